// zinc core: the one thread pool. zinc uses OpenMP for its own loops because
// the Debian oneDNN build uses the OpenMP runtime too: one pool, no
// oversubscription between matmuls and the kernels around them.
//
// parallel_for may be called from any thread; nested calls run serially.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>

namespace zinc {

inline int num_threads() { return omp_get_max_threads(); }

// Splits [0, n) into at most num_threads() contiguous chunks of at least
// `grain` elements and calls fn(lo, hi) for each. Chunk boundaries depend only
// on n, grain and the thread count, never on timing.
template <class Fn>
void parallel_for(size_t n, size_t grain, Fn&& fn) {
  if (n == 0) return;
  size_t max_chunks = std::max<size_t>(1, n / std::max<size_t>(grain, 1));
  int nt = static_cast<int>(std::min<size_t>(max_chunks, static_cast<size_t>(num_threads())));
  if (nt <= 1 || omp_in_parallel()) {
    fn(size_t{0}, n);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    size_t t = static_cast<size_t>(omp_get_thread_num());
    size_t lo = n * t / static_cast<size_t>(nt);
    size_t hi = n * (t + 1) / static_cast<size_t>(nt);
    if (lo < hi) fn(lo, hi);
  }
}

}  // namespace zinc
