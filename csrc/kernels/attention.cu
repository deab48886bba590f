// Causal multi-head self-attention on the GPU (kernels_cuda.h): the CPU
// algorithm of attention.cpp (Note [attention layout and memory]) step for
// step, with cuBLAS strided-batched GEMMs (cuda::matmul) for the products:
//   forward   q, k, v permuted head-major into (B*H, T, hs) scratch,
//             S = scale Q K^T, P = causal_softmax(S) (in the workspace), Y = P V
//   backward  dP = dO V^T, dV = P^T dO, dS = P * (dP - rowsum(P * dP)),
//             dQ = scale dS K, dK = scale dS^T Q
// Operands are written in the compute dtype: fp32, bf16 or fp16 (the CPU
// keeps fp16 operands as fp16-exact fp32 for its fp32 GEMM; here they are the
// same values as fp16 for cuBLAS).
//
// Note [GPU softmax rows]
// The softmax and the rowsum of backward are per-row kernels with
// math::kLanes = 16 threads per row (two rows per warp). Thread l visits
// columns l, l + 16, ...; the row's max is the max of the 16 lane maxima (the
// CPU's max_of; max is exact in any order), exp is math::exp_f, and the row
// sum is Note [lane order]: thread l's math::lane_partial, then every thread
// adds the 16 partials in lane order from zero (__shfl_sync, width 16). The
// formula is the CPU's softmax_row_causal (mx, e = exp_f(x - mx), inv =
// 1 / sum, e * inv, zeros above the diagonal; with packed documents the
// row from its first key on, zeros before it) and softmax_row_dot, so given
// the same S (dP) the GPU writes the CPU's P (dS) bit for bit; S and dP come
// from cuBLAS and differ from oneDNN's in the last bits, so the end results
// are close, not equal.
//
// Scratch: the head-major operands, dP, dS and the per-head outputs live in
// grow-only device buffers owned by the calling thread, one set per (device,
// stream) so that two streams of one thread never share them (at most
// kMaxStreams sets per device); the only state that outlives a call is P in
// the CudaAttentionWorkspace.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/cuda_common.cuh"
#include "kernels/gpu_profile.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda.h"
#include "kernels/math.h"

namespace zinc::kernels::cuda {

using zinc::cuda::DeviceBuffer;

class CudaAttentionWorkspace {
 public:
  DeviceBuffer probs;  // (B*H, T, T) fp32 softmax probabilities, zero above the diagonal (and before a document)
  // The fused path's instead (Note [fused attention]): each row's
  // log-sum-exp (B*H*T), the output (B*T*C) and backward's row dots.
  DeviceBuffer lse, out, di;
  AttentionShape shape{};
  bool has_forward = false;
  bool fused = false;  // which path the forward ran
};

CudaAttentionWorkspace* attention_workspace_create() { return new CudaAttentionWorkspace(); }
void attention_workspace_destroy(CudaAttentionWorkspace* ws) { delete ws; }

namespace {

using detail::blocks_for;
using detail::check_launch;
using detail::kRowsPerBlock;
using detail::kRowThreads;
using detail::kThreads;
using detail::lane_combine;
static_assert(kRowThreads % 32 == 0 && 32 % math::kLanes == 0, "rows must tile whole warps");

// One block per kRowsPerBlock rows (the row kernels do not stride).
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

// ---- permutes -----------------------------------------------------------------------

// Up to four (B,T) row-major fp32 sources (row stride stride[p] floats,
// columns col0[p] .. col0[p] + C) into head-major (B*H, T, hs) operands in
// dtype t.
struct PermuteIn {
  int n = 0;
  void* dst[4];
  const float* src[4];
  int64_t stride[4], col0[4];
  void add(void* d, const float* s, int64_t st, int64_t c0) {
    dst[n] = d, src[n] = s, stride[n] = st, col0[n] = c0;
    ++n;
  }
};

__global__ void attn_permute_in_kernel(PermuteIn p, DType t, int64_t B, int64_t T, int64_t C, int64_t H) {
  const int64_t hs = C / H, per = B * T * C, total = per * p.n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int part = static_cast<int>(i / per);
    const int64_t rem = i - part * per, r = rem / C, c = rem - r * C;
    const int64_t b = r / T, tt = r - b * T, h = c / hs, e = c - h * hs;
    const float x = p.src[part][r * p.stride[part] + p.col0[part] + c];
    const int64_t o = ((b * H + h) * T + tt) * hs + e;
    if (t == DType::kF32)
      static_cast<float*>(p.dst[part])[o] = x;
    else
      static_cast<uint16_t*>(p.dst[part])[o] = float_to_16(x, t);
  }
}

// The inverse: srcs[p] (B*H, T, hs) fp32 into columns p*C + h*hs + e of the
// (B,T) rows of dst (row stride `stride` floats), for p < nparts.
struct PermuteOut {
  const float* src[3];
};

__global__ void attn_permute_out_kernel(float* __restrict__ dst, int64_t stride, PermuteOut p, int nparts,
                                        int64_t B, int64_t T, int64_t C, int64_t H) {
  const int64_t hs = C / H, width = nparts * C, total = B * T * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, cc = i - r * width;
    const int part = static_cast<int>(cc / C);
    const int64_t c = cc - part * C, b = r / T, tt = r - b * T, h = c / hs, e = c - h * hs;
    dst[r * stride + cc] = p.src[part][((b * H + h) * T + tt) * hs + e];
  }
}

