// zinc optim on the GPU (CUDA builds only): AdamW and Lamb over
// GPU-resident state.
//
// adam_step_cuda is optim::adam_step with device pointers: the same
// AdamParams, step and grad_scale give the same float arguments
// (detail::make_adam_args) and the same per-element update
// (optim/detail/adam_update.h, one rounding per fma), so its results equal the
// CPU AVX2/AVX-512 paths bit for bit: training with GPU-resident AdamW and
// with ZeRO-Offload's CPU AdamW give the same weights. Enqueued on `stream`;
// returns at once. span.bf16_out (device, may be null) receives the new
// weights as bf16; out16/out16_dtype generalise it to fp16.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "optim/optim.h"

namespace zinc::optim {

void adam_step_cuda(const AdamParams& p, int64_t step, float grad_scale, const AdamSpan& span, cudaStream_t stream);
// The same with the compute copy in either 16-bit format (out16 may be null).
void adam_step_cuda(const AdamParams& p, int64_t step, float grad_scale, float* param, const void* grad,
                    DType grad_dtype, float* exp_avg, float* exp_avg_sq, void* out16, DType out16_dtype, int64_t n,
                    cudaStream_t stream);

// Lamb over GPU-resident state: optim::lamb_norms and optim::lamb_apply
// (Note [Lamb arithmetic] in optim/detail/lamb_math.h) with device pointers
// for w, grad, m, v and out16, and the segments on the host. The
// per-element u and update are the CPU's bit for bit (optim/detail/
// lamb_update.h). The norms are taken over the CPU's pieces (16384 elements
// from each segment's start), each piece summed in double on the GPU in an
// order of its own, and the pieces added on the host in lamb_norms's order:
// they differ from the CPU's sums by double rounding alone, so the trust
// ratios rounded to float are the CPU's unless a ratio lies within about
// 1e-15 relative of a float rounding boundary (a chance of the order of
// 1e-8 per tensor and step; the CPU's AVX2 and AVX-512 paths differ from
// each other the same way). Keeps its scratch (the piece table, the
// partial sums, the coefficients) between calls: one stream at a time.
class LambCuda {
 public:
  // Pass 1: adds each tensor's sums of w^2 and u^2 to sums[2t] and
  // sums[2t + 1] (host memory), waiting for the stream. Reads only.
  void norms(const LambParams& p, float grad_scale, const float* w, const void* grad, DType grad_dtype,
             const float* m, const float* v, int64_t n, std::span<const LambSegment> segs, double* sums,
             cudaStream_t stream);
  // Pass 2: the update of step `step` (>= 1) with ratios[t] for tensor t,
  // enqueued on `stream`; out16 (may be null) receives the new weights in
  // out16_dtype.
  void apply(const LambParams& p, int64_t step, float grad_scale, float* w, const void* grad, DType grad_dtype,
             float* m, float* v, void* out16, DType out16_dtype, int64_t n, std::span<const LambSegment> segs,
             const double* ratios, cudaStream_t stream);

 private:
  // The pieces of segs uploaded to table_ (stream-ordered); their count.
  int upload_pieces(int64_t n, std::span<const LambSegment> segs, const char* who, cudaStream_t stream);
  zinc::cuda::DeviceBuffer table_, partial_, coef_;
  std::vector<int> host_seg_;  // each uploaded piece's segment
};

}  // namespace zinc::optim
