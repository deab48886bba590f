// Shared by the comm tests: the MPI world every rank runs the tests in, and
// dtype-generic buffers. Expected values are computed from (seed, rank,
// world size) without communicating, so each rank checks itself.
//
// Every rank runs the same tests in the same order and issues the same
// collectives, so a test issues all of its collectives before any ASSERT
// that could end it early on one rank only (EXPECT inside loops).
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"

namespace zinc::comm::testing {

// The MPI communicator created by main() for the whole run.
Communicator& world();

// Values as float, stored as bytes of `dtype` (bf16 rounded to nearest even).
inline std::vector<char> encode(const std::vector<float>& v, DType dtype) {
  std::vector<char> out(v.size() * dtype_bytes(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const bf16 h = float_to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

inline std::vector<float> decode(const void* p, size_t n, DType dtype) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(&out[i], static_cast<const char*>(p) + 4 * i, 4);
    } else {
      bf16 h;
      std::memcpy(&h, static_cast<const char*>(p) + 2 * i, 2);
      out[i] = bf16_to_float(h);
    }
  }
  return out;
}

// what() of the CommError fn throws, or a marker when it throws none.
inline std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const CommError& e) {
    return e.what();
  }
  return "(no CommError thrown)";
}

// Small integers in [-8, 8]: sums over up to 16 ranks are exact in fp32 and bf16.
inline float small_int(int rank, int64_t i) { return static_cast<float>((rank * 7 + i * 13) % 17 - 8); }

}  // namespace zinc::comm::testing
