// Causal multi-head self-attention on top of the batched matmul.
//
// Note [attention layout and memory]
// q, k, v are permuted from qkv(B,T,3C) into head-major (B*H, T, hs) scratch
// so that every product is one batched oneDNN matmul over B*H:
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
// causal mask, as transformers builds from packed position_ids). The
// scores are still computed in full; the softmax runs over lo..t and
// writes 0 elsewhere, and backward's row dot and dS cover lo..t alone, so
// nothing crosses a boundary in either direction.
// Memory: the only per-layer state is P (B,H,T,T) fp32, the softmax output
// that backward needs (12.6 MB for B=8, H=6, T=256). q, k, v are re-permuted
// from qkv in backward rather than saved. Everything else (permuted operands,
// dP, dS, per-head outputs) lives in thread-local grow-only scratch shared by
// all layers. Operands are written directly as the matmuls read them (bf16
// for bf16 compute; fp16-exact fp32 values for fp16 compute, which multiplies
// in fp32), so matmul never has to convert them.
#include <algorithm>
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

enum Slot { kQ, kK, kV, kDO, kPc, kDS, kDP, kY, kDQ, kDK, kDV, kNumSlots };

void* scratch(Slot slot, size_t bytes) {
  thread_local AlignedBuffer bufs[kNumSlots];
  if (bufs[slot].bytes() < bytes) bufs[slot] = AlignedBuffer(round_up(bytes, 4096));
  return bufs[slot].data();
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
  if (!s.positions) return 0;
  const int64_t t = static_cast<int64_t>(r) % s.T, b = static_cast<int64_t>(r) / s.T / s.H;
  return t - s.positions[b * s.T + t];
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

// The inverse: srcs[p] (B*H, T, hs) fp32 into columns p*C + h*hs .. of the
// (B,T) rows of dst (row stride `stride` floats), for p < nparts.
void permute_out(float* dst, int64_t stride, const float* const* srcs, int nparts, AttentionShape s) {
  const int64_t hs = s.C / s.H;
  parallel_for(static_cast<size_t>(s.B * s.T), 16, [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const int64_t b = static_cast<int64_t>(r) / s.T, t = static_cast<int64_t>(r) % s.T;
      for (int part = 0; part < nparts; ++part) {
        float* row = dst + static_cast<int64_t>(r) * stride + part * s.C;
        for (int64_t h = 0; h < s.H; ++h) {
          const float* __restrict x = srcs[part] + ((b * s.H + h) * s.T + t) * hs;
          float* __restrict d = row + h * hs;
          for (int64_t i = 0; i < hs; ++i) d[i] = x[i];
        }
      }
    }
  });
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

// sum_j p[j] dp[j] over the causal part of a row (for dS = P (dP - dot)).
ZINC_ALWAYS_INLINE float softmax_row_dot_body(const float* __restrict p, const float* __restrict dp, int64_t n) {
  return detail::lane_sum<float>(n, [&](int64_t j) { return p[j] * dp[j]; });
}
ZINC_ISA_VARIANTS(float, softmax_row_dot, (const float* __restrict p, const float* __restrict dp, int64_t n), (p, dp, n))

}  // namespace

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
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  MatmulDesc sd{.batch = BH, .M = T, .N = T, .K = hs, .trans_b = true, .alpha = scale,
                .compute = compute};
  matmul(sd, operand(q, compute), operand(k, compute), P);
  // Softmax in place; with bf16 compute also write the bf16 copy for P V.
  void* pc = compute == DType::kF32 ? static_cast<void*>(P) : scratch(kPc, n_att * esz);
  parallel_for(static_cast<size_t>(BH * T), 16, [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const int64_t t = static_cast<int64_t>(r) % T, k0 = first_key(s, r);
      float* row = P + r * T;
      for (int64_t j = 0; j < k0; ++j) row[j] = 0.0f;
      softmax_row_causal(row + k0, t + 1 - k0, T - k0);
      if (compute != DType::kF32) store_operand_row(pc, r, row, T, compute);
    }
  });
  float* y = static_cast<float*>(scratch(kY, n_head * sizeof(float)));
  MatmulDesc yd{.batch = BH, .M = T, .N = hs, .K = T, .compute = compute};
  matmul(yd, operand(pc, compute), operand(v, compute), y);
  const float* parts[] = {y};
  permute_out(out, s.C, parts, 1, s);
}

