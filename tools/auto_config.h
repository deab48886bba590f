// zinc tools: "auto" values in a ds_config, resolved before the config is
// parsed (Note ["auto"] in auto_config.cpp).
//
// Configs written for the Hugging Face Trainer leave values as "auto" for the
// Trainer to fill in from its TrainingArguments. zinc's `trainer` section is
// where those arguments live here (with the Trainer's names and defaults),
// and resolve_auto() fills every "auto" it has a rule for, saying where each
// value came from. An "auto" without a rule stays, and the config's parser
// reports it at its path.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace zinc::tools {

// The `trainer` section: the TrainingArguments that "auto" values come from
// (Hugging Face's names and defaults).
struct TrainerConfig {
  int64_t per_device_train_batch_size = 8;
  int64_t gradient_accumulation_steps = 1;
  double learning_rate = 5e-5;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_epsilon = 1e-8;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;  // used when warmup_steps is 0: ceil(ratio x run.steps)
  // warmup_steps given as a float in (0, 1), transformers 5's share of the
  // steps: ceil(share x run.steps), over warmup_ratio (0: not given so).
  double warmup_share = 0.0;
  // Precision: unset means "from the CPU and the rest of the config" (bf16,
  // which zinc runs on every CPU, unless fp16 is asked for).
  int bf16 = -1, fp16 = -1;  // -1 unset, 0 false, 1 true
  // Activation checkpointing for the built-in GPT (TrainingArguments'
  // gradient_checkpointing, default false): -1 unset, 0 false, 1 true. Not an
  // "auto" rule: ExperimentConfig::parse combines it with
  // model.gradient_checkpointing.
  int gradient_checkpointing = -1;

  bool operator==(const TrainerConfig&) const = default;
};

// The `trainer` section with every key (bf16 / fp16 null when unset);
// parse_trainer reads it back to the same values.
nlohmann::json to_json(const TrainerConfig& t);

// One value that was "auto": its JSON path, what it became and why.
struct AutoValue {
  std::string path;
  nlohmann::json value;
  std::string source;  // e.g. "trainer.learning_rate", "model.n_embd^2 (n_embd 384)"
};

struct ResolvedConfig {
  nlohmann::json doc;
  std::vector<AutoValue> values;
};

// Parses the `trainer` section of `doc` strictly (unknown keys are errors
// with "did you mean"). Throws ConfigError.
TrainerConfig parse_trainer(const nlohmann::json& doc);

// What the rules take from outside the DeepSpeed keys, read once by
// parse_experiment from the parsed sections (never from the document again).
struct AutoFacts {
  int world_size = 1;      // train_batch_size's product
  TrainerConfig trainer;   // the `trainer` section, parse_trainer(doc)
  int64_t run_steps = 0;   // run.steps: the schedule's length and warmup_ratio's base
  // The model's hidden size for the ZeRO bucket rules (the Trainer's
  // model.config.hidden_size): its value, the JSON path that sets it
  // ("model.n_embd") and where it came from ("model.n_embd 64"). Called only
  // when one of those keys is "auto": for a model folder it reads its
  // config.json.
  struct Width {
    int64_t hidden = 0;
    std::string path, source;
  };
  std::function<Width()> hidden;
};

// `doc` with every "auto" that has a rule replaced. Throws ConfigError.
ResolvedConfig resolve_auto(const nlohmann::json& doc, const AutoFacts& facts);

}  // namespace zinc::tools
