// The CUDA twins of layers.cpp: bias, layernorm, GELU, cross-entropy and
// embeddings (kernels_cuda.h). Per-element and per-row math comes from
// kernels/math.h and row sums follow Note [lane order], so each result is the
// CPU's bit for bit. Parameter-gradient reductions add in the CPU's order,
// in double where the CPU does, with no atomics: the bias and layernorm
// weight and bias follow Note [column sums] (math.h: a thread per column and
// chunk of rows, the chunks' sums added in order), the embeddings give each
// thread one column and add the rows in order.
#include <string>
#include <type_traits>
#include <vector>

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

// ---- bias ---------------------------------------------------------------------------
__global__ void add_bias_kernel(float* y, const void* bias, DType bt, int64_t M, int64_t N) {
  const int64_t total = M * N;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
    y[i] += load_param(bias, bt, i % N);
}

// dbias[j] = float(dbias[j] + sum_i double(g[i,j])) with g = dy, or, where
// gelu_x is set, g = gelu'(gelu_x) * dy (gelu_backward's value). dbias may
// be null (no sums). Where out16 is set each g[i,j] is also written there
// as the 16-bit operand t (Note [fused 16-bit operands]): every element is
// visited by exactly one thread, so the pass writes each once.
__global__ void __launch_bounds__(kSumCols* kSumChunks)
    bias_backward_kernel(float* dbias, const float* dy, const float* gelu_x, uint16_t* out16, DType t, int64_t M,
                         int64_t N) {
  __shared__ double part[kSumChunks][kSumCols];
  const int64_t j = blockIdx.x * int64_t{kSumCols} + threadIdx.x;
  const int64_t chunks = (M + math::kColumnChunk - 1) / math::kColumnChunk;
  double acc = 0;
  for (int64_t k0 = 0; k0 < chunks; k0 += kSumChunks) {
    const int64_t k = k0 + threadIdx.y;
    if (j < N && k < chunks)
      part[threadIdx.y][threadIdx.x] = chunk_sum(k * math::kColumnChunk, M, [&](int64_t i) {
        float g = dy[i * N + j];
        if (gelu_x) g = math::gelu_grad(gelu_x[i * N + j]) * g;
        if (out16) out16[i * N + j] = float_to_16(g, t);
        return static_cast<double>(g);
      });
    __syncthreads();
    if (threadIdx.y == 0 && j < N)
      for (int64_t y = 0; y < kSumChunks && k0 + y < chunks; ++y) acc += part[y][threadIdx.x];
    __syncthreads();
  }
  if (dbias && threadIdx.y == 0 && j < N) dbias[j] = static_cast<float>(dbias[j] + acc);
}

