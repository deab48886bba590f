// zinc core: element types and bf16 / fp16 conversion.
//
// bf16 is the upper half of an IEEE-754 binary32. Conversion from fp32 rounds
// to nearest, ties to even; NaN stays NaN (quiet bit forced, sign kept) and
// +-Inf stays +-Inf. Finite values above the bf16 range round to Inf, as IEEE
// rounding requires.
// fp16 is IEEE-754 binary16 (5 exponent bits, 10 mantissa bits, largest
// finite 65504, subnormals down to 2^-24). Conversion from fp32 rounds to
// nearest, ties to even, with subnormal results; finite values of 65520 and
// above round to +-Inf (so an fp16 gradient overflows where a GPU's would);
// NaN stays NaN (quiet, sign and the top of the payload kept, as the F16C
// instruction does). fp16 -> fp32 is exact.
// All functions are pure and thread-safe. The scalar conversions are
// ZINC_HD (core/hd.h): the CUDA kernels convert with the same code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "core/hd.h"

namespace zinc {

enum class DType : uint8_t { kF32, kBF16, kF16 };

constexpr size_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) {
  return t == DType::kF32 ? "fp32" : t == DType::kBF16 ? "bf16" : "fp16";
}
// The 16-bit formats.
constexpr bool is_16bit(DType t) { return t != DType::kF32; }

// Storage type for one bf16 value; arithmetic goes through float.
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2);

// Storage type for one fp16 (IEEE binary16) value.
struct f16 {
  uint16_t bits;
};
static_assert(sizeof(f16) == 2);

// Round-to-nearest-even fp32 -> bf16. This is the definition every vector
// path (kernels, optimizer copy-out) must match bit for bit.
ZINC_HD bf16 float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and top payload, force quiet
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>((u + rounding_bias) >> 16)};
}

ZINC_HD float bf16_to_float(bf16 h) { return bits_float(static_cast<uint32_t>(h.bits) << 16); }

// Round-to-nearest-even fp32 -> fp16 by integer arithmetic, the definition
// every bulk path matches bit for bit (and the CPU's F16C instruction gives
// the same bits, NaN payloads included). Normal results: the exponent is
// rebiased (127 -> 15) and the 13 dropped mantissa bits rounded with the
// carry running into the exponent (which also turns 65520 and above into
// Inf). Subnormal results (|f| < 2^-14): adding 0.5f, whose unit in the last
// place is 2^-24, makes the fp32 adder round |f| to a multiple of 2^-24, the
// fp16 subnormal step; the low mantissa bits of the sum are then the fp16
// bits. NaN: quiet, the top of the payload kept. Every case is computed and
// one selected, without branches, so that loops over it vectorise.
ZINC_HD f16 float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t t = a - (112u << 23);
  const uint32_t normal = (t + 0xfffu + ((t >> 13) & 1u)) >> 13;
  const uint32_t subnormal = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
  uint32_t h = a >= 0x38800000u ? normal : subnormal;  // >= 2^-14: a normal fp16
  h = a >= 0x47800000u ? 0x7c00u : h;  // >= 65536 and Inf (65520 up to 65536 reach Inf by rounding)
  h = a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : h;  // NaN
  return f16{static_cast<uint16_t>(sign | h)};
}

// Exact fp16 -> fp32. Normal values rebias the exponent (15 -> 127);
// subnormals are (bits) * 2^-24, formed exactly as a float product; Inf and
// NaN keep an all-ones exponent. Branch-free like float_to_f16.
ZINC_HD float f16_to_float(f16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t e = (h.bits >> 10) & 0x1fu;
  const uint32_t m = h.bits & 0x3ffu;
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  const uint32_t special = 0x7f800000u | (m << 13);
  const uint32_t subnormal = float_bits(static_cast<float>(static_cast<int32_t>(m)) * 5.9604644775390625e-8f);
  uint32_t u = e == 0x1fu ? special : normal;
  u = e == 0 ? subnormal : u;
  return bits_float(sign | u);
}

// The 16-bit formats by DType (kBF16 or kF16).
ZINC_HD uint16_t float_to_16(float f, DType t) {
  return t == DType::kF16 ? float_to_f16(f).bits : float_to_bf16(f).bits;
}
ZINC_HD float from_16(uint16_t bits, DType t) {
  return t == DType::kF16 ? f16_to_float(f16{bits}) : bf16_to_float(bf16{bits});
}

// Bulk conversions; threaded and vectorised. n may be 0.
void convert_f32_to_bf16(const float* src, bf16* dst, size_t n);
void convert_bf16_to_f32(const bf16* src, float* dst, size_t n);
// dst = bf16_to_float(float_to_bf16(src)): fp32 values rounded to bf16
// precision (dst may equal src).
void round_to_bf16(const float* src, float* dst, size_t n);
void convert_f32_to_f16(const float* src, f16* dst, size_t n);
void convert_f16_to_f32(const f16* src, float* dst, size_t n);
// dst = f16_to_float(float_to_f16(src)) (dst may equal src).
void round_to_f16(const float* src, float* dst, size_t n);
// The same, vectorised but on the calling thread only: for a kernel that
// converts rows inside its own parallel loop.
void convert_f32_to_bf16_serial(const float* src, bf16* dst, size_t n);
void round_to_f16_serial(const float* src, float* dst, size_t n);
// By DType: kBF16 or kF16 (16-bit data as uint16_t); kF32 copies.
void convert_f32_to_16(const float* src, void* dst, size_t n, DType t);
void convert_16_to_f32(const void* src, float* dst, size_t n, DType t);

}  // namespace zinc
