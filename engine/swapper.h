// zinc engine, private: the pipelined optimizer swapper for NVMe offload of
// optimizer states (zero_optimization.offload_optimizer.device = "nvme").
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
// Threading: used by the training thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "offload/offload.h"

namespace zinc {

class OptimizerSwapper {
 public:
  struct SubGroup {
    int block;
    int64_t offset;  // within the block's optimizer span (elements)
    int64_t count;   // elements, a multiple of 1024
    int64_t file_offset;  // bytes
  };
  // span_numel[b]: elements of block b's optimizer span on this rank.
  OptimizerSwapper(const OffloadConfig& offload, const AioConfig& aio, int rank,
                   const std::vector<int64_t>& span_numel, int64_t sub_group_size);
  ~OptimizerSwapper();

  // Writes a block's initial master weights (span_numel[block] elements) and
  // zero moments.
  void init_block(int block, const float* master);
  // Runs fn on every sub-group in order with its master, m, v in memory; what
  // fn leaves there is written back.
  void for_each(const std::function<void(const SubGroup&, float* master, float* m, float* v)>& fn);
  // Reads a block's master weights (span_numel[block] elements) into out.
  void read_master(int block, float* out);

  int64_t bytes_read() const;
  int64_t bytes_written() const;
  int64_t buffer_bytes() const;  // pinned RAM the swapper holds
  const std::string& folder() const;

 private:
  // Declared before the store, so the store (whose rings have these buffers
  // registered) goes first.
  std::vector<offload::PinnedBuffer> buffers_;  // buffer_count x 3 * max sub-group
  std::unique_ptr<offload::NvmeStore> store_;
  int file_ = -1;
  std::vector<SubGroup> groups_;
  std::vector<int64_t> span_numel_;
  int64_t max_count_ = 0;
};

}  // namespace zinc
