#include "tools/auto_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>

#include "core/error.h"
#include "engine/config_reader.h"
#include "tools/config_check.h"

// Note ["auto"]
// -------------
// The rules are the Hugging Face Trainer's, with the `trainer` section (its
// TrainingArguments, with its names and defaults) as the source:
//   train_micro_batch_size_per_gpu   trainer.per_device_train_batch_size
//   gradient_accumulation_steps      trainer.gradient_accumulation_steps
//   train_batch_size                 data-parallel size x micro-batch x
//                                    accumulation (the concrete values if
//                                    they are given; the data-parallel size
//                                    is the world size over pipeline.stages
//                                    and tensor_parallel.autotp_size where
//                                    the document gives them, as DeepSpeed
//                                    counts replicas)
//   gradient_clipping                trainer.max_grad_norm
//   optimizer.params lr, betas, eps, weight_decay
//                                    trainer.learning_rate, [adam_beta1,
//                                    adam_beta2], adam_epsilon, weight_decay
//   scheduler.params warmup_min_lr 0, warmup_max_lr trainer.learning_rate,
//                    warmup_num_steps trainer.warmup_steps (or
//                    ceil(warmup_ratio x run.steps)), total_num_steps
//                    run.steps
//   zero_optimization reduce_bucket_size hidden^2,
//                     stage3_prefetch_bucket_size 0.9 hidden^2,
//                     stage3_param_persistence_threshold 10 hidden
//                    (hidden: the model's hidden size, from the
//                    parsed model section or the folder's config.json);
//                    stage3_gather_16bit_weights_on_model_save false
//                    (Accelerate's zero3_save_16bit_model default)
//   bf16.enabled / fp16.enabled     trainer.bf16 / trainer.fp16 when given;
//                                    otherwise bf16 on (zinc runs bf16 on
//                                    every x86-64 CPU, natively where the CPU
//                                    has it) unless fp16 is enabled, and fp16
//                                    off.
// A config with a `trainer` section and no optimizer (or scheduler) section
// gets the Trainer's own: AdamW from its arguments, and its linear warmup and
// linear decay to 0 over run.steps (DeepSpeed's WarmupDecayLR).
// Resolution happens on the document before any parsing, so the parsed
// config, its checks and what a checkpoint stores are all the concrete
// values.

