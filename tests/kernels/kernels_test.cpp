// Tests for csrc/kernels: every kernel against its scalar reference
// (kernels/reference.h) on awkward sizes, every backward against central
// finite differences of the double-precision reference forward.
//
// Tolerances, and why:
// - fp32 kernels vs the double reference: |got - want| <= atol + rtol |want|
//   with atol, rtol around 1e-5..1e-4: the kernels round to fp32 and sum in a
//   different order (lanes, blocking); errors grow with the reduction length.
// - bf16 matmul vs a reference on bf16-ROUNDED inputs: the products of two
//   bf16 values are exact in fp32, so only fp32 accumulation error remains and
//   the fp32 tolerance applies.
// - bf16 attention rounds P (and dS) to bf16 inside, which a reference on
//   rounded q, k, v does not see: 2^-8 relative per element, so ~2e-2.
// - Finite differences: the loss L = sum(G * f(x)) is evaluated in double with
//   the reference forward and h = 1e-4 (truncation ~h^2 |f'''| ~ 1e-8,
//   round-off ~1e-16/h ~ 1e-12), so the FD gradient is exact to ~1e-7 and the
//   tolerance is that of the fp32 analytic gradient: atol 1e-4, rtol 1e-3.
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
#include "kernels/math.h"
#include "kernels/reference.h"

#include "kernels_test_util.h"

namespace zinc::kernels {
namespace {

// ---- bias -------------------------------------------------------------------------------

TEST(Bias, AddBiasAgreesWithReference) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (auto [M, N] : {std::pair<int64_t, int64_t>{0, 5}, {1, 1}, {7, 17}, {33, 65}, {1000, 33}}) {
      Param bias(randn(N, 10 + M), dt);
      auto y = randn(M * N, 20 + N);
      auto want = to_double(y);
      auto bd = to_double(bias.f32);
      add_bias(y.data(), bias.view(), M, N);
      ref::add_bias(want.data(), bd.data(), M, N);
      EXPECT_TRUE(AllClose(y.data(), want.data(), y.size(), 1e-6, 1e-6)) << M << "x" << N;
    }
}

TEST(Bias, BackwardAccumulatesColumnSums) {
  for (auto [M, N] : {std::pair<int64_t, int64_t>{0, 5}, {1, 1}, {7, 17}, {33, 65}, {1000, 33}}) {
    auto dy = randn(M * N, 30 + M);
    auto db = randn(N, 40 + N);
    auto want = to_double(db);
    bias_backward(db.data(), dy.data(), M, N);
    auto dyd = to_double(dy);
    ref::bias_backward(want.data(), dyd.data(), M, N);
    EXPECT_TRUE(AllClose(db.data(), want.data(), N, 1e-5, 1e-6)) << M << "x" << N;
  }
}

TEST(Bias, BackwardMatchesFiniteDifferences) {
  const int64_t M = 7, N = 17;
  auto x = to_double(randn(M * N, 50)), g = to_double(randn(M * N, 51));
  auto bias = to_double(randn(N, 52));
  auto loss = [&] {
    auto y = x;
    ref::add_bias(y.data(), bias.data(), M, N);
    return dot(g, y);
  };
  auto fd = fd_grad(bias, loss);
  std::vector<float> gf(g.begin(), g.end()), db(N, 0.0f);
  bias_backward(db.data(), gf.data(), M, N);
  EXPECT_TRUE(AllClose(db.data(), fd.data(), N, kFdAtol, kFdRtol));
}

// ---- layernorm --------------------------------------------------------------------------

TEST(LayerNorm, ForwardAgreesWithReference) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (auto [N, C] : {std::pair<int64_t, int64_t>{0, 7}, {1, 1}, {5, 7}, {3, 17}, {9, 33}, {17, 384}}) {
      auto x = randn(N * C, 60 + C, 2.0f);
      for (auto& v : x) v += 3.0f;  // a non-zero mean
      Param w(randn(C, 61), dt), b(randn(C, 62), dt);
      std::vector<float> out(N * C), mean(N), rstd(N);
      layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.view(), b.view(), N, C);
      auto xd = to_double(x), wd = to_double(w.f32), bd = to_double(b.f32);
      std::vector<double> ro(N * C), rm(N), rr(N);
      ref::layernorm_forward(ro.data(), rm.data(), rr.data(), xd.data(), wd.data(), bd.data(), N, C);
      EXPECT_TRUE(AllClose(out.data(), ro.data(), out.size(), 1e-5, 1e-5)) << N << "x" << C;
      EXPECT_TRUE(AllClose(mean.data(), rm.data(), N, 1e-5, 1e-5));
      EXPECT_TRUE(AllClose(rstd.data(), rr.data(), N, 1e-5, 1e-4));
    }
}

TEST(LayerNorm, ForwardStableForLargeMean) {
  const int64_t N = 3, C = 33;
  auto x = randn(N * C, 70, 0.01f);
  for (auto& v : x) v += 1000.0f;
  Param w(std::vector<float>(C, 1.0f), DType::kF32), b(std::vector<float>(C, 0.0f), DType::kF32);
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.view(), b.view(), N, C);
  auto xd = to_double(x), wd = to_double(w.f32), bd = to_double(b.f32);
  std::vector<double> ro(N * C), rm(N), rr(N);
  ref::layernorm_forward(ro.data(), rm.data(), rr.data(), xd.data(), wd.data(), bd.data(), N, C);
  // Inputs near 1000 carry ~6e-5 absolute rounding, i.e. ~1e-2 of a 0.01 std:
  // this checks the variance does not cancel catastrophically, not precision.
  EXPECT_TRUE(AllClose(out.data(), ro.data(), out.size(), 2e-2, 2e-2));
}

