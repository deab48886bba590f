// Lamb over GPU-resident state (optim_cuda.h, Note [Lamb arithmetic] in
// optim/detail/lamb_math.h): pass 1 one block per piece, summing w^2 and
// u^2 in double; pass 2 one block per piece with its segment's coefficient.
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/error.h"
#include "kernels/gpu_profile.h"
#include "optim/detail/lamb_update.h"
#include "optim/optim_cuda.h"

namespace zinc::optim {
namespace {

using detail::LambArgs;
using detail::VecHD;

constexpr int kLambThreads = 256;

// One piece of the span (lamb_update.h's LambPiece as the device reads it).
struct PieceRow {
  int64_t begin, end;
  int64_t seg;
};

__device__ inline float load_grad(const void* grad, DType dt, int64_t i) {
  return dt == DType::kF32 ? static_cast<const float*>(grad)[i] : from_16(static_cast<const uint16_t*>(grad)[i], dt);
}

// Block p adds its piece's w^2 and u^2: each thread its strided elements in
// order, then the threads' sums in a tree (fixed, so the same bits every run).
template <bool kEpsInside>
__global__ void lamb_norms_kernel(LambArgs a, const float* w, const void* grad, DType grad_dtype, const float* m,
                                  const float* v, const PieceRow* pieces, double* partial) {
  __shared__ double sw[kLambThreads], su[kLambThreads];
  const PieceRow pc = pieces[blockIdx.x];
  double acc_w = 0, acc_u = 0;
  for (int64_t i = pc.begin + threadIdx.x; i < pc.end; i += kLambThreads) {
    float wi = w[i], mi = m[i], vi = v[i];
    const float u = detail::lamb_u<VecHD, kEpsInside>(a, wi, load_grad(grad, grad_dtype, i), mi, vi);
    acc_w += static_cast<double>(wi) * static_cast<double>(wi);
    acc_u += static_cast<double>(u) * static_cast<double>(u);
  }
  sw[threadIdx.x] = acc_w;
  su[threadIdx.x] = acc_u;
  __syncthreads();
  for (int half = kLambThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) {
      sw[threadIdx.x] += sw[threadIdx.x + half];
      su[threadIdx.x] += su[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partial[2 * blockIdx.x] = sw[0];
    partial[2 * blockIdx.x + 1] = su[0];
  }
}

// Block p updates its piece: w = coef u + w, m, v, and the 16-bit copy.
template <bool kEpsInside>
__global__ void lamb_apply_kernel(LambArgs a, float* w, const void* grad, DType grad_dtype, float* m, float* v,
                                  void* out16, DType out_dtype, const PieceRow* pieces, const float* coef) {
  const PieceRow pc = pieces[blockIdx.x];
  const float c = coef[pc.seg];
  for (int64_t i = pc.begin + threadIdx.x; i < pc.end; i += kLambThreads) {
    float wi = w[i], mi = m[i], vi = v[i];
    const float u = detail::lamb_u<VecHD, kEpsInside>(a, wi, load_grad(grad, grad_dtype, i), mi, vi);
    wi = VecHD::fma(c, u, wi);
    w[i] = wi;
    m[i] = mi;
    v[i] = vi;
    if (out16) static_cast<uint16_t*>(out16)[i] = float_to_16(wi, out_dtype);
  }
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) cuda::throw_cuda_error(e, what, __FILE__, __LINE__);
}

}  // namespace

int LambCuda::upload_pieces(int64_t n, std::span<const LambSegment> segs, const char* who, cudaStream_t stream) {
  const std::vector<detail::LambPiece> pieces = detail::lamb_pieces(n, segs, who);
  std::vector<PieceRow> rows;
  rows.reserve(pieces.size());
  for (const detail::LambPiece& p : pieces) rows.push_back({p.begin, p.end, p.seg});
  host_seg_.clear();
  for (const detail::LambPiece& p : pieces) host_seg_.push_back(p.seg);
  const size_t bytes = rows.size() * sizeof(PieceRow);
  if (table_.bytes() < bytes || partial_.bytes() < rows.size() * 2 * sizeof(double)) {
    // The last call's kernels may still read the old buffers.
    ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "Lamb: synchronize before growing its scratch");
    table_.reserve(bytes, "Lamb's table of pieces");
    partial_.reserve(rows.size() * 2 * sizeof(double), "Lamb's partial norms");
  }
  // From pageable memory: staged before the call returns, then in stream order.
  if (bytes)
    ZINC_CUDA_CHECK(cudaMemcpyAsync(table_.data(), rows.data(), bytes, cudaMemcpyHostToDevice, stream),
                    "Lamb: upload of the piece table");
  return static_cast<int>(rows.size());
}

