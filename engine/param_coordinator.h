// zinc engine, private: the parameter coordinator (DESIGN.md's
// ParamCoordinator). acquire(block) hands the model the block's full
// compute-precision parameters and release(block) takes them back; the model
// holds them through a HeldParams handle (engine/model.h), so an exception
// cannot leave a block held. Stages 0-2 keep every block gathered, so here
// acquire only counts and release only checks; ZeRO-3 will gather on
// acquire (waiting on a prefetch), record the order of acquires, and free on
// release.
// Threading: the training thread only.
#pragma once

#include <string>
#include <vector>

#include "core/error.h"
#include "engine/model.h"
#include "engine/shard.h"

namespace zinc {

class ParamCoordinator {
 public:
  ParamCoordinator(std::vector<BlockShard>& blocks, DType compute) : blocks_(blocks), compute_(compute) {}

  BlockParams acquire(int block) {
    BlockShard& s = blocks_[static_cast<size_t>(block)];
    ZINC_CHECK(s.param_state == ParamState::kGathered, "stages 0-2 keep every block gathered");
    s.held += 1;
    // At stage 0 in fp32 the master weights are the compute weights.
    const void* base = s.compute.empty() ? static_cast<const void*>(s.master_compute) : s.compute.data();
    return BlockParams{base, compute_, &s.layout};
  }
  // No-throw (it runs from HeldParams' destructor): a release without an
  // acquire is an invariant broken inside zinc, not a model error, because
  // models release through handles.
  void release(int block) noexcept {
    BlockShard& s = blocks_[static_cast<size_t>(block)];
    ZINC_CHECK(s.held > 0, "release of block " + std::to_string(block) + ", which is not held");
    s.held -= 1;
  }
  // The first block still held (-1: none); the engine checks it after a
  // model's forward and backward.
  int first_held() const {
    for (size_t b = 0; b < blocks_.size(); ++b)
      if (blocks_[b].held > 0) return static_cast<int>(b);
    return -1;
  }

 private:
  std::vector<BlockShard>& blocks_;
  DType compute_;
};

}  // namespace zinc