// ---- per-row kernels (Note [GPU softmax rows]) ----------------------------------------------

// The first key row r of the (B*H*T) score rows may see: 0, or with packed
// documents t - positions[b*T + t] (Note [document boundaries] in
// attention.cpp). The row kernels then run the CPU's row functions on the
// row from k0 on (softmax_row_causal(row + k0, ...), softmax_row_dot(p + k0,
// ...)), so lane l visits columns k0 + l, k0 + l + 16, ... as the CPU's
// lane l does, and the bits stay the CPU's.
__device__ inline int64_t first_key(const int32_t* positions, int64_t r, int64_t T, int64_t H, int64_t window) {
  const int64_t t = r % T, b = r / T / H;
  const int64_t k0 = positions ? t - positions[b * T + t] : 0;
  return window > 0 && t - window + 1 > k0 ? t - window + 1 : k0;
}

// Row r of P(rows, T) (query t = r % T, first key k0): p[k0..t] =
// softmax(p[k0..t]) as the CPU's softmax_row_causal, 0 elsewhere; with pc,
// also the row in the 16-bit compute dtype t16.
__global__ void attn_causal_softmax_kernel(float* __restrict__ P, uint16_t* __restrict__ pc, DType t16,
                                           const int32_t* __restrict__ positions, int64_t rows, int64_t T,
                                           int64_t H, int64_t window, float softcap) {
  const int lane = static_cast<int>(threadIdx.x % math::kLanes);
  const int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / math::kLanes;
  const bool live = r < rows;  // dead lanes still join the shuffles
  const int64_t t = live ? r % T : 0, k0 = live ? first_key(positions, r, T, H, window) : 0;
  float* row = P + (live ? r : 0) * T;
  float* p = row + k0;                      // the keys k0..t
  const int64_t nv = live ? t + 1 - k0 : 0;  // how many
  // Soft-capped scores (the CPU's softcap_row), each by the thread that reads it.
  if (softcap > 0.0f)
    for (int64_t j = lane; j < nv; j += math::kLanes) p[j] = math::softcap(p[j], softcap, 1.0f / softcap);
  float m = -INFINITY;
  for (int64_t j = lane; j < nv; j += math::kLanes) m = p[j] > m ? p[j] : m;
  float mx = -INFINITY;
#pragma unroll
  for (int k = 0; k < math::kLanes; ++k) {
    const float v = __shfl_sync(0xffffffffu, m, k, math::kLanes);
    mx = v > mx ? v : mx;
  }
  const float part = math::lane_partial<float>(nv, lane, [&](int64_t j) {
    const float e = math::exp_f(p[j] - mx);
    p[j] = e;
    return e;
  });
  const float inv = 1.0f / lane_combine<float>(part);
  if (!live) return;
  for (int64_t j = lane; j < nv; j += math::kLanes) p[j] *= inv;
  for (int64_t j = lane; j < k0; j += math::kLanes) row[j] = 0.0f;
  for (int64_t j = t + 1 + lane; j < T; j += math::kLanes) row[j] = 0.0f;
  if (pc) {
    // Each thread converts the p[j] it wrote itself (no other thread's
    // store is read without a barrier); the zeros need no read.
    uint16_t* d = pc + r * T;
    const uint16_t zero = float_to_16(0.0f, t16);
    for (int64_t j = lane; j < nv; j += math::kLanes) d[k0 + j] = float_to_16(p[j], t16);
    for (int64_t j = lane; j < k0; j += math::kLanes) d[j] = zero;
    for (int64_t j = t + 1 + lane; j < T; j += math::kLanes) d[j] = zero;
  }
}

