// zinc optim, private: AVX2 + FMA mapping (8 floats). Include only from a
// file compiled with -mavx2 -mfma.
#pragma once

#include <immintrin.h>

#include "core/dtype.h"

namespace zinc::optim::detail {

struct VecAvx2 {
  using F = __m256;
  static constexpr int kWidth = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_bf16(const bf16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even in integer arithmetic, NaN made quiet: the same
  // bits as zinc::float_to_bf16.
  static void store_bf16(bf16* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16(x));
  }
  // Non-temporal: p must be 16-byte aligned.
  static void stream_bf16(bf16* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), round_bf16(x)); }
  static void fence() { _mm_sfence(); }
  static __m128i round_bf16(F x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Pack the low 16 bits of the 8 lanes (values fit in 16 bits unsigned).
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi);
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // Sum-of-squares accumulator: 8 floats widen into two 4-double registers.
  struct D {
    __m256d lo, hi;
  };
  static D dzero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static D sq_acc(D acc, F x) {
    __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return {_mm256_fmadd_pd(a, a, acc.lo), _mm256_fmadd_pd(b, b, acc.hi)};
  }
  // The 8 lanes added in lane order.
  static double dsum(D acc) {
    alignas(32) double lanes[8];
    _mm256_store_pd(lanes, acc.lo);
    _mm256_store_pd(lanes + 4, acc.hi);
    double s = 0;
    for (double x : lanes) s += x;
    return s;
  }
};

}  // namespace zinc::optim::detail
