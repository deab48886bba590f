// The GPU layer kernels against the CPU kernels on the same inputs. These
// kernels share their math with the CPU (kernels/math.h, Note [lane order]),
// so the comparison is bit for bit. Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda.h"
#include "kernels/math.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc::kernels {
namespace {

using zinc::cuda::DeviceBuffer;
using zinc::cuda::testing::download;
using zinc::cuda::testing::upload;
using zinc::cuda::testing::Param;
using zinc::cuda::testing::randn;
using zinc::cuda::testing::filled16;
using zinc::cuda::testing::rounded16;

void expect_same_bits(const std::vector<float>& cpu, const std::vector<float>& gpu, const char* what) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what;
  for (size_t i = 0; i < cpu.size(); ++i)
    ASSERT_EQ(float_bits(cpu[i]), float_bits(gpu[i])) << what << " at " << i << ": cpu " << cpu[i] << " gpu " << gpu[i];
}

const DType kParamTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(CudaLayers, ConversionsMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  std::vector<float> x = randn(100003, 1, 1000.0);
  x[0] = 65520.0f;  // fp16 overflow to Inf
  x[1] = 1e-7f;     // fp16 subnormal
  x[2] = -0.0f;
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> cpu(x.size());
    convert_f32_to_16(x.data(), cpu.data(), x.size(), t);
    DeviceBuffer dx = upload(x), d16(x.size() * 2);
    cuda::convert_f32_to_16(dx.as<float>(), d16.data(), static_cast<int64_t>(x.size()), t, nullptr);
    std::vector<uint16_t> gpu = download<uint16_t>(d16, x.size());
    ASSERT_EQ(cpu, gpu) << dtype_name(t);
    std::vector<float> back_cpu(x.size());
    convert_16_to_f32(cpu.data(), back_cpu.data(), x.size(), t);
    DeviceBuffer dback(x.size() * 4);
    cuda::convert_16_to_f32(d16.data(), dback.as<float>(), static_cast<int64_t>(x.size()), t, nullptr);
    expect_same_bits(back_cpu, download<float>(dback, x.size()), "widen");
  }
}

// M: within one chunk of rows, exactly one, one and a bit, and more chunks
// than one wave of a block's threads takes (Note [column sums]).
TEST(CudaLayers, BiasForwardAndBackwardMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  const int64_t N = 203;
  for (int64_t M : {37, 64, 65, 4099})
  for (DType t : kParamTypes) {
    std::vector<float> y = randn(M * N, 2), b = randn(N, 3), dy = randn(M * N, 4), db = randn(N, 5);
    Param bias(b, t);
    DeviceBuffer dyv = upload(y), ddy = upload(dy), ddb = upload(db);
    add_bias(y.data(), bias.host(), M, N);
    cuda::add_bias(dyv.as<float>(), bias.dev(), M, N, nullptr);
    expect_same_bits(y, download<float>(dyv, y.size()), "add_bias");
    bias_backward(db.data(), dy.data(), M, N);
    cuda::bias_backward(ddb.as<float>(), ddy.as<float>(), M, N, nullptr);
    expect_same_bits(db, download<float>(ddb, db.size()), "bias_backward");
  }
}

