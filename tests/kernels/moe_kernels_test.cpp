// Tests for the mixture-of-experts kernels (kernels/moe.cpp): the router
// against a double softmax and top-k, its backward against central finite
// differences (with and without renormalising, with an aux-loss gradient
// on the probabilities), the grouping's invariants, and the gather and
// combine against their definitions and their backward maps against the
// adjoint identities.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "kernels/kernels.h"
#include "kernels_test_util.h"

namespace zinc::kernels {
namespace {

// The router's double reference: softmax, the top k (the lower index on a
// tie), renormalised weights.
void ref_route(const std::vector<double>& logits, int64_t N, int64_t E, int64_t k, bool renorm,
               std::vector<double>& probs, std::vector<int>& expert, std::vector<double>& weight) {
  probs.assign(static_cast<size_t>(N * E), 0.0);
  expert.assign(static_cast<size_t>(N * k), 0);
  weight.assign(static_cast<size_t>(N * k), 0.0);
  for (int64_t t = 0; t < N; ++t) {
    double mx = -1e300, sum = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[t * E + e]);
    for (int64_t e = 0; e < E; ++e) sum += probs[t * E + e] = std::exp(logits[t * E + e] - mx);
    for (int64_t e = 0; e < E; ++e) probs[t * E + e] /= sum;
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return probs[t * E + a] > probs[t * E + b]; });
    double chosen = 0;
    for (int64_t s = 0; s < k; ++s) chosen += probs[t * E + order[s]];
    for (int64_t s = 0; s < k; ++s) {
      expert[t * k + s] = static_cast<int>(order[s]);
      weight[t * k + s] = probs[t * E + order[s]] / (renorm ? chosen : 1.0);
    }
  }
}

TEST(MoeRoute, SoftmaxTopKAndWeightsAgreeWithTheReference) {
  for (bool renorm : {true, false})
    for (auto [E, k] : {std::pair<int64_t, int64_t>{4, 2}, {8, 1}, {37, 5}, {3, 3}}) {
      const int64_t N = 23;
      auto logits = randn(N * E, 70 + E, 2.0f);
      std::vector<float> probs(N * E), weight(N * k);
      std::vector<int32_t> expert(N * k);
      moe_route(logits.data(), N, E, k, renorm, probs.data(), expert.data(), weight.data());
      std::vector<double> rp, rw;
      std::vector<int> re;
      ref_route(to_double(logits), N, E, k, renorm, rp, re, rw);
      EXPECT_TRUE(AllClose(probs, rp, 1e-6, 1e-5)) << E << " " << k;
      EXPECT_TRUE(AllClose(weight, rw, 1e-6, 1e-5)) << E << " " << k;
      for (size_t i = 0; i < expert.size(); ++i) ASSERT_EQ(expert[i], re[i]) << E << " " << k << " at " << i;
    }
  // A tie goes to the lower expert, whatever the order of the logits.
  std::vector<float> tie = {1.0f, 3.0f, 3.0f, 0.0f}, probs(4), weight(2);
  std::vector<int32_t> expert(2);
  moe_route(tie.data(), 1, 4, 2, true, probs.data(), expert.data(), weight.data());
  EXPECT_EQ(expert[0], 1);
  EXPECT_EQ(expert[1], 2);
  EXPECT_THROW(moe_route(tie.data(), 1, 4, 5, true, probs.data(), expert.data(), weight.data()), Error);
}

// d logits of L = sum dweight * weight + sum dprobs * probs, the experts
// held fixed (the top-k choice is piecewise constant).
TEST(MoeRoute, BackwardMatchesFiniteDifferences) {
  const int64_t N = 5, E = 6, k = 2;
  for (bool renorm : {true, false})
    for (bool aux : {false, true}) {
      auto lf = randn(N * E, 80, 1.5f), dwf = randn(N * k, 81), dpf = randn(E, 82);
      std::vector<double> logits = to_double(lf), dw = to_double(dwf), dp = to_double(dpf);
      std::vector<float> probs(N * E), weight(N * k), dlogits(N * E);
      std::vector<int32_t> expert(N * k);
      moe_route(lf.data(), N, E, k, renorm, probs.data(), expert.data(), weight.data());
      moe_route_backward(probs.data(), expert.data(), weight.data(), dwf.data(), aux ? dpf.data() : nullptr, N, E, k,
                         renorm, dlogits.data());
      auto loss = [&] {
        std::vector<double> p(N * E), w;
        std::vector<int> ex;
        ref_route(logits, N, E, k, renorm, p, ex, w);
        double l = 0;
        for (int64_t t = 0; t < N; ++t) {
          // the forward's experts, not the perturbed run's
          double chosen = 0;
          for (int64_t s = 0; s < k; ++s) chosen += p[t * E + expert[t * k + s]];
          for (int64_t s = 0; s < k; ++s)
            l += dw[t * k + s] * p[t * E + expert[t * k + s]] / (renorm ? chosen : 1.0);
          if (aux)
            for (int64_t e = 0; e < E; ++e) l += dp[e] * p[t * E + e];
        }
        return l;
      };
      EXPECT_TRUE(AllClose(dlogits, fd_grad(logits, loss), 1e-5, 1e-4)) << renorm << aux;
    }
}

