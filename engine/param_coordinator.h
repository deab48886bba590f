// zinc engine, private: the parameter coordinator (docs/design.md's
// ParamCoordinator). acquire(block) hands the model the block's full
// compute-precision parameters and release(block) takes them back; the model
// holds them through a HeldParams handle (engine/model.h), so an exception
// cannot leave a block held.
//
// Stages 0-2 keep every block gathered: acquire only counts, release only
// checks, and after each update gather_after_step() all-gathers the ranks'
// new shards (stages 1, 2). Stage 3 (StagePlan::params_sharded) keeps only
// the rank's shard of each block; Note [ZeRO-3 parameter coordination]
// (param_coordinator.cpp) says how blocks are gathered, prefetched along a
// trace, kept and freed.
//
// Streams: the coordinator's collectives run on the gather stream, which is
// not the GradReducer's stream (it runs over the communicator's twin, see
// Communicator::twin), so a gather never queues behind a reduction. Every
// rank issues the same gathers in the same order. (Device gathers,
// DeviceGather below, run on the stream they are given: the engine's GPU
// reduction stream, where they do queue behind reductions.)
// Threading: the training thread only; the gathers run on the stream's
// thread and write the compute copies until they finish.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"
#include "engine/config.h"
#include "engine/engine_stats.h"
#include "engine/model.h"
#include "engine/shard.h"

namespace zinc {

class ParamCoordinator {
 public:
  // Sizes in elements; defaults are DeepSpeed's.
  // Its settings are zero_optimization's own (engine/config.h, where each
  // default and cost is written): allgather_bucket_size (stages 1-2) and the
  // stage3_* limits.

  // Where acquires come from: a training micro-step (forward and backward,
  // traced and prefetched) or an evaluation forward (gathered on demand).
  enum class Pass { kNone, kTrain, kEval };

  // `blocks` (partitions set) and `memory` must outlive the coordinator. At
  // stage 3 the engine then hands it every block's initial shard
  // (set_initial_shard) and calls start(). `gather` (null for one rank) runs the
  // parameter all-gathers. `nvme` (stage 3, offload_param "nvme"): the store
  // the shards of the blocks that do not persist move to; the coordinator
  // owns it and, after the constructor, uses it only from the gather
  // stream's thread. `pin` page-locks the buffers shards are read into.
  ParamCoordinator(const StagePlan& plan, std::vector<BlockShard>& blocks, DType compute,
                   comm::CommStream* gather, StateMemory& memory, const ZeroConfig& zero,
                   std::unique_ptr<offload::NvmeStore> nvme = nullptr, bool pin = false);
  ~ParamCoordinator();
  // Stage 3: which blocks stay gathered (stage3_param_persistence_threshold,
  // and stage3_model_persistence_threshold over the blocks in order), from
  // their layouts alone.
  static std::vector<bool> persistent_blocks(const std::vector<BlockLayout>& layouts, const ZeroConfig& zero);
  // Bytes a block's compute shard takes in the parameter file and in each
  // buffer it is read into or written from (4 KiB-aligned for O_DIRECT).
  static int64_t nvme_shard_bytes(const Partition& part, DType compute);

  // Stage 3: block's initial compute shard from its own fp32 elements
  // (part.shard_numel): kept in RAM (page-locked with offload_param "cpu"),
  // or, with offload_param "nvme" for a block that does not persist,
  // converted into a staging buffer and written straight to the parameter
  // file, so that no rank ever holds all its shards (Note [ZeRO-3 parameter
  // coordination]). Every block once, before start().
  void set_initial_shard(int block, const float* own);
  // Stage 3, after every initial shard: the persistent blocks are gathered
  // and the staging buffer goes.
  void start();

  // Stages 0-2 only (tests): every block gathered, no communication.
  ParamCoordinator(std::vector<BlockShard>& blocks, DType compute);

  // Stage 3 with the gathers on the GPU (the engine's GPU path on several
  // ranks, Note [the GPU path] in engine.cpp): the state machine, trace,
  // prefetch and limits stay the coordinator's, but a block's gather is
  // `gather` on `stream` (whose communicator reaches GPU memory) into the
  // GPU's copy, and nothing is allocated in RAM for it; acquire() then hands
  // out a null base (the engine substitutes the GPU's).
  struct DeviceGather {
    comm::CommStream* stream = nullptr;  // null: the coordinator's own gather stream
    std::function<void(int block)> begin;                        // training thread, before the submit
    std::function<void(comm::Communicator&, int block)> gather;  // the stream's thread
    std::function<void(int block)> end;                          // training thread: the block is freed
  };
  // Switches to device gathers (no offload_param "nvme"): the persistent
  // blocks gathered in RAM so far are freed and gathered again that way.
  void use_device_gather(DeviceGather g);

