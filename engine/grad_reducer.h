// zinc engine, private: the gradient reducer (docs/design.md's GradReducer).
//
// Owns the reduction of every block's gradient across ranks: the buckets of
// reduce_bucket_size elements, the reduce-scatter into each rank's shard (and
// at stage 0 the all-gather back into the full gradient), bf16 or fp16 on
// the wire (communication_data_type; fp16 by default with fp16 on), no-sync inside a gradient accumulation, the
// bound on reductions in flight, and at stage 2 freeing each block's full
// gradient once its reduction has run (Note [ZeRO stages] in shard.h).
//
// Order: the model reports blocks ready in the same order on every rank, so
// every rank submits the same collectives in the same order.
// Threading: called by the training thread; the collectives run on the
// CommStream's thread and read the blocks' buffers until they finish.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <vector>

#include "comm/comm.h"
#include "engine/shard.h"

namespace zinc {

class GradReducer {
 public:
  struct Options {
    int64_t bucket_numel = 0;          // elements per bucket: zero_optimization.reduce_bucket_size (set by the engine)
    bool overlap = false;              // overlap_comm: backward goes on while a bucket reduces
    DType wire = DType::kF32;          // the gradients' dtype on the wire (16-bit: several ranks only)
    // The GPU path with reductions on the GPU (Note [the GPU path] in
    // engine.cpp): when set, each block of a bucket is reduced by this call,
    // on the stream's thread and communicator, in the same order, writing
    // the rank's reduced fp32 shard into `shard_out` (stages 1-3; null at
    // stage 0, whose GPU-resident states have the callback all-gather the
    // reduced shards back on the GPU); the host full gradient is not read.
    std::function<void(comm::Communicator&, int block, float* shard_out)> device_reduce;
    // False where the gradients never reach host memory (GPU-resident
    // optimizer states on one rank): no host gradient buffers at all.
    bool host_grads = true;
    // StagePlan::grads_on_nvme: stores a block's reduced shard (fp32,
    // shard_numel elements) and returns when it is stored, on the stream's
    // thread, in the order the blocks are reduced; the buffer it read is
    // then freed. Required with grads_on_nvme (which also needs a stream on
    // one rank: the reduction there is the write).
    std::function<void(int block, const float* shard)> spill;
    // The model writes the host gradient buffers itself (the CPU path), so
    // they may be handed out fresh (Note [gradients written, not zeroed] in
    // engine/model.h); false where the GPU path copies its gradients into
    // them: they are then zeroed whole, as before.
    bool model_grads = true;
  };
  // At most this many buckets are in flight: the next submission waits for
  // the oldest, which bounds the full gradients alive at stage 2.
  static constexpr size_t kMaxInflight = 2;

  // Allocates the gradient buffers the plan keeps from the start and the
  // comm scratch (sized for the largest block). `blocks` must have their
  // partitions set and outlive the reducer; `stream` is null for one rank.
  GradReducer(const StagePlan& plan, std::vector<BlockShard>& blocks, comm::CommStream* stream,
              StateMemory& memory, const Options& options);

  // A backward starts; `boundary`: it ends a global batch (so it reduces).
  void begin_backward(bool boundary);
  // The block's full gradient buffer, allocated if the plan freed it.
  float* grads(int block);
  // Whether this is the first hand-out of the block's buffer since it was
  // last zeroed (Note [gradients written, not zeroed] in engine/model.h);
  // the next call says false until reset_after_step or a new buffer.
  bool take_fresh(int block);
  // The model is done with the block's gradient in this backward: at a
  // boundary it joins the bucket, which is submitted once full (on one rank
  // with grads_on_nvme at once: its reduction is the write).
  void ready(int block);
  // Submits the last, partial bucket of a boundary backward.
  void end_backward();
  // Waits until every reduction of this step has run (rethrows a failure);
  // every block is then kReduced.
  void wait_all();
  // The rank's shard of the block's reduced gradient (valid after wait_all;
  // not with grads_on_nvme, where the optimizer state has it).
  float* reduced_shard(BlockShard& s);
  // The sum of squares of the rank's shard of the block's reduced gradient
  // (after wait_all): with grads_on_nvme computed before the shard was
  // stored, by the same function, so the norm is the same bit for bit.
  double squared_norm(BlockShard& s);
  // After the step: the full gradients are zeroed, or freed where the plan
  // frees them.
  void reset_after_step();

  int64_t buckets_submitted() const { return buckets_submitted_; }

 private:
  void flush_bucket();
  // Zeroes the overwritten parameters of a block no backward was handed yet.
  void settle_fresh(BlockShard& s);
  // The full gradient as the next window's first backward finds it: with
  // model_grads its overwritten parameters left as they are (the backward
  // writes them) and the rest zeroed, handed out fresh; else all zeros.
  void clear_for_window(BlockShard& s);
  void submit(const std::vector<int>& ids);
  void reap();

  StagePlan plan_;
  std::vector<BlockShard>& blocks_;
  comm::CommStream* stream_;
  StateMemory& memory_;
  Options options_;
  bool boundary_ = false;
  std::vector<int> bucket_;  // blocks reported ready, not yet submitted
  int64_t bucket_numel_ = 0;
  std::deque<comm::CommHandle> inflight_;  // submitted, not yet known finished, oldest first
  int64_t buckets_submitted_ = 0;
  // Scratch of the comm thread, reused by every block in turn (the stream
  // runs one task at a time): the reduced shard at stage 0, and the bf16
  // wire copies (full + shard).
  AlignedBuffer scratch_shard_;  // fp32, max shard_numel (stage 0, or grads_on_nvme, several ranks)
  AlignedBuffer scratch_wire_;   // 16-bit wire format, max (padded_numel + shard_numel)
};

}  // namespace zinc