// ---- layernorm -------------------------------------------------------------------------
// With residual, first x += residual (each thread its own columns, which
// only it reads below): add then layernorm in one pass over the row.
// out16 set: the output goes there as the 16-bit operand t, and `out` is
// not written (Note [fused 16-bit operands]).
__global__ void layernorm_forward_kernel(float* out, uint16_t* out16, DType t, float* mean_out, float* rstd_out,
                                         float* x, const float* residual, const void* w, DType wt, const void* b,
                                         DType bt, int64_t N, int64_t C, float eps) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / math::kLanes;
  const int lane = threadIdx.x % math::kLanes;
  const bool valid = row < N;
  const int64_t n = valid ? C : 0;
  float* xr = x + (valid ? row : 0) * C;
  if (residual && valid)
    for (int64_t c = lane; c < C; c += math::kLanes) xr[c] = xr[c] + residual[row * C + c];
  const float mean = lane_combine(math::lane_partial<float>(n, lane, [&](int64_t c) { return xr[c]; })) /
                     static_cast<float>(C);
  const float var_sum = lane_combine(math::lane_partial<float>(n, lane, [&](int64_t c) {
    const float d = xr[c] - mean;
    return d * d;
  }));
  const float rstd = math::layernorm_rstd(var_sum, C, eps);
  if (!valid) return;
  if (out16) {
    uint16_t* o = out16 + row * C;
    for (int64_t c = lane; c < C; c += math::kLanes)
      o[c] = float_to_16(math::layernorm_out(xr[c], mean, rstd, load_param(w, wt, c), load_param(b, bt, c)), t);
  } else {
    float* o = out + row * C;
    for (int64_t c = lane; c < C; c += math::kLanes)
      o[c] = math::layernorm_out(xr[c], mean, rstd, load_param(w, wt, c), load_param(b, bt, c));
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

__global__ void layernorm_backward_dx_kernel(float* dx, const float* dout, const float* x, const void* w, DType wt,
                                             const float* mean, const float* rstd, int64_t N, int64_t C) {
  const int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / math::kLanes;
  const int lane = threadIdx.x % math::kLanes;
  const bool valid = row < N;
  const int64_t n = valid ? C : 0;
  const int64_t r = valid ? row : 0;
  const float* xr = x + r * C;
  const float* g = dout + r * C;
  const float m = mean[r], rs = rstd[r];
  const float mg = lane_combine(math::lane_partial<float>(n, lane, [&](int64_t c) { return g[c] * load_param(w, wt, c); })) /
                   static_cast<float>(C);
  const float mgx = lane_combine(math::lane_partial<float>(n, lane, [&](int64_t c) {
                      return g[c] * load_param(w, wt, c) * math::layernorm_xhat(xr[c], m, rs);
                    })) /
                    static_cast<float>(C);
  if (!valid) return;
  float* d = dx + row * C;
  for (int64_t c = lane; c < C; c += math::kLanes)
    d[c] += math::layernorm_dx(g[c], load_param(w, wt, c), math::layernorm_xhat(xr[c], m, rs), rs, mg, mgx);
}

// dw += sum_i dout * xhat, db += sum_i dout, in Note [column sums]'s order
// (the same block shape as bias_backward_kernel).
__global__ void __launch_bounds__(kSumCols* kSumChunks)
    layernorm_backward_dw_kernel(float* dw, float* db, const float* dout, const float* x, const float* mean,
                                 const float* rstd, int64_t N, int64_t C) {
  __shared__ double pw[kSumChunks][kSumCols], pb[kSumChunks][kSumCols];
  const int64_t c = blockIdx.x * int64_t{kSumCols} + threadIdx.x;
  const int64_t chunks = (N + math::kColumnChunk - 1) / math::kColumnChunk;
  double aw = 0, ab = 0;
  for (int64_t k0 = 0; k0 < chunks; k0 += kSumChunks) {
    const int64_t k = k0 + threadIdx.y;
    if (c < C && k < chunks) {
      double w = 0, b = 0;
      const int64_t r0 = k * math::kColumnChunk;
      const int64_t r1 = r0 + math::kColumnChunk < N ? r0 + math::kColumnChunk : N;
      for (int64_t i = r0; i < r1; ++i) {
        const float g = dout[i * C + c];
        w += g * math::layernorm_xhat(x[i * C + c], mean[i], rstd[i]);
        b += g;
      }
      pw[threadIdx.y][threadIdx.x] = w;
      pb[threadIdx.y][threadIdx.x] = b;
    }
    __syncthreads();
    if (threadIdx.y == 0 && c < C)
      for (int64_t y = 0; y < kSumChunks && k0 + y < chunks; ++y) {
        aw += pw[y][threadIdx.x];
        ab += pb[y][threadIdx.x];
      }
    __syncthreads();
  }
  if (threadIdx.y == 0 && c < C) {
    dw[c] = static_cast<float>(dw[c] + aw);
    db[c] = static_cast<float>(db[c] + ab);
  }
}

// ---- GELU ---------------------------------------------------------------------------------
__global__ void gelu_forward_kernel(float* out, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out[i] = math::gelu(x[i]);
}
__global__ void gelu_backward_kernel(float* dx, const float* x, const float* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dx[i] = math::gelu_grad(x[i]) * dout[i];
}
// gelu_forward / gelu_backward written as the 16-bit operand t only.
__global__ void gelu_forward_16_kernel(uint16_t* out16, DType t, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    out16[i] = float_to_16(math::gelu(x[i]), t);
}
__global__ void gelu_backward_16_kernel(uint16_t* dx16, DType t, const float* x, const float* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dx16[i] = float_to_16(math::gelu_grad(x[i]) * dout[i], t);
}

// ---- cross-entropy --------------------------------------------------------------------------
// A row of the cross-entropy kernels (one row per math::kLanes threads):
// which (row; r, a valid index to read, 0 past N), this thread's lane, the
// target, and how many of the row's V columns the threads visit (0 for an
// ignored row and past N; those threads still join every shuffle).
struct CeRow {
  int64_t row, r, n;
  int lane;
  bool valid, ignored;
  int32_t tgt;
};
__device__ inline CeRow ce_row(const int32_t* targets, int64_t N, int64_t V) {
  CeRow c;
  c.row = blockIdx.x * int64_t{kRowsPerBlock} + threadIdx.x / math::kLanes;
  c.lane = threadIdx.x % math::kLanes;
  c.valid = c.row < N;
  c.r = c.valid ? c.row : 0;
  c.tgt = c.valid && targets ? targets[c.r] : 0;
  c.ignored = c.tgt == kIgnoreTarget;
  c.n = c.valid && !c.ignored ? V : 0;
  return c;
}
// The maximum of x[0, n) over a row's lanes (exact in any order; NaNs
// ignored as max_of does), on every lane.
__device__ inline float lanes_max(const float* x, int64_t n, int lane) {
  float mx = -__int_as_float(0x7f800000);
  for (int64_t j = lane; j < n; j += math::kLanes) mx = x[j] > mx ? x[j] : mx;
  for (int off = math::kLanes / 2; off > 0; off /= 2) {
    const float o = __shfl_xor_sync(0xffffffffu, mx, off, math::kLanes);
    mx = o > mx ? o : mx;
  }
  return mx;
}

// One row per 16 threads. dlogits may alias logits: each thread reads and
// writes only its own lane's elements, and the target logit is read by every
// thread of the row before the row's first write (__syncwarp).
// A row whose target is kIgnoreTarget is no row to the loss (kernels.h): its
// threads still join every shuffle (two rows share a warp, the masks are
// full) but visit no column (n = 0), never read x[tgt], then write a row
// loss of 0 and a zero dlogits row, as the CPU's memset.
//
// Out = float: dlogits as above (may alias logits, may be null). Out =
// uint16_t: the gradient rounded to t and written to dlogits only (Note
// [fused 16-bit operands] in kernels_cuda.h; it must not overlap logits):
// the last pass recomputes the exponentials (exp_f of the same floats)
// instead of reading an fp32 copy back, with the same factor and target
// term in the same order, so the bits are the fp32 gradient's, rounded.
template <class Out>
__global__ void cross_entropy_kernel(const float* logits, const int32_t* targets, int64_t N, int64_t V, Out* dlogits,
                                     DType t, double grad_scale, double* row_loss) {
  constexpr bool k16 = std::is_same_v<Out, uint16_t>;
  const CeRow c = ce_row(targets, N, V);
  const int64_t row = c.row, r = c.r, n = c.n;
  const int lane = c.lane;
  const bool valid = c.valid, ignored = c.ignored;
  const int32_t tgt = c.tgt;
  const float* x = logits + r * V;
  const float x_tgt = n > 0 ? x[tgt] : 0.0f;
  const float mx = lanes_max(x, n, lane);
  __syncwarp();
  Out* e = dlogits ? dlogits + r * V : nullptr;
  const double sum = lane_combine(math::lane_partial<double>(n, lane, [&](int64_t j) {
    const float v = math::exp_f(x[j] - mx);
    if constexpr (!k16) {
      if (e) e[j] = v;
    }
    return v;
  }));
  if (!valid) return;
  if (ignored) {
    if (lane == 0) row_loss[row] = 0.0;
    if (e)
      for (int64_t j = lane; j < V; j += math::kLanes) {
        if constexpr (k16) e[j] = float_to_16(0.0f, t);
        else e[j] = 0.0f;
      }
    return;
  }
  if (lane == 0) row_loss[row] = log(sum) + static_cast<double>(mx) - static_cast<double>(x_tgt);
  if (!e) return;
  const float f = math::cross_entropy_factor(grad_scale, sum);
  if constexpr (k16) {
    const float g = static_cast<float>(grad_scale);
    for (int64_t j = lane; j < V; j += math::kLanes) {
      float v = math::exp_f(x[j] - mx) * f;
      if (j == tgt) v -= g;
      e[j] = float_to_16(v, t);
    }
  } else {
    for (int64_t j = lane; j < V; j += math::kLanes) e[j] *= f;
    if (tgt % math::kLanes == lane) e[tgt] -= static_cast<float>(grad_scale);
  }
}

// ---- embeddings ---------------------------------------------------------------------------------
// The position of row r: positions[r] for packed documents, else r % T.
__device__ inline int64_t position_of(const int32_t* positions, int64_t r, int64_t T) {
  return positions ? static_cast<int64_t>(positions[r]) : r % T;
}

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const void* wte, DType et, const void* wpe,
                                         DType pt, const int32_t* positions, int64_t rows, int64_t T, int64_t C) {
  const int64_t total = rows * C;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    const float v = load_param(wte, et, static_cast<int64_t>(tokens[r]) * C + c);
    out[i] = wpe ? v + load_param(wpe, pt, position_of(positions, r, T) * C + c) : v;
  }
}