TEST(MoeGroup, EveryPairOnceGroupedByExpertTokensInOrder) {
  const int64_t N = 41, E = 5, k = 2;
  auto logits = randn(N * E, 90, 2.0f);
  std::vector<float> probs(N * E), weight(N * k);
  std::vector<int32_t> expert(N * k), token_of_row(N * k), row_of_slot(N * k);
  moe_route(logits.data(), N, E, k, true, probs.data(), expert.data(), weight.data());
  std::vector<int64_t> offsets(E + 1);
  moe_group(expert.data(), N, k, E, offsets.data(), token_of_row.data(), row_of_slot.data());
  ASSERT_EQ(offsets[0], 0);
  ASSERT_EQ(offsets[E], N * k);
  for (int64_t i = 0; i < N * k; ++i) {
    const int64_t r = row_of_slot[i], e = expert[i];
    EXPECT_GE(r, offsets[e]);
    EXPECT_LT(r, offsets[e + 1]);
    EXPECT_EQ(token_of_row[r], i / k);
  }
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e] + 1; r < offsets[e + 1]; ++r) EXPECT_LT(token_of_row[r - 1], token_of_row[r]);
  expert[7] = 5;
  EXPECT_THROW(moe_group(expert.data(), N, k, E, offsets.data(), token_of_row.data(), row_of_slot.data()), Error);
}

// The gather and the combine against their definitions; their backward
// maps by the adjoint identities <A x, y> = <x, A^T y>, and dweight as the
// derivative of <dout, combine(y, w)> in w (linear: exact).
TEST(MoeDispatch, GatherAndCombineAndTheirBackward) {
  const int64_t N = 19, E = 4, k = 2, C = 13, M = N * k;
  auto logits = randn(N * E, 91, 2.0f);
  std::vector<float> probs(N * E), weight(N * k);
  std::vector<int32_t> expert(N * k), token_of_row(M), row_of_slot(M);
  moe_route(logits.data(), N, E, k, true, probs.data(), expert.data(), weight.data());
  std::vector<int64_t> offsets(E + 1);
  moe_group(expert.data(), N, k, E, offsets.data(), token_of_row.data(), row_of_slot.data());
  auto x = randn(N * C, 92), y = randn(M * C, 93), dout = randn(N * C, 94), dxg = randn(M * C, 95);
  std::vector<float> xg(M * C), out(N * C);
  moe_gather(xg.data(), x.data(), token_of_row.data(), M, C);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = 0; c < C; ++c) ASSERT_EQ(xg[r * C + c], x[token_of_row[r] * C + c]);
  moe_combine(out.data(), y.data(), weight.data(), row_of_slot.data(), N, k, C);
  std::vector<double> want(N * C, 0.0);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t s = 0; s < k; ++s)
      for (int64_t c = 0; c < C; ++c)
        want[t * C + c] += static_cast<double>(weight[t * k + s]) * y[row_of_slot[t * k + s] * C + c];
  EXPECT_TRUE(AllClose(out, want, 1e-6, 1e-5));
  // combine's backward
  std::vector<float> dy(M * C, 9.0f), dw(N * k);  // dy written, every row
  moe_combine_backward(dy.data(), dw.data(), dout.data(), y.data(), weight.data(), row_of_slot.data(), N, k, C);
  auto dot = [](const std::vector<float>& a, const std::vector<float>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
    return s;
  };
  EXPECT_NEAR(dot(out, dout), dot(y, dy), 1e-4);
  EXPECT_NEAR(dot(out, dout), dot(weight, dw), 1e-4);
  // gather's backward accumulates into dx
  std::vector<float> dx(N * C, 0.5f), base(N * C, 0.5f);
  moe_gather_backward(dx.data(), dxg.data(), row_of_slot.data(), N, k, C);
  for (size_t i = 0; i < dx.size(); ++i) dx[i] -= base[i];
  EXPECT_NEAR(dot(xg, dxg), dot(x, dx), 1e-4);
}

}  // namespace
}  // namespace zinc::kernels
