#include "kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace zinc::kernels::ref {

template <class T>
void matmul(const MatmulDesc& d, const T* a, const T* b, T* c) {
  for (int64_t bt = 0; bt < d.batch; ++bt) {
    const T* A = a + bt * d.M * d.K;
    const T* B = b + bt * d.K * d.N;
    T* Cm = c + bt * d.M * d.N;
    for (int64_t i = 0; i < d.M; ++i) {
      for (int64_t j = 0; j < d.N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < d.K; ++k) {
          double av = d.trans_a ? A[k * d.M + i] : A[i * d.K + k];
          double bv = d.trans_b ? B[j * d.K + k] : B[k * d.N + j];
          s += av * bv;
        }
        s *= d.alpha;
        if (d.accumulate) s += Cm[i * d.N + j];
        Cm[i * d.N + j] = static_cast<T>(s);
      }
    }
  }
}

template <class T>
void add_bias(T* y, const T* bias, int64_t M, int64_t N) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) y[i * N + j] += bias[j];
}

template <class T>
void bias_backward(T* dbias, const T* dy, int64_t M, int64_t N) {
  for (int64_t j = 0; j < N; ++j) {
    double s = 0;
    for (int64_t i = 0; i < M; ++i) s += dy[i * N + j];
    dbias[j] = static_cast<T>(dbias[j] + s);
  }
}

namespace {
template <class T>
void row_stats(const T* x, int64_t C, double eps, double& mean, double& rstd) {
  double m = 0;
  for (int64_t c = 0; c < C; ++c) m += x[c];
  m /= static_cast<double>(C);
  double v = 0;
  for (int64_t c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
  v /= static_cast<double>(C);
  mean = m;
  rstd = 1.0 / std::sqrt(v + eps);
}
}  // namespace

template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, double eps) {
  for (int64_t i = 0; i < N; ++i) {
    const T* xi = x + i * C;
    double m, r;
    row_stats(xi, C, eps, m, r);
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = static_cast<T>((xi[c] - m) * r * w[c] + b[c]);
    mean[i] = static_cast<T>(m);
    rstd[i] = static_cast<T>(r);
  }
}

template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dout, const T* x, const T* w, int64_t N,
                        int64_t C, double eps) {
  std::vector<double> dwa(C, 0.0), dba(C, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    const T* xi = x + i * C;
    const T* gi = dout + i * C;
    double m, r;
    row_stats(xi, C, eps, m, r);
    // y = xhat w + b, xhat = (x - m) r. With g = dout w:
    // dx = r (g - mean(g) - xhat mean(g xhat)).
    double mg = 0, mgx = 0;
    for (int64_t c = 0; c < C; ++c) {
      double xhat = (xi[c] - m) * r;
      double g = static_cast<double>(gi[c]) * w[c];
      mg += g;
      mgx += g * xhat;
      dwa[c] += gi[c] * xhat;
      dba[c] += gi[c];
    }
    mg /= static_cast<double>(C);
    mgx /= static_cast<double>(C);
    for (int64_t c = 0; c < C; ++c) {
      double xhat = (xi[c] - m) * r;
      double g = static_cast<double>(gi[c]) * w[c];
      dx[i * C + c] = static_cast<T>(dx[i * C + c] + r * (g - mg - xhat * mgx));
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    dw[c] = static_cast<T>(dw[c] + dwa[c]);
    db[c] = static_cast<T>(db[c] + dba[c]);
  }
}

template <class T>
void gelu_forward(T* out, const T* x, int64_t n) {
  const double k = std::sqrt(2.0 / M_PI);
  for (int64_t i = 0; i < n; ++i) {
    double v = x[i];
    out[i] = static_cast<T>(0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v))));
  }
}