TEST(LayerNorm, BackwardAgreesWithReference) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (auto [N, C] : {std::pair<int64_t, int64_t>{0, 7}, {1, 1}, {5, 7}, {3, 17}, {9, 33}, {17, 384}}) {
      auto x = randn(N * C, 80 + C), dout = randn(N * C, 81 + N);
      Param w(randn(C, 82), dt), b(randn(C, 83), dt);
      std::vector<float> out(N * C), mean(N), rstd(N);
      layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.view(), b.view(), N, C);
      auto dx = randn(N * C, 84), dw = randn(C, 85), db = randn(C, 86);  // accumulated into
      auto rdx = to_double(dx), rdw = to_double(dw), rdb = to_double(db);
      layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.view(), mean.data(),
                         rstd.data(), N, C);
      auto xd = to_double(x), gd = to_double(dout), wd = to_double(w.f32);
      ref::layernorm_backward(rdx.data(), rdw.data(), rdb.data(), gd.data(), xd.data(), wd.data(), N, C);
      EXPECT_TRUE(AllClose(dx.data(), rdx.data(), dx.size(), 1e-4, 1e-4)) << N << "x" << C;
      EXPECT_TRUE(AllClose(dw.data(), rdw.data(), C, 1e-4, 1e-4)) << N << "x" << C;
      EXPECT_TRUE(AllClose(db.data(), rdb.data(), C, 1e-4, 1e-4)) << N << "x" << C;
    }
}

// Note [column sums]: dw and db add the rows in chunks of kColumnChunk,
// each chunk from 0 in doubles, the chunks in order; the row-parallel pass
// (Note [column sums by row chunks]) must give exactly that at any thread
// count, also when the last chunk is short.
TEST(LayerNorm, BackwardColumnSumsFollowTheChunkOrderAtAnyThreadCount) {
  const int64_t N = 200, C = 45;
  auto x = randn(N * C, 92, 2.0f), g = randn(N * C, 93), w = randn(C, 94), b = randn(C, 95);
  std::vector<float> y(N * C), mean(N), rstd(N);
  layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), view(w), view(b), N, C);
  std::vector<float> want_w(C, 0.5f), want_b(C, -0.5f);
  for (int64_t j = 0; j < C; ++j) {
    double aw = 0.0, ab = 0.0;
    for (int64_t r0 = 0; r0 < N; r0 += math::kColumnChunk) {
      double pw = 0.0, pb = 0.0;
      for (int64_t i = r0; i < std::min(N, r0 + math::kColumnChunk); ++i) {
        const float gi = g[i * C + j];
        pw += gi * ((x[i * C + j] - mean[i]) * rstd[i]);
        pb += gi;
      }
      aw += pw;
      ab += pb;
    }
    want_w[j] = static_cast<float>(want_w[j] + aw);
    want_b[j] = static_cast<float>(want_b[j] + ab);
  }
  std::vector<float> dx1;
  for (int nt : {1, 2}) {
    std::vector<float> dx(N * C, 0.25f), dw(C, 0.5f), db(C, -0.5f);
    with_threads(nt, [&] {
      layernorm_backward(dx.data(), dw.data(), db.data(), g.data(), x.data(), view(w), mean.data(), rstd.data(), N, C);
    });
    EXPECT_TRUE(BitEqual(dw, want_w)) << nt << " threads";
    EXPECT_TRUE(BitEqual(db, want_b)) << nt << " threads";
    if (nt == 1) dx1 = dx;
    EXPECT_TRUE(BitEqual(dx, dx1)) << nt << " threads";
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  const int64_t N = 3, C = 17;
  auto x = to_double(randn(N * C, 90)), g = to_double(randn(N * C, 91));
  auto w = to_double(randn(C, 92)), b = to_double(randn(C, 93));
  auto loss = [&] {
    std::vector<double> out(N * C), m(N), r(N);
    ref::layernorm_forward(out.data(), m.data(), r.data(), x.data(), w.data(), b.data(), N, C);
    return dot(g, out);
  };
  auto fdx = fd_grad(x, loss), fdw = fd_grad(w, loss), fdb = fd_grad(b, loss);
  std::vector<float> xf(x.begin(), x.end()), gf(g.begin(), g.end()), wf(w.begin(), w.end()),
      bf(b.begin(), b.end());
  std::vector<float> out(N * C), mean(N), rstd(N), dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_forward(out.data(), mean.data(), rstd.data(), xf.data(), view(wf), view(bf), N, C);
  layernorm_backward(dx.data(), dw.data(), db.data(), gf.data(), xf.data(), view(wf), mean.data(),
                     rstd.data(), N, C);
  EXPECT_TRUE(AllClose(dx.data(), fdx.data(), dx.size(), kFdAtol, kFdRtol));
  EXPECT_TRUE(AllClose(dw.data(), fdw.data(), C, kFdAtol, kFdRtol));
  EXPECT_TRUE(AllClose(db.data(), fdb.data(), C, kFdAtol, kFdRtol));
}

// ---- GELU ----------------------------------------------------------------------------------

