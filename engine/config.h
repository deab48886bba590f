// zinc engine: the run configuration, DeepSpeed's ds_config JSON.
//
// Keys, defaults and meanings follow DeepSpeed (0.19 where its docs and code
// disagree). Parsing is strict: a wrong type, an out-of-range value, an
// inconsistent combination or an unknown key (with the nearest known key
// suggested) throws zinc::ConfigError naming the JSON path, the value and the
// rule. A DeepSpeed key zinc knows but does not implement is a warning that
// says it is ignored, or an error where ignoring it would change the result.
// A document may carry sections of its own beside the DeepSpeed ones (such as
// zinc-train's `model`, `data`, `run` and `comm`, parsed by
// tools/experiment_config.h): the caller names them to parse(), which leaves
// them to it and still rejects every other unknown key. Parsers of such
// sections use the engine's reader (engine/config_reader.h).
// Plain data; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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

  std::vector<std::string> warnings;  // known-but-ignored keys, already logged

  // The largest batch size (and factor of it) a config may give: products of
  // the batch triad stay far from int64 overflow.
  static constexpr int64_t kMaxBatch = int64_t{1} << 40;

  // Parses and validates; world_size is the data-parallel size the batch
  // triad must fit. `caller_sections` names top-level keys that the caller
  // parses itself (keys the engine does not read): parse() leaves them alone
  // but counts them as known, so a misspelt one still gets "did you mean".
  // Any other key the engine does not know is an error. Throws ConfigError.
  static Config parse(const nlohmann::json& j, int world_size = 1,
                      const std::vector<std::string>& caller_sections = {});
  // Reads the file (IoError if missing/unreadable, ConfigError with line and
  // column on a JSON syntax error) and parses it.
  static Config load(const std::string& path, int world_size = 1,
                     const std::vector<std::string>& caller_sections = {});
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
