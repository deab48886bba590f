// Causal multi-head self-attention on top of the batched matmul.
//
// Note [attention layout and memory]
// q, k, v are permuted from qkv(B,T,3C) into head-major (B*H, T, hs) scratch
// so that every product is a batched oneDNN matmul over a group of heads
// (Note [attention by head groups]):
//   forward   S = scale Q K^T (trans_b), P = causal_softmax(S), Y = P V
//   backward  dP = dO V^T (trans_b), dV = P^T dO (trans_a),
//             dS = P * (dP - rowsum(P * dP)) (zero above the diagonal),
//             dQ = scale dS K, dK = scale dS^T Q (trans_a)
// The full (T,T) score matrices are computed and the upper triangle thrown
// away: at T = 256, hs = 64 a masked brgemm still beats a hand-written
// triangular loop, and it keeps the code to a few calls.
//
// Note [document boundaries]
// With AttentionShape::positions, a row packs several documents and query t
// sees only keys lo..t of its own, lo = t - positions[t] (a block-diagonal
// causal mask, as transformers builds from packed position_ids); with a
// sliding window W, lo is at least t - W + 1 (the W keys up to t). The
// scores are still computed in full; the softmax runs over lo..t and
// writes 0 elsewhere, and backward's row dot and dS cover lo..t alone, so
// nothing crosses a boundary in either direction.
// Memory: the only per-layer state is P (B,H,T,T) fp32, the softmax output
// that backward needs (12.6 MB for B=8, H=6, T=256). q, k, v are re-permuted
// from qkv in backward rather than saved. Everything else lives in
// thread-local grow-only scratch shared by all layers: the permuted operands
// (on the calling thread), and one head group's dP, dS, P copy and outputs
// on each thread that runs groups. Operands are written directly as the
// matmuls read them (bf16 for bf16 compute; fp16-exact fp32 values for fp16
// compute, which multiplies in fp32), so matmul never has to convert them.
//
// Note [soft-capped scores' gradient]
// Gemma 2 caps the scores, y = cap tanh(s / cap), before the softmax, and
// backward needs the cap's derivative 1 - (y / cap)^2. y need not be kept
// nor the raw scores recomputed (a fifth T x T product per head): P holds
// p = exp(y - lse) with the row's log-sum-exp lse, so y = lse + log p, and
// forward keeps only lse, one float per row. log p is exact to a few ulps
// where p matters; where p underflowed to 0 the term p (dp - dot) is 0
// whatever the factor.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/alloc.h"
#include "core/error.h"
#include "core/parallel.h"
#include "kernels/kernels.h"
#include "kernels/profile.h"
#include "kernels/simd_math.h"

