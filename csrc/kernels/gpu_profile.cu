// Note [the GPU profile]
// Where a step's GPU time goes, without Nsight Systems (which the GPU
// machines this project is lent do not run): every kernel entry point of
// kernels_cuda.h and optim_cuda.h opens a GpuProfileScope of its kind on
// its stream, and so do the engine's copies of parameters and gradients
// between host and device (kCopy, engine/device_mirror_cuda.cpp), on the
// streams they run on. With the profile on, a scope records a CUDA event where it
// opens and where it closes, and each mark notes which kind is open after
// it on its thread. Per (thread, stream), the time between two consecutive
// marks is the GPU's time on that stream from the first to the second: the
// work between them, and any time the stream stood idle there waiting for
// the host or for another stream. It goes to the kind open after the first
// mark, so a matmul inside attention counts as matmul (the CPU profile's
// exclusive rule, kernels/profile.h), and to "outside" where none is open.
// "Outside" is the engine's own work on that stream (copies, waits on
// other streams) and the GPU idle between calls, waiting for the host.
//
// The host's time inside each call (launching it) is kept too, exclusive
// likewise and without the profile's own event records: a host that
// launches slower than the GPU runs shows as host time near the step's and
// GPU time inflated by idling.
//
// An event record costs the host a few microseconds, so a profiled step is
// slower than a plain one; gpu-train-step keeps the profiled round out of
// its figures. The marks of a step (about 2 a kernel call) stay until
// gpu_profile_read, which waits for them all.
#include "kernels/gpu_profile.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "core/cuda_util.h"

namespace zinc::kernels::cuda {
namespace {

std::atomic<bool> g_enabled{false};

struct Mark {
  cudaEvent_t event;
  cudaStream_t stream;
  int open;  // the kind open on the thread after this mark; -1: none
};
// One thread's marks. Its own mutex: the bench reads while an engine
// thread (the CPU update behind the forward) may still record.
struct Timeline {
  std::mutex mu;
  std::vector<Mark> marks;
  std::vector<cudaEvent_t> spare;  // created, not in marks
  double host_s[kNumOps] = {};
  int64_t calls[kNumOps] = {};
  cudaError_t failed = cudaSuccess;  // the first failed record (in a destructor, which cannot throw)
  bool ended = false;                // its thread has ended
};
struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<Timeline>> timelines;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: threads may end after exit's destructors
  return *r;
}
struct ThreadTimeline {
  Timeline* t = nullptr;
  ~ThreadTimeline() {
    if (!t) return;
    std::lock_guard<std::mutex> lock(registry().mu);
    std::lock_guard<std::mutex> tlock(t->mu);
    t->ended = true;
  }
};
thread_local ThreadTimeline t_timeline;
thread_local GpuProfileScope* t_current = nullptr;

Timeline& this_thread_timeline() {
  if (!t_timeline.t) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.timelines.push_back(std::make_unique<Timeline>());
    t_timeline.t = r.timelines.back().get();
  }
  return *t_timeline.t;
}

// Records a mark; a failure is kept for gpu_profile_read (never thrown
// here, since a scope's destructor calls it).
void mark(cudaStream_t stream, int open) {
  Timeline& t = this_thread_timeline();
  std::lock_guard<std::mutex> lock(t.mu);
  cudaEvent_t e = nullptr;
  if (!t.spare.empty()) {
    e = t.spare.back();
    t.spare.pop_back();
  } else if (const cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) {
    if (t.failed == cudaSuccess) t.failed = err;
    return;
  }
  if (const cudaError_t err = cudaEventRecord(e, stream); err != cudaSuccess) {
    if (t.failed == cudaSuccess) t.failed = err;
    t.spare.push_back(e);
    return;
  }
  t.marks.push_back({e, stream, open});
}

using Clock = std::chrono::steady_clock;
double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

void gpu_profile_enable(bool on) { g_enabled.store(on, std::memory_order_relaxed); }
bool gpu_profile_enabled() { return g_enabled.load(std::memory_order_relaxed); }

