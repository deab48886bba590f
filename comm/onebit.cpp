// The compressed all-reduce of 1-bit Adam (comm/onebit.h).
//
// Note [1-bit all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~
// DeepSpeed's compressed_allreduce (runtime/comm/nccl.py, mpi.py,
// compressed.py; the padding in runtime/fp16/onebit/adam.py), read at
// deepspeedai/DeepSpeed master, and matched here step by step:
//
//  - Padding: OnebitAdam pads a buffer of n elements with zeros to a
//    multiple of p * divider, divider = lcm(p, 8) = 8p / gcd(p, 8)
//    (corrected_tensor_size), so the worker error has the padded size and
//    the server error padded / p (server_chunk_size). Same here
//    (onebit_padded_size); the padding travels and is dropped at the end.
//  - Worker: x = buffer (zero padded) + worker_error; worker_scale =
//    ||x||_2 / sqrt(padded) (the norm over the whole padded buffer, divided
//    by the square root of its element count); worker_error = x -
//    worker_scale * s(x) with s(x) = sign(x) + 1 as bool, then 2b - 1: +1
//    for x >= 0, for -0 and for NaN, -1 for x < 0. Same here (bit = !(x < 0)).
//  - Packing: packbits of the bools (cupy/numpy default bitorder 'big':
//    element i -> bit 7 - i % 8 of byte i / 8), split into p equal chunks;
//    chunk j goes to rank j (all_to_all_single), every worker's scale to
//    every rank (all_gather). Same bit order here; the scale and the chunk's
//    bytes travel together as one message of f32 words (one all_to_all
//    instead of an all_to_all and an all_gather: the same data).
//  - Server (rank j, chunk j): compensated = sum over ranks q of
//    s_q * (scale_q * (1 / p)), the 1/p folded into each worker's scale
//    before the sum (torch.stack(scales).mul_(1 / size)), then +=
//    server_error; server_scale = ||compensated||_2 / sqrt(chunk);
//    server_error = compensated - server_scale * s(compensated); packed the
//    same way and all-gathered with the server scales; every rank's result
//    is s * server_scale of every chunk, in rank order, cut back to n.
//    Same here; the sum over q runs in rank order ((v0 + v1) + v2) + ...
//  - n = 0: DeepSpeed returns the empty buffer untouched; so does average().
//
// Where zinc differs, in rounding only: torch computes the norm in fp32 in
// its own reduction order and divides by np.sqrt (a double) in fp32; zinc
// sums the squares in double (eight partial sums, element i into i % 8,
// combined pairwise in a fixed order) and rounds
// sqrt(sum) / sqrt(count) to float once, so large values (|x| ~ 1e20,
// whose squares overflow fp32) give a finite scale where fp32 would give
// inf. torch's sum over ranks may group differently from rank order for
// p > 2 on a GPU. Everything else (signs, errors, the 1/p, the chunking, the
// padding) is exact, so results equal DeepSpeed's to within the rounding of
// the two scales, not bit for bit. The double-precision norm is plain code
// with that fixed order, so a reference summing the same way reproduces it
// bit for bit (tests/comm/onebit_reference.h); eight independent sums run
// about 4x faster than one (each addition no longer waits for the last).
#include "comm/onebit.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "core/cpu.h"
#include "core/error.h"

namespace zinc::comm {
namespace {

// Byte with its bits in reverse order: movemask gives lane k in bit k, the
// wire wants element k in bit 7 - k.
constexpr std::array<uint8_t, 256> make_reverse() {
  std::array<uint8_t, 256> r{};
  for (int b = 0; b < 256; ++b) {
    int v = 0;
    for (int k = 0; k < 8; ++k) v |= ((b >> k) & 1) << (7 - k);
    r[static_cast<size_t>(b)] = static_cast<uint8_t>(v);
  }
  return r;
}
constexpr std::array<uint8_t, 256> kReverse = make_reverse();

// Scalar forms: the fallback, and the tails of the vector forms.
void pack_tail(const float* x, int64_t from, int64_t n, uint8_t* bits) {
  for (int64_t i = from; i < n; i += 8) {
    unsigned byte = 0;
    for (int64_t k = 0; k < 8 && i + k < n; ++k) {
      if (!(x[i + k] < 0.0f)) byte |= 1u << (7 - k);
    }
    bits[i / 8] = static_cast<uint8_t>(byte);
  }
}

void unpack_tail(const uint8_t* bits, int64_t from, int64_t n, float scale, float* out, bool accumulate) {
  for (int64_t i = from; i < n; ++i) {
    const float v = (bits[i / 8] >> (7 - i % 8)) & 1 ? scale : -scale;
    out[i] = accumulate ? out[i] + v : v;
  }
}

ZINC_TARGET_AVX2 void pack_avx2(const float* x, int64_t n, uint8_t* bits) {
  const int64_t full = n / 8 * 8;
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < full; i += 8) {
    const int neg = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), zero, _CMP_LT_OQ));
    bits[i / 8] = kReverse[static_cast<size_t>(~neg & 0xFF)];
  }
  pack_tail(x, full, n, bits);
}

