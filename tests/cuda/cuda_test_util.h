// Helpers of the GPU tests: skip without a device, move vectors to and from it.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "core/cuda_util.h"
#include "core/device.h"

namespace zinc::cuda::testing {

#define ZINC_REQUIRE_GPU()                                                                   \
  do {                                                                                       \
    if (::zinc::cuda_status().devices == 0)                                                  \
      GTEST_SKIP() << "no GPU on this machine: " << ::zinc::cuda_status().why;               \
  } while (0)

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