// dS = P * (dP - dot), dot = sum_{k0<=j<=t} p[j] dp[j] in lane order from
// k0 (the CPU's softmax_row_dot(p + k0, dp + k0, ...)), zero outside
// k0..t. fp32 compute (ds == nullptr): dS overwrites dP. 16-bit compute: dS
// and a copy of P into ds, pc in t16. With soft-capped scores, S holds the
// raw scores and dS is also times 1 - tanh(S / softcap)^2 (the CPU's
// softcap_ds_row).
__global__ void attn_softmax_backward_kernel(const float* __restrict__ P, float* __restrict__ dP,
                                             uint16_t* __restrict__ ds, uint16_t* __restrict__ pc, DType t16,
                                             const int32_t* __restrict__ positions, int64_t rows, int64_t T,
                                             int64_t H, int64_t window, const float* __restrict__ S,
                                             float softcap) {
  const int lane = static_cast<int>(threadIdx.x % math::kLanes);
  const int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / math::kLanes;
  const bool live = r < rows;
  const float* p = P + (live ? r : 0) * T;
  float* dp = dP + (live ? r : 0) * T;
  const int64_t k0 = live ? first_key(positions, r, T, H, window) : 0;
  const int64_t nv = live ? r % T + 1 : 0;
  const float part =
      math::lane_partial<float>(nv - k0, lane, [&](int64_t j) { return p[k0 + j] * dp[k0 + j]; });
  const float dot = lane_combine<float>(part);
  if (!live) return;
  const float* sr = S ? S + r * T : nullptr;
  auto dsv = [&](int64_t j) {
    const float d = p[j] * (dp[j] - dot);
    return sr ? d * math::softcap_grad(sr[j], softcap) : d;
  };
  if (!ds) {
    // dp[k0 + j] is rewritten by the thread that read it for the dot.
    for (int64_t j = lane; j < k0; j += math::kLanes) dp[j] = 0.0f;
    for (int64_t j = k0 + lane; j < nv; j += math::kLanes) dp[j] = dsv(j);
    for (int64_t j = nv + lane; j < T; j += math::kLanes) dp[j] = 0.0f;
    return;
  }
  uint16_t* dsr = ds + r * T;
  uint16_t* pcr = pc + r * T;
  for (int64_t j = lane; j < T; j += math::kLanes) {
    dsr[j] = float_to_16(j >= k0 && j < nv ? dsv(j) : 0.0f, t16);
    pcr[j] = float_to_16(p[j], t16);
  }
}

// ---- scratch ------------------------------------------------------------------------------

enum Slot { kQ, kK, kV, kDO, kPc, kDS, kDP, kY, kDQ, kDK, kDV, kS, kOut, kNumSlots };

struct Scratch {
  DeviceBuffer bufs[kNumSlots];
};

