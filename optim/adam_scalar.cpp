// The plain scalar path (Adam and Lamb): the reference the vector paths are tested against,
// and the fallback on CPUs without AVX2.
#include "optim/detail/adam_math.h"
#include "optim/detail/lamb_math.h"
#include "optim/detail/vec_scalar.h"

namespace zinc::optim::detail {

const IsaKernels& scalar_kernels() {
  using S = VecScalar<false>;
  static const IsaKernels k = make_adam_table<S, S>();
  return k;
}

const LambKernels& scalar_lamb_kernels() {
  using S = VecScalar<false>;
  static const LambKernels k = make_lamb_table<S, S>();
  return k;
}

}  // namespace zinc::optim::detail