// One thread per column; rows in token order as the CPU's column blocks.
// dwte may be null (the positions alone, next to the token index).
__global__ void embedding_backward_kernel(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                          const int32_t* positions, int64_t rows, int64_t T, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  for (int64_t r = 0; r < rows; ++r) {
    const float g = dout[r * C + c];
    if (dwte) dwte[static_cast<int64_t>(tokens[r]) * C + c] += g;
    if (dwpe) dwpe[position_of(positions, r, T) * C + c] += g;
  }
}

// dwte[ids[k]][c] += dout rows of token ids[k], in row order; thread per (k, c).
// Also dwpe by an index of the positions (the rows of each position).
__global__ void embedding_backward_indexed_kernel(float* dwte, const float* dout, const int32_t* ids,
                                                  const int32_t* starts, const int32_t* rows, int64_t distinct,
                                                  int64_t C) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= distinct * C) return;
  const int64_t k = i / C, c = i % C;
  float* out = dwte + static_cast<int64_t>(ids[k]) * C + c;
  float v = *out;
  for (int32_t j = starts[k]; j < starts[k + 1]; ++j) v += dout[static_cast<int64_t>(rows[j]) * C + c];
  *out = v;
}

// dwpe[t][c] += dout[b*T + t][c] for b in order; thread per (t, c).
__global__ void position_backward_kernel(float* dwpe, const float* dout, int64_t B, int64_t T, int64_t C) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= T * C) return;
  const int64_t t = i / C, c = i % C;
  float v = dwpe[i];
  for (int64_t b = 0; b < B; ++b) v += dout[(b * T + t) * C + c];
  dwpe[i] = v;
}