// Grow-only scratch of the calling thread for (current device, stream). At
// most kMaxStreams streams per thread keep scratch; a further one drops the
// least recently used set after waiting for the device (work queued on that
// stream, which may be gone, may still use it).
constexpr size_t kMaxStreams = 8;

Scratch& stream_scratch(cudaStream_t stream) {
  int dev = 0;
  ZINC_CUDA_CHECK(cudaGetDevice(&dev), "attention: cudaGetDevice");
  struct Entry {
    int device;
    cudaStream_t stream;
    uint64_t used;
    std::unique_ptr<Scratch> scratch;
  };
  thread_local std::vector<Entry> all;
  thread_local uint64_t clock = 0;
  ++clock;
  size_t on_device = 0;
  for (Entry& e : all) {
    if (e.device != dev) continue;
    if (e.stream == stream) {
      e.used = clock;
      return *e.scratch;
    }
    ++on_device;
  }
  if (on_device >= kMaxStreams) {
    auto oldest = all.end();
    for (auto it = all.begin(); it != all.end(); ++it)
      if (it->device == dev && (oldest == all.end() || it->used < oldest->used)) oldest = it;
    ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "attention: cudaDeviceSynchronize before dropping a stream's scratch");
    all.erase(oldest);
  }
  all.push_back({dev, stream, clock, std::make_unique<Scratch>()});
  return *all.back().scratch;
}

// Grows buf (never shrinks); work already queued on `stream` may still read
// the old buffer, so growing waits for the stream first.
void* grow(DeviceBuffer& buf, size_t bytes, cudaStream_t stream) {
  if (buf.bytes() < bytes) {
    if (buf.data())
      ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "attention: cudaStreamSynchronize before growing scratch");
    buf.reserve(bytes, "the attention's scratch");
  }
  return buf.data();
}

CView operand(const void* p, DType compute) { return CView{p, compute}; }

void check_shape(const char* fn, AttentionShape s) {
  if (s.B < 0 || s.T < 0 || s.C <= 0 || s.H <= 0 || s.C % s.H != 0) {
    throw Error(std::string(fn) + ": bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                " C=" + std::to_string(s.C) + " H=" + std::to_string(s.H) +
                " (need C > 0, H > 0 and C divisible by H)");
  }
}

// Where the fused kernels do not run, grouped-query heads come repeated.
void check_unfused_heads(const char* fn, AttentionShape s) {
  if (s.kv() != s.H)
    throw Error(std::string(fn) + ": " + std::to_string(s.kv_heads) + " kv heads for " + std::to_string(s.H) +
                " query heads: only the fused attention (16-bit compute, head size up to 128) reads them in place");
}

void permute_in(const PermuteIn& p, DType t, AttentionShape s, cudaStream_t stream) {
  attn_permute_in_kernel<<<blocks_for(p.n * s.B * s.T * s.C, kThreads), kThreads, 0, stream>>>(p, t, s.B, s.T, s.C,
                                                                                                s.H);
  check_launch("attention: attn_permute_in_kernel");
}

void permute_out(float* dst, int64_t stride, PermuteOut p, int nparts, AttentionShape s, cudaStream_t stream) {
  attn_permute_out_kernel<<<blocks_for(nparts * s.B * s.T * s.C, kThreads), kThreads, 0, stream>>>(
      dst, stride, p, nparts, s.B, s.T, s.C, s.H);
  check_launch("attention: attn_permute_out_kernel");
}

// -1: ZINC_CUDA_ATTENTION decides; 0 or 1: set_unfused_attention_for_testing.
std::atomic<int> unfused_override{-1};

// The fused kernels where they apply, unless ZINC_CUDA_ATTENTION=unfused.
bool use_fused(AttentionShape s, DType compute) {
  static const bool unfused_env = [] {
    return env_choice("ZINC_CUDA_ATTENTION", {"unfused", "fused"}) == "unfused";
  }();
  const int o = unfused_override.load();
  const bool unfused = o >= 0 ? o == 1 : unfused_env;
  return !unfused && flash_attention_applies(s.C / s.H, compute);
}

