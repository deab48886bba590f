// The host-memory DeviceMirror of ZINC_EMULATE_GPU (core/device.h), and
// DeviceMirror::make without CUDA. The "GPU" buffers are host memory, the
// copies memcpy, the GPU-resident AdamW optim::adam_step, the norm
// kernels::squared_norm (whose order the GPU's follows): the engine's GPU
// path runs end to end on the CPU, every step as the GPU would order it.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "core/alloc.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/device_mirror.h"
#include "engine/shard.h"
#include "kernels/kernels.h"

namespace zinc {
namespace {

class HostMirror final : public DeviceMirror {
 public:
  HostMirror(const std::vector<int64_t>& padded, DType compute, const MirrorOptions& options)
      : compute_(compute), options_(options) {
    for (int64_t n : padded) {
      Block k;
      k.numel = n;
      if (!options_.transient_params) alloc(k.params, param_bytes(k));
      if (!options_.transient_grads) alloc(k.grads, grad_bytes(k));
      blocks_.push_back(std::move(k));
    }
  }
  // A block's parameters read while not on the "GPU" is a fault of the
  // engine's orchestration: the emulation reports it as such.
  const void* params(int block) override {
    Block& k = b(block);
    ZINC_CHECK(!k.params.empty(), "the GPU parameters of block " + std::to_string(block) + " were read after drop_params");
    return k.params.data();
  }
  void make_current() override {}
  float* grads(int block) override {
    Block& k = b(block);
    if (k.grads.empty()) {
      ZINC_CHECK(!k.copied, "grads() of block " + std::to_string(block) + " between its copy's start and finish");
      alloc(k.grads, grad_bytes(k));  // zeroed, as the GPU's memset
    }
    return k.grads.as<float>();
  }
  void upload_params(int block, const void* host) override {
    Block& k = b(block);
    if (k.params.empty()) alloc(k.params, param_bytes(k));
    std::memcpy(k.params.data(), host, k.params.bytes());
  }
  bool has_params(int block) override { return !b(block).params.empty(); }
  void drop_params(int block) noexcept override {
    if (options_.transient_params) release(b(block).params);
  }
  int64_t bytes() const override { return bytes_.load(); }
  int64_t peak_bytes() const override { return peak_.load(); }
  void upload_params_async(int block, const void* host) override { upload_params(block, host); }
  void wait_uploads() override {}
  void register_host(void*, size_t) override {}
  void start_grads_copy(int block) override {
    Block& k = b(block);
    ZINC_CHECK(!k.grads.empty(), "start_grads_copy of block " + std::to_string(block) + " without gradients");
    k.copied = true;
  }
  bool grads_copied(int block) override { return b(block).copied; }
  void finish_grads_copy(int block, float* host) override {
    Block& k = b(block);
    ZINC_CHECK(k.copied, "finish_grads_copy without start_grads_copy");
    std::memcpy(host, k.grads.data(), k.grads.bytes());
    done_with_grads(k);  // as the GPU zeroes (or frees) after its copy
    k.copied = false;
  }
  void enable_states(const std::vector<int64_t>& numel, const std::vector<int64_t>& offset) override {
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& k = blocks_[i];
      k.state_numel = numel[i];
      k.state_offset = offset[i];
      for (AlignedBuffer* a : {&k.master, &k.m, &k.v}) alloc(*a, static_cast<size_t>(k.state_numel) * 4);
      if (k.state_numel != k.numel) alloc(k.gshard, static_cast<size_t>(k.state_numel) * 4);
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
    for (Block& k : blocks_) {
      if (!k.gshard.empty())
        s += kernels::squared_norm(k.gshard.as<float>(), k.state_numel);
      else if (gather_back_)
        s += kernels::squared_norm(k.grads.as<float>() + k.norm_offset, k.norm_numel);
      else
        s += kernels::squared_norm(k.grads.as<float>(), k.numel);
    }
    return s;
  }
  void adam_step(int block, const optim::AdamParams& p, int64_t step, float grad_scale, void* host_out) override {
    Block& k = b(block);
    // With GPU shards (stage 3, gathers on the GPU) the update writes the
    // shard there, then the host's copy.
    char* out = host_out && !k.pshard.empty() ? k.pshard.as<char>()
                : host_out                    ? static_cast<char*>(host_out)
                                              : k.params.as<char>() + static_cast<size_t>(k.state_offset) * dtype_bytes(compute_);
    const void* grad = k.gshard.empty() ? k.grads.data() : k.gshard.data();
    optim::adam_step(p, step, grad_scale,
                     optim::AdamSpan{k.master.as<float>(), grad, DType::kF32, k.m.as<float>(), k.v.as<float>(),
                                     compute_ == DType::kBF16 ? reinterpret_cast<bf16*>(out) : nullptr,
                                     k.state_numel});
    if (compute_ != DType::kBF16)
      convert_f32_to_16(k.master.as<float>(), out, static_cast<size_t>(k.state_numel), compute_);
    if (host_out && !k.pshard.empty()) std::memcpy(host_out, k.pshard.data(), k.pshard.bytes());
  }
  void enable_param_shards(const std::vector<int64_t>& shard_numel) override {
    for (size_t i = 0; i < blocks_.size(); ++i) {
      blocks_[i].shard_numel = shard_numel[i];
      alloc(blocks_[i].pshard, static_cast<size_t>(shard_numel[i]) * dtype_bytes(compute_));
    }
  }
  void upload_shard(int block, const void* host) override {
    Block& k = b(block);
    ZINC_CHECK(!k.pshard.empty(), "upload_shard without enable_param_shards");
    std::memcpy(k.pshard.data(), host, k.pshard.bytes());
  }
  void begin_gather(int block) override {
    Block& k = b(block);
    if (k.params.empty()) alloc(k.params, param_bytes(k));
  }
  void gather_block(comm::Communicator& c, int block) override {
    Block& k = b(block);
    ZINC_CHECK(!k.params.empty(), "gather_block without begin_gather");
    c.all_gather(k.pshard.data(), k.params.data(), k.shard_numel, compute_);
  }
  void gather_params(comm::Communicator& c, int block) override {
    Block& k = b(block);
    c.all_gather(k.params.as<char>() + static_cast<size_t>(k.state_offset) * dtype_bytes(compute_), k.params.data(),
                 k.state_numel, compute_);
  }
  void zero_grads() override {
    for (Block& k : blocks_)
      if (!k.grads.empty()) std::memset(k.grads.data(), 0, k.grads.bytes());
  }
  void enable_device_reduce(DType wire, int64_t max_shard, bool gather_back) override {
    wire_ = wire;
    gather_back_ = gather_back;
    if (is_16bit(wire)) alloc(wire_buf_, static_cast<size_t>(max_padded() + max_shard) * 2);
    if (gather_back) alloc(shard_scratch_, static_cast<size_t>(max_shard) * 4);
  }
  void start_device_reduce(int block) override {
    ZINC_CHECK(!b(block).grads.empty(), "start_device_reduce of block " + std::to_string(block) + " without gradients");
  }
  // The GradReducer's host reduction on the "GPU" buffer, the same calls in
  // the same order (so the emulated run equals the CPU path bit for bit).
  void device_reduce(comm::Communicator& c, int block, int64_t shard, float* out) override {
    Block& k = b(block);
    float* shard_f32 = out ? out : gather_back_ ? shard_scratch_.as<float>() : k.gshard.as<float>();
    if (is_16bit(wire_)) {
      uint16_t* full = wire_buf_.as<uint16_t>();
      uint16_t* shard16 = full + k.numel;
      convert_f32_to_16(k.grads.as<float>(), full, static_cast<size_t>(k.numel), wire_);
      c.reduce_scatter(full, shard16, shard, wire_);
      convert_16_to_f32(shard16, shard_f32, static_cast<size_t>(shard), wire_);
    } else {
      c.reduce_scatter(k.grads.data(), shard_f32, shard, DType::kF32);
    }
    if (gather_back_) {  // stage 0: the full reduced gradient stays for the update
      c.all_gather(shard_f32, k.grads.data(), shard, DType::kF32);
      k.norm_offset = c.rank() * shard;
      k.norm_numel = shard;
      return;
    }
    done_with_grads(k);
  }
  void synchronize() override {}

