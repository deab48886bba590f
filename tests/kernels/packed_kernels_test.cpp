// The kernels' side of masked targets and packed documents (issue 31):
// cross-entropy rows without a target, and attention, rope and the learned
// position table following per-token positions. A packed document must
// compute what it computes alone.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels_test_util.h"

namespace zinc::kernels {
namespace {

// Rows without a target add nothing: the loss is the mean over the other
// rows, bit for bit what those rows alone give; their dlogits rows are zero
// and the others' carry 1/N of all rows (the engine rescales at the step).
TEST(CrossEntropy, RowsWithoutATargetAddNothing) {
  const int64_t N = 7, V = 11;
  const std::vector<float> logits = randn(N * V, 900);
  std::vector<int32_t> tgt = rand_ints(N, static_cast<int32_t>(V), 901);
  tgt[1] = tgt[4] = kIgnoreTarget;
  std::vector<float> kept_logits;
  std::vector<int32_t> kept_tgt;
  for (int64_t i = 0; i < N; ++i)
    if (tgt[i] != kIgnoreTarget) {
      kept_logits.insert(kept_logits.end(), logits.begin() + i * V, logits.begin() + (i + 1) * V);
      kept_tgt.push_back(tgt[i]);
    }
  std::vector<float> dl(N * V, 5.0f), dk(kept_logits.size());
  const double loss = cross_entropy(logits.data(), tgt.data(), N, V, dl.data(), 1.0f);
  const double want = cross_entropy(kept_logits.data(), kept_tgt.data(), N - 2, V, dk.data(), 1.0f);
  EXPECT_EQ(loss, want);
  int64_t k = 0;
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < V; ++j) {
      const float g = dl[i * V + j];
      if (tgt[i] == kIgnoreTarget)
        EXPECT_EQ(g, 0.0f) << "row " << i;
      else  // scaled by 1/N instead of 1/(N - 2)
        EXPECT_NEAR(g * N, dk[k * V + j] * (N - 2), 1e-6) << "row " << i;
    }
    k += tgt[i] != kIgnoreTarget;
  }
  // No target at all: zero loss, zero gradient, no NaN.
  std::vector<int32_t> none(N, kIgnoreTarget);
  EXPECT_EQ(cross_entropy(logits.data(), none.data(), N, V, dl.data(), 1.0f), 0.0);
  for (float g : dl) EXPECT_EQ(g, 0.0f);
  // Any other negative target is an error naming the row.
  tgt[3] = -1;
  EXPECT_THROW(cross_entropy(logits.data(), tgt.data(), N, V, dl.data(), 1.0f), Error);
}

// Row 0 packs documents of 5, 1 and 7 tokens; row 1 is one document of 13.
// Every document's attention output, and its rows of d qkv, equal those of
// the document run alone (to summation order: T differs).
TEST(Attention, APackedDocumentAttendsOnlyToItself) {
  const int64_t T = 13, C = 8, H = 2;
  const std::vector<std::vector<int64_t>> docs = {{5, 1, 7}, {13}};
  std::vector<int32_t> pos;
  for (const auto& row : docs)
    for (int64_t len : row)
      for (int64_t i = 0; i < len; ++i) pos.push_back(static_cast<int32_t>(i));
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const double tol = dt == DType::kF32 ? 1e-5 : 3e-2;
    const AttentionShape s{2, T, C, H, pos.data()};
    const std::vector<float> qkv = randn(2 * T * 3 * C, 910), dout = randn(2 * T * C, 911);
    std::vector<float> out(2 * T * C), dqkv(qkv.size());
    Workspace w;
    attention_forward(w.ws, out.data(), qkv.data(), s, dt);
    attention_backward(w.ws, dqkv.data(), dout.data(), qkv.data(), s, dt);
    for (int64_t b = 0; b < 2; ++b) {
      int64_t t0 = 0;
      for (int64_t len : docs[static_cast<size_t>(b)]) {
        const int64_t r0 = b * T + t0;
        const std::vector<float> q1(qkv.begin() + r0 * 3 * C, qkv.begin() + (r0 + len) * 3 * C);
        const std::vector<float> g1(dout.begin() + r0 * C, dout.begin() + (r0 + len) * C);
        std::vector<float> o1(len * C), d1(q1.size());
        Workspace w1;
        const AttentionShape s1{1, len, C, H};
        attention_forward(w1.ws, o1.data(), q1.data(), s1, dt);
        attention_backward(w1.ws, d1.data(), g1.data(), q1.data(), s1, dt);
        EXPECT_TRUE(AllClose(out.data() + r0 * C, o1.data(), o1.size(), tol, tol))
            << dtype_name(dt) << " row " << b << " document at " << t0;
        EXPECT_TRUE(AllClose(dqkv.data() + r0 * 3 * C, d1.data(), d1.size(), tol, tol))
            << dtype_name(dt) << " row " << b << " document at " << t0;
        t0 += len;
      }
    }
    // Without positions the third document of row 0 sees the first two.
    std::vector<float> flat(out.size());
    Workspace wf;
    attention_forward(wf.ws, flat.data(), qkv.data(), {2, T, C, H}, dt);
    EXPECT_FALSE(AllClose(flat.data() + 6 * C, out.data() + 6 * C, 7 * C, 1e-3, 1e-3)) << dtype_name(dt);
  }
  // Positions that reach before their row are refused.
  std::vector<int32_t> bad(2 * T, 0);
  bad[3] = 4;
  std::vector<float> qkv(2 * T * 3 * C), out(2 * T * C);
  Workspace w;
  EXPECT_THROW(attention_forward(w.ws, out.data(), qkv.data(), {2, T, C, H, bad.data()}, DType::kF32), Error);
}

