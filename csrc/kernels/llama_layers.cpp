// Llama-family layer kernels: RMSNorm, the SiLU-gated MLP activation, rotary
// position embeddings and the grouped-query head mapping. Threading and
// vectorisation as in layers.cpp: rows split over threads, parameter
// gradients summed in Note [column sums]'s order (in the rows' own pass,
// Note [column sums by row chunks] in layer_util.h), the
// compute loops written once and compiled per ISA (Note [kernel
// vectorisation] in simd_math.h), so every result is bit-identical across
// thread counts and ISA levels. The per-element formulas are kernels/math.h's.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/kernels.h"
#include "kernels/layer_util.h"
#include "kernels/profile.h"
#include "kernels/simd_math.h"

namespace zinc::kernels {
namespace {

using detail::param_f32;
using detail::row_grain;
using detail::rows_with_column_sums;

// ---- RMSNorm rows -----------------------------------------------------------------

ZINC_ALWAYS_INLINE void rmsnorm_row_forward_body(float* __restrict out, float* rstd_out, const float* __restrict x,
                                                 const float* __restrict w, int64_t C, float eps) {
  const float sq = detail::lane_sum<float>(C, [&](int64_t c) { return x[c] * x[c]; });
  const float rstd = math::rmsnorm_rstd(sq, C, eps);
  for (int64_t c = 0; c < C; ++c) out[c] = math::rmsnorm_out(x[c], rstd, w[c]);
  *rstd_out = rstd;
}
ZINC_ISA_VARIANTS(void, rmsnorm_row_forward, (float* __restrict out, float* rstd_out, const float* __restrict x, const float* __restrict w, int64_t C, float eps), (out, rstd_out, x, w, C, eps))

ZINC_ALWAYS_INLINE void rmsnorm_row_backward_body(float* __restrict dx, const float* __restrict dout,
                                                  const float* __restrict x, const float* __restrict w, float rstd,
                                                  int64_t C) {
  const float mgx =
      detail::lane_sum<float>(C, [&](int64_t c) { return dout[c] * w[c] * (x[c] * rstd); }) / static_cast<float>(C);
  for (int64_t c = 0; c < C; ++c) dx[c] += math::rmsnorm_dx(dout[c], w[c], x[c] * rstd, rstd, mgx);
}
ZINC_ISA_VARIANTS(void, rmsnorm_row_backward, (float* __restrict dx, const float* __restrict dout, const float* __restrict x, const float* __restrict w, float rstd, int64_t C), (dx, dout, x, w, rstd, C))

// RMSNorm weight gradient of one row: aw += dout xhat (double).
ZINC_ALWAYS_INLINE void rmsnorm_dw_row_body(double* __restrict aw, const float* __restrict g,
                                            const float* __restrict x, float r, int64_t n) {
  for (int64_t j = 0; j < n; ++j) aw[j] += g[j] * (x[j] * r);
}
ZINC_ISA_VARIANTS(void, rmsnorm_dw_row, (double* __restrict aw, const float* __restrict g, const float* __restrict x, float r, int64_t n), (aw, g, x, r, n))

// ---- gated MLP activations: SwiGLU and GeGLU --------------------------------------------
// One row's loops, written once over the activation (A::out, A::dgate,
// A::dup: math.h's swiglu* or geglu*), compiled per ISA for each.

struct SiluGated {
  static float out(float g, float u) { return math::swiglu(g, u); }
  static float dgate(float d, float g, float u) { return math::swiglu_dgate(d, g, u); }
  static float dup(float d, float g) { return math::swiglu_dup(d, g); }
};
struct GeluGated {
  static float out(float g, float u) { return math::geglu(g, u); }
  static float dgate(float d, float g, float u) { return math::geglu_dgate(d, g, u); }
  static float dup(float d, float g) { return math::geglu_dup(d, g); }
};

template <class A>
ZINC_ALWAYS_INLINE void gated_row_forward(float* __restrict out, const float* __restrict gate,
                                          const float* __restrict up, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = A::out(gate[j], up[j]);
}
template <class A>
ZINC_ALWAYS_INLINE void gated_row_backward(float* __restrict dgate, float* __restrict dup,
                                           const float* __restrict dout, const float* __restrict gate,
                                           const float* __restrict up, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    dgate[j] = A::dgate(dout[j], gate[j], up[j]);
    dup[j] = A::dup(dout[j], gate[j]);
  }
}

ZINC_ALWAYS_INLINE void swiglu_row_forward_body(float* __restrict out, const float* __restrict gate,
                                                const float* __restrict up, int64_t n) {
  gated_row_forward<SiluGated>(out, gate, up, n);
}
ZINC_ISA_VARIANTS(void, swiglu_row_forward, (float* __restrict out, const float* __restrict gate, const float* __restrict up, int64_t n), (out, gate, up, n))
ZINC_ALWAYS_INLINE void swiglu_row_backward_body(float* __restrict dgate, float* __restrict dup,
                                                 const float* __restrict dout, const float* __restrict gate,
                                                 const float* __restrict up, int64_t n) {
  gated_row_backward<SiluGated>(dgate, dup, dout, gate, up, n);
}
ZINC_ISA_VARIANTS(void, swiglu_row_backward, (float* __restrict dgate, float* __restrict dup, const float* __restrict dout, const float* __restrict gate, const float* __restrict up, int64_t n), (dgate, dup, dout, gate, up, n))
ZINC_ALWAYS_INLINE void geglu_row_forward_body(float* __restrict out, const float* __restrict gate,
                                               const float* __restrict up, int64_t n) {
  gated_row_forward<GeluGated>(out, gate, up, n);
}
ZINC_ISA_VARIANTS(void, geglu_row_forward, (float* __restrict out, const float* __restrict gate, const float* __restrict up, int64_t n), (out, gate, up, n))
ZINC_ALWAYS_INLINE void geglu_row_backward_body(float* __restrict dgate, float* __restrict dup,
                                                const float* __restrict dout, const float* __restrict gate,
                                                const float* __restrict up, int64_t n) {
  gated_row_backward<GeluGated>(dgate, dup, dout, gate, up, n);
}
ZINC_ISA_VARIANTS(void, geglu_row_backward, (float* __restrict dgate, float* __restrict dup, const float* __restrict dout, const float* __restrict gate, const float* __restrict up, int64_t n), (dgate, dup, dout, gate, up, n))

// ---- exact GELU ------------------------------------------------------------------------------

ZINC_ALWAYS_INLINE void gelu_erf_run_forward_body(float* __restrict out, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = math::gelu_erf(x[j]);
}
ZINC_ISA_VARIANTS(void, gelu_erf_run_forward, (float* __restrict out, const float* __restrict x, int64_t n), (out, x, n))

ZINC_ALWAYS_INLINE void gelu_erf_run_backward_body(float* __restrict dx, const float* __restrict x,
                                                   const float* __restrict dout, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dx[j] = dout[j] * math::gelu_erf_grad(x[j]);
}
ZINC_ISA_VARIANTS(void, gelu_erf_run_backward, (float* __restrict dx, const float* __restrict x, const float* __restrict dout, int64_t n), (dx, x, dout, n))

// ---- soft-capping -------------------------------------------------------------------------

ZINC_ALWAYS_INLINE void softcap_run_forward_body(float* __restrict x, float cap, int64_t n) {
  const float inv_cap = 1.0f / cap;
  for (int64_t j = 0; j < n; ++j) x[j] = math::softcap(x[j], cap, inv_cap);
}
ZINC_ISA_VARIANTS(void, softcap_run_forward, (float* __restrict x, float cap, int64_t n), (x, cap, n))

ZINC_ALWAYS_INLINE void softcap_run_backward_body(float* __restrict dx, const float* __restrict y, float cap,
                                                  int64_t n) {
  for (int64_t j = 0; j < n; ++j) dx[j] *= math::softcap_grad_from_out(y[j], cap);
}
ZINC_ISA_VARIANTS(void, softcap_run_backward, (float* __restrict dx, const float* __restrict y, float cap, int64_t n), (dx, y, cap, n))

// ---- RoPE -------------------------------------------------------------------------------

// One head of 2h values at one position; s_sign = -1 for the inverse.
ZINC_ALWAYS_INLINE void rope_head_body(float* __restrict x, const float* __restrict c, const float* __restrict s,
                                       float s_sign, int64_t h) {
  float* __restrict lo = x;
  float* __restrict hi = x + h;
  for (int64_t i = 0; i < h; ++i) {
    const float a = lo[i], b = hi[i], sn = s_sign * s[i];
    lo[i] = math::rope_lo(a, b, c[i], sn);
    hi[i] = math::rope_hi(a, b, c[i], sn);
  }
}
ZINC_ISA_VARIANTS(void, rope_head, (float* __restrict x, const float* __restrict c, const float* __restrict s, float s_sign, int64_t h), (x, c, s, s_sign, h))

// y[j] += x[j]
ZINC_ALWAYS_INLINE void add_head_body(float* __restrict y, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += x[j];
}
ZINC_ISA_VARIANTS(void, add_head, (float* __restrict y, const float* __restrict x, int64_t n), (y, x, n))

}  // namespace

