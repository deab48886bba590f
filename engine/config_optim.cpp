// The optimizer and scheduler sections of the config (config.h): parsed
// straight into optim's own parameter structs (optim/optim.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/config.h"
#include "engine/config_reader.h"
#include "engine/config_sections.h"

namespace zinc::detail {

using namespace config;

namespace {

// The schedules that take a key, for messages ("WarmupLR, WarmupDecayLR").
std::string schedules_taking(const optim::ScheduleKey& k) {
  std::string out;
  for (SchedulerType t : {SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR, SchedulerType::kWarmupCosineLR,
                          SchedulerType::kOneCycle}) {
    if (k.takes(t)) out += (out.empty() ? "" : ", ") + std::string(scheduler_type_name(t));
  }
  return out;
}

// scheduler.params, from optim's key table: each key of the schedule's type
// with its bounds; a key of another type gets a precise message.
void parse_schedule_params(Reader& p, SchedulerConfig& s) {
  std::string own;
  for (const optim::ScheduleKey& k : optim::schedule_keys()) {
    if (k.takes(s.type)) own += (own.empty() ? "" : ", ") + std::string(k.name);
  }
  for (const optim::ScheduleKey& k : optim::schedule_keys()) {
    if (k.takes(s.type) || !p.has(k.name)) continue;
    throw ConfigError(p.path_of(k.name), std::string("not a ") + scheduler_type_name(s.type) + " parameter (used by " +
                                             schedules_taking(k) + "); " + scheduler_type_name(s.type) +
                                             " takes " + own);
  }
  for (const optim::ScheduleKey& k : optim::schedule_keys()) {
    if (!k.takes(s.type)) continue;
    const json* v = p.find(k.name);
    if (!v || (k.nullable && v->is_null())) {
      if (v) s.*k.integer = k.null_value;
      if (!v && k.required) {
        throw ConfigError(p.path_of(k.name),
                          std::string("required for ") + scheduler_type_name(s.type) + " (DeepSpeed has no default)");
      }
      continue;
    }
    const Range range{k.lo, k.hi, k.lo_open, k.hi_open};
    if (k.number) s.*k.number = to_number(*v, p.last_path(), range);
    if (k.integer) s.*k.integer = to_int(*v, p.last_path(), range);
    if (k.flag) s.*k.flag = to_bool(*v, p.last_path());
    if (k.warmup) {
      std::vector<std::pair<std::string, WarmupType>> names;
      for (WarmupType w : {WarmupType::kLog, WarmupType::kLinear}) names.emplace_back(optim::warmup_type_name(w), w);
      p.get_enum<WarmupType>(k.name, s.*k.warmup, names);
    }
  }
}

// The update runs in fp32 and takes 1 - beta as 1 - float(beta), as
// DeepSpeed's CPU Adam does (the bits stay its bits). A beta within 2^-25
// of 1 is 1 there: its moment would never move (the second moment stuck at
// 0 makes each step lr * m / eps, and the run blows up without a NaN), so
// it is refused. Nearer 1 than about 3e-6, 1 - beta is off by more than
// 1% (19% at 1 - 1e-7): said.
void check_fp32_beta(Reader& p, const std::string& path, double beta, const std::string& given) {
  const double in_fp32 = 1.0 - static_cast<double>(static_cast<float>(beta));
  if (in_fp32 <= 0.0)
    throw ConfigError(path, given + " is 1 in fp32, the precision of the optimizer's update, where its moment "
                            "would never change; at most 0.99999994 (1 - 2^-24)");
  const double off = std::abs(in_fp32 - (1.0 - beta)) / (1.0 - beta);
  if (off > 0.01)
    p.warn(path, given + ": 1 - beta is " + num(in_fp32) + " in fp32, the precision of the optimizer's update, " +
                     std::to_string(static_cast<int>(std::lround(100.0 * off))) + "% off " + num(1.0 - beta));
}

// The keys DeepSpeed reads but that change nothing: warned about.
void warn_ignored_schedule_keys(Reader& p) {
  int64_t last = -1;
  if (p.get_int("last_batch_iteration", last, at_least(-1)) && last != -1) {
    p.warn_ignored(p.last_path(), "the schedule's position comes from the checkpoint when a run resumes");
  }
  // (OneCycle's stair counts are schedule keys in optim's table: they shape the cycle.)
}

// Settings that parse but probably are not what was meant.
void warn_odd_schedule(Reader& p, const SchedulerConfig& s) {
  if (s.type == SchedulerType::kOneCycle) {
    if (s.cycle_min_lr > s.cycle_max_lr) {
      p.warn(p.path_of("cycle_min_lr"), num(s.cycle_min_lr) + " is above cycle_max_lr " + num(s.cycle_max_lr) +
                                            "; the lr falls in the first half of the cycle and rises in the second");
    }
    if (s.cycle_momentum && s.decay_step_size > 0 && s.decay_mom_rate > 0) {
      p.warn(p.path_of("decay_mom_rate"), "beta1 grows after the cycle (cycle_max_mom * (1 + decay_mom_rate * "
                                          "steps / decay_step_size), as in DeepSpeed); a training step whose beta1 "
                                          "reaches 1 is an error");
    }
    return;
  }
  const bool decays = s.type != SchedulerType::kWarmupLR;
  if (decays && s.total_num_steps < s.warmup_num_steps) {
    p.warn(p.path_of("total_num_steps"), std::to_string(s.total_num_steps) + " is less than warmup_num_steps " +
                                             std::to_string(s.warmup_num_steps) +
                                             "; the lr drops to its floor right after warmup");
  }
  if (s.type != SchedulerType::kWarmupCosineLR && s.warmup_min_lr > s.warmup_max_lr) {
    p.warn(p.path_of("warmup_min_lr"), num(s.warmup_min_lr) + " is above warmup_max_lr " + num(s.warmup_max_lr) +
                                           "; the lr decreases during warmup");
  }
}

// The keys DeepSpeed's classes take (their constructors' arguments).
const std::vector<std::string>& onebit_key_list(OptimizerType t) {
  static const std::vector<std::string> adam = {"lr", "freeze_step", "bias_correction", "betas", "eps",
                                                "eps_inside_sqrt", "weight_decay", "max_grad_norm", "amsgrad",
                                                "cuda_aware", "comm_backend_name"};
  static const std::vector<std::string> zero_one = {
      "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
      "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "amsgrad", "cuda_aware",
      "comm_backend_name"};
  static const std::vector<std::string> lamb = {
      "lr", "freeze_step", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_grad_norm",
      "max_coeff", "min_coeff", "amsgrad", "cuda_aware", "comm_backend_name", "coeff_beta", "factor_max",
      "factor_min", "factor_threshold"};
  return t == OptimizerType::kZeroOneAdam ? zero_one : t == OptimizerType::kOneBitLamb ? lamb : adam;
}
bool onebit_takes(OptimizerType t, const std::string& key) {
  const std::vector<std::string>& ks = onebit_key_list(t);
  return std::find(ks.begin(), ks.end(), key) != ks.end();
}
// A key of some optimizer zinc knows (another one's: a precise message; a
// typo falls through to "unknown key" with its nearest match).
bool onebit_family_key(const std::string& key) {
  for (OptimizerType t : {OptimizerType::kOneBitAdam, OptimizerType::kZeroOneAdam, OptimizerType::kOneBitLamb})
    if (onebit_takes(t, key)) return true;
  return key == "adam_w_mode" || key == "torch_adam" || key == "set_grad_none";
}
std::string onebit_keys(OptimizerType t) {
  std::string out = std::string("DeepSpeed's ") +
                    (t == OptimizerType::kZeroOneAdam ? "ZeroOneAdam" : t == OptimizerType::kOneBitLamb ? "OnebitLamb" : "OnebitAdam") +
                    " takes ";
  const std::vector<std::string>& ks = onebit_key_list(t);
  for (size_t i = 0; i < ks.size(); ++i) out += (i ? ", " : "") + ks[i];
  return out;
}

// OneBitAdam's and ZeroOneAdam's own keys, after the ones they share with Adam. DeepSpeed's
// update has no bias correction and decoupled weight decay whatever the
// config says (Note [1-bit Adam] in engine/update_onebit.cpp).
void parse_onebit(Reader& p, OptimizerConfig& o) {
  OneBitConfig& b = o.onebit;
  const char* ds_name = o.type == OptimizerType::kZeroOneAdam  ? "ZeroOneAdam"
                        : o.type == OptimizerType::kOneBitLamb ? "OnebitLamb"
                                                               : "OnebitAdam";
  if (const json* bc = p.find("bias_correction"); bc && bc->is_boolean() && bc->get<bool>()) {
    p.warn(p.path_of("bias_correction"), std::string("true has no effect: DeepSpeed's ") + ds_name +
                                             " applies no bias correction whatever it says, and zinc follows it");
  }
  o.adam.bias_correction = false;
  o.adam.adam_w_mode = true;
  o.lamb.bias_correction = false;
  o.lamb.eps_inside_sqrt = false;
  if (o.type == OptimizerType::kOneBitLamb) {
    optim::LambParams& l = o.lamb;
    p.get_number("max_coeff", l.max_coeff, above(0));
    p.get_number("min_coeff", l.min_coeff, above(0));
    if (l.min_coeff > l.max_coeff)
      throw ConfigError(p.path_of("min_coeff"), "must be <= max_coeff " + num(l.max_coeff) + ", got " + num(l.min_coeff));
    p.get_number("coeff_beta", b.coeff_beta, lo_closed(0, 1));
    p.get_number("factor_max", b.factor_max, above(0));
    p.get_number("factor_min", b.factor_min, above(0));
    p.get_number("factor_threshold", b.factor_threshold, at_least(0));
    if (b.factor_min > b.factor_max)
      throw ConfigError(p.path_of("factor_min"),
                        "must be <= factor_max " + num(b.factor_max) + ", got " + num(b.factor_min));
  }
  if (o.type == OptimizerType::kZeroOneAdam) {
    p.get_int("var_freeze_step", b.var_freeze_step, at_least(1));
    p.get_int("var_update_scaler", b.var_update_scaler, at_least(1));
    p.get_int("local_step_scaler", b.local_step_scaler, at_least(1));
    p.get_int("local_step_clipper", b.local_step_clipper, at_least(1));
  } else {
    p.get_int("freeze_step", b.freeze_step, at_least(1));
  }
  p.get_bool("cuda_aware", b.cuda_aware);
  if (const json* v = p.find("comm_backend_name")) {
    const std::string name = to_string(*v, p.last_path());
    if (name != "nccl" && name != "mpi" && name != "compressed") {
      throw ConfigError(p.last_path(), show(*v) + (name == "hccl" ? " (Ascend NPUs) is not a transport zinc has"
                                                                  : " is not one of DeepSpeed's")
                                           + "; use \"nccl\", \"mpi\" or \"compressed\" (on CPU ranks each "
                                             "maps to zinc's comm.backend)");
    }
    b.comm_backend_name = name;
  }
  bool inside = false;
  if (p.get_bool("eps_inside_sqrt", inside) && inside) {
    p.warn(p.last_path(), std::string("true has no effect: DeepSpeed's ") + ds_name +
                              " adds eps outside the square root whatever it says, and zinc follows it");
  }
  double max_grad_norm = 0;
  if (p.get_number("max_grad_norm", max_grad_norm, at_least(0)) && max_grad_norm > 0) {
    p.warn(p.last_path(), std::string("has no effect (DeepSpeed's ") + ds_name +
                              " stores it and never reads it); clip with the top-level gradient_clipping");
  }
  const std::string no_amsgrad =
      std::string(ds_name) + " does not support the AMSGrad variant; remove it or set it to false";
  p.refuse_bool("amsgrad", false, no_amsgrad.c_str());
}

}  // namespace

void parse_optimizer(config::Reader& root, OptimizerConfig& o) {
  Reader r = root.section("optimizer");
  if (!r.given()) return;
  const json* t = r.find("type");
  if (!t || t->is_null()) {
    throw ConfigError("optimizer.type", "missing; set \"Adam\", \"AdamW\" or \"Lamb\" (zinc has no client optimizer)");
  }
  std::string type = to_string(*t, "optimizer.type");
  if (lower(type) == "adam") {
    o.type = OptimizerType::kAdam;
  } else if (lower(type) == "adamw") {
    o.type = OptimizerType::kAdamW;
  } else if (lower(type) == "lamb") {
    o.type = OptimizerType::kLamb;
  } else if (lower(type) == "onebitadam") {
    o.type = OptimizerType::kOneBitAdam;
  } else if (lower(type) == "zerooneadam") {
    o.type = OptimizerType::kZeroOneAdam;
  } else if (lower(type) == "onebitlamb") {
    o.type = OptimizerType::kOneBitLamb;
  } else {
    // DeepSpeed's other built-in optimizers (lower case, as it compares them).
    static const std::vector<std::string> kDeepSpeedOnly = {"adagrad", "lion", "muadam", "muadamw", "musgd", "muon"};
    std::string msg = show(*t) + " is not implemented in zinc; supported: Adam, AdamW, Lamb, OneBitAdam, "
                                 "ZeroOneAdam, OneBitLamb";
    bool ds_known =
        std::find(kDeepSpeedOnly.begin(), kDeepSpeedOnly.end(), lower(type)) != kDeepSpeedOnly.end();
    std::string near = ds_known ? "" : did_you_mean(type, {"Adam", "AdamW", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"});
    if (!near.empty()) msg += " (did you mean '" + near + "'?)";
    throw ConfigError("optimizer.type", msg);
  }
  const bool lamb = o.type == OptimizerType::kLamb;  // OneBitLamb is parsed with the 1-bit optimizers
  const bool onebit = o.one_bit();
  r.ignore_bool("legacy_fusion", false);

  Reader p = r.section("params");
  // Keys of the other family get a precise message rather than "unknown key".
  if (lamb) {
    for (const char* k : {"adam_w_mode", "torch_adam", "set_grad_none"}) {
      if (p.has(k)) {
        throw ConfigError(p.path_of(k), std::string("an Adam parameter; Lamb (DeepSpeed's FusedLamb) has no ") + k +
                                            " (its weight decay is always part of the trust-ratio update)");
      }
    }
  } else if (onebit) {
    for (const std::string& k : p.keys()) {
      if (onebit_family_key(k) && !onebit_takes(o.type, k)) {
        throw ConfigError(p.path_of(k), std::string("not a ") + optimizer_type_name(o.type) +
                                            " parameter (" + onebit_keys(o.type) + ")");
      }
    }
  } else {
    for (const char* k : {"max_coeff", "min_coeff", "eps_inside_sqrt", "max_grad_norm"}) {
      if (p.has(k)) {
        throw ConfigError(p.path_of(k), std::string("a Lamb parameter; type ") + optimizer_type_name(o.type) +
                                            " does not take it");
      }
    }
  }
  // The keys Adam and Lamb share, into the struct of the section's type.
  auto shared = [&](auto& x) {
    p.get_number("lr", x.lr, above(0));
    if (const json* b = p.find("betas")) {
      if (!b->is_array() || b->size() != 2) {
        type_error(p.last_path(), "a list of two numbers [beta1, beta2]", *b);
      }
      x.beta1 = to_number((*b)[0], p.last_path() + "[0]", lo_closed(0, 1));
      x.beta2 = to_number((*b)[1], p.last_path() + "[1]", lo_closed(0, 1));
      check_fp32_beta(p, p.last_path() + "[0]", x.beta1, (*b)[0].dump());
      check_fp32_beta(p, p.last_path() + "[1]", x.beta2, (*b)[1].dump());
    }
    p.get_number("eps", x.eps, above(0));
    p.get_number("weight_decay", x.weight_decay, at_least(0));
    p.get_bool("bias_correction", x.bias_correction);
  };
  if (lamb) {
    optim::LambParams& l = o.lamb;
    shared(l);
    p.get_number("max_coeff", l.max_coeff, above(0));
    p.get_number("min_coeff", l.min_coeff, above(0));
    p.get_bool("eps_inside_sqrt", l.eps_inside_sqrt);
    double max_grad_norm = 0;
    if (p.get_number("max_grad_norm", max_grad_norm, at_least(0)) && max_grad_norm > 0) {
      throw ConfigError(p.last_path(),
                        "per-tensor clipping inside FusedLamb is not implemented (DeepSpeed's engine never "
                        "passes it the norms it needs); use the top-level gradient_clipping, got " +
                            show(*p.find("max_grad_norm")));
    }
    if (l.min_coeff > l.max_coeff) {
      throw ConfigError(p.path_of("min_coeff"),
                        "must be <= max_coeff " + num(l.max_coeff) + ", got " + num(l.min_coeff));
    }
    p.refuse_bool("amsgrad", false, "FusedLamb does not support the AMSGrad variant; remove it or set it to false");
    p.finish();
    r.finish();
    return;
  }
  if (o.type == OptimizerType::kOneBitLamb)
    shared(o.lamb);
  else
    shared(o.adam);
  if (onebit) {
    parse_onebit(p, o);
    p.finish();
    r.finish();
    return;
  }
  bool w_mode = o.adam.adam_w_mode;
  bool has_w_mode = p.get_bool("adam_w_mode", w_mode);
  if (o.type == OptimizerType::kAdamW) {
    // As in DeepSpeed, type AdamW means decoupled weight decay whatever adam_w_mode says.
    if (has_w_mode && !w_mode) {
      p.warn(p.path_of("adam_w_mode"),
             "false is overridden by type \"AdamW\" (as in DeepSpeed); use type \"Adam\" for L2-style decay");
    }
    o.adam.adam_w_mode = true;
  } else {
    o.adam.adam_w_mode = w_mode;
  }
  // torch_adam: DeepSpeed's engine builds torch.optim.AdamW (or Adam) from
  // the keys given. Its update is DeepSpeed's own, but torch's AdamW decays
  // by 0.01 where weight_decay is not given (DeepSpeed's Adam: 0), and it
  // takes no bias_correction (DeepSpeed then fails building it).
  bool torch_adam = false;
  p.get_bool("torch_adam", torch_adam);
  if (torch_adam && o.adam.adam_w_mode && !p.find("weight_decay")) o.adam.weight_decay = 0.01;
  if (torch_adam && p.find("bias_correction") && !o.adam.bias_correction)
    p.refuse(p.path_of("bias_correction"), "false with torch_adam: torch's Adam always corrects the bias (DeepSpeed "
                                           "fails building it with bias_correction); remove one of them");
  // zinc's own key (OptimizerConfig::decay_vectors): false leaves biases and
  // norm weights undecayed, as the Hugging Face Trainer's AdamW does.
  p.get_bool("decay_norms_and_biases", o.decay_vectors);
  bool unused = false;
  p.get_bool("set_grad_none", unused);  // FusedAdam option; zinc zeroes gradient buffers itself
  p.refuse_bool("amsgrad", false, "AMSGrad changes the update rule; remove it or set it to false");
  p.finish();
  r.finish();
}


void parse_scheduler(config::Reader& root, SchedulerConfig& s) {
  Reader r = root.section("scheduler");
  if (!r.given()) return;
  const json* t = r.find("type");
  if (!t || t->is_null()) {
    throw ConfigError(
        "scheduler.type",
        "missing; set WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle (or remove 'scheduler' for a constant lr)");
  }
  if (t->is_string() && *t == "LRRangeTest") {
    throw ConfigError("scheduler.type", show(*t) +
                                            " is not implemented in zinc; supported: WarmupLR, WarmupDecayLR, "
                                            "WarmupCosineLR, OneCycle");
  }
  std::vector<std::pair<std::string, SchedulerType>> types;
  for (SchedulerType k : {SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR, SchedulerType::kWarmupCosineLR,
                          SchedulerType::kOneCycle}) {
    types.emplace_back(scheduler_type_name(k), k);
  }
  r.get_enum<SchedulerType>("type", s.type, types);
  Reader p = r.section("params");
  parse_schedule_params(p, s);
  warn_ignored_schedule_keys(p);
  p.finish();
  r.finish();
  warn_odd_schedule(p, s);
}

}  // namespace zinc::detail
