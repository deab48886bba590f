// zinc offload: the pipelined optimizer swapper for NVMe offload of
// optimizer states (zero_optimization.offload_optimizer.device = "nvme";
// the engine builds SwapperOptions from its config).
//
// Each rank's fp32 master weights and Adam m, v (12 bytes per parameter of
// its shards) live in one file of the rank's NvmeStore, cut into sub-groups
// of at most sub_group_size elements (multiples of 1024, so every transfer is
// 4 KiB aligned); a sub-group's region holds [master | m | v]. A step streams
// the sub-groups through buffer_count pinned buffers: while the optimizer
// updates sub-group i, sub-group i+1 (and further, with more buffers) is read
// and sub-group i-1 written back. A failed read or write ends the step with
// the store's IoError; the state on disk is then not used again (the store
// is scratch of this run, removed at exit, never read by a new run). The
// buffers are registered with the store's rings (fixed-buffer I/O).
//
// Gradients (SwapperOptions::gradients; ZeRO-3 with the optimizer on NVMe,
// as DeepSpeed's stage 3 swaps them): each span's reduced fp32 gradient
// goes to a second file, in a store of its own, as soon as backward has it
// (write_gradients), so no rank holds the gradients of all its shards at
// once; each sub-group's gradient is read with its states into a fourth
// region of the buffer. The buffers then hold 16 bytes per element.
//
// Threading: used by the training thread only, except write_gradients,
// which may run on another thread (the engine's reduction stream) while the
// training thread does not use the swapper.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "offload/offload.h"

namespace zinc::offload {

struct SwapperOptions {
  // The store: nvme_path and the aio settings. fixed_buffers is filled by the
  // swapper (its pinned buffers).
  NvmeOptions nvme;
  // Pinned buffers the sub-groups stream through (at least 2): with k
  // buffers, k - 1 sub-groups are read ahead. Each holds 3 x sub_group_size
  // fp32 (12 bytes per element).
  int64_t buffer_count = 4;
  // Page-lock the buffers (falls back to ordinary memory with a warning when
  // the memlock limit refuses).
  bool pin_memory = false;
  // Elements per sub-group, rounded down to a multiple of 1024 (at least
  // 1024): larger sub-groups mean fewer, larger transfers and more RAM. The
  // engine sets it from zero_optimization.sub_group_size (whose default is
  // engine/config.h's).
  int64_t sub_group_size = 0;
  // The spans' gradients live on NVMe too (write_gradients; for_each hands
  // each sub-group's gradient to fn).
  bool gradients = false;
  // Makes each ring's I/O engine (tests: a fault-injecting one); null means
  // io_uring.
  std::function<std::unique_ptr<IoEngine>(const NvmeOptions&)> engine_factory;
};

class OptimizerSwapper {
 public:
  struct SubGroup {
    int block;
    int64_t offset;  // within the block's optimizer span (elements)
    int64_t count;   // elements, a multiple of 1024
    int64_t file_offset;  // bytes
    int64_t grad_offset;  // bytes, in the gradient file (SwapperOptions::gradients)
  };
  // The layout a swapper takes for these spans, without building it: its
  // sub-groups, its file's size and the pinned RAM of its buffers (what
  // zinc-train --estimate reports).
  struct Plan {
    std::vector<SubGroup> groups;
    int64_t max_count = 0;     // elements of the largest sub-group
    int64_t file_bytes = 0;    // the optimizer_states file: 12 bytes per element of every sub-group
    int64_t grad_file_bytes = 0;  // the gradients file: 4 bytes per element (0 without gradients)
    int64_t buffer_count = 0;  // pinned buffers
    int64_t buffer_bytes = 0;  // all of them together
  };
  static Plan plan(const SwapperOptions& options, const std::vector<int64_t>& span_numel);

  // span_numel[b]: elements of block b's optimizer span on this rank.
  // Throws IoError naming the path when the store cannot be created.
  OptimizerSwapper(const SwapperOptions& options, int rank, const std::vector<int64_t>& span_numel);
  ~OptimizerSwapper();

  // Writes a block's initial master weights (span_numel[block] elements) and
  // zero moments; `master` may be reused on return, the writes may still be
  // in flight (for_each and read_master wait for them first; finish_init
  // waits and rethrows a failed one).
  void init_block(int block, const float* master);
  void finish_init();
  // Runs fn on every sub-group in order with its master, m, v in memory; what
  // fn leaves there is written back (write_back false: a reader's pass, which
  // writes nothing; read false: a writer's pass, in which fn sets every
  // element and nothing is read first). `grad` is the sub-group's gradient
  // as write_gradients left it when `grads` is set and the swapper keeps
  // gradients, else null.
  using Visitor = std::function<void(const SubGroup&, float* master, float* m, float* v, const float* grad)>;
  void for_each(const Visitor& fn, bool write_back = true, bool read = true, bool grads = false);
  // Writes block's gradient (span_numel[block] fp32 elements) to the
  // gradient file and waits. `grad` need not be aligned (an unaligned one is
  // copied through a staging page). Throws IoError.
  void write_gradients(int block, const float* grad);
  bool keeps_gradients() const { return grad_store_ != nullptr; }
  // Reads a block's master weights (span_numel[block] elements) into out.
  void read_master(int block, float* out);

  int64_t bytes_read() const;
  int64_t bytes_written() const;
  int64_t buffer_bytes() const;  // pinned RAM the swapper holds (PinnedBuffer::footprint)
  const std::string& folder() const;
  const std::vector<SubGroup>& sub_groups() const { return groups_; }

 private:
  // Declared before the store, so the store (whose rings have these buffers
  // registered) goes first.
  std::vector<PinnedBuffer> buffers_;  // buffer_count x 3 * max sub-group
  std::unique_ptr<NvmeStore> store_;
  int file_ = -1;
  std::unique_ptr<NvmeStore> grad_store_;  // SwapperOptions::gradients
  int grad_file_ = -1;
  std::vector<SubGroup> groups_;
  std::vector<int64_t> span_numel_;
  int64_t max_count_ = 0;
  int64_t region_ = 3;  // fp32 regions per buffer: master, m, v (and the gradient)
  // init_block's writes in flight, one per buffer (last: destroyed, so
  // waited for, before the stores).
  std::vector<IoTicket> init_writes_;
  size_t next_init_ = 0;
};

}  // namespace zinc::offload
