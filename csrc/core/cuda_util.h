// zinc core: small RAII wrappers over the CUDA runtime, for CUDA builds only
// (include only from targets built when ZINC_WITH_CUDA is on).
//
// Every CUDA call that can fail goes through ZINC_CUDA_CHECK(call, what),
// which throws zinc::Error("what: <CUDA's error name and text> (file:line)"),
// so a failure names the operation rather than surfacing later as a
// corrupted result. Destructors never throw: they free and drop errors.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "core/error.h"

namespace zinc::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  throw Error(std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + " (" + file +
              ":" + std::to_string(line) + ")");
}

#define ZINC_CUDA_CHECK(call, what)                                                   \
  do {                                                                                \
    const cudaError_t zinc_cuda_err_ = (call);                                        \
    if (zinc_cuda_err_ != cudaSuccess)                                                \
      ::zinc::cuda::throw_cuda_error(zinc_cuda_err_, (what), __FILE__, __LINE__);    \
  } while (0)

// cudaMalloc of `bytes` for `what` (a few words: "the model's
// activations"); out of GPU memory, one line that says how much was asked
// and is free, and what lowers the need, not CUDA's bare error.
inline void* gpu_malloc(size_t bytes, const std::string& what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it: the run ends with this message, not a later call's
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    // Whole MiB from 1 MiB up; below, KiB or bytes (a small GPU's "0 MiB of 0 MiB").
    auto mib = [](size_t b) {
      return b >= (size_t{1} << 20) ? std::to_string(b >> 20) + " MiB"
             : b >= 1024           ? std::to_string(b >> 10) + " KiB"
                                   : std::to_string(b) + " bytes";
    };
    throw Error("the GPU has no room for " + what + " (" + mib(bytes) + " more; " + mib(free_b) + " of " +
                mib(total_b) + " free): lower train_micro_batch_size_per_gpu or data.seq_len, turn on "
                "model.gradient_checkpointing, or keep less on the GPU (offload_optimizer, offload_param); "
                "zinc-train --estimate shows what a step takes");
  }
  if (e != cudaSuccess) throw_cuda_error(e, ("cudaMalloc of " + std::to_string(bytes) + " bytes for " + what).c_str(),
                                         __FILE__, __LINE__);
  return p;
}

// Owns `bytes` of device memory on the current device (cudaMalloc), or none.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes, const std::string& what = "a GPU buffer") : bytes_(bytes) {
    if (bytes) data_ = gpu_malloc(bytes, what);
  }
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (data_) cudaFree(data_);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  // Grows (never shrinks) to at least `bytes`; the contents are lost when
  // it grows. The old buffer goes first, so the GPU never holds both.
  void reserve(size_t bytes, const std::string& what = "a GPU buffer") {
    if (bytes <= bytes_) return;
    *this = DeviceBuffer();
    *this = DeviceBuffer(bytes, what);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory (cudaHostAlloc): the source and target of
// asynchronous copies that overlap with compute.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes)
      ZINC_CUDA_CHECK(cudaHostAlloc(&data_, bytes, cudaHostAllocDefault),
                      ("cudaHostAlloc of " + std::to_string(bytes) + " bytes").c_str());
  }
  ~PinnedBuffer() {
    if (data_) cudaFreeHost(data_);
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      if (data_) cudaFreeHost(data_);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A non-blocking stream of its own.
class Stream {
 public:
  Stream() { ZINC_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }
  void synchronize(const char* what = "cudaStreamSynchronize") const {
    ZINC_CUDA_CHECK(cudaStreamSynchronize(s_), what);
  }

 private:
  cudaStream_t s_ = nullptr;
};

// An event without timing, to order streams (record on one, wait on another).
class Event {
 public:
  Event() { ZINC_CUDA_CHECK(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming), "cudaEventCreate"); }
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }
  void record(cudaStream_t s) { ZINC_CUDA_CHECK(cudaEventRecord(e_, s), "cudaEventRecord"); }
  // Work submitted to `s` after this call waits for the recorded point.
  void wait_on(cudaStream_t s) const { ZINC_CUDA_CHECK(cudaStreamWaitEvent(s, e_, 0), "cudaStreamWaitEvent"); }
  void synchronize() const { ZINC_CUDA_CHECK(cudaEventSynchronize(e_), "cudaEventSynchronize"); }
  bool done() const { return cudaEventQuery(e_) == cudaSuccess; }

 private:
  cudaEvent_t e_ = nullptr;
};

// Copies (blocking helpers for setup and tests; the training paths use the async calls).
// cudaMemcpy from pageable memory returns once the data is staged, before
// the DMA lands: only the legacy stream is ordered after it. The device is
// synchronised so that work on any stream sees the data.
inline void copy_to_device(void* dst, const void* src, size_t bytes) {
  ZINC_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy host to device");
  ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "cudaDeviceSynchronize after a copy to the device");
}
inline void copy_to_host(void* dst, const void* src, size_t bytes) {
  ZINC_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy device to host");
}

}  // namespace zinc::cuda
