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
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "engine/config_text.h"
#include "engine/model.h"
#include "optim/optim.h"

namespace zinc {

// Each option below carries DeepSpeed's JSON name, its default (the
// initialiser) and, where it has one, its cost: what a larger or smaller
// value spends in memory, time or communication. Sizes are in elements
// unless a name says bytes.

// optimizer.type (case-insensitive in the JSON).
enum class OptimizerType { kAdam, kAdamW, kLamb, kOneBitAdam, kZeroOneAdam, kOneBitLamb };
// "Adam" | "AdamW" | "Lamb" | "OneBitAdam" | "ZeroOneAdam" | "OneBitLamb"
const char* optimizer_type_name(OptimizerType t);

// OneBitAdam's own keys (DeepSpeed's deepspeed/runtime/fp16/onebit/adam.py;
// Note [1-bit Adam] in engine/update_onebit.cpp). Its lr, betas, eps and
// weight_decay are `adam`'s; its update has no bias correction and decoupled
// weight decay, as DeepSpeed's has.
struct OneBitConfig {
  // Optimizer steps of plain Adam (gradients averaged in full) before the
  // variance freezes and the momentum goes over the wire at 1 bit per
  // element. Cost: each warm-up step sends 32x the bytes of a compressed
  // one; too few leave the frozen variance a poor estimate.
  int64_t freeze_step = 100000;
  // ZeroOneAdam (deepspeed/runtime/fp16/onebit/zoadam.py): the variance is
  // updated (gradients averaged in full) at steps that are multiples of an
  // interval that starts at 1 and doubles after every var_update_scaler
  // updates; between them the gradient goes over the wire at 1 bit. After
  // var_freeze_step the variance freezes and ranks take local steps,
  // synchronising (1 bit) every local_step_interval steps, an interval that
  // starts at 1 and doubles every local_step_scaler steps up to
  // local_step_clipper.
  int64_t var_freeze_step = 100000;
  int64_t var_update_scaler = 16;
  int64_t local_step_scaler = 32678;
  int64_t local_step_clipper = 16;
  // OneBitLamb (deepspeed/runtime/fp16/onebit/lamb.py; also freeze_step):
  // the trust ratio after the freeze is the warm-up's moving average of it
  // (coeff_beta) times a factor from a fresh variance estimate, clamped to
  // [factor_min, factor_max] and to within factor_threshold of the last
  // step's factor.
  double coeff_beta = 0.9;
  double factor_max = 4.0, factor_min = 0.5, factor_threshold = 0.1;
  // Accepted for DeepSpeed's configs: zinc's compressed all-reduce runs on
  // the engine's own transport (comm.backend) whatever these say.
  bool cuda_aware = false;
  std::string comm_backend_name = "nccl";
  bool operator==(const OneBitConfig&) const = default;
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  // optimizer.params: optim's own parameters (optim/optim.h, DeepSpeed's
  // names and defaults there). The section fills the struct of its type;
  // the other keeps its defaults and is not used.
  optim::AdamParams adam;  // Adam, AdamW
  optim::LambParams lamb;  // Lamb, OneBitLamb
  OneBitConfig onebit;     // OneBitAdam, ZeroOneAdam (with `adam`), OneBitLamb (with `lamb`)
  bool one_bit() const {
    return type == OptimizerType::kOneBitAdam || type == OptimizerType::kZeroOneAdam ||
           type == OptimizerType::kOneBitLamb;
  }
  bool lamb_family() const { return type == OptimizerType::kLamb || type == OptimizerType::kOneBitLamb; }
  // optimizer.params.decay_norms_and_biases (zinc's key; AdamW and Adam):
  // weight decay on the 1-D parameters (biases, norm weights) too, as
  // DeepSpeed's one parameter group has it. False: the Hugging Face
  // Trainer's own AdamW, which decays only the others (its
  // get_decay_parameter_names), as a `trainer` section without an
  // optimizer section gets it (tools/auto_config.cpp).
  bool decay_vectors = true;

  // The keys both share, as the section's type has them.
  double lr() const { return lamb_family() ? lamb.lr : adam.lr; }
  double beta1() const { return lamb_family() ? lamb.beta1 : adam.beta1; }
  double beta2() const { return lamb_family() ? lamb.beta2 : adam.beta2; }
  double eps() const { return lamb_family() ? lamb.eps : adam.eps; }
  double weight_decay() const { return lamb_family() ? lamb.weight_decay : adam.weight_decay; }
  bool bias_correction() const { return lamb_family() ? lamb.bias_correction : adam.bias_correction; }

