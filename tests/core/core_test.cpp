#include <gtest/gtest.h>
#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/alloc.h"
#include "core/cpu.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/rng.h"

namespace zinc {
namespace {

TEST(Bf16, ExactValuesRoundTrip) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 0.15625f, 65536.0f, -1.0e-20f}) {
    bf16 h = float_to_bf16(f);
    float back = bf16_to_float(h);
    if (float_bits(f) & 0xffffu) continue;  // not representable exactly
    EXPECT_EQ(float_bits(back), float_bits(f)) << f;
  }
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: tie goes to even (1).
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808000u)).bits, 0x3f80u);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd mantissa) and 1+2^-6: goes up to even.
  EXPECT_EQ(float_to_bf16(bits_float(0x3f818000u)).bits, 0x3f82u);
  // Just above halfway rounds up, just below rounds down.
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808001u)).bits, 0x3f81u);
  EXPECT_EQ(float_to_bf16(bits_float(0x3f807fffu)).bits, 0x3f80u);
  // Negative numbers round the magnitude the same way.
  EXPECT_EQ(float_to_bf16(bits_float(0xbf808001u)).bits, 0xbf81u);
}

TEST(Bf16, InfinityAndNanAreKept) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_bf16(inf).bits, 0x7f80u);
  EXPECT_EQ(float_to_bf16(-inf).bits, 0xff80u);
  // A NaN whose payload sits only in the low 16 bits must not become Inf.
  bf16 n = float_to_bf16(bits_float(0x7f800001u));
  EXPECT_TRUE(std::isnan(bf16_to_float(n)));
  bf16 qn = float_to_bf16(-std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(bf16_to_float(qn)));
  EXPECT_EQ(qn.bits & 0x8000u, 0x8000u);  // sign kept
  // The largest finite float rounds up to Inf, as IEEE rounding requires.
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80u);
}

TEST(Bf16, BulkConversionMatchesScalarOnAwkwardLengths) {
  Rng rng(7);
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{17}, size_t{100003}}) {
    std::vector<float> src(n);
    for (float& x : src) x = static_cast<float>(rng.normal() * 100.0);
    if (n > 3) {
      src[1] = std::numeric_limits<float>::quiet_NaN();
      src[2] = -std::numeric_limits<float>::infinity();
    }
    std::vector<bf16> dst(n);
    convert_f32_to_bf16(src.data(), dst.data(), n);
    std::vector<float> back(n);
    convert_bf16_to_f32(dst.data(), back.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(dst[i].bits, float_to_bf16(src[i]).bits) << i;
      ASSERT_EQ(float_bits(back[i]), static_cast<uint32_t>(dst[i].bits) << 16) << i;
    }
  }
}

TEST(Bf16, RoundToBf16PrecisionIsTheRoundTrip) {
  std::vector<float> v = {1.0f, 1.00390625f, 1.01171875f, -3.14159f, 1e-40f, -0.0f,
                          std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                          3.3895314e38f};
  for (int i = 0; i < 1000; ++i) v.push_back(static_cast<float>(i) * 0.7317f - 300.0f);
  std::vector<float> out(v.size());
  round_to_bf16(v.data(), out.data(), v.size());
  for (size_t i = 0; i < v.size(); ++i)
    EXPECT_EQ(float_bits(out[i]), float_bits(bf16_to_float(float_to_bf16(v[i])))) << v[i];
  round_to_bf16(v.data(), v.data(), v.size());  // in place
  EXPECT_EQ(std::memcmp(v.data(), out.data(), v.size() * 4), 0);
}

// fp16: the integer definition against the CPU's own conversion instruction
// (F16C, which every AVX2 CPU has), which rounds to nearest even in hardware.
__attribute__((target("f16c"))) uint16_t hw_f32_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
__attribute__((target("f16c"))) float hw_f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

