// The CUDA twins of llama_layers.cpp: RMSNorm, SwiGLU, rotary position
// embeddings and the grouped-query head mapping (kernels_cuda.h). As in
// layers.cu, the per-element and per-row math is kernels/math.h's, the row
// sums of RMSNorm follow Note [lane order] (16 threads per row) and its
// weight gradient Note [column sums] (a thread per column and chunk of rows,
// in double, no atomics), so every result is the CPU's bit for bit. RoPE and
// the head mapping are elementwise: a thread per output element, the
// grouped sum of gqa_reduce adding the group's heads in head order as the CPU.
#include <string>

#include "kernels/cuda_common.cuh"
#include "kernels/gpu_profile.h"
#include "kernels/kernels_cuda.h"

namespace zinc::kernels::cuda {
namespace {

using detail::chunk_sum;
using detail::kRowsPerBlock;
using detail::kRowThreads;
using detail::kSumChunks;
using detail::kSumCols;
using detail::lane_combine;
using detail::load_param;

// ---- RMSNorm -------------------------------------------------------------------------
// One row per 16 threads; the rows past N run the shuffles with no elements
// (every lane of a warp must take part in lane_combine).
// w_offset + w (Gemma's 1 + w), or w itself (the Llama's, exactly: even -0).
__device__ inline float shifted(float w_offset, float w) { return w_offset != 0.0f ? w_offset + w : w; }

// With residual, first x += residual (as layernorm_forward_kernel).
// out16 set: the output goes there as the 16-bit operand t, and `out` is
// not written (Note [fused 16-bit operands] in kernels_cuda.h).
__global__ void rmsnorm_forward_kernel(float* out, uint16_t* out16, DType t, float* rstd_out, float* x,
                                       const float* residual, const void* w, DType wt, int64_t N, int64_t C, float eps,
                                       float w_offset) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / math::kLanes;
  const int lane = threadIdx.x % math::kLanes;
  const bool valid = row < N;
  const int64_t n = valid ? C : 0;
  float* xr = x + (valid ? row : 0) * C;
  if (residual && valid)
    for (int64_t c = lane; c < C; c += math::kLanes) xr[c] = xr[c] + residual[row * C + c];
  const float sq = lane_combine(math::lane_partial<float>(n, lane, [&](int64_t c) { return xr[c] * xr[c]; }));
  const float rstd = math::rmsnorm_rstd(sq, C, eps);
  if (!valid) return;
  if (out16) {
    uint16_t* o = out16 + row * C;
    for (int64_t c = lane; c < C; c += math::kLanes)
      o[c] = float_to_16(math::rmsnorm_out(xr[c], rstd, shifted(w_offset, load_param(w, wt, c))), t);
  } else {
    float* o = out + row * C;
    for (int64_t c = lane; c < C; c += math::kLanes)
      o[c] = math::rmsnorm_out(xr[c], rstd, shifted(w_offset, load_param(w, wt, c)));
  }
  if (lane == 0) rstd_out[row] = rstd;
}

// dx += rstd (dout w - xhat mgx), mgx = sum(dout w xhat) / C in lane order.
__global__ void rmsnorm_backward_dx_kernel(float* dx, const float* dout, const float* x, const void* w, DType wt,
                                           const float* rstd, int64_t N, int64_t C, float w_offset) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / math::kLanes;
  const int lane = threadIdx.x % math::kLanes;
  const bool valid = row < N;
  const int64_t n = valid ? C : 0;
  const int64_t r = valid ? row : 0;
  const float* xr = x + r * C;
  const float* g = dout + r * C;
  const float rs = rstd[r];
  const float mgx = lane_combine(math::lane_partial<float>(n, lane, [&](int64_t c) {
                      return g[c] * (shifted(w_offset, load_param(w, wt, c))) * (xr[c] * rs);
                    })) /
                    static_cast<float>(C);
  if (!valid) return;
  float* d = dx + row * C;
  for (int64_t c = lane; c < C; c += math::kLanes)
    d[c] += math::rmsnorm_dx(g[c], shifted(w_offset, load_param(w, wt, c)), xr[c] * rs, rs, mgx);
}