namespace zinc::kernels {

class AttentionWorkspace {
 public:
  AlignedBuffer probs;  // (B*H, T, T) fp32 softmax probabilities, zero above the diagonal
  AlignedBuffer lse;    // (B*H*T) fp32 log-sum-exp of each row's capped scores (soft-capping only)
  AttentionShape shape{};
  bool has_forward = false;
};

AttentionWorkspace* attention_workspace_create() { return new AttentionWorkspace(); }
void attention_workspace_destroy(AttentionWorkspace* ws) { delete ws; }

namespace {

// fp16 compute (Note [fp16 compute] in matmul.cpp): operands are kept as fp32
// holding fp16-exact values, so the fp32 matmuls read them without widening.
struct f16x {
  float v;
};
static_assert(sizeof(f16x) == sizeof(float));
// n fp32 values as the compute dtype's operand, on the calling thread with
// the vectorised conversions (the rounding of float_to_bf16 / float_to_f16).
inline void store_row(const float* x, float* d, int64_t n) { std::copy(x, x + n, d); }
inline void store_row(const float* x, bf16* d, int64_t n) {
  convert_f32_to_bf16_serial(x, d, static_cast<size_t>(n));
}
inline void store_row(const float* x, f16x* d, int64_t n) {
  round_to_f16_serial(x, reinterpret_cast<float*>(d), static_cast<size_t>(n));
}

enum Slot { kQ, kK, kV, kDO, kPc, kDS, kDP, kY, kDQ, kDK, kDV, kRow, kNumSlots };
static_assert(kNumSlots == ScratchTally::kAttentionSlots);

void* scratch(Slot slot, size_t bytes) {
  thread_local AlignedBuffer bufs[kNumSlots];
  return grow_scratch(bufs[slot], bytes);
}

template <class Fn>
void dispatch_compute(DType t, Fn&& fn) {
  if (t == DType::kF32) {
    fn(float{});
  } else if (t == DType::kBF16) {
    fn(bf16{});
  } else {
    fn(f16x{});
  }
}

// Bytes of one operand element in scratch, and the view matmul gets of it.
size_t operand_bytes(DType compute) { return compute == DType::kF16 ? sizeof(float) : dtype_bytes(compute); }
CView operand(const void* p, DType compute) {
  return compute == DType::kF16 ? CView{p, DType::kF32, true} : CView{p, compute};
}
// Row r of P or dS (the n fp32 values at x) written as the 16-bit compute
// dtype's operand at base + r * n: fp16-exact fp32 for fp16, the 16 bits
// for bf16.
inline void store_operand_row(void* base, size_t r, const float* x, int64_t n, DType compute) {
  const size_t off = r * static_cast<size_t>(n);
  if (compute == DType::kF16)
    store_row(x, reinterpret_cast<f16x*>(static_cast<float*>(base) + off), n);
  else
    store_row(x, static_cast<bf16*>(base) + off, n);
}

void check_shape(const char* fn, AttentionShape s) {
  if (s.B < 0 || s.T < 0 || s.C <= 0 || s.H <= 0 || s.C % s.H != 0) {
    throw Error(std::string(fn) + ": bad shape B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                " C=" + std::to_string(s.C) + " H=" + std::to_string(s.H) +
                " (need C > 0, H > 0 and C divisible by H)");
  }
  if (s.kv() != s.H)
    throw Error(std::string(fn) + ": " + std::to_string(s.kv_heads) + " kv heads for " + std::to_string(s.H) +
                " query heads: the CPU attention takes them repeated (gqa_expand)");
  if (!s.positions) return;
  for (int64_t r = 0; r < s.B * s.T; ++r) {
    const int64_t t = r % s.T;
    if (s.positions[r] < 0 || s.positions[r] > t)
      throw Error(std::string(fn) + ": position " + std::to_string(s.positions[r]) + " of row " +
                  std::to_string(r / s.T) + ", token " + std::to_string(t) + " is outside [0, " + std::to_string(t) +
                  "] (a document cannot begin before its row)");
  }
}

// The first key query row r of the (B*H, T) score rows may see.
inline int64_t first_key(AttentionShape s, size_t r) {
  const int64_t t = static_cast<int64_t>(r) % s.T, b = static_cast<int64_t>(r) / s.T / s.H;
  const int64_t k0 = s.positions ? t - s.positions[b * s.T + t] : 0;
  return s.window > 0 ? std::max(k0, t - s.window + 1) : k0;
}

// Up to four head-major copies in one parallel region (each region is a
// barrier, and on a busy 2-core host every barrier costs). Part p reads
// columns col0[p] + h*hs .. of the (B,T) rows of src[p] (row stride
// stride[p] floats) and writes dst[p] (B*H, T, hs).
template <class To>
struct PermuteIn {
  int n = 0;
  To* dst[4];
  const float* src[4];
  int64_t stride[4], col0[4];
  void add(To* d, const float* s, int64_t st, int64_t c0) {
    dst[n] = d, src[n] = s, stride[n] = st, col0[n] = c0;
    ++n;
  }
};

template <class To>
void permute_in(const PermuteIn<To>& p, AttentionShape s) {
  const int64_t hs = s.C / s.H;
  parallel_for(static_cast<size_t>(s.B * s.T), 16, [&](size_t lo, size_t hi) {
    // A row's C values are converted in one call (into a small buffer that
    // stays in cache), then copied out head by head: a conversion call per
    // head of 64 values costs more in calls than in conversion.
    thread_local std::vector<To> row_buf;
    if (row_buf.size() < static_cast<size_t>(s.C)) row_buf.resize(static_cast<size_t>(s.C));
    To* conv = row_buf.data();
    for (int part = 0; part < p.n; ++part)
      for (size_t r = lo; r < hi; ++r) {
        const int64_t b = static_cast<int64_t>(r) / s.T, t = static_cast<int64_t>(r) % s.T;
        const float* row = p.src[part] + static_cast<int64_t>(r) * p.stride[part] + p.col0[part];
        store_row(row, conv, s.C);
        for (int64_t h = 0; h < s.H; ++h)
          std::memcpy(p.dst[part] + ((b * s.H + h) * s.T + t) * hs, conv + h * hs,
                      static_cast<size_t>(hs) * sizeof(To));
      }
  });
}

// The inverse for the heads [h0, h0 + nh): src (nh, T, hs) fp32 into
// columns h*hs .. of the (B,T) rows of dst (row stride `stride` floats),
// h the head's index within its batch row.
void heads_out(float* dst, int64_t stride, const float* src, int64_t h0, int64_t nh, AttentionShape s) {
  const int64_t hs = s.C / s.H;
  for (int64_t j = 0; j < nh; ++j) {
    const int64_t b = (h0 + j) / s.H, h = (h0 + j) % s.H;
    for (int64_t t = 0; t < s.T; ++t)
      std::memcpy(dst + (b * s.T + t) * stride + h * hs, src + (j * s.T + t) * hs,
                  static_cast<size_t>(hs) * sizeof(float));
  }
}

// Causal softmax of one row (query t): p[0..t] = softmax(p[0..t]), p[t+1..] = 0.
ZINC_ALWAYS_INLINE void softmax_row_causal_body(float* __restrict p, int64_t n_valid, int64_t n) {
  const float mx = detail::max_of(p, n_valid);
  for (int64_t j = 0; j < n_valid; ++j) p[j] = detail::exp_f(p[j] - mx);
  const float inv = 1.0f / detail::lane_sum<float>(n_valid, [&](int64_t j) { return p[j]; });
  for (int64_t j = 0; j < n_valid; ++j) p[j] *= inv;
  for (int64_t j = n_valid; j < n; ++j) p[j] = 0.0f;
}
ZINC_ISA_VARIANTS(void, softmax_row_causal, (float* __restrict p, int64_t n_valid, int64_t n), (p, n_valid, n))

// The same, returning the row's log-sum-exp: log sum_j exp(p_j) = mx + log(sum).
ZINC_ALWAYS_INLINE float softmax_row_causal_lse_body(float* __restrict p, int64_t n_valid, int64_t n) {
  const float mx = detail::max_of(p, n_valid);
  for (int64_t j = 0; j < n_valid; ++j) p[j] = detail::exp_f(p[j] - mx);
  const float sum = detail::lane_sum<float>(n_valid, [&](int64_t j) { return p[j]; });
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n_valid; ++j) p[j] *= inv;
  for (int64_t j = n_valid; j < n; ++j) p[j] = 0.0f;
  return mx + std::log(sum);
}
ZINC_ISA_VARIANTS(float, softmax_row_causal_lse, (float* __restrict p, int64_t n_valid, int64_t n), (p, n_valid, n))

// Soft-capping of one row's scores in place: s = cap tanh(s / cap).
ZINC_ALWAYS_INLINE void softcap_row_body(float* __restrict p, float cap, int64_t n) {
  const float inv_cap = 1.0f / cap;
  for (int64_t j = 0; j < n; ++j) p[j] = math::softcap(p[j], cap, inv_cap);
}
ZINC_ISA_VARIANTS(void, softcap_row, (float* __restrict p, float cap, int64_t n), (p, cap, n))

// Natural log of x > 0 (normal), with plain arithmetic so that the row
// loops vectorise: x = 2^e m, m in [sqrt(1/2), sqrt(2)), log m = 2
// atanh(f), f = (m - 1) / (m + 1), |f| <= 0.172, by its series to f^9
// (the next term is 3e-10 relative); ln 2 split into an exact head and a tail.
ZINC_ALWAYS_INLINE float log_pos(float x) {
  const uint32_t i = std::bit_cast<uint32_t>(x);
  float e = static_cast<float>(static_cast<int32_t>(i >> 23) - 127);
  float m = std::bit_cast<float>((i & 0x7fffffu) | 0x3f800000u);
  const bool hi = m > 1.41421356f;
  m = hi ? 0.5f * m : m;
  e = hi ? e + 1.0f : e;
  const float f = (m - 1.0f) / (m + 1.0f), f2 = f * f;
  float q = 1.0f / 9.0f;
  q = q * f2 + 1.0f / 7.0f;
  q = q * f2 + 1.0f / 5.0f;
  q = q * f2 + 1.0f / 3.0f;
  q = q * f2 + 1.0f;
  return e * 0.693359375f + (2.0f * f * q - e * 2.12194440e-4f);
}

// dS of one row with soft-capped scores: p (dp - dot) (1 - (y / cap)^2),
// y = cap tanh(s / cap) the capped score, recovered from the probability
// as y = lse + log p (Note [soft-capped scores' gradient]). A probability
// that underflowed to 0 is taken as the smallest normal one: its term is 0
// whatever the factor.
ZINC_ALWAYS_INLINE void softcap_ds_row_body(float* __restrict d, const float* __restrict p,
                                            const float* __restrict dp, float dot, float lse, float inv_cap,
                                            int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j] < 1.17549435e-38f ? 1.17549435e-38f : p[j];
    const float t = (lse + log_pos(pj)) * inv_cap;
    d[j] = p[j] * (dp[j] - dot) * (1.0f - t * t);
  }
}
ZINC_ISA_VARIANTS(void, softcap_ds_row, (float* __restrict d, const float* __restrict p, const float* __restrict dp, float dot, float lse, float inv_cap, int64_t n), (d, p, dp, dot, lse, inv_cap, n))

