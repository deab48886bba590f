// zinc tools: building a config-only experiment into a model, a data source
// and an engine config. The document is a ds_config plus the experiment
// sections `model`, `data`, `run` and `comm`, parsed by parse_experiment
// (tools/experiment_config.h). Shared by zinc-train, zinc-bench and the
// tests. Single-threaded use.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/data.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "tools/experiment_config.h"
#include "tools/hf_model.h"

namespace zinc::tools {

struct Experiment {
  Config config;                // the engine's (DeepSpeed sections); seed = experiment.run.seed
  ExperimentConfig experiment;  // model, data, run, comm
  std::shared_ptr<const DataSource> data;
  std::shared_ptr<const DataSource> eval_data;  // held-out samples; null without evaluation
  std::shared_ptr<Model> model;
  std::vector<AutoValue> auto_values;  // "auto" values resolved from the `trainer` section and the rules
  // The model in Hugging Face terms, for --save-pretrained: the folder's
  // config.json (model.from_pretrained) or one written for a gpt or llama
  // zinc built; empty for the mlp.
  std::optional<HfConfig> hf;
};

// Reads the config file, applies `--set` overrides in order, parses it
// (parse_experiment), opens the data source and builds the model the `model`
// section names (vocabulary and block size default to the data's). Throws
// ConfigError / IoError.
Experiment load_experiment(const std::string& path, const std::vector<std::string>& overrides,
                           int world_size = 1);
// The config file with `--set` overrides applied, unparsed (zinc-train reads
// its comm section, ExperimentConfig::parse_comm, before the world size is
// known).
nlohmann::json load_document(const std::string& path, const std::vector<std::string>& overrides);
// Same from an in-memory document.
Experiment build_experiment(const nlohmann::json& doc, int world_size = 1);

// The micro-batches of `micro` samples that cover `source` once (the last
// one's rows past its end have no targets).
int64_t eval_batches_held(const DataSource& source, int64_t micro);
// Mean loss over the first `batches` micro-batches of `micro` samples of
// `source` (in index order), forward only; at most eval_batches_held of
// them, so each sample counts once.
double evaluate(Engine& engine, const DataSource& source, int64_t batches, int64_t micro);

// The code paths this process runs, for headers (zinc-train, zinc-bench):
// "cpu: avx2 kernels (the CPU lacks avx512f ...) | matmul fp32: oneDNN
// gemm:jit | matmul bf16: via fp32 (...), no native bf16 on this CPU |
// optimizer: avx2". Creates two small matmul primitives to ask oneDNN.
// Throws zinc::Error for a bad ONEDNN_MAX_CPU_ISA.
std::string kernel_paths();

// Peak resident set size of this process in bytes (getrusage).
int64_t peak_rss_bytes();
// Resident set size of this process now, in bytes (/proc/self/statm).
int64_t current_rss_bytes();

}  // namespace zinc::tools
