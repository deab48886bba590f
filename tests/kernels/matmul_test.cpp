// Tests for the matmul kernel (kernels/kernels.h): every dtype and transpose
// against the scalar reference (kernels/reference.h), the fused bias, and the
// primitive cache under concurrent callers. The tolerances follow
// kernels_test.cpp's header: fp32 accumulation error only, since a reference
// on bf16- or fp16-rounded inputs sees the same exact products.

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

TEST(Matmul, F32AllTransposeCombosAgreeWithReference) {
  uint64_t seed = 1;
  for (const auto& mc : kMmCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb};
        check_matmul(d, DType::kF32, DType::kF32, seed += 3);
      }
}

TEST(Matmul, Bf16TransposedAgreesWithReferenceOnRoundedInputs) {
  uint64_t seed = 100;
  for (const auto& mc : kMmCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb,
                     .compute = DType::kBF16};
        check_matmul(d, DType::kBF16, DType::kBF16, seed += 3);
      }
}

// Note [fp16 compute]: fp16 operands widened, fp32 ones rounded to fp16,
// fp32 accumulation.
TEST(Matmul, Fp16AgreesWithReferenceOnRoundedInputs) {
  uint64_t seed = 150;
  for (const auto& mc : kMmCases)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb,
                     .compute = DType::kF16};
        check_matmul(d, DType::kF16, DType::kF16, seed += 3);
        check_matmul(d, DType::kF32, DType::kF16, seed += 3);  // fp32 activations, fp16 weights
      }
  EXPECT_EQ(matmul_path({.M = 8, .N = 8, .K = 8, .compute = DType::kF16}).multiply, DType::kF32);
}

// An fp32 operand beyond fp16's range becomes Inf in an fp16 matmul, as in an
// fp16 GEMM: the overflow dynamic loss scaling exists to catch.
TEST(Matmul, Fp16OperandAboveTheRangeOverflowsToInf) {
  MatmulDesc d{.M = 2, .N = 2, .K = 2, .compute = DType::kF16};
  std::vector<float> a = {70000.0f, 0.0f, 1.0f, 2.0f}, b = {1.0f, 0.0f, 0.0f, 1.0f}, c(4);
  std::vector<uint16_t> b16 = to_16(b, DType::kF16);
  matmul(d, view(a), {b16.data(), DType::kF16}, c.data());
  EXPECT_TRUE(std::isinf(c[0]));
  EXPECT_EQ(c[2], 1.0f);
  EXPECT_EQ(c[3], 2.0f);
  d.compute = DType::kF32;  // the same in fp32 is finite
  matmul(d, view(a), view(b), c.data());
  EXPECT_EQ(c[0], 70000.0f);
}

TEST(Matmul, AccumulateAndAlphaAgreeWithReference) {
  uint64_t seed = 200;
  for (DType compute : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& mc : kMmCases)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb,
                       .accumulate = true, .alpha = -0.375f, .compute = compute};
          check_matmul(d, compute, compute, seed += 3);
          d.accumulate = false;
          check_matmul(d, compute, compute, seed += 3);
        }
}

TEST(Matmul, MixedOperandDtypesAreConvertedToCompute) {
  MatmulDesc d{.batch = 2, .M = 17, .N = 33, .K = 7, .trans_b = true, .compute = DType::kBF16};
  check_matmul(d, DType::kF32, DType::kBF16, 300);  // fp32 activations, bf16 weights
  check_matmul(d, DType::kBF16, DType::kF32, 301);
  d.compute = DType::kF32;
  check_matmul(d, DType::kF32, DType::kBF16, 302);  // bf16 weights widened to fp32
  // Converting fp32 operands to bf16 first gives bit-identical results.
  auto a = randn(2 * 17 * 7, 303), b = randn(2 * 33 * 7, 304);
  auto a16 = to_bf16(a), b16 = to_bf16(b);
  std::vector<float> c1(2 * 17 * 33), c2(c1.size());
  d.compute = DType::kBF16;
  matmul(d, view(a), view(b), c1.data());
  matmul(d, view(a16), view(b16), c2.data());
  EXPECT_TRUE(BitEqual(c1, c2));
}

// An fp16 operand of a bf16 matmul multiplies its values rounded to bf16:
// the same bits as passing those bf16 values (on the native bf16 path it was
// once read as fp32).
TEST(Matmul, Fp16OperandOfABf16MatmulIsRoundedToBf16) {
  MatmulDesc d{.batch = 1, .M = 9, .N = 11, .K = 37, .trans_b = true, .compute = DType::kBF16};
  auto a = randn(9 * 37, 310), b = randn(11 * 37, 311);
  std::vector<uint16_t> a_f16(a.size());
  std::vector<bf16> a_bf16(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    a_f16[i] = float_to_f16(a[i]).bits;
    a_bf16[i] = float_to_bf16(f16_to_float(f16{a_f16[i]}));
  }
  std::vector<float> c1(9 * 11), c2(c1.size());
  matmul(d, CView{a_f16.data(), DType::kF16}, view(b), c1.data());
  matmul(d, CView{a_bf16.data(), DType::kBF16}, view(b), c2.data());
  EXPECT_TRUE(BitEqual(c1, c2));
}

