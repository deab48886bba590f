// zinc kernels: an opt-in profile of where kernel time goes, per kind of
// kernel, in exclusive wall time (a matmul inside attention counts as
// matmul, not attention). Off by default; when off a kernel call pays one
// relaxed atomic load. Totals are process-wide; scopes nest per thread.
// Inside a parallel region only its first thread records, standing for the
// others, so the totals add up to wall time.
#pragma once

#include <chrono>
#include <cstdint>

namespace zinc::kernels {

// kConvert, kOptimizer and kCopy are the GPU's alone (kernels/gpu_profile.h):
// its dtype conversions, its optimizers (AdamW, Lamb), and the engine's
// copies between host and device; the CPU's profile never records them.
enum class Op : int {
  kMatmul,
  kAttention,
  kLayerNorm,
  kGelu,
  kCrossEntropy,
  kEmbedding,
  kBias,
  kVector,
  kConvert,
  kOptimizer,
  kCopy,
  kCount
};
constexpr int kNumOps = static_cast<int>(Op::kCount);
const char* op_name(Op op);

void profile_enable(bool on);
bool profile_enabled();
void profile_reset();
struct ProfileTotals {
  double seconds[kNumOps] = {};
  int64_t calls[kNumOps] = {};
};
ProfileTotals profile_read();

class ProfileScope {
 public:
  explicit ProfileScope(Op op);
  ~ProfileScope();
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Op op_;
  bool active_;
  ProfileScope* parent_ = nullptr;
  std::chrono::steady_clock::time_point start_;
  double exclusive_s_ = 0;
};

}  // namespace zinc::kernels
