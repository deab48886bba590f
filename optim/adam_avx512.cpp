// The AVX-512 paths (this file is compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512bf16 -mfma); the BF16 instruction is only used by the
// table that the dispatcher picks when the CPU reports avx512bf16.
#include "optim/detail/adam_math.h"
#include "optim/detail/lamb_math.h"
#include "optim/detail/vec_avx512.h"
#include "optim/detail/vec_scalar.h"

namespace zinc::optim::detail {

const IsaKernels& avx512_kernels() {
  static const IsaKernels k = make_adam_table<VecAvx512<false>, VecScalar<true, 5>>();
  return k;
}

const IsaKernels& avx512_bf16_kernels() {
  static const IsaKernels k = make_adam_table<VecAvx512<true>, VecScalar<true, 5>>();
  return k;
}

const LambKernels& avx512_lamb_kernels() {
  static const LambKernels k = make_lamb_table<VecAvx512<false>, VecScalar<true, 5>>();
  return k;
}

const LambKernels& avx512_bf16_lamb_kernels() {
  static const LambKernels k = make_lamb_table<VecAvx512<true>, VecScalar<true, 5>>();
  return k;
}

}  // namespace zinc::optim::detail
