// The shared-memory backend's reductions and copies (shm_reduce.h). The
// scalar loops are the reference and the only code: contiguous, __restrict,
// no calls, so GCC vectorises each ISA variant.
#include "comm/shm_reduce.h"

#include <emmintrin.h>

#include <algorithm>
#include <cstring>

#include "core/cpu.h"

namespace zinc::comm::detail {
namespace {

constexpr int64_t kTile = 2048;  // fp32 accumulator elements per tile (8 KiB, stays in L1)

ZINC_ALWAYS_INLINE void add_f32_body(float* __restrict acc, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}
ZINC_ISA_VARIANTS(void, add_f32, (float* __restrict acc, const float* __restrict x, int64_t n), (acc, x, n))
ZINC_ALWAYS_INLINE void add2_f32_body(float* __restrict acc, const float* __restrict a, const float* __restrict b,
                              int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = a[i] + b[i];
}
ZINC_ISA_VARIANTS(void, add2_f32, (float* __restrict acc, const float* __restrict a, const float* __restrict b, int64_t n), (acc, a, b, n))
ZINC_ALWAYS_INLINE void widen_bf16_body(float* __restrict acc, const uint16_t* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = bits_float(static_cast<uint32_t>(x[i]) << 16);
}
ZINC_ISA_VARIANTS(void, widen_bf16, (float* __restrict acc, const uint16_t* __restrict x, int64_t n), (acc, x, n))
ZINC_ALWAYS_INLINE void add_bf16_body(float* __restrict acc, const uint16_t* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += bits_float(static_cast<uint32_t>(x[i]) << 16);
}
ZINC_ISA_VARIANTS(void, add_bf16, (float* __restrict acc, const uint16_t* __restrict x, int64_t n), (acc, x, n))
ZINC_ALWAYS_INLINE void round_bf16_body(uint16_t* __restrict out, const float* __restrict acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(acc[i]).bits;
}
ZINC_ISA_VARIANTS(void, round_bf16, (uint16_t* __restrict out, const float* __restrict acc, int64_t n), (out, acc, n))
ZINC_ALWAYS_INLINE void widen_f16_body(float* __restrict acc, const uint16_t* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] = f16_to_float(f16{x[i]});
}
ZINC_ISA_VARIANTS(void, widen_f16, (float* __restrict acc, const uint16_t* __restrict x, int64_t n), (acc, x, n))
ZINC_ALWAYS_INLINE void add_f16_body(float* __restrict acc, const uint16_t* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += f16_to_float(f16{x[i]});
}
ZINC_ISA_VARIANTS(void, add_f16, (float* __restrict acc, const uint16_t* __restrict x, int64_t n), (acc, x, n))
ZINC_ALWAYS_INLINE void round_f16_body(uint16_t* __restrict out, const float* __restrict acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_f16(acc[i]).bits;
}
ZINC_ISA_VARIANTS(void, round_f16, (uint16_t* __restrict out, const float* __restrict acc, int64_t n), (out, acc, n))


// memcpy through non-temporal 16-byte stores (SSE2, every x86-64) where dst
// is aligned, ordinary copies for the unaligned head and the tail. The stores
// are weakly ordered: a collective that streamed ends with an sfence (see
// Note [shm collectives: memory ordering]).
void stream_copy(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = std::min(bytes, static_cast<size_t>(-reinterpret_cast<uintptr_t>(d) & 15));
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  for (; bytes >= 64; bytes -= 64, d += 64, s += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  for (; bytes >= 16; bytes -= 16, d += 16, s += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  std::memcpy(d, s, bytes);
}

}  // namespace

void copy_out(void* dst, const void* src, size_t bytes, bool stream) {
  if (stream) {
    stream_copy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

// dst[i] = src[0][i] + src[1][i] + ... + src[L-1][i] (left to right, fp32),
// i < n, and the same into dst2 unless it is null (dst2 streamed when
// stream2). dst or dst2 may be one of the sources (the same elements): each
// tile is read before it is written.
void reduce_sum(void* dst, void* dst2, const std::vector<const char*>& src, int64_t n, DType dtype,
                bool stream, bool stream2) {
  const size_t L = src.size();
  alignas(64) float acc[kTile];
  for (int64_t t = 0; t < n; t += kTile) {
    const int64_t m = std::min(kTile, n - t);
    if (dtype == DType::kF32) {
      auto at = [&](size_t q) { return reinterpret_cast<const float*>(src[q]) + t; };
      if (L == 1) {
        std::memcpy(acc, at(0), static_cast<size_t>(m) * 4);
      } else {
        add2_f32(acc, at(0), at(1), m);
        for (size_t q = 2; q < L; ++q) add_f32(acc, at(q), m);
      }
      copy_out(static_cast<float*>(dst) + t, acc, static_cast<size_t>(m) * 4, stream);
      if (dst2) copy_out(static_cast<float*>(dst2) + t, acc, static_cast<size_t>(m) * 4, stream2);
    } else {
      auto at = [&](size_t q) { return reinterpret_cast<const uint16_t*>(src[q]) + t; };
      alignas(64) uint16_t rounded[kTile];
      if (dtype == DType::kF16) {
        widen_f16(acc, at(0), m);
        for (size_t q = 1; q < L; ++q) add_f16(acc, at(q), m);
        round_f16(rounded, acc, m);
      } else {
        widen_bf16(acc, at(0), m);
        for (size_t q = 1; q < L; ++q) add_bf16(acc, at(q), m);
        round_bf16(rounded, acc, m);
      }
      copy_out(static_cast<uint16_t*>(dst) + t, rounded, static_cast<size_t>(m) * 2, stream);
      if (dst2) copy_out(static_cast<uint16_t*>(dst2) + t, rounded, static_cast<size_t>(m) * 2, stream2);
    }
  }
}


}  // namespace zinc::comm::detail