TEST(CudaLayers, LayernormMatchesTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (int64_t C : {1, 15, 16, 17, 768})
  for (int64_t N : {29, 2113}) {  // not a multiple of the rows per block; more than a wave of chunks
    for (DType t : kParamTypes) {
      std::vector<float> x = randn(N * C, 6, 3.0), w = randn(C, 7), b = randn(C, 8), dout = randn(N * C, 9);
      for (int64_t i = 0; i < N * C; ++i) x[i] += 5.0f;  // |mean| >> std
      Param pw(w, t), pb(b, t);
      std::vector<float> out(N * C), mean(N), rstd(N);
      layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), pw.host(), pb.host(), N, C);
      DeviceBuffer dx = upload(x), dout_d(N * C * 4), dmean(N * 4), drstd(N * 4);
      cuda::layernorm_forward(dout_d.as<float>(), dmean.as<float>(), drstd.as<float>(), dx.as<float>(), pw.dev(),
                              pb.dev(), N, C, nullptr);
      expect_same_bits(out, download<float>(dout_d, out.size()), "layernorm out");
      expect_same_bits(mean, download<float>(dmean, N), "layernorm mean");
      expect_same_bits(rstd, download<float>(drstd, N), "layernorm rstd");
      {
        // The residual and the norm in one kernel: the CPU's add, then its layernorm.
        const std::vector<float> res = randn(N * C, 15);
        std::vector<float> sum(N * C), out2(N * C), mean2(N), rstd2(N);
        add(sum.data(), x.data(), res.data(), N * C);
        layernorm_forward(out2.data(), mean2.data(), rstd2.data(), sum.data(), pw.host(), pb.host(), N, C);
        DeviceBuffer d_sum = upload(x), d_res = upload(res), d_out2(N * C * 4), d_mean2(N * 4), d_rstd2(N * 4);
        cuda::add_layernorm_forward(d_out2.as<float>(), d_mean2.as<float>(), d_rstd2.as<float>(), d_sum.as<float>(),
                                    d_res.as<float>(), pw.dev(), pb.dev(), N, C, nullptr);
        expect_same_bits(sum, download<float>(d_sum, sum.size()), "add_layernorm sum");
        expect_same_bits(out2, download<float>(d_out2, out2.size()), "add_layernorm out");
        expect_same_bits(mean2, download<float>(d_mean2, N), "add_layernorm mean");
        expect_same_bits(rstd2, download<float>(d_rstd2, N), "add_layernorm rstd");
      }

      std::vector<float> gx = randn(N * C, 10), gw = randn(C, 11), gb = randn(C, 12);  // accumulated into
      DeviceBuffer dgx = upload(gx), dgw = upload(gw), dgb = upload(gb), ddout = upload(dout);
      layernorm_backward(gx.data(), gw.data(), gb.data(), dout.data(), x.data(), pw.host(), mean.data(), rstd.data(),
                         N, C);
      cuda::layernorm_backward(dgx.as<float>(), dgw.as<float>(), dgb.as<float>(), ddout.as<float>(), dx.as<float>(),
                               pw.dev(), dmean.as<float>(), drstd.as<float>(), N, C, nullptr);
      expect_same_bits(gx, download<float>(dgx, gx.size()), "layernorm dx");
      expect_same_bits(gw, download<float>(dgw, gw.size()), "layernorm dw");
      expect_same_bits(gb, download<float>(dgb, gb.size()), "layernorm db");
    }
  }
}

TEST(CudaLayers, GeluMatchesTheCpuBits) {
  ZINC_REQUIRE_GPU();
  const int64_t n = 70001;
  std::vector<float> x = randn(n, 13, 4.0), dout = randn(n, 14), y(n), dx(n);
  gelu_forward(y.data(), x.data(), n);
  gelu_backward(dx.data(), x.data(), dout.data(), n);
  DeviceBuffer d_x = upload(x), d_dout = upload(dout), d_y(n * 4), d_dx(n * 4);
  cuda::gelu_forward(d_y.as<float>(), d_x.as<float>(), n, nullptr);
  cuda::gelu_backward(d_dx.as<float>(), d_x.as<float>(), d_dout.as<float>(), n, nullptr);
  expect_same_bits(y, download<float>(d_y, n), "gelu");
  expect_same_bits(dx, download<float>(d_dx, n), "gelu backward");
}

