// zinc engine, private: a block's shard on this rank, what a ZeRO stage keeps
// of it (computed once), and the accounting of model-state memory.
//
// Note [ZeRO stages]
// ------------------
// Every block is one flat vector split into world_size equal shards
// (engine/partition.h). What a rank keeps, per block (StagePlan):
//
//   stage | compute params        | gradients                        | master, m, v
//   0     | full                  | full; reduced to full            | full
//   1     | full                  | full; reduced into own shard     | own shard
//   2     | full                  | own shard; full buffer only from | own shard
//         |                       | its block's backward until its   |
//         |                       | reduce-scatter has run           |
//   3     | own shard; full only  | as stage 2                       | own shard
//         | while gathered        |                                  |
//         | (ParamCoordinator)    |                                  |
//
// The reduction is the same for every stage (GradReducer, grad_reducer.h):
// at the micro-step that ends a global batch, each block's full gradient is
// reduce-scattered into the rank's shard as soon as the model reports it
// ready, in buckets of reduce_bucket_size elements. Stage 0 then all-gathers
// the reduced shards back into the full gradient (an all-reduce with the same
// summation order as the other stages) and every rank updates every element;
// stages 1 and 2 update their shard and all-gather the new compute
// parameters; stage 3 updates its compute shard and gathers a block when the
// model acquires it (the same all-gather of the same shards, later). The
// gradient norm is the sum over ranks of each rank's own-shard squares for
// every stage. So, at one world size, stages 0-3 and overlap on or off
// compute bit-identical weights. With one rank stage 3 keeps everything, as
// stage 2 does (there is nothing to shard), unless offload_param moves the
// parameters out of RAM: then a block is read into RAM while in use.
//
// Stage 3 with the optimizer states on NVMe (StagePlan::grads_on_nvme): the
// reduced shard of each block goes to NVMe as soon as its reduction has run
// (on one rank, as soon as backward reports it), its sum of squares taken
// first for the norm, and the update reads it with its sub-group's master,
// m and v (OptimizerSwapper): no reduced-shard buffer, and the full buffer
// only in backward, on one rank too.
//
// No-sync: micro-steps that do not end a global batch accumulate into the
// full gradient buffers with no communication. At stage 2 that means the full
// buffers live from the first micro-step's backward to the boundary's
// reduce-scatter: with gradient_accumulation_steps > 1, stage 2 holds full
// fp32 gradients (4 bytes per parameter) during the whole accumulation, as
// stage 1 does; with 1 it holds only the buckets in flight.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <unordered_map>

#include "comm/comm.h"
#include "core/alloc.h"
#include "core/dtype.h"
#include "engine/model.h"
#include "engine/partition.h"
#include "offload/offload.h"

namespace zinc {

// What a stage keeps, from (stage, world size) alone. Every "which stage am
// I" question of the engine is one of these fields.
struct StagePlan {
  int stage = 0;
  int world = 1;
  // Optimizer state (master, m, v) spans the whole padded block (stage 0)
  // rather than the rank's shard.
  bool optimizer_spans_block = true;
  // The full gradient buffer exists from start to end (false: stage 2 with
  // several ranks allocates it in backward and frees it once reduced).
  bool grad_always_allocated = true;
  // The reduced own shard lives in a buffer of its own (stages 1, 2 with
  // several ranks); else it is the own range of the full gradient.
  bool grad_shard_buffer = false;
  // The reduced shards are all-gathered back into the full gradient (stage 0
  // with several ranks: an all-reduce in the same summation order).
  bool gather_reduced_grads = false;
  // After the update the new compute shards are all-gathered (stages 1, 2
  // with several ranks).
  bool gather_params_after_step = false;
  // The compute parameters are sharded: a rank keeps its shard and holds a
  // block in full only while gathered (stage 3 with several ranks, or with
  // one rank whose parameters are offloaded: its "shard" is the whole block,
  // kept on NVMe or page-locked, and "gathered" into RAM while in use).
  bool params_sharded = false;
  // The reduced gradients go to NVMe block by block (Config::gradients_on_nvme):
  // the full gradient buffer exists only from its block's backward until
  // its reduction has run and the rank's shard is written (as at stage 2 on
  // several ranks, also on one rank), and there is no reduced-shard buffer.
  bool grads_on_nvme = false;

