// Tests for the CUDA matmul and the unfused attention (csrc/kernels/{matmul,attention}.cu):
// every GPU kernel against the CPU kernel of kernels.h on the same random
// inputs (upload, run, download, compare). Tests that need a GPU skip, saying
// why, where the CUDA runtime sees none (ZINC_REQUIRE_GPU,
// tests/cuda/cuda_test_util.h); the lane-order test and the argument checks
// run everywhere.
//
// Tolerances, and why:
// - matmul: cuBLAS and oneDNN both accumulate in fp32 but in different
//   orders. A sum of K terms in any order is within (K-1) u sum|terms| of
//   the exact sum (u = 2^-24), fp32 products add u |a b| each, and alpha,
//   the accumulated C and the bias one rounding each; so per element
//   |gpu - cpu| <= 2 (K+2) u (|alpha| sum_k |a_mk||b_kn| + |C0| + |bias|).
//   The tests allow twice that for fp32 compute (4 (K+2) u) and four times
//   for 16-bit compute (8 (K+2) u), since the tensor cores' fp32
//   accumulation of bf16/fp16 products is not round-to-nearest IEEE in
//   every step (operands are aligned and truncated inside an MMA). With
//   16-bit compute both sides multiply the very same 16-bit values (the CPU
//   rounds fp32 operands to them, the GPU converts), so the products are
//   exact on both and only the sums differ.
// - attention with random inputs: S and dP come from the two GEMMs and
//   differ in the last bits, which P, Y and the gradients inherit. fp32: the
//   CPU kernel is within 1e-4 (abs + rel) of the double reference on
//   kernels_test's sizes; GPU vs CPU is allowed 2e-4. bf16 / fp16: P and dS are rounded to
//   16 bits on both sides, and a last-bit difference in S can move a value
//   across a rounding boundary, changing that element by one 16-bit ulp
//   (2^-8 bf16, 2^-11 fp16 relative) on one side only. At these sizes such
//   flips happen (~1e-3 of the elements) and each moves an output by up to
//   ulp * |p| * |dp or v| * |k| * scale, about 1e-2 (bf16) and 1.5e-3 (fp16)
//   at worst; allowed: 2e-2 and 3e-3 (abs + rel), inside the CPU's own
//   distance from the double reference (3e-2 and 4e-3 in kernels_test).
//   Any indexing or order bug gives O(1) errors.
// - attention with S and dP exact (one-hot K and V, see
//   SoftmaxRowsMatchTheCpuBitForBit): the GPU's per-row kernels must give
//   the CPU's P and dS exactly (compared with ==, so +0 and -0 are equal).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda.h"
#include "kernels/math.h"
#include "kernels/simd_math.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc::kernels {
namespace {

using zinc::cuda::DeviceBuffer;
using zinc::cuda::testing::download;
using zinc::cuda::testing::upload;
using zinc::cuda::testing::randn;

// ---- helpers ------------------------------------------------------------------------------

std::vector<uint16_t> to_16(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_16(v[i], t);
  return out;
}
std::vector<float> round_16(const std::vector<float>& v, DType t) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_16(float_to_16(v[i], t), t);
  return out;
}

// Host data in a dtype, its device copy, and the views of both.
struct Operand {
  std::vector<float> f32;   // the host values (fp32 operands)
  std::vector<uint16_t> b16;  // the host bits (16-bit operands)
  DType dtype;
  DeviceBuffer dev;
  Operand(const std::vector<float>& v, DType t) : dtype(t) {
    if (is_16bit(t)) {
      b16 = to_16(v, t);
      dev = upload(b16);
    } else {
      f32 = v;
      dev = upload(f32);
    }
  }
  CView host() const { return is_16bit(dtype) ? CView{b16.data(), dtype} : CView{f32.data(), dtype}; }
  CView device() const { return {dev.data(), dtype}; }
};

::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<float>& want, double atol,
                                    double rtol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size mismatch";
  size_t bad = 0, first = got.size();
  double max_err = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= atol + rtol * std::fabs(static_cast<double>(want[i])))) {
      if (first == got.size()) first = i;
      ++bad;
    }
    if (err > max_err) max_err = err;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements differ; first at " << first
                                       << ": gpu " << got[first] << " cpu " << want[first] << " (max abs err "
                                       << max_err << ", atol " << atol << ", rtol " << rtol << ")";
}

// ---- matmul ---------------------------------------------------------------------------------

struct MmCase {
  int64_t batch, M, N, K;
};
const MmCase kMmCases[] = {{1, 1, 1, 1},   {1, 37, 53, 19}, {1, 53, 19, 37}, {1, 17, 33, 1},
                           {3, 7, 17, 33}, {2, 33, 1, 7},   {2, 65, 130, 97}};

