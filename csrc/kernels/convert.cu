// bf16 / fp16 <-> fp32 on the GPU with core/dtype.h's scalar conversions
// (ZINC_HD), so the bits are those of the CPU's bulk conversions.
#include "kernels/cuda_common.cuh"
#include "kernels/gpu_profile.h"
#include "kernels/kernels_cuda.h"

namespace zinc::kernels::cuda {
namespace {

__global__ void to_16_kernel(const float* src, uint16_t* dst, int64_t n, DType t) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = float_to_16(src[i], t);
}

__global__ void from_16_kernel(const uint16_t* src, float* dst, int64_t n, DType t) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = from_16(src[i], t);
}

}  // namespace

void convert_f32_to_16(const float* src, void* dst, int64_t n, DType t, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kConvert, stream);
  if (n <= 0) return;
  if (t == DType::kF32) {
    ZINC_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, stream),
                    "convert_f32_to_16 (copy)");
    return;
  }
  to_16_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(src, static_cast<uint16_t*>(dst), n, t);
  detail::check_launch("convert_f32_to_16");
}

void convert_16_to_f32(const void* src, float* dst, int64_t n, DType t, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kConvert, stream);
  if (n <= 0) return;
  if (t == DType::kF32) {
    ZINC_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice, stream),
                    "convert_16_to_f32 (copy)");
    return;
  }
  from_16_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(static_cast<const uint16_t*>(src), dst, n, t);
  detail::check_launch("convert_16_to_f32");
}

}  // namespace zinc::kernels::cuda