  static StagePlan make(int stage, int world, bool params_offloaded = false, bool grads_to_nvme = false) {
    StagePlan p;
    p.stage = stage;
    p.world = world;
    p.optimizer_spans_block = stage == 0;
    p.grad_always_allocated = !(stage >= 2 && world > 1);
    p.grad_shard_buffer = world > 1 && stage > 0;
    p.gather_reduced_grads = world > 1 && stage == 0;
    p.gather_params_after_step = world > 1 && (stage == 1 || stage == 2);
    p.params_sharded = stage == 3 && (world > 1 || params_offloaded);
    if (grads_to_nvme && stage == 3) {
      p.grads_on_nvme = true;
      p.grad_always_allocated = false;
      p.grad_shard_buffer = false;
    }
    return p;
  }
  // A separate compute copy of the parameters: bf16 / fp16 always; fp32 at
  // stages 1, 2 (at stage 0 in fp32 the master weights are the compute weights).
  bool compute_copy(DType compute) const { return is_16bit(compute) || stage > 0; }
  int64_t optimizer_numel(const Partition& p) const {
    return optimizer_spans_block ? p.padded_numel : p.shard_numel;
  }
};

// Bytes of model state held now and at most; every state buffer is
// allocated and freed through it.
//
// Buffers that come and go every step (stage 2's full gradients, stage 3's
// gathered blocks) come back the next step at the same sizes, so a freed
// buffer is kept and handed out again (cleared) for the next request of its
// exact size: the pages stay mapped instead of being returned and faulted in
// again each step (which cost stage 2 about 7% of its step on this machine),
// and the process holds at most the peak of what is live plus the kept
// buffers of sizes not asked for since, which in a repeating step is none.
class StateMemory {
 public:
  // zero false: a reused buffer keeps what it held (a new one is zeros).
  AlignedBuffer alloc(size_t bytes, bool zero = true) {
    add(static_cast<int64_t>(bytes));
    auto it = kept_.find(bytes);
    if (it == kept_.end()) return AlignedBuffer(bytes);
    AlignedBuffer b = std::move(it->second);
    kept_.erase(it);
    kept_bytes_ -= static_cast<int64_t>(bytes);
    if (zero) std::memset(b.data(), 0, bytes);
    return b;
  }
  void free(AlignedBuffer& b) {
    bytes_ -= static_cast<int64_t>(b.bytes());
    if (b.empty()) return;
    kept_bytes_ += static_cast<int64_t>(b.bytes());
    kept_.emplace(b.bytes(), std::move(b));
    b = AlignedBuffer();
  }
  // Bytes of freed buffers kept for reuse (not counted in bytes()).
  int64_t kept_bytes() const { return kept_bytes_; }
  // Returns the kept buffers to the system (after setup, whose buffers,
  // such as the compute shards moved to NVMe, do not come back).
  void release_kept() {
    kept_.clear();
    kept_bytes_ = 0;
  }
  void add(int64_t bytes) {
    bytes_ += bytes;
    peak_ = std::max(peak_, bytes_);
  }
  int64_t bytes() const { return bytes_; }
  int64_t peak_bytes() const { return peak_; }

 private:
  int64_t bytes_ = 0, peak_ = 0, kept_bytes_ = 0;
  std::unordered_multimap<size_t, AlignedBuffer> kept_;
};

// Whether a block's compute parameters are present in full on this rank
// (FSDP2's ShardedState). Stages 0-2 keep every block gathered; stage 3
// gathers on acquire or ahead of it (prefetch) and frees on release.
enum class ParamState {
  kSharded,   // only the own shard (compute_shard); `compute` is empty
  kGathering, // `compute` allocated; its all-gather is submitted (gather handle)
  kGathered,  // `compute` holds the full block
};

// Where a block's gradient is in the step (FSDP2's sharded-state idea: what
// is held is a value, not inferred from empty buffers).
enum class GradState {
  kFreed,         // no full gradient buffer (stage 2 between reductions)
  kAccumulating,  // the full buffer holds this accumulation's sum so far
  kReducing,      // its reduce-scatter is submitted and may be in flight
  kReduced,       // the own shard holds the reduced sum (until the step)
};

// One block on this rank: its partition, its buffers and their state.
struct BlockShard {
  BlockLayout layout;
  Partition part;
  // BlockSpec::frozen: compute parameters only (no gradients, no optimizer
  // span: opt_numel is 0), whatever the stage.
  bool frozen = false;
  // Another pipeline stage's block (Note [pipeline parallelism] in
  // engine/pipeline.cpp): nothing of it here; it is also `frozen`, so that
  // the reducer, the optimizer and checkpoints pass it by.
  bool absent = false;
  AlignedBuffer compute;  // 1-D, part.padded_numel, compute dtype (empty: the master is it, or kSharded)
  // Stage 3: the rank's own shard of the compute parameters (1-D,
  // part.shard_numel, compute dtype), written by the optimizer: in the
  // engine's RAM, or with offload_param "cpu" in page-locked host memory.
  AlignedBuffer compute_shard;
  offload::PinnedBuffer compute_shard_pinned;
  // With offload_param "nvme" a block that does not persist keeps its shard
  // on disk instead (ParamCoordinator): own_compute() is then null.
  char* own_compute() const {
    return compute_shard_pinned.data() ? compute_shard_pinned.as<char>() : compute_shard.as<char>();
  }
  int64_t nvme_offset = -1;              // byte offset of the shard in the parameter file (-1: in RAM)
  offload::PinnedBuffer nvme_read;       // the shard read from disk, while the block is gathered
  std::shared_ptr<offload::PinnedBuffer> nvme_update;  // the optimizer's new shard, until written back
  // Elements of this rank's optimizer span (the whole padded block at stage
  // 0, else the shard); the state itself is the OptimizerState's.
  int64_t opt_numel = 0;
  // The master weights when they are the compute weights (stage 0 in fp32,
  // optimizer state in memory); else null.
  float* master_compute = nullptr;
  AlignedBuffer grad;        // 1-D, part.padded_numel fp32 accumulators (when not kFreed)
  AlignedBuffer grad_shard;  // 1-D, part.shard_numel fp32 reduced gradient (StagePlan::grad_shard_buffer)
  double grad_squares = 0;   // StagePlan::grads_on_nvme: the stored shard's sum of squares
  ParamState param_state = ParamState::kGathered;
  int held = 0;  // HeldParams handles the model holds now (ParamCoordinator)
  bool persistent = false;    // stage 3: stays gathered (stage3_param_persistence_threshold)
  comm::CommHandle gather;    // stage 3: the all-gather of `compute`, while kGathering
  GradState grad_state = GradState::kAccumulating;
  bool grads_reported = false;  // grads_ready called in the current backward
  // Note [gradients written, not zeroed] (engine/model.h): no backward has
  // been handed `grad` since it was zeroed but for its overwritten parameters.
  bool grad_fresh = true;
  comm::CommHandle reduction;   // the reduce-scatter of this step, while kReducing
};

}  // namespace zinc