std::string describe(const MatmulDesc& d, DType a, DType b) {
  return "batch=" + std::to_string(d.batch) + " M=" + std::to_string(d.M) + " N=" + std::to_string(d.N) +
         " K=" + std::to_string(d.K) + " ta=" + std::to_string(d.trans_a) + " tb=" + std::to_string(d.trans_b) +
         " acc=" + std::to_string(d.accumulate) + " bias=" + std::to_string(d.bias) +
         " alpha=" + std::to_string(d.alpha) + " compute=" + std::string(dtype_name(d.compute)) +
         " a=" + std::string(dtype_name(a)) + " b=" + std::string(dtype_name(b));
}

// Runs cuda::matmul and kernels::matmul on the same operands (dtypes a_t, b_t,
// bias in bias_t when d.bias) and compares per element against the bound in
// the header, from the values the multiplier sees.
void check_matmul(const MatmulDesc& d, DType a_t, DType b_t, uint64_t seed, DType bias_t = DType::kF32) {
  const size_t na = d.batch * d.M * d.K, nb = d.batch * d.K * d.N, nc = d.batch * d.M * d.N;
  const auto a = randn(na, seed), b = randn(nb, seed + 1), c0 = randn(nc, seed + 2), bias = randn(d.N, seed + 3);
  Operand av(a, a_t), bv(b, b_t), biasv(bias, bias_t);
  std::vector<float> cpu = c0;
  matmul(d, av.host(), bv.host(), cpu.data(), d.bias ? biasv.host() : CView{});
  zinc::cuda::Stream stream;
  DeviceBuffer c_dev = upload(c0);
  cuda::matmul(d, av.device(), bv.device(), c_dev.as<float>(), stream.get(), d.bias ? biasv.device() : CView{});
  stream.synchronize();
  const auto gpu = download<float>(c_dev, nc);
  // The values multiplied: 16-bit operands as stored, fp32 ones rounded to a 16-bit compute dtype.
  auto seen = [&](const std::vector<float>& v, DType t) {
    if (is_16bit(t)) return round_16(v, t);
    return is_16bit(d.compute) ? round_16(v, d.compute) : v;
  };
  const auto as = seen(a, a_t), bs = seen(b, b_t);
  const auto bias_seen = is_16bit(bias_t) ? round_16(bias, bias_t) : bias;
  const double u = std::ldexp(1.0, -24);
  const double factor = (is_16bit(d.compute) ? 8.0 : 4.0) * static_cast<double>(d.K + 2) * u;
  size_t bad = 0, first = nc;
  double worst = 0;
  for (int64_t bt = 0; bt < d.batch; ++bt)
    for (int64_t m = 0; m < d.M; ++m)
      for (int64_t n = 0; n < d.N; ++n) {
        double mag = 0;
        for (int64_t k = 0; k < d.K; ++k) {
          const double x = as[bt * d.M * d.K + (d.trans_a ? k * d.M + m : m * d.K + k)];
          const double y = bs[bt * d.K * d.N + (d.trans_b ? n * d.K + k : k * d.N + n)];
          mag += std::fabs(x * y);
        }
        const size_t i = static_cast<size_t>((bt * d.M + m) * d.N + n);
        const double scale = std::fabs(d.alpha) * mag + (d.accumulate ? std::fabs(c0[i]) : 0.0) +
                             (d.bias ? std::fabs(bias_seen[n]) : 0.0);
        const double err = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
        if (!(err <= factor * scale)) {
          if (first == nc) first = i;
          ++bad;
        }
        if (scale > 0) worst = std::max(worst, err / (factor * scale));
      }
  EXPECT_EQ(bad, 0u) << describe(d, a_t, b_t) << ": " << bad << " of " << nc << " differ, first at " << first
                     << " gpu " << (first < nc ? gpu[first] : 0.0f) << " cpu " << (first < nc ? cpu[first] : 0.0f)
                     << " (worst err / bound " << worst << ")";
}

TEST(CudaMatmul, AllTransposeCombosAndComputeDtypesAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 1;
  for (DType compute : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& mc : kMmCases)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb,
                       .compute = compute};
          check_matmul(d, compute, compute, seed += 4);
        }
}

TEST(CudaMatmul, AccumulateAndAlphaAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 1000;
  for (DType compute : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& mc : kMmCases)
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb,
                       .accumulate = true, .alpha = -0.375f, .compute = compute};
          check_matmul(d, compute, compute, seed += 4);
          d.accumulate = false;
          d.alpha = 1.75f;
          check_matmul(d, compute, compute, seed += 4);
        }
}