// Note [fused 16-bit operands]: each fused form writes the bits of its
// kernel's fp32 output rounded by convert_f32_to_16, leaves no element
// unwritten (the buffers start as a pattern no rounding gives), and sums the
// bias gradient as bias_backward does; at sizes that are not multiples of
// the rows per block, the column chunk or the column block.
TEST(CudaLayers, FusedSixteenBitOperandsMatchTheKernelThenTheConversion) {
  ZINC_REQUIRE_GPU();
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (int64_t C : {1, 17, 768})
    for (int64_t N : {29, 2113}) {
      std::vector<float> x = randn(N * C, 21, 3.0), w = randn(C, 22), b = randn(C, 23), res = randn(N * C, 24);
      Param pw(w, DType::kBF16), pb(b, DType::kF32);
      std::vector<float> out(N * C), mean(N), rstd(N);
      layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), pw.host(), pb.host(), N, C);
      DeviceBuffer dx = upload(x), d16 = filled16(N * C), dmean(N * 4), drstd(N * 4);
      cuda::layernorm_forward_16(d16.data(), t, dmean.as<float>(), drstd.as<float>(), dx.as<float>(), nullptr,
                                 pw.dev(), pb.dev(), N, C, nullptr);
      ASSERT_EQ(rounded16(out, t), download<uint16_t>(d16, out.size())) << "layernorm_forward_16 " << dtype_name(t);
      expect_same_bits(mean, download<float>(dmean, N), "layernorm_forward_16 mean");
      expect_same_bits(rstd, download<float>(drstd, N), "layernorm_forward_16 rstd");
      expect_same_bits(x, download<float>(dx, x.size()), "layernorm_forward_16 leaves x");

      std::vector<float> sum(N * C);
      add(sum.data(), x.data(), res.data(), N * C);
      layernorm_forward(out.data(), mean.data(), rstd.data(), sum.data(), pw.host(), pb.host(), N, C);
      DeviceBuffer dres = upload(res), e16 = filled16(N * C);
      cuda::layernorm_forward_16(e16.data(), t, dmean.as<float>(), drstd.as<float>(), dx.as<float>(), dres.as<float>(),
                                 pw.dev(), pb.dev(), N, C, nullptr);
      expect_same_bits(sum, download<float>(dx, sum.size()), "add_layernorm_forward_16 x");
      ASSERT_EQ(rounded16(out, t), download<uint16_t>(e16, out.size())) << "add_layernorm_forward_16 " << dtype_name(t);
      expect_same_bits(rstd, download<float>(drstd, N), "add_layernorm_forward_16 rstd");
    }
    {
      const int64_t n = 70001;
      std::vector<float> x = randn(n, 25, 4.0), y(n);
      gelu_forward(y.data(), x.data(), n);
      DeviceBuffer dx = upload(x), d16 = filled16(n);
      cuda::gelu_forward_16(d16.data(), t, dx.as<float>(), n, nullptr);
      ASSERT_EQ(rounded16(y, t), download<uint16_t>(d16, y.size())) << "gelu_forward_16 " << dtype_name(t);
    }
    const int64_t N = 203;
    for (int64_t M : {37, 64, 65, 4099}) {
      std::vector<float> dy = randn(M * N, 26), db = randn(N, 27), x = randn(M * N, 28, 4.0);
      std::vector<float> db2 = db, g(M * N);
      DeviceBuffer ddy = upload(dy), ddb = upload(db), d16 = filled16(M * N);
      bias_backward(db.data(), dy.data(), M, N);
      cuda::bias_backward_16(ddb.as<float>(), d16.data(), t, ddy.as<float>(), M, N, nullptr);
      expect_same_bits(db, download<float>(ddb, db.size()), "bias_backward_16 db");
      ASSERT_EQ(rounded16(dy, t), download<uint16_t>(d16, dy.size())) << "bias_backward_16 " << M;

      gelu_backward(g.data(), x.data(), dy.data(), M * N);
      bias_backward(db2.data(), g.data(), M, N);
      DeviceBuffer dx = upload(x), ddb2 = upload(randn(N, 27)), g16 = filled16(M * N), h16 = filled16(M * N);
      cuda::gelu_backward_bias_16(ddb2.as<float>(), g16.data(), t, dx.as<float>(), ddy.as<float>(), M, N, nullptr);
      expect_same_bits(db2, download<float>(ddb2, db2.size()), "gelu_backward_bias_16 db");
      ASSERT_EQ(rounded16(g, t), download<uint16_t>(g16, g.size())) << "gelu_backward_bias_16 " << M;
      cuda::gelu_backward_bias_16(nullptr, h16.data(), t, dx.as<float>(), ddy.as<float>(), M, N, nullptr);
      ASSERT_EQ(rounded16(g, t), download<uint16_t>(h16, g.size())) << "gelu_backward_bias_16 without db " << M;
    }
  }
  DeviceBuffer any(64);
  EXPECT_THROW(cuda::gelu_forward_16(any.data(), DType::kF32, any.as<float>(), 4, nullptr), Error);
  EXPECT_THROW(cuda::cross_entropy_16(any.as<float>(), nullptr, 1, 4, any.data(), DType::kF32, 1.0f, nullptr, nullptr),
               Error);
}

