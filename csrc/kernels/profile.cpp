#include "kernels/profile.h"

#include <omp.h>

#include <atomic>

namespace zinc::kernels {
namespace {

std::atomic<bool> g_enabled{false};
std::atomic<int64_t> g_ns[kNumOps];
std::atomic<int64_t> g_calls[kNumOps];
thread_local ProfileScope* t_current = nullptr;

using Clock = std::chrono::steady_clock;
double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

const char* op_name(Op op) {
  static const char* names[] = {"matmul",    "attention", "layernorm", "gelu",    "cross_entropy",
                                "embedding", "bias",      "vector",    "convert", "optimizer",
                                "copy"};
  return names[static_cast<int>(op)];
}

void profile_enable(bool on) { g_enabled.store(on, std::memory_order_relaxed); }
bool profile_enabled() { return g_enabled.load(std::memory_order_relaxed); }
void profile_reset() {
  for (int i = 0; i < kNumOps; ++i) {
    g_ns[i] = 0;
    g_calls[i] = 0;
  }
}
ProfileTotals profile_read() {
  ProfileTotals t;
  for (int i = 0; i < kNumOps; ++i) {
    t.seconds[i] = static_cast<double>(g_ns[i].load()) * 1e-9;
    t.calls[i] = g_calls[i].load();
  }
  return t;
}

ProfileScope::ProfileScope(Op op) : op_(op), active_(g_enabled.load(std::memory_order_relaxed)) {
  if (!active_) return;
  // Inside a parallel region only the first thread records: the wall time
  // it splits between kinds stands for the region's other threads, so the
  // totals add up to wall time (a kernel that runs matmuls on every thread,
  // Note [attention by head groups], would otherwise count them twice).
  if (omp_in_parallel() && omp_get_thread_num() != 0) {
    active_ = false;
    return;
  }
  start_ = Clock::now();
  parent_ = t_current;
  if (parent_) parent_->exclusive_s_ += secs(start_ - parent_->start_);
  t_current = this;
}

ProfileScope::~ProfileScope() {
  if (!active_) return;
  const auto now = Clock::now();
  exclusive_s_ += secs(now - start_);
  g_ns[static_cast<int>(op_)].fetch_add(static_cast<int64_t>(exclusive_s_ * 1e9), std::memory_order_relaxed);
  g_calls[static_cast<int>(op_)].fetch_add(1, std::memory_order_relaxed);
  t_current = parent_;
  if (parent_) parent_->start_ = now;
}

}  // namespace zinc::kernels
