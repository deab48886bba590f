// Shared helpers of the kernel tests (kernels_test.cpp, kernels_paths_test.cpp):
// random data, the references' comparisons, and the matmul and attention
// checks. The tolerances are explained at the top of kernels_test.cpp.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <thread>
#include <vector>

#include "core/alloc.h"
#include "core/cpu.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/kernels.h"
#include "kernels/reference.h"

namespace zinc::kernels {

// ---- helpers -------------------------------------------------------------------------

inline std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal()) * scale;
  return v;
}

inline std::vector<int32_t> rand_ints(size_t n, int32_t hi, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(hi)));
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(v[i]);
  return out;
}

inline std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(float_to_bf16(v[i]));
  return out;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Either 16-bit format (t = kBF16 or kF16): the stored bits and the values they hold.
inline std::vector<uint16_t> to_16(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_16(v[i], t);
  return out;
}
inline std::vector<float> round_16(const std::vector<float>& v, DType t) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_16(float_to_16(v[i], t), t);
  return out;
}

inline CView view(const std::vector<float>& v) { return {v.data(), DType::kF32}; }
inline CView view(const std::vector<bf16>& v) { return {v.data(), DType::kBF16}; }

// A parameter held in one dtype: the view the kernel gets, and the exact fp32
// values the reference must see.
struct Param {
  std::vector<float> f32;  // values as the kernel sees them (rounded when 16-bit)
  std::vector<uint16_t> b16;
  DType dtype;
  Param(std::vector<float> v, DType t) : dtype(t) {
    if (is_16bit(t)) {
      b16.resize(v.size());
      f32.resize(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        b16[i] = float_to_16(v[i], t);
        f32[i] = from_16(b16[i], t);
      }
    } else {
      f32 = std::move(v);
    }
  }
  CView view() const { return dtype == DType::kF32 ? CView{f32.data(), dtype} : CView{b16.data(), dtype}; }
};

