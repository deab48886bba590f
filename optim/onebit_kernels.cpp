// The 1-bit optimizers' element loops (onebit_kernels.h).
#include "optim/onebit_kernels.h"

#include <algorithm>
#include <cmath>

#include "core/cpu.h"

namespace zinc::optim {
namespace {
// 1-bit Lamb's pass works through chunks of this many elements (a multiple of 8).
constexpr int64_t kLambChunk = 1024;
}  // namespace

// 1-bit Lamb's elementwise pass over one tensor (Note [1-bit Lamb]), one
// read of each array: the averaged momentum (fl, scaled) unscaled into m,
// the gradient reconstructed from it and the momentum before the step (m's
// old value) folded into the fresh variance vf, and the three reductions the
// factor needs: the sums of squares of u = m / denom + wd w and of m / denom
// (in double, element i into partial sum i % 8, combined ((s0 + s1) + (s2 +
// s3)) + ((s4 + s5) + (s6 + s7))) and the largest denom / (sqrt(vf) + eps), in element order.
//
// Written for GCC's vectoriser (Note [kernel vectorisation] in
// kernels/simd_math.h): per chunk of kChunk elements, one elementwise loop
// into three small buffers that stay in the L1 cache, then the reductions as
// eight lanes over whole blocks of 8 (lane k = element i % 8, so the chunks
// change no order). Compiled at each ISA level by ZINC_ISA_VARIANTS;
// -ffp-contract=off (optim/CMakeLists.txt) keeps every level's bits equal.
// The lane-wise maxima give the element-order maximum's bits: max skips NaN
// and keeps the first of equal values either way, and every lane starts at
// +0.
ZINC_ALWAYS_INLINE OneBitLambSums onebit_lamb_elementwise_body(int64_t n, const float* __restrict fl, float* __restrict m,
                                                  float* __restrict vf, const float* __restrict v,
                                                  const float* __restrict w, OneBitLambConsts c) {
  double su[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float rmax[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  alignas(64) float p[kLambChunk], u[kLambChunk], r[kLambChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kLambChunk) {
    const int64_t len = std::min(kLambChunk, n - c0);
    const float* __restrict flc = fl + c0;
    float* __restrict mc = m + c0;
    float* __restrict vfc = vf + c0;
    const float* __restrict vc = v + c0;
    const float* __restrict wc = w + c0;
    for (int64_t i = 0; i < len; ++i) {
      const float last = mc[i];
      const float mt = flc[i] / c.sc;
      mc[i] = mt;
      const float gr = (mt - last * c.b1) / c.one_minus_b1;
      const float vfn = c.b2 * vfc[i] + (c.one_minus_b2 * gr) * gr;
      vfc[i] = vfn;
      const float denom = std::sqrt(vc[i]) + c.eps;
      p[i] = mt / denom;
      u[i] = p[i] + c.wd * wc[i];
      r[i] = denom / (std::sqrt(vfn) + c.eps);
    }
    const int64_t full = len / 8 * 8;
    for (int64_t b = 0; b < full; b += 8)
      for (int k = 0; k < 8; ++k) su[k] += double(u[b + k]) * double(u[b + k]);
    for (int64_t b = 0; b < full; b += 8)
      for (int k = 0; k < 8; ++k) sp[k] += double(p[b + k]) * double(p[b + k]);
    for (int64_t b = 0; b < full; b += 8)
      for (int k = 0; k < 8; ++k) rmax[k] = rmax[k] < r[b + k] ? r[b + k] : rmax[k];
    for (int64_t i = full; i < len; ++i) {  // the last chunk's tail: lane i - full
      su[i - full] += double(u[i]) * double(u[i]);
      sp[i - full] += double(p[i]) * double(p[i]);
      rmax[i - full] = rmax[i - full] < r[i] ? r[i] : rmax[i - full];
    }
  }
  float ratio_max = 0;
  for (int k = 0; k < 8; ++k) ratio_max = ratio_max < rmax[k] ? rmax[k] : ratio_max;
  auto combine = [](const double* s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); };
  return {combine(su), combine(sp), ratio_max};
}
ZINC_ISA_VARIANTS(OneBitLambSums, onebit_lamb_elementwise,
                  (int64_t n, const float* fl, float* m, float* vf, const float* v, const float* w, OneBitLambConsts c),
                  (n, fl, m, vf, v, w, c))

// The other element loops of the compressed steps, each compiled at every
// ISA level the same way (plain loops, no a*b+c fused: every level gives the
// same bits).
// x = b1 m + (1 - b1) (g grad_scale) (x may be m).
ZINC_ALWAYS_INLINE void onebit_momentum_into_body(int64_t n, const float* m, const float* __restrict g, float* x,
                                           OneBitConsts c) {
  for (int64_t i = 0; i < n; ++i) x[i] = c.b1 * m[i] + c.one_minus_b1 * (g[i] * c.grad_scale);
}
ZINC_ISA_VARIANTS(void, onebit_momentum_into, (int64_t n, const float* m, const float* g, float* x, OneBitConsts c),
                  (n, m, g, x, c))
// The frozen-variance update in zinc's AdamW order: w = decay w + w (with
// weight decay), then w = -lr (m / (sqrt(v) + eps)) + w.
ZINC_ALWAYS_INLINE void onebit_frozen_update_body(int64_t n, float* __restrict w, const float* __restrict m,
                                           const float* __restrict v, OneBitConsts c) {
  if (c.decays) {
    for (int64_t i = 0; i < n; ++i) {
      const float decayed = c.decay * w[i] + w[i];
      w[i] = -c.lr * (m[i] / (std::sqrt(v[i]) + c.eps)) + decayed;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) w[i] = -c.lr * (m[i] / (std::sqrt(v[i]) + c.eps)) + w[i];
  }
}
ZINC_ISA_VARIANTS(void, onebit_frozen_update, (int64_t n, float* w, const float* m, const float* v, OneBitConsts c),
                  (n, w, m, v, c))
// 0/1 Adam's local step: m = b1 m + (1 - b1) g, u = m / (sqrt(v) + eps) +
// wd w, w += -lr u, acc += -lr u.
ZINC_ALWAYS_INLINE void zero_one_local_step_body(int64_t n, float* __restrict m, const float* __restrict g,
                                        const float* __restrict v, float* __restrict w, float* __restrict acc,
                                        OneBitConsts c) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = c.b1 * m[i] + c.one_minus_b1 * (g[i] * c.grad_scale);
    const float u = m[i] / (std::sqrt(v[i]) + c.eps) + c.wd * w[i];
    w[i] = w[i] + -c.lr * u;
    acc[i] = acc[i] + -c.lr * u;
  }
}
ZINC_ISA_VARIANTS(void, zero_one_local_step,
                  (int64_t n, float* m, const float* g, const float* v, float* w, float* acc, OneBitConsts c),
                  (n, m, g, v, w, acc, c))
