// zinc kernels, private to the .cu files: launch helpers, the lane-order
// row reduction (Note [lane order] in kernels/math.h) and the column sums
// (Note [column sums]).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/math.h"

namespace zinc::kernels::cuda::detail {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : b > 65535 * 8 ? 65535 * 8 : b);
}

// Throws zinc::Error naming the kernel when its launch failed.
inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) ::zinc::cuda::throw_cuda_error(e, (std::string("launch of ") + kernel).c_str(), __FILE__, __LINE__);
}

// The 16-bit operand dtype of the fused forms (Note [fused 16-bit operands]
// in kernels_cuda.h): throws zinc::Error naming `fn` for anything else.
inline void check_operand16(DType t, const char* fn) {
  if (t != DType::kBF16 && t != DType::kF16)
    throw Error(std::string(fn) + ": the operand dtype must be bf16 or fp16, got " + std::string(dtype_name(t)));
}

// One element of a parameter in its storage dtype, widened exactly.
__device__ __forceinline__ float load_param(const void* p, DType t, int64_t i) {
  if (t == DType::kF32) return static_cast<const float*>(p)[i];
  return from_16(static_cast<const uint16_t*>(p)[i], t);
}

// Rows handled by a block of kRowThreads threads, math::kLanes threads per row.
constexpr int kRowThreads = 128;
constexpr int kRowsPerBlock = kRowThreads / math::kLanes;

// The row sum of Note [lane order]: `partial` is this thread's
// math::lane_partial for lane (threadIdx.x % kLanes); every thread of the
// row's 16 gets the partials added in lane order from zero. All 32 lanes of
// the warp must call it (both rows of the warp), with the same control flow.
template <class Acc>
__device__ __forceinline__ Acc lane_combine(Acc partial) {
  Acc s = 0;
#pragma unroll
  for (int l = 0; l < math::kLanes; ++l) s += __shfl_sync(0xffffffffu, partial, l, math::kLanes);
  return s;
}

// Column sums (Note [column sums]): a block of kSumCols x kSumChunks
// threads owns kSumCols columns; in each wave thread (x, y) adds chunk
// wave * kSumChunks + y of column x (its rows in order), and thread y = 0
// then adds the wave's chunk sums in chunk order. A warp reads kSumCols
// consecutive floats of one row.
constexpr int kSumCols = 32, kSumChunks = 32;

// One chunk of a column: rows [r0, min(r0 + kColumnChunk, M)) in order, in
// double from zero; the per-row term is `term(i)`.
template <class Term>
__device__ double chunk_sum(int64_t r0, int64_t M, Term term) {
  double p = 0;
  const int64_t r1 = r0 + math::kColumnChunk < M ? r0 + math::kColumnChunk : M;
  for (int64_t i = r0; i < r1; ++i) p += term(i);
  return p;
}

}  // namespace zinc::kernels::cuda::detail
