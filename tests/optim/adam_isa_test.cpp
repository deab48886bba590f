// Every optimizer ISA path against the scalar path, on awkward lengths and
// special values.
//
// Tolerance: the vector paths compute Note [Adam arithmetic] with fused
// multiply-adds (one rounding) where the scalar path rounds the product and
// the sum separately. A fused result differs from the unfused one by at most
// one rounding of the product, i.e. half an ulp of the product's magnitude,
// and those differences feed the next operations. Each result is therefore
// checked against 4 ulps of the sum of the magnitudes of the terms that make
// it (not of the result, which can be tiny after cancellation), plus, for the
// weight, 8 ulps of the update's magnitude (m / denom carries the
// differences of m, v, sqrt and the division).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/cpu.h"
#include "core/alloc.h"
#include "core/error.h"
#include "core/rng.h"
#include "optim/optim.h"
#include "tests/optim/isa_test_util.h"

namespace zinc::optim {
namespace {

using testing::kAll;
using testing::ulp;

struct State {
  std::vector<float> w, m, v, g32;
  std::vector<bf16> g16, out;
};

State random_state(size_t n, uint64_t seed) {
  Rng rng(seed);
  State s;
  s.w.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.g32.resize(n);
  s.g16.resize(n);
  s.out.assign(n, bf16{0});
  for (size_t i = 0; i < n; ++i) {
    s.w[i] = static_cast<float>(rng.normal());
    s.m[i] = static_cast<float>(rng.normal() * 0.01);
    s.v[i] = static_cast<float>(rng.uniform() * 1e-4);
    s.g32[i] = static_cast<float>(rng.normal() * 0.01);
    s.g16[i] = float_to_bf16(s.g32[i]);
  }
  return s;
}

struct Mode {
  bool adamw;
  double wd;
  bool bias_correction;
  bool grad_bf16;
  bool out;
};

void run(Isa isa, const AdamParams& p, const Mode& mode, State& s, int64_t step) {
  AdamSpan span{s.w.data(), mode.grad_bf16 ? static_cast<const void*>(s.g16.data()) : s.g32.data(),
                mode.grad_bf16 ? DType::kBF16 : DType::kF32, s.m.data(), s.v.data(),
                mode.out ? s.out.data() : nullptr, static_cast<int64_t>(s.w.size())};
  adam_step(p, step, 0.75f, span, isa);
}

TEST(AdamIsa, EveryPathAgreesWithScalarOnAwkwardLengthsAndModes) {
  const size_t lengths[] = {0, 1, 7, 15, 16, 17, 31, 33, 1000, 16 * 4096 + 3, 100003};
  const Mode modes[] = {{true, 0.1, true, false, true},  {true, 0.0, true, false, false},
                        {false, 0.1, true, false, true}, {false, 0.01, false, true, true},
                        {true, 0.1, false, true, false}, {true, 0.05, true, true, true}};
  for (Isa isa : kAll) {
    if (!isa_supported(isa)) continue;
    for (const Mode& mode : modes)
      for (size_t n : lengths) {
        AdamParams p;
        p.lr = 1e-3;
        p.weight_decay = mode.wd;
        p.adam_w_mode = mode.adamw;
        p.bias_correction = mode.bias_correction;
        State ref = random_state(n, n + 1), got = ref;
        const State before = ref;
        run(Isa::kScalar, p, mode, ref, 3);
        run(isa, p, mode, got, 3);
        for (size_t i = 0; i < n; ++i) {
          const double g = (mode.grad_bf16 ? bf16_to_float(before.g16[i]) : before.g32[i]) * 0.75;
          const double gl2 = std::fabs(g) + (mode.adamw ? 0.0 : mode.wd * std::fabs(before.w[i]));
          const double m_scale = p.beta1 * std::fabs(before.m[i]) + (1 - p.beta1) * gl2;
          const double v_scale = p.beta2 * before.v[i] + (1 - p.beta2) * gl2 * gl2;
          const double upd = std::fabs(double(ref.w[i]) - before.w[i]);
          ASSERT_LE(std::fabs(double(got.m[i]) - ref.m[i]), 4 * ulp(m_scale))
              << isa_name(isa) << " n=" << n << " i=" << i;
          ASSERT_LE(std::fabs(double(got.v[i]) - ref.v[i]), 4 * ulp(v_scale))
              << isa_name(isa) << " n=" << n << " i=" << i;
          ASSERT_LE(std::fabs(double(got.w[i]) - ref.w[i]), 4 * ulp(before.w[i]) + 8 * ulp(upd))
              << isa_name(isa) << " n=" << n << " i=" << i;
          if (mode.out) {
            ASSERT_EQ(got.out[i].bits, float_to_bf16(got.w[i]).bits) << isa_name(isa) << " i=" << i;
          }
        }
      }
  }
}

TEST(AdamIsa, Bf16CopyOutEqualsCoreConversionOnSpecialValues) {
  // Subnormal weights (which VCVTNEPS2BF16 alone would flush), zeros, Inf and
  // NaN pass through an update that leaves them unchanged or makes them NaN.
  const size_t n = 67;
  for (Isa isa : kAll) {
    if (!isa_supported(isa)) continue;
    State s = random_state(n, 5);
    for (size_t i = 0; i < n; i += 3) {
      const float specials[] = {1e-40f, -3e-39f, 1.17e-38f, 0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::denorm_min(), 9.2e-41f};
      s.w[i] = specials[(i / 3) % 8];
      s.g32[i] = 0.0f;
      s.m[i] = 0.0f;
      s.v[i] = 0.0f;
    }
    s.g32[1] = std::numeric_limits<float>::quiet_NaN();
    AdamParams p;  // no weight decay: a zero gradient leaves w unchanged
    run(isa, p, {true, 0.0, true, false, true}, s, 1);
    EXPECT_TRUE(std::isnan(s.w[1])) << isa_name(isa);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(s.out[i].bits, float_to_bf16(s.w[i]).bits) << isa_name(isa) << " i=" << i << " w=" << s.w[i];
    }
    EXPECT_EQ(s.w[0], 1e-40f);  // unchanged, and its bf16 copy is not flushed
    EXPECT_NE(s.out[0].bits, 0u);
  }
}

TEST(AdamIsa, ResultsAreBitIdenticalForOneAndTwoThreads) {
  const size_t n = 300007;
  for (Isa isa : kAll) {
    if (!isa_supported(isa)) continue;
    AdamParams p;
    p.weight_decay = 0.01;
    State a = random_state(n, 17), b = a;
    omp_set_num_threads(1);
    run(isa, p, {true, 0.01, true, false, true}, a, 7);
    double na = grad_squared_norm(a.g32.data(), DType::kF32, static_cast<int64_t>(n), isa);
    omp_set_num_threads(2);
    run(isa, p, {true, 0.01, true, false, true}, b, 7);
    double nb = grad_squared_norm(b.g32.data(), DType::kF32, static_cast<int64_t>(n), isa);
    EXPECT_EQ(std::memcmp(a.w.data(), b.w.data(), n * 4), 0) << isa_name(isa);
    EXPECT_EQ(std::memcmp(a.m.data(), b.m.data(), n * 4), 0) << isa_name(isa);
    EXPECT_EQ(std::memcmp(a.v.data(), b.v.data(), n * 4), 0) << isa_name(isa);
    EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), n * 2), 0) << isa_name(isa);
    EXPECT_EQ(na, nb) << isa_name(isa);
  }
}

