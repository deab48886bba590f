// Scalar references of the Llama-family kernels (reference.h): one obvious
// loop nest per formula, sums in double, no threads.
#include <cmath>
#include <vector>

#include "kernels/reference.h"

namespace zinc::kernels::ref {
namespace {

template <class T>
double row_rstd(const T* x, int64_t C, double eps) {
  double sq = 0;
  for (int64_t c = 0; c < C; ++c) sq += static_cast<double>(x[c]) * x[c];
  return 1.0 / std::sqrt(sq / static_cast<double>(C) + eps);
}

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

}  // namespace

template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int64_t N, int64_t C, double eps) {
  for (int64_t i = 0; i < N; ++i) {
    const double r = row_rstd(x + i * C, C, eps);
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = static_cast<T>(w[c] * (x[i * C + c] * r));
    rstd[i] = static_cast<T>(r);
  }
}

template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, int64_t N, int64_t C, double eps) {
  std::vector<double> dwa(static_cast<size_t>(C), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    const T* xi = x + i * C;
    const T* gi = dout + i * C;
    const double r = row_rstd(xi, C, eps);
    // y = w xhat, xhat = x r: dx = r (g - xhat mean(g xhat)), g = dout w.
    double mgx = 0;
    for (int64_t c = 0; c < C; ++c) {
      mgx += static_cast<double>(gi[c]) * w[c] * (xi[c] * r);
      dwa[static_cast<size_t>(c)] += static_cast<double>(gi[c]) * (xi[c] * r);
    }
    mgx /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c)
      dx[i * C + c] = static_cast<T>(dx[i * C + c] + r * (static_cast<double>(gi[c]) * w[c] - xi[c] * r * mgx));
  }
  for (int64_t c = 0; c < C; ++c) dw[c] = static_cast<T>(dw[c] + dwa[static_cast<size_t>(c)]);
}

template <class T>
void swiglu_forward(T* out, const T* gate_up, int64_t N, int64_t I) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < I; ++j) {
      const double g = gate_up[i * 2 * I + j], u = gate_up[i * 2 * I + I + j];
      out[i * I + j] = static_cast<T>(g * sigmoid(g) * u);
    }
}

template <class T>
void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, int64_t N, int64_t I) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < I; ++j) {
      const double g = gate_up[i * 2 * I + j], u = gate_up[i * 2 * I + I + j], d = dout[i * I + j];
      const double s = sigmoid(g);
      dgate_up[i * 2 * I + j] = static_cast<T>(d * u * (s * (1.0 + g * (1.0 - s))));
      dgate_up[i * 2 * I + I + j] = static_cast<T>(d * g * s);
    }
}

template <class T>
void rope(T* x, const T* cos, const T* sin, RopeShape s, bool inverse) {
  const int64_t h = s.rotated() / 2;
  for (int64_t r = 0; r < s.B * s.T; ++r) {
    const int64_t t = r % s.T;
    for (int64_t k = 0; k < s.heads; ++k) {
      T* v = x + r * s.W + s.col + k * s.head_dim;
      for (int64_t i = 0; i < h; ++i) {
        const double c = cos[t * h + i], sn = (inverse ? -1.0 : 1.0) * sin[t * h + i];
        const double a = v[i], b = v[i + h];
        v[i] = static_cast<T>(a * c - b * sn);
        v[i + h] = static_cast<T>(b * c + a * sn);
      }
    }
  }
}

template <class T>
void gqa_expand(T* qkv, const T* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) {
  const int64_t g = H / Hkv, in_w = (H + 2 * Hkv) * hd, out_w = 3 * H * hd;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < H; ++k)
      for (int64_t e = 0; e < hd; ++e) {
        qkv[r * out_w + k * hd + e] = q_kv[r * in_w + k * hd + e];
        qkv[r * out_w + H * hd + k * hd + e] = q_kv[r * in_w + H * hd + (k / g) * hd + e];
        qkv[r * out_w + 2 * H * hd + k * hd + e] = q_kv[r * in_w + (H + Hkv) * hd + (k / g) * hd + e];
      }
}

template <class T>
void gqa_reduce(T* dq_kv, const T* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) {
  const int64_t g = H / Hkv, out_w = (H + 2 * Hkv) * hd, in_w = 3 * H * hd;
  for (int64_t r = 0; r < N; ++r) {
    for (int64_t e = 0; e < out_w; ++e) dq_kv[r * out_w + e] = 0;
    for (int64_t k = 0; k < H; ++k)
      for (int64_t e = 0; e < hd; ++e) {
        dq_kv[r * out_w + k * hd + e] += dqkv[r * in_w + k * hd + e];
        dq_kv[r * out_w + H * hd + (k / g) * hd + e] += dqkv[r * in_w + H * hd + k * hd + e];
        dq_kv[r * out_w + (H + Hkv) * hd + (k / g) * hd + e] += dqkv[r * in_w + 2 * H * hd + k * hd + e];
      }
  }
}

#define ZINC_LLAMA_REF_INSTANTIATE(T)                                                           \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double);       \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, int64_t, double); \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t);                              \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t);                   \
  template void rope<T>(T*, const T*, const T*, RopeShape, bool);                               \
  template void gqa_expand<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t);                \
  template void gqa_reduce<T>(T*, const T*, int64_t, int64_t, int64_t, int64_t);
ZINC_LLAMA_REF_INSTANTIATE(float)
ZINC_LLAMA_REF_INSTANTIATE(double)

}  // namespace zinc::kernels::ref