TEST(CudaLayers, CrossEntropyMatchesTheCpu) {
  ZINC_REQUIRE_GPU();
  for (int64_t V : {5, 16, 257, 50257}) {
    const int64_t N = 13;
    std::vector<float> logits = randn(N * V, 15, 3.0);
    std::vector<int32_t> targets(N);
    for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 7919) % V);
    std::vector<float> dl(N * V);
    const double loss = cross_entropy(logits.data(), targets.data(), N, V, dl.data(), 0.5f);
    DeviceBuffer d_logits = upload(logits), d_t = upload(targets), d_dl(N * V * 4), d_rows(N * 8);
    cuda::cross_entropy(d_logits.as<float>(), d_t.as<int32_t>(), N, V, d_dl.as<float>(), 0.5f, d_rows.as<double>(),
                        nullptr);
    const double gloss = cuda::cross_entropy_mean(d_rows.as<double>(), N, N, nullptr);
    // The loss goes through log(), whose last bit may differ between glibc and CUDA.
    EXPECT_NEAR(loss, gloss, 1e-12 * std::max(1.0, std::fabs(loss))) << "V=" << V;
    expect_same_bits(dl, download<float>(d_dl, dl.size()), "dlogits");
    // In place (dlogits aliasing logits), as the models call it.
    cuda::cross_entropy(d_logits.as<float>(), d_t.as<int32_t>(), N, V, d_logits.as<float>(), 0.5f,
                        d_rows.as<double>(), nullptr);
    expect_same_bits(dl, download<float>(d_logits, dl.size()), "dlogits in place");
  }
}

