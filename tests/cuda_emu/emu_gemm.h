// The emulated cuBLAS and cuBLASLt's one product (emu_cublas.cpp,
// emu_cublaslt.cpp): a column of op(A) op(B), each of its m sums taken in
// fp32 in k order from 0, as both document. op(A) is widened once into k
// rows of m (element (i, l) at w[l * m + i]), so that the m sums of a column
// advance together, one row of w times one number of B's column at a time:
// the compiler vectorises across the m sums, and each sum still sees the same
// roundings in the same order (a product, then an add; -ffp-contract=off) as
// the plain dot product would, so the bits do not change.
#pragma once
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "tests/cuda_emu/include/cublas_v2.h"

namespace zinc_emu_gemm {

inline float load(const void* p, cudaDataType t, int64_t i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return zinc::from_16(h, t == CUDA_R_16BF ? zinc::DType::kBF16 : zinc::DType::kF16);
}

// op(A) of one batch entry, widened: A is column-major with leading
// dimension lda from `base`; op(A)(i, l) is A(i, l), or A(l, i) transposed.
inline void widen_a(const void* A, cudaDataType t, int64_t base, int64_t lda, bool transposed, int64_t m,
                    int64_t k, std::vector<float>& w) {
  w.resize(static_cast<size_t>(m * k));
  for (int64_t l = 0; l < k; ++l)
    for (int64_t i = 0; i < m; ++i)
      w[static_cast<size_t>(l * m + i)] = load(A, t, base + (transposed ? l + i * lda : i + l * lda));
}

// acc[i] = sum over l of w(i, l) * bcol[l], for i < m, in l order.
inline void column(const std::vector<float>& w, const float* bcol, int64_t m, int64_t k, float* acc) {
  for (int64_t i = 0; i < m; ++i) acc[i] = 0.0f;
  for (int64_t l = 0; l < k; ++l) {
    const float x = bcol[l];
    const float* row = w.data() + l * m;
    for (int64_t i = 0; i < m; ++i) acc[i] += row[i] * x;
  }
}

}  // namespace zinc_emu_gemm