namespace zinc::tools {
namespace {

using nlohmann::json;
using namespace zinc::config;

bool is_auto(const json& v) { return v.is_string() && v.get_ref<const std::string&>() == "auto"; }

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// An integer the document gives at `key` of `obj`, if it holds one that fits
// in int64 (a larger one is left to the parser, which refuses it at its path).
std::optional<int64_t> int_at(const json& obj, const char* key) {
  if (!obj.is_object()) return std::nullopt;
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_number_integer()) return std::nullopt;
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
  return it->get<int64_t>();
}


// The data-parallel replicas train_batch_size counts: the ranks over the
// model-parallel degrees the document gives (where they divide the world;
// else the parser refuses them), and those ranks per replica.
std::pair<int64_t, int64_t> replicas_of(const json& d, int world_size) {
  const int64_t stages = d.contains("pipeline") ? int_at(d["pipeline"], "stages").value_or(1) : 1;
  const int64_t parts = d.contains("tensor_parallel") ? int_at(d["tensor_parallel"], "autotp_size").value_or(1) : 1;
  const int64_t seq = int_at(d, "sequence_parallel_size").value_or(1);
  const int64_t mp = stages >= 1 && parts >= 1 && seq >= 1 && stages * parts * seq <= world_size
                         ? stages * parts * seq : 1;
  return {world_size % mp == 0 ? world_size / mp : world_size, mp};
}

// Note [the Trainer's contradictions]: the Hugging Face Trainer fills each
// "auto" from its TrainingArguments and refuses a concrete DeepSpeed value
// that differs from the argument it would have filled it with
// (transformers' HfTrainerDeepSpeedConfig.fill_match), listing every
// difference and suggesting "auto". A config with a `trainer` section says
// it is such a run, so zinc refuses the same contradictions where the
// section sets an argument away from the Trainer's default. The Trainer
// holds the DeepSpeed values to its defaults too, given or not; zinc does
// not, because a zinc trainer section lists only what it sets, and the
// resolved config zinc writes back (--check, the run's config event, a
// checkpoint) lists every argument, defaults included, beside the concrete
// values: read back, a default must contradict nothing. A warmup from
// warmup_ratio is not held either: it follows run.steps, which a rerun of a
// resolved config may change. train_batch_size is held to the replicas x
// per_device_train_batch_size x gradient_accumulation_steps, as the
// Trainer computes it, where the section sets either.
void refuse_contradictions(const json& d, const TrainerConfig& t, int world_size) {
  const TrainerConfig defaults;
  auto same = [](const json& a, const json& b) {
    if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
    if (a.is_array() && b.is_array() && a.size() == b.size()) {
      for (size_t i = 0; i < a.size(); ++i)
        if (!a[i].is_number() || !b[i].is_number() || a[i].get<double>() != b[i].get<double>()) return false;
      return true;
    }
    return a == b;
  };
  std::vector<std::pair<std::string, std::string>> found;  // path, "VALUE against trainer.KEY VALUE"
  auto check = [&](const std::string& path, bool trainer_gives, const std::string& trainer_keys, const json& want) {
    const json* v = find_config_path(d, path);
    if (!trainer_gives || !v || is_auto(*v) || v->is_null()) return;
    // A value of another type is the parser's to refuse at its path.
    if (v->is_number() != want.is_number() || v->is_boolean() != want.is_boolean() || v->is_array() != want.is_array())
      return;
    if (v->is_array())
      for (const json& x : *v)
        if (!x.is_number()) return;
    if (!same(*v, want)) found.push_back({path, v->dump() + " against " + trainer_keys + " " + want.dump()});
  };
  // Whether the section sets the argument away from the Trainer's default.
  auto set = [&](auto TrainerConfig::*arg) { return t.*arg != defaults.*arg; };
  using T = TrainerConfig;
  check("train_micro_batch_size_per_gpu", set(&T::per_device_train_batch_size),
        "trainer.per_device_train_batch_size", t.per_device_train_batch_size);
  check("gradient_accumulation_steps", set(&T::gradient_accumulation_steps), "trainer.gradient_accumulation_steps",
        t.gradient_accumulation_steps);
  const int64_t replicas = replicas_of(d, world_size).first;
  const __int128 product =
      static_cast<__int128>(replicas) * t.per_device_train_batch_size * t.gradient_accumulation_steps;
  if (product <= INT64_MAX)
    check("train_batch_size", set(&T::per_device_train_batch_size) || set(&T::gradient_accumulation_steps),
          std::to_string(replicas) + (replicas == 1 ? " replica" : " replicas") +
              " x trainer.per_device_train_batch_size x trainer.gradient_accumulation_steps =",
          static_cast<int64_t>(product));
  check("gradient_clipping", set(&T::max_grad_norm), "trainer.max_grad_norm", t.max_grad_norm);
  check("optimizer.params.lr", set(&T::learning_rate), "trainer.learning_rate", t.learning_rate);
  check("optimizer.params.betas", set(&T::adam_beta1) || set(&T::adam_beta2), "trainer.adam_beta1, adam_beta2",
        json::array({t.adam_beta1, t.adam_beta2}));
  check("optimizer.params.eps", set(&T::adam_epsilon), "trainer.adam_epsilon", t.adam_epsilon);
  check("optimizer.params.weight_decay", set(&T::weight_decay), "trainer.weight_decay", t.weight_decay);
  check("scheduler.params.warmup_max_lr", set(&T::learning_rate), "trainer.learning_rate", t.learning_rate);
  check("scheduler.params.warmup_num_steps", set(&T::warmup_steps), "trainer.warmup_steps", t.warmup_steps);
  check("fp16.enabled", t.fp16 >= 0, "trainer.fp16", t.fp16 == 1);
  check("bf16.enabled", t.bf16 >= 0, "trainer.bf16", t.bf16 == 1);
  if (found.empty()) return;
  std::string msg = found[0].second;
  for (size_t i = 1; i < found.size(); ++i) msg += "; " + found[i].first + " " + found[i].second;
  throw ConfigError(found[0].first, msg + ": the config's trainer section contradicts " +
                                        (found.size() == 1 ? std::string("this value") : "these values") +
                                        " (the Hugging Face Trainer refuses such a config); make them agree, or "
                                        "set the DeepSpeed value to \"auto\"");
}

}  // namespace