// Rope rotates a token by its position's angle: the second document's rows
// get what the first's get at the same positions, bit for bit.
TEST(Rope, PositionsRestartTheAngle) {
  const int64_t T = 6, hd = 8, heads = 2, W = heads * hd;
  std::vector<float> cs, sn;
  const int64_t h = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < h; ++i) {
      const double a = static_cast<double>(t) * std::pow(10000.0, -2.0 * i / hd);
      cs.push_back(static_cast<float>(std::cos(a)));
      sn.push_back(static_cast<float>(std::sin(a)));
    }
  std::vector<float> x = randn(T * W, 920);
  for (int64_t i = 0; i < 3 * W; ++i) x[3 * W + i] = x[i];  // rows 3..5 repeat rows 0..2
  const std::vector<int32_t> pos = {0, 1, 2, 0, 1, 2};
  for (bool inverse : {false, true}) {
    std::vector<float> y = x;
    rope(y.data(), cs.data(), sn.data(), {1, T, W, 0, heads, hd, pos.data()}, inverse);
    for (int64_t i = 0; i < 3 * W; ++i) EXPECT_EQ(y[3 * W + i], y[i]) << i;
    std::vector<float> z = x;  // without positions row 3 turns by angle 3
    rope(z.data(), cs.data(), sn.data(), {1, T, W, 0, heads, hd}, inverse);
    EXPECT_NE(z[3 * W + 1], y[3 * W + 1]);
  }
}

// The learned position table is indexed, and its gradient scattered, by
// position.
TEST(Embedding, PositionsIndexTheTableAndItsGradient) {
  const int64_t B = 2, T = 5, C = 3, V = 7;
  const std::vector<int32_t> tok = rand_ints(B * T, static_cast<int32_t>(V), 930);
  const std::vector<int32_t> pos = {0, 1, 0, 1, 2, 0, 1, 2, 3, 4};
  const std::vector<float> wte = randn(V * C, 931), wpe = randn(T * C, 932), dout = randn(B * T * C, 933);
  std::vector<float> out(B * T * C);
  embedding_forward(out.data(), tok.data(), {wte.data(), DType::kF32}, {wpe.data(), DType::kF32}, B, T, C, V,
                    pos.data());
  std::vector<double> dwpe_want(T * C, 0.0);
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_EQ(out[r * C + c], wte[tok[r] * C + c] + wpe[pos[r] * C + c]) << r;
      dwpe_want[pos[r] * C + c] += dout[r * C + c];
    }
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C, V, pos.data());
  EXPECT_TRUE(AllClose(dwpe.data(), dwpe_want.data(), dwpe.size(), 1e-6, 1e-6));
  std::vector<int32_t> bad = pos;
  bad[4] = 5;  // beyond the table
  EXPECT_THROW(embedding_forward(out.data(), tok.data(), {wte.data(), DType::kF32}, {wpe.data(), DType::kF32}, B, T,
                                 C, V, bad.data()),
               Error);
}

}  // namespace
}  // namespace zinc::kernels