// ---- RMSNorm ------------------------------------------------------------------------

namespace {
// The weight the rows multiply by: w, or w_offset + w (each sum in fp32,
// as transformers forms 1 + w) in a thread-local copy.
const float* rmsnorm_weight(CView w, int64_t C, float w_offset) {
  const float* ww = param_f32(w, C, 0);
  if (w_offset == 0.0f) return ww;
  thread_local std::vector<float> shifted;
  shifted.resize(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) shifted[static_cast<size_t>(c)] = w_offset + ww[c];
  return shifted.data();
}
}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps,
                     float w_offset) {
  ProfileScope profile_scope(Op::kLayerNorm);
  if (N <= 0) return;
  if (C <= 0) throw Error("rmsnorm_forward: C must be > 0, got " + std::to_string(C));
  const float* ww = rmsnorm_weight(w, C, w_offset);
  parallel_for(static_cast<size_t>(N), row_grain(C), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) rmsnorm_row_forward(out + i * C, rstd + i, x + i * C, ww, C, eps);
  });
}

void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd,
                      int64_t N, int64_t C, float w_offset) {
  ProfileScope profile_scope(Op::kLayerNorm);
  if (N <= 0 || C <= 0) return;
  const float* ww = rmsnorm_weight(w, C, w_offset);
  // dx row by row, and dw += sum_i dout * xhat in the same pass while the
  // row is in cache (Note [column sums by row chunks]). dx must not overlap
  // dout or x.
  rows_with_column_sums<1>(
      N, C,
      [&](int64_t i, double* const* parts) {
        rmsnorm_dw_row(parts[0], dout + i * C, x + i * C, rstd[i], C);
        rmsnorm_row_backward(dx + i * C, dout + i * C, x + i * C, ww, rstd[i], C);
      },
      [&](size_t j, const double* acc) { dw[j] = static_cast<float>(dw[j] + acc[0]); });
}

