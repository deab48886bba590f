// The GPU mirror of device_mirror.h (CUDA builds).
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/device_mirror.h"
#include "kernels/kernels_cuda.h"
#include "optim/optim_cuda.h"

namespace zinc {
namespace {

constexpr cudaStream_t kCompute = nullptr;  // the models' compute stream (models/detail/ops.h)

class CudaMirror final : public DeviceMirror {
 public:
  CudaMirror(const std::vector<int64_t>& padded, DType compute) : compute_(compute) {
    ZINC_CUDA_CHECK(cudaGetDevice(&device_), "cudaGetDevice");
    blocks_.resize(padded.size());
    for (size_t b = 0; b < padded.size(); ++b) {
      Block& k = blocks_[b];
      k.numel = padded[b];
      k.params = cuda::DeviceBuffer(static_cast<size_t>(k.numel) * dtype_bytes(compute));
      k.grads = cuda::DeviceBuffer(static_cast<size_t>(k.numel) * sizeof(float));
      ZINC_CUDA_CHECK(cudaMemset(k.grads.data(), 0, k.grads.bytes()), "zeroing the GPU gradient buffers");
      k.produced = std::make_unique<cuda::Event>();
      k.copied = std::make_unique<cuda::Event>();
      k.uploaded = std::make_unique<cuda::Event>();
    }
  }

  ~CudaMirror() override {
    cudaDeviceSynchronize();  // nothing in flight reads what goes below
    for (void* p : registered_) cudaHostUnregister(p);
  }

  const void* params(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (k.upload_pending) {
      k.uploaded->wait_on(kCompute);
      k.upload_pending = false;
    }
    return k.params.data();
  }

  void make_current() override { ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice (the engine's GPU)"); }

  void upload_params_async(int block, const void* host) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    // After everything the compute stream has queued (the last backward
    // still reads these parameters), then on the copy stream.
    k.produced->record(kCompute);
    k.produced->wait_on(copy_.get());
    ZINC_CUDA_CHECK(cudaMemcpyAsync(k.params.data(), host, k.params.bytes(), cudaMemcpyHostToDevice, copy_.get()),
                    ("upload of block " + std::to_string(block) + "'s parameters").c_str());
    k.uploaded->record(copy_.get());
    k.upload_pending = true;
  }

  // Both streams: the acquire-path uploads (upload_params) run on the
  // compute stream and read the page-locked host copies asynchronously too.
  void wait_uploads() override {
    copy_.synchronize("wait for the parameter uploads");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "wait for the parameter uploads (compute stream)");
  }

  void register_host(void* p, size_t bytes) override {
    if (!p || !bytes) return;
    ZINC_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterDefault),
                    ("page-locking " + std::to_string(bytes) + " bytes of host compute parameters").c_str());
    registered_.push_back(p);
  }

  float* grads(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (k.copy_pending) {
      k.copied->wait_on(kCompute);  // the accumulator was copied out and zeroed
      k.copy_pending = false;
    }
    return k.grads.as<float>();
  }