std::vector<float> gelu_inputs(size_t n, uint64_t seed) {
  auto x = randn(n, seed, 3.0f);
  // Tails and special points where tanh saturates or the cubic dominates.
  const float special[] = {0.0f, -0.0f, 1e-8f, -1e-8f, 5.0f, -5.0f, 10.0f, -10.0f, 100.0f, -100.0f};
  for (size_t i = 0; i < std::min<size_t>(n, std::size(special)); ++i) x[i * 7 % n] = special[i];
  return x;
}

TEST(Gelu, ForwardAgreesWithReference) {
  for (size_t n : {0, 1, 7, 17, 33, 100003}) {
    auto x = gelu_inputs(n, 100 + n);
    std::vector<float> out(n);
    gelu_forward(out.data(), x.data(), n);
    auto xd = to_double(x);
    std::vector<double> want(n);
    ref::gelu_forward(want.data(), xd.data(), n);
    // ~1e-7 absolute from the tanh approximation, plus fp32 rounding of the result.
    EXPECT_TRUE(AllClose(out.data(), want.data(), n, 1e-6, 1e-6)) << "n=" << n;
  }
}

TEST(Gelu, BackwardAgreesWithReference) {
  for (size_t n : {0, 1, 7, 17, 33, 100003}) {
    auto x = gelu_inputs(n, 110 + n), dout = randn(n, 111);
    std::vector<float> dx(n);
    gelu_backward(dx.data(), x.data(), dout.data(), n);
    auto xd = to_double(x), gd = to_double(dout);
    std::vector<double> want(n);
    ref::gelu_backward(want.data(), xd.data(), gd.data(), n);
    EXPECT_TRUE(AllClose(dx.data(), want.data(), n, 2e-6, 1e-5)) << "n=" << n;
  }
}

TEST(Gelu, BackwardMatchesFiniteDifferences) {
  const size_t n = 33;
  auto x = to_double(gelu_inputs(n, 120)), g = to_double(randn(n, 121));
  auto loss = [&] {
    std::vector<double> out(n);
    ref::gelu_forward(out.data(), x.data(), n);
    return dot(g, out);
  };
  auto fd = fd_grad(x, loss);
  std::vector<float> xf(x.begin(), x.end()), gf(g.begin(), g.end()), dx(n);
  gelu_backward(dx.data(), xf.data(), gf.data(), n);
  EXPECT_TRUE(AllClose(dx.data(), fd.data(), n, kFdAtol, kFdRtol));
}

// ---- the fused bf16 kernels -----------------------------------------------------------------
// Where bf16 matmuls are native the CPU's Ops (models/cpu_ops.cpp) writes a
// layer's bf16 matmul operand in the same pass as the layer: they must give
// exactly the two-step kernels' bits (the kernel, then convert_f32_to_bf16,
// and bias_backward's column sums), at any thread count, and with row
// counts that do not fill the last column chunk.

std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<bf16> h(v.size());
  convert_f32_to_bf16(v.data(), h.data(), v.size());
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = h[i].bits;
  return out;
}
std::vector<uint16_t> bits_of(const std::vector<bf16>& h) {
  std::vector<uint16_t> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = h[i].bits;
  return out;
}

TEST(FusedBf16, LayerNormForwardEqualsLayerNormThenConversion) {
  for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 1}, {37, 133}, {130, 384}}) {
    auto x = randn(N * C, 140 + N, 3.0f), w = randn(C, 141), b = randn(C, 142);
    std::vector<float> y(N * C), mean(N), rstd(N);
    layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), view(w), view(b), N, C);
    for (int nt : {1, 2}) {
      std::vector<bf16> y16(N * C);
      std::vector<float> mean2(N), rstd2(N);
      with_threads(nt, [&] {
        layernorm_forward_bf16(y16.data(), mean2.data(), rstd2.data(), x.data(), view(w), view(b), N, C);
      });
      EXPECT_EQ(bits_of(y16), bf16_bits(y)) << N << "x" << C << ", " << nt << " threads";
      EXPECT_TRUE(BitEqual(mean2, mean) && BitEqual(rstd2, rstd)) << N << "x" << C << ", " << nt << " threads";
    }
  }
}

TEST(FusedBf16, GeluForwardEqualsGeluThenConversion) {
  for (int64_t n : {1, 2047, 2049, 3 * 8192 + 5}) {
    auto x = gelu_inputs(static_cast<size_t>(n), 143);
    std::vector<float> y(n);
    gelu_forward(y.data(), x.data(), n);
    for (int nt : {1, 2}) {
      std::vector<bf16> y16(n);
      with_threads(nt, [&] { gelu_forward_bf16(y16.data(), x.data(), n); });
      EXPECT_EQ(bits_of(y16), bf16_bits(y)) << "n=" << n << ", " << nt << " threads";
    }
  }
}

TEST(FusedBf16, BiasBackwardEqualsColumnSumsAndConversion) {
  for (auto [M, N] : {std::pair<int64_t, int64_t>{1, 3}, {64, 17}, {200, 45}, {2048, 96}}) {
    auto dy = randn(M * N, 144 + M, 2.0f);
    std::vector<float> want(N, 0.5f);
    bias_backward(want.data(), dy.data(), M, N);
    for (int nt : {1, 2}) {
      std::vector<float> db(N, 0.5f);
      std::vector<bf16> dy16(M * N);
      with_threads(nt, [&] { bias_backward_bf16(db.data(), dy16.data(), dy.data(), M, N); });
      EXPECT_TRUE(BitEqual(db, want)) << M << "x" << N << ", " << nt << " threads";
      EXPECT_EQ(bits_of(dy16), bf16_bits(dy)) << M << "x" << N << ", " << nt << " threads";
    }
  }
}

