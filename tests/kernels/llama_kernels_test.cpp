// Tests for the Llama-family kernels (kernels/llama_layers.cpp): each against
// its scalar reference (kernels/llama_reference.cpp) on awkward sizes, each
// backward against central finite differences of the double reference
// forward (or, for the linear maps, the adjoint identity), and every ISA
// variant against the baseline bit for bit. Tolerances as kernels_test.cpp's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/cpu.h"
#include "kernels/kernels.h"
#include "kernels/reference.h"
#include "kernels_test_util.h"

namespace zinc::kernels {
namespace {

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// cos/sin tables (T, hd/2) of plain rope at base 10000.
void rope_tables(int64_t T, int64_t hd, std::vector<float>& c, std::vector<float>& s) {
  const int64_t h = hd / 2;
  c.resize(static_cast<size_t>(T * h));
  s.resize(c.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < h; ++i) {
      const double a = static_cast<double>(t) * std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
      c[static_cast<size_t>(t * h + i)] = static_cast<float>(std::cos(a));
      s[static_cast<size_t>(t * h + i)] = static_cast<float>(std::sin(a));
    }
}

TEST(RmsNorm, ForwardAndBackwardAgreeWithReference) {
  for (DType wt : {DType::kF32, DType::kBF16}) {
    for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 1}, {7, 33}, {37, 133}, {5, 1024}}) {
      auto x = randn(static_cast<size_t>(N * C), 11, 2.0f), dout = randn(static_cast<size_t>(N * C), 12);
      Param w(randn(static_cast<size_t>(C), 13, 0.5f), wt);
      for (float& v : w.f32) v += 1.0f;
      if (is_16bit(wt)) w = Param(w.f32, wt);
      std::vector<float> out(x.size()), rstd(static_cast<size_t>(N)), dx(x.size(), 0.25f), dw(static_cast<size_t>(C), -0.5f);
      rmsnorm_forward(out.data(), rstd.data(), x.data(), w.view(), N, C, 1e-5f);
      rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.view(), rstd.data(), N, C);
      auto xd = to_double(x), wd = to_double(w.f32), gd = to_double(dout);
      std::vector<double> ro(x.size()), rr(static_cast<size_t>(N)), rdx(x.size(), 0.25), rdw(static_cast<size_t>(C), -0.5);
      ref::rmsnorm_forward(ro.data(), rr.data(), xd.data(), wd.data(), N, C, 1e-5);
      ref::rmsnorm_backward(rdx.data(), rdw.data(), gd.data(), xd.data(), wd.data(), N, C, 1e-5);
      EXPECT_TRUE(AllClose(out, ro, 1e-5, 1e-5)) << N << "x" << C;
      EXPECT_TRUE(AllClose(rstd, rr, 1e-6, 1e-5)) << N << "x" << C;
      EXPECT_TRUE(AllClose(dx, rdx, 1e-5, 1e-4)) << N << "x" << C;
      EXPECT_TRUE(AllClose(dw, rdw, 1e-4, 1e-4)) << N << "x" << C;
    }
  }
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  const int64_t N = 3, C = 19;
  auto xf = randn(N * C, 21), wf = randn(C, 22), gf = randn(N * C, 23);
  std::vector<double> x = to_double(xf), w = to_double(wf), g = to_double(gf);
  auto loss = [&] {
    std::vector<double> out(N * C), r(N);
    ref::rmsnorm_forward(out.data(), r.data(), x.data(), w.data(), N, C, 1e-5);
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += g[i] * out[i];
    return l;
  };
  std::vector<double> fd_x = fd_grad(x, loss), fd_w = fd_grad(w, loss);
  std::vector<float> out(N * C), rstd(N), dx(N * C, 0.0f), dw(C, 0.0f);
  rmsnorm_forward(out.data(), rstd.data(), xf.data(), view(wf), N, C, 1e-5f);
  rmsnorm_backward(dx.data(), dw.data(), gf.data(), xf.data(), view(wf), rstd.data(), N, C);
  EXPECT_TRUE(AllClose(dx, fd_x, 1e-4, 1e-3));
  EXPECT_TRUE(AllClose(dw, fd_w, 1e-4, 1e-3));
}

