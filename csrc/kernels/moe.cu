// The CUDA twins of moe.cpp (kernels_cuda.h), bit for bit the CPU's: the
// router runs math::moe_route_row (and its backward) in a thread per token,
// in the CPU's serial order (Note [expert routing order] in moe.cpp); the
// gather and combine take a thread per output element, each adding its
// slots in slot order as the CPU does. moe_group stays on the host
// (kernels::moe_group), where the experts' GEMMs are launched from.
#include <string>

#include "core/error.h"
#include "kernels/cuda_common.cuh"
#include "kernels/gpu_profile.h"
#include "kernels/kernels_cuda.h"
#include "kernels/math.h"

namespace zinc::kernels::cuda {
namespace {

#define ZINC_MOE_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); i += int64_t{gridDim.x} * blockDim.x)

__global__ void moe_route_kernel(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs,
                                 int32_t* expert, float* weight) {
  ZINC_MOE_STRIDE(t, N) math::moe_route_row(logits + t * E, E, k, renormalize, probs + t * E, expert + t * k, weight + t * k);
}

__global__ void moe_route_backward_kernel(const float* probs, const int32_t* expert, const float* weight,
                                          const float* dweight, const float* dprobs, int64_t N, int64_t E, int64_t k,
                                          bool renormalize, float* dlogits) {
  ZINC_MOE_STRIDE(t, N)
  math::moe_route_row_backward(probs + t * E, expert + t * k, weight + t * k, dweight + t * k,
                               dprobs, E, k, renormalize, dlogits + t * E);
}

__global__ void moe_gather_kernel(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C) {
  ZINC_MOE_STRIDE(i, M * C) {
    const int64_t r = i / C, c = i % C;
    xg[i] = x[static_cast<int64_t>(token_of_row[r]) * C + c];
  }
}

__global__ void moe_combine_kernel(float* out, const float* y, const float* weight, const int32_t* row_of_slot,
                                   int64_t N, int64_t k, int64_t C) {
  ZINC_MOE_STRIDE(i, N * C) {
    const int64_t t = i / C, c = i % C;
    float acc = 0.0f;
    for (int64_t s = 0; s < k; ++s) acc += weight[t * k + s] * y[static_cast<int64_t>(row_of_slot[t * k + s]) * C + c];
    out[i] = acc;
  }
}

__global__ void moe_combine_dy_kernel(float* dy, const float* dout, const float* weight, const int32_t* row_of_slot,
                                      int64_t N, int64_t k, int64_t C) {
  ZINC_MOE_STRIDE(i, N * k * C) {
    const int64_t ts = i / C, c = i % C, t = ts / k;
    dy[static_cast<int64_t>(row_of_slot[ts]) * C + c] = weight[ts] * dout[t * C + c];
  }
}

__global__ void moe_combine_dweight_kernel(float* dweight, const float* dout, const float* y,
                                           const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
  ZINC_MOE_STRIDE(ts, N * k) {
    const int64_t t = ts / k, r = row_of_slot[ts];
    float dot = 0.0f;
    for (int64_t c = 0; c < C; ++c) dot += dout[t * C + c] * y[r * C + c];
    dweight[ts] = dot;
  }
}

__global__ void moe_gather_backward_kernel(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N,
                                           int64_t k, int64_t C) {
  ZINC_MOE_STRIDE(i, N * C) {
    const int64_t t = i / C, c = i % C;
    float acc = dx[i];
    for (int64_t s = 0; s < k; ++s) acc += dxg[static_cast<int64_t>(row_of_slot[t * k + s]) * C + c];
    dx[i] = acc;
  }
}

void check_route(const char* fn, int64_t E, int64_t k) {
  if (E <= 0 || k <= 0 || k > E)
    throw Error(std::string(fn) + ": need 0 < k <= E, got k=" + std::to_string(k) + " E=" + std::to_string(E));
}

}  // namespace

void moe_route(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs, int32_t* expert,
               float* weight, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  check_route("cuda::moe_route", E, k);
  if (N <= 0) return;
  moe_route_kernel<<<detail::blocks_for(N), detail::kThreads, 0, stream>>>(logits, N, E, k, renormalize, probs,
                                                                             expert, weight);
  detail::check_launch("moe_route");
}

void moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* dweight,
                        const float* dprobs, int64_t N, int64_t E, int64_t k, bool renormalize, float* dlogits,
                        cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  check_route("cuda::moe_route_backward", E, k);
  if (N <= 0) return;
  moe_route_backward_kernel<<<detail::blocks_for(N), detail::kThreads, 0, stream>>>(
      probs, expert, weight, dweight, dprobs, N, E, k, renormalize, dlogits);
  detail::check_launch("moe_route_backward");
}

void moe_gather(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (M <= 0 || C <= 0) return;
  moe_gather_kernel<<<detail::blocks_for(M * C), detail::kThreads, 0, stream>>>(xg, x, token_of_row, M, C);
  detail::check_launch("moe_gather");
}

void moe_combine(float* out, const float* y, const float* weight, const int32_t* row_of_slot, int64_t N, int64_t k,
                 int64_t C, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (N <= 0 || C <= 0) return;
  moe_combine_kernel<<<detail::blocks_for(N * C), detail::kThreads, 0, stream>>>(out, y, weight, row_of_slot, N, k, C);
  detail::check_launch("moe_combine");
}

void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const float* weight,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (N <= 0 || k <= 0) return;
  if (C > 0)
    moe_combine_dy_kernel<<<detail::blocks_for(N * k * C), detail::kThreads, 0, stream>>>(dy, dout, weight,
                                                                                          row_of_slot, N, k, C);
  detail::check_launch("moe_combine_backward (dy)");
  moe_combine_dweight_kernel<<<detail::blocks_for(N * k), detail::kThreads, 0, stream>>>(dweight, dout, y,
                                                                                         row_of_slot, N, k, C);
  detail::check_launch("moe_combine_backward (dweight)");
}

void moe_gather_backward(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C,
                         cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (N <= 0 || C <= 0) return;
  moe_gather_backward_kernel<<<detail::blocks_for(N * C), detail::kThreads, 0, stream>>>(dx, dxg, row_of_slot, N, k,
                                                                                         C);
  detail::check_launch("moe_gather_backward");
}

}  // namespace zinc::kernels::cuda
