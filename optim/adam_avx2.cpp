// The AVX2 + FMA path (this file is compiled with -mavx2 -mfma).
#include "optim/detail/adam_math.h"
#include "optim/detail/vec_avx2.h"
#include "optim/detail/vec_scalar.h"

namespace zinc::optim::detail {
namespace {

// Squares accumulate in double: 8 floats widen into two 4-double registers.
template <bool kBf16>
double sqnorm_avx2(const void* grad, int64_t lo, int64_t hi) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 g = kBf16 ? VecAvx2::load_bf16(static_cast<const bf16*>(grad) + i)
                     : VecAvx2::load(static_cast<const float*>(grad) + i);
    __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
    __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    acc0 = _mm256_fmadd_pd(a, a, acc0);
    acc1 = _mm256_fmadd_pd(b, b, acc1);
  }
  alignas(32) double lanes[8];
  _mm256_store_pd(lanes, acc0);
  _mm256_store_pd(lanes + 4, acc1);
  double s = 0;
  for (double x : lanes) s += x;
  for (; i < hi; ++i) {
    float g = kBf16 ? bf16_to_float(static_cast<const bf16*>(grad)[i]) : static_cast<const float*>(grad)[i];
    s = std::fma(static_cast<double>(g), static_cast<double>(g), s);
  }
  return s;
}

}  // namespace

const IsaKernels& avx2_kernels() {
  static const IsaKernels k =
      make_adam_table<VecAvx2, VecScalar<true, 2>>(&sqnorm_avx2<false>, &sqnorm_avx2<true>);
  return k;
}

}  // namespace zinc::optim::detail