template <class T>
void gelu_backward(T* dx, const T* x, const T* dout, int64_t n) {
  const double k = std::sqrt(2.0 / M_PI);
  for (int64_t i = 0; i < n; ++i) {
    double v = x[i];
    double t = std::tanh(k * (v + 0.044715 * v * v * v));
    double dudx = k * (1.0 + 3.0 * 0.044715 * v * v);
    double g = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * dudx;
    dx[i] = static_cast<T>(g * dout[i]);
  }
}

// AttentionShape's score scale, window and soft-cap, in double (positions
// are not modelled: one document per row).
inline double ref_score_scale(AttentionShape s) {
  return s.scale > 0 ? static_cast<double>(s.scale) : 1.0 / std::sqrt(static_cast<double>(s.C / s.H));
}
inline int64_t ref_first_key(AttentionShape s, int64_t t) {
  return s.window > 0 ? std::max<int64_t>(0, t - s.window + 1) : 0;
}
inline double ref_softcap(double x, float cap) { return cap > 0 ? cap * std::tanh(x / cap) : x; }

template <class T>
void attention_forward(T* out, const T* qkv, AttentionShape s) {
  const int64_t hs = s.C / s.H;
  const double scale = ref_score_scale(s);
  std::vector<double> p(s.T);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        const T* q = qkv + (b * s.T + t) * 3 * s.C + h * hs;
        const int64_t j0 = ref_first_key(s, t);
        double mx = -INFINITY;
        for (int64_t j = j0; j <= t; ++j) {
          const T* k = qkv + (b * s.T + j) * 3 * s.C + s.C + h * hs;
          double dot = 0;
          for (int64_t i = 0; i < hs; ++i) dot += static_cast<double>(q[i]) * k[i];
          p[j] = ref_softcap(dot * scale, s.softcap);
          if (p[j] > mx) mx = p[j];
        }
        double sum = 0;
        for (int64_t j = j0; j <= t; ++j) sum += (p[j] = std::exp(p[j] - mx));
        T* o = out + (b * s.T + t) * s.C + h * hs;
        for (int64_t i = 0; i < hs; ++i) {
          double acc = 0;
          for (int64_t j = j0; j <= t; ++j)
            acc += p[j] / sum * qkv[(b * s.T + j) * 3 * s.C + 2 * s.C + h * hs + i];
          o[i] = static_cast<T>(acc);
        }
      }
}

template <class T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, AttentionShape s) {
  const int64_t hs = s.C / s.H;
  const double scale = ref_score_scale(s);
  std::vector<double> acc(static_cast<size_t>(s.B * s.T * 3 * s.C), 0.0);
  std::vector<double> p(s.T), dp(s.T), raw(s.T);
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t i) {
    return (b * s.T + t) * 3 * s.C + part * s.C + h * hs + i;
  };
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t j0 = ref_first_key(s, t);
        double mx = -INFINITY;
        for (int64_t j = j0; j <= t; ++j) {
          double dot = 0;
          for (int64_t i = 0; i < hs; ++i)
            dot += static_cast<double>(qkv[at(b, t, 0, h, i)]) * qkv[at(b, j, 1, h, i)];
          raw[j] = dot * scale;
          p[j] = ref_softcap(raw[j], s.softcap);
          if (p[j] > mx) mx = p[j];
        }
        double sum = 0;
        for (int64_t j = j0; j <= t; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t j = j0; j <= t; ++j) p[j] /= sum;
        const T* go = dout + (b * s.T + t) * s.C + h * hs;
        double pdp = 0;
        for (int64_t j = j0; j <= t; ++j) {
          double d = 0;
          for (int64_t i = 0; i < hs; ++i) {
            d += static_cast<double>(go[i]) * qkv[at(b, j, 2, h, i)];
            acc[at(b, j, 2, h, i)] += p[j] * go[i];  // dv
          }
          dp[j] = d;
          pdp += p[j] * d;
        }
        for (int64_t j = j0; j <= t; ++j) {
          double ds = p[j] * (dp[j] - pdp) * scale;
          if (s.softcap > 0) {
            const double th = std::tanh(raw[j] / s.softcap);
            ds *= 1.0 - th * th;
          }
          for (int64_t i = 0; i < hs; ++i) {
            acc[at(b, t, 0, h, i)] += ds * qkv[at(b, j, 1, h, i)];  // dq
            acc[at(b, j, 1, h, i)] += ds * qkv[at(b, t, 0, h, i)];  // dk
          }
        }
      }
  for (size_t i = 0; i < acc.size(); ++i) dqkv[i] = static_cast<T>(acc[i]);
}

