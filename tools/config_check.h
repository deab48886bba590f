// zinc tools: `zinc-train CONFIG --check`: what a run of a config would use,
// key by key with where each value came from, its warnings, and whether it
// would start, without training (Note [--check] in config_check.cpp).
//
// Single-threaded use; check_config logs through core/log as parsing does.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/experiment.h"

namespace zinc::tools {

// One leaf of the resolved config.
struct ConfigEntry {
  std::string path;       // DeepSpeed's (or the zinc section's) name: "zero_optimization.stage"
  nlohmann::json value;   // what the run uses
  std::string source;     // "file" | "--set" | "auto" | "default" | "derived" (zinc-train --check: "--steps" too)
  std::string from;       // for "auto" and "derived": what the value came from; else ""
};

// The value at a dotted path ("optimizer.params.lr") in a config document,
// under either spelling of a key the parser accepts two of (bfloat16 for
// bf16, max_live_parameters for stage3_max_live_parameters), or nullptr.
const nlohmann::json* find_config_path(const nlohmann::json& doc, const std::string& path);

// The resolved document of a parsed experiment: to_json(Config) with the
// experiment sections and its trainer section (e.trainer) beside it.
nlohmann::json resolved_document(const Config& c, const ExperimentConfig& e);

// Every leaf of `resolved` (arrays count as leaves) with its source:
// "auto" where resolve_auto filled it (its AutoValue says from what), "--set"
// where `set_doc` (the --set overrides applied to an empty document) has it,
// "file" where `file_doc` has it (under either spelling of an aliased key),
// "derived" for a member of the batch triad the other two gave, else
// "default". `world` is the data-parallel size (for "derived"). `merged`:
// the file with the overrides applied, where a key of the file counts only
// if the overrides left it (a --set of a whole section replaces the file's
// keys inside it); null: every key of the file counts.
std::vector<ConfigEntry> config_sources(const nlohmann::json& resolved, const nlohmann::json& file_doc,
                                        const nlohmann::json& set_doc, const std::vector<AutoValue>& autos,
                                        int world, const nlohmann::json* merged = nullptr);

// Leaves the file or the --set overrides give that the resolved config does
// not hold: keys zinc accepts and does not use (warned about, or at their
// defaults), such as fp16.loss_scale with fp16 off.
std::vector<ConfigEntry> unused_keys(const nlohmann::json& resolved, const nlohmann::json& file_doc,
                                     const nlohmann::json& set_doc, const nlohmann::json* merged = nullptr);

struct CheckReport {
  bool ok = false;                    // the run would start
  int world_size = 1;
  nlohmann::json resolved;            // null when refused
  std::vector<ConfigEntry> entries;   // every key of `resolved`
  std::vector<ConfigEntry> unused;    // given, not used (see unused_keys)
  std::vector<std::string> warnings;  // as logged, without the "config: " prefix
  std::vector<std::string> refusals;  // the error line(s) that stop the run
  std::vector<std::string> pipeline;  // with pipeline stages: which ranks hold which layers (PipelinePlan::describe)
  std::vector<std::string> tensor_parts;  // with tensor parts: which ranks hold which heads (describe_tensor_parts)
  std::vector<std::string> expert_ranks;  // with expert ranks: which ranks hold which experts (describe_expert_parts)
  std::vector<std::string> sequence_ranks;  // with sequence ranks: which ranks hold which tokens (describe_sequence_ranks)
  nlohmann::json to_json() const;     // one object: {"event": "check", ...}
};

// Parses the config file with the --set overrides at `world` ranks and runs
// the start-up checks that cost little and change nothing: the data file
// opens, the model builds, each nvme_path is a writable folder, and the
// folders the run would create (csv_monitor, tensorboard, checkpoints) can be
// created.
// Never throws for a config problem: the refusal is in the report.
CheckReport check_config(const std::string& path, const std::vector<std::string>& overrides, int world);

// The start-up checks above for an experiment already built. Throws
// ConfigError naming the key (zinc-train's runs call it too).
void check_startable(const Experiment& ex);
// Refuses (ConfigError at run.checkpoint_dir) a checkpoint folder whose
// path leaves no room below it for the files a save writes (the system's
// PATH_MAX), or with a name past NAME_MAX: the first save failed after
// training.
void check_checkpoint_path_room(const std::string& dir);

}  // namespace zinc::tools