TrainerConfig parse_trainer(const json& doc) {
  TrainerConfig t;
  if (!doc.is_object()) return t;
  std::vector<std::string> warnings;
  Reader root(doc, "", warnings);
  Reader r = root.section("trainer");
  r.get_int("per_device_train_batch_size", t.per_device_train_batch_size, at_least(1));
  r.get_int("gradient_accumulation_steps", t.gradient_accumulation_steps, at_least(1));
  r.get_number("learning_rate", t.learning_rate, at_least(0));
  r.get_number("adam_beta1", t.adam_beta1, closed(0, 1));
  r.get_number("adam_beta2", t.adam_beta2, closed(0, 1));
  r.get_number("adam_epsilon", t.adam_epsilon, above(0));
  r.get_number("weight_decay", t.weight_decay, at_least(0));
  r.get_number("max_grad_norm", t.max_grad_norm, at_least(0));
  // transformers 5's warmup_steps is the steps, or a float in (0, 1) the
  // share of them (its warmup_ratio is gone); transformers 4's warmup_ratio
  // is read too, and a share in warmup_steps wins over it, as a
  // warmup_steps above 0 does in transformers 4 (the share was once kept in
  // warmup_ratio, which a warmup_ratio of 0 beside it then overwrote).
  if (const json* w = r.find("warmup_steps"); w && w->is_number_float() && w->get<double>() > 0 && w->get<double>() < 1)
    t.warmup_share = w->get<double>();
  else
    r.get_int("warmup_steps", t.warmup_steps, at_least(0));
  r.get_number("warmup_ratio", t.warmup_ratio, closed(0, 1));
  // null: unset, as to_json writes it.
  for (auto [key, out] : {std::pair{"bf16", &t.bf16}, {"fp16", &t.fp16},
                          {"gradient_checkpointing", &t.gradient_checkpointing}}) {
    const json* v = r.find(key);
    if (v && !v->is_null()) *out = to_bool(*v, r.last_path()) ? 1 : 0;
  }
  r.finish();
  return t;
}

json to_json(const TrainerConfig& t) {
  auto tri = [](int v) { return v < 0 ? json(nullptr) : json(v == 1); };
  return {{"per_device_train_batch_size", t.per_device_train_batch_size},
          {"gradient_accumulation_steps", t.gradient_accumulation_steps},
          {"learning_rate", t.learning_rate},
          {"adam_beta1", t.adam_beta1},
          {"adam_beta2", t.adam_beta2},
          {"adam_epsilon", t.adam_epsilon},
          {"weight_decay", t.weight_decay},
          {"max_grad_norm", t.max_grad_norm},
          {"warmup_steps", t.warmup_share > 0 ? json(t.warmup_share) : json(t.warmup_steps)},
          {"warmup_ratio", t.warmup_ratio},
          {"bf16", tri(t.bf16)},
          {"fp16", tri(t.fp16)},
          {"gradient_checkpointing", tri(t.gradient_checkpointing)}};
}