TEST(CudaMatmul, FusedBiasInEveryDtypeAgreesWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 2000;
  for (DType compute : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType bias_t : {DType::kF32, DType::kBF16, DType::kF16})
      for (bool acc : {false, true})
        for (const auto& mc : {MmCase{1, 37, 53, 19}, MmCase{3, 7, 17, 33}}) {
          MatmulDesc d{.batch = mc.batch, .M = mc.M, .N = mc.N, .K = mc.K, .trans_b = true, .accumulate = acc,
                       .bias = true, .compute = compute};
          check_matmul(d, compute, compute, seed += 4, bias_t);
        }
}

// Note [the bias in the GEMM's epilogue]: a bias without accumulate, in one
// batch, runs in cuBLASLt's epilogue, for every transpose, compute dtype and
// bias dtype; the separate pass (ZINC_CUDA_MATMUL_BIAS=separate) gives the
// same values within the bound, and under kernel emulation the same bits.
TEST(CudaMatmul, TheBiasInTheEpilogueAgreesWithTheSeparatePass) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 3000;
  zinc::cuda::Stream stream;
  for (DType compute : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType bias_t : {DType::kF32, DType::kBF16})
      for (const auto& mc : {MmCase{1, 1, 1, 1}, MmCase{1, 37, 53, 19}, MmCase{1, 53, 19, 37}, MmCase{1, 65, 130, 97}})
        for (bool ta : {false, true})
          for (bool tb : {false, true}) {
            MatmulDesc d{.M = mc.M, .N = mc.N, .K = mc.K, .trans_a = ta, .trans_b = tb, .bias = true,
                         .compute = compute};
            ASSERT_TRUE(cuda::matmul_bias_in_epilogue(d)) << describe(d, compute, compute);
            check_matmul(d, compute, compute, seed += 4, bias_t);
            const auto a = randn(d.M * d.K, seed), b = randn(d.K * d.N, seed + 1), bias = randn(d.N, seed + 2);
            Operand av(a, compute), bv(b, compute), biasv(bias, bias_t);
            DeviceBuffer fused = upload(randn(d.M * d.N, seed + 3)), separate = upload(randn(d.M * d.N, seed + 3));
            cuda::matmul(d, av.device(), bv.device(), fused.as<float>(), stream.get(), biasv.device());
            cuda::set_separate_bias_for_testing(true);
            EXPECT_FALSE(cuda::matmul_bias_in_epilogue(d));
            cuda::matmul(d, av.device(), bv.device(), separate.as<float>(), stream.get(), biasv.device());
            cuda::set_separate_bias_for_testing(false);
            stream.synchronize();
            const auto f = download<float>(fused, d.M * d.N), g = download<float>(separate, d.M * d.N);
#ifdef ZINC_CUDA_EMU
            for (size_t i = 0; i < f.size(); ++i)
              ASSERT_EQ(std::memcmp(&f[i], &g[i], sizeof(float)), 0)
                  << describe(d, compute, compute) << " at " << i << ": " << f[i] << " against " << g[i];
#else
            EXPECT_TRUE(AllClose(f, g, 1e-3, 1e-3)) << describe(d, compute, compute);
#endif
          }
  // Where it does not apply: accumulate, several batches, no bias.
  EXPECT_FALSE(cuda::matmul_bias_in_epilogue({.M = 4, .N = 4, .K = 4, .accumulate = true, .bias = true}));
  EXPECT_FALSE(cuda::matmul_bias_in_epilogue({.batch = 2, .M = 4, .N = 4, .K = 4, .bias = true}));
  EXPECT_FALSE(cuda::matmul_bias_in_epilogue({.M = 4, .N = 4, .K = 4}));
}

TEST(CudaMatmul, MixedOperandDtypesAreConvertedToCompute) {
  ZINC_REQUIRE_GPU();
  const MatmulDesc base{.batch = 2, .M = 37, .N = 53, .K = 19, .trans_b = true};
  struct Mix {
    DType a, b, compute;
  };
  uint64_t seed = 3000;
  for (const Mix& x : {Mix{DType::kF32, DType::kBF16, DType::kBF16}, Mix{DType::kBF16, DType::kF32, DType::kBF16},
                       Mix{DType::kF32, DType::kF16, DType::kF16}, Mix{DType::kF16, DType::kF32, DType::kF16},
                       Mix{DType::kF32, DType::kBF16, DType::kF32}, Mix{DType::kF16, DType::kF32, DType::kF32}})
    for (bool ta : {false, true}) {
      MatmulDesc d = base;
      d.trans_a = ta;
      d.compute = x.compute;
      check_matmul(d, x.a, x.b, seed += 4);
    }
  // Converting fp32 operands on the device gives exactly what pre-converted
  // 16-bit operands give (the conversion is core/dtype.h's, bit for bit).
  for (DType t : {DType::kBF16, DType::kF16}) {
    MatmulDesc d = base;
    d.compute = t;
    const auto a = randn(2 * 37 * 19, 3100), b = randn(2 * 53 * 19, 3101);
    Operand a32(a, DType::kF32), b32(b, DType::kF32), a16(a, t), b16(b, t);
    DeviceBuffer c1(2 * 37 * 53 * sizeof(float)), c2(2 * 37 * 53 * sizeof(float));
    zinc::cuda::Stream stream;
    cuda::matmul(d, a32.device(), b32.device(), c1.as<float>(), stream.get());
    cuda::matmul(d, a16.device(), b16.device(), c2.as<float>(), stream.get());
    stream.synchronize();
    const auto r1 = download<float>(c1, 2 * 37 * 53), r2 = download<float>(c2, 2 * 37 * 53);
    EXPECT_EQ(std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(float)), 0) << dtype_name(t);
  }
}