TEST(Fp16, MatchesTheCpusConversionInstruction) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C instruction to compare with";
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e6f,
                          6.1035156e-05f /* 2^-14 */, 6.0975552e-05f, 5.9604645e-08f /* 2^-24 */,
                          2.9802322e-08f /* 2^-25: tie to 0 */, 2.9802326e-08f, 8.940697e-08f /* 1.5 ulp: tie */,
                          1e-10f, 1e-40f, std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                          bits_float(0x7f800001u), bits_float(0xffc12345u), bits_float(0x7fbfe000u)};
  Rng rng(11);
  for (int i = 0; i < 200000; ++i) {
    // Magnitudes from 2^-30 to 2^20 with random mantissas, both signs.
    double mag = std::ldexp(1.0 + rng.uniform(), static_cast<int>(rng.uniform() * 50.0) - 30);
    v.push_back(static_cast<float>(i % 2 ? mag : -mag));
  }
  // Every exact tie between two fp16 neighbours in the normal range.
  for (uint32_t h = 0x0400; h < 0x7bff; h += 37) v.push_back((hw_f16_to_f32(h) + hw_f16_to_f32(h + 1)) / 2);
  for (float f : v) {
    ASSERT_EQ(float_to_f16(f).bits, hw_f32_to_f16(f)) << f;
    f16 h = float_to_f16(f);
    ASSERT_EQ(float_bits(f16_to_float(h)), float_bits(hw_f16_to_f32(h.bits))) << h.bits;
  }
  // Every fp16 bit pattern widens exactly (NaNs only need to stay NaN).
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float w = f16_to_float(f16{static_cast<uint16_t>(b)});
    if (std::isnan(w)) {
      ASSERT_TRUE(std::isnan(hw_f16_to_f32(static_cast<uint16_t>(b)))) << b;
      continue;
    }
    ASSERT_EQ(float_bits(w), float_bits(hw_f16_to_f32(static_cast<uint16_t>(b)))) << b;
    ASSERT_EQ(float_to_f16(w).bits, b) << b;  // and round-trips
  }
}

TEST(Fp16, OverflowIsInfinityAndNanStaysNan) {
  EXPECT_EQ(float_to_f16(65504.0f).bits, 0x7bffu);
  EXPECT_EQ(float_to_f16(65519.0f).bits, 0x7bffu);
  EXPECT_EQ(float_to_f16(65520.0f).bits, 0x7c00u);  // the tie rounds to even: Inf
  EXPECT_EQ(float_to_f16(-1e30f).bits, 0xfc00u);
  f16 n = float_to_f16(-std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(f16_to_float(n)));
  EXPECT_EQ(n.bits & 0x8000u, 0x8000u);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(bits_float(0x7f800001u)))));
  // Below half the smallest subnormal: zero, sign kept.
  EXPECT_EQ(float_to_f16(-1e-9f).bits, 0x8000u);
}

TEST(Fp16, BulkConversionsMatchScalarAtEveryIsaLevel) {
  Rng rng(3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{17}, size_t{100003}}) {
    std::vector<float> src(n);
    for (float& x : src) x = static_cast<float>(rng.normal() * std::ldexp(1.0, static_cast<int>(n % 40) - 20));
    if (n > 4) {
      src[1] = std::numeric_limits<float>::quiet_NaN();
      src[2] = 1e9f;
      src[3] = 3e-6f;
    }
    for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (isa > cpu_isa()) continue;
      detail::set_dispatch_isa_for_testing(isa);
      std::vector<f16> dst(n);
      std::vector<float> back(n), rounded(n);
      convert_f32_to_f16(src.data(), dst.data(), n);
      convert_f16_to_f32(dst.data(), back.data(), n);
      round_to_f16(src.data(), rounded.data(), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_EQ(dst[i].bits, float_to_f16(src[i]).bits) << i;
        ASSERT_EQ(float_bits(back[i]), float_bits(f16_to_float(dst[i]))) << i;
        ASSERT_EQ(float_bits(rounded[i]), float_bits(back[i])) << i;
      }
    }
    detail::reset_dispatch_isa_for_testing();
  }
}

// ONEDNN_MAX_CPU_ISA caps zinc's kernels as it caps oneDNN (core/cpu.h).
class CpuCapEnv : public testing::Test {
 protected:
  void SetUp() override {
    const char* v = std::getenv("ONEDNN_MAX_CPU_ISA");
    had_ = v != nullptr;
    if (had_) saved_ = v;
  }
  void TearDown() override {
    if (had_)
      setenv("ONEDNN_MAX_CPU_ISA", saved_.c_str(), 1);
    else
      unsetenv("ONEDNN_MAX_CPU_ISA");
  }
  bool had_ = false;
  std::string saved_;
};

