// The AVX-512 paths (this file is compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512bf16 -mfma); the BF16 instruction is only used by the
// table that the dispatcher picks when the CPU reports avx512bf16.
#include "optim/detail/adam_math.h"
#include "optim/detail/vec_avx512.h"
#include "optim/detail/vec_scalar.h"

namespace zinc::optim::detail {
namespace {

// Squares accumulate in double: 16 floats widen into two 8-double registers.
template <bool kBf16>
double sqnorm_avx512(const void* grad, int64_t lo, int64_t hi) {
  using V = VecAvx512<false>;
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 g = kBf16 ? V::load_bf16(static_cast<const bf16*>(grad) + i) : V::load(static_cast<const float*>(grad) + i);
    __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    __m512d b = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(g), 1)));
    acc0 = _mm512_fmadd_pd(a, a, acc0);
    acc1 = _mm512_fmadd_pd(b, b, acc1);
  }
  alignas(64) double lanes[16];
  _mm512_store_pd(lanes, acc0);
  _mm512_store_pd(lanes + 8, acc1);
  double s = 0;
  for (double x : lanes) s += x;
  for (; i < hi; ++i) {
    float g = kBf16 ? bf16_to_float(static_cast<const bf16*>(grad)[i]) : static_cast<const float*>(grad)[i];
    s = std::fma(static_cast<double>(g), static_cast<double>(g), s);
  }
  return s;
}

}  // namespace

const IsaKernels& avx512_kernels() {
  static const IsaKernels k = make_adam_table<VecAvx512<false>, VecScalar<true, 5>>(&sqnorm_avx512<false>,
                                                                                &sqnorm_avx512<true>);
  return k;
}

const IsaKernels& avx512_bf16_kernels() {
  static const IsaKernels k = make_adam_table<VecAvx512<true>, VecScalar<true, 5>>(&sqnorm_avx512<false>,
                                                                               &sqnorm_avx512<true>);
  return k;
}

}  // namespace zinc::optim::detail
