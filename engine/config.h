// zinc engine: the run configuration (DeepSpeed's ds_config JSON plus zinc's
// `model`, `data` and `run` sections for config-only experiments).
//
// Keys, defaults and meanings follow DeepSpeed (0.19 where its docs and code
// disagree). Parsing is strict: a wrong type, an out-of-range value, an
// inconsistent combination or an unknown key (with the nearest known key
// suggested) throws zinc::ConfigError naming the JSON path, the value and the
// rule. A DeepSpeed key zinc knows but does not implement is a warning that
// says it is ignored, or an error where ignoring it would change the result.
// Plain data; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/data.h"

namespace zinc {

struct OptimizerConfig {
  std::string type = "AdamW";  // "Adam" | "AdamW" (case-insensitive in the JSON)
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;  // "betas": [b1, b2]
  double eps = 1e-8;
  double weight_decay = 0.0;
  // Decoupled (AdamW) weight decay. DeepSpeed's "Adam" defaults to
  // adam_w_mode true as well; "adam_w_mode": false gives L2-style Adam.
  bool adam_w_mode = true;
  bool bias_correction = true;
};

struct SchedulerConfig {
  std::string type;  // "" (constant lr) | "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR"
  // WarmupLR / WarmupDecayLR
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 0.001;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // "log" | "linear"
  // WarmupDecayLR / WarmupCosineLR (required for those)
  int64_t total_num_steps = 0;
  // WarmupCosineLR (ratios of the optimizer's lr)
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
};

struct OffloadConfig {
  std::string device = "none";  // "none" | "cpu" | "nvme"
  std::string nvme_path;        // required for nvme
  bool pin_memory = false;
  int64_t buffer_count = 4;
  int64_t buffer_size = 100000000;  // offload_param only
  int64_t max_in_cpu = 1000000000;  // offload_param only
  double ratio = 1.0;               // offload_optimizer only
};

struct ZeroConfig {
  int stage = 0;
  bool overlap_comm = false;  // default: true for stage 3, else false
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500000000;
  int64_t allgather_bucket_size = 500000000;
  bool allgather_partitions = true;
  OffloadConfig offload_optimizer;
  OffloadConfig offload_param;  // buffer_count default 5
  int64_t sub_group_size = 1000000000;
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_param_persistence_threshold = 100000;
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
};

struct AioConfig {
  int64_t block_size = 1048576;
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;  // alias: thread_count
  bool single_submit = false;
  bool overlap_events = true;
};

struct CsvMonitorConfig {
  bool enabled = false;
  std::string output_path;  // files go to <output_path>/<job_name>/, as DeepSpeed writes them
  std::string job_name = "DeepSpeedJobName";
};

// zinc's `model` section: the built-in model to train.
struct ModelConfig {
  std::string type = "gpt";  // "gpt" | "mlp"
  int64_t vocab_size = 0;    // 0 = take the data source's vocabulary
  int64_t block_size = 0;    // gpt: max sequence length (0 = data.seq_len)
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  // mlp: next-token MLP over the previous `context` tokens' embeddings
  int64_t context = 4;
  int64_t hidden = 512;
};

// zinc's `run` section: how long and what to log/save.
struct RunConfig {
  int64_t steps = 100;       // optimizer steps
  uint64_t seed = 42;        // model init and data order
  int64_t eval_interval = 0; // 0 = no evaluation
  int64_t eval_batches = 4;
  int64_t checkpoint_interval = 0;  // 0 = none
  std::string output_dir = "runs/default";
};

// zinc's `comm` section: how ranks talk.
struct CommConfig {
  // "auto": shared memory between the ranks of one machine, hierarchical
  // (shared memory inside machines, MPI between them) across machines;
  // "mpi", "shm", "hierarchical" force one (for comparison). The environment
  // variable ZINC_COMM_BACKEND overrides it.
  std::string backend = "auto";
  // The longest a shared-memory collective waits for another rank before it
  // fails with an error naming that rank (ZINC_COMM_TIMEOUT overrides it).
  double timeout_seconds = 600;
};

struct Config {
  // batch triad; after parse() all three are set and consistent for the world size
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  int world_size = 1;
  // Seed of the model's initial weights (not a ds_config key: DeepSpeed
  // leaves initialisation to the model). zinc-train sets it from run.seed.
  uint64_t seed = 42;

  double gradient_clipping = 1.0;  // 0 = off
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool bf16 = false;  // bf16.enabled
  std::string grad_accum_dtype = "fp32";        // data_types.grad_accum_dtype (only fp32 here)
  std::string communication_data_type;          // "" = same as gradients
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  AioConfig aio;
  CsvMonitorConfig csv_monitor;

  // zinc sections
  ModelConfig model;
  DataConfig data;
  RunConfig run;
  CommConfig comm;

  std::vector<std::string> warnings;  // known-but-ignored keys, already logged

  // Parses and validates; world_size is the data-parallel size the batch
  // triad must fit. Throws ConfigError.
  static Config parse(const nlohmann::json& j, int world_size = 1);
  // Only the `comm` section, strictly (ConfigError naming the path), for
  // picking the transport before the world size and so the rest of the
  // config are known. A document that is not an object gives the defaults
  // (parse() reports it).
  static CommConfig parse_comm(const nlohmann::json& j);
  // Reads the file (IoError if missing/unreadable, ConfigError with line and
  // column on a JSON syntax error) and parses it.
  static Config load(const std::string& path, int world_size = 1);
  // Cross-field checks (called by parse).
  void validate() const;
};

// Reads a JSON file: IoError naming the path if it cannot be read,
// ConfigError naming the file, line and column on a syntax error.
nlohmann::json read_json_file(const std::string& path);

// Applies a "--set a.b.c=value" override to a JSON document: value parsed as
// JSON, a bare word as a string; intermediate objects are created. Throws
// ConfigError for a malformed assignment.
void apply_override(nlohmann::json& j, const std::string& assignment);

// The nearest of `candidates` to `key` by edit distance, or "" if none is close.
std::string did_you_mean(const std::string& key, const std::vector<std::string>& candidates);

}  // namespace zinc
