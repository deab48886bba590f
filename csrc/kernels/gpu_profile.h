// zinc kernels: an opt-in profile of where a GPU step's time goes, per kind
// of kernel call (kernels/profile.h's kinds), read from CUDA events: the
// profile that works where no Nsight Systems does (Note [the GPU profile]
// in gpu_profile.cu). Off by default; when off a call pays one relaxed
// atomic load.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "kernels/profile.h"

namespace zinc::kernels::cuda {

void gpu_profile_enable(bool on);
bool gpu_profile_enabled();
// Drops what was recorded. Call it with no scope open on any thread.
void gpu_profile_reset();

// One stream's timeline, from its first recorded event to its last.
struct GpuStreamProfile {
  cudaStream_t stream = nullptr;
  int64_t events = 0;
  double span_s = 0;     // first event to last
  double scoped_s = 0;   // inside the kinds' calls (the sum of gpu_s on this stream)
  double outside_s = 0;  // between them: the engine's own work and waits, and the GPU idle
  double gpu_s[kNumOps] = {};  // scoped_s by kind
};
struct GpuProfileTotals {
  double gpu_s[kNumOps] = {};   // GPU time inside the kind's calls, exclusive of nested calls
  double host_s[kNumOps] = {};  // the host's time inside them (launching), exclusive likewise
  int64_t calls[kNumOps] = {};
  std::vector<GpuStreamProfile> streams;  // the most events first
};
// Waits for every recorded event; throws zinc::Error on a CUDA error.
GpuProfileTotals gpu_profile_read();

// Records an event on `stream` where it opens and where it closes.
class GpuProfileScope {
 public:
  GpuProfileScope(Op op, cudaStream_t stream);
  ~GpuProfileScope();
  GpuProfileScope(const GpuProfileScope&) = delete;
  GpuProfileScope& operator=(const GpuProfileScope&) = delete;

 private:
  Op op_;
  bool active_;
  cudaStream_t stream_ = nullptr;
  GpuProfileScope* parent_ = nullptr;
  std::chrono::steady_clock::time_point start_;
  double host_exclusive_s_ = 0;
};

}  // namespace zinc::kernels::cuda