TEST(FusedBf16, GeluBackwardEqualsGeluBackwardThenBiasAndConversion) {
  for (auto [M, N] : {std::pair<int64_t, int64_t>{1, 3}, {65, 40}, {300, 1536}}) {
    auto x = gelu_inputs(static_cast<size_t>(M * N), 145), dout = randn(M * N, 146);
    std::vector<float> dx(M * N), want(N, -1.0f);
    gelu_backward(dx.data(), x.data(), dout.data(), M * N);
    bias_backward(want.data(), dx.data(), M, N);
    for (int nt : {1, 2}) {
      std::vector<float> db(N, -1.0f);
      std::vector<bf16> dx16(M * N);
      with_threads(nt, [&] { gelu_backward_bias_bf16(db.data(), dx16.data(), x.data(), dout.data(), M, N); });
      EXPECT_TRUE(BitEqual(db, want)) << M << "x" << N << ", " << nt << " threads";
      EXPECT_EQ(bits_of(dx16), bf16_bits(dx)) << M << "x" << N << ", " << nt << " threads";
    }
  }
}

// ---- cross-entropy ---------------------------------------------------------------------------

TEST(CrossEntropy, LossAndGradientAgreeWithReference) {
  for (auto [N, V] : {std::pair<int64_t, int64_t>{1, 1}, {7, 17}, {33, 5}, {5, 1000}, {3, 50257}}) {
    auto logits = randn(N * V, 130 + V, 3.0f);
    auto tgt = rand_ints(N, static_cast<int32_t>(V), 131 + N);
    std::vector<float> dl(N * V);
    double loss = cross_entropy(logits.data(), tgt.data(), N, V, dl.data(), 2.5f);
    auto ld = to_double(logits);
    std::vector<double> rdl(N * V);
    double rloss = ref::cross_entropy(ld.data(), tgt.data(), N, V, rdl.data(), 2.5);
    EXPECT_NEAR(loss, rloss, 1e-5 * std::max(1.0, std::fabs(rloss))) << N << "x" << V;
    EXPECT_TRUE(AllClose(dl.data(), rdl.data(), dl.size(), 1e-7, 1e-5)) << N << "x" << V;
    // Without a gradient buffer only the loss is computed.
    EXPECT_EQ(cross_entropy(logits.data(), tgt.data(), N, V, nullptr, 2.5f), loss);
  }
}

TEST(CrossEntropy, GradientMayAliasLogits) {
  const int64_t N = 7, V = 33;
  auto logits = randn(N * V, 140, 2.0f);
  auto tgt = rand_ints(N, V, 141);
  std::vector<float> dl(N * V);
  double l1 = cross_entropy(logits.data(), tgt.data(), N, V, dl.data(), 1.0f);
  double l2 = cross_entropy(logits.data(), tgt.data(), N, V, logits.data(), 1.0f);
  EXPECT_EQ(l1, l2);
  EXPECT_TRUE(BitEqual(dl, logits));
}

TEST(CrossEntropy, StableForHugeLogits) {
  const int64_t N = 3, V = 17;
  auto logits = randn(N * V, 150, 1.0f);
  for (int64_t i = 0; i < N * V; ++i) logits[i] += (i % 2 ? 3e4f : -3e4f);
  auto tgt = rand_ints(N, V, 151);
  std::vector<float> dl(N * V);
  double loss = cross_entropy(logits.data(), tgt.data(), N, V, dl.data(), 1.0f);
  auto ld = to_double(logits);
  std::vector<double> rdl(N * V);
  double rloss = ref::cross_entropy(ld.data(), tgt.data(), N, V, rdl.data(), 1.0);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, rloss, 1e-3 * std::max(1.0, std::fabs(rloss)));
  EXPECT_TRUE(AllClose(dl.data(), rdl.data(), dl.size(), 1e-6, 1e-5));
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  const int64_t N = 5, V = 7;
  auto x = to_double(randn(N * V, 160, 2.0f));
  auto tgt = rand_ints(N, V, 161);
  const double s = 3.0;
  auto loss = [&] { return s * ref::cross_entropy(x.data(), tgt.data(), N, V, (double*)nullptr, 1.0); };
  auto fd = fd_grad(x, loss);
  std::vector<float> xf(x.begin(), x.end()), dl(N * V);
  cross_entropy(xf.data(), tgt.data(), N, V, dl.data(), static_cast<float>(s));
  EXPECT_TRUE(AllClose(dl.data(), fd.data(), dl.size(), kFdAtol, kFdRtol));
}

TEST(CrossEntropy, TargetOutsideVocabularyThrowsNamingRow) {
  const int64_t N = 5, V = 7;
  auto logits = randn(N * V, 170);
  for (int32_t bad : {-1, 7, 1000}) {
    std::vector<int32_t> tgt = {0, 1, 2, bad, 4};
    try {
      cross_entropy(logits.data(), tgt.data(), N, V, nullptr, 1.0f);
      ADD_FAILURE() << "no throw for target " << bad;
    } catch (const zinc::Error& e) {
      EXPECT_NE(std::string(e.what()).find("row 3"), std::string::npos) << e.what();
    }
  }
}