TEST(CudaMatmul, ZeroSizedDimensions) {
  ZINC_REQUIRE_GPU();
  zinc::cuda::Stream stream;
  const std::vector<float> ones(12, 1.0f), five(12, 5.0f), bias = {1.0f, 2.0f, 3.0f, 4.0f};
  DeviceBuffer a = upload(ones), b = upload(ones), c = upload(five), bd = upload(bias);
  const CView av{a.data(), DType::kF32}, bv{b.data(), DType::kF32};
  // K = 0: the empty product is zero, plus C when accumulating, plus the bias.
  cuda::matmul({.M = 3, .N = 4, .K = 0, .accumulate = true}, av, bv, c.as<float>(), stream.get());
  stream.synchronize();
  auto got = download<float>(c, 12);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return v == 5.0f; }));
  cuda::matmul({.M = 3, .N = 4, .K = 0}, av, bv, c.as<float>(), stream.get());
  stream.synchronize();
  got = download<float>(c, 12);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float v) { return v == 0.0f; }));
  cuda::matmul({.M = 3, .N = 4, .K = 0, .bias = true}, av, bv, c.as<float>(), stream.get(),
               {bd.data(), DType::kF32});
  stream.synchronize();
  got = download<float>(c, 12);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(got[i], bias[i % 4]) << i;
  // M, N or batch = 0: nothing to touch.
  cuda::matmul({.M = 0, .N = 4, .K = 3}, av, bv, nullptr, stream.get());
  cuda::matmul({.M = 3, .N = 0, .K = 3}, av, bv, nullptr, stream.get());
  cuda::matmul({.batch = 0, .M = 3, .N = 4, .K = 3}, av, bv, nullptr, stream.get());
  stream.synchronize();
}

// As on the CPU: an fp32 operand beyond fp16's range becomes Inf in an fp16 matmul.
TEST(CudaMatmul, Fp16OperandAboveTheRangeOverflowsToInf) {
  ZINC_REQUIRE_GPU();
  const std::vector<float> a = {70000.0f, 0.0f, 1.0f, 2.0f}, b = {1.0f, 0.0f, 0.0f, 1.0f};
  Operand av(a, DType::kF32), bv(b, DType::kF16);
  DeviceBuffer c(4 * sizeof(float));
  zinc::cuda::Stream stream;
  cuda::matmul({.M = 2, .N = 2, .K = 2, .compute = DType::kF16}, av.device(), bv.device(), c.as<float>(),
               stream.get());
  stream.synchronize();
  auto got = download<float>(c, 4);
  EXPECT_TRUE(std::isinf(got[0]));
  EXPECT_EQ(got[2], 1.0f);
  EXPECT_EQ(got[3], 2.0f);
  Operand b32(b, DType::kF32);
  cuda::matmul({.M = 2, .N = 2, .K = 2}, av.device(), b32.device(), c.as<float>(), stream.get());
  stream.synchronize();
  got = download<float>(c, 4);
  EXPECT_EQ(got[0], 70000.0f);
}

TEST(CudaMatmul, SeveralStreamsOfOneThreadEachGiveTheCpuResult) {
  ZINC_REQUIRE_GPU();
  // Streams converting operands at once: each has its own scratch. Twelve
  // streams also pass the per-thread limit of eight (matmul.cu's
  // kMaxStreams), so older streams' scratch is dropped on the way.
  const MatmulDesc d{.batch = 2, .M = 65, .N = 130, .K = 97, .trans_b = true, .compute = DType::kBF16};
  const size_t na = 2 * 65 * 97, nb = 2 * 130 * 97, nc = 2 * 65 * 130;
  constexpr int kStreams = 12;
  std::vector<std::unique_ptr<Operand>> as, bs;
  std::vector<std::vector<float>> want;
  std::vector<std::unique_ptr<zinc::cuda::Stream>> streams;
  std::vector<DeviceBuffer> cs;
  for (int i = 0; i < kStreams; ++i) {
    as.push_back(std::make_unique<Operand>(randn(na, 4000 + 2 * i), DType::kF32));
    bs.push_back(std::make_unique<Operand>(randn(nb, 4001 + 2 * i), DType::kBF16));
    want.emplace_back(nc);
    matmul(d, as[i]->host(), bs[i]->host(), want[i].data());
    streams.push_back(std::make_unique<zinc::cuda::Stream>());
    cs.emplace_back(nc * sizeof(float));
  }
  for (int rep = 0; rep < 2; ++rep)
    for (int i = 0; i < kStreams; ++i)
      cuda::matmul(d, as[i]->device(), bs[i]->device(), cs[i].as<float>(), streams[i]->get());
  // Loose here (the strict bound is check_matmul's): a mix-up of scratch
  // would give a different product altogether.
  for (int i = 0; i < kStreams; ++i) {
    streams[i]->synchronize();
    EXPECT_TRUE(AllClose(download<float>(cs[i], nc), want[i], 1e-3, 1e-3)) << "stream " << i;
  }
}