  bool operator==(const OptimizerConfig&) const = default;
};

// scheduler: optim's own parameters (optim/optim.h), parsed straight into.
using SchedulerType = optim::ScheduleType;  // kConstant when there is no scheduler section
using WarmupType = optim::WarmupType;       // scheduler.params.warmup_type
using SchedulerConfig = optim::ScheduleParams;
// "constant" | "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" | "OneCycle"
inline const char* scheduler_type_name(SchedulerType t) { return optim::schedule_type_name(t); }

// Where a ZeRO state lives (offload_optimizer.device, offload_param.device).
enum class OffloadDevice {
  kNone,  // "none": the engine's own RAM. Fastest; RAM holds all of it.
  kCpu,   // "cpu": host RAM, page-locked when pin_memory. On the CPU build the
          // same RAM as "none" (pinning only matters for GPU copies).
  kNvme,  // "nvme": files under nvme_path, streamed through io_uring
          // sub-group by sub-group. RAM holds only the buffers in flight;
          // each step reads and writes the whole state (disk bandwidth).
};
const char* offload_device_name(OffloadDevice d);  // "none" | "cpu" | "nvme"

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;  // the folder for the state files (required for nvme)
  // Page-locked host buffers. Costs locked RAM (RLIMIT_MEMLOCK); refused
  // locks fall back to ordinary memory with a warning.
  bool pin_memory = false;
  // nvme: sub-group buffers in flight (read ahead, update, write behind).
  // More: deeper overlap of I/O with the update; each costs sub_group_size x
  // 12 bytes (master, m, v) of RAM.
  int64_t buffer_count = 4;
  // offload_param only, accepted and warned about when not the default:
  // zinc bounds its parameter buffers by stage3_max_live_parameters (and
  // offload_param's buffer_count, default 5, likewise).
  int64_t buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  // offload_optimizer: the share of the optimizer states offloaded; below 1
  // the first blocks' states live on the GPU (Note [a share of the states on
  // the GPU] in engine/gpu_offload.cpp; "device": "cuda", one rank).
  double ratio = 1.0;

  bool operator==(const OffloadConfig&) const = default;
};

struct ZeroConfig {
  // 0: plain data parallel; 1: optimizer states partitioned; 2: and
  // gradients; 3: and parameters (Note [ZeRO stages], engine/shard.h).
  // Each stage saves memory per rank and adds no traffic over stage 1 except
  // stage 3's gathers (parameters cross the wire once per use).
  int stage = 0;
  // Reduce each gradient bucket on the comm thread while backward goes on.
  // Default: true at stage 3, else false. Costs up to GradReducer's two
  // buckets of full gradients alive at once.
  bool overlap_comm = false;
  bool contiguous_gradients = true;  // zinc's gradients are always contiguous (flat blocks)
  bool reduce_scatter = true;        // false is warned and ignored: zinc always reduce-scatters
  // Gradient elements per reduction. Larger: fewer, larger collectives (less
  // latency), more gradient memory alive at stage 2/3 and less overlap. 0:
  // one block per bucket.
  int64_t reduce_bucket_size = 500000000;
  // Parameter elements per all-gather after the step (stages 1, 2). Same
  // trade as reduce_bucket_size, in the step instead of backward.
  int64_t allgather_bucket_size = 500000000;
  bool allgather_partitions = true;  // false is warned and ignored
  OffloadConfig offload_optimizer;
  // Stage 3 only: where the compute-parameter shards live. "cpu": page-locked
  // host RAM when pin_memory (the same RAM on the CPU build); "nvme": the
  // shards of blocks that do not persist live in a file under nvme_path and
  // are read just ahead of their gathers (RAM then holds only the gathered
  // blocks); each gather reads the shard again (forward and backward, unless
  // the block stays gathered between them) and each step writes it once.
  OffloadConfig offload_param;
  // Optimizer elements updated per NVMe sub-group: the unit the swapper
  // reads, updates and writes. Larger: longer I/O, fewer waits, more RAM.
  // 0 (DeepSpeed: a sub-group per parameter): the smallest, 1024 elements.
  int64_t sub_group_size = 1000000000;
  // What the engine and the estimate use: 0 is the smallest bucket (each
  // block flushed on its own) and the smallest sub-group (the swapper's
  // 1024 elements), as documented above; once the engine refused 0 on an
  // internal check while the parser took it.
  int64_t reduce_bucket_numel() const { return reduce_bucket_size > 0 ? reduce_bucket_size : 1; }
  int64_t sub_group_numel() const { return sub_group_size > 0 ? sub_group_size : 1; }
  // Stage 3 (engine/param_coordinator.cpp, Note [ZeRO-3 parameter coordination]):
  // Elements gathered ahead of use along the recorded order. Larger: more
  // overlap of gathers with compute, more memory.
  int64_t stage3_prefetch_bucket_size = 50000000;
  // Blocks of at most this many elements stay gathered for the whole run:
  // their memory is spent for good, their gathers only once per step.
  int64_t stage3_param_persistence_threshold = 100000;
  // The most elements of persistent blocks in the whole model (blocks taken
  // in order until the next would pass it). Default: no limit.
  int64_t stage3_model_persistence_threshold = std::numeric_limits<int64_t>::max();
  // The most elements gathered at once on a rank (plus the block an acquire
  // needs): the bound on stage 3's parameter memory. 0: only that block.
  int64_t stage3_max_live_parameters = 1000000000;
  // A released block stays gathered if the recorded order uses it again
  // within this many elements of other blocks: a gather saved for memory.
  int64_t stage3_max_reuse_distance = 1000000000;