// ---- vocabulary parts (kernels.h's embedding_part_* and cross_entropy_part_*) ----------------
__global__ void embedding_part_forward_kernel(float* out, const int32_t* tokens, const void* wte, DType et, int64_t N,
                                              int64_t C, int64_t lo, int64_t n) {
  const int64_t total = N * C;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / C, c = i % C, t = static_cast<int64_t>(tokens[r]) - lo;
    out[i] = t >= 0 && t < n ? load_param(wte, et, t * C + c) : 0.0f;
  }
}

// One thread per column, the rows in order (the CPU's order).
__global__ void embedding_part_backward_kernel(float* dwte, const float* dout, const int32_t* tokens, int64_t N,
                                               int64_t C, int64_t lo, int64_t n) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  for (int64_t r = 0; r < N; ++r) {
    const int64_t t = static_cast<int64_t>(tokens[r]) - lo;
    if (t >= 0 && t < n) dwte[t * C + c] += dout[r * C + c];
  }
}

// One row per 16 threads, as cross_entropy_kernel: the row's maximum.
__global__ void cross_entropy_part_max_kernel(const float* logits, int64_t N, int64_t Vp, double* row_maxes) {
  const CeRow c = ce_row(nullptr, N, Vp);  // every row's maximum, ignored or not
  const float mx = lanes_max(logits + c.r * Vp, c.n, c.lane);
  if (c.valid && c.lane == 0) row_maxes[c.row] = static_cast<double>(mx);
}

