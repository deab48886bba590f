// zinc kernels: the per-element and per-row math shared by the CPU kernels
// (layers.cpp, attention.cpp, vector_ops.cpp) and their CUDA twins (*.cu).
//
// Every function here is ZINC_HD (core/hd.h): compiled for the host and,
// under nvcc, for the device. The CPU kernels call these functions inside
// their vectorised loops, so the CPU tests exercise the formulas the GPU
// runs; with the flags named in core/hd.h both sides compute the same bits.
//
// Note [lane order]
// A sum over a row is not associative in floating point, so "the same
// formula" must include the order. Every row sum in zinc (lane_sum in
// simd_math.h on the CPU) is defined as: kLanes partial sums, lane l adding
// f(l), f(l + kLanes), f(l + 2 kLanes), ... in that order from zero, then
// the partials added in lane order from zero. The CPU keeps the lanes in one
// vector register; a GPU kernel gives a row kLanes threads, thread l
// computing lane_partial(l) and every thread adding the partials in lane
// order (lane_combine). Both are the same sequence of roundings.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/hd.h"

namespace zinc::kernels::math {

// Independent partial sums per row reduction (one zmm of floats).
constexpr int kLanes = 16;

// Lane l's partial sum (Note [lane order]).
template <class Acc, class F>
ZINC_HD Acc lane_partial(int64_t n, int l, F f) {
  Acc a = 0;
  for (int64_t i = l; i < n; i += kLanes) a += static_cast<Acc>(f(i));
  return a;
}

// kernels::squared_norm sums fixed chunks of kNormChunk elements, each in
// lane order in double, then adds the chunk sums in index order (Note
// [squared_norm order] in vector_ops.cpp): the summation tree depends only on n.
constexpr int64_t kNormChunk = int64_t{1} << 16;

// Note [column sums]
// A parameter gradient that sums a column over M rows (the bias, the
// layernorm weight and bias) adds the rows in chunks of kColumnChunk rows:
// each chunk's rows in order, in double, from 0; then the chunks' sums in
// chunk order, in double, from 0; then that total once into the float
// gradient. The CPU's column blocks and the GPU's threads (one per column
// and chunk) follow the same tree, so both give the same bits, and the GPU
// runs M / kColumnChunk times more threads than there are columns (adding
// all M rows in one thread per column left most of a large GPU idle).
constexpr int64_t kColumnChunk = 64;

// exp(x) in float, ~2 ulp for x <= 88.3; 0 below -87.3 (where the true
// value is subnormal); +Inf from about 88.4 up (every caller passes x <= 0,
// or 2|u| to tanh_f, where Inf gives 1). Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial (truncation
// error r^8/8! < 1e-8 relative). Plain + and * only (no libm), so that the
// CPU loops vectorise and the GPU computes the same bits.
ZINC_HD float exp_f(float x) {
  float xc = x > 88.7f ? 88.7f : x;
  xc = xc < -87.3f ? -87.3f : xc;
  float nf = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = xc - nf * 0.693359375f;  // ln2 split into an exactly representable head
  r = r + nf * 2.12194440e-4f;       // and a tail: ln2 = 0.693359375 - 2.12194440e-4
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float s = bits_float(static_cast<uint32_t>(static_cast<int32_t>(nf) + 127) << 23);
  return x < -87.3f ? 0.0f : p * s;
}

// tanh(u) = sign(u) (1 - 2 / (exp(2|u|) + 1)); absolute error ~1e-7.
ZINC_HD float tanh_f(float u) {
  float a = u < 0.0f ? -u : u;
  float t = 1.0f - 2.0f / (exp_f(2.0f * a) + 1.0f);
  return u < 0.0f ? -t : t;
}

// ---- GELU, tanh form ----------------------------------------------------------
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
ZINC_HD float gelu(float v) {
  float t = tanh_f(kGeluC * (v + kGeluA * v * v * v));
  return 0.5f * v * (1.0f + t);
}

// d gelu(v) / dv
ZINC_HD float gelu_grad(float v) {
  float v2 = v * v;
  float t = tanh_f(kGeluC * (v + kGeluA * v2 * v));
  float dudx = kGeluC * (1.0f + 3.0f * kGeluA * v2);
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * dudx;
}

// ---- GELU, exact form (erf): GPT-NeoX's "gelu" -----------------------------------------
// erf(x) by Abramowitz and Stegun 7.1.26: 1 - (a1 t + ... + a5 t^5)
// exp(-x^2), t = 1 / (1 + p |x|), odd in x; absolute error below 1.5e-7
// in exact arithmetic, a few 1e-7 in float. Plain + * / and exp_f only.
ZINC_HD float erf_f(float x) {
  const float a = x < 0.0f ? -x : x;
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const float y = 1.0f - p * t * exp_f(-a * a);
  return x < 0.0f ? -y : y;
}
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
// x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))
ZINC_HD float gelu_erf(float v) { return 0.5f * v * (1.0f + erf_f(v * kInvSqrt2)); }
// Phi(x) + x phi(x)
ZINC_HD float gelu_erf_grad(float v) {
  return 0.5f * (1.0f + erf_f(v * kInvSqrt2)) + v * kInvSqrt2Pi * exp_f(-0.5f * v * v);
}

// ---- layernorm ------------------------------------------------------------------
// Forward of one row of C: mean = sum(x) / C, then the two-pass variance
// var = sum((x - mean)^2) / C (both sums in lane order), rstd = 1 / sqrt(var + eps),
// out = layernorm_out(...).
ZINC_HD float layernorm_rstd(float var_sum, int64_t C, float eps) {
  const float var = var_sum / static_cast<float>(C);
  return 1.0f / sqrtf(var + eps);
}
ZINC_HD float layernorm_out(float x, float mean, float rstd, float w, float b) {
  return (x - mean) * rstd * w + b;
}
// Backward, with g = dout * w and xhat = (x - mean) rstd:
//   dx += rstd (g - mean(g) - xhat mean(g xhat)),
// mg = sum(dout w) / C and mgx = sum(dout w xhat) / C in lane order.
ZINC_HD float layernorm_xhat(float x, float mean, float rstd) { return (x - mean) * rstd; }
ZINC_HD float layernorm_dx(float dout, float w, float xhat, float rstd, float mg, float mgx) {
  return rstd * (dout * w - mg - xhat * mgx);
}

// ---- softmax cross-entropy (one row of V logits) ----------------------------------
// mx = max(x); e_j = exp_f(x_j - mx); sum = sum_j e_j in double, lane order;
// loss = log(sum) + mx - x[target];
// dlogits_j = e_j * cross_entropy_factor(grad_scale, sum), then
// dlogits[target] -= float(grad_scale), with grad_scale = dloss_scale / N.
ZINC_HD float cross_entropy_factor(double grad_scale, double sum) {
  return static_cast<float>(grad_scale / sum);
}

// ---- RMSNorm (Llama) ----------------------------------------------------------------
// Forward of one row of C: rstd = 1 / sqrt(sum(x^2) / C + eps) (sum in lane
// order), out = w * (x * rstd), in that order, as transformers' LlamaRMSNorm
// (which normalises in fp32 and then multiplies by the weight).
ZINC_HD float rmsnorm_rstd(float sq_sum, int64_t C, float eps) {
  return 1.0f / sqrtf(sq_sum / static_cast<float>(C) + eps);
}
ZINC_HD float rmsnorm_out(float x, float rstd, float w) { return w * (x * rstd); }
// Backward, with g = dout * w and xhat = x rstd:
//   dx += rstd (g - xhat mean(g xhat)),  mgx = sum(dout w xhat) / C in lane order;
//   dw += dout xhat (a column sum, Note [column sums]).
ZINC_HD float rmsnorm_dx(float dout, float w, float xhat, float rstd, float mgx) {
  return rstd * (dout * w - xhat * mgx);
}

// ---- SiLU-gated MLP (SwiGLU) ----------------------------------------------------------
// h = silu(gate) * up with silu(g) = g sigmoid(g) = g / (1 + exp(-g)).
ZINC_HD float sigmoid(float g) { return 1.0f / (1.0f + exp_f(-g)); }
ZINC_HD float swiglu(float gate, float up) { return gate * sigmoid(gate) * up; }
// d h / d gate = up silu'(g), silu'(g) = s (1 + g (1 - s)); d h / d up = silu(g).
ZINC_HD float swiglu_dgate(float dout, float gate, float up) {
  const float s = sigmoid(gate);
  return dout * up * (s * (1.0f + gate * (1.0f - s)));
}
ZINC_HD float swiglu_dup(float dout, float gate) { return dout * (gate * sigmoid(gate)); }

// ---- GELU-gated MLP (GeGLU, Gemma's tanh form) -----------------------------------------
// h = gelu(gate) * up, gelu the tanh form above; d h / d gate = up gelu'(g),
// d h / d up = gelu(g).
ZINC_HD float geglu(float gate, float up) { return gelu(gate) * up; }
ZINC_HD float geglu_dgate(float dout, float gate, float up) { return dout * up * gelu_grad(gate); }
ZINC_HD float geglu_dup(float dout, float gate) { return dout * gelu(gate); }

// ---- soft-capping (Gemma 2's attention and final logits) ------------------------------------
// y = cap tanh(x / cap), as transformers writes it, with x / cap taken as x
// times the caller's inv_cap = 1 / cap (within an ulp of the division; a
// vector division per score cost a third of the cap's time on the CPU).
ZINC_HD float softcap(float x, float cap, float inv_cap) { return cap * tanh_f(x * inv_cap); }
// dy/dx = 1 - tanh(x / cap)^2, from x (the raw value).
ZINC_HD float softcap_grad(float x, float cap) {
  const float t = tanh_f(x / cap);
  return 1.0f - t * t;
}
// The same from y = softcap(x, cap) (the capped value): 1 - (y / cap)^2.
ZINC_HD float softcap_grad_from_out(float y, float cap) {
  const float t = y / cap;
  return 1.0f - t * t;
}

// ---- mixture-of-experts routing (Note [expert routing order] in moe.cpp) -------------------
// One token: probs = softmax(logits) over E (index order), its top k
// experts by repeated selection (ties: the lower index), their weights the
// probabilities, divided by their sum (slot order) with renormalize.
ZINC_HD void moe_route_row(const float* logits, int64_t E, int64_t k, bool renormalize, float* probs,
                           int32_t* expert, float* weight) {
  float mx = logits[0];
  for (int64_t e = 1; e < E; ++e) mx = logits[e] > mx ? logits[e] : mx;
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) {
    probs[e] = exp_f(logits[e] - mx);
    sum += probs[e];
  }
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < E; ++e) probs[e] *= inv;
  float chosen = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t q = 0; q < s; ++q) taken = taken || expert[q] == e;
      if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
    }
    expert[s] = static_cast<int32_t>(best);
    weight[s] = probs[best];
    chosen += probs[best];
  }
  if (renormalize)
    for (int64_t s = 0; s < k; ++s) weight[s] = weight[s] / chosen;
}
// Its backward: d weight (k) and, where the aux loss adds one, d probs (E;
// the same for every token: the load-balancing loss's gradient depends on
// the expert alone) to d logits (E), written. With renormalize, w_s = p_s / S: dp_s =
// (dw_s - sum_q dw_q w_q) / S; then the softmax's dlogit_e = p_e (dp_e -
// sum_e' p_e' dp_e'), sums in slot and index order.
ZINC_HD void moe_route_row_backward(const float* probs, const int32_t* expert, const float* weight,
                                    const float* dweight, const float* dprobs, int64_t E, int64_t k,
                                    bool renormalize, float* dlogits) {
  float chosen = 0.0f, dw_w = 0.0f;
  for (int64_t s = 0; s < k; ++s) {
    chosen += probs[expert[s]];
    dw_w += dweight[s] * weight[s];
  }
  for (int64_t e = 0; e < E; ++e) dlogits[e] = dprobs ? dprobs[e] : 0.0f;  // dp, then dlogits in place
  for (int64_t s = 0; s < k; ++s)
    dlogits[expert[s]] += renormalize ? (dweight[s] - dw_w) / chosen : dweight[s];
  float dot = 0.0f;
  for (int64_t e = 0; e < E; ++e) dot += probs[e] * dlogits[e];
  for (int64_t e = 0; e < E; ++e) dlogits[e] = probs[e] * (dlogits[e] - dot);
}