// Argument checks happen before any device work: these run without a GPU.
// Strided operands and result (MatmulDesc::lda, ldb, ldc: LoRA's column
// blocks of a wider matrix) as cuBLAS's leading dimensions, against the
// CPU's strided matmul: every transpose, accumulate or not, fp32 operands
// converted to a 16-bit compute dtype with their strides kept. The wider
// matrices' other columns are neither read into the result nor written:
// C's start as a guard value and stay it.
TEST(CudaMatmul, StridedOperandsAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  const int64_t M = 37, N = 19, K = 23;
  uint64_t seed = 7000;
  for (DType compute : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType operands : {DType::kF32, compute})
      for (bool ta : {false, true})
        for (bool tb : {false, true})
          for (bool acc : {false, true}) {
            if (compute == DType::kF32 && operands != DType::kF32) continue;
            MatmulDesc d{.M = M, .N = N, .K = K, .trans_a = ta, .trans_b = tb, .accumulate = acc, .compute = compute};
            const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
            d.lda = a_cols + 5;
            d.ldb = b_cols + 3;
            d.ldc = N + 7;
            const auto a = randn(a_rows * d.lda, seed += 3), b = randn(b_rows * d.ldb, seed + 1);
            std::vector<float> c0 = randn(M * d.ldc, seed + 2);
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = N; n < d.ldc; ++n) c0[m * d.ldc + n] = 1234.5f;  // outside the result
            Operand av(a, operands), bv(b, operands);
            std::vector<float> cpu = c0;
            matmul(d, av.host(), bv.host(), cpu.data());
            DeviceBuffer c_dev = upload(c0);
            zinc::cuda::Stream stream;
            cuda::matmul(d, av.device(), bv.device(), c_dev.as<float>(), stream.get());
            stream.synchronize();
            const auto gpu = download<float>(c_dev, c0.size());
            const std::string what = describe(d, operands, operands) + " lda/ldb/ldc " + std::to_string(d.lda) + "/" +
                                     std::to_string(d.ldb) + "/" + std::to_string(d.ldc);
            // The same rounded operands on both sides, fp32 sums in two orders.
            EXPECT_TRUE(AllClose(gpu, cpu, 1e-4, 1e-5)) << what;
            for (int64_t m = 0; m < M; ++m)
              for (int64_t n = N; n < d.ldc; ++n)
                ASSERT_EQ(gpu[m * d.ldc + n], 1234.5f) << what << ": wrote outside the result at row " << m;
          }
  // Batched, or a stride below its row, or a fused bias into a strided result: refused.
  float dummy = 0;
  const CView v{&dummy, DType::kF32};
  EXPECT_THROW(cuda::matmul({.batch = 2, .M = 2, .N = 2, .K = 2, .lda = 4}, v, v, &dummy, nullptr), zinc::Error);
  EXPECT_THROW(cuda::matmul({.M = 2, .N = 2, .K = 3, .lda = 2}, v, v, &dummy, nullptr), zinc::Error);
  EXPECT_THROW(cuda::matmul({.M = 2, .N = 2, .K = 2, .bias = true, .ldc = 4}, v, v, &dummy, nullptr, v), zinc::Error);
}

TEST(CudaMatmul, BadArgumentsThrowBeforeTouchingTheDevice) {
  float dummy = 0;
  const CView v{&dummy, DType::kF32};
  EXPECT_THROW(cuda::matmul({.M = -1, .N = 2, .K = 2}, v, v, &dummy, nullptr), zinc::Error);
  EXPECT_THROW(cuda::matmul({.M = 2, .N = 2, .K = 2, .bias = true}, v, v, &dummy, nullptr), zinc::Error);
  EXPECT_THROW(cuda::matmul({.M = 2, .N = 2, .K = 2, .bias = true, .alpha = 2.0f}, v, v, &dummy, nullptr, v),
               zinc::Error);
}