// Gemma's norm scales by 1 + w: the same as the Llama's with the weight
// 1 + w, and its dw is the Llama's (d(1 + w) = dw), in bf16 weights too.
TEST(RmsNorm, WeightOffsetIsTheNormOfOnePlusW) {
  for (DType wt : {DType::kF32, DType::kBF16}) {
    const int64_t N = 9, C = 45;
    auto x = randn(static_cast<size_t>(N * C), 14, 2.0f), dout = randn(static_cast<size_t>(N * C), 15);
    Param w(randn(static_cast<size_t>(C), 16, 0.3f), wt);
    std::vector<float> shifted(w.f32);
    for (float& v : shifted) v = 1.0f + v;
    std::vector<float> out(x.size()), rstd(N), dx(x.size(), 0.25f), dw(C, -0.5f);
    std::vector<float> want(x.size()), wrstd(N), wdx(x.size(), 0.25f), wdw(C, -0.5f);
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.view(), N, C, 1e-6f, 1.0f);
    rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), w.view(), rstd.data(), N, C, 1.0f);
    rmsnorm_forward(want.data(), wrstd.data(), x.data(), view(shifted), N, C, 1e-6f);
    rmsnorm_backward(wdx.data(), wdw.data(), dout.data(), x.data(), view(shifted), wrstd.data(), N, C);
    EXPECT_TRUE(BitEqual(out, want)) << dtype_name(wt);
    EXPECT_TRUE(BitEqual(dx, wdx)) << dtype_name(wt);
    EXPECT_TRUE(BitEqual(dw, wdw)) << dtype_name(wt);
    // ... and not the norm of w itself.
    rmsnorm_forward(want.data(), wrstd.data(), x.data(), w.view(), N, C, 1e-6f);
    EXPECT_FALSE(BitEqual(out, want));
  }
}

// GeGLU (Gemma's MLP): gelu_tanh(gate) * up against the double formula and
// central finite differences.
TEST(GeGlu, ForwardAndBackwardAgreeWithTheFormulaAndFiniteDifferences) {
  auto gelu = [](double v) { return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))); };
  const int64_t N = 7, I = 29;
  auto gu = randn(N * 2 * I, 17, 3.0f), dout = randn(N * I, 18);
  std::vector<float> out(N * I), dgu(gu.size(), 9.0f);  // dgu is written, not accumulated
  geglu_forward(out.data(), gu.data(), N, I);
  geglu_backward(dgu.data(), dout.data(), gu.data(), N, I);
  std::vector<double> ro(out.size());
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < I; ++j) ro[i * I + j] = gelu(gu[i * 2 * I + j]) * gu[i * 2 * I + I + j];
  EXPECT_TRUE(AllClose(out, ro, 1e-5, 1e-5));
  std::vector<double> x = to_double(gu), g = to_double(dout);
  auto loss = [&] {
    double l = 0;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < I; ++j) l += g[i * I + j] * gelu(x[i * 2 * I + j]) * x[i * 2 * I + I + j];
    return l;
  };
  EXPECT_TRUE(AllClose(dgu, fd_grad(x, loss), 1e-4, 1e-3));
}

// Exact GELU (GPT-NeoX's "gelu"): x Phi(x) against std::erf in double, its
// backward against the derivative and central finite differences.
TEST(GeluErf, ForwardAndBackwardAgreeWithErfAndFiniteDifferences) {
  auto x = randn(2001, 24, 3.0f), g = randn(2001, 25);
  x[0] = 0.0f;
  x[1] = -9.0f;  // Phi underflows: exp_f's clamp
  x[2] = 12.0f;
  std::vector<float> y(x.size()), dx(x.size(), 7.0f);  // dx is written, not accumulated
  gelu_erf_forward(y.data(), x.data(), static_cast<int64_t>(x.size()));
  gelu_erf_backward(dx.data(), x.data(), g.data(), static_cast<int64_t>(x.size()));
  std::vector<double> ry(x.size()), rdx(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double v = x[i], cdf = 0.5 * (1.0 + std::erf(v / std::sqrt(2.0)));
    ry[i] = v * cdf;
    rdx[i] = g[i] * (cdf + v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * M_PI));
  }
  EXPECT_TRUE(AllClose(y, ry, 1e-6, 1e-5));
  EXPECT_TRUE(AllClose(dx, rdx, 1e-6, 1e-5));
  // ... and not GELU's tanh form, which differs by up to ~5e-4 here.
  std::vector<float> tanh_form(x.size());
  gelu_forward(tanh_form.data(), x.data(), static_cast<int64_t>(x.size()));
  double most = 0;
  for (size_t i = 0; i < x.size(); ++i) most = std::max(most, std::fabs(static_cast<double>(tanh_form[i]) - y[i]));
  EXPECT_GT(most, 1e-4);
}