TEST(Matmul, ZeroSizedDimensions) {
  std::vector<float> c(12, 5.0f), a(12, 1.0f), b(12, 1.0f);
  // K = 0: the empty product is zero, plus C when accumulating.
  matmul({.M = 3, .N = 4, .K = 0, .accumulate = true}, view(a), view(b), c.data());
  EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](float v) { return v == 5.0f; }));
  matmul({.M = 3, .N = 4, .K = 0}, view(a), view(b), c.data());
  EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](float v) { return v == 0.0f; }));
  // M, N or batch = 0: nothing to write.
  matmul({.M = 0, .N = 4, .K = 3}, view(a), view(b), nullptr);
  matmul({.M = 3, .N = 0, .K = 3}, view(a), view(b), nullptr);
  matmul({.batch = 0, .M = 3, .N = 4, .K = 3}, view(a), view(b), nullptr);
}

TEST(Matmul, ConcurrentCallersShareTheCacheSafely) {
  // Two threads run the same (cached) primitive on different outputs.
  MatmulDesc d{.M = 65, .N = 33, .K = 47, .trans_b = true, .compute = DType::kBF16};
  auto a = randn(65 * 47, 400), b = randn(33 * 47, 401);
  std::vector<float> want(65 * 33);
  matmul(d, view(a), view(b), want.data());
  std::vector<std::vector<float>> got(2, std::vector<float>(want.size()));
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < 20; ++r) matmul(d, view(a), view(b), got[t].data());
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 2; ++t) EXPECT_TRUE(AllClose(got[t], want, 1e-5, 1e-5));
}


TEST(Matmul, FusedBiasEqualsMatmulThenBias) {
  uint64_t seed = 800;
  for (DType compute : {DType::kF32, DType::kBF16})
    for (DType bias_dtype : {DType::kF32, DType::kBF16})
      for (int64_t batch : {1, 3}) {
        MatmulDesc d{.batch = batch, .M = 33, .N = 17, .K = 65, .trans_b = true, .compute = compute};
        auto a = randn(batch * 33 * 65, seed++), b = randn(17 * 65 * batch, seed++),
             bias = randn(17, seed++);
        auto bias16 = to_bf16(bias);
        CView bv = bias_dtype == DType::kF32 ? view(bias) : view(bias16);
        std::vector<float> want(batch * 33 * 17), got(want.size());
        matmul(d, view(a), view(b), want.data());
        for (int64_t r = 0; r < batch * 33; ++r)
          for (int64_t j = 0; j < 17; ++j) want[r * 17 + j] += bv.at(j);
        MatmulDesc db = d;
        db.bias = true;
        matmul(db, view(a), view(b), got.data(), bv);
        EXPECT_TRUE(AllClose(got, want, 1e-5, 1e-6))
            << dtype_name(compute) << " bias " << dtype_name(bias_dtype) << " batch " << batch;
      }
  MatmulDesc bad{.M = 2, .N = 2, .K = 2, .bias = true};
  std::vector<float> x(4, 1.0f), c(4);
  EXPECT_THROW(matmul(bad, view(x), view(x), c.data()), zinc::Error);  // no bias view
}


