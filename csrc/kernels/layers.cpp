// Layer kernels: bias, layernorm, GELU, softmax cross-entropy, embeddings.
//
// Threading: row-wise work is split over rows; parameter-gradient reductions
// (bias, layernorm weights, embeddings) are split over COLUMNS, each thread
// walking every row in order for its own columns. That keeps every sum in row
// order, so the results are bit-identical for any thread count, with no
// per-thread partial buffers to combine. Vectorisation: see
// Note [kernel vectorisation] in simd_math.h.
//
// Small parameter vectors (bias, layernorm w and b) that arrive as bf16 (fp16) are
// widened once per call into thread-local scratch; large ones (the token
// embedding table) are read through a template on the element type, chosen
// once per call.
#include <algorithm>
#include <cstring>
#include <cmath>
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

using detail::dispatch;
using detail::for_column_blocks;
using detail::load;
using detail::param_f32;
using detail::row_grain;
using detail::rows_with_column_sums;

// ---- layernorm rows -------------------------------------------------------------

ZINC_ALWAYS_INLINE void layernorm_row_forward_body(float* __restrict out, float* mean_out, float* rstd_out,
                                       const float* __restrict x, const float* __restrict w,
                                       const float* __restrict b, int64_t C, float eps) {
  const float mean = detail::lane_sum<float>(C, [&](int64_t c) { return x[c]; }) / static_cast<float>(C);
  // Two-pass variance: no cancellation when |mean| >> std.
  const float var_sum = detail::lane_sum<float>(C, [&](int64_t c) {
    const float d = x[c] - mean;
    return d * d;
  });
  const float rstd = math::layernorm_rstd(var_sum, C, eps);
  for (int64_t c = 0; c < C; ++c) out[c] = math::layernorm_out(x[c], mean, rstd, w[c], b[c]);
  *mean_out = mean;
  *rstd_out = rstd;
}
ZINC_ISA_VARIANTS(void, layernorm_row_forward, (float* __restrict out, float* mean_out, float* rstd_out, const float* __restrict x, const float* __restrict w, const float* __restrict b, int64_t C, float eps), (out, mean_out, rstd_out, x, w, b, C, eps))

ZINC_ALWAYS_INLINE void layernorm_row_backward_body(float* __restrict dx, const float* __restrict dout,
                                        const float* __restrict x, const float* __restrict w,
                                        float mean, float rstd, int64_t C) {
  // With g = dout * w and xhat = (x - mean) rstd:
  // dx += rstd (g - mean(g) - xhat mean(g xhat)).
  const float mg = detail::lane_sum<float>(C, [&](int64_t c) { return dout[c] * w[c]; }) /
                   static_cast<float>(C);
  const float mgx = detail::lane_sum<float>(C, [&](int64_t c) {
                      return dout[c] * w[c] * math::layernorm_xhat(x[c], mean, rstd);
                    }) /
                    static_cast<float>(C);
  for (int64_t c = 0; c < C; ++c)
    dx[c] += math::layernorm_dx(dout[c], w[c], math::layernorm_xhat(x[c], mean, rstd), rstd, mg, mgx);
}
ZINC_ISA_VARIANTS(void, layernorm_row_backward, (float* __restrict dx, const float* __restrict dout, const float* __restrict x, const float* __restrict w, float mean, float rstd, int64_t C), (dx, dout, x, w, mean, rstd, C))

// ---- GELU ---------------------------------------------------------------------------

ZINC_ALWAYS_INLINE void gelu_forward_range_body(float* __restrict out, const float* __restrict x, size_t n) {
  using namespace detail;
  for (size_t i = 0; i < n; ++i) out[i] = math::gelu(x[i]);
}
ZINC_ISA_VARIANTS(void, gelu_forward_range, (float* __restrict out, const float* __restrict x, size_t n), (out, x, n))

