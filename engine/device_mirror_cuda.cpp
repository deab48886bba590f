// The GPU mirror of device_mirror.h (CUDA builds).
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "core/cuda_util.h"
#include "core/device.h"
#include "core/error.h"
#include "engine/device_mirror.h"

namespace zinc {
namespace {

constexpr cudaStream_t kCompute = nullptr;  // the models' compute stream (models/detail/ops.h)

class CudaMirror final : public DeviceMirror {
 public:
  CudaMirror(const std::vector<int64_t>& padded, DType compute) : compute_(compute) {
    blocks_.resize(padded.size());
    for (size_t b = 0; b < padded.size(); ++b) {
      Block& k = blocks_[b];
      k.numel = padded[b];
      k.params = cuda::DeviceBuffer(static_cast<size_t>(k.numel) * dtype_bytes(compute));
      k.grads = cuda::DeviceBuffer(static_cast<size_t>(k.numel) * sizeof(float));
      ZINC_CUDA_CHECK(cudaMemset(k.grads.data(), 0, k.grads.bytes()), "zeroing the GPU gradient buffers");
      k.staging = cuda::PinnedBuffer(static_cast<size_t>(k.numel) * sizeof(float));
      k.produced = std::make_unique<cuda::Event>();
      k.copied = std::make_unique<cuda::Event>();
      device_bytes_ += static_cast<int64_t>(k.params.bytes() + k.grads.bytes());
      pinned_bytes_ += static_cast<int64_t>(k.staging.bytes());
    }
  }

  const void* params(int block) const override { return blocks_[static_cast<size_t>(block)].params.data(); }

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
    ZINC_CUDA_CHECK(cudaMemcpyAsync(k.params.data(), host, k.params.bytes(), cudaMemcpyHostToDevice, kCompute),
                    ("upload of block " + std::to_string(block) + "'s parameters").c_str());
  }

  void start_grads_copy(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
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

  void synchronize() override {
    copy_.synchronize("synchronize the gradient copies");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "synchronize the compute stream");
  }

  int64_t device_bytes() const override { return device_bytes_; }
  int64_t pinned_bytes() const override { return pinned_bytes_; }

 private:
  struct Block {
    int64_t numel = 0;
    cuda::DeviceBuffer params, grads;
    cuda::PinnedBuffer staging;
    std::unique_ptr<cuda::Event> produced, copied;
    bool copy_pending = false;
  };
  DType compute_;
  cuda::Stream copy_;
  std::vector<Block> blocks_;
  int64_t device_bytes_ = 0, pinned_bytes_ = 0;
};

}  // namespace

std::unique_ptr<DeviceMirror> DeviceMirror::make(const std::vector<int64_t>& padded_numel, DType compute) {
  if (cuda_status().devices == 0) throw Error("device \"cuda\": no GPU is visible (" + cuda_status().why + ")");
  return std::make_unique<CudaMirror>(padded_numel, compute);
}

}  // namespace zinc