// Soft-capping: cap tanh(x / cap), and its backward from the capped values.
TEST(Softcap, ForwardAndBackwardAgreeWithTheFormulaAndFiniteDifferences) {
  const float cap = 2.5f;
  auto x = randn(1001, 19, 4.0f), g = randn(1001, 20);
  std::vector<float> y = x, dx = g;
  softcap_forward(y.data(), cap, static_cast<int64_t>(y.size()));
  softcap_backward(dx.data(), y.data(), cap, static_cast<int64_t>(y.size()));
  std::vector<double> ry(x.size()), rdx(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double t = std::tanh(static_cast<double>(x[i]) / cap);
    ry[i] = cap * t;
    rdx[i] = g[i] * (1.0 - t * t);
  }
  EXPECT_TRUE(AllClose(y, ry, 1e-6, 1e-6));
  EXPECT_TRUE(AllClose(dx, rdx, 1e-6, 1e-5));
  EXPECT_THROW(softcap_forward(y.data(), 0.0f, 1), Error);
}

TEST(SwiGlu, ForwardAndBackwardAgreeWithReferenceAndFiniteDifferences) {
  const int64_t N = 13, I = 77;
  auto gu = randn(N * 2 * I, 31, 3.0f), dout = randn(N * I, 32);
  gu[0] = 40.0f;   // sigmoid saturates at 1
  gu[1] = -40.0f;  // ... and at 0
  std::vector<float> out(N * I), dgu(gu.size());
  swiglu_forward(out.data(), gu.data(), N, I);
  swiglu_backward(dgu.data(), dout.data(), gu.data(), N, I);
  auto gud = to_double(gu), dd = to_double(dout);
  std::vector<double> ro(out.size()), rd(gu.size());
  ref::swiglu_forward(ro.data(), gud.data(), N, I);
  ref::swiglu_backward(rd.data(), dd.data(), gud.data(), N, I);
  EXPECT_TRUE(AllClose(out, ro, 1e-5, 1e-5));
  EXPECT_TRUE(AllClose(dgu, rd, 1e-5, 1e-5));

  const int64_t n = 2, i = 5;
  std::vector<double> x = to_double(randn(n * 2 * i, 33, 2.0f)), g = to_double(randn(n * i, 34));
  auto loss = [&] {
    std::vector<double> o(n * i);
    ref::swiglu_forward(o.data(), x.data(), n, i);
    double l = 0;
    for (size_t k = 0; k < o.size(); ++k) l += g[k] * o[k];
    return l;
  };
  std::vector<double> fd = fd_grad(x, loss);
  std::vector<float> xf(x.begin(), x.end()), gf(g.begin(), g.end()), dx(xf.size());
  swiglu_backward(dx.data(), gf.data(), xf.data(), n, i);
  EXPECT_TRUE(AllClose(dx, fd, 1e-4, 1e-3));
}

// Partial rotary embeddings (Phi-3, GPT-NeoX): the first rotary_dim values
// of each head rotate (pairs i, i + rotary_dim/2, tables of rotary_dim/2),
// the rest of the head is untouched; against the reference, and the inverse
// undoes it.
TEST(Rope, PartialRotaryRotatesTheFirstDimsOfEachHead) {
  const int64_t B = 2, T = 9, hd = 12, rd = 8, W = 4 * hd;
  std::vector<float> c, s;
  rope_tables(T, rd, c, s);
  const RopeShape sh{B, T, W, hd, 3, hd, nullptr, rd};
  auto x = randn(B * T * W, 43);
  std::vector<float> got = x;
  rope(got.data(), c.data(), s.data(), sh, false);
  std::vector<double> want = to_double(x), cd = to_double(c), sd = to_double(s);
  ref::rope(want.data(), cd.data(), sd.data(), sh, false);
  EXPECT_TRUE(AllClose(got, want, 1e-6, 1e-5));
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t j = 0; j < W; ++j) {
      const bool rotated = j >= hd && (j - hd) % hd < rd;
      if (!rotated) ASSERT_EQ(got[r * W + j], x[r * W + j]) << r << ":" << j;
      if (rotated && r % T > 0) ASSERT_NE(got[r * W + j], x[r * W + j]) << r << ":" << j;
    }
  rope(got.data(), c.data(), s.data(), sh, true);
  EXPECT_TRUE(AllClose(got, to_double(x), 1e-5, 1e-5));
}