void LambCuda::norms(const LambParams& p, float grad_scale, const float* w, const void* grad, DType grad_dtype,
                     const float* m, const float* v, int64_t n, std::span<const LambSegment> segs, double* sums,
                     cudaStream_t stream) {
  kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kOptimizer, stream);
  const int count = upload_pieces(n, segs, "lamb_norms (GPU)", stream);
  if (count == 0) return;
  const LambArgs a = detail::make_lamb_args(p, grad_scale);
  if (p.eps_inside_sqrt)
    lamb_norms_kernel<true><<<count, kLambThreads, 0, stream>>>(a, w, grad, grad_dtype, m, v, table_.as<PieceRow>(),
                                                                partial_.as<double>());
  else
    lamb_norms_kernel<false><<<count, kLambThreads, 0, stream>>>(a, w, grad, grad_dtype, m, v, table_.as<PieceRow>(),
                                                                 partial_.as<double>());
  check("launch of the Lamb norms");
  std::vector<double> host(static_cast<size_t>(2 * count));
  ZINC_CUDA_CHECK(cudaMemcpyAsync(host.data(), partial_.data(), host.size() * sizeof(double), cudaMemcpyDeviceToHost,
                                  stream),
                  "Lamb: copy of the norms' partial sums");
  ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "Lamb: waiting for the norms");
  // Each segment's pieces in order, then the segment into its tensor's
  // sums: lamb_norms's order.
  size_t i = 0;
  for (size_t k = 0; k < segs.size(); ++k) {
    double sw = 0, su = 0;
    for (; i < host_seg_.size() && host_seg_[i] == static_cast<int>(k); ++i) {
      sw += host[2 * i];
      su += host[2 * i + 1];
    }
    if (segs[k].tensor < 0) continue;
    sums[2 * segs[k].tensor] += sw;
    sums[2 * segs[k].tensor + 1] += su;
  }
}

void LambCuda::apply(const LambParams& p, int64_t step, float grad_scale, float* w, const void* grad,
                     DType grad_dtype, float* m, float* v, void* out16, DType out16_dtype, int64_t n,
                     std::span<const LambSegment> segs, const double* ratios, cudaStream_t stream) {
  kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kOptimizer, stream);
  if (step < 1) throw Error("lamb_apply (GPU): step must be >= 1, got " + std::to_string(step));
  if (out16 && !is_16bit(out16_dtype)) throw Error("lamb_apply (GPU): out16 must be bf16 or fp16");
  const int count = upload_pieces(n, segs, "lamb_apply (GPU)", stream);
  if (count == 0) return;
  const std::vector<float> coef = detail::lamb_coefficients(p, step, segs, ratios);
  if (coef_.bytes() < coef.size() * sizeof(float)) {
    ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "Lamb: synchronize before growing its scratch");
    coef_.reserve(coef.size() * sizeof(float), "Lamb's trust ratios");
  }
  ZINC_CUDA_CHECK(cudaMemcpyAsync(coef_.data(), coef.data(), coef.size() * sizeof(float), cudaMemcpyHostToDevice,
                                  stream),
                  "Lamb: upload of the coefficients");
  const LambArgs a = detail::make_lamb_args(p, grad_scale);
  if (p.eps_inside_sqrt)
    lamb_apply_kernel<true><<<count, kLambThreads, 0, stream>>>(a, w, grad, grad_dtype, m, v, out16, out16_dtype,
                                                                table_.as<PieceRow>(), coef_.as<float>());
  else
    lamb_apply_kernel<false><<<count, kLambThreads, 0, stream>>>(a, w, grad, grad_dtype, m, v, out16, out16_dtype,
                                                                 table_.as<PieceRow>(), coef_.as<float>());
  check("launch of the Lamb update");
}

}  // namespace zinc::optim