ZINC_TARGET_AVX2 void unpack_avx2(const uint8_t* bits, int64_t n, float scale, float* out, bool accumulate) {
  const int64_t full = n / 8 * 8;
  const __m256i lane_bit = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
  const __m256 pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
  for (int64_t i = 0; i < full; i += 8) {
    const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[i / 8]), lane_bit);
    __m256 v = _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lane_bit)));
    if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
    _mm256_storeu_ps(out + i, v);
  }
  unpack_tail(bits, full, n, scale, out, accumulate);
}

ZINC_TARGET_AVX512 void pack_avx512(const float* x, int64_t n, uint8_t* bits) {
  const int64_t full = n / 16 * 16;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += 16) {
    const unsigned pos = ~static_cast<unsigned>(_mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), zero, _CMP_LT_OQ));
    bits[i / 8] = kReverse[pos & 0xFF];
    bits[i / 8 + 1] = kReverse[(pos >> 8) & 0xFF];
  }
  pack_tail(x, full, n, bits);
}

ZINC_TARGET_AVX512 void unpack_avx512(const uint8_t* bits, int64_t n, float scale, float* out, bool accumulate) {
  const int64_t full = n / 16 * 16;
  const __m512 pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
  for (int64_t i = 0; i < full; i += 16) {
    const auto m = static_cast<__mmask16>(kReverse[bits[i / 8]] | (kReverse[bits[i / 8 + 1]] << 8));
    __m512 v = _mm512_mask_blend_ps(m, neg, pos);
    if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(out + i), v);
    _mm512_storeu_ps(out + i, v);
  }
  unpack_tail(bits, full, n, scale, out, accumulate);
}

void check_level(CpuIsa isa) {
  if (isa > cpu_isa()) {
    throw Error("onebit: " + std::string(cpu_isa_name(isa)) + " cannot run here: " + cpu_isa_missing(isa));
  }
}

// The worker's and the server's two passes over a buffer (Note [1-bit
// all-reduce]), each fused so that the buffer is read once per pass:
//  - compensate: x[i] += e[i], returning the sum of the squares of the new
//    x[i] in double, element i into partial sum i % 8, the partial sums
//    added as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)). Eight
//    independent sums keep the adder busy, and the fixed order gives the
//    same bits at every ISA level (the vector forms keep lane k = sum k and
//    multiply and add separately: the file is built with -ffp-contract=off).
//  - error_pack: e[i] = x[i] - scale * s(x[i]) and the sign bits of x.
double combine8(const double* s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

double compensate_scalar(float* x, const float* e, int64_t n, double* s) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      x[i + k] += e[i + k];
      s[k] += static_cast<double>(x[i + k]) * static_cast<double>(x[i + k]);
    }
  for (int k = 0; i < n; ++i, ++k) {
    x[i] += e[i];
    s[k] += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  }
  return combine8(s);
}

// The squares of v's eight floats, in double, added to lanes 0-3 (lo) and
// 4-7 (hi): lane k holds element i % 8 == k, as compensate_scalar's s[k].
ZINC_TARGET_AVX2 inline void add_squares_avx2(__m256 v, __m256d& lo, __m256d& hi) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
  hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
}

ZINC_TARGET_AVX2 double compensate_avx2(float* x, const float* e, int64_t n) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  const int64_t full = n / 8 * 8;
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(e + i));
    _mm256_storeu_ps(x + i, v);
    add_squares_avx2(v, lo, hi);
  }
  alignas(32) double s[8];
  _mm256_store_pd(s, lo);
  _mm256_store_pd(s + 4, hi);
  return compensate_scalar(x + full, e + full, n - full, s);
}