ZINC_ALWAYS_INLINE void gelu_backward_range_body(float* __restrict dx, const float* __restrict x,
                                     const float* __restrict dout, size_t n) {
  using namespace detail;
  for (size_t i = 0; i < n; ++i) dx[i] = math::gelu_grad(x[i]) * dout[i];
}
ZINC_ISA_VARIANTS(void, gelu_backward_range, (float* __restrict dx, const float* __restrict x, const float* __restrict dout, size_t n), (dx, x, dout, n))

// ---- cross-entropy rows -----------------------------------------------------------

ZINC_ALWAYS_INLINE float row_max_body(const float* __restrict x, int64_t n) { return detail::max_of(x, n); }
ZINC_ISA_VARIANTS(float, row_max, (const float* __restrict x, int64_t n), (x, n))

// e[j] = exp(x[j] - mx); e may equal x (elementwise, each read before written).
ZINC_ALWAYS_INLINE void row_exp_body(float* e, const float* x, float mx, int64_t n) {
  for (int64_t j = 0; j < n; ++j) e[j] = detail::exp_f(x[j] - mx);
}
ZINC_ISA_VARIANTS(void, row_exp, (float* e, const float* x, float mx, int64_t n), (e, x, mx, n))

ZINC_ALWAYS_INLINE double row_sum_body(const float* __restrict e, int64_t n) {
  return detail::lane_sum<double>(n, [&](int64_t j) { return e[j]; });
}
ZINC_ISA_VARIANTS(double, row_sum, (const float* __restrict e, int64_t n), (e, n))

ZINC_ALWAYS_INLINE void row_scale_body(float* __restrict e, float f, int64_t n) {
  for (int64_t j = 0; j < n; ++j) e[j] *= f;
}
ZINC_ISA_VARIANTS(void, row_scale, (float* __restrict e, float f, int64_t n), (e, f, n))

// ---- row and column sums --------------------------------------------------------------

// y[j] += x[j]
ZINC_ALWAYS_INLINE void add_row_body(float* __restrict y, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] += x[j];
}
ZINC_ISA_VARIANTS(void, add_row, (float* __restrict y, const float* __restrict x, int64_t n), (y, x, n))

// acc[j] += x[j] in double
ZINC_ALWAYS_INLINE void add_row_f64_body(double* __restrict acc, const float* __restrict x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += x[j];
}
ZINC_ISA_VARIANTS(void, add_row_f64, (double* __restrict acc, const float* __restrict x, int64_t n),
                  (acc, x, n))

// Layernorm weight gradients of one row: aw += g xhat, ab += g (double).
ZINC_ALWAYS_INLINE void layernorm_dw_row_body(double* __restrict aw, double* __restrict ab,
                                              const float* __restrict g, const float* __restrict x,
                                              float m, float r, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    aw[j] += g[j] * ((x[j] - m) * r);
    ab[j] += g[j];
  }
}
ZINC_ISA_VARIANTS(void, layernorm_dw_row,
                  (double* __restrict aw, double* __restrict ab, const float* __restrict g,
                   const float* __restrict x, float m, float r, int64_t n),
                  (aw, ab, g, x, m, r, n))

}  // namespace

float* exp_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(n)) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

namespace {
// The fp32 values of a row (or a chunk) before their bf16 conversion: a
// thread's grow-only scratch, small enough to stay in cache.
float* row_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(n)) buf.resize(static_cast<size_t>(n));
  return buf.data();
}
constexpr size_t kBf16Chunk = 2048;  // values per conversion in the GELU kernels

// Rows of an (M,N) fp32 matrix, each made by row(i, tmp) (which returns it,
// in tmp or elsewhere), written as bf16 into out, with dbias(N) += their
// column sums (bias_backward's bits; Note [column sums by row chunks]).
template <class RowFn>
void rows_bf16_with_column_sums(float* dbias, bf16* out, int64_t M, int64_t N, RowFn&& row) {
  rows_with_column_sums<1>(
      M, N,
      [&](int64_t i, double* const* parts) {
        const float* r = row(i, row_scratch(N));
        add_row_f64(parts[0], r, N);
        convert_f32_to_bf16_serial(r, out + i * N, static_cast<size_t>(N));
      },
      [&](size_t j, const double* acc) { dbias[j] = static_cast<float>(dbias[j] + acc[0]); });
}
}  // namespace