// ---- attention --------------------------------------------------------------------------------
// These hold the unfused path (attention.cu) at every compute dtype; the
// fused kernels, which bf16 and fp16 compute take by default, have their own
// tests (tests/cuda/cuda_flash_attention_test.cpp).
class CudaAttention : public ::testing::Test {
 protected:
  void SetUp() override { cuda::set_unfused_attention_for_testing(true); }
  void TearDown() override { cuda::set_unfused_attention_for_testing(false); }
};

struct CpuWs {
  AttentionWorkspace* ws = attention_workspace_create();
  ~CpuWs() { attention_workspace_destroy(ws); }
};
struct GpuWs {
  cuda::CudaAttentionWorkspace* ws = cuda::attention_workspace_create();
  ~GpuWs() { cuda::attention_workspace_destroy(ws); }
};

struct AttResult {
  std::vector<float> out, dqkv;
};

AttResult cpu_attention(AttentionShape s, DType compute, const std::vector<float>& qkv,
                        const std::vector<float>& dout) {
  CpuWs w;
  AttResult r{std::vector<float>(s.B * s.T * s.C), std::vector<float>(qkv.size())};
  attention_forward(w.ws, r.out.data(), qkv.data(), s, compute);
  attention_backward(w.ws, r.dqkv.data(), dout.data(), qkv.data(), s, compute);
  return r;
}

// s.positions, if any, are host memory here (the CPU kernel's); the GPU gets a device copy.
AttResult gpu_attention(AttentionShape s, DType compute, const std::vector<float>& qkv,
                        const std::vector<float>& dout) {
  GpuWs w;
  DeviceBuffer pos;
  if (s.positions) {
    pos = upload(std::vector<int32_t>(s.positions, s.positions + s.B * s.T));
    s.positions = pos.as<int32_t>();
  }
  zinc::cuda::Stream stream;
  DeviceBuffer q = upload(qkv), g = upload(dout);
  DeviceBuffer out(s.B * s.T * s.C * sizeof(float));
  // dqkv is written, not accumulated: start from garbage.
  DeviceBuffer dqkv = upload(std::vector<float>(qkv.size(), 123.0f));
  cuda::attention_forward(w.ws, out.as<float>(), q.as<float>(), s, compute, stream.get());
  cuda::attention_backward(w.ws, dqkv.as<float>(), g.as<float>(), q.as<float>(), s, compute, stream.get());
  stream.synchronize();
  return {download<float>(out, s.B * s.T * s.C), download<float>(dqkv, qkv.size())};
}

std::string describe(AttentionShape s, DType compute) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
         " H=" + std::to_string(s.H) + " " + std::string(dtype_name(compute)) + (s.positions ? " packed" : "") +
         (s.window > 0 ? " window " + std::to_string(s.window) : "") +
         (s.scale > 0 ? " scale " + std::to_string(s.scale) : "") +
         (s.softcap > 0 ? " softcap " + std::to_string(s.softcap) : "");
}

void check_attention(AttentionShape s, DType compute, uint64_t seed, double tol) {
  const auto qkv = randn(s.B * s.T * 3 * s.C, seed), dout = randn(s.B * s.T * s.C, seed + 1);
  const AttResult cpu = cpu_attention(s, compute, qkv, dout);
  const AttResult gpu = gpu_attention(s, compute, qkv, dout);
  EXPECT_TRUE(AllClose(gpu.out, cpu.out, tol, tol)) << "forward " << describe(s, compute);
  EXPECT_TRUE(AllClose(gpu.dqkv, cpu.dqkv, tol, tol)) << "backward " << describe(s, compute);
}

const AttentionShape kAttShapes[] = {{2, 37, 64, 4}, {1, 128, 128, 2}, {1, 1, 4, 1}, {2, 17, 12, 3}};

TEST_F(CudaAttention, F32ForwardAndBackwardAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 5000;
  for (auto s : kAttShapes) check_attention(s, DType::kF32, seed += 2, 2e-4);
}

TEST_F(CudaAttention, Bf16ForwardAndBackwardAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 5100;
  for (auto s : kAttShapes) check_attention(s, DType::kBF16, seed += 2, 2e-2);
}

TEST_F(CudaAttention, Fp16ForwardAndBackwardAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 5200;
  for (auto s : kAttShapes) check_attention(s, DType::kF16, seed += 2, 3e-3);
}

// Packed documents (Note [document boundaries] in attention.cpp): several
// documents per row, of length 1 and longer than 16 lanes, cut differently
// in each row; the tolerances above.
TEST_F(CudaAttention, PackedDocumentsAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 5250;
  for (AttentionShape s : kAttShapes) {
    const std::vector<int32_t> pos = zinc::cuda::testing::packed_positions(s.B, s.T);
    s.positions = pos.data();
    check_attention(s, DType::kF32, seed += 2, 2e-4);
    check_attention(s, DType::kBF16, seed += 2, 2e-2);
    check_attention(s, DType::kF16, seed += 2, 3e-3);
  }
}