  void upload_params(int block, const void* host) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (k.upload_pending) {  // an older upload must not land after this one
      k.uploaded->wait_on(kCompute);
      k.upload_pending = false;
    }
    ZINC_CUDA_CHECK(cudaMemcpyAsync(k.params.data(), host, k.params.bytes(), cudaMemcpyHostToDevice, kCompute),
                    ("upload of block " + std::to_string(block) + "'s parameters").c_str());
  }

  void start_grads_copy(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (k.staging.bytes() == 0) {  // page-locked staging only where copies of whole blocks happen (one rank)
      k.staging = cuda::PinnedBuffer(static_cast<size_t>(k.numel) * sizeof(float));
    }
    k.produced->record(kCompute);
    k.produced->wait_on(copy_.get());
    ZINC_CUDA_CHECK(cudaMemcpyAsync(k.staging.data(), k.grads.data(), k.grads.bytes(), cudaMemcpyDeviceToHost,
                                    copy_.get()),
                    ("copy of block " + std::to_string(block) + "'s gradients to the host").c_str());
    ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.data(), 0, k.grads.bytes(), copy_.get()), "zeroing a GPU gradient buffer");
    k.copied->record(copy_.get());
    k.copy_pending = true;
  }

  bool grads_copied(int block) override { return blocks_[static_cast<size_t>(block)].copied->done(); }

  void finish_grads_copy(int block, float* host) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    k.copied->synchronize();
    std::memcpy(host, k.staging.data(), k.staging.bytes());
  }

  void enable_states(const std::vector<int64_t>& numel, const std::vector<int64_t>& offset) override {
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& k = blocks_[i];
      k.state_numel = numel[i];
      k.state_offset = offset[i];
      const size_t bytes = static_cast<size_t>(k.state_numel) * sizeof(float);
      std::vector<cuda::DeviceBuffer*> bufs = {&k.master, &k.m, &k.v};
      if (k.state_numel != k.numel) bufs.push_back(&k.gshard);  // several ranks: the reduced shard stays here
      for (cuda::DeviceBuffer* b : bufs) {
        *b = cuda::DeviceBuffer(bytes);
        ZINC_CUDA_CHECK(cudaMemset(b->data(), 0, bytes), "zeroing the GPU optimizer states");
      }
    }
    norms_ = cuda::DeviceBuffer(blocks_.size() * sizeof(double));
  }

  void upload_states(int block, int64_t offset, int64_t count, const float* master, const float* m,
                     const float* v) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    const size_t at = static_cast<size_t>(offset) * sizeof(float), bytes = static_cast<size_t>(count) * sizeof(float);
    if (master) cuda::copy_to_device(k.master.as<char>() + at, master, bytes);
    if (m) cuda::copy_to_device(k.m.as<char>() + at, m, bytes);
    if (v) cuda::copy_to_device(k.v.as<char>() + at, v, bytes);
  }

  void download_states(int block, int64_t offset, int64_t count, float* master, float* m, float* v) override {
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "synchronize before reading the GPU optimizer states");
    Block& k = blocks_[static_cast<size_t>(block)];
    const size_t at = static_cast<size_t>(offset) * sizeof(float), bytes = static_cast<size_t>(count) * sizeof(float);
    if (master) cuda::copy_to_host(master, k.master.as<char>() + at, bytes);
    if (m) cuda::copy_to_host(m, k.m.as<char>() + at, bytes);
    if (v) cuda::copy_to_host(v, k.v.as<char>() + at, bytes);
  }

  double grad_squared_norm() override {
    for (size_t b = 0; b < blocks_.size(); ++b) {
      const Block& k = blocks_[b];
      const bool shard = k.gshard.bytes() > 0;
      kernels::cuda::squared_norm(shard ? k.gshard.as<float>() : k.grads.as<float>(), shard ? k.state_numel : k.numel,
                                  norms_.as<double>() + b, kCompute);
    }
    std::vector<double> host(blocks_.size());
    ZINC_CUDA_CHECK(cudaMemcpyAsync(host.data(), norms_.data(), host.size() * sizeof(double), cudaMemcpyDeviceToHost,
                                    kCompute),
                    "copy of the gradient norms");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "synchronize for the gradient norm");
    double s = 0;
    for (double x : host) s += x;
    return s;
  }

  void adam_step(int block, const optim::AdamParams& p, int64_t step, float grad_scale) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    const bool half = is_16bit(compute_);
    const bool shard = k.gshard.bytes() > 0;
    char* out = k.params.as<char>() + static_cast<size_t>(k.state_offset) * dtype_bytes(compute_);
    optim::adam_step_cuda(p, step, grad_scale, k.master.as<float>(), shard ? k.gshard.data() : k.grads.data(),
                          DType::kF32, k.m.as<float>(), k.v.as<float>(), half ? out : nullptr, compute_,
                          k.state_numel, kCompute);
    if (!half)
      ZINC_CUDA_CHECK(cudaMemcpyAsync(out, k.master.data(), static_cast<size_t>(k.state_numel) * 4,
                                      cudaMemcpyDeviceToDevice, kCompute),
                      "copy of the updated fp32 weights");
    k.produced->record(kCompute);  // gather_params waits for the update
  }

  void zero_grads() override {
    for (Block& k : blocks_)
      ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.data(), 0, k.grads.bytes(), kCompute), "zeroing the GPU gradients");
  }

  void gather_params(comm::Communicator& c, int block) override {
    ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice on the reduction thread");
    Block& k = blocks_[static_cast<size_t>(block)];
    comm::wait_cuda_event(c, k.produced->get());
    const size_t es = dtype_bytes(compute_);
    c.all_gather(k.params.as<char>() + static_cast<size_t>(k.state_offset) * es, k.params.data(), k.state_numel,
                 compute_);
  }

  void enable_device_reduce(DType wire, int64_t max_shard) override {
    wire_ = wire;
    shard_scratch_ = cuda::DeviceBuffer(static_cast<size_t>(max_shard) * 4);
    shard_staging_ = cuda::PinnedBuffer(static_cast<size_t>(max_shard) * 4);
    if (is_16bit(wire))
      for (Block& k : blocks_) {
        k.wire = cuda::DeviceBuffer(static_cast<size_t>(k.numel) * 2);
      }
  }

  void start_device_reduce(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (is_16bit(wire_)) kernels::cuda::convert_f32_to_16(k.grads.as<float>(), k.wire.data(), k.numel, wire_, kCompute);
    k.produced->record(kCompute);
    k.copy_pending = true;  // the next grads() waits for `copied`, recorded by device_reduce before the step ends
  }

  void device_reduce(comm::Communicator& c, int block, int64_t shard, float* shard_out) override {
    // The comm thread's current device is its own: make it the mirror's.
    ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice on the reduction thread");
    Block& k = blocks_[static_cast<size_t>(block)];
    comm::wait_cuda_event(c, k.produced->get());
    const bool w16 = is_16bit(wire_);
    if (!shard_out && !w16) {  // GPU-resident states: straight into the shard they update
      c.reduce_scatter(k.grads.data(), k.gshard.data(), shard, DType::kF32);
      ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.data(), 0, k.grads.bytes(), reduce_copy_.get()),
                      "zeroing a GPU gradient buffer");
      k.copied->record(reduce_copy_.get());
      reduce_copy_.synchronize("zeroing a GPU gradient buffer");
      return;
    }
    c.reduce_scatter(w16 ? k.wire.data() : k.grads.data(), shard_scratch_.data(), shard, w16 ? wire_ : DType::kF32);
    if (!shard_out) {  // GPU-resident states, 16-bit wire: widened on the GPU
      kernels::cuda::convert_16_to_f32(shard_scratch_.data(), k.gshard.as<float>(), shard, wire_, reduce_copy_.get());
      ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.data(), 0, k.grads.bytes(), reduce_copy_.get()),
                      "zeroing a GPU gradient buffer");
      k.copied->record(reduce_copy_.get());
      reduce_copy_.synchronize("widening a reduced gradient shard");
      return;
    }
    const size_t bytes = static_cast<size_t>(shard) * (w16 ? 2 : 4);
    ZINC_CUDA_CHECK(cudaMemcpyAsync(shard_staging_.data(), shard_scratch_.data(), bytes, cudaMemcpyDeviceToHost,
                                    reduce_copy_.get()),
                    "copy of a reduced gradient shard to the host");
    ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.data(), 0, k.grads.bytes(), reduce_copy_.get()),
                    "zeroing a GPU gradient buffer");
    k.copied->record(reduce_copy_.get());
    reduce_copy_.synchronize("copy of a reduced gradient shard to the host");
    if (w16)
      convert_16_to_f32(shard_staging_.data(), shard_out, static_cast<size_t>(shard), wire_);
    else
      std::memcpy(shard_out, shard_staging_.data(), bytes);
  }

  void synchronize() override {
    copy_.synchronize("synchronize the gradient copies");
    reduce_copy_.synchronize("synchronize the reduced-shard copies");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "synchronize the compute stream");
  }


 private:
  struct Block {
    int64_t numel = 0;
    cuda::DeviceBuffer params, grads;
    cuda::DeviceBuffer master, m, v;  // GPU-resident states (enable_states)
    cuda::DeviceBuffer wire;           // 16-bit copy for the reduction (enable_device_reduce)
    cuda::DeviceBuffer gshard;         // GPU-resident states on several ranks: the reduced fp32 shard
    int64_t state_numel = 0, state_offset = 0;
    cuda::PinnedBuffer staging;
    std::unique_ptr<cuda::Event> produced, copied, uploaded;
    bool copy_pending = false, upload_pending = false;
  };
  DType compute_;
  cuda::Stream copy_;
  cuda::Stream reduce_copy_;  // the comm thread's copies (device_reduce)
  std::vector<Block> blocks_;
  cuda::DeviceBuffer shard_scratch_;
  cuda::PinnedBuffer shard_staging_;  // one reduced shard on its way to the host (the comm thread's)
  DType wire_ = DType::kF32;
  int device_ = 0;
  cuda::DeviceBuffer norms_;  // per block, grad_squared_norm
  std::vector<void*> registered_;
};

}  // namespace

std::unique_ptr<DeviceMirror> DeviceMirror::make(const std::vector<int64_t>& padded_numel, DType compute) {
  if (gpu_emulated()) return make_host_mirror(padded_numel, compute);
  if (cuda_status().devices == 0) throw Error("device \"cuda\": no GPU is visible (" + cuda_status().why + ")");
  return std::make_unique<CudaMirror>(padded_numel, compute);
}

}  // namespace zinc