// ---- bias -------------------------------------------------------------------------

void add_bias(float* y, CView bias, int64_t M, int64_t N) {
  ProfileScope profile_scope(Op::kBias);
  if (M <= 0 || N <= 0) return;
  const float* bb = param_f32(bias, N, 0);
  parallel_for(static_cast<size_t>(M), row_grain(N), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) add_row(y + i * N, bb, N);
  });
}

// Column sums in Note [column sums]'s order (kernels/math.h): rows in chunks.
void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N) {
  ProfileScope profile_scope(Op::kBias);
  if (M <= 0 || N <= 0) return;
  for_column_blocks(N, [&](int64_t c0, int64_t c1, double* __restrict acc) {
    const int64_t w = c1 - c0;
    std::vector<double> partv(static_cast<size_t>(w));
    double* __restrict part = partv.data();
    for (int64_t r0 = 0; r0 < M; r0 += math::kColumnChunk) {
      std::fill(partv.begin(), partv.end(), 0.0);
      const int64_t r1 = std::min(M, r0 + math::kColumnChunk);
      for (int64_t i = r0; i < r1; ++i) add_row_f64(part, dy + i * N + c0, w);
      for (int64_t j = 0; j < w; ++j) acc[j] += part[j];
    }
    for (int64_t j = 0; j < w; ++j) dbias[c0 + j] = static_cast<float>(dbias[c0 + j] + acc[j]);
  });
}

void bias_backward_bf16(float* dbias, bf16* dy16, const float* dy, int64_t M, int64_t N) {
  ProfileScope profile_scope(Op::kBias);
  rows_bf16_with_column_sums(dbias, dy16, M, N, [&](int64_t i, float*) { return dy + i * N; });
}

// ---- layernorm ----------------------------------------------------------------------

void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b,
                       int64_t N, int64_t C, float eps) {
  ProfileScope profile_scope(Op::kLayerNorm);
  if (N <= 0) return;
  if (C <= 0) throw Error("layernorm_forward: C must be > 0, got " + std::to_string(C));
  const float* ww = param_f32(w, C, 0);
  const float* bb = param_f32(b, C, 1);
  parallel_for(static_cast<size_t>(N), row_grain(C), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i)
      layernorm_row_forward(out + i * C, mean + i, rstd + i, x + i * C, ww, bb, C, eps);
  });
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, CView w,
                        const float* mean, const float* rstd, int64_t N, int64_t C) {
  ProfileScope profile_scope(Op::kLayerNorm);
  if (N <= 0 || C <= 0) return;
  const float* ww = param_f32(w, C, 0);
  // dx row by row; dw += sum_i dout * xhat and db += sum_i dout in the same
  // pass (Note [column sums by row chunks]). dx must not overlap dout or x.
  rows_with_column_sums<2>(
      N, C,
      [&](int64_t i, double* const* parts) {
        layernorm_dw_row(parts[0], parts[1], dout + i * C, x + i * C, mean[i], rstd[i], C);
        layernorm_row_backward(dx + i * C, dout + i * C, x + i * C, ww, mean[i], rstd[i], C);
      },
      [&](size_t j, const double* acc) {
        dw[j] = static_cast<float>(dw[j] + acc[0]);
        db[j] = static_cast<float>(db[j] + acc[1]);
      });
}

void layernorm_forward_bf16(bf16* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                            int64_t C, float eps) {
  ProfileScope profile_scope(Op::kLayerNorm);
  if (N <= 0) return;
  if (C <= 0) throw Error("layernorm_forward: C must be > 0, got " + std::to_string(C));
  const float* ww = param_f32(w, C, 0);
  const float* bb = param_f32(b, C, 1);
  parallel_for(static_cast<size_t>(N), row_grain(C), [&](size_t lo, size_t hi) {
    float* row = row_scratch(C);
    for (size_t i = lo; i < hi; ++i) {
      layernorm_row_forward(row, mean + i, rstd + i, x + i * C, ww, bb, C, eps);
      convert_f32_to_bf16_serial(row, out + i * C, static_cast<size_t>(C));
    }
  });
}