 private:
  struct Block {
    int64_t numel = 0;
    AlignedBuffer params, grads, master, m, v, gshard;
    AlignedBuffer pshard;  // enable_param_shards: the rank's compute shard
    int64_t shard_numel = 0;
    int64_t state_numel = 0, state_offset = 0;
    int64_t norm_offset = 0, norm_numel = 0;  // gather_back: the rank's shard of the accumulator
    bool copied = false;
  };
  Block& b(int block) { return blocks_[static_cast<size_t>(block)]; }
  size_t param_bytes(const Block& k) const { return static_cast<size_t>(k.numel) * dtype_bytes(compute_); }
  static size_t grad_bytes(const Block& k) { return static_cast<size_t>(k.numel) * sizeof(float); }
  // The comm thread frees (device_reduce) while the training thread
  // allocates: the counts are atomic, as the CUDA mirror's.
  void alloc(AlignedBuffer& a, size_t n) {
    a = AlignedBuffer(n);
    std::memset(a.data(), 0, n);
    const int64_t now = bytes_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void release(AlignedBuffer& a) noexcept {
    bytes_.fetch_sub(static_cast<int64_t>(a.bytes()));
    a = AlignedBuffer();
  }
  // After a boundary's copy or reduction: zeroed for the next global batch,
  // or freed (transient_grads).
  void done_with_grads(Block& k) {
    if (options_.transient_grads)
      release(k.grads);
    else
      std::memset(k.grads.data(), 0, k.grads.bytes());
  }
  int64_t max_padded() const {
    int64_t m = 0;
    for (const Block& k : blocks_) m = std::max(m, k.numel);
    return m;
  }
  DType wire_ = DType::kF32;
  bool gather_back_ = false;
  AlignedBuffer wire_buf_, shard_scratch_;
  DType compute_;
  MirrorOptions options_;
  std::vector<Block> blocks_;
  std::atomic<int64_t> bytes_{0}, peak_{0};
};

}  // namespace

GpuPlan GpuPlan::make(const Config& c, int world) {
  const ZeroConfig& z = c.zero;
  const bool states_on_gpu = z.offload_optimizer.device == OffloadDevice::kNone;
  const bool params_sharded = StagePlan::make(z.stage, world, z.offload_param.device != OffloadDevice::kNone).params_sharded;
  GpuPlan g;
  // The GPU keeps what the host keeps (Note [ZeRO stages] in shard.h): at
  // stage 3 a block's parameters only while gathered, from stage 2 the
  // gradients only until reduced or copied out (GPU-resident states on one
  // rank read them in place: they stay).
  g.mirror.transient_params = params_sharded;
  g.mirror.transient_grads = z.stage >= 2 && !(states_on_gpu && world == 1);
  g.host_grads = !(states_on_gpu && world == 1);
  g.device_gathers = params_sharded && world > 1 && z.offload_param.device != OffloadDevice::kNvme;
  return g;
}

std::unique_ptr<DeviceMirror> make_host_mirror(const std::vector<int64_t>& padded_numel, DType compute,
                                               const MirrorOptions& options) {
  return std::make_unique<HostMirror>(padded_numel, compute, options);
}

#if !defined(ZINC_WITH_CUDA)
std::unique_ptr<DeviceMirror> DeviceMirror::make(const std::vector<int64_t>& padded_numel, DType compute,
                                                 const MirrorOptions& options) {
  if (gpu_emulated()) return make_host_mirror(padded_numel, compute, options);
  throw Error("device \"cuda\": zinc was built without CUDA");
}
#endif

}  // namespace zinc
