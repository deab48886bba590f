// The optimizer and scheduler sections of the config (config.h): parsed
// straight into optim's own parameter structs (optim/optim.h).
#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/config.h"
#include "engine/config_reader.h"
#include "engine/config_sections.h"

namespace zinc::detail {

using namespace config;

namespace {

// OneCycle's params (DeepSpeed's names and defaults; cycle_min_lr and
// cycle_max_lr have none there either).
void parse_one_cycle(Reader& p, SchedulerConfig& s) {
  for (const char* k : {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
                        "warmup_min_ratio", "cos_min_ratio"}) {
    if (p.has(k)) {
      throw ConfigError(p.path_of(k), "a Warmup* schedule's parameter; OneCycle takes cycle_min_lr, cycle_max_lr, "
                                      "cycle_first_step_size, cycle_second_step_size, decay_step_size, "
                                      "decay_lr_rate and the momentum keys");
    }
  }
  for (const char* k : {"cycle_min_lr", "cycle_max_lr"}) {
    if (!p.has(k)) throw ConfigError(p.path_of(k), "required for OneCycle (DeepSpeed has no default)");
  }
  p.get_number("cycle_min_lr", s.cycle_min_lr, at_least(0));
  p.get_number("cycle_max_lr", s.cycle_max_lr, at_least(0));
  p.get_number("decay_lr_rate", s.decay_lr_rate, at_least(0));
  p.get_int("cycle_first_step_size", s.cycle_first_step_size, at_least(1));
  const json* second = p.find("cycle_second_step_size");
  if (second && !second->is_null()) s.cycle_second_step_size = to_int(*second, p.last_path(), at_least(1));
  // DeepSpeed stores the stair counts but never reads them: no effect there either.
  for (const char* k : {"cycle_first_stair_count", "cycle_second_stair_count"}) {
    const json* v = p.find(k);
    if (!v || v->is_null()) continue;
    if (to_int(*v, p.last_path(), at_least(0)) != 0) {
      p.warn_ignored(p.last_path(), "DeepSpeed's OneCycle stores it but never uses it; the cycle is not a staircase there either");
    }
  }
  p.get_int("decay_step_size", s.decay_step_size, at_least(0));
  p.get_bool("cycle_momentum", s.cycle_momentum);
  p.get_number("cycle_min_mom", s.cycle_min_mom, lo_closed(0, 1));
  p.get_number("cycle_max_mom", s.cycle_max_mom, lo_closed(0, 1));
  p.get_number("decay_mom_rate", s.decay_mom_rate, at_least(0));
  int64_t last = -1;
  if (p.get_int("last_batch_iteration", last, at_least(-1)) && last != -1) {
    p.warn_ignored(p.last_path(), "the schedule's position comes from the checkpoint when a run resumes");
  }
  if (s.cycle_min_lr > s.cycle_max_lr) {
    p.warn(p.path_of("cycle_min_lr"), num(s.cycle_min_lr) + " is above cycle_max_lr " + num(s.cycle_max_lr) +
                                          "; the lr falls in the first half of the cycle and rises in the second");
  }
  if (s.cycle_momentum && s.decay_step_size > 0 && s.decay_mom_rate > 0) {
    p.warn(p.path_of("decay_mom_rate"), "beta1 grows after the cycle (cycle_max_mom * (1 + decay_mom_rate * "
                                        "steps / decay_step_size), as in DeepSpeed); a training step whose beta1 "
                                        "reaches 1 is an error");
  }
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
  } else {
    // DeepSpeed's other built-in optimizers (lower case, as it compares them).
    static const std::vector<std::string> kDeepSpeedOnly = {"adagrad",    "onebitadam", "zerooneadam",
                                                            "onebitlamb", "lion",       "muadam",
                                                            "muadamw",    "musgd",      "muon"};
    std::string msg = show(*t) + " is not implemented in zinc; supported: Adam, AdamW, Lamb";
    bool ds_known =
        std::find(kDeepSpeedOnly.begin(), kDeepSpeedOnly.end(), lower(type)) != kDeepSpeedOnly.end();
    std::string near = ds_known ? "" : did_you_mean(type, {"Adam", "AdamW", "Lamb"});
    if (!near.empty()) msg += " (did you mean '" + near + "'?)";
    throw ConfigError("optimizer.type", msg);
  }
  const bool lamb = o.type == OptimizerType::kLamb;
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
  shared(o.adam);
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
  bool unused = false;
  p.get_bool("torch_adam", unused);     // torch's and DeepSpeed's Adam compute the same update
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
  const std::string name =
      to_choice(*t, "scheduler.type", {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"}, false);
  if (name == "OneCycle") {
    s.type = SchedulerType::kOneCycle;
    Reader p = r.section("params");
    parse_one_cycle(p, s);
    p.finish();
    r.finish();
    return;
  }
  s.type = name == "WarmupLR"        ? SchedulerType::kWarmupLR
           : name == "WarmupDecayLR" ? SchedulerType::kWarmupDecayLR
                                     : SchedulerType::kWarmupCosineLR;
  const bool cosine = s.type == SchedulerType::kWarmupCosineLR;
  const bool decays = s.type != SchedulerType::kWarmupLR;

  Reader p = r.section("params");
  // Keys that belong to another of the three schedules get a precise message.
  for (const char* k : {"warmup_min_lr", "warmup_max_lr"}) {
    if (cosine && p.has(k)) {
      throw ConfigError(p.path_of(k),
                        "not a WarmupCosineLR parameter: it scales the optimizer's lr by "
                        "warmup_min_ratio and cos_min_ratio instead");
    }
  }
  for (const char* k : {"warmup_min_ratio", "cos_min_ratio"}) {
    if (!cosine && p.has(k)) throw ConfigError(p.path_of(k), std::string("only used by WarmupCosineLR, not ") + scheduler_type_name(s.type));
  }
  if (!decays && p.has("total_num_steps")) {
    throw ConfigError(p.path_of("total_num_steps"),
                      "not a WarmupLR parameter (WarmupLR holds the lr after warmup); use WarmupDecayLR or "
                      "WarmupCosineLR to decay");
  }
  if (cosine) {
    p.get_number("warmup_min_ratio", s.warmup_min_ratio, closed(0, 1));
    p.get_number("cos_min_ratio", s.cos_min_ratio, closed(0, 1));
  } else {
    p.get_number("warmup_min_lr", s.warmup_min_lr, at_least(0));
    p.get_number("warmup_max_lr", s.warmup_max_lr, at_least(0));
  }
  p.get_int("warmup_num_steps", s.warmup_num_steps, at_least(0));
  p.get_enum<WarmupType>("warmup_type", s.warmup_type, {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}});
  bool has_total = decays && p.get_int("total_num_steps", s.total_num_steps, at_least(1));
  int64_t last = -1;
  if (p.get_int("last_batch_iteration", last, at_least(-1)) && last != -1) {
    p.warn_ignored(p.last_path(), "the schedule's position comes from the checkpoint when a run resumes");
  }
  p.finish();
  r.finish();

  if (decays && !has_total) {
    throw ConfigError("scheduler.params.total_num_steps",
                      std::string("required for ") + scheduler_type_name(s.type) + " (the step at which the decay ends)");
  }
  if (has_total && s.total_num_steps < s.warmup_num_steps) {
    p.warn("scheduler.params.total_num_steps",
           std::to_string(s.total_num_steps) + " is less than warmup_num_steps " +
               std::to_string(s.warmup_num_steps) + "; the lr drops to its floor right after warmup");
  }
  if (!cosine && s.warmup_min_lr > s.warmup_max_lr) {
    p.warn("scheduler.params.warmup_min_lr", num(s.warmup_min_lr) + " is above warmup_max_lr " +
                                                 num(s.warmup_max_lr) + "; the lr decreases during warmup");
  }
}

}  // namespace zinc::detail