// sum_j p[j] dp[j] over the causal part of a row (for dS = P (dP - dot)).
ZINC_ALWAYS_INLINE float softmax_row_dot_body(const float* __restrict p, const float* __restrict dp, int64_t n) {
  return detail::lane_sum<float>(n, [&](int64_t j) { return p[j] * dp[j]; });
}
ZINC_ISA_VARIANTS(float, softmax_row_dot, (const float* __restrict p, const float* __restrict dp, int64_t n), (p, dp, n))

// Note [attention by head groups]
// The (T,T) products of one head are small (256 KB of fp32 scores at T =
// 256) and each is used by the very next pass: the softmax reads the
// scores the Q K^T product wrote, P V reads the probabilities, and backward
// chains dP = dO V^T, dS and three products over dS and P in the same way.
// Run over all B*H heads at once, every one of those intermediates (12.6 MB
// for the reference GPT) goes out to memory and comes back. So the heads are
// taken in groups small enough that a group's intermediates stay in a
// core's L2 cache: each thread runs whole groups, its matmuls single-threaded
// (oneDNN runs a primitive called inside a parallel region on the calling
// thread), and copies the group's outputs into their columns of out or dqkv
// while they are still in cache. Only P itself, which backward needs, goes
// out to memory, and the scratch the whole-batch form kept for dP, dS, the
// copy of P and the head outputs (38 MB for the reference GPT) shrinks to
// one group's per thread (1.5 MB). A matmul over a group computes each head
// exactly as the matmul over all heads does (the same kernel; heads are
// independent and nothing is split along K), so the results are bit for bit
// those of one call over all heads at any thread count.
constexpr size_t kGroupScoreBytes = size_t{512} << 10;
std::atomic<int64_t> g_heads_per_group{0};  // set_attention_heads_per_group_for_testing