// A synchronising step's local step and undo in one pass (the same
// operations in the same order as zero_one_local_step followed by a separate undo
// pass, so the same bits): m, w move as in zero_one_local_step, then the local steps
// are undone, w -= acc + -lr u, and x = (acc + -lr u) (sqrt(v) + eps).
// acc itself is not written: x is either acc (an alignment gap) or the
// compressor's input, whose average then lands in acc.
ZINC_ALWAYS_INLINE void zero_one_local_sync_body(int64_t n, float* __restrict m, const float* __restrict g,
                                        const float* __restrict v, float* __restrict w, const float* acc, float* x,
                                        OneBitConsts c) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = c.b1 * m[i] + c.one_minus_b1 * (g[i] * c.grad_scale);
    const float den = std::sqrt(v[i]) + c.eps;
    const float u = m[i] / den + c.wd * w[i];
    const float stepped = w[i] + -c.lr * u;
    const float a = acc[i] + -c.lr * u;
    w[i] = stepped - a;
    x[i] = a * den;
  }
}
ZINC_ISA_VARIANTS(void, zero_one_local_sync,
                  (int64_t n, float* m, const float* g, const float* v, float* w, const float* acc, float* x,
                   OneBitConsts c),
                  (n, m, g, v, w, acc, x, c))
// 0/1 Adam's synchronisation, after the average: m = -(avg / lrs), w +=
// avg / (sqrt(v) + eps), acc = 0 (avg is acc).
ZINC_ALWAYS_INLINE void zero_one_sync_apply_body(int64_t n, float* __restrict m, float* __restrict w, float* __restrict acc,
                                        const float* __restrict v, float lrs, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = -(acc[i] / lrs);
    w[i] = w[i] + acc[i] / (std::sqrt(v[i]) + eps);
    acc[i] = 0.0f;
  }
}
ZINC_ISA_VARIANTS(void, zero_one_sync_apply, (int64_t n, float* m, float* w, float* acc, const float* v, float lrs, float eps),
                  (n, m, w, acc, v, lrs, eps))
// 1-bit Lamb: x = (b1 m + (1 - b1) (g grad_scale)) sc; and the update w = w +
// coeff (m / (sqrt(v) + eps) + wd w).
ZINC_ALWAYS_INLINE void onebit_lamb_momentum_body(int64_t n, const float* __restrict m, const float* __restrict g,
                                           float* __restrict x, float sc, OneBitConsts c) {
  for (int64_t i = 0; i < n; ++i) x[i] = (c.b1 * m[i] + c.one_minus_b1 * (g[i] * c.grad_scale)) * sc;
}
ZINC_ISA_VARIANTS(void, onebit_lamb_momentum, (int64_t n, const float* m, const float* g, float* x, float sc, OneBitConsts c),
                  (n, m, g, x, sc, c))
ZINC_ALWAYS_INLINE void onebit_lamb_apply_body(int64_t n, float* __restrict w, const float* __restrict m,
                                        const float* __restrict v, float coeff, float eps, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = m[i] / (std::sqrt(v[i]) + eps) + wd * w[i];
    w[i] = w[i] + coeff * u;
  }
}
ZINC_ISA_VARIANTS(void, onebit_lamb_apply, (int64_t n, float* w, const float* m, const float* v, float coeff, float eps,
                                     float wd),
                  (n, w, m, v, coeff, eps, wd))

}  // namespace zinc::optim
