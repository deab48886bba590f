// zinc kernels, private: vectorisable math and the ISA-dispatch attribute.
//
// Note [kernel vectorisation]
// The project builds without -march (the binary must run on any x86-64), so a
// plain loop is compiled for SSE2 only. The compute-bound loops (GELU, the
// exponentials of softmax and cross-entropy, layernorm rows, the column sums
// of the parameter gradients) are written once as an always-inline `_body`
// and compiled three times by ZINC_ISA_VARIANTS (core/cpu.h): baseline, AVX2
// and AVX-512, chosen per call from zinc::cpu_isa(), which honours the
// ONEDNN_MAX_CPU_ISA cap (an ifunc, as GCC's target_clones uses, cannot be
// capped). The loops themselves are plain C++ written so that GCC vectorises
// them: contiguous, __restrict where there is no aliasing, no libm calls
// (libm's expf/tanhf are scalar without -ffast-math). Two flags in
// kernels/CMakeLists.txt make that hold for AVX2 too:
// - -fno-trapping-math: the selects of exp_f and tanh_f (clamps, the sign)
//   compute both arms; with trapping math GCC may not speculate an FP
//   operation, and without AVX-512's masked instructions it then leaves the
//   loop scalar. zinc never reads the FP exception flags, and the flag
//   changes no value.
// - -ffp-contract=off: no clone fuses a*b+c, so every ISA computes the same
//   bits, and the results depend neither on the thread count nor on the ISA
//   (tests/kernels checks every path against the baseline bit for bit).
// GCC will not reorder a single float accumulator without -ffast-math, so
// sums go through lane_sum: kLanes independent accumulators in a loop over
// whole blocks (the form GCC's loop vectoriser accepts; a `j + 16 <= n` loop
// or an exp fused into a double accumulation is left scalar), combined in a
// fixed order. Maxima use an OpenMP simd max reduction, which is exact in any
// order.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/cpu.h"

namespace zinc::kernels::detail {

// Independent partial sums per reduction (one zmm of floats).
constexpr int kLanes = 16;

// exp(x) in float, ~2 ulp over the whole range; 0 below -87.3 (where the true
// value is subnormal), saturates at exp(88.7). Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial (truncation
// error r^8/8! < 1e-8 relative).
inline float exp_f(float x) {
  float xc = x > 88.7f ? 88.7f : x;
  xc = xc < -87.3f ? -87.3f : xc;
  float nf = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = xc - nf * 0.693359375f;  // ln2 split into an exactly representable head
  r = r + nf * 2.12194440e-4f;       // and a tail: ln2 = 0.693359375 - 2.12194440e-4
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(nf) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, 4);
  return x < -87.3f ? 0.0f : p * s;
}

// tanh(u) = sign(u) (1 - 2 / (exp(2|u|) + 1)); absolute error ~1e-7.
inline float tanh_f(float u) {
  float a = u < 0.0f ? -u : u;
  float t = 1.0f - 2.0f / (exp_f(2.0f * a) + 1.0f);
  return u < 0.0f ? -t : t;
}

// Sum of f(i) for i in [0, n), accumulated in Acc over kLanes lanes (lane
// i % kLanes) and combined in lane order. f must be cheap and inlinable.
template <class Acc, class F>
inline Acc lane_sum(int64_t n, F&& f) {
  Acc acc[kLanes] = {};
  const int64_t nb = n / kLanes;
  for (int64_t b = 0; b < nb; ++b)
    for (int l = 0; l < kLanes; ++l) acc[l] += static_cast<Acc>(f(b * kLanes + l));
  for (int64_t i = nb * kLanes; i < n; ++i) acc[i - nb * kLanes] += static_cast<Acc>(f(i));
  Acc s = 0;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// max of x[0..n) (-inf when n == 0); NaNs are ignored.
inline float max_of(const float* __restrict x, int64_t n) {
  float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

}  // namespace zinc::kernels::detail