// ---- GELU -----------------------------------------------------------------------------

void gelu_forward(float* out, const float* x, int64_t n) {
  ProfileScope profile_scope(Op::kGelu);
  parallel_for(static_cast<size_t>(std::max<int64_t>(n, 0)), 1 << 13, [&](size_t lo, size_t hi) {
    gelu_forward_range(out + lo, x + lo, hi - lo);
  });
}

void gelu_backward(float* dx, const float* x, const float* dout, int64_t n) {
  ProfileScope profile_scope(Op::kGelu);
  parallel_for(static_cast<size_t>(std::max<int64_t>(n, 0)), 1 << 13, [&](size_t lo, size_t hi) {
    gelu_backward_range(dx + lo, x + lo, dout + lo, hi - lo);
  });
}

void gelu_forward_bf16(bf16* out, const float* x, int64_t n) {
  ProfileScope profile_scope(Op::kGelu);
  parallel_for(static_cast<size_t>(std::max<int64_t>(n, 0)), 1 << 13, [&](size_t lo, size_t hi) {
    float* tmp = row_scratch(kBf16Chunk);
    for (size_t i = lo; i < hi; i += kBf16Chunk) {
      const size_t m = std::min(kBf16Chunk, hi - i);
      gelu_forward_range(tmp, x + i, m);
      convert_f32_to_bf16_serial(tmp, out + i, m);
    }
  });
}

void gelu_backward_bias_bf16(float* dbias, bf16* dx16, const float* x, const float* dout, int64_t M, int64_t N) {
  ProfileScope profile_scope(Op::kGelu);
  rows_bf16_with_column_sums(dbias, dx16, M, N, [&](int64_t i, float* tmp) {
    gelu_backward_range(tmp, x + i * N, dout + i * N, static_cast<size_t>(N));
    return static_cast<const float*>(tmp);
  });
}

// ---- cross-entropy ----------------------------------------------------------------------

double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V,
                     float* dlogits, float dloss_scale) {
  ProfileScope profile_scope(Op::kCrossEntropy);
  if (N <= 0) return 0.0;
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] == kIgnoreTarget) continue;
    if (targets[i] < 0 || targets[i] >= V) {
      throw Error("cross_entropy: target " + std::to_string(targets[i]) + " at row " +
                  std::to_string(i) + " is outside the vocabulary [0, " + std::to_string(V) + ") (" +
                  std::to_string(kIgnoreTarget) + " marks a position without a target)");
    }
    ++counted;
  }
  // Per-row losses summed in row order afterwards: thread-count independent.
  std::vector<double> row_loss(static_cast<size_t>(N));
  const double grad_scale = static_cast<double>(dloss_scale) / static_cast<double>(N);
  parallel_for(static_cast<size_t>(N), row_grain(V), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      const float* x = logits + i * V;
      const int32_t tgt = targets[i];
      if (tgt == kIgnoreTarget) {
        row_loss[i] = 0.0;
        if (dlogits) std::memset(dlogits + i * V, 0, static_cast<size_t>(V) * sizeof(float));
        continue;
      }
      const float x_tgt = x[tgt];  // read before dlogits (which may alias) overwrites it
      const float mx = row_max(x, V);
      // The exponentials go to dlogits when there is one (row-sized, so the
      // scaling pass below hits cache), else to thread-local scratch.
      float* e = dlogits ? dlogits + i * V : exp_scratch(V);
      row_exp(e, x, mx, V);
      const double sum = row_sum(e, V);
      row_loss[i] = std::log(sum) + static_cast<double>(mx) - static_cast<double>(x_tgt);
      if (dlogits) {
        row_scale(e, math::cross_entropy_factor(grad_scale, sum), V);
        e[tgt] -= static_cast<float>(grad_scale);
      }
    }
  });
  double total = 0;
  for (double l : row_loss) total += l;
  return counted > 0 ? total / static_cast<double>(counted) : 0.0;
}

