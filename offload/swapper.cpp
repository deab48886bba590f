#include "offload/swapper.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/alloc.h"
#include "core/error.h"

namespace zinc::offload {

namespace {
constexpr int64_t kAlign = 1024;  // elements: 4 KiB of fp32
int64_t round_up_elems(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

OptimizerSwapper::Plan OptimizerSwapper::plan(const SwapperOptions& options, const std::vector<int64_t>& span_numel) {
  Plan p;
  if (options.sub_group_size <= 0) throw Error("OptimizerSwapper: sub_group_size must be set (elements per sub-group)");
  const int64_t group = std::max<int64_t>(kAlign, options.sub_group_size / kAlign * kAlign);
  for (size_t b = 0; b < span_numel.size(); ++b) {
    // Every span is a multiple of 1024 elements (engine/partition.h).
    for (int64_t off = 0; off < span_numel[b]; off += group) {
      const int64_t count = round_up_elems(std::min(group, span_numel[b] - off));
      p.groups.push_back({static_cast<int>(b), off, count, p.file_bytes, p.grad_file_bytes});
      p.file_bytes += 3 * count * 4;
      if (options.gradients) p.grad_file_bytes += count * 4;
      p.max_count = std::max(p.max_count, count);
    }
  }
  p.buffer_count = std::max<int64_t>(2, options.buffer_count);
  const int64_t regions = options.gradients ? 4 : 3;
  p.buffer_bytes =
      p.buffer_count * static_cast<int64_t>(PinnedBuffer::footprint(static_cast<size_t>(regions * p.max_count * 4)));
  return p;
}

OptimizerSwapper::OptimizerSwapper(const SwapperOptions& options, int rank,
                                   const std::vector<int64_t>& span_numel)
    : span_numel_(span_numel) {
  NvmeOptions o = options.nvme;
  Plan p = plan(options, span_numel);
  groups_ = std::move(p.groups);
  max_count_ = p.max_count;
  region_ = options.gradients ? 4 : 3;
  for (int64_t i = 0; i < p.buffer_count; ++i) {
    buffers_.emplace_back(static_cast<size_t>(region_ * max_count_ * 4), options.pin_memory);
    o.fixed_buffers.emplace_back(buffers_.back().data(), buffers_.back().bytes());
  }
  store_ = std::make_unique<NvmeStore>(o, rank, options.engine_factory);
  file_ = store_->create("optimizer_states", p.file_bytes);
  if (options.gradients) {
    // A store of its own: its writes come from the reduction stream's thread.
    NvmeOptions g = options.nvme;
    g.fixed_buffers.clear();
    grad_store_ = std::make_unique<NvmeStore>(g, rank, options.engine_factory);
    grad_file_ = grad_store_->create("gradients", p.grad_file_bytes);
  }
}

OptimizerSwapper::~OptimizerSwapper() = default;

// The sub-groups' first writes go through every buffer in turn, each
// waited for only when its buffer comes round again (or by finish_init),
// so the disk writes one while the next is filled.
void OptimizerSwapper::init_block(int block, const float* master) {
  const size_t nb = buffers_.size();
  if (init_writes_.empty()) init_writes_.resize(nb);
  for (const SubGroup& g : groups_) {
    if (g.block != block) continue;
    const size_t k = next_init_++ % nb;
    init_writes_[k].wait();  // the buffer's previous sub-group is on disk
    float* buf = buffers_[k].as<float>();
    const int64_t used = std::min(g.count, span_numel_[block] - g.offset);
    std::memset(buf, 0, static_cast<size_t>(3 * g.count * 4));
    std::memcpy(buf, master + g.offset, static_cast<size_t>(used) * 4);
    init_writes_[k] = store_->write(file_, g.file_offset, buf, 3 * g.count * 4);
  }
}

void OptimizerSwapper::finish_init() {
  for (IoTicket& t : init_writes_) t.wait();
}

void OptimizerSwapper::write_gradients(int block, const float* grad) {
  ZINC_CHECK(grad_store_ != nullptr, "OptimizerSwapper::write_gradients: the swapper keeps no gradients");
  int64_t offset = -1;
  for (const SubGroup& g : groups_)
    if (g.block == block) {
      offset = g.grad_offset;
      break;
    }
  ZINC_CHECK(offset >= 0, "OptimizerSwapper::write_gradients: no block " + std::to_string(block));
  // Spans are multiples of 1024 elements and a block's sub-groups are
  // consecutive in the file, so the span is one 4 KiB-aligned range.
  const int64_t bytes = span_numel_[static_cast<size_t>(block)] * 4;
  if (reinterpret_cast<uintptr_t>(grad) % 4096 == 0) {
    grad_store_->write(grad_file_, offset, grad, bytes).wait();
    return;
  }
  // Small blocks come from the heap, 64-byte aligned: through a staging page.
  constexpr int64_t kStaging = int64_t{1} << 20;
  AlignedBuffer staging(static_cast<size_t>(std::min(bytes, kStaging)), kPageAlign);
  for (int64_t at = 0; at < bytes; at += kStaging) {
    const int64_t n = std::min(kStaging, bytes - at);
    std::memcpy(staging.data(), reinterpret_cast<const char*>(grad) + at, static_cast<size_t>(n));
    grad_store_->write(grad_file_, offset + at, staging.data(), n).wait();
  }
}

void OptimizerSwapper::for_each(const Visitor& fn, bool write_back, bool read, bool grads) {
  finish_init();
  const size_t n = groups_.size(), nb = buffers_.size();
  grads = grads && read && grad_store_ != nullptr;
  std::vector<IoTicket> reads(n), grad_reads(n), writes(n);
  auto buf = [&](size_t i) { return buffers_[i % nb].as<float>(); };
  auto bytes = [&](size_t i) { return 3 * groups_[i].count * 4; };
  // Buffer i % nb is free for sub-group i once sub-group i - nb is written.
  size_t next_read = 0;
  auto issue_reads = [&](size_t upto) {
    for (; next_read < n && next_read < upto; ++next_read) {
      if (next_read >= nb) writes[next_read - nb].wait();
      const SubGroup& g = groups_[next_read];
      reads[next_read] = store_->read(file_, g.file_offset, buf(next_read), bytes(next_read));
      if (grads) grad_reads[next_read] = grad_store_->read(grad_file_, g.grad_offset, buf(next_read) + 3 * g.count, g.count * 4);
    }
  };
  if (read) issue_reads(nb - 1);  // keep one buffer for the write of the group in hand
  for (size_t i = 0; i < n; ++i) {
    if (read) reads[i].wait();
    else if (i >= nb) writes[i - nb].wait();  // the buffer's previous group is on disk
    if (grads) grad_reads[i].wait();
    const SubGroup& g = groups_[i];
    float* b = buf(i);
    fn(g, b, b + g.count, b + 2 * g.count, grads ? b + 3 * g.count : nullptr);
    if (write_back) writes[i] = store_->write(file_, g.file_offset, b, bytes(i));
    if (read) issue_reads(i + nb);
  }
  for (size_t i = 0; i < n; ++i) writes[i].wait();
}

void OptimizerSwapper::read_master(int block, float* out) {
  finish_init();
  float* buf = buffers_[0].as<float>();
  for (const SubGroup& g : groups_) {
    if (g.block != block) continue;
    store_->read(file_, g.file_offset, buf, g.count * 4).wait();
    const int64_t used = std::min(g.count, span_numel_[block] - g.offset);
    std::memcpy(out + g.offset, buf, static_cast<size_t>(used) * 4);
  }
}

int64_t OptimizerSwapper::bytes_read() const {
  return store_->bytes_read() + (grad_store_ ? grad_store_->bytes_read() : 0);
}
int64_t OptimizerSwapper::bytes_written() const {
  return store_->bytes_written() + (grad_store_ ? grad_store_->bytes_written() : 0);
}
int64_t OptimizerSwapper::buffer_bytes() const {
  int64_t s = 0;
  for (const auto& b : buffers_) s += static_cast<int64_t>(b.footprint());
  return s;
}
const std::string& OptimizerSwapper::folder() const { return store_->folder(); }

}  // namespace zinc::offload