TEST(Rope, AgreesWithReferenceAndBackwardIsTheTranspose) {
  // A fused row [q (3 heads) | k (1 head) | v (1 head)] of head_dim 10.
  const int64_t B = 2, T = 7, hd = 10, W = 5 * hd;
  std::vector<float> c, s;
  rope_tables(T, hd, c, s);
  for (RopeShape sh : {RopeShape{B, T, W, 0, 3, hd}, RopeShape{B, T, W, 3 * hd, 1, hd}}) {
    auto x = randn(B * T * W, 41);
    std::vector<float> got = x;
    rope(got.data(), c.data(), s.data(), sh, false);
    std::vector<double> want = to_double(x), cd = to_double(c), sd = to_double(s);
    ref::rope(want.data(), cd.data(), sd.data(), sh, false);
    EXPECT_TRUE(AllClose(got, want, 1e-6, 1e-5));
    // Columns outside the rotated heads are untouched.
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t j = 0; j < W; ++j)
        if (j < sh.col || j >= sh.col + sh.heads * hd) {
          ASSERT_EQ(got[r * W + j], x[r * W + j]);
        }
    // <rope(x), y> == <x, rope_inverse(y)>: backward is the transposed map.
    auto y = randn(x.size(), 42);
    std::vector<float> yi = y;
    rope(yi.data(), c.data(), s.data(), sh, true);
    EXPECT_NEAR(dot(got, y), dot(x, yi), 1e-4 * std::sqrt(static_cast<double>(x.size())));
    // The rotation is orthogonal: the inverse undoes it.
    rope(got.data(), c.data(), s.data(), sh, true);
    EXPECT_TRUE(AllClose(got, to_double(x), 1e-5, 1e-5));
  }
  std::vector<float> x(10);
  EXPECT_THROW(rope(x.data(), c.data(), s.data(), RopeShape{1, 1, 10, 0, 1, 9}, false), Error);
  EXPECT_THROW(rope(x.data(), c.data(), s.data(), RopeShape{1, 1, 10, 0, 1, 10, nullptr, 5}, false), Error);
  EXPECT_THROW(rope(x.data(), c.data(), s.data(), RopeShape{1, 1, 10, 0, 1, 10, nullptr, 12}, false), Error);
  EXPECT_THROW(rope(x.data(), c.data(), s.data(), RopeShape{1, 1, 10, 2, 1, 10}, false), Error);
}

TEST(GroupedQueryHeads, ExpandAndReduceAgreeWithReferenceAndAreAdjoint) {
  const int64_t N = 9, hd = 6;
  for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{4, 4}, {4, 2}, {6, 1}, {8, 2}}) {
    auto in = randn(N * (H + 2 * Hkv) * hd, 51);
    std::vector<float> out(N * 3 * H * hd);
    gqa_expand(out.data(), in.data(), N, H, Hkv, hd);
    std::vector<double> rin = to_double(in), rout(out.size());
    ref::gqa_expand(rout.data(), rin.data(), N, H, Hkv, hd);
    EXPECT_TRUE(AllClose(out, rout, 0, 0)) << H << ":" << Hkv;
    auto d = randn(out.size(), 52);
    std::vector<float> red(in.size(), 7.0f);  // written, not accumulated
    gqa_reduce(red.data(), d.data(), N, H, Hkv, hd);
    std::vector<double> dd = to_double(d), rred(in.size());
    ref::gqa_reduce(rred.data(), dd.data(), N, H, Hkv, hd);
    EXPECT_TRUE(AllClose(red, rred, 1e-6, 1e-6)) << H << ":" << Hkv;
    EXPECT_NEAR(dot(out, d), dot(in, red), 1e-4 * static_cast<double>(in.size()));
  }
  std::vector<float> a(100), b(100);
  EXPECT_THROW(gqa_expand(a.data(), b.data(), 1, 3, 2, 2), Error);
}