// dw[c] = float(dw[c] + sum_i double(dout[i,c] (x[i,c] rstd[i]))), in Note
// [column sums]'s order (the block shape of layers.cu's bias_backward_kernel).
__global__ void __launch_bounds__(kSumCols* kSumChunks)
    rmsnorm_backward_dw_kernel(float* dw, const float* dout, const float* x, const float* rstd, int64_t N, int64_t C) {
  __shared__ double part[kSumChunks][kSumCols];
  const int64_t c = blockIdx.x * int64_t{kSumCols} + threadIdx.x;
  const int64_t chunks = (N + math::kColumnChunk - 1) / math::kColumnChunk;
  double acc = 0;
  for (int64_t k0 = 0; k0 < chunks; k0 += kSumChunks) {
    const int64_t k = k0 + threadIdx.y;
    if (c < C && k < chunks)
      part[threadIdx.y][threadIdx.x] = chunk_sum(k * math::kColumnChunk, N, [&](int64_t i) {
        return dout[i * C + c] * (x[i * C + c] * rstd[i]);  // a float product, then added in double
      });
    __syncthreads();
    if (threadIdx.y == 0 && c < C)
      for (int64_t y = 0; y < kSumChunks && k0 + y < chunks; ++y) acc += part[y][threadIdx.x];
    __syncthreads();
  }
  if (threadIdx.y == 0 && c < C) dw[c] = static_cast<float>(dw[c] + acc);
}

// ---- SwiGLU and GeGLU -------------------------------------------------------------------
// gate_up rows are [gate (I) | up (I)]; a thread per element of out (N, I);
// gelu: GeGLU's math (math::geglu*), else SwiGLU's.
// out16 set: written there as the 16-bit operand t instead of out.
__global__ void gated_forward_kernel(float* out, uint16_t* out16, DType t, const float* gate_up, int64_t N, int64_t I,
                                     bool gelu) {
  const int64_t total = N * I;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / I, j = e % I;
    const float* row = gate_up + i * 2 * I;
    const float v = gelu ? math::geglu(row[j], row[I + j]) : math::swiglu(row[j], row[I + j]);
    if (out16)
      out16[e] = float_to_16(v, t);
    else
      out[e] = v;
  }
}

__global__ void gated_backward_kernel(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I,
                                      bool gelu) {
  const int64_t total = N * I;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = e / I, j = e % I;
    const float* row = gate_up + i * 2 * I;
    float* drow = dgate_up + i * 2 * I;
    drow[j] = gelu ? math::geglu_dgate(dout[e], row[j], row[I + j]) : math::swiglu_dgate(dout[e], row[j], row[I + j]);
    drow[I + j] = gelu ? math::geglu_dup(dout[e], row[j]) : math::swiglu_dup(dout[e], row[j]);
  }
}

// ---- exact GELU and soft-capping -------------------------------------------------------------
__global__ void gelu_erf_forward_kernel(float* out, const float* x, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x)
    out[e] = math::gelu_erf(x[e]);
}

__global__ void gelu_erf_backward_kernel(float* dx, const float* x, const float* dout, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x)
    dx[e] = dout[e] * math::gelu_erf_grad(x[e]);
}

__global__ void softcap_forward_kernel(float* x, float cap, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x)
    x[e] = math::softcap(x[e], cap, 1.0f / cap);
}

__global__ void softcap_backward_kernel(float* dx, const float* y, float cap, int64_t n) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x)
    dx[e] *= math::softcap_grad_from_out(y[e], cap);
}

// ---- RoPE -------------------------------------------------------------------------------
// A thread per pair (row r, head k, frequency i): x[i] and x[i + h] of head k
// rotated by the angle of frequency i at position r % T, or positions[r]
// with packed documents. s_sign = -1 for the inverse, applied to sin as the
// CPU does (an exact negation).
__global__ void rope_kernel(float* x, const float* cos, const float* sin, const int32_t* positions, int64_t N,
                            int64_t T, int64_t W, int64_t col, int64_t heads, int64_t h, int64_t head_dim,
                            float s_sign) {
  const int64_t per_row = heads * h, total = N * per_row;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / per_row, k = (e % per_row) / h, i = e % h;
    const int64_t t = positions ? static_cast<int64_t>(positions[r]) : r % T;
    float* head = x + r * W + col + k * head_dim;  // its first 2h values rotate
    const float a = head[i], b = head[h + i], c = cos[t * h + i], sn = s_sign * sin[t * h + i];
    head[i] = math::rope_lo(a, b, c, sn);
    head[h + i] = math::rope_hi(a, b, c, sn);
  }
}

// ---- grouped-query heads ------------------------------------------------------------------
// A thread per element of the expanded row [q | k | v] (3 H hd); kv head
// k / g feeds head k.
__global__ void gqa_expand_kernel(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) {
  const int64_t g = H / Hkv, in_w = (H + 2 * Hkv) * hd, part_w = H * hd, out_w = 3 * part_w, total = N * out_w;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / out_w, o = e % out_w;
    const int64_t part = o / part_w, k = (o % part_w) / hd, d = o % hd;
    const float* in = q_kv + r * in_w;
    qkv[e] = part == 0 ? in[o] : in[part_w + (part - 1) * Hkv * hd + (k / g) * hd + d];
  }
}