// ---- embeddings -----------------------------------------------------------------------------

namespace {
void check_tokens(const char* fn, const int32_t* tokens, int64_t n, int64_t V) {
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V) {
      throw Error(std::string(fn) + ": token " + std::to_string(tokens[i]) + " at position " +
                  std::to_string(i) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    }
  }
}
void check_positions(const char* fn, const int32_t* positions, int64_t n, int64_t T) {
  if (!positions) return;
  for (int64_t i = 0; i < n; ++i) {
    if (positions[i] < 0 || positions[i] >= T) {
      throw Error(std::string(fn) + ": position " + std::to_string(positions[i]) + " at row " +
                  std::to_string(i) + " is outside [0, " + std::to_string(T) + ")");
    }
  }
}
inline int64_t position_of(const int32_t* positions, int64_t r, int64_t T) {
  return positions ? static_cast<int64_t>(positions[r]) : r % T;
}
}  // namespace

void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, const int32_t* positions) {
  ProfileScope profile_scope(Op::kEmbedding);
  const int64_t rows = B * T;
  if (rows <= 0 || C <= 0) return;
  check_tokens("embedding_forward", tokens, rows, V);
  if (wpe.data) check_positions("embedding_forward", positions, rows, T);
  dispatch(wte.dtype, [&](auto te) {
    using TE = decltype(te);
    const TE* E = static_cast<const TE*>(wte.data);
    if (!wpe.data) {
      parallel_for(static_cast<size_t>(rows), row_grain(C), [&](size_t lo, size_t hi) {
        for (size_t r = lo; r < hi; ++r) {
          const TE* __restrict e = E + static_cast<int64_t>(tokens[r]) * C;
          float* __restrict o = out + r * C;
          for (int64_t c = 0; c < C; ++c) o[c] = load(e[c]);
        }
      });
      return;
    }
    dispatch(wpe.dtype, [&](auto tp) {
      using TP = decltype(tp);
      const TP* P = static_cast<const TP*>(wpe.data);
      parallel_for(static_cast<size_t>(rows), row_grain(C), [&](size_t lo, size_t hi) {
        for (size_t r = lo; r < hi; ++r) {
          const TE* __restrict e = E + static_cast<int64_t>(tokens[r]) * C;
          const TP* __restrict p = P + position_of(positions, static_cast<int64_t>(r), T) * C;
          float* __restrict o = out + r * C;
          for (int64_t c = 0; c < C; ++c) o[c] = load(e[c]) + load(p[c]);
        }
      });
    });
  });
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, const int32_t* positions) {
  ProfileScope profile_scope(Op::kEmbedding);
  const int64_t rows = B * T;
  if (rows <= 0 || C <= 0) return;
  check_tokens("embedding_backward", tokens, rows, V);
  if (dwpe) check_positions("embedding_backward", positions, rows, T);
  // Column blocks: each thread owns columns [c0, c1) of every row of dwte and
  // dwpe and adds the dout rows in token order, so the result is the same for
  // any thread count and needs no atomics.
  parallel_for(static_cast<size_t>(C), 16, [&](size_t c0, size_t c1) {
    const int64_t w = static_cast<int64_t>(c1 - c0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = dout + r * C + c0;
      add_row(dwte + static_cast<int64_t>(tokens[r]) * C + c0, g, w);
      if (dwpe) add_row(dwpe + position_of(positions, r, T) * C + c0, g, w);
    }
  });
}

// ---- vocabulary parts (tensor parallelism) ---------------------------------------------

