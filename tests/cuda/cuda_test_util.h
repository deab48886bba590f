// Helpers of the GPU tests: skip without a device, move vectors to and from it.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/device.h"

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

}  // namespace zinc::cuda::testing