int64_t heads_per_group(AttentionShape s) {
  const int64_t BH = s.B * s.H, nt = num_threads();
  const int64_t by_cache = std::max<int64_t>(1, static_cast<int64_t>(kGroupScoreBytes / (sizeof(float) * s.T * s.T)));
  const int64_t forced = g_heads_per_group.load(std::memory_order_relaxed);
  if (forced > 0) return std::min(forced, std::max<int64_t>(BH, 1));
  // At least one group per thread.
  return std::max<int64_t>(1, std::min(by_cache, (BH + nt - 1) / nt));
}

// fn(h0, nh) for the groups of heads [h0, h0 + nh), split across the threads
// in fixed contiguous shares. Not handed out dynamically: then a thread
// might run no group in a pass, and which thread-local buffers exist would
// depend on timing, against the estimate (ScratchTally::attention counts one
// group's buffers on every thread; MemoryEstimate.* caught the difference).
template <class Fn>
void for_head_groups(AttentionShape s, Fn&& fn) {
  const int64_t BH = s.B * s.H, g = heads_per_group(s);
  const int64_t n_groups = (BH + g - 1) / g;
  parallel_for(static_cast<size_t>(n_groups), 1, [&](size_t lo, size_t hi) {
    for (size_t gi = lo; gi < hi; ++gi) {
      const int64_t h0 = static_cast<int64_t>(gi) * g;
      fn(h0, std::min(g, BH - h0));
    }
  });
}

}  // namespace