ZINC_TARGET_AVX512 double compensate_avx512(float* x, const float* e, int64_t n) {
  __m512d acc = _mm512_setzero_pd();
  const int64_t full = n / 8 * 8;
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(e + i));
    _mm256_storeu_ps(x + i, v);
    const __m512d a = _mm512_cvtps_pd(v);
    acc = _mm512_add_pd(acc, _mm512_mul_pd(a, a));
  }
  alignas(64) double s[8];
  _mm512_store_pd(s, acc);
  return compensate_scalar(x + full, e + full, n - full, s);
}

void error_pack_tail(const float* x, int64_t from, int64_t n, float scale, float* e, uint8_t* bits) {
  for (int64_t i = from; i < n; ++i) e[i] = x[i] - (x[i] < 0.0f ? -scale : scale);
  pack_tail(x, from, n, bits);
}

ZINC_TARGET_AVX2 void error_pack_avx2(const float* x, int64_t n, float scale, float* e, uint8_t* bits) {
  const int64_t full = n / 8 * 8;
  const __m256 zero = _mm256_setzero_ps(), pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
  for (int64_t i = 0; i < full; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 lt = _mm256_cmp_ps(v, zero, _CMP_LT_OQ);
    _mm256_storeu_ps(e + i, _mm256_sub_ps(v, _mm256_blendv_ps(pos, neg, lt)));
    bits[i / 8] = kReverse[static_cast<size_t>(~_mm256_movemask_ps(lt) & 0xFF)];
  }
  error_pack_tail(x, full, n, scale, e, bits);
}

ZINC_TARGET_AVX512 void error_pack_avx512(const float* x, int64_t n, float scale, float* e, uint8_t* bits) {
  const int64_t full = n / 16 * 16;
  const __m512 zero = _mm512_setzero_ps(), pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
  for (int64_t i = 0; i < full; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 lt = _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ);
    _mm512_storeu_ps(e + i, _mm512_sub_ps(v, _mm512_mask_blend_ps(lt, pos, neg)));
    const unsigned p = ~static_cast<unsigned>(lt);
    bits[i / 8] = kReverse[p & 0xFF];
    bits[i / 8 + 1] = kReverse[(p >> 8) & 0xFF];
  }
  error_pack_tail(x, full, n, scale, e, bits);
}

// The server's first pass, fused: y[i] = the sum over q in rank order of
// (bit i of bits[q] ? scale[q] : -scale[q]), plus e[i]; returns the sum of
// the squares of y as compensate does (lane i % 8). The same operations in
// the same order as unpacking each chunk, accumulating, and compensating.
double server_sum_scalar(const uint8_t* const* bits, const float* scale, int p, const float* e, float* y, int64_t from,
                         int64_t n, double* s) {
  for (int64_t i = from; i < n; ++i) {
    float v = (bits[0][i / 8] >> (7 - i % 8)) & 1 ? scale[0] : -scale[0];
    for (int q = 1; q < p; ++q) v += (bits[q][i / 8] >> (7 - i % 8)) & 1 ? scale[q] : -scale[q];
    v += e[i];
    y[i] = v;
    s[(i - from) % 8] += static_cast<double>(v) * static_cast<double>(v);
  }
  return combine8(s);
}

ZINC_TARGET_AVX2 double server_sum_avx2(const uint8_t* const* bits, const float* scale, int p, const float* e,
                                        float* y, int64_t n) {
  const __m256i lane_bit = _mm256_setr_epi32(128, 64, 32, 16, 8, 4, 2, 1);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  const int64_t full = n / 8 * 8;
  for (int64_t i = 0; i < full; i += 8) {
    __m256 v = _mm256_setzero_ps();
    for (int q = 0; q < p; ++q) {
      const __m256i b = _mm256_and_si256(_mm256_set1_epi32(bits[q][i / 8]), lane_bit);
      const __m256 pos = _mm256_set1_ps(scale[q]), neg = _mm256_set1_ps(-scale[q]);
      const __m256 t = _mm256_blendv_ps(neg, pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, lane_bit)));
      v = q == 0 ? t : _mm256_add_ps(v, t);
    }
    v = _mm256_add_ps(v, _mm256_loadu_ps(e + i));
    _mm256_storeu_ps(y + i, v);
    add_squares_avx2(v, lo, hi);
  }
  alignas(32) double s[8];
  _mm256_store_pd(s, lo);
  _mm256_store_pd(s + 4, hi);
  return server_sum_scalar(bits, scale, p, e, y, full, n, s);
}