// ---- SwiGLU and GeGLU -----------------------------------------------------------------

namespace {
// The (N, 2I) rows [gate | up] through a row kernel pair, rows split over threads.
template <class RowForward>
void gated_forward(float* out, const float* gate_up, int64_t N, int64_t I, RowForward row) {
  ProfileScope profile_scope(Op::kGelu);
  if (N <= 0 || I <= 0) return;
  parallel_for(static_cast<size_t>(N), row_grain(I), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) row(out + i * I, gate_up + i * 2 * I, gate_up + i * 2 * I + I, I);
  });
}
template <class RowBackward>
void gated_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I, RowBackward row) {
  ProfileScope profile_scope(Op::kGelu);
  if (N <= 0 || I <= 0) return;
  parallel_for(static_cast<size_t>(N), row_grain(I), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const size_t r = i * 2 * static_cast<size_t>(I);
      row(dgate_up + r, dgate_up + r + I, dout + i * I, gate_up + r, gate_up + r + I, I);
    }
  });
}
}  // namespace

void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) {
  gated_forward(out, gate_up, N, I, swiglu_row_forward);
}
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) {
  gated_backward(dgate_up, dout, gate_up, N, I, swiglu_row_backward);
}
void geglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) {
  gated_forward(out, gate_up, N, I, geglu_row_forward);
}
void geglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) {
  gated_backward(dgate_up, dout, gate_up, N, I, geglu_row_backward);
}

// ---- exact GELU ------------------------------------------------------------------------------

void gelu_erf_forward(float* out, const float* x, int64_t n) {
  ProfileScope profile_scope(Op::kGelu);
  parallel_for(static_cast<size_t>(std::max<int64_t>(n, 0)), size_t{1} << 14, [&](size_t lo, size_t hi) {
    gelu_erf_run_forward(out + lo, x + lo, static_cast<int64_t>(hi - lo));
  });
}

void gelu_erf_backward(float* dx, const float* x, const float* dout, int64_t n) {
  ProfileScope profile_scope(Op::kGelu);
  parallel_for(static_cast<size_t>(std::max<int64_t>(n, 0)), size_t{1} << 14, [&](size_t lo, size_t hi) {
    gelu_erf_run_backward(dx + lo, x + lo, dout + lo, static_cast<int64_t>(hi - lo));
  });
}

// ---- soft-capping -------------------------------------------------------------------------

void softcap_forward(float* x, float cap, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  if (!(cap > 0.0f)) throw Error("softcap_forward: cap must be > 0, got " + std::to_string(cap));
  parallel_for(static_cast<size_t>(std::max<int64_t>(n, 0)), size_t{1} << 14, [&](size_t lo, size_t hi) {
    softcap_run_forward(x + lo, cap, static_cast<int64_t>(hi - lo));
  });
}