void set_attention_heads_per_group_for_testing(int64_t g) { g_heads_per_group.store(std::max<int64_t>(g, 0)); }

void attention_forward(AttentionWorkspace* ws, float* out, const float* qkv, AttentionShape s,
                       DType compute) {
  ProfileScope profile_scope(Op::kAttention);
  check_shape("attention_forward", s);
  ws->shape = s;
  ws->has_forward = true;
  if (s.B == 0 || s.T == 0) return;
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  const size_t n_head = static_cast<size_t>(BH * T * hs);
  const size_t n_att = static_cast<size_t>(BH * T * T);
  if (ws->probs.bytes() < n_att * sizeof(float)) ws->probs = AlignedBuffer(n_att * sizeof(float));
  float* P = ws->probs.as<float>();
  float* lse = nullptr;
  if (s.softcap > 0.0f) {
    const size_t n_rows = static_cast<size_t>(BH * T);
    if (ws->lse.bytes() < n_rows * sizeof(float)) ws->lse = AlignedBuffer(n_rows * sizeof(float));
    lse = ws->lse.as<float>();
  }
  const size_t esz = operand_bytes(compute);
  void* q = scratch(kQ, n_head * esz);
  void* k = scratch(kK, n_head * esz);
  void* v = scratch(kV, n_head * esz);
  dispatch_compute(compute, [&](auto tag) {
    using E = decltype(tag);
    PermuteIn<E> p;
    p.add(static_cast<E*>(q), qkv, 3 * s.C, 0);
    p.add(static_cast<E*>(k), qkv, 3 * s.C, s.C);
    p.add(static_cast<E*>(v), qkv, 3 * s.C, 2 * s.C);
    permute_in(p, s);
  });
  const float scale = s.score_scale();
  const bool f32 = compute == DType::kF32;
  // Note [attention by head groups]: each thread takes whole groups of
  // heads and runs their matmuls on its own.
  for_head_groups(s, [&](int64_t h0, int64_t nh) {
    float* Pg = P + h0 * T * T;
    const size_t off = static_cast<size_t>(h0 * T * hs) * esz;
    matmul({.batch = nh, .M = T, .N = T, .K = hs, .trans_b = true, .alpha = scale, .compute = compute},
           operand(static_cast<char*>(q) + off, compute), operand(static_cast<char*>(k) + off, compute), Pg);
    // Softmax in place; with 16-bit compute also the operand copy for P V.
    void* pc = f32 ? static_cast<void*>(Pg) : scratch(kPc, static_cast<size_t>(nh * T * T) * esz);
    float* y = static_cast<float*>(scratch(kY, static_cast<size_t>(nh * T * hs) * sizeof(float)));
    for (int64_t i = 0; i < nh * T; ++i) {
      const size_t r = static_cast<size_t>(h0 * T + i);
      const int64_t t = i % T, k0 = first_key(s, r);
      float* row = Pg + i * T;
      for (int64_t j = 0; j < k0; ++j) row[j] = 0.0f;
      if (s.softcap > 0.0f) {
        softcap_row(row + k0, s.softcap, t + 1 - k0);
        lse[r] = softmax_row_causal_lse(row + k0, t + 1 - k0, T - k0);
      } else {
        softmax_row_causal(row + k0, t + 1 - k0, T - k0);
      }
      if (!f32) store_operand_row(pc, static_cast<size_t>(i), row, T, compute);
    }
    matmul({.batch = nh, .M = T, .N = hs, .K = T, .compute = compute}, operand(pc, compute),
           operand(static_cast<char*>(v) + off, compute), y);
    heads_out(out, s.C, y, h0, nh, s);
  });
}