  bool operator==(const ZeroConfig&) const = default;
};

// aio: the NVMe store's io_uring settings (offload/nvme_store.h).
struct AioConfig {
  // Bytes per read or write request. Larger: fewer requests; a multiple of 4096.
  int64_t block_size = 1048576;
  int64_t queue_depth = 8;            // requests in flight per ring
  int64_t intra_op_parallelism = 1;   // rings (threads) per transfer; alias thread_count
  bool single_submit = false;         // submit requests one by one instead of in batches
  bool overlap_events = true;         // submit the next requests while completions are reaped

  bool operator==(const AioConfig&) const = default;
};

// csv_monitor and tensorboard: DeepSpeed's monitor sections, with the same
// keys and defaults for both. Rank 0 writes the curves (tools/monitor.h):
// csv_monitor one CSV file per scalar, tensorboard one TensorBoard event
// file. Each costs a few small writes per step. wandb and comet, DeepSpeed's
// other monitors, log to a network service and are refused when enabled.
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;  // files go to <output_path>/<job_name>/, as DeepSpeed writes them
  std::string job_name = "DeepSpeedJobName";

  bool operator==(const MonitorConfig&) const = default;
};
using CsvMonitorConfig = MonitorConfig;
using TensorBoardConfig = MonitorConfig;

// checkpoint: DeepSpeed's section. tag_validation decides what a save does
// when the ranks pass different tags (rank 0's tag is used in every case, so
// that all ranks write one checkpoint).
enum class TagValidation { kIgnore, kWarn, kFail };
struct CheckpointConfig {
  TagValidation tag_validation = TagValidation::kWarn;

  bool operator==(const CheckpointConfig&) const = default;
};

// fp16: DeepSpeed's section (Note [dynamic loss scaling] in
// optim/loss_scaler.h). With enabled the model's weights are fp16 (fp32
// master weights in the optimizer), gradients go over the wire in fp16
// unless communication_data_type says otherwise, and backward runs on the
// loss times the loss scale.
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;         // 0: dynamic; > 0: this static scale
  int64_t initial_scale_power = 16;  // the first dynamic scale is 2^this
  int64_t loss_scale_window = 1000;  // clean steps before the scale doubles
  int64_t hysteresis = 2;            // overflows tolerated before the scale halves
  bool consecutive_hysteresis = false;  // refill the hysteresis after every clean step
  double min_loss_scale = 1;

  bool operator==(const Fp16Config&) const = default;
};

// activation_checkpointing: DeepSpeed's section, with its keys and defaults.
// In DeepSpeed it configures the checkpointing API
// (deepspeed.checkpointing.checkpoint) that a model opts into; it does not
// switch checkpointing on. zinc likewise: the built-in GPT recomputes its
// layers when the experiment's model.gradient_checkpointing (or
// trainer.gradient_checkpointing) says so. The keys are parsed, checked and
// kept; none changes what zinc does (each set one is warned about, saying why).
struct ActivationCheckpointingConfig {
  bool given = false;  // the section is present (and not null)
  // Splits each checkpoint across the model-parallel ranks. zinc has no
  // model parallelism: ignored.
  bool partition_activations = false;
  // Copies partitioned checkpoints into preallocated contiguous buffers
  // (DeepSpeed requires partition_activations with it). Ignored with
  // partition_activations; zinc's GPT allocates its layer inputs once anyway.
  bool contiguous_memory_optimization = false;
  // Moves checkpoints to host memory. On the CPU build they are in host RAM
  // already: no effect.
  bool cpu_checkpointing = false;
  // The number of checkpoints, used by DeepSpeed only to size the contiguous
  // buffers of contiguous_memory_optimization. Unset: null (or false, which
  // DeepSpeed's own defaults use and configs carry).
  std::optional<int64_t> number_checkpoints;
  // Synchronizes the device at each checkpoint boundary. zinc's CPU kernels
  // are synchronous: no effect.
  bool synchronize_checkpoint_boundary = false;
  // Logs forward and backward time per checkpoint. Not implemented (zinc
  // times whole passes: wall_clock_breakdown).
  bool profile = false;

