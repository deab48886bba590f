#include "optim/adam_probe.h"

#include <algorithm>

#include "core/parallel.h"

namespace zinc::optim {

void probe_range_avx512(float* a, const float* b, float* c, float* d, int64_t lo, int64_t hi);

namespace {

__attribute__((target_clones("default", "avx2"))) void probe_range_generic(float* __restrict a,
                                                                          const float* __restrict b,
                                                                          float* __restrict c,
                                                                          float* __restrict d, int64_t lo,
                                                                          int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float x = b[i];
    a[i] += x;
    c[i] -= x;
    d[i] = d[i] * 0.5f + x;
  }
}

void probe_range(float* a, const float* b, float* c, float* d, int64_t lo, int64_t hi) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512)
    probe_range_avx512(a, b, c, d, lo, hi);
  else
    probe_range_generic(a, b, c, d, lo, hi);
}

}  // namespace

void adam_probe(float* a, const float* b, float* c, float* d, int64_t n) {
  const int64_t blocks = (n + 15) / 16;
  parallel_for(static_cast<size_t>(blocks), 1 << 12, [&](size_t lo, size_t hi) {
    probe_range(a, b, c, d, static_cast<int64_t>(lo) * 16, std::min(n, static_cast<int64_t>(hi) * 16));
  });
}

}  // namespace zinc::optim