void attention_backward(AttentionWorkspace* ws, float* dqkv, const float* dout, const float* qkv,
                        AttentionShape s, DType compute) {
  ProfileScope profile_scope(Op::kAttention);
  check_shape("attention_backward", s);
  if (!ws->has_forward || ws->shape.B != s.B || ws->shape.T != s.T || ws->shape.C != s.C ||
      ws->shape.H != s.H || ws->shape.softcap != s.softcap) {
    throw Error("attention_backward: the workspace holds no forward pass of this shape "
                "(call attention_forward with the same workspace first)");
  }
  if (s.B == 0 || s.T == 0) return;
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  const size_t n_head = static_cast<size_t>(BH * T * hs);
  const float* P = ws->probs.as<float>();
  const size_t esz = operand_bytes(compute);
  void* q = scratch(kQ, n_head * esz);
  void* k = scratch(kK, n_head * esz);
  void* v = scratch(kV, n_head * esz);
  void* dO = scratch(kDO, n_head * esz);
  dispatch_compute(compute, [&](auto tag) {
    using E = decltype(tag);
    PermuteIn<E> p;
    p.add(static_cast<E*>(q), qkv, 3 * s.C, 0);
    p.add(static_cast<E*>(k), qkv, 3 * s.C, s.C);
    p.add(static_cast<E*>(v), qkv, 3 * s.C, 2 * s.C);
    p.add(static_cast<E*>(dO), dout, s.C, 0);
    permute_in(p, s);
  });
  const float scale = s.score_scale();
  const bool f32 = compute == DType::kF32;
  // Note [attention by head groups].
  for_head_groups(s, [&](int64_t h0, int64_t nh) {
    const size_t n_g = static_cast<size_t>(nh * T * T);
    const size_t off = static_cast<size_t>(h0 * T * hs) * esz;
    auto at = [&](void* base) { return operand(static_cast<char*>(base) + off, compute); };
    float* dP = static_cast<float*>(scratch(kDP, n_g * sizeof(float)));
    matmul({.batch = nh, .M = T, .N = T, .K = hs, .trans_b = true, .compute = compute}, at(dO), at(v), dP);
    // dS overwrites dP in place for fp32 compute; with 16-bit compute each
    // row of it and of P is written as the compute dtype's operand (for dQ,
    // dK and dV), the fp32 row of dS going through a small buffer that
    // stays in cache until its conversion.
    const float* Pg = P + h0 * T * T;
    void* ds = f32 ? static_cast<void*>(dP) : scratch(kDS, n_g * esz);
    void* pc = f32 ? const_cast<float*>(Pg) : scratch(kPc, n_g * esz);
    float* row_buf = f32 ? nullptr : static_cast<float*>(scratch(kRow, static_cast<size_t>(T) * sizeof(float)));
    // Soft-capped scores: each row's log-sum-exp from forward.
    const float* lse = s.softcap > 0.0f ? ws->lse.as<float>() : nullptr;
    const float inv_cap = s.softcap > 0.0f ? 1.0f / s.softcap : 0.0f;
    for (int64_t i = 0; i < nh * T; ++i) {
      const size_t r = static_cast<size_t>(h0 * T + i);
      const int64_t nv = i % T + 1, k0 = first_key(s, r);
      const float* p = Pg + i * T;
      float* dp = dP + i * T;
      const float dot = softmax_row_dot(p + k0, dp + k0, nv - k0);
      float* d = f32 ? dp : row_buf;
      for (int64_t j = 0; j < k0; ++j) d[j] = 0.0f;
      if (lse)
        softcap_ds_row(d + k0, p + k0, dp + k0, dot, lse[r], inv_cap, nv - k0);
      else
        for (int64_t j = k0; j < nv; ++j) d[j] = p[j] * (dp[j] - dot);
      for (int64_t j = nv; j < T; ++j) d[j] = 0.0f;
      if (!f32) {
        store_operand_row(ds, static_cast<size_t>(i), d, T, compute);
        store_operand_row(pc, static_cast<size_t>(i), p, T, compute);
      }
    }
    const size_t n_gh = static_cast<size_t>(nh * T * hs) * sizeof(float);
    float* dv = static_cast<float*>(scratch(kDV, n_gh));
    float* dq = static_cast<float*>(scratch(kDQ, n_gh));
    float* dk = static_cast<float*>(scratch(kDK, n_gh));
    matmul({.batch = nh, .M = T, .N = hs, .K = T, .trans_a = true, .compute = compute}, operand(pc, compute),
           at(dO), dv);
    matmul({.batch = nh, .M = T, .N = hs, .K = T, .alpha = scale, .compute = compute}, operand(ds, compute),
           at(k), dq);
    matmul({.batch = nh, .M = T, .N = hs, .K = T, .trans_a = true, .alpha = scale, .compute = compute},
           operand(ds, compute), at(q), dk);
    heads_out(dqkv, 3 * s.C, dq, h0, nh, s);
    heads_out(dqkv + s.C, 3 * s.C, dk, h0, nh, s);
    heads_out(dqkv + 2 * s.C, 3 * s.C, dv, h0, nh, s);
  });
}

}  // namespace zinc::kernels