// Masked targets (kIgnoreTarget): ignored rows next to counted ones in the
// same warp (two rows per warp), a first and last row ignored, an odd N, and
// every row ignored (loss 0, dlogits all zero). The device dlogits start as
// NaN, so the ignored rows' zeros must be written.
TEST(CudaLayers, CrossEntropyWithIgnoredTargetsMatchesTheCpu) {
  ZINC_REQUIRE_GPU();
  for (int64_t V : {5, 16, 257, 50257})
    for (int pattern = 0; pattern < 3; ++pattern) {
      const int64_t N = 13;
      std::vector<float> logits = randn(N * V, 21, 3.0);
      std::vector<int32_t> targets(N);
      int64_t counted = 0;
      for (int64_t i = 0; i < N; ++i) {
        const bool ignore = pattern == 2 || (pattern == 0 ? i % 3 == 0 : (i == 0 || i == N - 1 || i % 2 == 1));
        targets[i] = ignore ? kIgnoreTarget : static_cast<int32_t>((i * 7919) % V);
        counted += !ignore;
      }
      const std::string at = "V=" + std::to_string(V) + " pattern " + std::to_string(pattern);
      std::vector<float> dl(N * V);
      const double loss = cross_entropy(logits.data(), targets.data(), N, V, dl.data(), 0.5f);
      DeviceBuffer d_logits = upload(logits), d_t = upload(targets), d_rows(N * 8);
      DeviceBuffer d_dl = upload(std::vector<float>(N * V, std::nanf("")));
      cuda::cross_entropy(d_logits.as<float>(), d_t.as<int32_t>(), N, V, d_dl.as<float>(), 0.5f, d_rows.as<double>(),
                          nullptr);
      const double gloss = cuda::cross_entropy_mean(d_rows.as<double>(), N, counted, nullptr);
      if (counted == 0) {
        EXPECT_EQ(loss, 0.0) << at;
        EXPECT_EQ(gloss, 0.0) << at;
      } else {
        EXPECT_NEAR(loss, gloss, 1e-12 * std::max(1.0, std::fabs(loss))) << at;
      }
      const std::vector<double> rows = download<double>(d_rows, N);
      for (int64_t i = 0; i < N; ++i)
        if (targets[i] == kIgnoreTarget) {
          EXPECT_EQ(rows[i], 0.0) << at << " row " << i;
        }
      expect_same_bits(dl, download<float>(d_dl, dl.size()), ("dlogits " + at).c_str());
      // The 16-bit gradient alone (Note [fused 16-bit operands]): the fp32
      // one rounded, into a NaN pattern, and the same row losses.
      for (DType t : {DType::kBF16, DType::kF16}) {
        DeviceBuffer d16 = filled16(N * V), rows16 = upload(std::vector<double>(N, std::nan("")));
        cuda::cross_entropy_16(d_logits.as<float>(), d_t.as<int32_t>(), N, V, d16.data(), t, 0.5f,
                               rows16.as<double>(), nullptr);
        ASSERT_EQ(rounded16(dl, t), download<uint16_t>(d16, dl.size()))
            << "cross_entropy_16 " << dtype_name(t) << " " << at;
        const std::vector<double> r16 = download<double>(rows16, N);
        for (int64_t i = 0; i < N; ++i) EXPECT_EQ(rows[i], r16[i]) << "cross_entropy_16 row loss " << i << " " << at;
      }
      // fp16's loss scale folded in (the models' forward, with dynamic
      // loss scaling's powers of two): the bits of the fp32 gradient scaled
      // afterwards, then rounded, which is what the unfused path computes.
      for (float s : {1024.0f, 65536.0f}) {
        std::vector<float> scaled = dl;
        for (float& x : scaled) x *= s;
        DeviceBuffer d16 = filled16(N * V);
        cuda::cross_entropy_16(d_logits.as<float>(), d_t.as<int32_t>(), N, V, d16.data(), DType::kF16, 0.5f * s,
                               d_rows.as<double>(), nullptr);
        ASSERT_EQ(rounded16(scaled, DType::kF16), download<uint16_t>(d16, dl.size()))
            << "cross_entropy_16 fp16, loss scale " << s << " " << at;
      }
      cuda::cross_entropy(d_logits.as<float>(), d_t.as<int32_t>(), N, V, d_logits.as<float>(), 0.5f,
                          d_rows.as<double>(), nullptr);
      expect_same_bits(dl, download<float>(d_logits, dl.size()), ("dlogits in place " + at).c_str());
      // Without dlogits: the losses alone.
      cuda::cross_entropy(d_logits.as<float>(), d_t.as<int32_t>(), N, V, nullptr, 0.5f, d_rows.as<double>(), nullptr);
    }
  EXPECT_EQ(cuda::cross_entropy_mean(nullptr, 0, 0, nullptr), 0.0);
}

