// The host-memory DeviceMirror of ZINC_EMULATE_GPU (core/device.h), and
// DeviceMirror::make without CUDA. The "GPU" buffers are host memory, the
// copies memcpy, the GPU-resident AdamW optim::adam_step, the norm
// kernels::squared_norm (whose order the GPU's follows): the engine's GPU
// path runs end to end on the CPU, every step as the GPU would order it.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/alloc.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/device_mirror.h"
#include "kernels/kernels.h"

namespace zinc {
namespace {

class HostMirror final : public DeviceMirror {
 public:
  HostMirror(const std::vector<int64_t>& padded, DType compute) : compute_(compute) {
    for (int64_t n : padded) {
      Block k;
      k.numel = n;
      k.params = AlignedBuffer(static_cast<size_t>(n) * dtype_bytes(compute));
      k.grads = AlignedBuffer(static_cast<size_t>(n) * sizeof(float));
      blocks_.push_back(std::move(k));
    }
  }
  const void* params(int block) override { return b(block).params.data(); }
  void make_current() override {}
  float* grads(int block) override { return b(block).grads.as<float>(); }
  void upload_params(int block, const void* host) override {
    std::memcpy(b(block).params.data(), host, b(block).params.bytes());
  }
  void upload_params_async(int block, const void* host) override { upload_params(block, host); }
  void wait_uploads() override {}
  void register_host(void*, size_t) override {}
  void start_grads_copy(int block) override { b(block).copied = true; }
  bool grads_copied(int block) override { return b(block).copied; }
  void finish_grads_copy(int block, float* host) override {
    Block& k = b(block);
    ZINC_CHECK(k.copied, "finish_grads_copy without start_grads_copy");
    std::memcpy(host, k.grads.data(), k.grads.bytes());
    std::memset(k.grads.data(), 0, k.grads.bytes());  // as the GPU zeroes after its copy
    k.copied = false;
  }
  void enable_states(const std::vector<int64_t>& numel, const std::vector<int64_t>& offset) override {
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& k = blocks_[i];
      k.state_numel = numel[i];
      k.state_offset = offset[i];
      for (AlignedBuffer* a : {&k.master, &k.m, &k.v}) *a = AlignedBuffer(static_cast<size_t>(k.state_numel) * 4);
      if (k.state_numel != k.numel) k.gshard = AlignedBuffer(static_cast<size_t>(k.state_numel) * 4);
    }
  }
  void upload_states(int block, int64_t offset, int64_t count, const float* master, const float* m,
                     const float* v) override {
    Block& k = b(block);
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    if (master) std::memcpy(k.master.as<float>() + offset, master, bytes);
    if (m) std::memcpy(k.m.as<float>() + offset, m, bytes);
    if (v) std::memcpy(k.v.as<float>() + offset, v, bytes);
  }
  void download_states(int block, int64_t offset, int64_t count, float* master, float* m, float* v) override {
    Block& k = b(block);
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    if (master) std::memcpy(master, k.master.as<float>() + offset, bytes);
    if (m) std::memcpy(m, k.m.as<float>() + offset, bytes);
    if (v) std::memcpy(v, k.v.as<float>() + offset, bytes);
  }
  double grad_squared_norm() override {
    double s = 0;
    for (Block& k : blocks_)
      s += k.gshard.empty() ? kernels::squared_norm(k.grads.as<float>(), k.numel)
                            : kernels::squared_norm(k.gshard.as<float>(), k.state_numel);
    return s;
  }
  void adam_step(int block, const optim::AdamParams& p, int64_t step, float grad_scale) override {
    Block& k = b(block);
    char* out = k.params.as<char>() + static_cast<size_t>(k.state_offset) * dtype_bytes(compute_);
    const void* grad = k.gshard.empty() ? k.grads.data() : k.gshard.data();
    optim::adam_step(p, step, grad_scale,
                     optim::AdamSpan{k.master.as<float>(), grad, DType::kF32, k.m.as<float>(), k.v.as<float>(),
                                     compute_ == DType::kBF16 ? reinterpret_cast<bf16*>(out) : nullptr,
                                     k.state_numel});
    if (compute_ != DType::kBF16)
      convert_f32_to_16(k.master.as<float>(), out, static_cast<size_t>(k.state_numel), compute_);
  }
  void gather_params(comm::Communicator& c, int block) override {
    Block& k = b(block);
    c.all_gather(k.params.as<char>() + static_cast<size_t>(k.state_offset) * dtype_bytes(compute_), k.params.data(),
                 k.state_numel, compute_);
  }
  void zero_grads() override {
    for (Block& k : blocks_) std::memset(k.grads.data(), 0, k.grads.bytes());
  }
  void enable_device_reduce(DType wire, int64_t max_shard) override {
    wire_ = wire;
    if (is_16bit(wire)) wire_buf_ = AlignedBuffer(static_cast<size_t>(max_padded() + max_shard) * 2);
  }
  void start_device_reduce(int) override {}
  // The GradReducer's host reduction on the "GPU" buffer, the same calls in
  // the same order (so the emulated run equals the CPU path bit for bit).
  void device_reduce(comm::Communicator& c, int block, int64_t shard, float* out) override {
    Block& k = b(block);
    if (is_16bit(wire_)) {
      uint16_t* full = wire_buf_.as<uint16_t>();
      uint16_t* shard16 = full + k.numel;
      convert_f32_to_16(k.grads.as<float>(), full, static_cast<size_t>(k.numel), wire_);
      c.reduce_scatter(full, shard16, shard, wire_);
      convert_16_to_f32(shard16, out ? out : k.gshard.as<float>(), static_cast<size_t>(shard), wire_);
    } else {
      c.reduce_scatter(k.grads.data(), out ? out : k.gshard.as<float>(), shard, DType::kF32);
    }
    std::memset(k.grads.data(), 0, k.grads.bytes());
  }
  void synchronize() override {}

 private:
  struct Block {
    int64_t numel = 0;
    AlignedBuffer params, grads, master, m, v, gshard;
    int64_t state_numel = 0, state_offset = 0;
    bool copied = false;
  };
  Block& b(int block) { return blocks_[static_cast<size_t>(block)]; }
  int64_t max_padded() const {
    int64_t m = 0;
    for (const Block& k : blocks_) m = std::max(m, k.numel);
    return m;
  }
  DType wire_ = DType::kF32;
  AlignedBuffer wire_buf_;
  DType compute_;
  std::vector<Block> blocks_;
};

}  // namespace

std::unique_ptr<DeviceMirror> make_host_mirror(const std::vector<int64_t>& padded_numel, DType compute) {
  return std::make_unique<HostMirror>(padded_numel, compute);
}

#if !defined(ZINC_WITH_CUDA)
std::unique_ptr<DeviceMirror> DeviceMirror::make(const std::vector<int64_t>& padded_numel, DType compute) {
  if (gpu_emulated()) return make_host_mirror(padded_numel, compute);
  throw Error("device \"cuda\": zinc was built without CUDA");
}
#endif

}  // namespace zinc