// A thread per element of d q_kv (N, (H + 2 Hkv) hd): q copied; a k or v
// element of kv head j is the sum of heads j g .. j g + g - 1, from the
// first and in head order (the CPU's memcpy then add_head).
__global__ void gqa_reduce_kernel(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) {
  const int64_t g = H / Hkv, part_w = H * hd, in_w = 3 * part_w, kv_w = Hkv * hd, out_w = part_w + 2 * kv_w;
  const int64_t total = N * out_w;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / out_w, o = e % out_w;
    const float* in = dqkv + r * in_w;
    if (o < part_w) {
      dq_kv[e] = in[o];
      continue;
    }
    const int64_t part = 1 + (o - part_w) / kv_w, j = ((o - part_w) % kv_w) / hd, d = o % hd;
    const float* src = in + part * part_w + j * g * hd + d;
    float v = src[0];
    for (int64_t m = 1; m < g; ++m) v += src[m * hd];
    dq_kv[e] = v;
  }
}

unsigned row_blocks(int64_t N) { return static_cast<unsigned>((N + kRowsPerBlock - 1) / kRowsPerBlock); }
unsigned sum_blocks(int64_t C) { return static_cast<unsigned>((C + kSumCols - 1) / kSumCols); }

// The CPU's check of a head layout (llama_layers.cpp), under the twin's name.
void check_gqa(const char* what, int64_t H, int64_t Hkv) {
  if (H <= 0 || Hkv <= 0 || H % Hkv != 0)
    throw Error(std::string(what) + ": heads " + std::to_string(H) + " not a positive multiple of kv heads " +
                std::to_string(Hkv));
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps,
                     cudaStream_t stream, float w_offset) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  if (N <= 0) return;
  if (C <= 0) throw Error("cuda::rmsnorm_forward: C must be > 0, got " + std::to_string(C));
  rmsnorm_forward_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(out, nullptr, DType::kF32, rstd,
                                                                    const_cast<float*>(x), nullptr, w.data, w.dtype, N,
                                                                    C, eps, w_offset);
  detail::check_launch("rmsnorm_forward");
}

void rmsnorm_forward_16(void* out16, DType t, float* rstd, float* x, const float* residual, CView w, int64_t N,
                        int64_t C, float eps, cudaStream_t stream, float w_offset) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  detail::check_operand16(t, "cuda::rmsnorm_forward_16");
  if (N <= 0) return;
  if (C <= 0) throw Error("cuda::rmsnorm_forward_16: C must be > 0, got " + std::to_string(C));
  rmsnorm_forward_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(nullptr, static_cast<uint16_t*>(out16), t, rstd,
                                                                    x, residual, w.data, w.dtype, N, C, eps, w_offset);
  detail::check_launch("rmsnorm_forward_16");
}

void add_rmsnorm_forward(float* out, float* rstd, float* x, const float* residual, CView w, int64_t N, int64_t C,
                         float eps, cudaStream_t stream, float w_offset) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  if (N <= 0) return;
  if (C <= 0) throw Error("cuda::add_rmsnorm_forward: C must be > 0, got " + std::to_string(C));
  rmsnorm_forward_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(out, nullptr, DType::kF32, rstd, x, residual,
                                                                    w.data, w.dtype, N, C, eps, w_offset);
  detail::check_launch("add_rmsnorm_forward");
}

void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd, int64_t N,
                      int64_t C, cudaStream_t stream, float w_offset) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  if (N <= 0 || C <= 0) return;
  rmsnorm_backward_dx_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(dx, dout, x, w.data, w.dtype, rstd, N, C, w_offset);
  detail::check_launch("rmsnorm_backward (dx)");
  rmsnorm_backward_dw_kernel<<<sum_blocks(C), dim3(kSumCols, kSumChunks), 0, stream>>>(dw, dout, x, rstd, N, C);
  detail::check_launch("rmsnorm_backward (dw)");
}

void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (N <= 0 || I <= 0) return;
  gated_forward_kernel<<<detail::blocks_for(N * I), detail::kThreads, 0, stream>>>(out, nullptr, DType::kF32,
                                                                                    gate_up, N, I, false);
  detail::check_launch("swiglu_forward");
}