// The fused kernels' arguments over the q|k|v rows: (B,T,3C), or with
// kv_heads the q (H heads) | k | v (kv_heads each) rows.
FlashArgs flash_args(const float* qkv, AttentionShape s) {
  FlashArgs a;
  const int64_t D = s.C / s.H, kv = s.kv() * D;
  a.q = qkv;
  a.k = qkv + s.C;
  a.v = qkv + s.C + kv;
  a.q_stride = a.kv_stride = s.C + 2 * kv;
  a.out_stride = a.dout_stride = s.C;
  a.B = s.B, a.T = s.T, a.H = s.H, a.Hkv = s.kv(), a.D = D;
  a.positions = s.positions;
  a.window = s.window;
  a.scale = s.score_scale();
  a.softcap = s.softcap;
  return a;
}

}  // namespace

void set_unfused_attention_for_testing(bool unfused) { unfused_override.store(unfused ? 1 : 0); }

int64_t attention_workspace_bytes(AttentionShape s, DType compute) {
  const int64_t f = static_cast<int64_t>(sizeof(float));
  if (use_fused(s, compute)) return (2 * s.B * s.H * s.T + s.B * s.T * s.C) * f;  // lse, di; the output
  // Checked as the CPU's (kernels::attention_workspace_bytes): a user's sizes.
  int64_t bht = 0, scores = 0, bytes = 0;
  if (__builtin_mul_overflow(s.B * s.H, s.T, &bht) || __builtin_mul_overflow(bht, s.T, &scores) ||
      __builtin_mul_overflow(scores, f, &bytes))
    throw Error("attention: scores of " + std::to_string(s.B) + " x " + std::to_string(s.H) + " heads x " +
                std::to_string(s.T) + " x " + std::to_string(s.T) + " tokens take more bytes than a 64-bit count holds");
  return bytes;
}

int64_t attention_scratch_bytes(AttentionShape s, DType compute) {
  if (s.B == 0 || s.T == 0 || use_fused(s, compute)) return 0;
  // attention_workspace_bytes checked B*H*T*T*4 against a 64-bit count
  // (no smaller size than that is formed here).
  (void)attention_workspace_bytes(s, compute);
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  const int64_t f = static_cast<int64_t>(sizeof(float)), esz = static_cast<int64_t>(dtype_bytes(compute));
  const int64_t n_head = BH * T * hs, n_att = BH * T * T;
  const bool f32 = compute == DType::kF32;
  int64_t bytes = 4 * n_head * esz            // q, k, v, dO
                  + n_att * f                 // dP
                  + 4 * n_head * f;           // y, dq, dk, dv
  if (!f32) bytes += 2 * n_att * esz          // P's and dS's 16-bit copies
                     + n_head * f;            // the output on its way to 16 bits (no fp32 copy kept)
  if (s.softcap > 0.0f) bytes += n_att * f;   // the raw scores again
  return bytes;
}

bool fused_attention_used(int64_t head_dim, DType compute) {
  AttentionShape s{1, 1, head_dim, 1};
  return use_fused(s, compute);
}

