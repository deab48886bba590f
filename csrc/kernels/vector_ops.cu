// The CUDA twins of vector_ops.cpp. squared_norm keeps the CPU's summation
// tree (math::kNormChunk chunks, each in lane order in double, chunk sums in
// index order), so its result is the CPU's bit for bit.
#include <unordered_map>

#include "kernels/cuda_common.cuh"
#include "kernels/gpu_profile.h"
#include "kernels/kernels_cuda.h"

namespace zinc::kernels::cuda {
namespace {

#define ZINC_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); i += int64_t{gridDim.x} * blockDim.x)

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  ZINC_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}
__global__ void accumulate_kernel(float* y, const float* x, int64_t n) {
  ZINC_GRID_STRIDE(i, n) y[i] += x[i];
}
__global__ void scale_kernel(float* x, float alpha, int64_t n) {
  ZINC_GRID_STRIDE(i, n) x[i] *= alpha;
}
__global__ void copy_columns_kernel(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t width,
                                    int64_t n) {
  ZINC_GRID_STRIDE(i, n) {
    const int64_t r = i / width, c = i % width;
    dst[r * dst_W + c] = src[r * src_W + c];
  }
}
__global__ void add_transposed_kernel(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows,
                                      int64_t cols) {
  ZINC_GRID_STRIDE(i, rows * cols) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ldd + c] += src[c * lds + r];
  }
}
__global__ void axpy_kernel(float* y, float alpha, const float* x, int64_t n) {
  ZINC_GRID_STRIDE(i, n) y[i] += alpha * x[i];
}
__global__ void dropout_kernel(float* out, const float* x, int64_t n, uint32_t threshold, float keep_scale,
                               uint64_t key, bool accumulate, DropoutColumns w) {
  ZINC_GRID_STRIDE(i, n) {
    const uint32_t at = math::dropout_index(i, w.cols, w.stride, w.first);
    const float v = math::dropout_keeps(key, at, threshold) ? x[i] * keep_scale : 0.0f;
    out[i] = accumulate ? out[i] + v : v;
  }
}

// Two chunks per warp (16 lanes each), kRowsPerBlock chunks per block.
__global__ void chunk_norm_kernel(const float* x, int64_t n, int64_t nchunks, double* partial) {
  const int64_t chunk = blockIdx.x * int64_t{detail::kRowsPerBlock} + threadIdx.x / math::kLanes;
  const int lane = threadIdx.x % math::kLanes;
  const bool valid = chunk < nchunks;
  const int64_t begin = valid ? chunk * math::kNormChunk : 0;
  const int64_t len = valid ? (n - begin < math::kNormChunk ? n - begin : math::kNormChunk) : 0;
  const float* xc = x + begin;
  const double s = detail::lane_combine(math::lane_partial<double>(len, lane, [&](int64_t i) {
    const double v = xc[i];
    return v * v;
  }));
  if (valid && lane == 0) partial[chunk] = s;
}

__global__ void sum_in_order_kernel(const double* partial, int64_t nchunks, double* out) {
  double s = 0;
  for (int64_t c = 0; c < nchunks; ++c) s += partial[c];
  *out = s;
}

}  // namespace

void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (n <= 0) return;
  add_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(out, a, b, n);
  detail::check_launch("add");
}
void accumulate(float* y, const float* x, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (n <= 0) return;
  accumulate_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(y, x, n);
  detail::check_launch("accumulate");
}
void copy_columns(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t N, int64_t width,
                  cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  const int64_t n = N * width;
  if (N <= 0 || width <= 0) return;
  copy_columns_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(dst, dst_W, src, src_W, width, n);
  detail::check_launch("copy_columns");
}
void add_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols,
                    cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (rows <= 0 || cols <= 0) return;
  add_transposed_kernel<<<detail::blocks_for(rows * cols), detail::kThreads, 0, stream>>>(dst, ldd, src, lds, rows,
                                                                                           cols);
  detail::check_launch("add_transposed");
}
void scale(float* x, float alpha, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (n <= 0) return;
  scale_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(x, alpha, n);
  detail::check_launch("scale");
}
void axpy(float* y, float alpha, const float* x, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (n <= 0) return;
  axpy_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(y, alpha, x, n);
  detail::check_launch("axpy");
}

void dropout(float* out, const float* x, int64_t n, float p, uint64_t key, bool accumulate, cudaStream_t stream,
             DropoutColumns window) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (n <= 0) return;
  check_dropout_window(n, window);
  dropout_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(
      out, x, n, math::dropout_threshold(p), 1.0f / (1.0f - p), key, accumulate, window);
  detail::check_launch("dropout");
}

void squared_norm(const float* x, int64_t n, double* out, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (n <= 0) {
    ZINC_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), stream), "squared_norm (empty)");
    return;
  }
  const int64_t nchunks = (n + math::kNormChunk - 1) / math::kNormChunk;
  // Scratch per (thread, stream): two streams of one thread must not share
  // the partial sums between the chunk and the summing kernels.
  thread_local std::unordered_map<cudaStream_t, ::zinc::cuda::DeviceBuffer> scratch;
  ::zinc::cuda::DeviceBuffer& partial = scratch[stream];
  if (partial.bytes() < static_cast<size_t>(nchunks) * sizeof(double)) {
    ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "squared_norm: synchronize before growing its scratch");
    partial.reserve(static_cast<size_t>(nchunks) * sizeof(double), "the norm's partial sums");
  }
  const unsigned blocks = static_cast<unsigned>((nchunks + detail::kRowsPerBlock - 1) / detail::kRowsPerBlock);
  chunk_norm_kernel<<<blocks, detail::kRowThreads, 0, stream>>>(x, n, nchunks, partial.as<double>());
  detail::check_launch("squared_norm (chunks)");
  sum_in_order_kernel<<<1, 1, 0, stream>>>(partial.as<double>(), nchunks, out);
  detail::check_launch("squared_norm (sum)");
}

}  // namespace zinc::kernels::cuda