void gated_forward_16(void* out16, DType t, const float* gate_up, int64_t N, int64_t I, bool gelu,
                      cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  detail::check_operand16(t, "cuda::gated_forward_16");
  if (N <= 0 || I <= 0) return;
  gated_forward_kernel<<<detail::blocks_for(N * I), detail::kThreads, 0, stream>>>(
      nullptr, static_cast<uint16_t*>(out16), t, gate_up, N, I, gelu);
  detail::check_launch(gelu ? "geglu_forward_16" : "swiglu_forward_16");
}

void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I,
                     cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (N <= 0 || I <= 0) return;
  gated_backward_kernel<<<detail::blocks_for(N * I), detail::kThreads, 0, stream>>>(dgate_up, dout, gate_up, N, I,
                                                                                        false);
  detail::check_launch("swiglu_backward");
}

void geglu_forward(float* out, const float* gate_up, int64_t N, int64_t I, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (N <= 0 || I <= 0) return;
  gated_forward_kernel<<<detail::blocks_for(N * I), detail::kThreads, 0, stream>>>(out, nullptr, DType::kF32,
                                                                                    gate_up, N, I, true);
  detail::check_launch("geglu_forward");
}

void geglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I,
                    cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (N <= 0 || I <= 0) return;
  gated_backward_kernel<<<detail::blocks_for(N * I), detail::kThreads, 0, stream>>>(dgate_up, dout, gate_up, N, I,
                                                                                        true);
  detail::check_launch("geglu_backward");
}

void gelu_erf_forward(float* out, const float* x, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (n <= 0) return;
  gelu_erf_forward_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(out, x, n);
  detail::check_launch("gelu_erf_forward");
}

void gelu_erf_backward(float* dx, const float* x, const float* dout, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (n <= 0) return;
  gelu_erf_backward_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(dx, x, dout, n);
  detail::check_launch("gelu_erf_backward");
}

void softcap_forward(float* x, float cap, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (!(cap > 0.0f)) throw Error("cuda::softcap_forward: cap must be > 0, got " + std::to_string(cap));
  if (n <= 0) return;
  softcap_forward_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(x, cap, n);
  detail::check_launch("softcap_forward");
}

void softcap_backward(float* dx, const float* y, float cap, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kVector, stream);
  if (!(cap > 0.0f)) throw Error("cuda::softcap_backward: cap must be > 0, got " + std::to_string(cap));
  if (n <= 0) return;
  softcap_backward_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(dx, y, cap, n);
  detail::check_launch("softcap_backward");
}

void rope(float* x, const float* cos, const float* sin, RopeShape s, bool inverse, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kAttention, stream);
  if (s.head_dim <= 0 || s.rotated() % 2 != 0 || s.rotated() <= 0 || s.rotated() > s.head_dim)
    throw Error("cuda::rope: the rotated dims " + std::to_string(s.rotated()) +
                " must be even, > 0 and at most head_dim " + std::to_string(s.head_dim));
  if (s.col < 0 || s.col + s.heads * s.head_dim > s.W)
    throw Error("cuda::rope: heads " + std::to_string(s.heads) + " x " + std::to_string(s.head_dim) +
                " from column " + std::to_string(s.col) + " exceed the row width " + std::to_string(s.W));
  const int64_t N = s.B * s.T, h = s.rotated() / 2;
  if (N <= 0 || s.heads <= 0) return;
  rope_kernel<<<detail::blocks_for(N * s.heads * h), detail::kThreads, 0, stream>>>(
      x, cos, sin, s.positions, N, s.T, s.W, s.col, s.heads, h, s.head_dim, inverse ? -1.0f : 1.0f);
  detail::check_launch("rope");
}

void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kAttention, stream);
  check_gqa("cuda::gqa_expand", H, Hkv);
  if (N <= 0 || H <= 0 || hd <= 0) return;
  gqa_expand_kernel<<<detail::blocks_for(N * 3 * H * hd), detail::kThreads, 0, stream>>>(qkv, q_kv, N, H, Hkv, hd);
  detail::check_launch("gqa_expand");
}

void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kAttention, stream);
  check_gqa("cuda::gqa_reduce", H, Hkv);
  if (N <= 0 || H <= 0 || hd <= 0) return;
  gqa_reduce_kernel<<<detail::blocks_for(N * (H + 2 * Hkv) * hd), detail::kThreads, 0, stream>>>(dq_kv, dqkv, N, H,
                                                                                                  Hkv, hd);
  detail::check_launch("gqa_reduce");
}

}  // namespace zinc::kernels::cuda