// Per row: sum exp(x - max) over the part's columns (written into dlogits,
// which may alias logits: the target's logit is read first) and the
// target's logit where the target is the part's; an ignored row gets 0s.
__global__ void cross_entropy_part_sums_kernel(const float* logits, const int32_t* targets, int64_t N, int64_t Vp,
                                               int64_t lo, const double* row_maxes, double* sums, float* dlogits) {
  const CeRow c = ce_row(targets, N, Vp);
  const int64_t row = c.row, r = c.r, n = c.n;
  const int lane = c.lane;
  const bool valid = c.valid, ignored = c.ignored;
  const float* x = logits + r * Vp;
  const int64_t t = static_cast<int64_t>(c.tgt) - lo;
  const bool own = n > 0 && t >= 0 && t < Vp;
  const float x_tgt = own ? x[t] : 0.0f;
  const float mx = valid ? static_cast<float>(row_maxes[r]) : 0.0f;
  __syncwarp();
  float* e = dlogits ? dlogits + r * Vp : nullptr;
  const double sum = lane_combine(math::lane_partial<double>(n, lane, [&](int64_t j) {
    const float v = math::exp_f(x[j] - mx);
    if (e) e[j] = v;
    return v;
  }));
  if (!valid) return;
  if (ignored && e)
    for (int64_t j = lane; j < Vp; j += math::kLanes) e[j] = 0.0f;
  if (lane == 0) {
    sums[2 * row] = ignored ? 0.0 : sum;
    sums[2 * row + 1] = own ? static_cast<double>(x_tgt) : 0.0;
  }
}

// dlogits as cross_entropy writes them, for the part's columns.
__global__ void cross_entropy_part_finish_kernel(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                                                 const double* sums, float* dlogits, double grad_scale) {
  const int64_t total = N * Vp;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / Vp, j = i % Vp;
    const int32_t tgt = targets[r];
    if (tgt == kIgnoreTarget) continue;
    float v = dlogits[i] * math::cross_entropy_factor(grad_scale, sums[2 * r]);
    if (static_cast<int64_t>(tgt) - lo == j) v -= static_cast<float>(grad_scale);
    dlogits[i] = v;
  }
}

unsigned row_blocks(int64_t N) { return static_cast<unsigned>((N + kRowsPerBlock - 1) / kRowsPerBlock); }
unsigned column_blocks(int64_t C) { return static_cast<unsigned>((C + 127) / 128); }
unsigned sum_blocks(int64_t C) { return static_cast<unsigned>((C + kSumCols - 1) / kSumCols); }

}  // namespace

void add_bias(float* y, CView bias, int64_t M, int64_t N, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kBias, stream);
  if (M <= 0 || N <= 0) return;
  add_bias_kernel<<<detail::blocks_for(M * N), detail::kThreads, 0, stream>>>(y, bias.data, bias.dtype, M, N);
  detail::check_launch("add_bias");
}

void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kBias, stream);
  if (M <= 0 || N <= 0) return;
  bias_backward_kernel<<<sum_blocks(N), dim3(kSumCols, kSumChunks), 0, stream>>>(dbias, dy, nullptr, nullptr,
                                                                                 DType::kF32, M, N);
  detail::check_launch("bias_backward");
}

void bias_backward_16(float* dbias, void* dy16, DType t, const float* dy, int64_t M, int64_t N, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kBias, stream);
  detail::check_operand16(t, "cuda::bias_backward_16");
  if (M <= 0 || N <= 0) return;
  bias_backward_kernel<<<sum_blocks(N), dim3(kSumCols, kSumChunks), 0, stream>>>(
      dbias, dy, nullptr, static_cast<uint16_t*>(dy16), t, M, N);
  detail::check_launch("bias_backward_16");
}

