// The 1-bit compressed all-reduce on one process (comm/onebit.h): sign
// packing and unpacking against their definition at every ISA level this
// CPU runs, DeepSpeed's padding, CompressedAllReduce over a world of one
// against the reference of onebit_reference.h, and the wire volume.
// Multi-rank: onebit_mpi_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "comm/onebit.h"
#include "core/cpu.h"
#include "core/error.h"
#include "tests/comm/onebit_reference.h"

namespace zinc::comm::testing {
namespace {

std::vector<CpuIsa> levels_here() {
  std::vector<CpuIsa> v;
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (isa <= cpu_isa()) v.push_back(isa);
  return v;
}

std::vector<float> signed_values(int64_t n, int seed) {
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = onebit_input(0, seed, 0, i);
  // The special values DeepSpeed's sign().add_(1).bool() maps: +0, -0, NaN -> +1; -inf -> -1.
  if (n > 3) {
    x[0] = 0.0f;
    x[1] = -0.0f;
    x[2] = std::numeric_limits<float>::quiet_NaN();
    x[3] = -std::numeric_limits<float>::infinity();
  }
  return x;
}

TEST(OnebitPack, EveryIsaLevelEqualsTheDefinitionOnOddSizes) {
  std::printf("ISA levels tested here (CPU: %s):", std::string(cpu_isa_name(cpu_isa())).c_str());
  for (CpuIsa isa : levels_here()) std::printf(" %s", std::string(cpu_isa_name(isa)).c_str());
  std::printf("\n");
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{33},
                    int64_t{1001}, int64_t{4099}}) {
    const std::vector<float> x = signed_values(n, static_cast<int>(n));
    const std::vector<uint8_t> want = reference_pack(x);
    for (CpuIsa isa : levels_here()) {
      std::vector<uint8_t> bits(want.size(), 0xA5);
      pack_signs_at(isa, x.data(), n, bits.data());
      EXPECT_EQ(bits, want) << cpu_isa_name(isa) << " n=" << n;
      // Unpack: +-scale, and accumulate adds to what is there.
      std::vector<float> out(n, 1.25f), acc(n, 1.25f);
      unpack_signs_scaled_at(isa, bits.data(), n, 0.375f, out.data(), false);
      unpack_signs_scaled_at(isa, bits.data(), n, 0.375f, acc.data(), true);
      for (int64_t i = 0; i < n; ++i) {
        const float s = x[i] < 0.0f ? -0.375f : 0.375f;
        EXPECT_EQ(out[i], s) << cpu_isa_name(isa) << " n=" << n << " i=" << i;
        EXPECT_EQ(acc[i], 1.25f + s) << cpu_isa_name(isa) << " n=" << n << " i=" << i;
      }
    }
  }
  // The special values, spelled out: +0, -0, NaN pack as 1, -inf as 0; bits 7..4 of byte 0.
  const std::vector<float> x = signed_values(8, 3);
  std::vector<uint8_t> bits(1);
  pack_signs(x.data(), 8, bits.data());
  EXPECT_EQ(bits[0] >> 4, 0b1110);
}

TEST(OnebitPack, PaddingIsDeepSpeedsMultipleOfPTimesLcmP8) {
  EXPECT_EQ(onebit_padded_size(0, 2), 0);
  EXPECT_EQ(onebit_padded_size(1, 1), 8);
  EXPECT_EQ(onebit_padded_size(1, 2), 16);
  EXPECT_EQ(onebit_padded_size(17, 2), 32);
  EXPECT_EQ(onebit_padded_size(1, 3), 72);   // lcm(3, 8) = 24, times 3
  EXPECT_EQ(onebit_padded_size(33, 4), 64);  // lcm(4, 8) = 8, times 4 = 32
  EXPECT_EQ(onebit_padded_size(1, 16), 256);
  for (int p : {1, 2, 3, 4, 5, 6, 8, 12}) {
    for (int64_t n : {int64_t{1}, int64_t{999}, int64_t{1} << 20}) {
      OnebitReference ref(n, p);
      EXPECT_EQ(onebit_padded_size(n, p), ref.padded) << "n=" << n << " p=" << p;
    }
  }
}

// A world of one: the worker and server phases still compress, with error feedback.
TEST(OnebitAllReduce, WorldOfOneEqualsTheReferenceBitForBitOverSteps) {
  auto single = make_single_communicator();
  for (int kind : {0, 1, 2}) {
    for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{1001}}) {
      for (CpuIsa isa : levels_here()) {
        detail::set_dispatch_isa_for_testing(isa);
        CompressedAllReduce car(n, 1);
        OnebitReference ref(n, 1);
        for (int step = 0; step < 5; ++step) {
          std::vector<float> buf(n);
          for (int64_t i = 0; i < n; ++i) buf[i] = onebit_input(kind, step, 0, i);
          const std::vector<float> want = ref.step({buf});
          car.average(*single, buf.data(), n);
          EXPECT_EQ(std::memcmp(buf.data(), want.data(), n * sizeof(float)), 0)
              << "kind " << kind << " n=" << n << " step " << step << " " << cpu_isa_name(isa);
          EXPECT_EQ(car.worker_error(), ref.worker_error[0]);
          EXPECT_EQ(car.server_error(), ref.server_error[0]);
          for (float v : buf) EXPECT_TRUE(std::isfinite(v));
        }
      }
      detail::reset_dispatch_isa_for_testing();
    }
  }
}

TEST(OnebitAllReduce, WrongSizeThrowsNamingBoth) {
  auto single = make_single_communicator();
  CompressedAllReduce car(10, 1);
  std::vector<float> buf(11);
  try {
    car.average(*single, buf.data(), 11);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("made for 10 elements over 1 ranks, called with 11"), std::string::npos)
        << e.what();
  }
}

// Bytes each rank sends per average(): two phases of p - 1 messages, each a
// scale and chunk / 8 bytes of signs (rounded to words), against an fp32
// ring all-reduce (2 (p - 1) / p * 4n bytes per rank).
TEST(OnebitAllReduce, WireVolumeIsAbout32TimesBelowFp32) {
  for (int p : {2, 4, 8}) {
    for (int64_t n : {int64_t{1} << 20, int64_t{1000003}}) {
      CompressedAllReduce car(n, p);
      const int64_t chunk = car.padded_size() / p;
      EXPECT_EQ(car.message_words(), 1 + (chunk / 8 + 3) / 4);
      const int64_t compressed = car.wire_bytes_per_rank();
      EXPECT_EQ(compressed, 2 * (p - 1) * car.message_words() * 4);
      const double fp32_ring = 2.0 * (p - 1) / p * 4.0 * double(n);
      std::printf("n=%lld p=%d: 1-bit %lld bytes sent per rank per step, fp32 ring all-reduce %.0f (%.1fx)\n",
                  static_cast<long long>(n), p, static_cast<long long>(compressed), fp32_ring,
                  fp32_ring / double(compressed));
      EXPECT_GT(fp32_ring / double(compressed), 31.0);
    }
  }
}

}  // namespace
}  // namespace zinc::comm::testing
