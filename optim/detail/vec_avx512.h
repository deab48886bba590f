// zinc optim, private: AVX-512 mapping (16 floats); with kBf16Insn the bf16
// store uses the AVX512-BF16 conversion instruction. Include only from a file
// compiled with -mavx512f -mavx512bw -mavx512vl (and -mavx512bf16).
#pragma once

#include <immintrin.h>

#include "core/dtype.h"

namespace zinc::optim::detail {

// Integer round-to-nearest-even with quiet NaN, 16 lanes: zinc::float_to_bf16.
inline __m256i avx512_bf16_rne(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  __mmask16 nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

template <bool kBf16Insn>
struct VecAvx512 {
  using F = __m512;
  static constexpr int kWidth = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F load_bf16(const bf16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store_bf16(bf16* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16(x)); }
  // Non-temporal: p must be 32-byte aligned.
  static void stream_bf16(bf16* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), round_bf16(x)); }
  static void fence() { _mm_sfence(); }
  static __m256i round_bf16(F x) {
    __m256i r;
    if constexpr (kBf16Insn) {
      // VCVTNEPS2BF16 rounds to nearest even and quiets NaN like
      // float_to_bf16, but flushes subnormal inputs to zero; those lanes
      // (rare: |x| < 2^-126) take the integer path so the bits stay equal.
      __m512i abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
      __mmask16 sub = _mm512_cmplt_epi32_mask(abs, _mm512_set1_epi32(0x00800000)) &
                      _mm512_cmpneq_epi32_mask(abs, _mm512_setzero_si512());
      r = (__m256i)_mm512_cvtneps_pbh(x);
      if (__builtin_expect(sub != 0, 0)) r = _mm256_mask_blend_epi16(sub, r, avx512_bf16_rne(x));
    } else {
      r = avx512_bf16_rne(x);
    }
    return r;
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // Sum-of-squares accumulator: 16 floats widen into two 8-double registers.
  struct D {
    __m512d lo, hi;
  };
  static D dzero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static D sq_acc(D acc, F x) {
    __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d b = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(x), 1)));
    return {_mm512_fmadd_pd(a, a, acc.lo), _mm512_fmadd_pd(b, b, acc.hi)};
  }
  // The 16 lanes added in lane order.
  static double dsum(D acc) {
    alignas(64) double lanes[16];
    _mm512_store_pd(lanes, acc.lo);
    _mm512_store_pd(lanes + 8, acc.hi);
    double s = 0;
    for (double x : lanes) s += x;
    return s;
  }
};

}  // namespace zinc::optim::detail
