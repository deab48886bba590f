// zinc core: code shared between the CPU and CUDA builds.
//
// ZINC_HD marks a function that is compiled for the host and, under nvcc, for
// the device too: the per-element math of the kernels (kernels/math.h), the
// bf16/fp16 conversions (core/dtype.h) and the Adam update
// (optim/detail/adam_update.h) are written once with it, so that the CPU
// tests run the very formulas the GPU kernels run.
//
// Bit-identical results on both sides need the same operations in the same
// order with the same roundings: the CPU kernels build with
// -ffp-contract=off and the .cu files with --fmad=false (no a*b+c fused
// unless the code says fma), and nvcc's default IEEE division and square
// root (no --use_fast_math).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ZINC_HD __host__ __device__ __forceinline__
#else
#define ZINC_HD inline
#endif

namespace zinc {

ZINC_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

ZINC_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

}  // namespace zinc
