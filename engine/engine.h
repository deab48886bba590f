// zinc engine: the training engine (public header of engine/).
//
//   auto engine = zinc::Engine::initialize(model, config);
//   for each micro-batch: engine.forward(batch); engine.backward(); engine.step();
//   // or: engine.train_batch(loader) for one whole global batch
//
// step() updates weights only at a gradient-accumulation boundary (every
// gradient_accumulation_steps micro-batches), as DeepSpeed's engine does.
// The engine owns the parameters (fp32 master weights, the bf16 / fp16
// compute copy with bf16 / fp16 on), the gradient accumulators and the optimizer states, laid out
// as one flat vector per model block (see engine/model.h).
//
// Data parallelism (Note [ZeRO stages] in engine/shard.h): with a
// communicator of N ranks every rank runs the same model on its own part of
// each global batch; zero_optimization.stage picks what each rank keeps:
// 0 everything (gradients all-reduced), 1 the optimizer state of its own
// shard of every block, 2 also only its own shard of the reduced gradients,
// 3 also only its own shard of the parameters, gathered block by block
// while the model uses them. Optimizer states can live in RAM, page-locked
// RAM or on NVMe, and with "device": "cuda" the model computes on the GPU
// (ZeRO-Offload, or the states on the GPU).
// Every rank must make the same calls in the same order. After the backward
// that ends a global batch, step() must run before the next forward().
//
// Threading: one Engine is driven from one thread. Kernels inside use the
// OpenMP pool; collectives run on the engine's CommStream thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "data/data.h"
#include "engine/config.h"
#include "engine/engine_stats.h"
#include "engine/model.h"

namespace zinc {

// The split of `model` into config.pipeline.stages stages (Note [pipeline
// parallelism] in engine/pipeline.cpp), as Engine::initialize makes it,
// without ranks: zinc-train --check prints it. Throws ConfigError where
// the model cannot be split so.
struct PipelinePlan {
  std::vector<PipelineLayer> layers;
  std::vector<int> bounds;       // the first layer of each stage, then the layer count
  std::vector<int> block_stage;  // per block, the first stage that uses it (its owner)
  // Per block, every stage that uses it: one, or two for a head tied to
  // the embedding (each keeps a copy, their gradients are summed).
  std::vector<std::vector<int>> block_stages;
  std::vector<int> tied_stages;  // the two stages that share blocks (none: empty)
  bool holds(int block, int stage) const;
  // Per stage at `world` ranks: "stage 0 (ranks 0-1): layers 0-2 (Embedding, 2 DecoderLayer), 0.37M parameters".
  std::vector<std::string> describe(int world) const;
};
PipelinePlan plan_pipeline(const Model& model, const Config& config);
// Tensor parts (Note [tensor parallelism] in engine/tensor_parallel.cpp),
// one line per part at config.world_size ranks: "tensor part 1 (ranks 1,
// 3): heads 2-3 of 4, kv heads 1 of 2, MLP 12-23 of 24". Throws
// ConfigError at tensor_parallel.autotp_size where the model cannot split
// so.
std::vector<std::string> describe_tensor_parts(const Model& model, const Config& config);
// Expert ranks (Note [expert parallelism] in engine/expert_parallel.cpp),
// one line per rank of expert_parallel.autoep_size: "expert rank 1 (ranks
// 1, 3): experts 4-7 of 8 in each of 2 layers". Throws ConfigError at
// expert_parallel.autoep_size where the model cannot share them out so.
std::vector<std::string> describe_expert_parts(const Model& model, const Config& config);
// Sequence ranks (Note [sequence parallelism] in
// engine/sequence_parallel.cpp): per slice, its ranks and tokens of rows of
// seq_len. ConfigError at sequence_parallel_size where the model cannot
// split its rows or seq_len does not divide.
std::vector<std::string> describe_sequence_ranks(const Model& model, const Config& config, int64_t seq_len);

class Engine {
 public:
  // Validates the config against the model and allocates all state.
  // Throws ConfigError for a config that cannot train this model.
  // comm: the data-parallel world (null: one rank). The config's world size
  // must equal comm->size().
  static Engine initialize(std::shared_ptr<Model> model, const Config& config,
                           std::shared_ptr<comm::Communicator> comm = nullptr);
  static Engine initialize(std::shared_ptr<Model> model, const nlohmann::json& config,
                           std::shared_ptr<comm::Communicator> comm = nullptr);

  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;
  ~Engine();

  // One micro-batch forward; returns its mean loss.
  float forward(const Batch& batch);
  // Backward of the last forward; gradients accumulate.
  void backward();
  // At an accumulation boundary: global norm, clipping, AdamW, schedule
  // advance, gradients zeroed. Elsewhere: nothing.
  void step();
  // gradient_accumulation_steps x (next micro-batch, forward, backward, step).
  // Returns the mean loss over the whole global batch. Refused inside a
  // global batch (after forward/backward calls of the caller's own).
  float train_batch(DataLoader& loader);
  // The same over the caller's gradient_accumulation_steps micro-batches
  // (without pipeline stages).
  float train_batch(const std::vector<Batch>& micro_batches);
  // Forward only (no gradients kept); mean loss over the batch's targets,
  // NaN for a batch without one.
  float evaluate(const Batch& batch);