// ---- embeddings ------------------------------------------------------------------------------

TEST(Embedding, ForwardAgreesWithReference) {
  const int64_t B = 3, T = 7, C = 17, V = 33;
  auto tokens = rand_ints(B * T, V, 180);
  for (DType te : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType tp : {DType::kF32, DType::kBF16, DType::kF16})
      for (bool with_pos : {true, false}) {
        Param wte(randn(V * C, 181), te), wpe(randn(T * C, 182), tp);
        std::vector<float> out(B * T * C);
        CView pv = with_pos ? wpe.view() : CView{nullptr, tp};
        embedding_forward(out.data(), tokens.data(), wte.view(), pv, B, T, C, V);
        auto ed = to_double(wte.f32), pd = to_double(wpe.f32);
        std::vector<double> want(out.size());
        ref::embedding_forward(want.data(), tokens.data(), ed.data(), with_pos ? pd.data() : nullptr, B,
                               T, C);
        EXPECT_TRUE(AllClose(out.data(), want.data(), out.size(), 0.0, 1e-7));
      }
}

TEST(Embedding, BackwardSumsInTokenOrderForAnyThreadCount) {
  // Many repeats of few tokens, so rows collide.
  const int64_t B = 4, T = 33, C = 100, V = 5;
  auto tokens = rand_ints(B * T, V, 190);
  auto dout = randn(B * T * C, 191);
  auto dwte0 = randn(V * C, 192), dwpe0 = randn(T * C, 193);
  // The reference adds the same fp32 values in the same (token) order: bit-equal.
  auto want_te = dwte0, want_pe = dwpe0;
  ref::embedding_backward(want_te.data(), want_pe.data(), dout.data(), tokens.data(), B, T, C);
  for (int nt : {1, 2}) {
    auto dwte = dwte0, dwpe = dwpe0;
    with_threads(nt, [&] {
      embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, V);
    });
    EXPECT_TRUE(BitEqual(dwte, want_te)) << nt << " threads";
    EXPECT_TRUE(BitEqual(dwpe, want_pe)) << nt << " threads";
  }
  auto dwte = dwte0;  // no position table
  embedding_backward(dwte.data(), nullptr, dout.data(), tokens.data(), B, T, C, V);
  EXPECT_TRUE(BitEqual(dwte, want_te));
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 3, C = 5, V = 4;
  auto tokens = rand_ints(B * T, V, 200);
  auto wte = to_double(randn(V * C, 201)), wpe = to_double(randn(T * C, 202));
  auto g = to_double(randn(B * T * C, 203));
  auto loss = [&] {
    std::vector<double> out(B * T * C);
    ref::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return dot(g, out);
  };
  auto fdte = fd_grad(wte, loss), fdpe = fd_grad(wpe, loss);
  std::vector<float> gf(g.begin(), g.end()), dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), gf.data(), tokens.data(), B, T, C, V);
  EXPECT_TRUE(AllClose(dwte.data(), fdte.data(), dwte.size(), kFdAtol, kFdRtol));
  EXPECT_TRUE(AllClose(dwpe.data(), fdpe.data(), dwpe.size(), kFdAtol, kFdRtol));
}

TEST(Embedding, TokenOutsideVocabularyThrows) {
  const int64_t B = 1, T = 3, C = 4, V = 5;
  std::vector<float> wte(V * C), out(T * C), dwte(V * C);
  for (int32_t bad : {-1, 5}) {
    std::vector<int32_t> tokens = {0, bad, 1};
    EXPECT_THROW(embedding_forward(out.data(), tokens.data(), view(wte), CView{}, B, T, C, V), zinc::Error);
    EXPECT_THROW(embedding_backward(dwte.data(), nullptr, out.data(), tokens.data(), B, T, C, V),
                 zinc::Error);
  }
}

TEST(Attention, F32ForwardAndBackwardAgreeWithReference) {
  uint64_t seed = 300;
  for (auto s : kAttShapes) check_attention(s, DType::kF32, seed += 2, 1e-4);
}

TEST(Attention, Bf16ForwardAndBackwardAgreeWithReference) {
  uint64_t seed = 400;
  // P and dS are rounded to bf16 inside (2^-9 relative each); summed over up
  // to T = 65 terms of N(0,1) size values.
  for (auto s : kAttShapes) check_attention(s, DType::kBF16, seed += 2, 3e-2);
}

TEST(Attention, Fp16ForwardAndBackwardAgreeWithReference) {
  uint64_t seed = 450;
  // As bf16, with fp16's 2^-12 relative rounding of P and dS.
  for (auto s : kAttShapes) check_attention(s, DType::kF16, seed += 2, 4e-3);
}