void embedding_part_forward(float* out, const int32_t* tokens, CView wte, int64_t N, int64_t C, int64_t lo,
                            int64_t n) {
  ProfileScope profile_scope(Op::kEmbedding);
  if (N <= 0 || C <= 0) return;
  dispatch(wte.dtype, [&](auto te) {
    using TE = decltype(te);
    const TE* E = static_cast<const TE*>(wte.data);
    parallel_for(static_cast<size_t>(N), row_grain(C), [&](size_t r0, size_t r1) {
      for (size_t r = r0; r < r1; ++r) {
        const int64_t t = static_cast<int64_t>(tokens[r]) - lo;
        float* __restrict o = out + r * C;
        if (t < 0 || t >= n) {
          std::memset(o, 0, static_cast<size_t>(C) * sizeof(float));
          continue;
        }
        const TE* __restrict e = E + t * C;
        for (int64_t c = 0; c < C; ++c) o[c] = load(e[c]);
      }
    });
  });
}

void embedding_part_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t lo,
                             int64_t n) {
  ProfileScope profile_scope(Op::kEmbedding);
  if (N <= 0 || C <= 0) return;
  parallel_for(static_cast<size_t>(C), 16, [&](size_t c0, size_t c1) {
    const int64_t w = static_cast<int64_t>(c1 - c0);
    for (int64_t r = 0; r < N; ++r) {
      const int64_t t = static_cast<int64_t>(tokens[r]) - lo;
      if (t >= 0 && t < n) add_row(dwte + t * C + c0, dout + r * C + c0, w);
    }
  });
}

void cross_entropy_part_max(const float* logits, int64_t N, int64_t Vp, double* row_maxes) {
  ProfileScope profile_scope(Op::kCrossEntropy);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), row_grain(Vp), [&](size_t r0, size_t r1) {
    for (size_t i = r0; i < r1; ++i) row_maxes[i] = static_cast<double>(row_max(logits + i * Vp, Vp));
  });
}

void cross_entropy_part_sums(const float* logits, const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                             const double* row_maxes, double* sums, float* dlogits) {
  ProfileScope profile_scope(Op::kCrossEntropy);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), row_grain(Vp), [&](size_t r0, size_t r1) {
    for (size_t i = r0; i < r1; ++i) {
      const float* x = logits + i * Vp;
      const int32_t tgt = targets[i];
      sums[2 * i] = sums[2 * i + 1] = 0.0;
      if (tgt == kIgnoreTarget) {
        if (dlogits) std::memset(dlogits + i * Vp, 0, static_cast<size_t>(Vp) * sizeof(float));
        continue;
      }
      const int64_t t = static_cast<int64_t>(tgt) - lo;
      if (t >= 0 && t < Vp) sums[2 * i + 1] = static_cast<double>(x[t]);  // before dlogits (may alias) is written
      float* e = dlogits ? dlogits + i * Vp : exp_scratch(Vp);
      row_exp(e, x, static_cast<float>(row_maxes[i]), Vp);
      sums[2 * i] = row_sum(e, Vp);
    }
  });
}

double cross_entropy_part_finish(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo, const double* row_maxes,
                                 const double* sums, float* dlogits, float dloss_scale) {
  ProfileScope profile_scope(Op::kCrossEntropy);
  if (N <= 0) return 0.0;
  const double grad_scale = static_cast<double>(dloss_scale) / static_cast<double>(N);
  double total = 0;
  int64_t counted = 0;
  for (int64_t i = 0; i < N; ++i) {  // in row order: thread-count independent
    if (targets[i] == kIgnoreTarget) continue;
    ++counted;
    total += std::log(sums[2 * i]) + static_cast<double>(static_cast<float>(row_maxes[i])) - sums[2 * i + 1];
  }
  if (dlogits) {
    parallel_for(static_cast<size_t>(N), row_grain(Vp), [&](size_t r0, size_t r1) {
      for (size_t i = r0; i < r1; ++i) {
        if (targets[i] == kIgnoreTarget) continue;
        float* e = dlogits + i * Vp;
        row_scale(e, math::cross_entropy_factor(grad_scale, sums[2 * i]), Vp);
        const int64_t t = static_cast<int64_t>(targets[i]) - lo;
        if (t >= 0 && t < Vp) e[t] -= static_cast<float>(grad_scale);
      }
    });
  }
  return counted > 0 ? total / static_cast<double>(counted) : 0.0;
}

}  // namespace zinc::kernels