  // True when the micro-batch most recently run through backward() completes
  // a global batch (so the next step() will update weights).
  bool is_gradient_accumulation_boundary() const;
  // Pre-clip global L2 norm of the averaged gradient at the last boundary.
  double global_grad_norm() const;
  // Learning rate applied by the most recent optimizer step (before the
  // first step: the one the first step will use).
  double learning_rate() const;
  // fp16: the loss scale the next backward multiplies the loss by (Note
  // [dynamic loss scaling] in optim/loss_scaler.h); 1 without fp16.
  double loss_scale() const;
  // Optimizer steps taken (global batches completed), skipped ones included.
  int64_t global_steps() const;
  int64_t skipped_steps() const;
  // Of the skipped steps this engine took (since initialize; not restored by
  // a load), those that fp16's dynamic loss scaling skipped on an overflow:
  // the normal way the scale finds its level, not a fault.
  int64_t overflow_steps() const;
  int64_t micro_steps() const;
  // Mean loss over the micro-batches of the last completed global batch,
  // all ranks.
  double last_batch_loss() const;
  // This rank and the number of ranks (every rank, with pipeline stages too).
  int rank() const;
  int world_size() const;
  // The replica this rank computes for and their number: world_size() /
  // (pipeline stages x tensor parts x sequence ranks). A DataLoader takes
  // these; every rank of a replica reads the same micro-batches.
  int data_parallel_rank() const;
  int data_parallel_size() const;
  // This rank's pipeline stage (0 without stages), and the forwards its
  // 1F1B schedule has computed again before their backward (Note [pipeline
  // parallelism] in engine/pipeline.cpp).
  int pipeline_stage() const;
  int64_t pipeline_recomputed_forwards() const;
  // Seconds this stage spent in its transfers to and from the neighbouring
  // stages (the schedule's bubble, and the wire); not in comm_wait_seconds.
  double pipeline_wait_seconds() const;
  // Seconds this rank spent in its tensor parts' all-reduces (Note [tensor
  // parallelism]: two per layer forward, two backward); not in
  // comm_wait_seconds.
  double tensor_wait_seconds() const;
  // This rank's tensor part and their number (0 and 1 without parts).
  int tensor_parallel_rank() const;
  int tensor_parallel_size() const;
  // This rank's slice of its replica's rows and their number (0 and 1
  // without sequence_parallel_size; Note [sequence parallelism] in
  // engine/sequence_parallel.cpp), and the seconds spent in the attention's
  // all-to-alls (not in comm_wait_seconds).
  int sequence_parallel_rank() const;
  int sequence_parallel_size() const;
  double sequence_wait_seconds() const;
  // This rank's share of the experts and the number of expert ranks (0 and
  // 1 without expert_parallel; Note [expert parallelism] in
  // engine/expert_parallel.cpp), and the seconds spent in the experts'
  // exchanges (not in comm_wait_seconds). Expert ranks train on batches of
  // their own: data_parallel_size() counts them.
  int expert_parallel_rank() const;
  int expert_parallel_size() const;
  double expert_wait_seconds() const;
  // Seconds the training thread spent blocked on communication (exposed,
  // not overlapped), and seconds the comm threads spent in collectives (the
  // reduction and the gather stream together).
  double comm_wait_seconds() const;
  double comm_busy_seconds() const;

  const Config& config() const;
  Model& model();
  DType compute_dtype() const;
  int64_t num_parameters() const;  // unpadded
  int64_t num_trained_parameters() const;  // unpadded, outside frozen blocks (BlockSpec::frozen)
  StepTimings timings() const;
  ParamGatherStats param_gather_stats() const;

  // Checkpoints (Note [checkpoints] in engine/checkpoint.cpp). Both are
  // collective: every rank calls them, between global batches. Each rank
  // writes its own shards of the optimizer state (no gather), with
  // checksums; the tag becomes visible (a folder DIR/TAG, and DIR/latest
  // naming it) only once complete, so a crash at any point leaves the
  // previous checkpoint and `latest` intact. tag "" means
  // "global_step<N>"; client_state is any JSON kept with it (zinc-train keeps
  // the data loader's position there). A tag is one folder name
  // (ckpt::check_tag: [A-Za-z0-9._+-], not "latest"); rank 0 holds the
  // folder's lock (ckpt::DirLock) while it saves.
  void save_checkpoint(const std::string& dir, const std::string& tag = "",
                       const nlohmann::json& client_state = nlohmann::json::object());
  // Loads DIR/TAG (tag "": the one DIR/latest names), saved at any world
  // size and ZeRO stage, into this engine (same model); restores the step
  // counters and the schedule's position. Returns the client_state. Throws
  // IoError naming the file (and block) for a missing, short, edited or
  // corrupted file. Every file is verified before anything is loaded, so
  // such a failure leaves the engine as it was; only a shard chunk whose
  // checksum fails while it is read leaves it partly loaded, and then
  // forward, evaluate, save_checkpoint and full_params throw until a load
  // succeeds (Note [a failed load] in engine.cpp). Every rank calls it; all
  // fail together.
  nlohmann::json load_checkpoint(const std::string& dir, const std::string& tag = "");

  // The full fp32 master weights of one block in its flat layout (padding
  // included). At stages 1 and 2 each rank holds only its shard, so this is a
  // collective there: every rank must call it, for the same block.
  std::vector<float> full_params(int block) const;
  // Bytes read from and written to NVMe so far: the optimizer swapper's
  // (offload_optimizer.device "nvme") and the parameter shards'
  // (offload_param.device "nvme" at stage 3); 0 without NVMe.
  int64_t offload_bytes_read() const;
  int64_t offload_bytes_written() const;
  // Bytes of model state (parameters, gradients, optimizer state) this rank
  // holds now, and the most it has held.
  int64_t model_state_bytes() const;
  int64_t model_state_peak_bytes() const;
  // With "device": "cuda": bytes of GPU memory held for model state now and
  // at most (parameters, gradient accumulators, GPU-resident optimizer
  // states, reduction buffers; not activations or cuBLAS workspaces). 0 on
  // the CPU.
  int64_t gpu_state_bytes() const;
  int64_t gpu_state_peak_bytes() const;

 private:
  void check_batch_start() const;
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zinc
