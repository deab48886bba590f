// zinc engine, private: where the optimizer state lives (docs/design.md's
// optimizer-state interface). Each rank's fp32 master weights and Adam
// moments m, v of its optimizer spans (one per block: the whole padded block
// at stage 0, else the rank's shard) live in RAM, in page-locked RAM
// (offload_optimizer.device "cpu") or on NVMe ("nvme", streamed through the
// offload swapper). One visitor, for_each, walks every span wherever it
// lives; the Adam update and checkpoints (their save and load) use it.
// Threading: the training thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/config.h"
#include "engine/shard.h"
#include "offload/swapper.h"

namespace zinc {

// A piece of one block's optimizer span, in memory for the visitor.
struct StateSpan {
  int block = 0;
  int64_t offset = 0;  // elements, within the block's span
  int64_t count = 0;   // elements
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  // The span's reduced gradient where the state keeps the gradients (ZeRO-3
  // with the optimizer on NVMe: OptimizerState::keeps_gradients) and the
  // walk reads them; else null (the gradient is the GradReducer's).
  const float* grad = nullptr;
};

class OptimizerState {
 public:
  virtual ~OptimizerState() = default;
  // Sets a block's master weights (span_numel[block] elements) and zeroes
  // its moments.
  virtual void init_block(int block, const float* master) = 0;
  // After the last init_block: waits for writes still in flight (NVMe) and
  // rethrows a failed one.
  virtual void finish_init() {}
  // Calls fn on every span in block order (NVMe: sub-group by sub-group, the
  // next read and the previous written while fn runs); what fn leaves in
  // master, m and v is kept.
  virtual void for_each(const std::function<void(const StateSpan&)>& fn) = 0;
  // The same walk for a reader (a checkpoint save; Lamb's norms, which ask
  // for the gradients too): fn must not change the span, and on NVMe
  // nothing is written back.
  virtual void for_each_read(const std::function<void(const StateSpan&)>& fn, bool grads = false) {
    (void)grads;
    for_each(fn);
  }
  // The same walk for a writer that sets every element of every span (a
  // checkpoint load): on NVMe the old values are not read first.
  virtual void for_each_overwrite(const std::function<void(const StateSpan&)>& fn) { for_each(fn); }
  // Copies a block's master weights (span_numel[block] elements) to out.
  virtual void read_master(int block, float* out) = 0;
  // The block's master weights where they stay in memory (RAM, pinned RAM),
  // null on NVMe.
  virtual float* master_in_memory(int block) = 0;
  // Whether the state keeps the reduced gradients too (on NVMe, with
  // SwapperOptions::gradients): then write_gradients stores a block's, and
  // for_each (and for_each_read asked for them) hands them over in
  // StateSpan::grad.
  virtual bool keeps_gradients() const { return false; }
  // Stores block's reduced gradient (span_numel[block] fp32 elements). May
  // run on the reduction stream's thread while the training thread leaves
  // the state alone.
  virtual void write_gradients(int block, const float* grad) {
    (void)block;
    (void)grad;
    throw Error("OptimizerState: this state keeps no gradients");
  }
  // NVMe traffic so far (0 in memory).
  virtual int64_t bytes_read() const { return 0; }
  virtual int64_t bytes_written() const { return 0; }
};

// device: kNone (RAM), kCpu (page-locked RAM; pin_memory false or a
// refused mlock gives ordinary memory) or kNvme (the swapper with `nvme`
// options). span_numel[b]: the elements of block b's span on this rank. The
// memory the state holds is added to `memory`. Throws IoError for an NVMe
// folder that cannot be used.
std::unique_ptr<OptimizerState> make_optimizer_state(OffloadDevice device,
                                                     const std::vector<int64_t>& span_numel, bool pin_memory,
                                                     const offload::SwapperOptions& nvme, int rank,
                                                     StateMemory& memory);

}  // namespace zinc
