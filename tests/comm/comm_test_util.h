// Shared by the comm tests: the MPI world every rank runs the tests in, and
// dtype-generic buffers. Expected values are computed from (seed, rank,
// world size) without communicating, so each rank checks itself.
//
// Every rank runs the same tests in the same order and issues the same
// collectives, so a test issues all of its collectives before any ASSERT
// that could end it early on one rank only (EXPECT inside loops).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"

namespace zinc::comm::testing {

// The MPI communicator created by main() for the whole run.
Communicator& world();

// Values as float, stored as bytes of `dtype` (bf16 / fp16 rounded to nearest even).
inline std::vector<char> encode(const std::vector<float>& v, DType dtype) {
  std::vector<char> out(v.size() * dtype_bytes(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = float_to_16(v[i], dtype);
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
      uint16_t h;
      std::memcpy(&h, static_cast<const char*>(p) + 2 * i, 2);
      out[i] = from_16(h, dtype);
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

// Two streams, over `c` and over c.duplicate(), do not wait for each other:
// (1) work on the first stream that cannot finish until a gather on the
// second stream has run on this rank does finish (over one stream, or over
// communicators that share their state, it would wait forever: the wait is
// bounded and then throws); (2) many collectives submitted alternately to
// both streams, running at the same time, all give the right sums.
// Collective: every rank calls it.
inline void expect_duplicate_streams_independent(Communicator& c) {
  std::unique_ptr<Communicator> dup = c.duplicate();
  ASSERT_NE(dup, nullptr) << c.backend() << ": duplicate() returned null (MPI without MPI_THREAD_MULTIPLE?)";
  EXPECT_EQ(dup->size(), c.size());
  EXPECT_EQ(dup->rank(), c.rank());
  EXPECT_EQ(dup->backend(), c.backend());
  const int R = c.size(), me = c.rank();
  const int64_t n = 777;
  {
    CommStream reduce(c), gather(*dup);
    std::promise<void> gathered;
    std::shared_future<void> gathered_f = gathered.get_future().share();
    std::vector<float> sum(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) sum[static_cast<size_t>(i)] = small_int(me, i);
    CommHandle blocked = reduce.submit([&, gathered_f](Communicator& cc) {
      if (gathered_f.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
        throw std::runtime_error("the gather on the other stream did not run while this stream was busy");
      cc.all_reduce(sum.data(), sum.data(), n, DType::kF32);
    });
    std::vector<float> parts(static_cast<size_t>(n * R));
    for (int64_t i = 0; i < n; ++i) parts[static_cast<size_t>(me * n + i)] = static_cast<float>(me * 1000 + i);
    gather.submit([&](Communicator& cc) { cc.all_gather(parts.data() + me * n, parts.data(), n, DType::kF32); })
        .wait();
    gathered.set_value();
    blocked.wait();
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(parts[static_cast<size_t>(r * n + i)], static_cast<float>(r * 1000 + i)) << "rank " << r;
    for (int64_t i = 0; i < n; ++i) {
      float want = 0;
      for (int r = 0; r < R; ++r) want += small_int(r, i);
      EXPECT_EQ(sum[static_cast<size_t>(i)], want) << i;
    }
  }
  {
    constexpr int kRounds = 40;
    CommStream a(c), b(*dup);
    std::vector<std::vector<float>> sums(kRounds), gathers(kRounds);
    for (int k = 0; k < kRounds; ++k) {
      sums[k].resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) sums[k][static_cast<size_t>(i)] = small_int(me + k, i);
      gathers[k].resize(static_cast<size_t>(n * R));
      for (int64_t i = 0; i < n; ++i) gathers[k][static_cast<size_t>(me * n + i)] = static_cast<float>(k * 7 + me);
      a.submit([&sums, k, n](Communicator& cc) {
        cc.all_reduce(sums[k].data(), sums[k].data(), n, DType::kF32);
      });
      b.submit([&gathers, k, n, me](Communicator& cc) {
        cc.all_gather(gathers[k].data() + me * n, gathers[k].data(), n, DType::kF32);
      });
    }
    a.synchronize();
    b.synchronize();
    for (int k = 0; k < kRounds; ++k) {
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int r = 0; r < R; ++r) want += small_int(r + k, i);
        EXPECT_EQ(sums[k][static_cast<size_t>(i)], want) << "round " << k << " element " << i;
      }
      for (int r = 0; r < R; ++r)
        EXPECT_EQ(gathers[k][static_cast<size_t>(r * n)], static_cast<float>(k * 7 + r)) << "round " << k;
    }
  }
}

}  // namespace zinc::comm::testing