void gpu_profile_reset() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.timelines.begin(); it != r.timelines.end();) {
    Timeline& t = **it;
    std::unique_lock<std::mutex> tlock(t.mu);
    for (const Mark& m : t.marks) t.spare.push_back(m.event);
    t.marks.clear();
    std::fill(std::begin(t.host_s), std::end(t.host_s), 0.0);
    std::fill(std::begin(t.calls), std::end(t.calls), int64_t{0});
    t.failed = cudaSuccess;
    if (t.ended) {  // nothing will record here again
      for (cudaEvent_t e : t.spare) cudaEventDestroy(e);
      tlock.unlock();
      it = r.timelines.erase(it);
    } else {
      ++it;
    }
  }
}

GpuProfileTotals gpu_profile_read() {
  GpuProfileTotals out;
  std::map<cudaStream_t, GpuStreamProfile> by_stream;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& tp : r.timelines) {
    Timeline& t = *tp;
    std::lock_guard<std::mutex> tlock(t.mu);
    if (t.failed != cudaSuccess)
      ::zinc::cuda::throw_cuda_error(t.failed, "GPU profile: an event record", __FILE__, __LINE__);
    for (int i = 0; i < kNumOps; ++i) {
      out.host_s[i] += t.host_s[i];
      out.calls[i] += t.calls[i];
    }
    // This thread's marks, stream by stream, in the order recorded.
    std::map<cudaStream_t, std::vector<const Mark*>> streams;
    for (const Mark& m : t.marks) streams[m.stream].push_back(&m);
    for (const auto& [stream, marks] : streams) {
      // A stream's events complete in order: waiting for its last waits for all.
      ZINC_CUDA_CHECK(cudaEventSynchronize(marks.back()->event), "GPU profile: waiting for the recorded events");
      GpuStreamProfile& sp = by_stream[stream];
      sp.stream = stream;
      sp.events += static_cast<int64_t>(marks.size());
      for (size_t i = 0; i + 1 < marks.size(); ++i) {
        float ms = 0;
        ZINC_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i]->event, marks[i + 1]->event),
                        "GPU profile: the time between two events");
        const double s = std::max(0.0, static_cast<double>(ms) * 1e-3);
        sp.span_s += s;
        if (marks[i]->open >= 0) {
          out.gpu_s[marks[i]->open] += s;
          sp.gpu_s[marks[i]->open] += s;
          sp.scoped_s += s;
        } else {
          sp.outside_s += s;
        }
      }
    }
  }
  for (auto& [stream, sp] : by_stream) out.streams.push_back(sp);
  std::stable_sort(out.streams.begin(), out.streams.end(),
                   [](const GpuStreamProfile& a, const GpuStreamProfile& b) { return a.events > b.events; });
  return out;
}

GpuProfileScope::GpuProfileScope(Op op, cudaStream_t stream)
    : op_(op), active_(g_enabled.load(std::memory_order_relaxed)) {
  if (!active_) return;
  stream_ = stream;
  const Clock::time_point now = Clock::now();
  parent_ = t_current;
  if (parent_) parent_->host_exclusive_s_ += secs(now - parent_->start_);
  t_current = this;
  mark(stream, static_cast<int>(op));
  start_ = Clock::now();  // the host's time without the record's
}

GpuProfileScope::~GpuProfileScope() {
  if (!active_) return;
  host_exclusive_s_ += secs(Clock::now() - start_);
  {
    Timeline& t = this_thread_timeline();
    std::lock_guard<std::mutex> lock(t.mu);
    t.host_s[static_cast<int>(op_)] += host_exclusive_s_;
    t.calls[static_cast<int>(op_)] += 1;
  }
  mark(stream_, parent_ ? static_cast<int>(parent_->op_) : -1);
  t_current = parent_;
  if (parent_) parent_->start_ = Clock::now();
}

}  // namespace zinc::kernels::cuda