void attention_forward(CudaAttentionWorkspace* ws, float* out, const float* qkv, AttentionShape s, DType compute,
                       cudaStream_t stream, void* out16) {
  GpuProfileScope profile_scope(Op::kAttention, stream);
  if (out16 && compute != DType::kBF16 && compute != DType::kF16)
    throw Error("cuda::attention_forward: a 16-bit output needs bf16 or fp16 compute, got " +
                std::string(dtype_name(compute)));
  check_shape("cuda::attention_forward", s);
  if (s.B == 0 || s.T == 0) {
    ws->shape = s;
    ws->has_forward = true;
    return;
  }
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  ws->shape = s;
  ws->has_forward = true;
  ws->fused = use_fused(s, compute);
  if (ws->fused) {
    FlashArgs a = flash_args(qkv, s);
    a.lse = static_cast<float*>(grow(ws->lse, static_cast<size_t>(BH * T) * sizeof(float), stream));
    const size_t out_bytes = static_cast<size_t>(s.B * T * s.C) * sizeof(float);
    a.out = static_cast<float*>(grow(ws->out, out_bytes, stream));
    a.out16 = static_cast<uint16_t*>(out16);
    flash_attention_forward(a, compute, stream);
    if (!out16)  // else the kernel wrote what the projection reads
      ZINC_CUDA_CHECK(cudaMemcpyAsync(out, a.out, out_bytes, cudaMemcpyDeviceToDevice, stream),
                      "attention: copy of the fused output");
    return;
  }
  check_unfused_heads("cuda::attention_forward", s);
  const size_t n_head = static_cast<size_t>(BH * T * hs);
  const size_t n_att = static_cast<size_t>(BH * T * T);
  float* P = static_cast<float*>(grow(ws->probs, n_att * sizeof(float), stream));
  Scratch& sc = stream_scratch(stream);
  const size_t esz = dtype_bytes(compute);
  void* q = grow(sc.bufs[kQ], n_head * esz, stream);
  void* k = grow(sc.bufs[kK], n_head * esz, stream);
  void* v = grow(sc.bufs[kV], n_head * esz, stream);
  PermuteIn pin;
  pin.add(q, qkv, 3 * s.C, 0);
  pin.add(k, qkv, 3 * s.C, s.C);
  pin.add(v, qkv, 3 * s.C, 2 * s.C);
  permute_in(pin, compute, s, stream);
  const float scale = s.score_scale();
  MatmulDesc sd{.batch = BH, .M = T, .N = T, .K = hs, .trans_b = true, .alpha = scale, .compute = compute};
  matmul(sd, operand(q, compute), operand(k, compute), P, stream);
  // Softmax in place; with 16-bit compute also the 16-bit copy of P for P V.
  const bool f32 = compute == DType::kF32;
  uint16_t* pc = f32 ? nullptr : static_cast<uint16_t*>(grow(sc.bufs[kPc], n_att * esz, stream));
  attn_causal_softmax_kernel<<<row_blocks(BH * T), kRowThreads, 0, stream>>>(
      P, pc, compute, s.positions, BH * T, T, s.H, s.window, s.softcap);
  check_launch("attention: attn_causal_softmax_kernel");
  float* y = static_cast<float*>(grow(sc.bufs[kY], n_head * sizeof(float), stream));
  MatmulDesc yd{.batch = BH, .M = T, .N = hs, .K = T, .compute = compute};
  matmul(yd, f32 ? operand(P, compute) : operand(pc, compute), operand(v, compute), y, stream);
  PermuteOut po{{y, nullptr, nullptr}};
  // With out16 and no `out` (a model that keeps no fp32 copy) the output
  // goes through this stream's scratch to its rounding.
  float* dst = out || !out16 ? out : static_cast<float*>(grow(sc.bufs[kOut], n_head * sizeof(float), stream));
  permute_out(dst, s.C, po, 1, s, stream);
  if (out16) convert_f32_to_16(dst, out16, s.B * T * s.C, compute, stream);
}