// Vocabulary parts (kernels.h): a vocabulary of 13 in two parts of 7 rows
// (the second part's last row padding), ignored targets among the rows,
// each part's steps as the model takes them with the sums over the parts
// between them; every value the GPU gives equals the CPU's bits (the loss
// is the host's sum in both).
TEST(CudaLayers, VocabularyPartsMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  const int64_t N = 11, C = 24, V = 13, Vp = 7;
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = i % 4 == 3 ? kIgnoreTarget : static_cast<int32_t>((i * 5) % V);
  std::vector<int32_t> tok(N);
  for (int64_t i = 0; i < N; ++i) tok[i] = static_cast<int32_t>((i * 3 + 1) % V);
  DeviceBuffer d_t = upload(targets), d_tok = upload(tok);
  std::vector<std::vector<float>> logits(2), dl(2);
  std::vector<double> maxes(N, -1e300), sums(2 * N, 0.0);
  for (int p = 0; p < 2; ++p) {
    logits[p] = randn(N * Vp, 40 + p, 3.0);
    std::vector<double> m(N);
    cross_entropy_part_max(logits[p].data(), N, Vp, m.data());
    DeviceBuffer d_l = upload(logits[p]), d_m(N * 8);
    cuda::cross_entropy_part_max(d_l.as<float>(), N, Vp, d_m.as<double>(), nullptr);
    EXPECT_EQ(download<double>(d_m, N), m) << "row maxima of part " << p;
    for (int64_t i = 0; i < N; ++i) maxes[i] = std::max(maxes[i], m[i]);
  }
  for (int p = 0; p < 2; ++p) {
    std::vector<double> s(2 * N);
    dl[p].resize(N * Vp);
    cross_entropy_part_sums(logits[p].data(), targets.data(), N, Vp, p * Vp, maxes.data(), s.data(), dl[p].data());
    DeviceBuffer d_l = upload(logits[p]), d_m = upload(maxes), d_s(2 * N * 8);
    DeviceBuffer d_dl = upload(std::vector<float>(N * Vp, std::nanf("")));
    cuda::cross_entropy_part_sums(d_l.as<float>(), d_t.as<int32_t>(), N, Vp, p * Vp, d_m.as<double>(),
                                  d_s.as<double>(), d_dl.as<float>(), nullptr);
    EXPECT_EQ(download<double>(d_s, 2 * N), s) << "sums of part " << p;
    expect_same_bits(dl[p], download<float>(d_dl, dl[p].size()), "exponentials");
    for (int64_t i = 0; i < 2 * N; ++i) sums[i] += s[i];
  }
  for (int p = 0; p < 2; ++p) {
    std::vector<float> want = dl[p];
    const double loss = cross_entropy_part_finish(targets.data(), N, Vp, p * Vp, maxes.data(), sums.data(), want.data(),
                                                  0.5f);
    EXPECT_GT(loss, 0.0);
    DeviceBuffer d_dl = upload(dl[p]), d_s = upload(sums);
    cuda::cross_entropy_part_finish(d_t.as<int32_t>(), N, Vp, p * Vp, d_s.as<double>(), d_dl.as<float>(), 0.5f,
                                    nullptr);
    expect_same_bits(want, download<float>(d_dl, want.size()), "dlogits");
  }
  // The embedding's part: rows [7, 14) of a 13-token vocabulary (the last padding).
  for (DType t : kParamTypes) {
    Param pte(randn(Vp * C, 50), t);
    std::vector<float> out(N * C);
    embedding_part_forward(out.data(), tok.data(), pte.host(), N, C, Vp, Vp);
    DeviceBuffer d_out = upload(std::vector<float>(N * C, std::nanf("")));
    cuda::embedding_part_forward(d_out.as<float>(), d_tok.as<int32_t>(), pte.dev(), N, C, Vp, Vp, nullptr);
    expect_same_bits(out, download<float>(d_out, out.size()), "embedding part forward");
  }
  std::vector<float> dout = randn(N * C, 51), dwte = randn(Vp * C, 52);
  DeviceBuffer d_dout = upload(dout), d_dwte = upload(dwte);
  embedding_part_backward(dwte.data(), dout.data(), tok.data(), N, C, Vp, Vp);
  cuda::embedding_part_backward(d_dwte.as<float>(), d_dout.as<float>(), d_tok.as<int32_t>(), N, C, Vp, Vp, nullptr);
  expect_same_bits(dwte, download<float>(d_dwte, dwte.size()), "embedding part backward");
}

