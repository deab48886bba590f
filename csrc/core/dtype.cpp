#include "core/dtype.h"

#include <immintrin.h>

#include <cstring>

#include "core/cpu.h"
#include "core/parallel.h"

namespace zinc {
namespace {

// The loops are written so that GCC vectorises them (the NaN test becomes a
// blend), once per ISA level (ZINC_ISA_VARIANTS, core/cpu.h). The integer
// rounding is float_to_bf16's, so every level gives the same bits.
ZINC_ALWAYS_INLINE void f32_to_bf16_range_body(const float* __restrict src, bf16* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}
ZINC_ISA_VARIANTS(void, f32_to_bf16_range, (const float* __restrict src, bf16* __restrict dst, size_t n),
                  (src, dst, n))

ZINC_ALWAYS_INLINE void bf16_to_f32_range_body(const bf16* __restrict src, float* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
ZINC_ISA_VARIANTS(void, bf16_to_f32_range, (const bf16* __restrict src, float* __restrict dst, size_t n),
                  (src, dst, n))

// dst may equal src: each element is read before it is written.
ZINC_ALWAYS_INLINE void round_bf16_range_body(const float* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(float_to_bf16(src[i]));
}
ZINC_ISA_VARIANTS(void, round_bf16_range, (const float* src, float* dst, size_t n), (src, dst, n))

// fp16: the compiler does not vectorise float_to_f16's selects well, and
// every x86 CPU with AVX2 has the F16C conversion instructions, which round
// to nearest even exactly as float_to_f16 defines it (NaN payloads too:
// tests/core Fp16.MatchesTheCpusConversionInstruction). So the AVX2 and
// AVX-512 levels use them (8 and 16 values per instruction) and the
// baseline loops over the scalar functions; the tail of a vector loop goes
// through the scalar functions as well.
void f32_to_f16_scalar(const float* src, f16* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
}
void f16_to_f32_scalar(const f16* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_float(src[i]);
}
void round_f16_scalar(const float* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_float(float_to_f16(src[i]));
}

__attribute__((target("avx2,fma,f16c"))) void f32_to_f16_avx2(const float* src, f16* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  f32_to_f16_scalar(src + i, dst + i, n - i);
}
__attribute__((target("avx2,fma,f16c"))) void f16_to_f32_avx2(const f16* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  f16_to_f32_scalar(src + i, dst + i, n - i);
}
__attribute__((target("avx2,fma,f16c"))) void round_f16_avx2(const float* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  round_f16_scalar(src + i, dst + i, n - i);
}
// GCC 12's _mm512_cvtps_ph / _mm512_cvtph_ps start from an undefined
// register, which -Wmaybe-uninitialized reports inside its own header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
ZINC_TARGET_AVX512 void f32_to_f16_avx512(const float* src, f16* dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  f32_to_f16_scalar(src + i, dst + i, n - i);
}
ZINC_TARGET_AVX512 void f16_to_f32_avx512(const f16* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  f16_to_f32_scalar(src + i, dst + i, n - i);
}
ZINC_TARGET_AVX512 void round_f16_avx512(const float* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  round_f16_scalar(src + i, dst + i, n - i);
}

#pragma GCC diagnostic pop

// The level: the dispatcher's, with AVX2 only where the CPU has F16C.
int f16_level() {
  const CpuIsa isa = detail::dispatch_isa();
  if (isa == CpuIsa::kBaseline) return 0;
  static const bool f16c = __builtin_cpu_supports("f16c");
  if (!f16c) return 0;
  return isa == CpuIsa::kAvx2 ? 1 : 2;
}
void f32_to_f16_range(const float* src, f16* dst, size_t n) {
  switch (f16_level()) {
    case 0: return f32_to_f16_scalar(src, dst, n);
    case 1: return f32_to_f16_avx2(src, dst, n);
    default: return f32_to_f16_avx512(src, dst, n);
  }
}
void f16_to_f32_range(const f16* src, float* dst, size_t n) {
  switch (f16_level()) {
    case 0: return f16_to_f32_scalar(src, dst, n);
    case 1: return f16_to_f32_avx2(src, dst, n);
    default: return f16_to_f32_avx512(src, dst, n);
  }
}
void round_f16_range(const float* src, float* dst, size_t n) {
  switch (f16_level()) {
    case 0: return round_f16_scalar(src, dst, n);
    case 1: return round_f16_avx2(src, dst, n);
    default: return round_f16_avx512(src, dst, n);
  }
}

}  // namespace

// OpenMP chunks of at least 64 KiB of work.
void convert_f32_to_bf16(const float* src, bf16* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) { f32_to_bf16_range(src + lo, dst + lo, hi - lo); });
}

void convert_f32_to_bf16_serial(const float* src, bf16* dst, size_t n) { f32_to_bf16_range(src, dst, n); }
void round_to_f16_serial(const float* src, float* dst, size_t n) { round_f16_range(src, dst, n); }

void convert_bf16_to_f32(const bf16* src, float* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) { bf16_to_f32_range(src + lo, dst + lo, hi - lo); });
}

}  // namespace zinc

namespace zinc {
void round_to_bf16(const float* src, float* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) { round_bf16_range(src + lo, dst + lo, hi - lo); });
}
}  // namespace zinc

namespace zinc {
void convert_f32_to_f16(const float* src, f16* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) { f32_to_f16_range(src + lo, dst + lo, hi - lo); });
}
void convert_f16_to_f32(const f16* src, float* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) { f16_to_f32_range(src + lo, dst + lo, hi - lo); });
}
void round_to_f16(const float* src, float* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) { round_f16_range(src + lo, dst + lo, hi - lo); });
}
void convert_f32_to_16(const float* src, void* dst, size_t n, DType t) {
  switch (t) {
    case DType::kF32: std::memcpy(dst, src, n * 4); break;
    case DType::kBF16: convert_f32_to_bf16(src, static_cast<bf16*>(dst), n); break;
    case DType::kF16: convert_f32_to_f16(src, static_cast<f16*>(dst), n); break;
  }
}
void convert_16_to_f32(const void* src, float* dst, size_t n, DType t) {
  switch (t) {
    case DType::kF32: std::memcpy(dst, src, n * 4); break;
    case DType::kBF16: convert_bf16_to_f32(static_cast<const bf16*>(src), dst, n); break;
    case DType::kF16: convert_f16_to_f32(static_cast<const f16*>(src), dst, n); break;
  }
}
}  // namespace zinc