  BlockParams acquire(int block);
  // No-throw (it runs from HeldParams' destructor): a release without an
  // acquire is an invariant broken inside zinc, not a model error, because
  // models release through handles.
  void release(int block) noexcept;
  // The first block still held (-1: none); the engine checks it after a
  // model's forward and backward.
  int first_held() const;

  // A training micro-step's forward starts (kTrain: the acquires up to
  // end_pass() are one pass of the trace) or an evaluation forward (kEval).
  void begin_pass(Pass pass);
  // The pass ended (after backward, or after the evaluation forward). The
  // first training pass, and any that departed from the trace, become the
  // trace, once every rank is checked to have made the same acquires.
  void end_pass();

  // Before the optimizer writes the compute shards: waits for every gather
  // in flight (stage 3). Ends any stream_next_gather not yet gathered.
  void before_update();
  // Where the optimizer writes block's new compute shard: the shard itself,
  // or for a shard on NVMe a buffer that finish_update() writes back.
  char* shard_to_update(int block);
  // The optimizer is done with the block: a new shard on NVMe goes back to
  // disk on the gather stream (ahead of any later read of it), and its
  // buffer is freed when written, so RAM holds about one block's update.
  void finish_update(int block);
  // After the update. Stages 1, 2: every rank's new shard of every block to
  // every rank, in place in the compute copies, in buckets. Stage 3: the
  // blocks that stay gathered are gathered again (their copies are stale),
  // others are freed, and the start of the trace is prefetched. Returns when
  // the stage 1, 2 gathers have arrived.
  void gather_after_step();
  // Stages 1-2 on several ranks, for the update about to run (Note [the
  // gather streamed behind the update]): each bucket of the all-gather
  // starts as soon as the update has finished its blocks, and `gathered(b)`
  // runs on the gather stream's thread once block b has arrived.
  // After before_update; gather_after_step submits what is left and returns
  // when all has arrived, and the next update gathers as before unless this
  // is called again.
  void stream_next_gather(std::function<void(int)> gathered);

  // Observations for tests and benchmarks (stage 3).
  using Stats = ParamGatherStats;
  const Stats& stats() const { return stats_; }
  // Bytes moved by the parameter store (offload_param "nvme"; else 0).
  int64_t nvme_bytes_read() const { return nvme_ ? nvme_->bytes_read() : 0; }
  int64_t nvme_bytes_written() const { return nvme_ ? nvme_->bytes_written() : 0; }
  // The recorded order of a training pass's acquires (block numbers).
  const std::vector<int>& trace() const { return trace_; }

 private:
  enum class Mode { kRecording, kFollowing };
  void lay_out_nvme_file();
  void gather_all_stages_1_2();
  std::vector<std::vector<BlockShard*>> gather_buckets_1_2();
  void submit_gather_bucket(const std::vector<BlockShard*>& bucket);
  void submit_streamed_buckets(bool all);
  void start_gather(BlockShard& s, bool prefetch);
  void wait_gather(BlockShard& s);
  void free_gathered(BlockShard& s);
  void prefetch_from(size_t pos);
  void drain_prefetches();
  void check_agreement(int value, size_t pos);
  void finish_trace();
  bool keep_after_release(int block) const;

  std::unique_ptr<offload::NvmeStore> nvme_;
  int nvme_file_ = -1;
  offload::PinnedBuffer staging_;  // stage 3 with NVMe, until start(): an initial shard on its way to disk
  bool started_ = false;
  DeviceGather device_;  // device_.stream set: gathers on the GPU
  bool pin_ = false;
  StagePlan plan_;
  std::vector<BlockShard>& blocks_;
  DType compute_;
  comm::CommStream* gather_ = nullptr;
  StateMemory* memory_ = nullptr;
  ZeroConfig zero_;

  Pass pass_ = Pass::kNone;
  Mode mode_ = Mode::kRecording;
  std::vector<int> trace_;         // block acquired at each position of a training pass
  std::vector<int64_t> reuse_at_;  // per trace position: elements acquired until the same block's next use
  std::vector<int> current_;       // this training pass's acquires so far
  std::vector<size_t> last_pos_;   // per block: the position of its latest acquire in this pass
  bool warned_departure_ = false;
  std::vector<comm::CommHandle> pending_writes_;  // NVMe write-backs of the last step
  // stream_next_gather: what runs as a block arrives (empty: not streaming),
  // the buckets, which blocks the update has finished, the next bucket to submit.
  std::function<void(int)> streamed_;
  std::vector<std::vector<BlockShard*>> stream_buckets_;
  std::vector<char> stream_updated_;
  size_t stream_next_ = 0;
  Stats stats_;
};

}  // namespace zinc