template <class W>
inline ::testing::AssertionResult AllClose(const float* got, const W* want, size_t n, double atol, double rtol) {
  size_t bad = 0, first = n;
  double max_err = 0;
  for (size_t i = 0; i < n; ++i) {
    double w = static_cast<double>(want[i]);
    double err = std::fabs(static_cast<double>(got[i]) - w);
    bool ok = err <= atol + rtol * std::fabs(w) || (std::isnan(w) && std::isnan(got[i]));
    if (!ok) {
      if (first == n) first = i;
      ++bad;
    }
    if (err > max_err) max_err = err;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << n << " elements differ; first at " << first
                                       << ": got " << got[first] << " want " << want[first]
                                       << " (max abs err " << max_err << ", atol " << atol << ", rtol "
                                       << rtol << ")";
}

template <class A, class B>
inline ::testing::AssertionResult AllClose(const std::vector<A>& got, const std::vector<B>& want, double atol,
                                    double rtol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size mismatch";
  std::vector<float> g(got.begin(), got.end());
  return AllClose(g.data(), want.data(), got.size(), atol, rtol);
}

inline bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Central differences of loss(x) with respect to every element of x.
inline std::vector<double> fd_grad(std::vector<double>& x, const std::function<double()>& loss, double h = 1e-4) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double old = x[i];
    x[i] = old + h;
    double lp = loss();
    x[i] = old - h;
    double lm = loss();
    x[i] = old;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Runs fn with the OpenMP pool limited to n threads, restoring it afterwards.
template <class Fn>
inline void with_threads(int n, Fn&& fn) {
  int old = omp_get_max_threads();
  omp_set_num_threads(n);
  fn();
  omp_set_num_threads(old);
}

constexpr double kFdAtol = 1e-4, kFdRtol = 1e-3;

// ---- matmul ------------------------------------------------------------------------------

struct MmCase {
  int64_t batch, M, N, K;
};
// {2, 37, 53, 19} is the shape whose products oneDNN's AMX kernels got wrong
// (Note [no AMX] in kernels/matmul.cpp).
const MmCase kMmCases[] = {{1, 1, 1, 1},     {1, 7, 17, 33}, {1, 33, 7, 17}, {1, 17, 33, 1},
                           {1, 65, 130, 97}, {3, 7, 17, 33}, {2, 33, 1, 7},  {2, 37, 53, 19}};

// Runs the fast matmul with operands in dtypes (ta, tb) and compute `compute`
// and checks it against the double reference on the values the kernel sees.
inline void check_matmul(MatmulDesc d, DType a_dtype, DType b_dtype, uint64_t seed) {
  const size_t na = d.batch * d.M * d.K, nb = d.batch * d.K * d.N, nc = d.batch * d.M * d.N;
  auto a = randn(na, seed), b = randn(nb, seed + 1), c0 = randn(nc, seed + 2);
  // The reference sees the values after the conversion to `compute` (an
  // operand stored in 16 bits is already rounded to its own format).
  auto seen = [&](const std::vector<float>& v, DType t) {
    if (is_16bit(t)) return round_16(v, t);
    return is_16bit(d.compute) ? round_16(v, d.compute) : v;
  };
  auto a_seen = seen(a, a_dtype), b_seen = seen(b, b_dtype);
  auto a16 = to_16(a, is_16bit(a_dtype) ? a_dtype : DType::kBF16);
  auto b16 = to_16(b, is_16bit(b_dtype) ? b_dtype : DType::kBF16);
  CView av = a_dtype == DType::kF32 ? view(a) : CView{a16.data(), a_dtype};
  CView bv = b_dtype == DType::kF32 ? view(b) : CView{b16.data(), b_dtype};
  std::vector<float> c = c0;
  matmul(d, av, bv, c.data());
  auto ad = to_double(a_seen), bd = to_double(b_seen), cd = to_double(c0);
  ref::matmul(d, ad.data(), bd.data(), cd.data());
  EXPECT_TRUE(AllClose(c.data(), cd.data(), nc, 1e-5 * d.K, 1e-5))
      << "batch=" << d.batch << " M=" << d.M << " N=" << d.N << " K=" << d.K << " ta=" << d.trans_a
      << " tb=" << d.trans_b << " acc=" << d.accumulate << " alpha=" << d.alpha
      << " compute=" << dtype_name(d.compute);
}

// ---- attention --------------------------------------------------------------------------------

const AttentionShape kAttShapes[] = {{1, 1, 4, 1}, {2, 7, 12, 3}, {1, 17, 16, 2}, {2, 33, 8, 1},
                                     {1, 65, 64, 2}};

struct Workspace {
  AttentionWorkspace* ws = attention_workspace_create();
  ~Workspace() { attention_workspace_destroy(ws); }
};

inline void check_attention(AttentionShape s, DType compute, uint64_t seed, double tol) {
  const size_t n_qkv = s.B * s.T * 3 * s.C, n_out = s.B * s.T * s.C;
  auto qkv = randn(n_qkv, seed), dout = randn(n_out, seed + 1);
  // 16-bit compute rounds q, k, v (and dout for backward); the reference sees them rounded.
  auto qkv_seen = is_16bit(compute) ? round_16(qkv, compute) : qkv;
  auto dout_seen = is_16bit(compute) ? round_16(dout, compute) : dout;
  Workspace w;
  std::vector<float> out(n_out), dqkv(n_qkv, 123.0f);  // dqkv is written, not accumulated
  attention_forward(w.ws, out.data(), qkv.data(), s, compute);
  attention_backward(w.ws, dqkv.data(), dout.data(), qkv.data(), s, compute);
  auto qd = to_double(qkv_seen), gd = to_double(dout_seen);
  std::vector<double> rout(n_out), rdqkv(n_qkv);
  ref::attention_forward(rout.data(), qd.data(), s);
  ref::attention_backward(rdqkv.data(), gd.data(), qd.data(), s);
  EXPECT_TRUE(AllClose(out.data(), rout.data(), n_out, tol, tol))
      << "B=" << s.B << " T=" << s.T << " C=" << s.C << " H=" << s.H << " " << dtype_name(compute);
  EXPECT_TRUE(AllClose(dqkv.data(), rdqkv.data(), n_qkv, tol, tol))
      << "B=" << s.B << " T=" << s.T << " C=" << s.C << " H=" << s.H << " " << dtype_name(compute);
}

}  // namespace zinc::kernels
