// Helpers of the GPU tests: skip without a device, move vectors to and from it.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "kernels/kernels.h"

namespace zinc::cuda::testing {

// Skips without a GPU; fails instead where ZINC_EXPECT_GPU=1 says one must
// be there (gpu-bundle/run.sh sets it: a driver too old for the CUDA
// runtime must not pass as "no GPU").
#if defined(ZINC_CUDA_EMU)
// Kernel emulation (tests/cuda_emu) runs these tests with the kernels on the CPU.
#define ZINC_REQUIRE_GPU() \
  do {                     \
  } while (0)
#else
#define ZINC_REQUIRE_GPU()                                                                   \
  do {                                                                                       \
    if (::zinc::cuda_status().devices == 0) {                                                \
      const char* zinc_expect_ = std::getenv("ZINC_EXPECT_GPU");                             \
      if (zinc_expect_ && std::string(zinc_expect_) == "1")                                  \
        FAIL() << "ZINC_EXPECT_GPU=1 but no GPU: " << ::zinc::cuda_status().why;              \
      GTEST_SKIP() << "no GPU on this machine: " << ::zinc::cuda_status().why;               \
    }                                                                                        \
  } while (0)
#endif

// Packed-document positions (Batch::positions, Note [document boundaries]
// in csrc/kernels/attention.cpp) for B rows of T tokens: each row is cut
// into documents of lengths taken in turn from a list that mixes length 1,
// short ones and ones longer than a row's 16 lanes, from another start in
// each row (so the rows' boundaries differ and the last is cut by T).
inline std::vector<int32_t> packed_positions(int64_t B, int64_t T) {
  static const int64_t kLengths[] = {1, 1, 4, 2, 1, 19, 3, 33, 5, 1, 17};
  const int64_t n = static_cast<int64_t>(sizeof(kLengths) / sizeof(kLengths[0]));
  std::vector<int32_t> pos;
  for (int64_t b = 0; b < B; ++b) {
    int64_t k = (3 * b) % n, left = kLengths[k], p = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (left == 0) {
        k = (k + 1) % n;
        left = kLengths[k];
        p = 0;
      }
      pos.push_back(static_cast<int32_t>(p++));
      --left;
    }
  }
  return pos;
}

template <class T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer d(v.size() * sizeof(T));
  if (!v.empty()) copy_to_device(d.data(), v.data(), v.size() * sizeof(T));
  return d;
}

template <class T>
std::vector<T> download(const DeviceBuffer& d, size_t n) {
  ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "test: cudaDeviceSynchronize");
  std::vector<T> v(n);
  if (n) copy_to_host(v.data(), d.data(), n * sizeof(T));
  return v;
}

// n normal values times `scale`, from `seed`.
inline std::vector<float> randn(int64_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(rng.normal() * scale);
  return v;
}

// A parameter vector stored in `t`: the host bytes, a device copy, and the
// CView of each.
struct Param {
  std::vector<uint16_t> h16;
  std::vector<float> h32;
  DeviceBuffer d;
  DType t;
  Param(const std::vector<float>& v, DType dt) : t(dt) {
    if (t == DType::kF32) {
      h32 = v;
      d = upload(h32);
    } else {
      for (float x : v) h16.push_back(float_to_16(x, t));
      d = upload(h16);
    }
  }
  kernels::CView host() const {
    return {t == DType::kF32 ? static_cast<const void*>(h32.data()) : h16.data(), t};
  }
  kernels::CView dev() const { return {d.data(), t}; }
};

// Note [fused 16-bit operands] (kernels_cuda.h): what a fused kernel must
// write, v rounded by the CPU's conversion, and a device buffer of n 16-bit
// values that no rounding gives (so an element left unwritten shows).
inline std::vector<uint16_t> rounded16(const std::vector<float>& v, DType t) {
  std::vector<uint16_t> r(v.size());
  ::zinc::convert_f32_to_16(v.data(), r.data(), v.size(), t);
  return r;
}
inline DeviceBuffer filled16(int64_t n) {
  return upload(std::vector<uint16_t>(static_cast<size_t>(n), uint16_t{0xFFFF}));  // a NaN pattern
}

}  // namespace zinc::cuda::testing