ResolvedConfig resolve_auto(const json& doc, const AutoFacts& facts) {
  const TrainerConfig& t = facts.trainer;
  const int world_size = facts.world_size;
  ResolvedConfig out;
  out.doc = doc;
  if (!doc.is_object()) return out;
  json& d = out.doc;
  if (d.contains("trainer") && d["trainer"].is_object()) refuse_contradictions(d, t, world_size);
  auto set = [&](json& obj, const std::string& key, const std::string& path, const json& v, const std::string& why) {
    obj[key] = v;
    out.values.push_back({path, v, why});
  };
  auto auto_at = [](json& obj, const std::string& key) {
    return obj.is_object() && obj.contains(key) && is_auto(obj[key]);
  };

  // Batch triad: micro-batch and accumulation first, then the product.
  if (auto_at(d, "train_micro_batch_size_per_gpu"))
    set(d, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", t.per_device_train_batch_size,
        "trainer.per_device_train_batch_size");
  if (auto_at(d, "gradient_accumulation_steps"))
    set(d, "gradient_accumulation_steps", "gradient_accumulation_steps", t.gradient_accumulation_steps,
        "trainer.gradient_accumulation_steps");
  if (auto_at(d, "train_batch_size")) {
    const int64_t micro = int_at(d, "train_micro_batch_size_per_gpu").value_or(t.per_device_train_batch_size);
    const int64_t gas = int_at(d, "gradient_accumulation_steps").value_or(t.gradient_accumulation_steps);
    const auto [replicas, mp] = replicas_of(d, world_size);
    const std::string why = (replicas == world_size
                                 ? std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks")
                                 : std::to_string(replicas) + (replicas == 1 ? " replica" : " replicas") + " (" +
                                       std::to_string(world_size) + " ranks / " + std::to_string(mp) +
                                       " per replica)") +
                            " x micro-batch " + std::to_string(micro) + " x accumulation " + std::to_string(gas);
    // In 128 bits: the factors are any int64 the document gives.
    const __int128 product = static_cast<__int128>(micro) * gas * replicas;
    if (product > INT64_MAX || product < INT64_MIN)
      throw ConfigError("train_batch_size", "\"auto\" is " + why + ", which does not fit in a 64-bit integer");
    set(d, "train_batch_size", "train_batch_size", static_cast<int64_t>(product), why);
  }
  if (auto_at(d, "gradient_clipping"))
    set(d, "gradient_clipping", "gradient_clipping", t.max_grad_norm, "trainer.max_grad_norm");

  // No optimizer or scheduler section: the Trainer builds its own, AdamW
  // with a linear warmup and linear decay to 0 (DeepSpeed's WarmupDecayLR),
  // from its arguments. Only where a `trainer` section says to act as it.
  const bool trainer_given = d.contains("trainer") && d["trainer"].is_object();
  if (trainer_given && !d.contains("optimizer")) {
    d["optimizer"] = {{"type", "AdamW"},
                      {"params",
                       {{"lr", "auto"}, {"betas", "auto"}, {"eps", "auto"}, {"weight_decay", "auto"},
                        {"decay_norms_and_biases", false}}}};
    out.values.push_back({"optimizer.type", "AdamW",
                          "no optimizer section: the Trainer's own AdamW, without weight decay on biases and norm "
                          "weights"});
  }
  if (trainer_given && !d.contains("scheduler")) {
    // Linear, as the Trainer's default lr_scheduler_type (DeepSpeed's
    // default warmup_type is log).
    d["scheduler"] = {{"type", "WarmupDecayLR"},
                      {"params", {{"warmup_min_lr", "auto"}, {"warmup_max_lr", "auto"}, {"warmup_num_steps", "auto"},
                                  {"total_num_steps", "auto"}, {"warmup_type", "linear"}}}};
    out.values.push_back({"scheduler.type", "WarmupDecayLR",
                          "no scheduler section: the Trainer's own linear warmup and decay"});
  }
  if (d.contains("optimizer") && d["optimizer"].is_object() && d["optimizer"].contains("params")) {
    json& p = d["optimizer"]["params"];
    if (auto_at(p, "lr")) set(p, "lr", "optimizer.params.lr", t.learning_rate, "trainer.learning_rate");
    if (auto_at(p, "betas"))
      set(p, "betas", "optimizer.params.betas", json::array({t.adam_beta1, t.adam_beta2}),
          "trainer.adam_beta1, trainer.adam_beta2");
    if (auto_at(p, "eps")) set(p, "eps", "optimizer.params.eps", t.adam_epsilon, "trainer.adam_epsilon");
    if (auto_at(p, "weight_decay"))
      set(p, "weight_decay", "optimizer.params.weight_decay", t.weight_decay, "trainer.weight_decay");
  }

  const int64_t steps = facts.run_steps;
  if (d.contains("scheduler") && d["scheduler"].is_object() && d["scheduler"].contains("params")) {
    json& p = d["scheduler"]["params"];
    if (auto_at(p, "warmup_min_lr")) set(p, "warmup_min_lr", "scheduler.params.warmup_min_lr", 0.0, "0, as the Trainer sets it");
    if (auto_at(p, "warmup_max_lr"))
      set(p, "warmup_max_lr", "scheduler.params.warmup_max_lr", t.learning_rate, "trainer.learning_rate");
    if (auto_at(p, "warmup_num_steps")) {
      const bool from_share = t.warmup_share > 0;
      const double share = from_share ? t.warmup_share : t.warmup_ratio;
      if (!from_share && (t.warmup_steps > 0 || t.warmup_ratio == 0))
        set(p, "warmup_num_steps", "scheduler.params.warmup_num_steps", t.warmup_steps, "trainer.warmup_steps");
      else
        set(p, "warmup_num_steps", "scheduler.params.warmup_num_steps",
            // share <= 1 (parse_trainer), but 2^63 - 1 steps round up to 2^63 as a double
            static_cast<int64_t>(std::min(std::ceil(share * static_cast<double>(steps)), 9.2e18)),
            std::string("ceil(trainer.") + (from_share ? "warmup_steps " : "warmup_ratio ") + num(share) +
                " x run.steps " + std::to_string(steps) + ")");
    }
    // A run of 0 steps (a load-and-save) never steps the schedule; its length must still be >= 1.
    if (auto_at(p, "total_num_steps"))
      set(p, "total_num_steps", "scheduler.params.total_num_steps", std::max<int64_t>(steps, 1), "run.steps");
  }

  if (d.contains("zero_optimization") && d["zero_optimization"].is_object()) {
    json& z = d["zero_optimization"];
    const bool hidden_rule = auto_at(z, "reduce_bucket_size") || auto_at(z, "stage3_prefetch_bucket_size") ||
                             auto_at(z, "stage3_param_persistence_threshold");
    int64_t hidden = 0;
    std::string h;
    if (hidden_rule) {
      ZINC_CHECK(facts.hidden, "resolve_auto: no hidden size to size the ZeRO buckets from");
      const AutoFacts::Width w = facts.hidden();
      // hidden^2 must fit in an int64; a width that large (or below 1) is
      // refused at its path rather than sizing a bucket from it.
      if (w.hidden < 1 || w.hidden > 3037000499)
        throw ConfigError(w.path, "must be in [1, 3037000499] to size the \"auto\" ZeRO buckets from it "
                                  "(hidden^2), got " + std::to_string(w.hidden));
      hidden = w.hidden;
      h = " (" + w.source + ")";
    }
    if (auto_at(z, "reduce_bucket_size"))
      set(z, "reduce_bucket_size", "zero_optimization.reduce_bucket_size", hidden * hidden, "hidden^2" + h);
    if (auto_at(z, "stage3_prefetch_bucket_size"))
      set(z, "stage3_prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
          static_cast<int64_t>(0.9 * static_cast<double>(hidden * hidden)), "0.9 hidden^2" + h);
    if (auto_at(z, "stage3_param_persistence_threshold"))
      set(z, "stage3_param_persistence_threshold", "zero_optimization.stage3_param_persistence_threshold",
          10 * hidden, "10 hidden" + h);
    // Accelerate fills it from its zero3_save_16bit_model (default false);
    // it only decides what a model save writes, never the training.
    for (const char* key : {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"})
      if (auto_at(z, key))
        set(z, key, std::string("zero_optimization.") + key, false,
            "false, Accelerate's zero3_save_16bit_model default");
  }

  // Precision. fp16 first: whether it is on decides bf16's default.
  auto enabled = [&](const char* section) -> json* {
    if (!d.contains(section) || !d[section].is_object()) return nullptr;
    return d[section].contains("enabled") ? &d[section]["enabled"] : nullptr;
  };
  bool fp16_on = false;
  if (json* e = enabled("fp16")) {
    if (is_auto(*e)) {
      fp16_on = t.fp16 == 1;
      set(d["fp16"], "enabled", "fp16.enabled", fp16_on,
          t.fp16 >= 0 ? "trainer.fp16" : "off unless trainer.fp16 asks for it");
    } else {
      fp16_on = e->is_boolean() && e->get<bool>();
    }
  }
  // "bfloat16" is DeepSpeed's older spelling of the same section (transformers' ZeRO-3 bf16 template uses it).
  for (const char* section : {"bf16", "bfloat16"}) {
    if (json* e = enabled(section); e && is_auto(*e)) {
      const bool on = t.bf16 >= 0 ? t.bf16 == 1 : !fp16_on;
      set(d[section], "enabled", std::string(section) + ".enabled", on,
          t.bf16 >= 0 ? "trainer.bf16"
                      : fp16_on ? "off: fp16 is enabled"
                                : "on: zinc runs bf16 on every x86-64 CPU (natively where it has avx512_bf16)");
    }
  }
  // Without a `trainer` section the values above are TrainingArguments' defaults: say so.
  if (!trainer_given) {
    for (AutoValue& v : out.values) {
      if (v.source.rfind("trainer.", 0) == 0)
        v.source += " (the Trainer's default: the config has no trainer section)";
    }
  }
  return out;
}

}  // namespace zinc::tools