TEST_F(CpuCapEnv, OneDnnNamesInAnyCaseMapToZincLevels) {
  const std::pair<const char*, CpuIsa> cases[] = {
      {"SSE41", CpuIsa::kBaseline},          {"avx", CpuIsa::kBaseline},
      {"AVX2", CpuIsa::kAvx2},               {"avx2_vnni", CpuIsa::kAvx2},
      {"AVX512_CORE", CpuIsa::kAvx512},      {"avx512_core_vnni", CpuIsa::kAvx512},
      {"AVX512_CORE_BF16", CpuIsa::kAvx512Bf16}, {"AVX512_CORE_AMX", CpuIsa::kAvx512Bf16},
      {"ALL", CpuIsa::kAvx512Bf16}};
  for (const auto& [name, level] : cases) {
    setenv("ONEDNN_MAX_CPU_ISA", name, 1);
    EXPECT_EQ(cpu_isa_cap(), level) << name;
    EXPECT_EQ(cpu_isa(), std::min(level, cpu_isa_detected())) << name;
  }
  unsetenv("ONEDNN_MAX_CPU_ISA");
  EXPECT_EQ(cpu_isa(), cpu_isa_detected());
  EXPECT_EQ(cpu_isa_missing(CpuIsa::kBaseline), "");
  EXPECT_EQ(cpu_isa_missing(cpu_isa_detected()), "");
}

TEST_F(CpuCapEnv, CapBelowTheCpuIsNamedAsTheReason) {
  setenv("ONEDNN_MAX_CPU_ISA", "SSE41", 1);
  if (cpu_isa_detected() < CpuIsa::kAvx2) GTEST_SKIP() << "the CPU lacks avx2: " << cpu_isa_missing(CpuIsa::kAvx2);
  EXPECT_EQ(cpu_isa(), CpuIsa::kBaseline);
  EXPECT_EQ(cpu_isa_missing(CpuIsa::kAvx2), "capped by ONEDNN_MAX_CPU_ISA=SSE41");
  EXPECT_NE(cpu_isa_summary().find("capped by ONEDNN_MAX_CPU_ISA=SSE41"), std::string::npos);
}

TEST_F(CpuCapEnv, UnknownValueIsAnErrorNamingTheVariable) {
  setenv("ONEDNN_MAX_CPU_ISA", "avx3", 1);
  try {
    cpu_isa();
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ONEDNN_MAX_CPU_ISA=avx3: unknown ISA"), std::string::npos) << e.what();
  }
}

// A switch's misspelt value was read as unset without a word
// (ZINC_GPU_UPDATE_BEHIND=false left the update behind on).
TEST(EnvChoice, AMisspeltValueIsWarnedAboutAndReadAsUnset) {
  const char* var = "ZINC_TEST_ENV_CHOICE";
  ::unsetenv(var);
  EXPECT_EQ(env_choice(var, {"0", "1"}), "");
  ::setenv(var, "1", 1);
  EXPECT_EQ(env_choice(var, {"0", "1"}), "1");
  ::setenv(var, "false", 1);
  LogCapture cap(LogLevel::kWarn);
  EXPECT_EQ(env_choice(var, {"0", "1"}), "");
  const std::vector<std::string> m = cap.messages();
  ASSERT_EQ(m.size(), 1u);
  EXPECT_NE(m[0].find("ZINC_TEST_ENV_CHOICE=\"false\" is none of the values it takes (0, 1): ignored"),
            std::string::npos)
      << m[0];
  ::unsetenv(var);
}

TEST(CpuIsa, MissingInstructionsAreNamed) {
  // Every level the CPU lacks names at least one instruction set it lacks.
  for (CpuIsa i : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (i <= cpu_isa_detected()) continue;
    EXPECT_EQ(cpu_isa_missing(i).rfind("the CPU lacks ", 0), 0u) << cpu_isa_missing(i);
  }
  EXPECT_NE(cpu_model_and_flags().find(" | "), std::string::npos);
}