  bool operator==(const ActivationCheckpointingConfig&) const = default;
};

// "pipeline": DeepSpeed's section (Note [pipeline parallelism] in
// engine/pipeline.cpp). The ranks form a grid of `stages` pipeline stages
// by world_size / stages data-parallel replicas; each stage holds a
// contiguous run of the model's layers.
enum class PipePartition { kParameters, kUniform, kType };
struct PipelineConfig {
  int64_t stages = 1;  // "auto" (DeepSpeed's default, set by its PipelineModule): 1
  // How layers are split: balanced by parameters (DeepSpeed's default
  // partition_method, and what its "best" means here), by layer count, or
  // by the count of layers whose kind matches type_regex ("type:REGEX").
  PipePartition partition = PipePartition::kParameters;
  std::string type_regex;
  bool operator==(const PipelineConfig&) const = default;
};

// "tensor_parallel": DeepSpeed's AutoTP training section (Note [tensor
// parallelism] in engine/tensor_parallel.cpp). autotp_size ranks split
// each layer's weights (the Megatron split: whole heads, the MLP's inner
// size); they run the same batch.
struct TensorParallelConfig {
  int64_t size = 1;  // autotp_size
  bool operator==(const TensorParallelConfig&) const = default;
};

// "expert_parallel": DeepSpeed's AutoEP section (Note [expert parallelism]
// in engine/expert_parallel.cpp). autoep_size ranks, each training on its
// own batches, share out the experts of every mixture-of-experts layer and
// exchange the tokens routed to them.
struct ExpertParallelConfig {
  int64_t size = 1;           // autoep_size (1 unless enabled)
  std::string preset_model;   // DeepSpeed's layer-detection hint, kept for --check
  bool operator==(const ExpertParallelConfig&) const = default;
};

struct Config {
  // batch triad; after parse() all three are set and consistent for the world size
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  int world_size = 1;
  // The document this config was parsed from (checkpoints keep it).
  nlohmann::json source;
  CheckpointConfig checkpoint;
  // Seed of the model's initial weights (not a ds_config key: DeepSpeed
  // leaves initialisation to the model). zinc-train sets it from run.seed.
  uint64_t seed = 42;

  // "device" (zinc's key): where the model computes and the engine keeps the
  // compute parameters and gradient buffers. "cpu" (default) or "cuda"
  // (CUDA builds with a GPU: ZeRO-Offload, the optimizer states stay on the
  // host); "auto" resolves to cuda where zinc was built with CUDA and a GPU is
  // visible, else cpu. Resolved at parse time.
  Device device = Device::kCpu;
  // "auto" chose cuda: what only the model can refuse (a family without
  // GPU kernels, a tied head over pipeline stages) falls back to the CPU
  // too, saying why (tools/experiment.cpp), instead of stopping the run.
  bool device_auto = false;

  // 0 = off: DeepSpeed's default (GRADIENT_CLIPPING_DEFAULT 0.0; zinc's
  // was 1.0, which clipped a config without the key without a word).
  double gradient_clipping = 0.0;
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  // bf16.enabled: compute in bf16 (fp32 master weights and gradients).
  // Halves the compute copy and activations; on CPUs without native bf16
  // matmuls the matmuls run in fp32 (docs/cpu.md).
  bool bf16 = false;
  Fp16Config fp16;
  DType grad_accum_dtype = DType::kF32;  // data_types.grad_accum_dtype (only fp32 is implemented)
  // communication_data_type: the gradients' dtype on the wire (unset: fp32,
  // as accumulated; fp16 with fp16 enabled). bf16 / fp16 halve the reduction
  // traffic and round each sum.
  std::optional<DType> communication_data_type;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  AioConfig aio;
  CsvMonitorConfig csv_monitor;
  TensorBoardConfig tensorboard;
  ActivationCheckpointingConfig activation_checkpointing;
  PipelineConfig pipeline;
  TensorParallelConfig tensor_parallel;
  // sequence_parallel_size: DeepSpeed-Ulysses (Note [sequence parallelism]
  // in engine/sequence_parallel.cpp). That many ranks split each row of a
  // replica's micro-batches by tokens; ZeRO partitions over them too.
  int64_t sequence_parallel_size = 1;
  ExpertParallelConfig expert_parallel;

