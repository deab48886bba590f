// The AVX2 + FMA path (this file is compiled with -mavx2 -mfma).
#include "optim/detail/adam_math.h"
#include "optim/detail/lamb_math.h"
#include "optim/detail/vec_avx2.h"
#include "optim/detail/vec_scalar.h"

namespace zinc::optim::detail {

const IsaKernels& avx2_kernels() {
  static const IsaKernels k = make_adam_table<VecAvx2, VecScalar<true, 2>>();
  return k;
}

const LambKernels& avx2_lamb_kernels() {
  static const LambKernels k = make_lamb_table<VecAvx2, VecScalar<true, 2>>();
  return k;
}

}  // namespace zinc::optim::detail
