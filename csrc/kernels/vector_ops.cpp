// Vector ops over fp32 arrays. They are memory-bound, so they are plain
// SSE2-vectorised loops split over the OpenMP pool in chunks of >= 32K
// elements (smaller arrays run on the calling thread).
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/kernels.h"
#include "kernels/math.h"
#include "kernels/profile.h"
#include "kernels/simd_math.h"

namespace zinc::kernels {
namespace {

constexpr size_t kGrain = size_t{1} << 15;

// Note [squared_norm order]
// squared_norm sums fixed chunks of kNormChunk elements, each with kLanes
// interleaved double accumulators, then adds the chunk sums in index order.
// The summation tree depends only on n, so the result is bit-identical for any
// thread count (gradient clipping must not change with OMP_NUM_THREADS).
constexpr int64_t kNormChunk = math::kNormChunk;

ZINC_ALWAYS_INLINE double chunk_squared_norm_body(const float* __restrict x, int64_t n) {
  return detail::lane_sum<double>(n, [&](int64_t i) {
    const double v = x[i];
    return v * v;
  });
}
ZINC_ISA_VARIANTS(double, chunk_squared_norm, (const float* __restrict x, int64_t n), (x, n))

bool chunk_finite(const float* __restrict x, int64_t n) {
  // Exponent all ones <=> Inf or NaN. Integer ops so that it vectorises.
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

}  // namespace

void add(float* out, const float* a, const float* b, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(n), kGrain, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) out[i] = a[i] + b[i];
  });
}

void accumulate(float* y, const float* x, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(n), kGrain, [&](size_t lo, size_t hi) {
    float* __restrict yy = y;
    const float* __restrict xx = x;
    for (size_t i = lo; i < hi; ++i) yy[i] += xx[i];
  });
}

void scale(float* x, float alpha, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(n), kGrain, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) x[i] *= alpha;
  });
}

void dropout(float* out, const float* x, int64_t n, float p, uint64_t key, bool accumulate, DropoutColumns w) {
  ProfileScope profile_scope(Op::kVector);
  check_dropout_window(n, w);
  ZINC_CHECK(p >= 0.0f && p < 1.0f, "dropout: p must be in [0, 1)");
  const uint32_t threshold = math::dropout_threshold(p);
  const float keep_scale = 1.0f / (1.0f - p);
  parallel_for(static_cast<size_t>(n), kGrain, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const uint32_t at = math::dropout_index(static_cast<int64_t>(i), w.cols, w.stride, w.first);
      const float v = math::dropout_keeps(key, at, threshold) ? x[i] * keep_scale : 0.0f;
      out[i] = accumulate ? out[i] + v : v;
    }
  });
}

void copy_columns(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t N, int64_t width) {
  ProfileScope profile_scope(Op::kVector);
  if (N <= 0 || width <= 0) return;
  parallel_for(static_cast<size_t>(N), std::max<size_t>(1, kGrain / static_cast<size_t>(width)), [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r)
      std::memcpy(dst + r * dst_W, src + r * src_W, static_cast<size_t>(width) * sizeof(float));
  });
}

void axpy(float* y, float alpha, const float* x, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(n), kGrain, [&](size_t lo, size_t hi) {
    float* __restrict yy = y;
    const float* __restrict xx = x;
    for (size_t i = lo; i < hi; ++i) yy[i] += alpha * xx[i];
  });
}

double squared_norm(const float* x, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  if (n <= 0) return 0.0;
  const int64_t nchunks = (n + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(static_cast<size_t>(nchunks));
  parallel_for(static_cast<size_t>(nchunks), 1, [&](size_t lo, size_t hi) {
    for (size_t c = lo; c < hi; ++c) {
      int64_t begin = static_cast<int64_t>(c) * kNormChunk;
      int64_t len = std::min(kNormChunk, n - begin);
      partial[c] = chunk_squared_norm(x + begin, len);
    }
  });
  double s = 0;
  for (double p : partial) s += p;
  return s;
}

bool all_finite(const float* x, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  if (n <= 0) return true;
  const int64_t nchunks = (n + kNormChunk - 1) / kNormChunk;
  std::vector<uint8_t> ok(static_cast<size_t>(nchunks));
  parallel_for(static_cast<size_t>(nchunks), 1, [&](size_t lo, size_t hi) {
    for (size_t c = lo; c < hi; ++c) {
      int64_t begin = static_cast<int64_t>(c) * kNormChunk;
      ok[c] = chunk_finite(x + begin, std::min(kNormChunk, n - begin));
    }
  });
  for (uint8_t v : ok)
    if (!v) return false;
  return true;
}

}  // namespace zinc::kernels