// Note [attention by head groups]: the heads are run in groups, each
// thread's matmuls on its own; any group size, at any thread count, gives
// the bits of one group of all heads on one thread.
TEST(Attention, HeadGroupsGiveTheSameBitsAtAnySizeAndThreadCount) {
  const AttentionShape shapes[] = {{3, 37, 24, 3}, {2, 64, 32, 2}};
  uint64_t seed = 470;
  for (AttentionShape s : shapes)
    for (bool packed : {false, true})
      for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
        std::vector<int32_t> pos(static_cast<size_t>(s.B * s.T));
        for (int64_t r = 0; r < s.B; ++r)
          for (int64_t t = 0, p = 0; t < s.T; ++t, p = (p + 1) % (11 + r)) pos[r * s.T + t] = static_cast<int32_t>(p);
        if (packed) s.positions = pos.data();
        auto qkv = randn(s.B * s.T * 3 * s.C, seed++), dout = randn(s.B * s.T * s.C, seed++);
        auto run = [&](int64_t g, int nt, std::vector<float>& out, std::vector<float>& dqkv) {
          out.assign(dout.size(), 0.0f);
          dqkv.assign(qkv.size(), 0.0f);
          set_attention_heads_per_group_for_testing(g);
          with_threads(nt, [&] {
            Workspace w;
            attention_forward(w.ws, out.data(), qkv.data(), s, dt);
            attention_backward(w.ws, dqkv.data(), dout.data(), qkv.data(), s, dt);
          });
          set_attention_heads_per_group_for_testing(0);
        };
        std::vector<float> want_out, want_dqkv, out, dqkv;
        run(s.B * s.H, 1, want_out, want_dqkv);
        for (int64_t g : {int64_t{0}, int64_t{1}, int64_t{4}, s.B * s.H})
          for (int nt : {1, 2}) {
            run(g, nt, out, dqkv);
            const std::string what = std::string(dtype_name(dt)) + (packed ? " packed" : "") + ", " +
                                     std::to_string(g) + " heads per group, " + std::to_string(nt) + " threads";
            EXPECT_TRUE(BitEqual(out, want_out)) << what;
            EXPECT_TRUE(BitEqual(dqkv, want_dqkv)) << what;
          }
      }
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  const AttentionShape s{2, 5, 6, 2};
  auto qkv = to_double(randn(s.B * s.T * 3 * s.C, 500));
  auto g = to_double(randn(s.B * s.T * s.C, 501));
  auto loss = [&] {
    std::vector<double> out(s.B * s.T * s.C);
    ref::attention_forward(out.data(), qkv.data(), s);
    return dot(g, out);
  };
  auto fd = fd_grad(qkv, loss);
  std::vector<float> qf(qkv.begin(), qkv.end()), gf(g.begin(), g.end()), out(g.size()), dqkv(qkv.size());
  Workspace w;
  attention_forward(w.ws, out.data(), qf.data(), s, DType::kF32);
  attention_backward(w.ws, dqkv.data(), gf.data(), qf.data(), s, DType::kF32);
  EXPECT_TRUE(AllClose(dqkv.data(), fd.data(), dqkv.size(), kFdAtol, kFdRtol));
}

// The score scale, a sliding window and Gemma 2's soft-capping (which
// bites: scores reach several times the cap), alone and together, against
// the double reference; backward also against finite differences; in every
// compute dtype, with a head group per head and one group for all (the
// capped scores backward recovers from P must be forward's). The last case
// spreads the scores far past a wide cap, so that probabilities underflow to
// 0 (Note [soft-capped scores' gradient]); fp32 only, as scores of ~100
// rounded from 16-bit operands are off by more than the tolerance.
TEST(Attention, ScaleWindowAndSoftcapMatchTheReference) {
  const AttentionShape base{2, 19, 12, 3};
  auto g = randn(base.B * base.T * base.C, 511);
  auto gd = to_double(g);
  struct Case {
    float scale, softcap;
    int64_t window;
    float spread;
  };
  for (Case c : {Case{0.0f, 1.5f, 0, 2.0f}, Case{0.7f, 0.0f, 4, 2.0f}, Case{0.7f, 1.5f, 4, 2.0f},
                 Case{1.0f, 60.0f, 0, 12.0f}}) {
    auto qkv = randn(base.B * base.T * 3 * base.C, 510, c.spread);
    auto qd = to_double(qkv);
    AttentionShape s = base;
    s.scale = c.scale;
    s.softcap = c.softcap;
    s.window = c.window;
    std::vector<double> want_out(g.size()), want_dqkv(qkv.size());
    ref::attention_forward(want_out.data(), qd.data(), s);
    ref::attention_backward(want_dqkv.data(), gd.data(), qd.data(), s);
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16})
      for (int64_t groups : {1, 0}) {
        if (c.spread > 2.0f && dt != DType::kF32) continue;
        set_attention_heads_per_group_for_testing(groups);
        std::vector<float> out(g.size()), dqkv(qkv.size());
        Workspace w;
        attention_forward(w.ws, out.data(), qkv.data(), s, dt);
        attention_backward(w.ws, dqkv.data(), g.data(), qkv.data(), s, dt);
        set_attention_heads_per_group_for_testing(0);
        const double tol = dt == DType::kF32 ? 1e-4 : dt == DType::kF16 ? 1e-2 : 5e-2;
        const std::string what = std::string(dtype_name(dt)) + " scale " + std::to_string(c.scale) + " softcap " +
                                 std::to_string(c.softcap) + " window " + std::to_string(c.window);
        for (float v : dqkv) ASSERT_TRUE(std::isfinite(v)) << what;
        EXPECT_TRUE(AllClose(out.data(), want_out.data(), out.size(), tol, tol)) << what;
        EXPECT_TRUE(AllClose(dqkv.data(), want_dqkv.data(), dqkv.size(), tol, tol)) << what;
      }
  }
  // The soft-cap's backward against finite differences of the reference.
  AttentionShape s{1, 6, 6, 2};
  s.softcap = 1.0f;
  auto q2 = to_double(randn(s.B * s.T * 3 * s.C, 512, 2.0f)), g2 = to_double(randn(s.B * s.T * s.C, 513));
  auto loss = [&] {
    std::vector<double> out(s.B * s.T * s.C);
    ref::attention_forward(out.data(), q2.data(), s);
    return dot(g2, out);
  };
  auto fd = fd_grad(q2, loss);
  std::vector<float> qf(q2.begin(), q2.end()), gf(g2.begin(), g2.end()), out(gf.size()), dqkv(qf.size());
  Workspace w;
  attention_forward(w.ws, out.data(), qf.data(), s, DType::kF32);
  attention_backward(w.ws, dqkv.data(), gf.data(), qf.data(), s, DType::kF32);
  EXPECT_TRUE(AllClose(dqkv.data(), fd.data(), dqkv.size(), kFdAtol, kFdRtol));
}