void attention_backward(AttentionWorkspace* ws, float* dqkv, const float* dout, const float* qkv,
                        AttentionShape s, DType compute) {
  ProfileScope profile_scope(Op::kAttention);
  check_shape("attention_backward", s);
  if (!ws->has_forward || ws->shape.B != s.B || ws->shape.T != s.T || ws->shape.C != s.C ||
      ws->shape.H != s.H) {
    throw Error("attention_backward: the workspace holds no forward pass of this shape "
                "(call attention_forward with the same workspace first)");
  }
  if (s.B == 0 || s.T == 0) return;
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  const size_t n_head = static_cast<size_t>(BH * T * hs);
  const size_t n_att = static_cast<size_t>(BH * T * T);
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
  float* dP = static_cast<float*>(scratch(kDP, n_att * sizeof(float)));
  matmul({.batch = BH, .M = T, .N = T, .K = hs, .trans_b = true, .compute = compute},
         operand(dO, compute), operand(v, compute), dP);
  // dS overwrites dP in place for fp32 compute; with 16-bit compute each
  // row of it and of P is written as the compute dtype's operand (for dQ,
  // dK and dV).
  const bool f32 = compute == DType::kF32;
  void* ds = f32 ? static_cast<void*>(dP) : scratch(kDS, n_att * esz);
  const void* pc = f32 ? static_cast<const void*>(P) : scratch(kPc, n_att * esz);
  parallel_for(static_cast<size_t>(BH * T), 16, [&](size_t lo, size_t hi) {
    thread_local std::vector<float> row_buf;
    if (!f32 && row_buf.size() < static_cast<size_t>(T)) row_buf.resize(static_cast<size_t>(T));
    for (size_t r = lo; r < hi; ++r) {
      const int64_t nv = static_cast<int64_t>(r) % T + 1, k0 = first_key(s, r);
      const float* p = P + r * T;
      float* dp = dP + r * T;
      const float dot = softmax_row_dot(p + k0, dp + k0, nv - k0);
      // The fp32 row of dS: over dP itself for fp32 compute, else in a
      // small buffer that stays in cache until its conversion.
      float* d = f32 ? dp : row_buf.data();
      for (int64_t j = 0; j < k0; ++j) d[j] = 0.0f;
      for (int64_t j = k0; j < nv; ++j) d[j] = p[j] * (dp[j] - dot);
      for (int64_t j = nv; j < T; ++j) d[j] = 0.0f;
      if (!f32) {
        store_operand_row(ds, r, d, T, compute);
        store_operand_row(const_cast<void*>(pc), r, p, T, compute);
      }
    }
  });
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* dv = static_cast<float*>(scratch(kDV, n_head * sizeof(float)));
  float* dq = static_cast<float*>(scratch(kDQ, n_head * sizeof(float)));
  float* dk = static_cast<float*>(scratch(kDK, n_head * sizeof(float)));
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .trans_a = true, .compute = compute},
         operand(pc, compute), operand(dO, compute), dv);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .alpha = scale, .compute = compute},
         operand(ds, compute), operand(k, compute), dq);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .trans_a = true, .alpha = scale, .compute = compute},
         operand(ds, compute), operand(q, compute), dk);
  const float* parts[] = {dq, dk, dv};
  permute_out(dqkv, 3 * s.C, parts, 3, s);
}

}  // namespace zinc::kernels

namespace zinc::kernels {

int64_t attention_workspace_bytes(AttentionShape s) {
  return s.B * s.H * s.T * s.T * static_cast<int64_t>(sizeof(float));
}

// The slots and matmuls of attention_forward and attention_backward above,
// by shape.
void ScratchTally::attention(AttentionShape s, DType compute) {
  if (s.B == 0 || s.T == 0) return;
  const int64_t hs = s.C / s.H, BH = s.B * s.H, T = s.T;
  const size_t n_head = static_cast<size_t>(BH * T * hs), n_att = static_cast<size_t>(BH * T * T);
  const size_t esz = operand_bytes(compute);
  const bool f32 = compute == DType::kF32;
  auto grow = [this](Slot slot, size_t bytes) {
    attention_[slot] = std::max(attention_[slot], static_cast<int64_t>(round_up(bytes, 4096)));
  };
  for (Slot sl : {kQ, kK, kV, kDO}) grow(sl, n_head * esz);
  grow(kY, n_head * sizeof(float));
  grow(kDP, n_att * sizeof(float));
  if (!f32) {
    grow(kPc, n_att * esz);
    grow(kDS, n_att * esz);
  }
  for (Slot sl : {kDQ, kDK, kDV}) grow(sl, n_head * sizeof(float));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const DType dt = compute;
  // P's 16-bit copy (pc) and dS are compute dtype operands (fp16: fp16-exact
  // fp32); with fp32 compute pc is P.
  const CView o = operand(nullptr, compute);
  const DType od = o.dtype;
  const bool ex = o.bf16_exact;
  matmul({.batch = BH, .M = T, .N = T, .K = hs, .trans_b = true, .alpha = scale, .compute = dt}, od, ex, od, ex);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .compute = dt}, od, ex, od, ex);
  matmul({.batch = BH, .M = T, .N = T, .K = hs, .trans_b = true, .compute = dt}, od, ex, od, ex);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .trans_a = true, .compute = dt}, od, ex, od, ex);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .alpha = scale, .compute = dt}, od, ex, od, ex);
  matmul({.batch = BH, .M = T, .N = hs, .K = T, .trans_a = true, .alpha = scale, .compute = dt}, od, ex, od, ex);
}

}  // namespace zinc::kernels
