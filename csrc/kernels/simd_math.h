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
#include "kernels/math.h"

namespace zinc::kernels::detail {

// The shared math (kernels/math.h), under the names the CPU kernels use.
constexpr int kLanes = math::kLanes;
using math::exp_f;
using math::tanh_f;
using math::kGeluA;
using math::kGeluC;

// Sum of f(i) for i in [0, n), accumulated in Acc over kLanes lanes (lane
// i % kLanes) and combined in lane order (Note [lane order] in math.h: the
// CUDA kernels sum in the same order). f must be cheap and inlinable.
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

}  // namespace zinc::kernels::detail