namespace zinc::kernels {

int64_t attention_workspace_bytes(AttentionShape s) {
  // Checked: the shape comes from a user's sizes (seq_len, heads, the
  // micro-batch), and a score matrix past 2^63 bytes is refused, not wrapped.
  int64_t bht = 0, scores = 0, bytes = 0;
  if (__builtin_mul_overflow(s.B * s.H, s.T, &bht) || __builtin_mul_overflow(bht, s.T, &scores) ||
      __builtin_add_overflow(scores, s.softcap > 0.0f ? bht : 0, &scores) ||
      __builtin_mul_overflow(scores, static_cast<int64_t>(sizeof(float)), &bytes))
    throw Error("attention: scores of " + std::to_string(s.B) + " x " + std::to_string(s.H) + " heads x " +
                std::to_string(s.T) + " x " + std::to_string(s.T) + " tokens take more bytes than a 64-bit count holds");
  return bytes;
}

// The slots and matmuls of attention_forward and attention_backward above,
// by shape: the calling thread's, and those of every other thread that runs
// head groups (Note [attention by head groups]), each of which keeps its
// own group buffers and oneDNN scratchpad.
void ScratchTally::attention(AttentionShape s, DType compute) {
  if (s.B == 0 || s.T == 0) return;
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  const size_t n_head = static_cast<size_t>(BH * T * hs);
  const size_t esz = operand_bytes(compute);
  const bool f32 = compute == DType::kF32;
  auto grow = [](ScratchTally& t, Slot slot, size_t bytes) {
    t.attention_[slot] = std::max(t.attention_[slot], static_cast<int64_t>(scratch_bytes(bytes)));
  };
  for (Slot sl : {kQ, kK, kV, kDO}) grow(*this, sl, n_head * esz);
  // One group-running thread's buffers and matmuls (the group of most heads;
  // a last, smaller group fits in them).
  const int64_t g = heads_per_group(s), n_groups = (BH + g - 1) / g;
  ScratchTally w;
  const size_t n_g = static_cast<size_t>(g * T * T);
  grow(w, kDP, n_g * sizeof(float));
  for (Slot sl : {kY, kDQ, kDK, kDV}) grow(w, sl, static_cast<size_t>(g * T * hs) * sizeof(float));
  if (!f32) {
    grow(w, kPc, n_g * esz);
    grow(w, kDS, n_g * esz);
    grow(w, kRow, static_cast<size_t>(T) * sizeof(float));
  }
  const float scale = s.score_scale();
  const DType dt = compute;
  // P's 16-bit copy (pc) and dS are compute dtype operands (fp16: fp16-exact
  // fp32); with fp32 compute pc is P.
  const CView o = operand(nullptr, compute);
  const DType od = o.dtype;
  const bool ex = o.bf16_exact;
  for (int64_t nh : {g, BH - (n_groups - 1) * g}) {
    w.matmul({.batch = nh, .M = T, .N = T, .K = hs, .trans_b = true, .alpha = scale, .compute = dt}, od, ex, od, ex);
    w.matmul({.batch = nh, .M = T, .N = hs, .K = T, .compute = dt}, od, ex, od, ex);
    w.matmul({.batch = nh, .M = T, .N = T, .K = hs, .trans_b = true, .compute = dt}, od, ex, od, ex);
    w.matmul({.batch = nh, .M = T, .N = hs, .K = T, .trans_a = true, .compute = dt}, od, ex, od, ex);
    w.matmul({.batch = nh, .M = T, .N = hs, .K = T, .alpha = scale, .compute = dt}, od, ex, od, ex);
    w.matmul({.batch = nh, .M = T, .N = hs, .K = T, .trans_a = true, .alpha = scale, .compute = dt}, od, ex, od, ex);
  }
  // The calling thread's group slots are its own attention_ slots; its
  // matmul scratchpad is the slot every matmul on it shares.
  for (int sl = 0; sl < kNumSlots; ++sl) attention_[sl] = std::max(attention_[sl], w.attention_[sl]);
  for (int sl = 0; sl < 4; ++sl) matmul_[sl] = std::max(matmul_[sl], w.matmul_[sl]);
  const int64_t group_threads = std::min<int64_t>(num_threads(), n_groups);
  other_threads_ = std::max(other_threads_, (group_threads - 1) * w.bytes());
}

}  // namespace zinc::kernels
