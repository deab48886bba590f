// Fused causal attention on the GPU's tensor cores (kernels_cuda.h).
//
// Note [fused attention]
// The unfused path (attention.cu) writes the (B*H, T, T) scores and
// probabilities to device memory and runs the softmax over whole rows. This
// one is the FlashAttention-2 algorithm: the scores of a tile of queries and
// a tile of keys live in shared memory only, the softmax is online (a running
// row maximum m and sum l; each new key tile rescales the output rows by
// exp(m_old - m_new)), and forward keeps one float per row, the log-sum-exp
// lse = m + log l, for backward, which recomputes the probabilities as
// exp(s - lse). The products run on the tensor cores through WMMA
// (m16n16k16, bf16 or fp16 operands, fp32 accumulation); the emulation has a
// WMMA of its own (tests/cuda_emu/include/mma.h).
//
// Blocks of 4 warps take 64 queries (forward, dQ) or 64 keys (dK, dV), 16 per
// warp, and walk the other side in tiles of 64. The operands are converted to
// the compute dtype when a tile is loaded into shared memory, with head dims
// zero-padded up to DP, a multiple of 32 (64, 96, 128 run as they are; 80
// runs as 96; any head dim up to 128 is correct), rows past T zero. WMMA's
// fragments have a layout CUDA leaves unspecified, so everything done per
// row (the mask, the cap, the softmax, the rescale) is done on fp32 copies
// in shared memory: S = Q K^T goes from fragments to shared memory, each
// pair of lanes takes one row of the warp's 16 (32 columns each, the row's
// max and sum combined with one shuffle), writes P in the compute dtype
// there and scales the fp32 output rows, which go back into fragments for
// O += P V.
//
// Masks: key j is seen by query t when j <= t and j >= first(t), first(t)
// = t - positions[b, t] with packed documents and t - window + 1 with a
// window (the larger), as the unfused kernels' first_key. Scores are
// scale * q.k, soft-capped (cap tanh(s / cap)) when softcap > 0, before
// the mask; a fully masked row so far has m = -inf and adds nothing.
//
// Grouped-query attention: query head h reads kv head h / (H / Hkv) from
// q, k and v as the projection wrote them (row strides q_stride and
// kv_stride), so k and v are never repeated. The Llama-style decoder passes
// its projection so (AttentionShape::kv_heads, Ops::attention_reads_kv_heads).
//
// Backward, deterministic (no atomics): Di = rowsum(dO * O) first; then one
// kernel per 64-key tile of each kv head walks every query tile of every
// query head of its group and accumulates dV += P^T dO and dK += dS^T Q in
// fragments, and one kernel per 64-query tile walks the key tiles for dQ +=
// dS K, with dS = P (dP - Di) (times the cap's 1 - tanh^2), dP = dO V^T.
// That recomputes Q K^T and dO V^T twice, the price of no atomics.
//
// Precision: the products see Q, K, V, dO, P and dS rounded to the compute
// dtype, as the unfused path's GEMMs do; P is unnormalised in [0, 1] where
// the unfused path rounds the normalised P. The results are not the unfused
// path's bits; the tests hold both to the fp32 CPU attention (tests/cuda/
// cuda_flash_attention_test.cpp states the tolerances).
//
// Shared memory: up to 121 KiB a block at DP 128 (under sm_80's 163 KiB),
// set per launch with cudaFuncSetAttribute.
#include <cuda_runtime_api.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cuda_common.cuh"
#include "kernels/gpu_profile.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda.h"
#include "kernels/math.h"

