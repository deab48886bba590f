// zinc tools: the experiment sections of a config, `model`, `data`, `run` and
// `comm`, which zinc-train (and zinc-bench, and the tests) read beside the
// DeepSpeed sections that the engine's zinc::Config parses.
//
// One document holds both. parse_experiment() parses it whole: the engine's
// sections through Config::parse, told that ExperimentConfig::sections() are
// the caller's (so an unknown or misspelt top-level key is still an error,
// with "did you mean"), then these four through ExperimentConfig::parse, with
// the same strictness and the same kind of messages (engine/config_reader.h).
// Plain data; thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/data.h"
#include "engine/config.h"
#include "models/family.h"
#include "models/models.h"
#include "tools/auto_config.h"

namespace zinc::tools {

// The `model` section: which family (models/family.h) and its sizes, or a
// Hugging Face folder to start from.
struct ModelConfig {
  std::string type = "gpt";  // a family's name (models::families(): gpt, mlp, llama)
  int64_t vocab_size = 0;    // 0 = take the data source's vocabulary
  // Recompute each layer's activations in backward instead of keeping them
  // (the family's config: less activation memory for about one extra
  // forward per step; bit-identical gradients). On when
  // model.gradient_checkpointing or trainer.gradient_checkpointing is true;
  // both given with different values is an error naming both. A family
  // that cannot (the mlp) refuses it.
  bool gradient_checkpointing = false;
  // Without from_pretrained: the family's own keys, read by the family
  // (Family::from_section; their defaults are its config struct's), and
  // the data's vocabulary and sequence length not yet applied (that is
  // build_experiment's FamilyConfig::fit_data).
  struct Settings {
    std::shared_ptr<const models::FamilyConfig> model = models::section_defaults(*models::family_named("gpt"));
    bool operator==(const Settings& o) const {
      return (model == nullptr) == (o.model == nullptr) &&
             (!model || (&model->family() == &o.model->family() && model->section_json() == o.model->section_json()));
    }
  } settings;
  // A Hugging Face model folder (config.json + safetensors) to start from:
  // the architecture picks the family, config.json gives the sizes and the
  // weights the initial values (tools/hf_model.h). A size key given here
  // too must agree with config.json (given_values holds them).
  std::string from_pretrained;
  nlohmann::json given_values = nlohmann::json::object();
  // LoRA (model.lora, PEFT's LoraConfig keys): adapters on the model, its
  // base frozen; or model.adapter, a PEFT adapter folder to start from (its
  // adapter_config.json is the configuration; from_pretrained only).
  models::LoraConfig lora;
  std::string adapter;
  // Under LoRA, keep the frozen base's layer weights packed for the
  // matmuls where the engine holds them in place (ZeRO stages 0-2; Note
  // [packed frozen weights] in kernels/matmul.cpp): model.pack_frozen_weights,
  // default true; false saves the two packed copies for slower products.
  bool pack_frozen_weights = true;
  // The LoRA configuration the model is built with: `from` (model.lora, or
  // the adapter folder's) with pack_frozen_weights.
  models::LoraConfig built_lora(models::LoraConfig from) const {
    from.pack_base = pack_frozen_weights;
    return from;
  }
  // The keys the section gave (for that check). Not a setting: equal
  // configs may have come from documents that spelt defaults out or not.
  struct GivenKeys : std::vector<std::string> {
    bool operator==(const GivenKeys&) const { return true; }
  } given;

  // The model's family: `type`'s (parse_model checked it is registered).
  const models::Family& family() const;

  bool operator==(const ModelConfig&) const = default;
};

// The `run` section: how long and what to log/save.
struct RunConfig {
  int64_t steps = 100;       // optimizer steps
  uint64_t seed = 42;        // model init (Config::seed) and data order
  int64_t eval_interval = 0; // 0 = no evaluation
  int64_t eval_batches = 4;
  int64_t checkpoint_interval = 0;  // 0 = none; else every N steps and at the end
  std::string output_dir = "runs/default";
  std::string checkpoint_dir;  // "" = output_dir + "/checkpoints"
  int64_t keep_last = 0;       // 0 = keep every checkpoint; else the newest N (older ones go once a newer is complete)

