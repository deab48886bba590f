// AdamW over GPU-resident fp32 state (optim_cuda.h): one thread per element,
// grid-stride, the shared update of optim/detail/adam_update.h.
#include <string>

#include "core/cuda_util.h"
#include "kernels/gpu_profile.h"
#include "optim/detail/adam_args.h"
#include "optim/optim_cuda.h"

namespace zinc::optim {
namespace {

using detail::AdamArgs;
using detail::Decay;
using detail::VecHD;

template <Decay kDecay>
__global__ void adam_kernel(AdamArgs a, float* w, const void* grad, DType grad_dtype, float* m, float* v, void* out16,
                            DType out_dtype, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float wi = w[i], mi = m[i], vi = v[i];
    const float gi = grad_dtype == DType::kF32 ? static_cast<const float*>(grad)[i]
                                               : from_16(static_cast<const uint16_t*>(grad)[i], grad_dtype);
    detail::adam_update<VecHD, kDecay>(a, wi, gi, mi, vi);
    w[i] = wi;
    m[i] = mi;
    v[i] = vi;
    if (out16) static_cast<uint16_t*>(out16)[i] = float_to_16(wi, out_dtype);
  }
}

}  // namespace

void adam_step_cuda(const AdamParams& p, int64_t step, float grad_scale, float* param, const void* grad,
                    DType grad_dtype, float* exp_avg, float* exp_avg_sq, void* out16, DType out16_dtype, int64_t n,
                    cudaStream_t stream) {
  kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kOptimizer, stream);
  if (n == 0) return;
  if (step < 1) throw Error("adam_step_cuda: step must be >= 1, got " + std::to_string(step));
  if (out16 && out16_dtype == DType::kF32) throw Error("adam_step_cuda: out16 must be bf16 or fp16");
  const AdamArgs a = detail::make_adam_args(p, step, grad_scale);
  constexpr int kThreads = 256;
  const int64_t want = (n + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(want > 65535 * 8 ? 65535 * 8 : want);
  switch (detail::adam_decay(p)) {
    case Decay::kNone:
      adam_kernel<Decay::kNone><<<blocks, kThreads, 0, stream>>>(a, param, grad, grad_dtype, exp_avg, exp_avg_sq,
                                                                  out16, out16_dtype, n);
      break;
    case Decay::kAdamW:
      adam_kernel<Decay::kAdamW><<<blocks, kThreads, 0, stream>>>(a, param, grad, grad_dtype, exp_avg, exp_avg_sq,
                                                                   out16, out16_dtype, n);
      break;
    case Decay::kL2:
      adam_kernel<Decay::kL2><<<blocks, kThreads, 0, stream>>>(a, param, grad, grad_dtype, exp_avg, exp_avg_sq, out16,
                                                                out16_dtype, n);
      break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) cuda::throw_cuda_error(e, "launch of adam_step_cuda", __FILE__, __LINE__);
}

void adam_step_cuda(const AdamParams& p, int64_t step, float grad_scale, const AdamSpan& s, cudaStream_t stream) {
  adam_step_cuda(p, step, grad_scale, s.param, s.grad, s.grad_dtype, s.exp_avg, s.exp_avg_sq, s.bf16_out,
                 DType::kBF16, s.n, stream);
}

}  // namespace zinc::optim
