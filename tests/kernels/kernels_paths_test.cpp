// The kernels' code paths: bf16 without native bf16 (the fp32 route), the
// route's rule, and every ISA variant computing the same bits.
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

#include "kernels_test_util.h"

namespace zinc::kernels {
namespace {

// ---- bf16 without native bf16: the fp32 fallback --------------------------------------------------
//
// Note [bf16 matmul without native bf16] (matmul.cpp): where oneDNN has no
// bf16 kernel the bf16 values are multiplied by the fp32 primitive. The
// fallback must meet exactly the tolerances the native path meets (the
// reference on bf16-rounded inputs), on every CPU: it is forced here where
// the native path exists, and it is the automatic path where it does not.

class Bf16Path : public testing::TestWithParam<MatmulBf16Path> {
 protected:
  void SetUp() override {
    if (GetParam() == MatmulBf16Path::kAuto) {
      MatmulPath p = matmul_path({.M = 64, .N = 64, .K = 64, .compute = DType::kBF16});
      if (p.multiply != DType::kBF16)
        GTEST_SKIP() << "no native bf16 matmul here (" << p.why << "; "
                     << cpu_isa_missing(CpuIsa::kAvx512) << "): the via-fp32 case covers this CPU";
    }
    set_matmul_bf16_path_for_testing(GetParam());
  }
  void TearDown() override { set_matmul_bf16_path_for_testing(MatmulBf16Path::kAuto); }
};

TEST_P(Bf16Path, MatmulAgreesWithReferenceOnRoundedInputs) {
  const DType want = GetParam() == MatmulBf16Path::kViaF32 ? DType::kF32 : DType::kBF16;
  uint64_t seed = 900;
  for (const auto& mc : kMmCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool acc : {false, true}) {
          MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb,
                       .accumulate = acc, .alpha = acc ? -0.375f : 1.0f, .compute = DType::kBF16};
          EXPECT_EQ(matmul_path(d).multiply, want);
          check_matmul(d, DType::kBF16, DType::kBF16, seed += 3);
          check_matmul(d, DType::kF32, DType::kBF16, seed += 3);  // fp32 activations are rounded too
        }
}

TEST_P(Bf16Path, AttentionAgreesWithReference) {
  uint64_t seed = 950;
  for (auto s : kAttShapes) check_attention(s, DType::kBF16, seed += 2, 3e-2);
}

TEST_P(Bf16Path, OperandsConvertedOnceGiveTheSameBits) {
  // bf16_operand_copy / _in_place convert an fp32 operand once for several
  // matmuls; the matmuls must see exactly what they would convert themselves.
  MatmulDesc d{.M = 33, .N = 17, .K = 65, .trans_b = true, .compute = DType::kBF16};
  auto a = randn(33 * 65, 970), b = randn(17 * 65, 971);
  std::vector<float> want(33 * 17), got(want.size()), got2(want.size());
  matmul(d, view(a), view(b), want.data());
  AlignedBuffer sa, sb;
  CView av = bf16_operand_copy(a.data(), static_cast<int64_t>(a.size()), sa);
  CView bv = bf16_operand_copy(b.data(), static_cast<int64_t>(b.size()), sb);
  EXPECT_EQ(av.dtype == DType::kF32, av.bf16_exact);
  matmul(d, av, bv, got.data());
  EXPECT_TRUE(BitEqual(got, want));
  auto a_copy = a;
  AlignedBuffer si;
  CView ai = bf16_operand_in_place(a_copy.data(), static_cast<int64_t>(a_copy.size()), si);
  matmul(d, ai, view(b), got2.data());
  EXPECT_TRUE(BitEqual(got2, want));
  if (ai.dtype == DType::kF32) {
    EXPECT_TRUE(BitEqual(a_copy, round_bf16(a)));  // rounded in place
  }
}

// Note [widened operands in chunks] (matmul.cpp): a bf16 weight whose fp32
// copy would pass 32 MiB is widened a block of C's columns at a time. Each
// element sums the same products as the product of the weight widened
// beforehand (which converts nothing, so runs as one product), to fp32
// rounding; a block in the wrong place would be off by whole values. And the
// scratch the estimate counts stays within one block.
TEST_P(Bf16Path, AWideBf16WeightIsWidenedInBlocks) {
  const int64_t M = 5, K = 1000, N = 20000;  // 80 MB as fp32
  auto a = randn(static_cast<size_t>(M * K), 1200);
  auto wf = round_bf16(randn(static_cast<size_t>(N * K), 1201, 0.05f));
  auto w16 = to_bf16(wf);
  auto bias_f = round_bf16(randn(static_cast<size_t>(N), 1202));
  auto bias16 = to_bf16(bias_f);
  const CView wide{wf.data(), DType::kF32, true};
  for (bool tb : {true, false})
    for (bool acc : {false, true}) {
      SCOPED_TRACE(testing::Message() << "trans_b " << tb << " accumulate " << acc);
      MatmulDesc d{.M = M, .N = N, .K = K, .trans_b = tb, .accumulate = acc, .bias = !acc,
                   .alpha = acc ? 0.5f : 1.0f, .compute = DType::kBF16};
      // The same numbers as a (K, N) weight when not transposed.
      std::vector<bf16> w16_kn;
      std::vector<float> wf_kn;
      if (!tb) {
        w16_kn.resize(w16.size());
        wf_kn.resize(wf.size());
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k) {
            w16_kn[static_cast<size_t>(k * N + n)] = w16[static_cast<size_t>(n * K + k)];
            wf_kn[static_cast<size_t>(k * N + n)] = wf[static_cast<size_t>(n * K + k)];
          }
      }
      const CView w_blocks = tb ? view(w16) : view(w16_kn);
      const CView w_whole = tb ? wide : CView{wf_kn.data(), DType::kF32, true};
      std::vector<float> want = randn(static_cast<size_t>(M * N), 1203), got = want;
      matmul(d, view(a), w_whole, want.data(), view(bias_f));
      matmul(d, view(a), w_blocks, got.data(), view(bias16));
      // The same products summed; oneDNN blocks K its own way for a narrower
      // C, so the sums may differ in their last bits (seen: 2.4e-6 at 8.9).
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i]))) << "element " << i;
      ScratchTally blocks, whole;
      blocks.matmul(d, DType::kF32, false, DType::kBF16, false, DType::kBF16);
      whole.matmul(d, DType::kF32, false, DType::kF32, true, DType::kF32);
      if (matmul_path(d).multiply == DType::kF32) {
        // Widened: one block of at most 32 MiB, not the whole 80 MB.
        EXPECT_LE(blocks.bytes(), whole.bytes() + (int64_t{33} << 20));
        EXPECT_LT(blocks.bytes(), int64_t{48} << 20);
      }
    }
}

