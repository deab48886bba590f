// zinc optim on the GPU (CUDA builds only): AdamW over GPU-resident state.
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

#include "core/dtype.h"
#include "optim/optim.h"

namespace zinc::optim {

void adam_step_cuda(const AdamParams& p, int64_t step, float grad_scale, const AdamSpan& span, cudaStream_t stream);
// The same with the compute copy in either 16-bit format (out16 may be null).
void adam_step_cuda(const AdamParams& p, int64_t step, float grad_scale, float* param, const void* grad,
                    DType grad_dtype, float* exp_avg, float* exp_avg_sq, void* out16, DType out16_dtype, int64_t n,
                    cudaStream_t stream);

}  // namespace zinc::optim