// Note [packed frozen weights]: matmul_packed against the plain matmul on
// the same operands (the same sums; where oneDNN picks another kernel for
// the packed layout, at a small strided shape here, the last bits differ), for every compute dtype, both layouts of B, strided A
// and C, accumulate, alpha and a fused bias, at odd sizes and at one past
// oneDNN's blocking; the bf16 path through fp32 too.
TEST(MatmulPacked, AgreesWithThePlainMatmul) {
  uint64_t seed = 900;
  struct Shape {
    int64_t M, N, K;
  };
  for (MatmulBf16Path path : {MatmulBf16Path::kAuto, MatmulBf16Path::kViaF32}) {
    set_matmul_bf16_path_for_testing(path);
    for (DType compute : {DType::kF32, DType::kBF16, DType::kF16})
      for (Shape sh : {Shape{1, 1, 1}, Shape{7, 17, 33}, Shape{65, 130, 97}, Shape{129, 67, 257}})
        for (bool tb : {false, true})
          for (int variant = 0; variant < 4; ++variant) {
            MatmulDesc d{.M = sh.M, .N = sh.N, .K = sh.K, .trans_b = tb, .compute = compute};
            if (variant == 1) d.accumulate = true, d.alpha = -0.375f;
            if (variant == 2) d.bias = true;
            if (variant == 3) d.lda = sh.K + 3, d.ldc = sh.N + 5;  // column blocks of wider rows
            const int64_t lda = d.lda ? d.lda : sh.K, ldc = d.ldc ? d.ldc : sh.N;
            auto a = randn(sh.M * lda, seed++), b = randn(sh.K * sh.N, seed++), c0 = randn(sh.M * ldc, seed++),
                 bias = randn(sh.N, seed++);
            // The weight in the compute dtype where it is 16-bit (a frozen
            // base's storage); for variant 0 of a 16-bit compute, fp32
            // values the product rounds (converted before packing).
            auto b16 = to_16(b, is_16bit(compute) ? compute : DType::kBF16);
            CView bv = is_16bit(compute) && variant != 0 ? CView{b16.data(), compute} : view(b);
            std::vector<float> want = c0, got = c0;
            matmul(d, view(a), bv, want.data(), d.bias ? view(bias) : CView{});
            PackedWeight slot;
            matmul_packed(d, view(a), bv, 1, slot, got.data(), d.bias ? view(bias) : CView{});
            EXPECT_FALSE(slot.empty());
            EXPECT_EQ(slot.bytes(), packed_weight_bytes(d));
            EXPECT_TRUE(AllClose(got, want, 1e-5, 1e-5))
                << dtype_name(compute) << " " << sh.M << "x" << sh.N << "x" << sh.K << " tb " << tb << " variant "
                << variant << " path " << static_cast<int>(path);
          }
  }
  set_matmul_bf16_path_for_testing(MatmulBf16Path::kAuto);
}

// The slot keeps the weight it packed while the generation and the address
// stay the same (values written into the weight since are not seen: the
// caller's promise is that there are none), and packs again for a new
// generation or another weight; generation 0 runs the plain matmul.
TEST(MatmulPacked, RepacksOnlyForANewGenerationOrWeight) {
  const int64_t M = 9, N = 40, K = 70;
  MatmulDesc d{.M = M, .N = N, .K = K, .trans_b = true, .compute = DType::kBF16};
  auto a = randn(M * K, 950), b1 = randn(N * K, 951), b2 = randn(N * K, 952);
  auto w = to_bf16(b1), w2 = to_bf16(b2);
  auto product = [&](const std::vector<bf16>& wv) {
    std::vector<float> c(M * N);
    matmul(d, view(a), CView{wv.data(), DType::kBF16}, c.data());
    return c;
  };
  const auto with_b1 = product(w), with_b2 = product(w2);
  ASSERT_FALSE(BitEqual(with_b1, with_b2));
  PackedWeight slot;
  std::vector<float> c(M * N);
  matmul_packed(d, view(a), CView{w.data(), DType::kBF16}, 7, slot, c.data());
  EXPECT_TRUE(AllClose(c, with_b1, 1e-5, 1e-5));
  // The same address, new values, the same generation: the packed copy is used.
  std::vector<bf16> saved = w;
  w = w2;
  matmul_packed(d, view(a), CView{w.data(), DType::kBF16}, 7, slot, c.data());
  EXPECT_TRUE(AllClose(c, with_b1, 1e-5, 1e-5));
  // A new generation: packed again.
  matmul_packed(d, view(a), CView{w.data(), DType::kBF16}, 8, slot, c.data());
  EXPECT_TRUE(AllClose(c, with_b2, 1e-5, 1e-5));
  // Another weight under the same generation: packed again.
  matmul_packed(d, view(a), CView{saved.data(), DType::kBF16}, 8, slot, c.data());
  EXPECT_TRUE(AllClose(c, with_b1, 1e-5, 1e-5));
  // Generation 0: the plain product, the slot untouched.
  PackedWeight none;
  matmul_packed(d, view(a), CView{w.data(), DType::kBF16}, 0, none, c.data());
  EXPECT_TRUE(none.empty());
  EXPECT_TRUE(AllClose(c, with_b2, 1e-5, 1e-5));
  // A batched product cannot be packed: the plain one, the slot untouched.
  MatmulDesc batched = d;
  batched.batch = 2;
  auto a2 = randn(2 * M * K, 953), bb = randn(2 * N * K, 954);
  std::vector<float> want(2 * M * N), got(want.size());
  matmul(batched, view(a2), view(bb), want.data());
  matmul_packed(batched, view(a2), view(bb), 3, none, got.data());
  EXPECT_TRUE(none.empty());
  EXPECT_TRUE(BitEqual(got, want));
}

}  // namespace
}  // namespace zinc::kernels