ZINC_TARGET_AVX512 double server_sum_avx512(const uint8_t* const* bits, const float* scale, int p, const float* e,
                                            float* y, int64_t n) {
  __m512d acc = _mm512_setzero_pd();
  const int64_t full = n / 16 * 16;
  for (int64_t i = 0; i < full; i += 16) {
    __m512 v = _mm512_setzero_ps();
    for (int q = 0; q < p; ++q) {
      const auto m = static_cast<__mmask16>(kReverse[bits[q][i / 8]] | (kReverse[bits[q][i / 8 + 1]] << 8));
      const __m512 t = _mm512_mask_blend_ps(m, _mm512_set1_ps(-scale[q]), _mm512_set1_ps(scale[q]));
      v = q == 0 ? t : _mm512_add_ps(v, t);
    }
    v = _mm512_add_ps(v, _mm512_loadu_ps(e + i));
    _mm512_storeu_ps(y + i, v);
    const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(a, a));
    acc = _mm512_add_pd(acc, _mm512_mul_pd(b, b));
  }
  alignas(64) double s[8];
  _mm512_store_pd(s, acc);
  return server_sum_scalar(bits, scale, p, e, y, full, n, s);
}

// y[0, n) := the sum of the p decompressed chunks plus e; returns the server's scale.
float server_sum_scale(const uint8_t* const* bits, const float* scale, int p, const float* e, float* y, int64_t n) {
  double sum = 0;
  switch (detail::dispatch_isa()) {
    case CpuIsa::kBaseline: {
      double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      sum = server_sum_scalar(bits, scale, p, e, y, 0, n, s);
      break;
    }
    case CpuIsa::kAvx2: sum = server_sum_avx2(bits, scale, p, e, y, n); break;
    default: sum = server_sum_avx512(bits, scale, p, e, y, n);
  }
  return static_cast<float>(std::sqrt(sum) / std::sqrt(static_cast<double>(n)));
}

// x[0, n) += e; returns sqrt(sum of squares) / sqrt(n), DeepSpeed's scale.
float compensate_scale(float* x, const float* e, int64_t n) {
  double sum = 0;
  switch (detail::dispatch_isa()) {
    case CpuIsa::kBaseline: {
      double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      sum = compensate_scalar(x, e, n, s);
      break;
    }
    case CpuIsa::kAvx2: sum = compensate_avx2(x, e, n); break;
    default: sum = compensate_avx512(x, e, n);
  }
  return static_cast<float>(std::sqrt(sum) / std::sqrt(static_cast<double>(n)));
}

void error_pack(const float* x, int64_t n, float scale, float* e, uint8_t* bits) {
  switch (detail::dispatch_isa()) {
    case CpuIsa::kBaseline: return error_pack_tail(x, 0, n, scale, e, bits);
    case CpuIsa::kAvx2: return error_pack_avx2(x, n, scale, e, bits);
    default: return error_pack_avx512(x, n, scale, e, bits);
  }
}

}  // namespace

void pack_signs_at(CpuIsa isa, const float* x, int64_t n, uint8_t* bits) {
  check_level(isa);
  switch (isa) {
    case CpuIsa::kBaseline: return pack_tail(x, 0, n, bits);
    case CpuIsa::kAvx2: return pack_avx2(x, n, bits);
    default: return pack_avx512(x, n, bits);
  }
}

void unpack_signs_scaled_at(CpuIsa isa, const uint8_t* bits, int64_t n, float scale, float* out, bool accumulate) {
  check_level(isa);
  switch (isa) {
    case CpuIsa::kBaseline: return unpack_tail(bits, 0, n, scale, out, accumulate);
    case CpuIsa::kAvx2: return unpack_avx2(bits, n, scale, out, accumulate);
    default: return unpack_avx512(bits, n, scale, out, accumulate);
  }
}

void pack_signs(const float* x, int64_t n, uint8_t* bits) { pack_signs_at(detail::dispatch_isa(), x, n, bits); }

void unpack_signs_scaled(const uint8_t* bits, int64_t n, float scale, float* out, bool accumulate) {
  unpack_signs_scaled_at(detail::dispatch_isa(), bits, n, scale, out, accumulate);
}