void softcap_backward(float* dx, const float* y, float cap, int64_t n) {
  ProfileScope profile_scope(Op::kVector);
  if (!(cap > 0.0f)) throw Error("softcap_backward: cap must be > 0, got " + std::to_string(cap));
  parallel_for(static_cast<size_t>(std::max<int64_t>(n, 0)), size_t{1} << 14, [&](size_t lo, size_t hi) {
    softcap_run_backward(dx + lo, y + lo, cap, static_cast<int64_t>(hi - lo));
  });
}

// ---- RoPE -------------------------------------------------------------------------------

void rope(float* x, const float* cos, const float* sin, RopeShape s, bool inverse) {
  ProfileScope profile_scope(Op::kAttention);
  if (s.head_dim <= 0 || s.rotated() % 2 != 0 || s.rotated() <= 0 || s.rotated() > s.head_dim)
    throw Error("rope: the rotated dims " + std::to_string(s.rotated()) + " must be even, > 0 and at most head_dim " +
                std::to_string(s.head_dim));
  if (s.col < 0 || s.col + s.heads * s.head_dim > s.W)
    throw Error("rope: heads " + std::to_string(s.heads) + " x " + std::to_string(s.head_dim) + " from column " +
                std::to_string(s.col) + " exceed the row width " + std::to_string(s.W));
  const int64_t h = s.rotated() / 2, N = s.B * s.T;
  if (s.positions)
    for (int64_t r = 0; r < N; ++r)
      if (s.positions[r] < 0 || s.positions[r] >= s.rows())
        throw Error("rope: position " + std::to_string(s.positions[r]) + " at row " + std::to_string(r) +
                    " is outside [0, " + std::to_string(s.rows()) + ")");
  const float sign = inverse ? -1.0f : 1.0f;
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), row_grain(s.heads * s.head_dim), [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const int64_t t = s.positions ? static_cast<int64_t>(s.positions[r]) : static_cast<int64_t>(r) % s.T;
      float* row = x + static_cast<int64_t>(r) * s.W + s.col;
      for (int64_t k = 0; k < s.heads; ++k) rope_head(row + k * s.head_dim, cos + t * h, sin + t * h, sign, h);
    }
  });
}

// ---- grouped-query heads ------------------------------------------------------------------

void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) {
  ProfileScope profile_scope(Op::kAttention);
  if (H <= 0 || Hkv <= 0 || H % Hkv != 0)
    throw Error("gqa_expand: heads " + std::to_string(H) + " not a positive multiple of kv heads " + std::to_string(Hkv));
  const int64_t g = H / Hkv, in_w = (H + 2 * Hkv) * hd, out_w = 3 * H * hd;
  const size_t head_bytes = static_cast<size_t>(hd) * sizeof(float);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), row_grain(out_w), [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const float* in = q_kv + static_cast<int64_t>(r) * in_w;
      float* out = qkv + static_cast<int64_t>(r) * out_w;
      std::memcpy(out, in, static_cast<size_t>(H) * head_bytes);
      for (int part = 1; part <= 2; ++part) {
        const float* src = in + H * hd + (part - 1) * Hkv * hd;
        float* dst = out + part * H * hd;
        for (int64_t k = 0; k < H; ++k) std::memcpy(dst + k * hd, src + (k / g) * hd, head_bytes);
      }
    }
  });
}

void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) {
  ProfileScope profile_scope(Op::kAttention);
  if (H <= 0 || Hkv <= 0 || H % Hkv != 0)
    throw Error("gqa_reduce: heads " + std::to_string(H) + " not a positive multiple of kv heads " + std::to_string(Hkv));
  const int64_t g = H / Hkv, out_w = (H + 2 * Hkv) * hd, in_w = 3 * H * hd;
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), row_grain(in_w), [&](size_t lo, size_t hi) {
    for (size_t r = lo; r < hi; ++r) {
      const float* in = dqkv + static_cast<int64_t>(r) * in_w;
      float* out = dq_kv + static_cast<int64_t>(r) * out_w;
      std::memcpy(out, in, static_cast<size_t>(H * hd) * sizeof(float));
      for (int part = 1; part <= 2; ++part) {
        const float* src = in + part * H * hd;
        float* dst = out + H * hd + (part - 1) * Hkv * hd;
        for (int64_t j = 0; j < Hkv; ++j) {
          float* d = dst + j * hd;
          std::memcpy(d, src + j * g * hd, static_cast<size_t>(hd) * sizeof(float));
          for (int64_t m = 1; m < g; ++m) add_head(d, src + (j * g + m) * hd, hd);
        }
      }
    }
  });
}

}  // namespace zinc::kernels