TEST(CudaLayers, EmbeddingsMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  const int64_t B = 3, T = 11, C = 48, V = 97;
  for (DType t : kParamTypes) {
    std::vector<float> wte = randn(V * C, 16), wpe = randn(T * C, 17);
    Param pte(wte, t), ppe(wpe, t);
    std::vector<int32_t> tok(B * T);
    for (int64_t i = 0; i < B * T; ++i) tok[i] = static_cast<int32_t>((i * 31) % 5);  // repeated tokens
    DeviceBuffer d_tok = upload(tok);
    for (bool pos : {true, false}) {
      std::vector<float> out(B * T * C);
      embedding_forward(out.data(), tok.data(), pte.host(), pos ? ppe.host() : CView{}, B, T, C, V);
      DeviceBuffer d_out(out.size() * 4);
      cuda::embedding_forward(d_out.as<float>(), d_tok.as<int32_t>(), pte.dev(), pos ? ppe.dev() : CView{}, B, T, C,
                              nullptr);
      expect_same_bits(out, download<float>(d_out, out.size()), "embedding forward");
    }
    std::vector<float> dout = randn(B * T * C, 18), dwte = randn(V * C, 19), dwpe = randn(T * C, 20);
    DeviceBuffer d_dout = upload(dout), d_dwte = upload(dwte), d_dwpe = upload(dwpe);
    DeviceBuffer d_dwte2 = upload(dwte), d_dwpe2 = upload(dwpe);
    embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C, V);
    cuda::embedding_backward(d_dwte.as<float>(), d_dwpe.as<float>(), d_dout.as<float>(), d_tok.as<int32_t>(), B, T, C,
                             nullptr);
    expect_same_bits(dwte, download<float>(d_dwte, dwte.size()), "dwte");
    expect_same_bits(dwpe, download<float>(d_dwpe, dwpe.size()), "dwpe");
    // The same through the token index (a thread per token and column).
    cuda::TokenIndex index;
    index.build(tok.data(), B * T, V, nullptr);
    EXPECT_EQ(index.distinct(), 5);
    cuda::embedding_backward(d_dwte2.as<float>(), d_dwpe2.as<float>(), d_dout.as<float>(), d_tok.as<int32_t>(), B, T,
                             C, nullptr, &index);
    expect_same_bits(dwte, download<float>(d_dwte2, dwte.size()), "dwte (indexed)");
    expect_same_bits(dwpe, download<float>(d_dwpe2, dwpe.size()), "dwpe (indexed)");
  }
}

// Packed documents: wpe indexed and dwpe scattered by position (documents
// of length 1 and ones longer than 16 tokens, different in each row; an
// odd C), on each backward path: one thread per column, the token index
// with the position index, and the token index without it.
TEST(CudaLayers, EmbeddingsWithPositionsMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  const int64_t B = 3, T = 41, C = 37, V = 97;
  const std::vector<int32_t> pos = zinc::cuda::testing::packed_positions(B, T);
  for (DType t : kParamTypes) {
    std::vector<float> wte = randn(V * C, 22), wpe = randn(T * C, 23);
    Param pte(wte, t), ppe(wpe, t);
    std::vector<int32_t> tok(B * T);
    for (int64_t i = 0; i < B * T; ++i) tok[i] = static_cast<int32_t>((i * 31) % 7);
    DeviceBuffer d_tok = upload(tok), d_pos = upload(pos);
    std::vector<float> out(B * T * C);
    embedding_forward(out.data(), tok.data(), pte.host(), ppe.host(), B, T, C, V, pos.data());
    DeviceBuffer d_out(out.size() * 4);
    cuda::embedding_forward(d_out.as<float>(), d_tok.as<int32_t>(), pte.dev(), ppe.dev(), B, T, C, nullptr,
                            d_pos.as<int32_t>());
    expect_same_bits(out, download<float>(d_out, out.size()), "embedding forward with positions");

    std::vector<float> dout = randn(B * T * C, 24), dwte = randn(V * C, 25), dwpe = randn(T * C, 26);
    const std::vector<float> dwte0 = dwte, dwpe0 = dwpe;
    embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C, V, pos.data());
    cuda::TokenIndex index, pindex;
    index.build(tok.data(), B * T, V, nullptr);
    pindex.build(pos.data(), B * T, T, nullptr);
    EXPECT_EQ(pindex.distinct(), 33);  // the longest document
    DeviceBuffer d_dout = upload(dout);
    for (int path = 0; path < 3; ++path) {
      const std::string at = std::string(dtype_name(t)) + " path " + std::to_string(path);
      DeviceBuffer d_dwte = upload(dwte0), d_dwpe = upload(dwpe0);
      cuda::embedding_backward(d_dwte.as<float>(), d_dwpe.as<float>(), d_dout.as<float>(), d_tok.as<int32_t>(), B, T,
                               C, nullptr, path == 0 ? nullptr : &index, d_pos.as<int32_t>(),
                               path == 1 ? &pindex : nullptr);
      expect_same_bits(dwte, download<float>(d_dwte, dwte.size()), ("dwte " + at).c_str());
      expect_same_bits(dwpe, download<float>(d_dwpe, dwpe.size()), ("dwpe " + at).c_str());
    }
  }
}

