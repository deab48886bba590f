#include "engine/optimizer_state.h"

#include <cstring>

#include "core/error.h"

namespace zinc {
namespace {

// master, m, v of one block side by side in memory.
struct InMemorySpan {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
};

// RAM ("none"): three aligned buffers per block.
class RamState final : public OptimizerState {
 public:
  RamState(const std::vector<int64_t>& span_numel, StateMemory& memory) : numel_(span_numel) {
    for (int64_t n : span_numel) {
      const size_t bytes = static_cast<size_t>(n) * 4;
      master_.push_back(memory.alloc(bytes));
      m_.push_back(memory.alloc(bytes));
      v_.push_back(memory.alloc(bytes));
    }
  }
  void init_block(int b, const float* master) override {
    std::memcpy(master_[b].data(), master, static_cast<size_t>(numel_[b]) * 4);
  }
  void for_each(const std::function<void(const StateSpan&)>& fn) override {
    for (size_t b = 0; b < numel_.size(); ++b)
      if (numel_[b] > 0)  // 0: a frozen block (no state)
        fn({static_cast<int>(b), 0, numel_[b], master_[b].as<float>(), m_[b].as<float>(), v_[b].as<float>()});
  }
  void read_master(int b, float* out) override {
    std::memcpy(out, master_[b].data(), static_cast<size_t>(numel_[b]) * 4);
  }
  float* master_in_memory(int b) override { return master_[b].as<float>(); }

 private:
  std::vector<int64_t> numel_;
  std::vector<AlignedBuffer> master_, m_, v_;
};

// Page-locked RAM ("cpu"): one pinned buffer of 3 x span per block.
class PinnedState final : public OptimizerState {
 public:
  PinnedState(const std::vector<int64_t>& span_numel, bool pin_memory, StateMemory& memory) : numel_(span_numel) {
    for (int64_t n : span_numel) {
      buffers_.emplace_back(static_cast<size_t>(3 * n) * 4, pin_memory);
      memory.add(static_cast<int64_t>(buffers_.back().footprint()));
    }
  }
  void init_block(int b, const float* master) override {
    std::memcpy(span(b).master, master, static_cast<size_t>(numel_[b]) * 4);
  }
  void for_each(const std::function<void(const StateSpan&)>& fn) override {
    for (size_t b = 0; b < numel_.size(); ++b) {
      if (numel_[b] == 0) continue;  // a frozen block (no state)
      InMemorySpan s = span(static_cast<int>(b));
      fn({static_cast<int>(b), 0, numel_[b], s.master, s.m, s.v});
    }
  }
  void read_master(int b, float* out) override {
    std::memcpy(out, span(b).master, static_cast<size_t>(numel_[b]) * 4);
  }
  float* master_in_memory(int b) override { return span(b).master; }

 private:
  InMemorySpan span(int b) {
    float* base = buffers_[static_cast<size_t>(b)].as<float>();
    return {base, base + numel_[b], base + 2 * numel_[b]};
  }
  std::vector<int64_t> numel_;
  std::vector<offload::PinnedBuffer> buffers_;
};

// NVMe ("nvme"): the offload swapper streams sub-groups through pinned
// buffers.
class NvmeState final : public OptimizerState {
 public:
  NvmeState(const std::vector<int64_t>& span_numel, const offload::SwapperOptions& options, int rank,
            StateMemory& memory)
      : swapper_(options, rank, span_numel) {
    memory.add(swapper_.buffer_bytes());
  }
  void init_block(int b, const float* master) override { swapper_.init_block(b, master); }
  void finish_init() override { swapper_.finish_init(); }
  void for_each(const std::function<void(const StateSpan&)>& fn) override {
    swapper_.for_each(visitor(fn), /*write_back=*/true, /*read=*/true, /*grads=*/true);
  }
  void for_each_read(const std::function<void(const StateSpan&)>& fn, bool grads) override {
    swapper_.for_each(visitor(fn), /*write_back=*/false, /*read=*/true, grads);
  }
  void for_each_overwrite(const std::function<void(const StateSpan&)>& fn) override {
    swapper_.for_each(visitor(fn), /*write_back=*/true, /*read=*/false);
  }
  bool keeps_gradients() const override { return swapper_.keeps_gradients(); }
  void write_gradients(int block, const float* grad) override { swapper_.write_gradients(block, grad); }
  void read_master(int b, float* out) override { swapper_.read_master(b, out); }
  float* master_in_memory(int) override { return nullptr; }
  int64_t bytes_read() const override { return swapper_.bytes_read(); }
  int64_t bytes_written() const override { return swapper_.bytes_written(); }

 private:
  static offload::OptimizerSwapper::Visitor visitor(const std::function<void(const StateSpan&)>& fn) {
    return [&fn](const offload::OptimizerSwapper::SubGroup& g, float* master, float* m, float* v, const float* grad) {
      fn({g.block, g.offset, g.count, master, m, v, grad});
    };
  }
  offload::OptimizerSwapper swapper_;
};

}  // namespace

std::unique_ptr<OptimizerState> make_optimizer_state(OffloadDevice device,
                                                     const std::vector<int64_t>& span_numel, bool pin_memory,
                                                     const offload::SwapperOptions& nvme, int rank,
                                                     StateMemory& memory) {
  switch (device) {
    case OffloadDevice::kNone: return std::make_unique<RamState>(span_numel, memory);
    case OffloadDevice::kCpu: return std::make_unique<PinnedState>(span_numel, pin_memory, memory);
    case OffloadDevice::kNvme: return std::make_unique<NvmeState>(span_numel, nvme, rank, memory);
  }
  throw Error("optimizer state: unknown device");
}

}  // namespace zinc