// Sliding-window attention (AttentionShape::window, Mistral's
// sliding_window): windows of 1, shorter than 16 lanes and longer than the
// sequence, alone and with packed documents; the tolerances above.
TEST_F(CudaAttention, SlidingWindowsAgreeWithCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 5300;
  for (AttentionShape s : kAttShapes)
    for (int64_t w : {int64_t{1}, int64_t{5}, int64_t{40}}) {
      s.window = w;
      s.positions = nullptr;
      check_attention(s, DType::kF32, seed += 2, 2e-4);
      check_attention(s, DType::kBF16, seed += 2, 2e-2);
      const std::vector<int32_t> pos = zinc::cuda::testing::packed_positions(s.B, s.T);
      s.positions = pos.data();
      check_attention(s, DType::kF32, seed += 2, 2e-4);
      s.scale = 0.2f;  // Granite's attention_multiplier instead of 1/sqrt(head size)
      check_attention(s, DType::kF32, seed += 2, 2e-4);
      s.softcap = 0.7f;  // Gemma 2's attn_logit_softcapping (recomputed scores in backward)
      check_attention(s, DType::kF32, seed += 2, 2e-4);
      check_attention(s, DType::kBF16, seed += 2, 2e-2);
      s.scale = 0.0f;
      s.softcap = 0.0f;
    }
}

// With K and V one-hot along the head dimension (k_t' = v_t' = e_t', which
// needs hs >= T), every GEMM whose result the row kernels read has a single
// nonzero term per element, so it is exact on both sides whatever the
// summation order:
//   S = scale Q K^T has S[t,t'] = scale q[t,t'] (scale = 1/8 for hs = 64),
//   Y = P V has Y[t,i] = P[t,i]        -> out shows P,
//   dP = dO V^T has dP[t,t'] = dO[t,t'],
//   dQ = scale dS K has dQ[t,i] = scale dS[t,i] -> dq shows dS.
// So out and the dq part of dqkv must equal the CPU's exactly: the softmax
// (max, exp_f, lane-order sum, 1/sum) and rowsum(P * dP) kernels reproduce
// the CPU's formulas and order (Note [GPU softmax rows] in attention.cu).
// dk and dv are real sums and are checked with the tolerances above. (TF32
// in the fp32 GEMMs would also show here: it would round q and dO.) With
// packed documents too: the rows from their first key on, zeros elsewhere.
TEST_F(CudaAttention, SoftmaxRowsMatchTheCpuBitForBit) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 5300;
  for (AttentionShape s : {AttentionShape{2, 37, 128, 2}, AttentionShape{1, 64, 192, 3}})
    for (bool packed : {false, true})
    for (DType compute : {DType::kF32, DType::kBF16, DType::kF16}) {
      const std::vector<int32_t> pos = zinc::cuda::testing::packed_positions(s.B, s.T);
      s.positions = packed ? pos.data() : nullptr;
      const int64_t hs = s.C / s.H;
      ASSERT_GE(hs, s.T);
      auto qkv = randn(s.B * s.T * 3 * s.C, seed += 2, 3.0f);
      const auto dout = randn(s.B * s.T * s.C, seed + 1);
      for (int64_t r = 0; r < s.B * s.T; ++r) {
        const int64_t t = r % s.T;
        for (int64_t h = 0; h < s.H; ++h)
          for (int64_t i = 0; i < hs; ++i) {
            const float onehot = i == t ? 1.0f : 0.0f;
            qkv[r * 3 * s.C + s.C + h * hs + i] = onehot;      // k
            qkv[r * 3 * s.C + 2 * s.C + h * hs + i] = onehot;  // v
          }
      }
      const AttResult cpu = cpu_attention(s, compute, qkv, dout);
      const AttResult gpu = gpu_attention(s, compute, qkv, dout);
      size_t out_bad = 0, dq_bad = 0;
      for (size_t i = 0; i < cpu.out.size(); ++i) out_bad += !(gpu.out[i] == cpu.out[i]);
      for (int64_t r = 0; r < s.B * s.T; ++r)
        for (int64_t c = 0; c < s.C; ++c) dq_bad += !(gpu.dqkv[r * 3 * s.C + c] == cpu.dqkv[r * 3 * s.C + c]);
      EXPECT_EQ(out_bad, 0u) << "P differs: " << describe(s, compute);
      EXPECT_EQ(dq_bad, 0u) << "dS differs: " << describe(s, compute);
      const double tol = compute == DType::kF32 ? 2e-4 : compute == DType::kBF16 ? 2e-2 : 3e-3;
      EXPECT_TRUE(AllClose(gpu.dqkv, cpu.dqkv, tol, tol)) << "dk, dv: " << describe(s, compute);
    }
}