template <class T>
double cross_entropy(const T* logits, const int32_t* targets, int64_t N, int64_t V, T* dlogits,
                     double dloss_scale) {
  double total = 0;
  for (int64_t i = 0; i < N; ++i) {
    const T* x = logits + i * V;
    double mx = -INFINITY;
    for (int64_t j = 0; j < V; ++j) mx = x[j] > mx ? static_cast<double>(x[j]) : mx;
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - mx);
    total += std::log(sum) + mx - x[targets[i]];
    if (dlogits) {
      for (int64_t j = 0; j < V; ++j) {
        double g = std::exp(x[j] - mx) / sum - (j == targets[i] ? 1.0 : 0.0);
        dlogits[i * V + j] = static_cast<T>(g * dloss_scale / static_cast<double>(N));
      }
    }
  }
  return N > 0 ? total / static_cast<double>(N) : 0.0;
}

template <class T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t B,
                       int64_t T_, int64_t C) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t c = 0; c < C; ++c) {
        double v = wte[tokens[b * T_ + t] * C + c];
        if (wpe) v += wpe[t * C + c];
        out[(b * T_ + t) * C + c] = static_cast<T>(v);
      }
}

template <class T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B,
                        int64_t T_, int64_t C) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t c = 0; c < C; ++c) {
        T g = dout[(b * T_ + t) * C + c];
        dwte[tokens[b * T_ + t] * C + c] += g;
        if (dwpe) dwpe[t * C + c] += g;
      }
}

template <class T>
void add(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
template <class T>
void accumulate(T* y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}
template <class T>
void scale(T* x, T alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
}
template <class T>
void axpy(T* y, T alpha, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
template <class T>
double squared_norm(const T* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}
template <class T>
bool all_finite(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

#define ZINC_REF_INSTANTIATE(T)                                                                  \
  template void matmul<T>(const MatmulDesc&, const T*, const T*, T*);                            \
  template void add_bias<T>(T*, const T*, int64_t, int64_t);                                     \
  template void bias_backward<T>(T*, const T*, int64_t, int64_t);                                \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, \
                                     double);                                                    \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t,        \
                                      int64_t, double);                                          \
  template void gelu_forward<T>(T*, const T*, int64_t);                                          \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);                               \
  template void attention_forward<T>(T*, const T*, AttentionShape);                              \
  template void attention_backward<T>(T*, const T*, const T*, AttentionShape);                   \
  template double cross_entropy<T>(const T*, const int32_t*, int64_t, int64_t, T*, double);      \
  template void embedding_forward<T>(T*, const int32_t*, const T*, const T*, int64_t, int64_t,  \
                                     int64_t);                                                   \
  template void embedding_backward<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t,       \
                                      int64_t);                                                  \
  template void add<T>(T*, const T*, const T*, int64_t);                                         \
  template void accumulate<T>(T*, const T*, int64_t);                                            \
  template void scale<T>(T*, T, int64_t);                                                        \
  template void axpy<T>(T*, T, const T*, int64_t);                                               \
  template double squared_norm<T>(const T*, int64_t);                                            \
  template bool all_finite<T>(const T*, int64_t);

ZINC_REF_INSTANTIATE(float)
ZINC_REF_INSTANTIATE(double)
#undef ZINC_REF_INSTANTIATE

}  // namespace zinc::kernels::ref