TEST(AdamIsa, Avx512WithAndWithoutTheBf16InstructionAreBitIdentical) {
  if (!isa_supported(Isa::kAvx512Bf16))
    GTEST_SKIP() << "avx512_bf16 cannot run here: " << cpu_isa_missing(CpuIsa::kAvx512Bf16);
  AdamParams p;
  p.weight_decay = 0.1;
  State a = random_state(5003, 3), b = a;
  run(Isa::kAvx512, p, {true, 0.1, true, true, true}, a, 2);
  run(Isa::kAvx512Bf16, p, {true, 0.1, true, true, true}, b, 2);
  EXPECT_EQ(std::memcmp(a.w.data(), b.w.data(), a.w.size() * 4), 0);
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.size() * 2), 0);
}

TEST(AdamIsa, StreamedCopyOutEqualsStoredCopyOut) {
  for (Isa isa : kAll) {
    if (!isa_supported(isa)) continue;
    for (size_t n : {size_t{1}, size_t{17}, size_t{100003}}) {
      State a = random_state(n, 31), b = a;
      AlignedBuffer out_a = make_buffer<bf16>(n), out_b = make_buffer<bf16>(n);  // 64-byte aligned
      AdamParams p;
      p.weight_decay = 0.1;
      set_stream_min_bytes(int64_t{1} << 40);  // plain stores
      adam_step(p, 2, 1.0f, AdamSpan{a.w.data(), a.g32.data(), DType::kF32, a.m.data(), a.v.data(), out_a.as<bf16>(),
                                     static_cast<int64_t>(n)}, isa);
      set_stream_min_bytes(0);  // non-temporal stores
      adam_step(p, 2, 1.0f, AdamSpan{b.w.data(), b.g32.data(), DType::kF32, b.m.data(), b.v.data(), out_b.as<bf16>(),
                                     static_cast<int64_t>(n)}, isa);
      set_stream_min_bytes(kStreamMinBytes);
      EXPECT_EQ(std::memcmp(out_a.data(), out_b.data(), n * 2), 0) << isa_name(isa) << " n=" << n;
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out_b.as<bf16>()[i].bits, float_to_bf16(b.w[i]).bits);
    }
  }
}