TEST(Attention, EachLayerKeepsItsOwnWorkspace) {
  // Forward of two layers, then backward of the first: the second forward
  // must not clobber what the first backward needs.
  const AttentionShape s{2, 17, 16, 2};
  auto qkv1 = randn(s.B * s.T * 3 * s.C, 600), qkv2 = randn(s.B * s.T * 3 * s.C, 601);
  auto dout = randn(s.B * s.T * s.C, 602);
  Workspace w1, w2;
  std::vector<float> out(dout.size()), dqkv(qkv1.size());
  attention_forward(w1.ws, out.data(), qkv1.data(), s, DType::kF32);
  attention_forward(w2.ws, out.data(), qkv2.data(), s, DType::kF32);
  attention_backward(w1.ws, dqkv.data(), dout.data(), qkv1.data(), s, DType::kF32);
  auto qd = to_double(qkv1), gd = to_double(dout);
  std::vector<double> want(qkv1.size());
  ref::attention_backward(want.data(), gd.data(), qd.data(), s);
  EXPECT_TRUE(AllClose(dqkv.data(), want.data(), dqkv.size(), 1e-4, 1e-4));
}

TEST(Attention, BackwardWithoutMatchingForwardThrows) {
  const AttentionShape s{1, 3, 4, 2};
  std::vector<float> qkv(s.B * s.T * 3 * s.C), dout(s.B * s.T * s.C), dqkv(qkv.size()), out(dout.size());
  Workspace w;
  EXPECT_THROW(attention_backward(w.ws, dqkv.data(), dout.data(), qkv.data(), s, DType::kF32), zinc::Error);
  attention_forward(w.ws, out.data(), qkv.data(), s, DType::kF32);
  AttentionShape other = s;
  other.H = 1;
  EXPECT_THROW(attention_backward(w.ws, dqkv.data(), dout.data(), qkv.data(), other, DType::kF32),
               zinc::Error);
  AttentionShape bad{1, 3, 5, 2};  // C not divisible by H
  EXPECT_THROW(attention_forward(w.ws, out.data(), qkv.data(), bad, DType::kF32), zinc::Error);
}

// ---- vector ops ---------------------------------------------------------------------------------

const size_t kVecSizes[] = {0, 1, 7, 17, 33, 100003};

TEST(VectorOps, ElementwiseOpsAgreeWithReference) {
  for (size_t n : kVecSizes) {
    auto a = randn(n, 700 + n), b = randn(n, 701 + n);
    // Same fp32 operations as the reference: bit-equal.
    auto out = b, want = b;
    add(out.data(), a.data(), b.data(), n);
    ref::add(want.data(), a.data(), b.data(), n);
    EXPECT_TRUE(BitEqual(out, want)) << "add n=" << n;
    out = a;  // out aliases a
    add(out.data(), out.data(), b.data(), n);
    EXPECT_TRUE(BitEqual(out, want)) << "aliased add n=" << n;
    out = a, want = a;
    accumulate(out.data(), b.data(), n);
    ref::accumulate(want.data(), b.data(), n);
    EXPECT_TRUE(BitEqual(out, want)) << "accumulate n=" << n;
    out = a, want = a;
    scale(out.data(), -0.3f, n);
    ref::scale(want.data(), -0.3f, n);
    EXPECT_TRUE(BitEqual(out, want)) << "scale n=" << n;
    out = a, want = a;
    axpy(out.data(), 1.7f, b.data(), n);
    ref::axpy(want.data(), 1.7f, b.data(), n);
    EXPECT_TRUE(BitEqual(out, want)) << "axpy n=" << n;
  }
}

