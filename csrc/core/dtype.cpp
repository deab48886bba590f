#include "core/dtype.h"

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

ZINC_ALWAYS_INLINE void f32_to_f16_range_body(const float* __restrict src, f16* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
}
ZINC_ISA_VARIANTS(void, f32_to_f16_range, (const float* __restrict src, f16* __restrict dst, size_t n),
                  (src, dst, n))

ZINC_ALWAYS_INLINE void f16_to_f32_range_body(const f16* __restrict src, float* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_float(src[i]);
}
ZINC_ISA_VARIANTS(void, f16_to_f32_range, (const f16* __restrict src, float* __restrict dst, size_t n),
                  (src, dst, n))

ZINC_ALWAYS_INLINE void round_f16_range_body(const float* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_float(float_to_f16(src[i]));
}
ZINC_ISA_VARIANTS(void, round_f16_range, (const float* src, float* dst, size_t n), (src, dst, n))

}  // namespace

// OpenMP chunks of at least 64 KiB of work.
void convert_f32_to_bf16(const float* src, bf16* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) { f32_to_bf16_range(src + lo, dst + lo, hi - lo); });
}

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