// ---- rotary position embedding ----------------------------------------------------------
// transformers' rotate_half convention: a head of d = 2h values pairs element
// i with i + h, both rotated by the angle of frequency i at the position:
//   out[i]     = x[i] cos - x[i + h] sin
//   out[i + h] = x[i + h] cos + x[i] sin
// Backward applies the transposed rotation (the angle negated).
ZINC_HD float rope_lo(float x_lo, float x_hi, float c, float s) { return x_lo * c - x_hi * s; }
ZINC_HD float rope_hi(float x_lo, float x_hi, float c, float s) { return x_hi * c + x_lo * s; }

// Note [dropout masks]
// Dropout (LoRA's lora_dropout) keeps element i of a stream `key` when a
// hash of (key, i) is at least p 2^32: a counter-based mask, so backward
// and a recomputed forward (activation checkpointing) make the same mask
// again instead of storing it, and the GPU's kernel makes the CPU's. The
// hash is two rounds of a 32-bit integer mixer (xor-shift-multiply, the
// "lowbias32" constants), the element's index entering the first and the
// key's halves one round each; i < 2^32 (the callers check). A kept element
// is scaled by 1 / (1 - p) (inverted dropout, as torch.nn.Dropout).
ZINC_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352dU;
  h ^= h >> 15;
  h *= 0x846ca68bU;
  h ^= h >> 16;
  return h;
}
ZINC_HD bool dropout_keeps(uint64_t key, uint32_t i, uint32_t threshold) {
  return mix32(mix32(i + static_cast<uint32_t>(key)) ^ static_cast<uint32_t>(key >> 32)) >= threshold;
}
// The mask index of element i of a column window (kernels::DropoutColumns:
// cols 0 is the identity).
ZINC_HD uint32_t dropout_index(int64_t i, int64_t cols, int64_t stride, int64_t first) {
  return static_cast<uint32_t>(cols == 0 ? i : (i / cols) * stride + first + i % cols);
}
// p in [0, 1) as the threshold dropout_keeps compares with.
inline uint32_t dropout_threshold(float p) {
  const double t = std::ldexp(static_cast<double>(p), 32);
  return t >= 4294967295.0 ? 0xffffffffU : static_cast<uint32_t>(t);
}
// A key for sub-stream `j` of `key` (a layer's, a target's).
inline uint64_t dropout_subkey(uint64_t key, uint64_t j) {
  uint64_t z = key + 0x9e3779b97f4a7c15ULL * (j + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return (z ^ (z >> 31)) | 1;  // never 0 (0: no dropout)
}

}  // namespace zinc::kernels::math