TEST(GradNorm, EveryPathAgreesWithScalarInFp32AndBf16) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16385}, size_t{100003}}) {
    State s = random_state(n, 23);
    double ref32 = grad_squared_norm(s.g32.data(), DType::kF32, static_cast<int64_t>(n), Isa::kScalar);
    double ref16 = grad_squared_norm(s.g16.data(), DType::kBF16, static_cast<int64_t>(n), Isa::kScalar);
    double direct = 0;
    for (float g : s.g32) direct += double(g) * g;
    EXPECT_NEAR(ref32, direct, 1e-12 * (1 + direct));
    for (Isa isa : kAll) {
      if (!isa_supported(isa)) continue;
      // Squares are exact in double; only the order of the double additions differs.
      EXPECT_NEAR(grad_squared_norm(s.g32.data(), DType::kF32, static_cast<int64_t>(n), isa), ref32, 1e-13 * (1 + ref32));
      EXPECT_NEAR(grad_squared_norm(s.g16.data(), DType::kBF16, static_cast<int64_t>(n), isa), ref16, 1e-13 * (1 + ref16));
    }
  }
}

TEST(AdamIsa, DispatchPicksTheBestSupportedPathAndRejectsUnknownNames) {
  Isa best = detect_isa();
  EXPECT_TRUE(isa_supported(best));
  EXPECT_EQ(parse_isa(isa_name(best)), best);
  EXPECT_THROW(parse_isa("sse9"), Error);
  EXPECT_TRUE(isa_supported(Isa::kScalar));
}

// The tests above loop over the paths this CPU can run; this one names the
// paths they left out and the instructions (or the cap) that ruled them out.
TEST(AdamIsa, PathsThisCpuCannotRunAreNamed) {
  std::string left_out;
  for (Isa isa : kAll) {
    if (isa_supported(isa)) continue;
    const CpuIsa level = isa == Isa::kAvx2 ? CpuIsa::kAvx2 : isa == Isa::kAvx512 ? CpuIsa::kAvx512 : CpuIsa::kAvx512Bf16;
    left_out += std::string(left_out.empty() ? "" : "; ") + std::string(isa_name(isa)) + ": " + cpu_isa_missing(level);
  }
  if (!left_out.empty()) GTEST_SKIP() << "not tested here: " << left_out;
}

}  // namespace
}  // namespace zinc::optim