  std::vector<std::string> warnings;  // known-but-ignored keys, already logged

  // The largest batch size (and factor of it) a config may give: products of
  // the batch triad stay far from int64 overflow.
  static constexpr int64_t kMaxBatch = int64_t{1} << 40;

  // Parses and validates; world_size is the number of ranks (the batch
  // triad fits its data-parallel part, world_size / pipeline.stages). `caller_sections` names top-level keys that the caller
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
  // The model's compute dtype: bf16, fp16 or fp32.
  // The replicas: the batch triad's data-parallel size, world_size /
  // (pipeline.stages * tensor_parallel.size * sequence_parallel_size).
  int data_parallel_size() const { return world_size / model_parallel_size(); }
  // The ranks one replica of the model spans: stages times tensor parts
  // times sequence ranks.
  int model_parallel_size() const {
    return static_cast<int>(pipeline.stages * tensor_parallel.size * sequence_parallel_size);
  }
  // The ranks ZeRO partitions over: the replicas times their sequence
  // ranks (which hold the same weights, as DeepSpeed's sequence-data-
  // parallel group).
  // With expert ranks, those that hold the same experts: the replicas
  // divided by expert_parallel.size (every weight, the dense ones too, is
  // partitioned over them; Note [expert parallelism]).
  int zero_group_size() const {
    return data_parallel_size() * static_cast<int>(sequence_parallel_size) / static_cast<int>(expert_parallel.size);
  }
  bool pipelined() const { return pipeline.stages > 1; }
  bool tensor_split() const { return tensor_parallel.size > 1; }
  bool sequence_split() const { return sequence_parallel_size > 1; }
  bool expert_split() const { return expert_parallel.size > 1; }
  DType compute_dtype() const { return bf16 ? DType::kBF16 : fp16.enabled ? DType::kF16 : DType::kF32; }
  // The gradients' dtype on the wire: communication_data_type, else fp16
  // with fp16 on (as DeepSpeed reduces fp16 gradients), else fp32.
  DType wire_dtype() const {
    return communication_data_type ? *communication_data_type : fp16.enabled ? DType::kF16 : DType::kF32;
  }
  // ZeRO-3 with the optimizer states on NVMe keeps the reduced gradients
  // there too (as DeepSpeed's stage 3 swaps them), written as backward
  // reduces each block and read with their sub-group's states: no rank holds
  // the fp32 gradients of all its shards (StagePlan::grads_on_nvme). On the
  // GPU path the gradients are the DevicePath's.
  bool gradients_on_nvme() const {
    return zero.stage == 3 && zero.offload_optimizer.device == OffloadDevice::kNvme && device == Device::kCpu;
  }

  // Every field compares, `source` and `warnings` too (a test of the
  // serializer clears them to compare only the settings).
  bool operator==(const Config&) const = default;
};

// The config as a ds_config document with DeepSpeed's key names: every
// setting zinc reads, resolved (defaults filled in, aliases under their
// documented names, the batch triad complete). parse(to_json(c),
// c.world_size) gives back c's settings (not `source`, `warnings`, `seed`,
// which are not ds_config keys). engine/config_json.cpp.
nlohmann::json to_json(const Config& c);

// The deepest nesting of objects and lists a config document may have. A
// ds_config needs four or five levels; the limit keeps every recursive walk
// of a document (copying, comparing, dumping, the section parsers) far from
// the end of the stack, where a 100,000-deep document used to crash zinc.
// Files, --set overrides and Python dicts are held to it alike.
inline constexpr int kMaxConfigDepth = 64;

// Reads a JSON file: IoError naming the path if it cannot be read,
// ConfigError naming the file, line and column on a syntax error, and
// naming the file, the position and the JSON path of a duplicate key, a
// number out of the double's range (1e400) or nesting deeper than
// kMaxConfigDepth (Note [reading config JSON] in config_file.cpp).
nlohmann::json read_json_file(const std::string& path);
// The same for JSON text; `origin` names it in errors.
nlohmann::json parse_json_text(const std::string& text, const std::string& origin);

// Applies a "--set a.b.c=value" override to a JSON document: value parsed as
// JSON, a bare word as a string; intermediate objects are created. Throws
// ConfigError for a malformed assignment, a list index out of range, text
// that is not UTF-8, and a path and value nested deeper than
// kMaxConfigDepth together.
void apply_override(nlohmann::json& j, const std::string& assignment);

}  // namespace zinc