void gelu_backward_bias_16(float* dbias, void* dx16, DType t, const float* x, const float* dout, int64_t M,
                           int64_t N, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  detail::check_operand16(t, "cuda::gelu_backward_bias_16");
  if (M <= 0 || N <= 0) return;
  if (!dbias) {  // no column sums: the elementwise pass
    gelu_backward_16_kernel<<<detail::blocks_for(M * N), detail::kThreads, 0, stream>>>(
        static_cast<uint16_t*>(dx16), t, x, dout, M * N);
    detail::check_launch("gelu_backward_bias_16");
    return;
  }
  bias_backward_kernel<<<sum_blocks(N), dim3(kSumCols, kSumChunks), 0, stream>>>(
      dbias, dout, x, static_cast<uint16_t*>(dx16), t, M, N);
  detail::check_launch("gelu_backward_bias_16");
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N, int64_t C,
                       cudaStream_t stream, float eps) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  if (N <= 0) return;
  if (C <= 0) throw Error("cuda::layernorm_forward: C must be > 0, got " + std::to_string(C));
  layernorm_forward_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(out, nullptr, DType::kF32, mean, rstd,
                                                                      const_cast<float*>(x), nullptr, w.data, w.dtype,
                                                                      b.data, b.dtype, N, C, eps);
  detail::check_launch("layernorm_forward");
}

void layernorm_forward_16(void* out16, DType t, float* mean, float* rstd, float* x, const float* residual, CView w,
                          CView b, int64_t N, int64_t C, cudaStream_t stream, float eps) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  detail::check_operand16(t, "cuda::layernorm_forward_16");
  if (N <= 0) return;
  if (C <= 0) throw Error("cuda::layernorm_forward_16: C must be > 0, got " + std::to_string(C));
  layernorm_forward_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(nullptr, static_cast<uint16_t*>(out16), t, mean,
                                                                      rstd, x, residual, w.data, w.dtype, b.data,
                                                                      b.dtype, N, C, eps);
  detail::check_launch("layernorm_forward_16");
}

void add_layernorm_forward(float* out, float* mean, float* rstd, float* x, const float* residual, CView w, CView b,
                           int64_t N, int64_t C, cudaStream_t stream, float eps) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  if (N <= 0) return;
  if (C <= 0) throw Error("cuda::add_layernorm_forward: C must be > 0, got " + std::to_string(C));
  layernorm_forward_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(out, nullptr, DType::kF32, mean, rstd, x,
                                                                      residual, w.data, w.dtype, b.data, b.dtype, N, C,
                                                                      eps);
  detail::check_launch("add_layernorm_forward");
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, CView w,
                        const float* mean, const float* rstd, int64_t N, int64_t C, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kLayerNorm, stream);
  if (N <= 0 || C <= 0) return;
  layernorm_backward_dx_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(dx, dout, x, w.data, w.dtype, mean, rstd, N,
                                                                          C);
  detail::check_launch("layernorm_backward (dx)");
  layernorm_backward_dw_kernel<<<sum_blocks(C), dim3(kSumCols, kSumChunks), 0, stream>>>(dw, db, dout, x, mean,
                                                                                         rstd, N, C);
  detail::check_launch("layernorm_backward (dw, db)");
}

void gelu_forward(float* out, const float* x, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (n <= 0) return;
  gelu_forward_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(out, x, n);
  detail::check_launch("gelu_forward");
}

void gelu_forward_16(void* out16, DType t, const float* x, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  detail::check_operand16(t, "cuda::gelu_forward_16");
  if (n <= 0) return;
  gelu_forward_16_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(static_cast<uint16_t*>(out16), t, x,
                                                                                 n);
  detail::check_launch("gelu_forward_16");
}

void gelu_backward(float* dx, const float* x, const float* dout, int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kGelu, stream);
  if (n <= 0) return;
  gelu_backward_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(dx, x, dout, n);
  detail::check_launch("gelu_backward");
}

void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, float* dlogits,
                   float dloss_scale, double* row_loss, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kCrossEntropy, stream);
  if (N <= 0) return;
  const double grad_scale = static_cast<double>(dloss_scale) / static_cast<double>(N);
  cross_entropy_kernel<float><<<row_blocks(N), kRowThreads, 0, stream>>>(logits, targets, N, V, dlogits,
                                                                         DType::kF32, grad_scale, row_loss);
  detail::check_launch("cross_entropy");
}