// The header's CUDA line: on a machine with no NVIDIA driver or device it
// says plainly "no GPU found" (not the runtime's "driver version is
// insufficient"); with a driver but no usable GPU it gives the runtime's
// reason.
TEST(CudaStatus, SaysNoGpuFoundPlainlyWithoutADriver) {
  const CudaStatus& st = cuda_status();
  const std::string line = st.summary();
  if (!st.built) {
    // scripts/setup.sh's first partial build on a machine without a GPU
    // leaves CUDA out and says so (ZINC_CUDA_DEFERRED).
    EXPECT_TRUE(line.rfind("CUDA: not built", 0) == 0 || line.rfind("CUDA: no GPU found (this first build", 0) == 0)
        << line;
    if (!nvidia_driver_present()) {
      EXPECT_NE(line.find("no GPU found"), std::string::npos) << line;
    }
  } else if (st.devices > 0) {
    EXPECT_EQ(line, "CUDA: " + std::to_string(st.devices) + " GPU(s)");
  } else if (!nvidia_driver_present()) {
    EXPECT_TRUE(st.none_here);
    EXPECT_EQ(line, "CUDA: built, no GPU found");
    EXPECT_EQ(line.find("insufficient"), std::string::npos) << line;
  } else {
    EXPECT_FALSE(st.none_here);
    EXPECT_EQ(line, "CUDA: built, no usable GPU (" + st.why + ")");
  }
}

TEST(AlignedBuffer, IsAlignedZeroedAndMovable) {
  AlignedBuffer a(1000, kPageAlign);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kPageAlign, 0u);
  for (uint8_t byte : a.span<uint8_t>()) ASSERT_EQ(byte, 0);
  void* p = a.data();
  AlignedBuffer b = std::move(a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.bytes(), 1000u);
  AlignedBuffer c = make_buffer<float>(33);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c.data()) % kSimdAlign, 0u);
  EXPECT_EQ(c.span<float>().size(), 33u);
}

TEST(ParallelFor, CoversEveryIndexOnceForAnyThreadCount) {
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{5}, size_t{1000}}) {
      std::vector<int> hits(n, 0);
      parallel_for(n, 1, [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) hits[i] += 1;
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1);
    }
  }
  omp_set_num_threads(2);
}

TEST(Rng, SameSeedSameStreamDifferentSeedDifferent) {
  Rng a(1), b(1), c(2);
  for (int i = 0; i < 100; ++i) {
    uint64_t x = a.next_u64();
    ASSERT_EQ(x, b.next_u64());
    ASSERT_NE(x, c.next_u64());
  }
  EXPECT_NE(mix_seed(1, 0), mix_seed(1, 1));
}

TEST(Rng, NormalHasUnitMomentsAndBelowIsInRange) {
  Rng r(3);
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = r.normal();
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
  for (int i = 0; i < 1000; ++i) ASSERT_LT(r.below(7), 7u);
}

TEST(Errors, PosixErrorNamesContextAndErrno) {
  IoError e = posix_error("open /nope", 2);
  EXPECT_NE(std::string(e.what()).find("open /nope"), std::string::npos);
  EXPECT_NE(std::string(e.what()).find("errno 2"), std::string::npos);
  ConfigError c("a.b", "must be >= 2, got 1");
  EXPECT_EQ(std::string(c.what()), "a.b: must be >= 2, got 1");
  EXPECT_EQ(c.path(), "a.b");
}

}  // namespace
}  // namespace zinc

// ---- DynLib (core/dynlib.h) ----------------------------------------------------
#include "core/dynlib.h"

TEST(DynLib, OpensTheFirstCandidateThatLoadsAndFindsSymbols) {
  zinc::DynLib lib = zinc::DynLib::open({"libzinc-no-such-library.so.9", "libc.so.6"}, "libc");
  EXPECT_EQ(lib.name(), "libc.so.6");
  auto atoi_fn = lib.get<int (*)(const char*)>("atoi");
  EXPECT_EQ(atoi_fn("42"), 42);
  try {
    lib.get<void (*)()>("zinc_no_such_symbol");
    FAIL() << "expected an error";
  } catch (const zinc::Error& e) {
    EXPECT_NE(std::string(e.what()).find("zinc_no_such_symbol"), std::string::npos) << e.what();
  }
}

TEST(DynLib, NamesEveryCandidateWhenNoneLoads) {
  try {
    zinc::DynLib::open({"libzinc-a.so.1", "/nowhere/libzinc-b.so.2"}, "the thing");
    FAIL() << "expected an error";
  } catch (const zinc::Error& e) {
    const std::string m = e.what();
    for (const char* part : {"the thing", "libzinc-a.so.1", "/nowhere/libzinc-b.so.2", "LD_LIBRARY_PATH"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " in " << m;
  }
}
