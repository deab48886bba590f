// zinc core: the one thread pool. zinc uses OpenMP for its own loops because
// the Debian oneDNN build uses the OpenMP runtime too: one pool, no
// oversubscription between matmuls and the kernels around them.
//
// parallel_for may be called from any thread; nested calls run serially.
//
// Note [OpenMP across fork]: the OpenMP runtime's threads do not survive
// fork(). A child forked after the parent's pool started would wait for
// them at its first parallel region, forever (Python's multiprocessing
// with the fork start method, a zinc.optim step in the child: it hung).
// So a child forked after a parallel_for ran runs its parallel_for loops
// on its own thread: correct, and as fast as one core (the spawn start
// method gives a process of its own pool). oneDNN's matmuls use the same
// runtime, which is why engines refuse to run in such a child at all.
#pragma once

#include <omp.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstddef>

namespace zinc {

namespace detail {
inline std::atomic<bool>& pool_started() {
  static std::atomic<bool> started{false};
  return started;
}
inline std::atomic<bool>& pool_lost() {  // in a child forked after the pool started
  static std::atomic<bool> lost{false};
  return lost;
}
inline void watch_fork() {
  static const int registered = pthread_atfork(nullptr, nullptr, [] {
    if (pool_started().load()) pool_lost().store(true);
  });
  (void)registered;
}
}  // namespace detail

// Whether this process was forked from one whose pool had started: its
// parallel_for loops run on one thread (Note [OpenMP across fork]).
inline bool threads_lost_to_fork() { return detail::pool_lost().load(std::memory_order_relaxed); }

inline int num_threads() { return omp_get_max_threads(); }

// Splits [0, n) into at most num_threads() contiguous chunks of at least
// `grain` elements and calls fn(lo, hi) for each. Chunk boundaries depend only
// on n, grain and the thread count, never on timing.
template <class Fn>
void parallel_for(size_t n, size_t grain, Fn&& fn) {
  if (n == 0) return;
  size_t max_chunks = std::max<size_t>(1, n / std::max<size_t>(grain, 1));
  int nt = static_cast<int>(std::min<size_t>(max_chunks, static_cast<size_t>(num_threads())));
  if (nt <= 1 || omp_in_parallel() || threads_lost_to_fork()) {
    fn(size_t{0}, n);
    return;
  }
  detail::watch_fork();
  detail::pool_started().store(true, std::memory_order_relaxed);
#pragma omp parallel num_threads(nt)
  {
    size_t t = static_cast<size_t>(omp_get_thread_num());
    size_t lo = n * t / static_cast<size_t>(nt);
    size_t hi = n * (t + 1) / static_cast<size_t>(nt);
    if (lo < hi) fn(lo, hi);
  }
}

}  // namespace zinc