// Strided operands and results (MatmulDesc::lda, ldb, ldc): a column block
// of wider matrices multiplies as its dense copy does (to fp32 rounding:
// oneDNN may pick another kernel for a strided layout), in every transpose,
// in fp32 and in bf16 (where an fp32 operand is rounded: gathered densely
// first); C's other columns are untouched.
TEST_P(Bf16Path, StridedOperandsMultiplyAsTheirDenseCopies) {
  const int64_t M = 13, N = 7, K = 19, pad = 5;
  uint64_t seed = 1300;
  for (DType compute : {DType::kF32, DType::kBF16})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool acc : {false, true}) {
          SCOPED_TRACE(testing::Message() << dtype_name(compute) << " trans_a " << ta << " trans_b " << tb
                                          << " accumulate " << acc);
          const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
          const int64_t lda = a_cols + pad, ldb = b_cols + pad + 2, ldc = N + pad + 1;
          auto wide_a = randn(static_cast<size_t>(a_rows * lda), seed += 3);
          auto wide_b = randn(static_cast<size_t>(b_rows * ldb), seed += 3);
          std::vector<float> dense_a(static_cast<size_t>(a_rows * a_cols)), dense_b(static_cast<size_t>(b_rows * b_cols));
          for (int64_t r = 0; r < a_rows; ++r)
            for (int64_t c = 0; c < a_cols; ++c) dense_a[static_cast<size_t>(r * a_cols + c)] = wide_a[static_cast<size_t>(r * lda + 2 + c)];
          for (int64_t r = 0; r < b_rows; ++r)
            for (int64_t c = 0; c < b_cols; ++c) dense_b[static_cast<size_t>(r * b_cols + c)] = wide_b[static_cast<size_t>(r * ldb + 1 + c)];
          MatmulDesc d{.M = M, .N = N, .K = K, .trans_a = ta, .trans_b = tb, .accumulate = acc,
                       .alpha = acc ? 0.75f : 1.0f, .compute = compute};
          std::vector<float> want = randn(static_cast<size_t>(M * N), seed += 3);
          std::vector<float> wide_c(static_cast<size_t>(M * ldc), 9.0f);
          for (int64_t r = 0; r < M; ++r)
            for (int64_t c = 0; c < N; ++c) wide_c[static_cast<size_t>(r * ldc + 3 + c)] = want[static_cast<size_t>(r * N + c)];
          matmul(d, view(dense_a), view(dense_b), want.data());
          MatmulDesc ds = d;
          ds.lda = lda;
          ds.ldb = ldb;
          ds.ldc = ldc;
          matmul(ds, CView{wide_a.data() + 2, DType::kF32}, CView{wide_b.data() + 1, DType::kF32}, wide_c.data() + 3);
          for (int64_t r = 0; r < M; ++r)
            for (int64_t c = 0; c < ldc; ++c) {
              const float got = wide_c[static_cast<size_t>(r * ldc + c)];
              if (c < 3 || c >= 3 + N)
                ASSERT_EQ(got, 9.0f) << "row " << r << " column " << c << " outside C";
              else  // oneDNN may take another kernel (another summation order) for a strided layout
                ASSERT_NEAR(got, want[static_cast<size_t>(r * N + c - 3)],
                            1e-5 * (1.0 + std::fabs(want[static_cast<size_t>(r * N + c - 3)])))
                    << "row " << r << " column " << c;
            }
        }
}