void attention_backward(CudaAttentionWorkspace* ws, float* dqkv, const float* dout, const float* qkv,
                        AttentionShape s, DType compute, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kAttention, stream);
  check_shape("cuda::attention_backward", s);
  if (!ws->has_forward || ws->shape.B != s.B || ws->shape.T != s.T || ws->shape.C != s.C || ws->shape.H != s.H ||
      ws->shape.kv() != s.kv()) {
    throw Error("cuda::attention_backward: the workspace holds no forward pass of this shape "
                "(call attention_forward with the same workspace first)");
  }
  if (s.B == 0 || s.T == 0) return;
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  if (ws->fused) {
    FlashArgs a = flash_args(qkv, s);
    a.lse = ws->lse.as<float>();
    a.out = ws->out.as<float>();
    a.dout = dout;
    a.di = static_cast<float*>(grow(ws->di, static_cast<size_t>(BH * T) * sizeof(float), stream));
    a.dq = dqkv;
    a.dk = dqkv + (a.k - a.q);
    a.dv = dqkv + (a.v - a.q);
    flash_attention_backward(a, compute, stream);
    return;
  }
  check_unfused_heads("cuda::attention_backward", s);
  const size_t n_head = static_cast<size_t>(BH * T * hs);
  const size_t n_att = static_cast<size_t>(BH * T * T);
  const float* P = ws->probs.as<float>();
  Scratch& sc = stream_scratch(stream);
  const size_t esz = dtype_bytes(compute);
  void* q = grow(sc.bufs[kQ], n_head * esz, stream);
  void* k = grow(sc.bufs[kK], n_head * esz, stream);
  void* v = grow(sc.bufs[kV], n_head * esz, stream);
  void* dO = grow(sc.bufs[kDO], n_head * esz, stream);
  PermuteIn pin;
  pin.add(q, qkv, 3 * s.C, 0);
  pin.add(k, qkv, 3 * s.C, s.C);
  pin.add(v, qkv, 3 * s.C, 2 * s.C);
  pin.add(dO, dout, s.C, 0);
  permute_in(pin, compute, s, stream);
  float* dP = static_cast<float*>(grow(sc.bufs[kDP], n_att * sizeof(float), stream));
  matmul({.batch = BH, .M = T, .N = T, .K = hs, .trans_b = true, .compute = compute}, operand(dO, compute),
         operand(v, compute), dP, stream);
  // dS (and, for 16-bit compute, a 16-bit copy of P for dV). With fp32
  // compute dS overwrites dP in place and P is used as is.
  const bool f32 = compute == DType::kF32;
  // Soft-capped scores: the raw scores again (forward's product) for the
  // cap's derivative.
  float* S = nullptr;
  if (s.softcap > 0.0f) {
    S = static_cast<float*>(grow(sc.bufs[kS], n_att * sizeof(float), stream));
    matmul({.batch = BH, .M = T, .N = T, .K = hs, .trans_b = true, .alpha = s.score_scale(), .compute = compute},
           operand(q, compute), operand(k, compute), S, stream);
  }
  uint16_t* ds = f32 ? nullptr : static_cast<uint16_t*>(grow(sc.bufs[kDS], n_att * esz, stream));
  uint16_t* pc = f32 ? nullptr : static_cast<uint16_t*>(grow(sc.bufs[kPc], n_att * esz, stream));
  attn_softmax_backward_kernel<<<row_blocks(BH * T), kRowThreads, 0, stream>>>(
      P, dP, ds, pc, compute, s.positions, BH * T, T, s.H, s.window, S, s.softcap);
  check_launch("attention: attn_softmax_backward_kernel");
  const CView pv = f32 ? operand(P, compute) : operand(pc, compute);
  const CView dsv = f32 ? operand(dP, compute) : operand(ds, compute);
  const float scale = s.score_scale();
  float* dv = static_cast<float*>(grow(sc.bufs[kDV], n_head * sizeof(float), stream));
  float* dq = static_cast<float*>(grow(sc.bufs[kDQ], n_head * sizeof(float), stream));
  float* dk = static_cast<float*>(grow(sc.bufs[kDK], n_head * sizeof(float), stream));
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .trans_a = true, .compute = compute}, pv, operand(dO, compute), dv,
         stream);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .alpha = scale, .compute = compute}, dsv, operand(k, compute), dq,
         stream);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .trans_a = true, .alpha = scale, .compute = compute}, dsv,
         operand(q, compute), dk, stream);
  PermuteOut po{{dq, dk, dv}};
  permute_out(dqkv, 3 * s.C, po, 3, s, stream);
}

}  // namespace zinc::kernels::cuda