  bool operator==(const RunConfig&) const = default;
};

// The transport between ranks: the spellings comm::make_communicator takes.
enum class CommBackend { kAuto, kMpi, kShm, kHierarchical };
const char* comm_backend_name(CommBackend b);  // "auto" | "mpi" | "shm" | "hierarchical"

// The `comm` section: how ranks talk.
struct CommConfig {
  // "auto": shared memory between the ranks of one machine, hierarchical
  // (shared memory inside machines, MPI between them) across machines;
  // "mpi", "shm", "hierarchical" force one (for comparison). The environment
  // variable ZINC_COMM_BACKEND overrides it.
  CommBackend backend = CommBackend::kAuto;
  // The longest a shared-memory collective waits for another rank before it
  // fails with an error naming that rank (ZINC_COMM_TIMEOUT overrides it).
  double timeout_seconds = 600;

  bool operator==(const CommConfig&) const = default;
};

struct ExperimentConfig {
  ModelConfig model;
  DataConfig data;  // the `data` section (data/data.h)
  RunConfig run;
  CommConfig comm;
  // The `trainer` section (TrainingArguments' names), read once: "auto"
  // values resolve from it (resolve_auto), gradient checkpointing combines
  // with it, and --check and the config event echo it.
  TrainerConfig trainer;

  std::vector<std::string> warnings;  // ignored keys in these sections, already logged
  // Whether the document has a `model` / `data` section. A plain ds_config
  // has neither: zinc-train then trains its default GPT on synthetic tokens,
  // and says so in a warning and in its header.
  bool model_given = true, data_given = true;

  // The top-level keys these sections take ("model", "data", "run",
  // "comm", and "trainer", which resolve_auto reads): the caller_sections
  // to give Config::parse.
  static const std::vector<std::string>& sections();

  // Parses and validates the four sections of `doc` and nothing else (the
  // other keys are Config::parse's), with `trainer` the document's trainer
  // section as parse_trainer read it. Throws ConfigError naming the path.
  static ExperimentConfig parse(const nlohmann::json& doc, const TrainerConfig& trainer);
  // The same, reading the trainer section itself.
  static ExperimentConfig parse(const nlohmann::json& doc);
  // Only the `comm` section, strictly, for picking the transport before the
  // world size and so the rest of the config are known. A document that is
  // not an object gives the defaults (parse_experiment reports it).
  static CommConfig parse_comm(const nlohmann::json& doc);

  // Cross-field checks (called by parse), for parsed configs and for
  // configs built in code alike: the model's size rules (models::size_error,
  // reported at model.FIELD), the model against the data (block_size,
  // vocab_size) and a file for file data. Sizes the data fills in are
  // checked when the model is built (build_experiment).
  void validate() const;

  bool operator==(const ExperimentConfig&) const = default;  // warnings too
};

// The four sections as a document with every key, resolved (defaults filled
// in, run.checkpoint_dir made concrete); keys a section reads only for
// another data type are left out, so that ExperimentConfig::parse gives back
// the same settings without warnings.
nlohmann::json to_json(const ExperimentConfig& e);

// A whole experiment document, parsed.
struct ParsedExperiment {
  Config config;                // the DeepSpeed sections; config.seed = experiment.run.seed
  ExperimentConfig experiment;  // model, data, run, comm
  std::vector<AutoValue> auto_values;  // the "auto" values resolved (resolve_auto), in document order
};

// One pass over the document (Note [one config pass] in
// experiment_config.cpp): parse_trainer(doc), ExperimentConfig::parse(doc,
// trainer), resolve_auto(doc, auto_facts(experiment, world_size)), then
// Config::parse(resolved, world_size, ExperimentConfig::sections()): every
// key of the document read and checked once. (Only the comm section is read
// earlier too, by the launcher that must know the transport before the
// world size: ExperimentConfig::parse_comm.)
// Throws ConfigError.
ParsedExperiment parse_experiment(const nlohmann::json& doc, int world_size = 1);

// What the "auto" rules take from the parsed sections (auto_config.h).
AutoFacts auto_facts(const ExperimentConfig& e, int world_size);
// The "auto" step of parse_experiment alone, reading the sections it needs
// (for tests and for tools that show the resolved document).
ResolvedConfig resolve_auto(const nlohmann::json& doc, int world_size);

}  // namespace zinc::tools