void cross_entropy_16(const float* logits, const int32_t* targets, int64_t N, int64_t V, void* dlogits16, DType t,
                      float dloss_scale, double* row_loss, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kCrossEntropy, stream);
  detail::check_operand16(t, "cuda::cross_entropy_16");
  if (N <= 0) return;
  const double grad_scale = static_cast<double>(dloss_scale) / static_cast<double>(N);
  cross_entropy_kernel<uint16_t><<<row_blocks(N), kRowThreads, 0, stream>>>(
      logits, targets, N, V, static_cast<uint16_t*>(dlogits16), t, grad_scale, row_loss);
  detail::check_launch("cross_entropy_16");
}

double cross_entropy_mean(const double* row_loss, int64_t N, int64_t targets, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kCrossEntropy, stream);
  if (N <= 0 || targets <= 0) return 0.0;
  std::vector<double> host(static_cast<size_t>(N));
  ZINC_CUDA_CHECK(cudaMemcpyAsync(host.data(), row_loss, host.size() * sizeof(double), cudaMemcpyDeviceToHost, stream),
                  "cross_entropy_mean: copy of the row losses");
  ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "cross_entropy_mean: synchronize");
  double total = 0;
  for (double l : host) total += l;  // row order, as the CPU (ignored rows add 0)
  return total / static_cast<double>(targets);
}

void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T, int64_t C,
                       cudaStream_t stream, const int32_t* positions) {
  GpuProfileScope profile_scope(Op::kEmbedding, stream);
  const int64_t rows = B * T;
  if (rows <= 0 || C <= 0) return;
  embedding_forward_kernel<<<detail::blocks_for(rows * C), detail::kThreads, 0, stream>>>(
      out, tokens, wte.data, wte.dtype, wpe.data, wpe.dtype, positions, rows, T, C);
  detail::check_launch("embedding_forward");
}

void embedding_part_forward(float* out, const int32_t* tokens, CView wte, int64_t N, int64_t C, int64_t lo, int64_t n,
                            cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kEmbedding, stream);
  if (N <= 0 || C <= 0) return;
  embedding_part_forward_kernel<<<detail::blocks_for(N * C), detail::kThreads, 0, stream>>>(out, tokens, wte.data,
                                                                                            wte.dtype, N, C, lo, n);
  detail::check_launch("embedding_part_forward");
}

void embedding_part_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t lo,
                             int64_t n, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kEmbedding, stream);
  if (N <= 0 || C <= 0) return;
  embedding_part_backward_kernel<<<column_blocks(C), 128, 0, stream>>>(dwte, dout, tokens, N, C, lo, n);
  detail::check_launch("embedding_part_backward");
}

void cross_entropy_part_max(const float* logits, int64_t N, int64_t Vp, double* row_maxes, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kCrossEntropy, stream);
  if (N <= 0) return;
  cross_entropy_part_max_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(logits, N, Vp, row_maxes);
  detail::check_launch("cross_entropy_part_max");
}

void cross_entropy_part_sums(const float* logits, const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                             const double* row_maxes, double* sums, float* dlogits, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kCrossEntropy, stream);
  if (N <= 0) return;
  cross_entropy_part_sums_kernel<<<row_blocks(N), kRowThreads, 0, stream>>>(logits, targets, N, Vp, lo, row_maxes,
                                                                            sums, dlogits);
  detail::check_launch("cross_entropy_part_sums");
}

void cross_entropy_part_finish(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo, const double* sums,
                               float* dlogits, float dloss_scale, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kCrossEntropy, stream);
  if (N <= 0 || !dlogits) return;
  const double grad_scale = static_cast<double>(dloss_scale) / static_cast<double>(N);
  cross_entropy_part_finish_kernel<<<detail::blocks_for(N * Vp), detail::kThreads, 0, stream>>>(
      targets, N, Vp, lo, sums, dlogits, grad_scale);
  detail::check_launch("cross_entropy_part_finish");
}

