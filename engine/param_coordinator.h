// zinc engine, private: the parameter coordinator (DESIGN.md's
// ParamCoordinator). acquire(block) hands the model the block's full
// compute-precision parameters and release(block) takes them back; the model
// holds them through a HeldParams handle (engine/model.h), so an exception
// cannot leave a block held. Stages 0-2 keep every block gathered, so here
// acquire only counts and release only checks, and after each update
// gather_after_step() all-gathers the ranks' new shards (stages 1, 2).
// ZeRO-3 will gather on acquire (waiting on a prefetch), record the order of
// acquires, and free on release.
//
// Streams: the coordinator's collectives run on the gather stream, which is
// not the GradReducer's stream (over a duplicate communicator, see
// Communicator::duplicate), so a gather never queues behind a reduction.
// Every rank issues the same gathers in the same order.
// Threading: the training thread only; the gathers run on the stream's
// thread and write the compute copies until they finish.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"
#include "engine/model.h"
#include "engine/shard.h"

namespace zinc {

class ParamCoordinator {
 public:
  // `blocks` must outlive the coordinator. `gather` (null for one rank) runs
  // the parameter all-gathers, in buckets of `allgather_bucket_numel`
  // elements (zero_optimization.allgather_bucket_size).
  ParamCoordinator(std::vector<BlockShard>& blocks, DType compute, comm::CommStream* gather = nullptr,
                   int64_t allgather_bucket_numel = 500000000)
      : blocks_(blocks), compute_(compute), gather_(gather), bucket_numel_(allgather_bucket_numel) {}

  BlockParams acquire(int block);
  // No-throw (it runs from HeldParams' destructor): a release without an
  // acquire is an invariant broken inside zinc, not a model error, because
  // models release through handles.
  void release(int block) noexcept;
  // The first block still held (-1: none); the engine checks it after a
  // model's forward and backward.
  int first_held() const;

  // Stages 1 and 2, after the update: every rank's new shard of every block
  // to every rank, in place in the compute copies, in buckets; returns when
  // all have arrived. Needs the gather stream.
  void gather_after_step();

 private:
  std::vector<BlockShard>& blocks_;
  DType compute_;
  comm::CommStream* gather_;
  int64_t bucket_numel_;
};

}  // namespace zinc
