#include "offload/swapper.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace zinc::offload {

namespace {
constexpr int64_t kAlign = 1024;  // elements: 4 KiB of fp32
int64_t round_up_elems(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

OptimizerSwapper::Plan OptimizerSwapper::plan(const SwapperOptions& options, const std::vector<int64_t>& span_numel) {
  Plan p;
  const int64_t group = std::max<int64_t>(kAlign, options.sub_group_size / kAlign * kAlign);
  for (size_t b = 0; b < span_numel.size(); ++b) {
    // Every span is a multiple of 1024 elements (engine/partition.h).
    for (int64_t off = 0; off < span_numel[b]; off += group) {
      const int64_t count = round_up_elems(std::min(group, span_numel[b] - off));
      p.groups.push_back({static_cast<int>(b), off, count, p.file_bytes});
      p.file_bytes += 3 * count * 4;
      p.max_count = std::max(p.max_count, count);
    }
  }
  p.buffer_count = std::max<int64_t>(2, options.buffer_count);
  p.buffer_bytes = p.buffer_count * static_cast<int64_t>(PinnedBuffer::footprint(static_cast<size_t>(3 * p.max_count * 4)));
  return p;
}

OptimizerSwapper::OptimizerSwapper(const SwapperOptions& options, int rank,
                                   const std::vector<int64_t>& span_numel)
    : span_numel_(span_numel) {
  NvmeOptions o = options.nvme;
  Plan p = plan(options, span_numel);
  groups_ = std::move(p.groups);
  max_count_ = p.max_count;
  for (int64_t i = 0; i < p.buffer_count; ++i) {
    buffers_.emplace_back(static_cast<size_t>(3 * max_count_ * 4), options.pin_memory);
    o.fixed_buffers.emplace_back(buffers_.back().data(), buffers_.back().bytes());
  }
  store_ = std::make_unique<NvmeStore>(o, rank, options.engine_factory);
  file_ = store_->create("optimizer_states", p.file_bytes);
}

OptimizerSwapper::~OptimizerSwapper() = default;

void OptimizerSwapper::init_block(int block, const float* master) {
  float* buf = buffers_[0].as<float>();
  for (const SubGroup& g : groups_) {
    if (g.block != block) continue;
    const int64_t used = std::min(g.count, span_numel_[block] - g.offset);
    std::memset(buf, 0, static_cast<size_t>(3 * g.count * 4));
    std::memcpy(buf, master + g.offset, static_cast<size_t>(used) * 4);
    store_->write(file_, g.file_offset, buf, 3 * g.count * 4).wait();
  }
}

void OptimizerSwapper::for_each(const std::function<void(const SubGroup&, float*, float*, float*)>& fn,
                                bool write_back, bool read) {
  const size_t n = groups_.size(), nb = buffers_.size();
  std::vector<IoTicket> reads(n), writes(n);
  auto buf = [&](size_t i) { return buffers_[i % nb].as<float>(); };
  auto bytes = [&](size_t i) { return 3 * groups_[i].count * 4; };
  // Buffer i % nb is free for sub-group i once sub-group i - nb is written.
  size_t next_read = 0;
  auto issue_reads = [&](size_t upto) {
    for (; next_read < n && next_read < upto; ++next_read) {
      if (next_read >= nb) writes[next_read - nb].wait();
      reads[next_read] = store_->read(file_, groups_[next_read].file_offset, buf(next_read), bytes(next_read));
    }
  };
  if (read) issue_reads(nb - 1);  // keep one buffer for the write of the group in hand
  for (size_t i = 0; i < n; ++i) {
    if (read) reads[i].wait();
    else if (i >= nb) writes[i - nb].wait();  // the buffer's previous group is on disk
    const SubGroup& g = groups_[i];
    float* b = buf(i);
    fn(g, b, b + g.count, b + 2 * g.count);
    if (write_back) writes[i] = store_->write(file_, g.file_offset, b, bytes(i));
    if (read) issue_reads(i + nb);
  }
  for (size_t i = 0; i < n; ++i) writes[i].wait();
}

void OptimizerSwapper::read_master(int block, float* out) {
  float* buf = buffers_[0].as<float>();
  for (const SubGroup& g : groups_) {
    if (g.block != block) continue;
    store_->read(file_, g.file_offset, buf, g.count * 4).wait();
    const int64_t used = std::min(g.count, span_numel_[block] - g.offset);
    std::memcpy(out + g.offset, buf, static_cast<size_t>(used) * 4);
  }
}

int64_t OptimizerSwapper::bytes_read() const { return store_->bytes_read(); }
int64_t OptimizerSwapper::bytes_written() const { return store_->bytes_written(); }
int64_t OptimizerSwapper::buffer_bytes() const {
  int64_t s = 0;
  for (const auto& b : buffers_) s += static_cast<int64_t>(b.footprint());
  return s;
}
const std::string& OptimizerSwapper::folder() const { return store_->folder(); }

}  // namespace zinc::offload
