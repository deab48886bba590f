// The plain scalar path: the reference the vector paths are tested against,
// and the fallback on CPUs without AVX2.
#include "optim/detail/adam_math.h"
#include "optim/detail/vec_scalar.h"

namespace zinc::optim::detail {
namespace {

template <bool kBf16>
double sqnorm_scalar(const void* grad, int64_t lo, int64_t hi) {
  double s = 0;
  for (int64_t i = lo; i < hi; ++i) {
    float g = kBf16 ? bf16_to_float(static_cast<const bf16*>(grad)[i]) : static_cast<const float*>(grad)[i];
    s += static_cast<double>(g) * g;
  }
  return s;
}

}  // namespace

const IsaKernels& scalar_kernels() {
  using S = VecScalar<false>;
  static const IsaKernels k = make_adam_table<S, S>(&sqnorm_scalar<false>, &sqnorm_scalar<true>);
  return k;
}

}  // namespace zinc::optim::detail