// Note [bf16 matmul without native bf16]: bf16 is multiplied as bf16 only
// where the CPU has bf16 arithmetic (zinc's avx512_bf16 level, under the
// cap) that is faster than fp32: not on AVX-512 without it (oneDNN's bf16
// kernels emulate it, slowly), and not on Intel unless AMX is on. And
// Note [no AMX]: unless ONEDNN_MAX_CPU_ISA names AMX, oneDNN stays below it.
TEST(Matmul, Bf16IsMultipliedAsBf16OnlyWithBf16ArithmeticThatPays) {
  const MatmulPath p = matmul_path({.M = 256, .N = 256, .K = 256, .trans_b = true, .compute = DType::kBF16});
  std::string cap = cpu_isa_cap_env();
  for (char& c : cap) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const bool amx = cap == "AVX512_CORE_AMX" && cpu_model_and_flags().find("amx_bf16") != std::string::npos;
  if (cpu_isa() >= CpuIsa::kAvx512Bf16 && (!cpu_is_intel() || amx)) {
    EXPECT_EQ(p.multiply, DType::kBF16) << p.impl << ": " << p.why;
  } else {
    EXPECT_EQ(p.multiply, DType::kF32) << p.impl;
    EXPECT_NE(p.why, "") << p.impl;
    if (cpu_isa() >= CpuIsa::kAvx512Bf16) {
      EXPECT_NE(p.why.find("Intel"), std::string::npos) << p.why;
    }
  }
  if (cap != "AVX512_CORE_AMX") {
    EXPECT_EQ(p.impl.find("amx"), std::string::npos) << p.impl;
    EXPECT_EQ(matmul_path({.M = 256, .N = 256, .K = 256, .compute = DType::kF32}).impl.find("amx"),
              std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(Matmul, Bf16Path, testing::Values(MatmulBf16Path::kAuto, MatmulBf16Path::kViaF32),
                         [](const testing::TestParamInfo<MatmulBf16Path>& i) {
                           return i.param == MatmulBf16Path::kAuto ? std::string("Native")
                                                                   : std::string("ViaFp32");
                         });

TEST(Matmul, Bf16ViaFp32AndNativeAgreeToFp32Accumulation) {
  MatmulDesc d{.M = 65, .N = 130, .K = 97, .trans_b = true, .compute = DType::kBF16};
  if (matmul_path(d).multiply != DType::kBF16)
    GTEST_SKIP() << "no native bf16 matmul here (" << cpu_isa_missing(CpuIsa::kAvx512) << ")";
  auto a = randn(65 * 97, 990), b = randn(130 * 97, 991);
  std::vector<float> native(65 * 130), via(native.size());
  matmul(d, view(a), view(b), native.data());
  set_matmul_bf16_path_for_testing(MatmulBf16Path::kViaF32);
  matmul(d, view(a), view(b), via.data());
  set_matmul_bf16_path_for_testing(MatmulBf16Path::kAuto);
  EXPECT_TRUE(AllClose(via, native, 1e-5 * 97, 1e-5));
}

// ---- every ISA variant computes the same bits ----------------------------------------------------
//
// The vector kernels are compiled for baseline, AVX2 and AVX-512 and chosen
// at run time (core/cpu.h). With -ffp-contract=off every variant performs the
// same IEEE operations in the same order, so each must reproduce the baseline
// bit for bit; a variant the CPU (or ONEDNN_MAX_CPU_ISA) rules out is skipped
// with the missing instructions named.

struct KernelOutputs {
  std::vector<std::vector<float>> f;
  std::vector<double> d;
  std::vector<uint16_t> h;
};

KernelOutputs run_vector_kernels() {
  KernelOutputs o;
  // GELU over values that reach both clamps of exp_f.
  auto x = randn(10007, 1000, 4.0f);
  x[0] = 30.0f;
  x[1] = -30.0f;
  x[2] = 0.0f;
  std::vector<float> g(x.size()), dg(x.size());
  auto dout = randn(x.size(), 1001);
  gelu_forward(g.data(), x.data(), static_cast<int64_t>(x.size()));
  gelu_backward(dg.data(), x.data(), dout.data(), static_cast<int64_t>(x.size()));
  o.f.push_back(g);
  o.f.push_back(dg);
  // The fused bf16 forms (cpu_ops with native bf16 matmuls).
  auto push16 = [&o](const std::vector<bf16>& h) {
    for (bf16 v : h) o.h.push_back(v.bits);
  };
  {
    const int64_t M = 97, W = 103;  // x as (M, W) for the column sums
    std::vector<bf16> g16(x.size()), dg16(M * W), dy16(M * W);
    std::vector<float> gdb(W, 0.5f), ddb(W, 0.5f);
    gelu_forward_bf16(g16.data(), x.data(), static_cast<int64_t>(x.size()));
    gelu_backward_bias_bf16(gdb.data(), dg16.data(), x.data(), dout.data(), M, W);
    bias_backward_bf16(ddb.data(), dy16.data(), dout.data(), M, W);
    for (auto* h : {&g16, &dg16, &dy16}) push16(*h);
    o.f.push_back(gdb);
    o.f.push_back(ddb);
  }
  // Layernorm forward and backward, odd sizes.
  const int64_t N = 37, C = 133;
  auto lx = randn(N * C, 1002), w = randn(C, 1003), b = randn(C, 1004), ldo = randn(N * C, 1005);
  std::vector<float> ly(N * C), mean(N), rstd(N), ldx(N * C, 0.5f), ldw(C, 0.25f), ldb(C, -0.25f);
  layernorm_forward(ly.data(), mean.data(), rstd.data(), lx.data(), view(w), view(b), N, C);
  layernorm_backward(ldx.data(), ldw.data(), ldb.data(), ldo.data(), lx.data(), view(w), mean.data(),
                     rstd.data(), N, C);
  for (auto* v : {&ly, &mean, &rstd, &ldx, &ldw, &ldb}) o.f.push_back(*v);
  std::vector<bf16> ly16(N * C);
  layernorm_forward_bf16(ly16.data(), mean.data(), rstd.data(), lx.data(), view(w), view(b), N, C);
  push16(ly16);
  // Cross-entropy with its gradient.
  const int64_t R = 29, V = 517;
  auto logits = randn(R * V, 1006, 3.0f);
  auto tgt = rand_ints(R, static_cast<int32_t>(V), 1007);
  std::vector<float> dl(R * V);
  o.d.push_back(cross_entropy(logits.data(), tgt.data(), R, V, dl.data(), 1.0f));
  o.f.push_back(dl);
  // Attention (fp32: the softmax rows are vector kernels).
  const AttentionShape s{2, 33, 8, 2};
  auto qkv = randn(s.B * s.T * 3 * s.C, 1008), ado = randn(s.B * s.T * s.C, 1009);
  std::vector<float> aout(s.B * s.T * s.C), adqkv(qkv.size());
  Workspace ws;
  attention_forward(ws.ws, aout.data(), qkv.data(), s, DType::kF32);
  attention_backward(ws.ws, adqkv.data(), ado.data(), qkv.data(), s, DType::kF32);
  o.f.push_back(aout);
  o.f.push_back(adqkv);
  // ... and soft-capped (Gemma 2: the cap's rows are vector kernels too).
  AttentionShape sc = s;
  sc.softcap = 0.8f;
  Workspace ws2;
  attention_forward(ws2.ws, aout.data(), qkv.data(), sc, DType::kF32);
  attention_backward(ws2.ws, adqkv.data(), ado.data(), qkv.data(), sc, DType::kF32);
  o.f.push_back(aout);
  o.f.push_back(adqkv);
  // Column sums and the embedding scatter.
  std::vector<float> dbias(C, 1.0f);
  bias_backward(dbias.data(), ldo.data(), N, C);
  o.f.push_back(dbias);
  std::vector<float> yb = lx;
  add_bias(yb.data(), view(b), N, C);
  o.f.push_back(yb);
  const int64_t EB = 3, ET = 11, EC = 19, EV = 7;
  auto etok = rand_ints(EB * ET, static_cast<int32_t>(EV), 1010);
  auto edo = randn(EB * ET * EC, 1011);
  std::vector<float> dwte(EV * EC, 0.0f), dwpe(ET * EC, 0.0f);
  embedding_backward(dwte.data(), dwpe.data(), edo.data(), etok.data(), EB, ET, EC, EV);
  o.f.push_back(dwte);
  o.f.push_back(dwpe);
  // Norm and conversions, with the special values.
  auto big = randn(200003, 1012);
  big[5] = std::numeric_limits<float>::infinity();
  big[6] = std::numeric_limits<float>::quiet_NaN();
  big[7] = 1e-40f;  // subnormal
  big[8] = -0.0f;
  big[9] = 3.3895314e38f;  // rounds to inf in bf16
  o.d.push_back(squared_norm(big.data() + 10, 200003 - 10));
  std::vector<bf16> h(big.size());
  convert_f32_to_bf16(big.data(), h.data(), big.size());
  for (bf16 v : h) o.h.push_back(v.bits);
  std::vector<float> wide(big.size()), rounded(big.size());
  convert_bf16_to_f32(h.data(), wide.data(), h.size());
  round_to_bf16(big.data(), rounded.data(), big.size());
  o.f.push_back(wide);
  o.f.push_back(rounded);
  return o;
}

class IsaVariants : public testing::TestWithParam<CpuIsa> {};

TEST_P(IsaVariants, ReproduceTheBaselineBitForBit) {
  const CpuIsa isa = GetParam();
  if (isa > cpu_isa()) GTEST_SKIP() << cpu_isa_name(isa) << " cannot run here: " << cpu_isa_missing(isa);
  detail::set_dispatch_isa_for_testing(CpuIsa::kBaseline);
  KernelOutputs base = run_vector_kernels();
  detail::set_dispatch_isa_for_testing(isa);
  KernelOutputs got = run_vector_kernels();
  detail::reset_dispatch_isa_for_testing();
  ASSERT_EQ(base.f.size(), got.f.size());
  for (size_t i = 0; i < base.f.size(); ++i)
    EXPECT_EQ(std::memcmp(base.f[i].data(), got.f[i].data(), base.f[i].size() * 4), 0)
        << "float output " << i << " differs at " << cpu_isa_name(isa);
  for (size_t i = 0; i < base.d.size(); ++i)
    EXPECT_EQ(std::memcmp(&base.d[i], &got.d[i], 8), 0) << "double output " << i << " at " << cpu_isa_name(isa);
  EXPECT_EQ(base.h, got.h) << "bf16 conversion at " << cpu_isa_name(isa);
  // The round trip is what float_to_bf16 / bf16_to_float define.
  auto big = randn(64, 1013);
  std::vector<float> r(64);
  round_to_bf16(big.data(), r.data(), 64);
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(float_bits(r[i]), float_bits(bf16_to_float(float_to_bf16(big[i]))));
}

INSTANTIATE_TEST_SUITE_P(Kernels, IsaVariants, testing::Values(CpuIsa::kAvx2, CpuIsa::kAvx512),
                         [](const testing::TestParamInfo<CpuIsa>& i) {
                           return std::string(cpu_isa_name(i.param));
                         });

}  // namespace
}  // namespace zinc::kernels