TEST_F(CudaAttention, EachLayerKeepsItsOwnWorkspace) {
  ZINC_REQUIRE_GPU();
  const AttentionShape s{2, 37, 64, 4};
  const auto qkv1 = randn(s.B * s.T * 3 * s.C, 5400), qkv2 = randn(s.B * s.T * 3 * s.C, 5401);
  const auto dout = randn(s.B * s.T * s.C, 5402);
  const AttResult want = cpu_attention(s, DType::kF32, qkv1, dout);
  GpuWs w1, w2;
  zinc::cuda::Stream stream;
  DeviceBuffer q1 = upload(qkv1), q2 = upload(qkv2), g = upload(dout);
  DeviceBuffer out(s.B * s.T * s.C * sizeof(float)), dqkv(qkv1.size() * sizeof(float));
  cuda::attention_forward(w1.ws, out.as<float>(), q1.as<float>(), s, DType::kF32, stream.get());
  cuda::attention_forward(w2.ws, out.as<float>(), q2.as<float>(), s, DType::kF32, stream.get());
  cuda::attention_backward(w1.ws, dqkv.as<float>(), g.as<float>(), q1.as<float>(), s, DType::kF32, stream.get());
  stream.synchronize();
  EXPECT_TRUE(AllClose(download<float>(dqkv, qkv1.size()), want.dqkv, 2e-4, 2e-4));
}

// The shape checks come before any device work: this runs without a GPU.
TEST_F(CudaAttention, BackwardWithoutMatchingForwardThrows) {
  GpuWs w;
  const AttentionShape s{1, 4, 8, 2};
  EXPECT_THROW(cuda::attention_backward(w.ws, nullptr, nullptr, nullptr, s, DType::kF32, nullptr), zinc::Error);
  EXPECT_THROW(cuda::attention_forward(w.ws, nullptr, nullptr, {1, 4, 9, 2}, DType::kF32, nullptr), zinc::Error);
  // B = 0 records the (empty) forward without touching the device; another shape still throws.
  cuda::attention_forward(w.ws, nullptr, nullptr, {0, 4, 8, 2}, DType::kF32, nullptr);
  cuda::attention_backward(w.ws, nullptr, nullptr, nullptr, {0, 4, 8, 2}, DType::kF32, nullptr);
  EXPECT_THROW(cuda::attention_backward(w.ws, nullptr, nullptr, nullptr, s, DType::kF32, nullptr), zinc::Error);
}

// ---- the shared row-sum order ----------------------------------------------------------------------

// Note [lane order]: a GPU row sum is kLanes threads, thread l computing
// math::lane_partial(n, l, f), then the partials added in lane order from
// zero. That must be exactly the CPU's detail::lane_sum: the same roundings
// in the same order. The data spans many magnitudes and signs so that any
// other order would show in the bits.
template <class Acc>
Acc lane_order_sum(int64_t n, const std::vector<float>& x) {
  Acc partial[math::kLanes];
  for (int l = 0; l < math::kLanes; ++l)
    partial[l] = math::lane_partial<Acc>(n, l, [&](int64_t i) { return x[static_cast<size_t>(i)]; });
  Acc s = 0;
  for (int l = 0; l < math::kLanes; ++l) s += partial[l];
  return s;
}

TEST(LaneOrder, LanePartialsCombinedInLaneOrderEqualLaneSum) {
  Rng rng(6000);
  std::vector<float> x(4097);
  for (auto& v : x) v = static_cast<float>(rng.normal() * std::ldexp(1.0, static_cast<int>(rng.below(40)) - 20));
  int differs_from_sequential = 0;
  for (int64_t n : {0, 1, 15, 16, 17, 1000, 4097}) {
    auto f = [&](int64_t i) { return x[static_cast<size_t>(i)]; };
    const float gf = lane_order_sum<float>(n, x), cf = detail::lane_sum<float>(n, f);
    const double gd = lane_order_sum<double>(n, x), cd = detail::lane_sum<double>(n, f);
    EXPECT_EQ(float_bits(gf), float_bits(cf)) << "float, n=" << n;
    uint64_t gb, cb;
    std::memcpy(&gb, &gd, 8);
    std::memcpy(&cb, &cd, 8);
    EXPECT_EQ(gb, cb) << "double, n=" << n;
    float seq = 0;
    for (int64_t i = 0; i < n; ++i) seq += x[static_cast<size_t>(i)];
    differs_from_sequential += float_bits(seq) != float_bits(cf);
  }
  // The data does tell orders apart: a plain left-to-right sum differs somewhere.
  EXPECT_GT(differs_from_sequential, 0);
}

}  // namespace
}  // namespace zinc::kernels