// Every Llama kernel at every ISA level the CPU has gives the baseline's bits.
std::vector<std::vector<float>> run_llama_kernels() {
  std::vector<std::vector<float>> o;
  const int64_t N = 37, C = 133, I = 91;
  auto x = randn(N * C, 61), w = randn(C, 62), dout = randn(N * C, 63);
  std::vector<float> out(N * C), rstd(N), dx(N * C, 0.5f), dw(C, 0.25f);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), view(w), N, C, 1e-6f);
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), view(w), rstd.data(), N, C);
  for (auto* v : {&out, &rstd, &dx, &dw}) o.push_back(*v);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), view(w), N, C, 1e-6f, 1.0f);
  rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), view(w), rstd.data(), N, C, 1.0f);
  for (auto* v : {&out, &rstd, &dx, &dw}) o.push_back(*v);
  {
    auto ggu = randn(N * 2 * I, 67, 4.0f), gdo = randn(N * I, 68);
    std::vector<float> gact(N * I), gdgu(ggu.size());
    geglu_forward(gact.data(), ggu.data(), N, I);
    geglu_backward(gdgu.data(), gdo.data(), ggu.data(), N, I);
    o.push_back(gact);
    o.push_back(gdgu);
    std::vector<float> capped = ggu, dcap = gdgu;
    softcap_forward(capped.data(), 3.0f, static_cast<int64_t>(capped.size()));
    softcap_backward(dcap.data(), capped.data(), 3.0f, static_cast<int64_t>(capped.size()));
    o.push_back(capped);
    o.push_back(dcap);
    gelu_erf_forward(capped.data(), ggu.data(), static_cast<int64_t>(ggu.size()));
    gelu_erf_backward(dcap.data(), ggu.data(), gdgu.data(), static_cast<int64_t>(ggu.size()));
    o.push_back(capped);
    o.push_back(dcap);
  }
  auto gu = randn(N * 2 * I, 64, 4.0f), sdo = randn(N * I, 65);
  std::vector<float> act(N * I), dgu(gu.size());
  swiglu_forward(act.data(), gu.data(), N, I);
  swiglu_backward(dgu.data(), sdo.data(), gu.data(), N, I);
  o.push_back(act);
  o.push_back(dgu);
  const int64_t T = 37, hd = 38, H = 4, Hkv = 2;
  std::vector<float> c, s;
  rope_tables(T, hd, c, s);
  auto qkv = randn(T * (H + 2 * Hkv) * hd, 66);
  rope(qkv.data(), c.data(), s.data(), {1, T, (H + 2 * Hkv) * hd, 0, H + Hkv, hd}, false);
  o.push_back(qkv);
  rope(qkv.data(), c.data(), s.data(), {1, T, (H + 2 * Hkv) * hd, 0, H, hd}, true);
  o.push_back(qkv);
  rope(qkv.data(), c.data(), s.data(), {1, T, (H + 2 * Hkv) * hd, 0, H + Hkv, hd, nullptr, hd - 10}, false);
  o.push_back(qkv);
  std::vector<float> big(T * 3 * H * hd), red(qkv.size());
  gqa_expand(big.data(), qkv.data(), T, H, Hkv, hd);
  gqa_reduce(red.data(), big.data(), T, H, Hkv, hd);
  o.push_back(big);
  o.push_back(red);
  return o;
}

class LlamaIsaVariants : public testing::TestWithParam<CpuIsa> {};

TEST_P(LlamaIsaVariants, ReproduceTheBaselineBitForBit) {
  const CpuIsa isa = GetParam();
  if (isa > cpu_isa()) GTEST_SKIP() << cpu_isa_name(isa) << " cannot run here: " << cpu_isa_missing(isa);
  detail::set_dispatch_isa_for_testing(CpuIsa::kBaseline);
  auto base = run_llama_kernels();
  detail::set_dispatch_isa_for_testing(isa);
  auto got = run_llama_kernels();
  detail::reset_dispatch_isa_for_testing();
  ASSERT_EQ(base.size(), got.size());
  for (size_t i = 0; i < base.size(); ++i)
    EXPECT_EQ(std::memcmp(base[i].data(), got[i].data(), base[i].size() * 4), 0)
        << "output " << i << " differs at " << cpu_isa_name(isa);
}

INSTANTIATE_TEST_SUITE_P(Kernels, LlamaIsaVariants, testing::Values(CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const testing::TestParamInfo<CpuIsa>& i) {
                           return std::string(cpu_isa_name(i.param));
                         });

}  // namespace
}  // namespace zinc::kernels