namespace zinc::kernels::cuda {

namespace {

using namespace nvcuda;
using detail::check_launch;

constexpr int kTile = 64;                  // queries or keys a block takes, and the other side's tile
constexpr int kWarps = 4;                  // 16 rows each
constexpr int kFlashThreads = 32 * kWarps;
constexpr int kLdS = kTile + 4;            // fp32 score rows (floats)
constexpr int kLdP = kTile + 8;            // 16-bit P and dS rows (elements)
constexpr int kMaxHeadDim = 128;

template <class E>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major>;
template <class E>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major>;
template <class E>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Shared memory layout of the three kernels at head dim (padded) DP, byte
// offsets, every region 128-byte aligned (WMMA needs 32).
template <int DP>
struct Smem {
  static constexpr int kLd = DP + 8;  // 16-bit operand rows (elements)
  static constexpr int kLdO = DP + 4;  // fp32 output rows (floats)
  static constexpr size_t kOperand = size_t{kTile} * kLd * 2;  // one 64-row operand tile
  static constexpr size_t kScores = size_t{kWarps} * 16 * kLdS * 4;  // one fp32 16 x 64 tile per warp
  static constexpr size_t k16 = size_t{kWarps} * 16 * kLdP * 2;  // one 16-bit 16 x 64 tile per warp
  static constexpr size_t kRows = size_t{kTile} * 4;  // one float per row of the tile
  // Forward: Q, K, V, S, P, O, 1/l.
  static constexpr size_t kFwdS = 3 * kOperand, kFwdP = kFwdS + kScores, kFwdO = kFwdP + k16,
                          kFwdInv = kFwdO + size_t{kWarps} * 16 * kLdO * 4, kFwdFirst = kFwdInv + kRows,
                          kFwd = kFwdFirst + kRows;
  // Backward: the kernel's own operand pair, the other side's pair, per warp
  // two fp32 score tiles (S and dP, adjacent) and two 16-bit ones, then lse,
  // Di and first key of the query tile's rows.
  static constexpr size_t kBwdW = 4 * kOperand, kBwd16 = kBwdW + 2 * kScores, kBwdRows = kBwd16 + 2 * k16,
                          kBwd = kBwdRows + 3 * kRows;
  static_assert(kOperand % 128 == 0 && kScores % 128 == 0 && k16 % 128 == 0, "regions stay 128-byte aligned");
  static_assert(kBwd <= 163 * 1024 && kFwd <= 163 * 1024, "fits sm_80's shared memory");
  // A warp's output staging (16 x DP floats) fits in two operand tiles.
  static_assert(size_t{kWarps} * 16 * kLdO * 4 <= 2 * kOperand, "staging fits");
  // ... and in a warp's two fp32 score tiles (flash_dq_kernel).
  static_assert(kLdO <= 2 * kLdS, "staging fits");
};

// The backward kernels' shared memory (Smem's kBwd* regions) as pointers:
// the kernel's own operand pair (K, V for dK and dV; Q, dO for dQ), the
// other side's pair, this warp's two fp32 score tiles (S and dP, adjacent)
// and two 16-bit ones, and the query rows' lse, Di and first keys.
template <int DP>
struct BwdTiles {
  uint16_t *own0, *own1, *other0, *other1;
  float *s, *dp;
  uint16_t *p16, *ds16;
  float *lse, *di;
  int32_t* first;
  __device__ BwdTiles(unsigned char* smem, int warp) {
    using L = Smem<DP>;
    own0 = reinterpret_cast<uint16_t*>(smem);
    own1 = reinterpret_cast<uint16_t*>(smem + L::kOperand);
    other0 = reinterpret_cast<uint16_t*>(smem + 2 * L::kOperand);
    other1 = reinterpret_cast<uint16_t*>(smem + 3 * L::kOperand);
    s = reinterpret_cast<float*>(smem + L::kBwdW) + warp * 2 * 16 * kLdS;
    dp = s + 16 * kLdS;
    p16 = reinterpret_cast<uint16_t*>(smem + L::kBwd16) + warp * 2 * 16 * kLdP;
    ds16 = p16 + 16 * kLdP;
    lse = reinterpret_cast<float*>(smem + L::kBwdRows);
    di = lse + kTile;
    first = reinterpret_cast<int32_t*>(di + kTile);
  }
};

template <class E>
__device__ __forceinline__ const E* as_e(const uint16_t* p) {
  return reinterpret_cast<const E*>(p);
}

// The first key query t of batch b sees (see the Note).
__device__ __forceinline__ int64_t first_key(const FlashArgs& a, int64_t b, int64_t t) {
  int64_t k0 = a.positions ? t - a.positions[b * a.T + t] : 0;
  if (a.window > 0 && t - a.window + 1 > k0) k0 = t - a.window + 1;
  return k0;
}

// The first key tile any query q0 .. q0 + 63 (those < T) sees: the least
// first key over the rows (the documents' starts and the windows' ends;
// not assumed to grow with t), rounded down to a tile. Tiles before it
// are masked for every row and skipped: with packed documents most of a
// long row's tiles. Every thread of the block takes part and gets the same
// value; `first` (kTile ints of shared memory) is free again on return.
__device__ int64_t first_key_tile(const FlashArgs& a, int64_t b, int64_t q0, int32_t* first) {
  for (int i = threadIdx.x; i < kTile; i += kFlashThreads)
    first[i] = q0 + i < a.T ? static_cast<int32_t>(first_key(a, b, q0 + i)) : INT32_MAX;
  __syncthreads();
  int32_t m = INT32_MAX;
  for (int i = 0; i < kTile; ++i) m = first[i] < m ? first[i] : m;
  __syncthreads();
  return m / kTile * kTile;
}

// Rows row0 .. row0 + 63 of one head (columns col0 .. col0 + D of rows of
// `stride` floats from src) into a 64 x DP tile of dtype t, zero past T and
// past D. All the block's threads take part.
template <int DP>
__device__ void load_tile(uint16_t* dst, const float* __restrict__ src, int64_t stride, int64_t row0, int64_t T,
                          int64_t D, DType t) {
  constexpr int kLd = Smem<DP>::kLd;
  for (int i = threadIdx.x; i < kTile * DP; i += kFlashThreads) {
    const int r = i / DP, c = i % DP;
    const int64_t row = row0 + r;
    const float x = row < T && c < D ? src[row * stride + c] : 0.0f;
    dst[r * kLd + c] = float_to_16(x, t);
  }
}

// One float per row of a 64-row tile: f(row) for rows < T, `dead` past T.
template <class F>
__device__ void load_rows(float* dst, int64_t row0, int64_t T, float dead, F f) {
  for (int i = threadIdx.x; i < kTile; i += kFlashThreads) dst[i] = row0 + i < T ? f(row0 + i) : dead;
}

// d(16 x 64, fp32, rows kLdS) = a(16 x DP) b^T where b is 64 x DP; both
// row-major 16-bit with rows Smem<DP>::kLd.
template <class E, int DP>
__device__ void product_abt(float* d, const uint16_t* a, const uint16_t* b) {
  constexpr int kLd = Smem<DP>::kLd;
  for (int n = 0; n < kTile / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < DP / 16; ++kk) {
      FragA<E> fa;
      FragBCol<E> fb;
      wmma::load_matrix_sync(fa, as_e<E>(a + kk * 16), kLd);
      wmma::load_matrix_sync(fb, as_e<E>(b + n * 16 * kLd + kk * 16), kLd);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(d + n * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// acc[n] += a(16 x 64, 16-bit rows kLdP) b(64 x DP, rows Smem<DP>::kLd), for
// the DP / 16 column blocks n of the result.
template <class E, int DP>
__device__ void product_accumulate(FragC* acc, const uint16_t* a, const uint16_t* b) {
  constexpr int kLd = Smem<DP>::kLd;
  for (int n = 0; n < DP / 16; ++n)
    for (int kk = 0; kk < kTile / 16; ++kk) {
      FragA<E> fa;
      FragBRow<E> fb;
      wmma::load_matrix_sync(fa, as_e<E>(a + kk * 16), kLdP);
      wmma::load_matrix_sync(fb, as_e<E>(b + kk * 16 * kLd + n * 16), kLd);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
}

// A warp's 16 result rows (DP / 16 fragments, times `scale`) through its
// staging rows into rows row0 .. row0 + 15 (those < T) of dst, columns
// 0 .. D of rows of `stride` floats.
template <int DP>
__device__ void write_rows(float* dst, int64_t stride, int64_t row0, int64_t T, int64_t D, FragC* acc, float scale,
                           float* stage) {
  constexpr int kLdO = Smem<DP>::kLdO;
  for (int n = 0; n < DP / 16; ++n) {
    for (int i = 0; i < acc[n].num_elements; ++i) acc[n].x[i] *= scale;
    wmma::store_matrix_sync(stage + n * 16, acc[n], kLdO, wmma::mem_row_major);
  }
  __syncwarp();
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int r = 0; r < 16; ++r) {
    if (row0 + r >= T) break;
    for (int64_t c = lane; c < D; c += 32) dst[(row0 + r) * stride + c] = stage[r * kLdO + c];
  }
  __syncwarp();
}

// The scaled, capped score of a raw product (the Note).
__device__ __forceinline__ float capped(float raw, const FlashArgs& a) {
  const float s = raw * a.scale;
  return a.softcap > 0.0f ? math::softcap(s, a.softcap, 1.0f / a.softcap) : s;
}

// ---- forward ---------------------------------------------------------------------------------

template <class E, int DP>
__global__ void __launch_bounds__(kFlashThreads) flash_forward_kernel(FlashArgs a, DType t16) {
  extern __shared__ __align__(128) unsigned char flash_smem[];
  using L = Smem<DP>;
  uint16_t* Qs = reinterpret_cast<uint16_t*>(flash_smem);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(flash_smem + L::kOperand);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(flash_smem + 2 * L::kOperand);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  float* Sw = reinterpret_cast<float*>(flash_smem + L::kFwdS) + warp * 16 * kLdS;
  uint16_t* Pw = reinterpret_cast<uint16_t*>(flash_smem + L::kFwdP) + warp * 16 * kLdP;
  float* Ow = reinterpret_cast<float*>(flash_smem + L::kFwdO) + warp * 16 * L::kLdO;
  float* inv_l = reinterpret_cast<float*>(flash_smem + L::kFwdInv);
  int32_t* first_s = reinterpret_cast<int32_t*>(flash_smem + L::kFwdFirst);

  const int64_t bh = blockIdx.x, b = bh / a.H, h = bh % a.H, g = h / (a.H / a.Hkv);
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kTile, T = a.T;
  load_tile<DP>(Qs, a.q + b * T * a.q_stride + h * a.D, a.q_stride, q0, T, a.D, t16);
  for (int i = lane; i < 16 * L::kLdO; i += 32) Ow[i] = 0.0f;
  __syncthreads();
  FragA<E> qf[DP / 16];
  for (int kk = 0; kk < DP / 16; ++kk) wmma::load_matrix_sync(qf[kk], as_e<E>(Qs + warp * 16 * L::kLd + kk * 16), L::kLd);

  // This lane's row of the warp's 16 and its half of the columns.
  const int r = lane / 2, half = lane % 2;
  const int64_t t = q0 + warp * 16 + r;
  const bool live = t < T;
  const int64_t kfirst = live ? first_key(a, b, t) : 0;
  float m = -INFINITY, l = 0.0f;
  const int64_t kend = q0 + kTile < T ? q0 + kTile : T;
  const int64_t kbeg = first_key_tile(a, b, q0, first_s);
  for (int64_t k0 = kbeg; k0 < kend; k0 += kTile) {
    __syncthreads();  // the last tile's K and V are read
    load_tile<DP>(Ks, a.k + b * T * a.kv_stride + g * a.D, a.kv_stride, k0, T, a.D, t16);
    load_tile<DP>(Vs, a.v + b * T * a.kv_stride + g * a.D, a.kv_stride, k0, T, a.D, t16);
    __syncthreads();
    // S = Q K^T (the Q fragments stay loaded).
    for (int n = 0; n < kTile / 16; ++n) {
      FragC acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int kk = 0; kk < DP / 16; ++kk) {
        FragBCol<E> fb;
        wmma::load_matrix_sync(fb, as_e<E>(Ks + n * 16 * L::kLd + kk * 16), L::kLd);
        wmma::mma_sync(acc, qf[kk], fb, acc);
      }
      wmma::store_matrix_sync(Sw + n * 16, acc, kLdS, wmma::mem_row_major);
    }
    __syncwarp();
    // The online softmax of the lane's half row.
    float* srow = Sw + r * kLdS + half * 32;
    float mx = -INFINITY;
    for (int c = 0; c < 32; ++c) {
      const int64_t j = k0 + half * 32 + c;
      const float y = live && j <= t && j >= kfirst ? capped(srow[c], a) : -INFINITY;
      srow[c] = y;
      mx = y > mx ? y : mx;
    }
    const float other = __shfl_xor_sync(0xffffffffu, mx, 1);
    mx = other > mx ? other : mx;
    const float mnew = mx > m ? mx : m;
    const float alpha = mnew == -INFINITY ? 1.0f : expf(m - mnew);
    float sum = 0.0f;
    uint16_t* prow = Pw + r * kLdP + half * 32;
    for (int c = 0; c < 32; ++c) {
      const float p = srow[c] == -INFINITY ? 0.0f : expf(srow[c] - mnew);
      sum += p;
      prow[c] = float_to_16(p, t16);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = mnew;
    float* orow = Ow + r * L::kLdO;
    for (int c = half * (DP / 2); c < (half + 1) * (DP / 2); ++c) orow[c] *= alpha;
    __syncwarp();
    // O += P V.
    for (int n = 0; n < DP / 16; ++n) {
      FragC acc;
      wmma::load_matrix_sync(acc, Ow + n * 16, L::kLdO, wmma::mem_row_major);
      for (int kk = 0; kk < kTile / 16; ++kk) {
        FragA<E> fa;
        FragBRow<E> fb;
        wmma::load_matrix_sync(fa, as_e<E>(Pw + kk * 16), kLdP);
        wmma::load_matrix_sync(fb, as_e<E>(Vs + kk * 16 * L::kLd + n * 16), L::kLd);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ow + n * 16, acc, L::kLdO, wmma::mem_row_major);
    }
    __syncwarp();
  }
  if (half == 0) {
    inv_l[warp * 16 + r] = live ? 1.0f / l : 0.0f;
    if (live) a.lse[bh * T + t] = m + logf(l);
  }
  __syncwarp();
  const int64_t row0 = q0 + warp * 16;
  for (int rr = 0; rr < 16 && row0 + rr < T; ++rr) {
    const int64_t at = (b * T + row0 + rr) * a.out_stride + h * a.D;
    float* out = a.out + at;
    for (int64_t c = lane; c < a.D; c += 32) {
      const float o = Ow[rr * L::kLdO + c] * inv_l[warp * 16 + rr];
      out[c] = o;
      if (a.out16) a.out16[at + c] = float_to_16(o, t16);
    }
  }
}

// ---- backward --------------------------------------------------------------------------------

// Di = sum over the head's D columns of dO * O, one warp per (b, t, h) row
// (di[(b H + h) T + t]), with dO rounded to the compute dtype t16 as dP =
// dO V^T sees it: Di is then the sum of P dP up to the products' rounding,
// and dS = P (dP - Di) cancels as it should (a row that sees one key has
// dS = 0 up to that rounding; with fp32 dO here the difference of the two
// roundings of dO stayed, 2e-2 of the gradient at head dim 128).
__global__ void flash_row_dot_kernel(FlashArgs a, DType t16) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t rows = a.B * a.T * a.H, warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  // A grid-stride loop over rows by whole warps (every lane of a warp has the same row).
  for (int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; row < rows; row += warps) {
    const int64_t bt = row / a.H, h = row % a.H;
    const float* dout = a.dout + bt * a.dout_stride + h * a.D;
    const float* out = a.out + bt * a.out_stride + h * a.D;
    float part = 0.0f;
    for (int64_t c = lane; c < a.D; c += 32) part += from_16(float_to_16(dout[c], t16), t16) * out[c];
    for (int o = 16; o > 0; o /= 2) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) {
      const int64_t b = bt / a.T, t = bt % a.T;
      a.di[(b * a.H + h) * a.T + t] = part;
    }
  }
}

// The probability and score gradient of query t and key j from the raw
// products q.k and dO.v (the Note).
struct PdS {
  float p, ds;
};
__device__ __forceinline__ PdS p_and_ds(float raw, float dp, float lse, float di, const FlashArgs& a) {
  const float s = raw * a.scale;
  const float y = a.softcap > 0.0f ? math::softcap(s, a.softcap, 1.0f / a.softcap) : s;
  const float p = expf(y - lse);
  float ds = p * (dp - di);
  if (a.softcap > 0.0f) ds *= math::softcap_grad(s, a.softcap);
  return {p, ds};
}

// dK and dV of 64 keys of one kv head (blockIdx.x: b * Hkv + g, blockIdx.y:
// the key tile), over every query head of the group and every query tile
// that sees them.
template <class E, int DP>
__global__ void __launch_bounds__(kFlashThreads) flash_dkdv_kernel(FlashArgs a, DType t16) {
  extern __shared__ __align__(128) unsigned char flash_smem[];
  using L = Smem<DP>;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const BwdTiles<DP> sm(flash_smem, warp);
  uint16_t *Ks = sm.own0, *Vs = sm.own1, *Qs = sm.other0, *dOs = sm.other1;
  float *STw = sm.s, *dPTw = sm.dp;  // S^T and dP^T
  uint16_t *PTw = sm.p16, *dSTw = sm.ds16;
  float *lse_s = sm.lse, *di_s = sm.di;
  int32_t* first_s = sm.first;

  const int64_t bg = blockIdx.x, b = bg / a.Hkv, g = bg % a.Hkv, group = a.H / a.Hkv;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kTile, T = a.T;
  load_tile<DP>(Ks, a.k + b * T * a.kv_stride + g * a.D, a.kv_stride, k0, T, a.D, t16);
  load_tile<DP>(Vs, a.v + b * T * a.kv_stride + g * a.D, a.kv_stride, k0, T, a.D, t16);
  FragC dk[DP / 16], dv[DP / 16];
  for (int n = 0; n < DP / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  const int r = lane / 2, half = lane % 2;
  const int64_t j = k0 + warp * 16 + r;  // this lane's key
  // Queries t >= k0 see these keys; with a window only t < k0 + 64 + window - 1.
  int64_t qend = T;
  if (a.window > 0 && k0 + kTile + a.window - 1 < qend) qend = k0 + kTile + a.window - 1;
  for (int64_t hh = 0; hh < group; ++hh) {
    const int64_t h = g * group + hh, bh = b * a.H + h;
    for (int64_t q0 = k0 / kTile * kTile; q0 < qend; q0 += kTile) {
      __syncthreads();  // the last query tile is read
      for (int i = threadIdx.x; i < kTile; i += kFlashThreads)
        first_s[i] = q0 + i < T ? static_cast<int32_t>(first_key(a, b, q0 + i)) : INT32_MAX;
      __syncthreads();
      // A query tile whose every row's first key comes after these keys
      // (packed documents, windows) adds nothing: skipped, by every thread.
      int32_t least = INT32_MAX;
      for (int i = 0; i < kTile; ++i) least = first_s[i] < least ? first_s[i] : least;
      if (least > k0 + kTile - 1) continue;
      load_tile<DP>(Qs, a.q + b * T * a.q_stride + h * a.D, a.q_stride, q0, T, a.D, t16);
      load_tile<DP>(dOs, a.dout + b * T * a.dout_stride + h * a.D, a.dout_stride, q0, T, a.D, t16);
      load_rows(lse_s, q0, T, 0.0f, [&](int64_t t) { return a.lse[bh * T + t]; });
      load_rows(di_s, q0, T, 0.0f, [&](int64_t t) { return a.di[bh * T + t]; });
      __syncthreads();
      product_abt<E, DP>(STw, Ks + warp * 16 * L::kLd, Qs);
      product_abt<E, DP>(dPTw, Vs + warp * 16 * L::kLd, dOs);
      __syncwarp();
      for (int c = 0; c < 32; ++c) {
        const int qi = half * 32 + c;
        const int64_t t = q0 + qi;
        float p = 0.0f, ds = 0.0f;
        if (t < T && j <= t && j >= first_s[qi]) {
          const PdS v = p_and_ds(STw[r * kLdS + qi], dPTw[r * kLdS + qi], lse_s[qi], di_s[qi], a);
          p = v.p;
          ds = v.ds;
        }
        PTw[r * kLdP + qi] = float_to_16(p, t16);
        dSTw[r * kLdP + qi] = float_to_16(ds, t16);
      }
      __syncwarp();
      product_accumulate<E, DP>(dv, PTw, dOs);
      product_accumulate<E, DP>(dk, dSTw, Qs);
    }
  }
  __syncthreads();  // Q and dO are free: they stage the results
  float* stage = reinterpret_cast<float*>(flash_smem + 2 * L::kOperand) + warp * 16 * L::kLdO;
  const int64_t row0 = k0 + warp * 16;
  write_rows<DP>(a.dk + b * T * a.kv_stride + g * a.D, a.kv_stride, row0, T, a.D, dk, a.scale, stage);
  write_rows<DP>(a.dv + b * T * a.kv_stride + g * a.D, a.kv_stride, row0, T, a.D, dv, 1.0f, stage);
}

// dQ of 64 queries of one head (blockIdx.x: b * H + h, blockIdx.y: the
// query tile), over the key tiles they see.
template <class E, int DP>
__global__ void __launch_bounds__(kFlashThreads) flash_dq_kernel(FlashArgs a, DType t16) {
  extern __shared__ __align__(128) unsigned char flash_smem[];
  using L = Smem<DP>;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const BwdTiles<DP> sm(flash_smem, warp);
  uint16_t *Qs = sm.own0, *dOs = sm.own1, *Ks = sm.other0, *Vs = sm.other1;
  float *Sw = sm.s, *dPw = sm.dp;  // S and dP (adjacent: they stage the result)
  uint16_t* dSw = sm.p16;
  float *lse_s = sm.lse, *di_s = sm.di;
  int32_t* first_s = sm.first;

  const int64_t bh = blockIdx.x, b = bh / a.H, h = bh % a.H, g = h / (a.H / a.Hkv);
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kTile, T = a.T;
  load_tile<DP>(Qs, a.q + b * T * a.q_stride + h * a.D, a.q_stride, q0, T, a.D, t16);
  load_tile<DP>(dOs, a.dout + b * T * a.dout_stride + h * a.D, a.dout_stride, q0, T, a.D, t16);
  load_rows(lse_s, q0, T, 0.0f, [&](int64_t t) { return a.lse[bh * T + t]; });
  load_rows(di_s, q0, T, 0.0f, [&](int64_t t) { return a.di[bh * T + t]; });
  FragC dq[DP / 16];
  for (int n = 0; n < DP / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);
  const int r = lane / 2, half = lane % 2, qi = warp * 16 + r;
  const int64_t t = q0 + qi;
  const bool live = t < T;
  const int64_t kfirst = live ? first_key(a, b, t) : 0;
  const int64_t kend = q0 + kTile < T ? q0 + kTile : T;
  const int64_t kbeg = first_key_tile(a, b, q0, first_s);
  for (int64_t k0 = kbeg; k0 < kend; k0 += kTile) {
    __syncthreads();  // the last key tile is read (and, the first time, Q, dO and the rows are loaded)
    load_tile<DP>(Ks, a.k + b * T * a.kv_stride + g * a.D, a.kv_stride, k0, T, a.D, t16);
    load_tile<DP>(Vs, a.v + b * T * a.kv_stride + g * a.D, a.kv_stride, k0, T, a.D, t16);
    __syncthreads();
    product_abt<E, DP>(Sw, Qs + warp * 16 * L::kLd, Ks);
    product_abt<E, DP>(dPw, dOs + warp * 16 * L::kLd, Vs);
    __syncwarp();
    for (int c = 0; c < 32; ++c) {
      const int kj = half * 32 + c;
      const int64_t j = k0 + kj;
      float ds = 0.0f;
      if (live && j <= t && j >= kfirst) ds = p_and_ds(Sw[r * kLdS + kj], dPw[r * kLdS + kj], lse_s[qi], di_s[qi], a).ds;
      dSw[r * kLdP + kj] = float_to_16(ds, t16);
    }
    __syncwarp();
    product_accumulate<E, DP>(dq, dSw, Ks);
  }
  // The warp's S and dP rows (adjacent) stage its result.
  write_rows<DP>(a.dq + b * T * a.q_stride + h * a.D, a.q_stride, q0 + warp * 16, T, a.D, dq, a.scale, Sw);
}

// ---- launches --------------------------------------------------------------------------------

void check_args(const char* fn, const FlashArgs& a, DType compute) {
  if (compute != DType::kBF16 && compute != DType::kF16)
    throw Error(std::string(fn) + ": the fused attention runs bf16 or fp16 compute, not " +
                std::string(dtype_name(compute)));
  if (a.B < 0 || a.T < 0 || a.H <= 0 || a.Hkv <= 0 || a.H % a.Hkv != 0 || a.D <= 0 || a.D > kMaxHeadDim)
    throw Error(std::string(fn) + ": bad shape B=" + std::to_string(a.B) + " T=" + std::to_string(a.T) +
                " H=" + std::to_string(a.H) + " Hkv=" + std::to_string(a.Hkv) + " D=" + std::to_string(a.D) +
                " (need H a multiple of Hkv and 0 < D <= " + std::to_string(kMaxHeadDim) + ")");
  if (a.B * a.H > 0x7fffffff || (a.T + kTile - 1) / kTile > 65535)
    throw Error(std::string(fn) + ": B*H or T too large for one grid");
}

template <class Kernel>
void launch(const char* name, Kernel* flash_kernel, dim3 grid, size_t smem, cudaStream_t stream, const FlashArgs& a,
            DType t16) {
  ZINC_CUDA_CHECK(cudaFuncSetAttribute(flash_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                  (std::string("cudaFuncSetAttribute(") + name + ")").c_str());
  flash_kernel<<<grid, kFlashThreads, smem, stream>>>(a, t16);
  check_launch(name);
}

template <int DP>
void forward_dp(const FlashArgs& a, DType t, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.B * a.H), static_cast<unsigned>((a.T + kTile - 1) / kTile));
  if (t == DType::kBF16)
    launch("flash_forward_kernel", flash_forward_kernel<__nv_bfloat16, DP>, grid, Smem<DP>::kFwd, stream, a, t);
  else
    launch("flash_forward_kernel", flash_forward_kernel<__half, DP>, grid, Smem<DP>::kFwd, stream, a, t);
}

template <int DP>
void backward_dp(const FlashArgs& a, DType t, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>((a.T + kTile - 1) / kTile);
  const dim3 kv_grid(static_cast<unsigned>(a.B * a.Hkv), tiles), q_grid(static_cast<unsigned>(a.B * a.H), tiles);
  if (t == DType::kBF16) {
    launch("flash_dkdv_kernel", flash_dkdv_kernel<__nv_bfloat16, DP>, kv_grid, Smem<DP>::kBwd, stream, a, t);
    launch("flash_dq_kernel", flash_dq_kernel<__nv_bfloat16, DP>, q_grid, Smem<DP>::kBwd, stream, a, t);
  } else {
    launch("flash_dkdv_kernel", flash_dkdv_kernel<__half, DP>, kv_grid, Smem<DP>::kBwd, stream, a, t);
    launch("flash_dq_kernel", flash_dq_kernel<__half, DP>, q_grid, Smem<DP>::kBwd, stream, a, t);
  }
}

// The padded head dim: D rounded up to a multiple of 32.
int padded(int64_t D) { return static_cast<int>((D + 31) / 32 * 32); }

}  // namespace

bool flash_attention_applies(int64_t head_dim, DType compute) {
  return (compute == DType::kBF16 || compute == DType::kF16) && head_dim > 0 && head_dim <= kMaxHeadDim;
}

void flash_attention_forward(const FlashArgs& a, DType compute, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kAttention, stream);
  check_args("cuda::flash_attention_forward", a, compute);
  if (a.B == 0 || a.T == 0) return;
  switch (padded(a.D)) {
    case 32: forward_dp<32>(a, compute, stream); break;
    case 64: forward_dp<64>(a, compute, stream); break;
    case 96: forward_dp<96>(a, compute, stream); break;
    default: forward_dp<128>(a, compute, stream); break;
  }
}

void flash_attention_backward(const FlashArgs& a, DType compute, cudaStream_t stream) {
  GpuProfileScope profile_scope(Op::kAttention, stream);
  check_args("cuda::flash_attention_backward", a, compute);
  if (a.B == 0 || a.T == 0) return;
  const int64_t rows = a.B * a.T * a.H;
  flash_row_dot_kernel<<<detail::blocks_for(rows * 32, kFlashThreads), kFlashThreads, 0, stream>>>(a, compute);
  check_launch("flash_row_dot_kernel");
  switch (padded(a.D)) {
    case 32: backward_dp<32>(a, compute, stream); break;
    case 64: backward_dp<64>(a, compute, stream); break;
    case 96: backward_dp<96>(a, compute, stream); break;
    default: backward_dp<128>(a, compute, stream); break;
  }
}

}  // namespace zinc::kernels::cuda
