// The single-rank backend: a world of one whose collectives copy, with the
// same argument errors as the MPI backend. Runs on every rank (no MPI use).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm_test_util.h"
#include "core/error.h"

namespace zinc::comm::testing {
namespace {

TEST(SingleCommunicator, IsAWorldOfOne) {
  auto c = make_single_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->local_size(), 1);
  EXPECT_EQ(c->backend(), "single");
}

TEST(SingleCommunicator, CollectivesCopyBitsUnchanged) {
  auto c = make_single_communicator();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t n = 1001;
    const size_t bytes = n * dtype_bytes(dt);
    std::vector<char> src(bytes);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<char>(i * 37 + 11);  // includes NaN patterns
    std::vector<char> out(bytes, 0);
    c->all_reduce(src.data(), out.data(), n, dt);
    EXPECT_EQ(std::memcmp(out.data(), src.data(), bytes), 0) << "all_reduce " << dtype_name(dt);
    std::fill(out.begin(), out.end(), 0);
    c->reduce_scatter(src.data(), out.data(), n, dt);
    EXPECT_EQ(std::memcmp(out.data(), src.data(), bytes), 0) << "reduce_scatter " << dtype_name(dt);
    std::fill(out.begin(), out.end(), 0);
    c->all_gather(src.data(), out.data(), n, dt);
    EXPECT_EQ(std::memcmp(out.data(), src.data(), bytes), 0) << "all_gather " << dtype_name(dt);
    std::fill(out.begin(), out.end(), 0);
    c->all_to_all(src.data(), out.data(), n, dt);
    EXPECT_EQ(std::memcmp(out.data(), src.data(), bytes), 0) << "all_to_all " << dtype_name(dt);
    std::vector<char> in_place = src;
    c->all_reduce(in_place.data(), in_place.data(), n, dt);
    c->all_gather(in_place.data(), in_place.data(), n, dt);
    c->broadcast(in_place.data(), n, dt, 0);
    EXPECT_EQ(in_place, src) << "in place " << dtype_name(dt);
  }
  std::vector<double> d = {1.5, -2.0, 3.25};
  c->all_reduce_f64(d.data(), 3);
  c->all_reduce_max_f64(d.data(), 3);
  c->barrier();
  EXPECT_EQ(d, (std::vector<double>{1.5, -2.0, 3.25}));
}

TEST(SingleCommunicator, RejectsTheSameArgumentsAsMpi) {
  auto c = make_single_communicator();
  std::vector<float> buf(16);
  EXPECT_EQ(message_of([&] { c->broadcast(buf.data(), 4, DType::kF32, 1); }),
            "rank 0: broadcast: root 1 is not a rank of this world of 1");
  EXPECT_EQ(message_of([&] { c->reduce_scatter(buf.data(), buf.data(), 4, DType::kF32); }).rfind(
                "rank 0: reduce_scatter: recv overlaps send", 0),
            0u);
  EXPECT_EQ(message_of([&] { c->all_gather(buf.data() + 1, buf.data(), 4, DType::kF32); }).rfind(
                "rank 0: all_gather: send overlaps recv", 0),
            0u);
  EXPECT_EQ(message_of([&] { c->all_reduce(buf.data(), buf.data(), -5, DType::kBF16); }),
            "rank 0: all_reduce: count must be >= 0, got -5");
}

TEST(SingleCommunicator, DuplicateDrivesAnIndependentStream) {
  auto c = make_single_communicator();
  expect_duplicate_streams_independent(*c);
}

TEST(SingleCommunicator, DrivesACommStream) {
  auto c = make_single_communicator();
  CommStream stream(*c);
  std::vector<float> full = {1, 2, 3, 4}, part(4);
  CommHandle h = stream.submit([&](Communicator& cc) { cc.reduce_scatter(full.data(), part.data(), 4, DType::kF32); });
  h.wait();
  EXPECT_EQ(part, full);
}

}  // namespace
}  // namespace zinc::comm::testing