// Note [dropout masks] (math.h): inverted dropout whose mask is a function
// of (key, index): a kept element is x / (1 - p), about 1 - p of them are
// kept, the same key gives the same mask (written, in place, or added) and
// another key another mask.
TEST(VectorOps, DropoutKeepsAboutOneMinusPScaledAndRepeatsItsMask) {
  const int64_t n = 200000;
  const std::vector<float> x = randn(static_cast<size_t>(n), 160);
  for (float p : {0.05f, 0.3f, 0.5f}) {
    std::vector<float> a(x.size()), b(x.size()), c = x, acc(x.size(), 1.0f), other(x.size());
    dropout(a.data(), x.data(), n, p, 42, false);
    dropout(b.data(), x.data(), n, p, 42, false);
    dropout(c.data(), c.data(), n, p, 42, false);
    dropout(acc.data(), x.data(), n, p, 42, true);
    dropout(other.data(), x.data(), n, p, 43, false);
    int64_t kept = 0, differ = 0;
    for (int64_t i = 0; i < n; ++i) {
      const size_t u = static_cast<size_t>(i);
      if (a[u] != 0.0f) {
        ++kept;
        ASSERT_EQ(a[u], x[u] * (1.0f / (1.0f - p))) << i;
      }
      ASSERT_EQ(acc[u], 1.0f + a[u]) << i;
      differ += (a[u] != 0.0f) != (other[u] != 0.0f);
    }
    EXPECT_TRUE(BitEqual(a, b));
    EXPECT_TRUE(BitEqual(a, c));
    // Binomial: the kept share within 5 standard deviations of 1 - p.
    const double sd = std::sqrt(p * (1.0 - p) / static_cast<double>(n));
    EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 5 * sd) << "p " << p;
    // Two independent masks differ at 2 p (1 - p) of the elements.
    EXPECT_NEAR(static_cast<double>(differ) / n, 2.0 * p * (1.0 - p), 0.01) << "p " << p;
  }
  std::vector<float> none(x.size());
  dropout(none.data(), x.data(), n, 0.0f, 42, false);
  EXPECT_TRUE(BitEqual(none, x));
}

// A column window (DropoutColumns: a tensor part's columns of a wider
// input) takes those columns of the whole matrix's mask, so parts that
// each drop their columns drop what one rank drops of the whole.
TEST(VectorOps, DropoutOfAColumnWindowIsThoseColumnsOfTheWholeMask) {
  const int64_t rows = 37, W = 24;
  const std::vector<float> x = randn(static_cast<size_t>(rows * W), 161);
  std::vector<float> whole(x.size());
  dropout(whole.data(), x.data(), rows * W, 0.3f, 77, false);
  for (auto [first, cols] : {std::pair<int64_t, int64_t>{0, 12}, {12, 12}, {5, 7}, {0, 24}, {23, 1}}) {
    std::vector<float> part(static_cast<size_t>(rows * cols)), dropped(part.size()), acc(part.size(), 2.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) part[static_cast<size_t>(r * cols + c)] = x[static_cast<size_t>(r * W + first + c)];
    dropout(dropped.data(), part.data(), rows * cols, 0.3f, 77, false, {cols, W, first});
    dropout(acc.data(), part.data(), rows * cols, 0.3f, 77, true, {cols, W, first});
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const size_t at = static_cast<size_t>(r * cols + c);
        ASSERT_EQ(dropped[at], whole[static_cast<size_t>(r * W + first + c)]) << first << "+" << cols << " at " << r << "," << c;
        ASSERT_EQ(acc[at], 2.0f + dropped[at]);
      }
  }
}

TEST(VectorOps, SquaredNormAgreesWithReference) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{17}, size_t{33}, size_t{100003}, size_t{300017}}) {
    auto x = randn(n, 710 + n);
    double got = squared_norm(x.data(), n), want = ref::squared_norm(x.data(), n);
    EXPECT_NEAR(got, want, 1e-12 * std::max(1.0, want)) << "n=" << n;
  }
}

TEST(VectorOps, SquaredNormIndependentOfThreadCount) {
  const size_t n = 3 * 65536 + 17;  // several fixed chunks and a ragged tail
  auto x = randn(n, 720);
  double one = 0, two = 0;
  with_threads(1, [&] { one = squared_norm(x.data(), n); });
  with_threads(2, [&] { two = squared_norm(x.data(), n); });
  EXPECT_EQ(std::memcmp(&one, &two, sizeof(double)), 0) << one << " vs " << two;
}

TEST(VectorOps, AllFiniteDetectsNanAndInf) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (size_t n : {size_t{1}, size_t{17}, size_t{200003}}) {
    auto x = randn(n, 730);
    EXPECT_TRUE(all_finite(x.data(), n));
    for (float b : bad)
      for (size_t pos : {size_t{0}, n / 2, n - 1}) {
        auto y = x;
        y[pos] = b;
        EXPECT_FALSE(all_finite(y.data(), n)) << "n=" << n << " pos=" << pos << " value=" << b;
      }
  }
  EXPECT_TRUE(all_finite(nullptr, 0));
  const float big = std::numeric_limits<float>::max();
  EXPECT_TRUE(all_finite(&big, 1));
}

TEST(Determinism, ParameterGradientsIndependentOfThreadCount) {
  const int64_t N = 257, C = 100;
  auto x = randn(N * C, 740), dout = randn(N * C, 741), w = randn(C, 742), b = randn(C, 743);
  std::vector<float> out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), view(w), view(b), N, C);
  std::vector<std::vector<float>> res[2];
  for (int nt : {1, 2}) {
    std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f), dbias(C, 0.0f), dl(N * C);
    std::vector<int32_t> tgt = rand_ints(N, C, 744);
    double loss = 0;
    with_threads(nt, [&] {
      layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), view(w), mean.data(),
                         rstd.data(), N, C);
      bias_backward(dbias.data(), dout.data(), N, C);
      loss = cross_entropy(x.data(), tgt.data(), N, C, dl.data(), 1.0f);
    });
    res[nt - 1] = {dx, dw, db, dbias, dl, {static_cast<float>(loss)}};
  }
  for (size_t i = 0; i < res[0].size(); ++i) EXPECT_TRUE(BitEqual(res[0][i], res[1][i])) << "output " << i;
}

}  // namespace
}  // namespace zinc::kernels
