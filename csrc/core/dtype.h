// zinc core: element types and bf16 conversion.
//
// bf16 is the upper half of an IEEE-754 binary32. Conversion from fp32 rounds
// to nearest, ties to even; NaN stays NaN (quiet bit forced, sign kept) and
// +-Inf stays +-Inf. Finite values above the bf16 range round to Inf, as IEEE
// rounding requires. All functions are pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace zinc {

enum class DType : uint8_t { kF32, kBF16 };

constexpr size_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) { return t == DType::kF32 ? "fp32" : "bf16"; }

// Storage type for one bf16 value; arithmetic goes through float.
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2);

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even fp32 -> bf16. This is the definition every vector
// path (kernels, optimizer copy-out) must match bit for bit.
inline bf16 float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and top payload, force quiet
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

inline float bf16_to_float(bf16 h) { return bits_float(static_cast<uint32_t>(h.bits) << 16); }

// Bulk conversions; threaded and vectorised. n may be 0.
void convert_f32_to_bf16(const float* src, bf16* dst, size_t n);
void convert_bf16_to_f32(const bf16* src, float* dst, size_t n);
// dst = bf16_to_float(float_to_bf16(src)): fp32 values rounded to bf16
// precision (dst may equal src).
void round_to_bf16(const float* src, float* dst, size_t n);

}  // namespace zinc