// The CPU Ops' add_transposed (models/cpu_ops.cpp), written out: one add
// per element of dst.
void cpu_ops_add_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < cols; ++k) dst[i * ldd + k] += src[k * lds + i];
}

TEST(CudaLayers, VectorOpsMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (int64_t n : {int64_t{1}, int64_t{1000}, kernels::math::kNormChunk * 3 + 17}) {
    std::vector<float> a = randn(n, 21), b = randn(n, 22);
    DeviceBuffer da = upload(a), db = upload(b), dout(n * 4), dnorm(8);
    std::vector<float> out(n);
    add(out.data(), a.data(), b.data(), n);
    cuda::add(dout.as<float>(), da.as<float>(), db.as<float>(), n, nullptr);
    expect_same_bits(out, download<float>(dout, n), "add");
    axpy(out.data(), 0.3f, a.data(), n);
    cuda::axpy(dout.as<float>(), 0.3f, da.as<float>(), n, nullptr);
    expect_same_bits(out, download<float>(dout, n), "axpy");
    accumulate(out.data(), b.data(), n);
    cuda::accumulate(dout.as<float>(), db.as<float>(), n, nullptr);
    expect_same_bits(out, download<float>(dout, n), "accumulate");
    scale(out.data(), 1.7f, n);
    cuda::scale(dout.as<float>(), 1.7f, n, nullptr);
    expect_same_bits(out, download<float>(dout, n), "scale");
    // LoRA's B gradients added transposed: dst (rows x cols, stride ldd) += src^T.
    if (n >= 1000) {
      const int64_t rows = 29, cols = 7, ldd = 9, lds = 31;
      std::vector<float> dst = randn(rows * ldd, 23), src = randn(cols * lds, 24);
      DeviceBuffer ddst = upload(dst), dsrc = upload(src);
      cpu_ops_add_transposed(dst.data(), ldd, src.data(), lds, rows, cols);
      cuda::add_transposed(ddst.as<float>(), ldd, dsrc.as<float>(), lds, rows, cols, nullptr);
      expect_same_bits(dst, download<float>(ddst, dst.size()), "add_transposed");
    }
    const double norm = squared_norm(out.data(), n);
    cuda::squared_norm(dout.as<float>(), n, dnorm.as<double>(), nullptr);
    const double gnorm = download<double>(dnorm, 1)[0];
    EXPECT_EQ(0, std::memcmp(&norm, &gnorm, 8)) << "squared_norm n=" << n << ": " << norm << " vs " << gnorm;
  }
}

}  // namespace
}  // namespace zinc::kernels

namespace zinc::kernels {
namespace {
// cuBLAS is opened at run time (core/dynlib.h): the library the GPU matmuls
// will use must load on every machine with the toolkit, GPU or not.
TEST(CudaLibraries, CublasLoadsWithoutAGpu) {
  const std::string lib = cuda::cublas_library();
  EXPECT_NE(lib.find("libcublas.so."), std::string::npos) << lib;
}
}  // namespace
}  // namespace zinc::kernels

namespace zinc::kernels {
namespace {
// TokenIndex's grouping (host side, no GPU): every row once, grouped by token
// in ascending token order, rows increasing within a token.
TEST(CudaLibraries, TokenIndexGroupsRowsByTokenInOrder) {
  const std::vector<int32_t> tok = {3, 1, 3, 0, 1, 3, 7};
  std::vector<int32_t> ids, starts, rows;
  cuda::TokenIndex::group(tok.data(), static_cast<int64_t>(tok.size()), 8, ids, starts, rows);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 3, 7}));
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 1, 3, 6, 7}));
  EXPECT_EQ(rows, (std::vector<int32_t>{3, 1, 4, 0, 2, 5, 6}));
  const std::vector<int32_t> bad = {0, 9};
  EXPECT_THROW(cuda::TokenIndex::group(bad.data(), 2, 8, ids, starts, rows), Error);
}
}  // namespace
}  // namespace zinc::kernels