void TokenIndex::group(const int32_t* tokens, int64_t n, int64_t V, std::vector<int32_t>& ids,
                       std::vector<int32_t>& starts, std::vector<int32_t>& rows) {
  // A stable counting sort: rows grouped by token, increasing within each.
  std::vector<int32_t> next(static_cast<size_t>(V), 0);
  for (int64_t r = 0; r < n; ++r) {
    if (tokens[r] < 0 || tokens[r] >= V)
      throw Error("TokenIndex: token " + std::to_string(tokens[r]) + " at position " + std::to_string(r) +
                  " is outside the vocabulary [0, " + std::to_string(V) + ")");
    ++next[static_cast<size_t>(tokens[r])];  // counts first
  }
  ids.clear();
  starts.clear();
  int32_t at = 0;
  for (int64_t v = 0; v < V; ++v) {
    const int32_t count = next[static_cast<size_t>(v)];
    if (count == 0) continue;
    ids.push_back(static_cast<int32_t>(v));
    starts.push_back(at);
    next[static_cast<size_t>(v)] = at;  // now: where its next row goes
    at += count;
  }
  starts.push_back(at);
  rows.resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) rows[static_cast<size_t>(next[static_cast<size_t>(tokens[r])]++)] = static_cast<int32_t>(r);
}

void TokenIndex::build(const int32_t* tokens, int64_t n, int64_t V, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kEmbedding, stream);
  group(tokens, n, V, host_ids_, host_starts_, host_rows_);
  distinct_ = static_cast<int64_t>(host_ids_.size());
  // The device copies are read by kernels queued later on `stream`: wait
  // for earlier readers before growing or overwriting them.
  ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "TokenIndex: synchronize before rewriting");
  ids_.reserve(host_ids_.size() * 4, "the token index");
  starts_.reserve(host_starts_.size() * 4, "the token index");
  rows_.reserve(host_rows_.size() * 4 + 4, "the token index");
  ZINC_CUDA_CHECK(cudaMemcpyAsync(ids_.data(), host_ids_.data(), host_ids_.size() * 4, cudaMemcpyHostToDevice, stream),
                  "TokenIndex upload");
  ZINC_CUDA_CHECK(cudaMemcpyAsync(starts_.data(), host_starts_.data(), host_starts_.size() * 4,
                                  cudaMemcpyHostToDevice, stream),
                  "TokenIndex upload");
  if (n > 0)
    ZINC_CUDA_CHECK(cudaMemcpyAsync(rows_.data(), host_rows_.data(), host_rows_.size() * 4, cudaMemcpyHostToDevice,
                                    stream),
                    "TokenIndex upload");
}
const int32_t* TokenIndex::ids() const { return ids_.as<int32_t>(); }
const int32_t* TokenIndex::starts() const { return starts_.as<int32_t>(); }
const int32_t* TokenIndex::rows() const { return rows_.as<int32_t>(); }

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, cudaStream_t stream, const TokenIndex* index, const int32_t* positions,
                        const TokenIndex* position_index) {
  GpuProfileScope profile_scope(Op::kEmbedding, stream);
  const int64_t rows = B * T;
  if (rows <= 0 || C <= 0) return;
  if (index) {
    const int64_t work = index->distinct() * C;
    if (work > 0) {
      embedding_backward_indexed_kernel<<<static_cast<unsigned>((work + 255) / 256), 256, 0, stream>>>(
          dwte, dout, index->ids(), index->starts(), index->rows(), index->distinct(), C);
      detail::check_launch("embedding_backward (tokens)");
    }
    if (!dwpe) return;
    if (!positions) {
      position_backward_kernel<<<static_cast<unsigned>((T * C + 255) / 256), 256, 0, stream>>>(dwpe, dout, B, T, C);
    } else if (position_index) {
      // The rows of each position that occurs, in row order: the token
      // kernel's (position, column) threads.
      const int64_t pwork = position_index->distinct() * C;
      if (pwork > 0)
        embedding_backward_indexed_kernel<<<static_cast<unsigned>((pwork + 255) / 256), 256, 0, stream>>>(
            dwpe, dout, position_index->ids(), position_index->starts(), position_index->rows(),
            position_index->distinct(), C);
    } else {
      embedding_backward_kernel<<<column_blocks(C), 128, 0, stream>>>(nullptr, dwpe, dout, tokens, positions, rows,
                                                                      T, C);
    }
    detail::check_launch("embedding_backward (positions)");
    return;
  }
  embedding_backward_kernel<<<column_blocks(C), 128, 0, stream>>>(dwte, dwpe, dout, tokens, positions, rows, T, C);
  detail::check_launch("embedding_backward");
}

}  // namespace zinc::kernels::cuda