int64_t onebit_padded_size(int64_t n, int p) {
  ZINC_CHECK(n >= 0 && p >= 1, "onebit_padded_size: n >= 0 and p >= 1");
  const int64_t divider = int64_t{8} * p / std::gcd(p, 8);
  const int64_t unit = int64_t{p} * divider;
  return (n + unit - 1) / unit * unit;
}

CompressedAllReduce::CompressedAllReduce(int64_t n, int world_size)
    : n_(n), padded_(onebit_padded_size(n, world_size)), p_(world_size) {
  const int64_t chunk = padded_ / p_;
  words_ = 1 + (chunk / 8 + 3) / 4;
  worker_error_.assign(static_cast<size_t>(padded_), 0.0f);
  server_error_.assign(static_cast<size_t>(chunk), 0.0f);
  x_.resize(static_cast<size_t>(padded_));
  y_.resize(static_cast<size_t>(chunk));
  send_.resize(static_cast<size_t>(p_ * words_));
  recv_.resize(static_cast<size_t>(p_ * words_));
  bits_.resize(static_cast<size_t>(p_));
  scales_.resize(static_cast<size_t>(p_));
}

void CompressedAllReduce::average(Communicator& comm, float* buf, int64_t n) {
  check_call(comm, n);
  if (n == 0) return;
  if (buf != x_.data()) std::memcpy(x_.data(), buf, static_cast<size_t>(n) * sizeof(float));
  average_input(comm, buf);
}

void CompressedAllReduce::check_call(const Communicator& comm, int64_t n) const {
  if (n != n_ || comm.size() != p_) {
    throw Error("CompressedAllReduce::average: made for " + std::to_string(n_) + " elements over " +
                std::to_string(p_) + " ranks, called with " + std::to_string(n) + " over " +
                std::to_string(comm.size()));
  }
}

void CompressedAllReduce::average_input(Communicator& comm, float* out) {
  check_call(comm, n_);
  if (n_ == 0) return;
  const int64_t chunk = padded_ / p_;
  auto message = [&](std::vector<float>& v, int q) { return v.data() + q * words_; };
  auto message_bits = [&](std::vector<float>& v, int q) { return reinterpret_cast<uint8_t*>(message(v, q) + 1); };

  // Worker: compensate (the padding is 0 + error) and scale in one pass;
  // error and signs in a second; message j = (scale, chunk j's signs).
  float* x = x_.data();
  std::fill(x + n_, x + padded_, 0.0f);
  const float worker_scale = compensate_scale(x, worker_error_.data(), padded_);
  std::fill(send_.begin(), send_.end(), 0.0f);
  for (int j = 0; j < p_; ++j) {
    message(send_, j)[0] = worker_scale;
    error_pack(x + j * chunk, chunk, worker_scale, worker_error_.data() + j * chunk, message_bits(send_, j));
  }
  comm.all_to_all(send_.data(), recv_.data(), words_, DType::kF32);

  // Server (this rank's chunk): average of the decompressed chunks, compensate, compress.
  float* y = y_.data();
  const float inv_p = 1.0f / static_cast<float>(p_);
  std::vector<const uint8_t*>& bits = bits_;
  std::vector<float>& scales = scales_;
  for (int q = 0; q < p_; ++q) {
    bits[static_cast<size_t>(q)] = message_bits(recv_, q);
    scales[static_cast<size_t>(q)] = message(recv_, q)[0] * inv_p;
  }
  const float server_scale = server_sum_scale(bits.data(), scales.data(), p_, server_error_.data(), y, chunk);
  const int me = comm.rank();
  std::fill(send_.begin(), send_.end(), 0.0f);
  message(send_, me)[0] = server_scale;
  error_pack(y, chunk, server_scale, server_error_.data(), message_bits(send_, me));
  comm.all_gather(message(send_, me), send_.data(), words_, DType::kF32);

  // Every rank: decompress the chunks straight into out[0, n) (the padding is dropped).
  for (int q = 0; q < p_; ++q) {
    const int64_t from = q * chunk, count = std::min(chunk, n_ - from);
    if (count > 0) unpack_signs_scaled(message_bits(send_, q), count, message(send_, q)[0], out + from);
  }
}

}  // namespace zinc::comm
