// Multi-rank tests of the MPI communicator, and main() for the comm test
// binary (run by CTest under mpirun at -np 1, 2 and 4; see comm_test_util.h
// for the rules every test follows).
//
// comm_test --abort=single | --abort=mpi is not a test run: it makes a
// communicator call abort(7, "boom ...") (under MPI: the last rank, while the
// others wait in a barrier) for abort_test.sh to check the exit code and the
// message.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "comm_test_util.h"
#include "core/device.h"
#include "core/error.h"
#include "tests/comm/mpi_test_main.h"

namespace zinc::comm::testing {
namespace {

std::unique_ptr<Communicator> g_world;

}  // namespace

Communicator& world() { return *g_world; }

namespace {

// ---------------------------------------------------------------------------
// The world itself

TEST(MpiWorld, RankSizeAndBackendAreConsistent) {
  Communicator& c = world();
  double v[3] = {1.0, static_cast<double>(c.rank()), static_cast<double>(c.local_size())};
  c.all_reduce_f64(v, 3);
  double m[2] = {static_cast<double>(c.rank()), static_cast<double>(c.local_size())};
  c.all_reduce_max_f64(m, 2);
  EXPECT_EQ(c.backend(), "mpi");
  EXPECT_GE(c.rank(), 0);
  EXPECT_LT(c.rank(), c.size());
  EXPECT_EQ(v[0], c.size());
  EXPECT_EQ(v[1], c.size() * (c.size() - 1) / 2.0);  // ranks are 0..size-1, each once
  EXPECT_EQ(m[0], c.size() - 1);
  EXPECT_GE(c.local_size(), 1);
  EXPECT_LE(m[1], c.size());
  EXPECT_EQ(launched_with_mpi(), c.size() > 1);
}

// In every build (nccl_test, built only with NCCL, covers the backend
// itself): where NCCL cannot start, make_nccl_communicator refuses with one
// line naming the rank and the reason, on every rank, and leaves nobody waiting.
TEST(MpiWorld, NcclBackendRefusesWhereItCannotStart) {
  const CudaStatus& cuda = cuda_status();
  if (cuda.built && cuda.devices >= world().local_size()) {
    GTEST_SKIP() << "a GPU for every rank on this machine: nccl_test covers the NCCL backend";
  }
  const std::string got = message_of([] { make_nccl_communicator(world()); });
  world().barrier();
  const std::string prefix = "[rank " + std::to_string(world().rank()) + "] nccl backend: ";
  EXPECT_EQ(got.rfind(prefix, 0), 0u) << got;
  EXPECT_EQ(got.find('\n'), std::string::npos) << got;
  if (!cuda.built) {
    EXPECT_NE(got.find("built without CUDA"), std::string::npos) << got;
  }
}

// split(): groups of the ranks with the same color, ranked by key; their
// collectives sum within the group only. Here: odd and even ranks, each
// group ranked in reverse.
// Note [MPI collectives: the time limit]: a limit past what the watchdog's
// int64 of nanoseconds holds (a config's 1e12 seconds, ZINC_COMM_TIMEOUT=inf,
// meant as "never") is no limit. It wrapped to a negative one, and the
// watchdog ended the job at the first call ("has waited 0.0 s ... past
// comm.timeout_seconds (-9.22337e+09 s").
TEST(MpiWorld, ALimitBeyondWhatNanosecondsHoldIsNoLimit) {
  for (const char* env : {"", "inf"}) {
    if (*env) setenv("ZINC_COMM_TIMEOUT", env, 1);
    std::unique_ptr<Communicator> c = make_communicator("mpi", 1e12);
    unsetenv("ZINC_COMM_TIMEOUT");
    EXPECT_GE(c->timeout_seconds(), 9e9) << env;
    for (int i = 0; i < 4; ++i) {  // past the watchdog's quarter-second look
      double v = 1.0;
      c->all_reduce_f64(&v, 1);
      EXPECT_EQ(v, c->size());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      c->barrier();
    }
  }
  world().barrier();
}

TEST(MpiWorld, SplitMakesGroupsWhoseCollectivesStayInside) {
  Communicator& c = world();
  std::unique_ptr<Communicator> g = c.split(c.rank() % 2, -c.rank());
  const int members = (c.size() - c.rank() % 2 + 1) / 2;
  ASSERT_EQ(g->size(), members);
  EXPECT_EQ(g->rank(), members - 1 - c.rank() / 2);
  double v = c.rank();
  g->all_reduce_f64(&v, 1);
  double want = 0;
  for (int r = c.rank() % 2; r < c.size(); r += 2) want += r;
  EXPECT_EQ(v, want);
  EXPECT_THROW(c.split(-1, 0), CommError);
}

// Point to point: a ring where every rank sends to the next and receives
// from the previous in one exchange (each send meets the other rank's
// receive, so nothing waits), then plain send and recv between pairs, in
// order, of more than one message.
TEST(MpiWorld, ExchangeAndSendRecvDeliverInOrder) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  if (n == 1) {
    float x = 1;
    EXPECT_THROW(c.send(&x, 1, DType::kF32, 0), CommError);  // not another rank
    return;
  }
  std::vector<float> out(1000), in(1000, -1.0f);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(r * 10000 + static_cast<int>(i));
  c.exchange(out.data(), 1000, (r + 1) % n, in.data(), 1000, (r + n - 1) % n, DType::kF32);
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(in[i], static_cast<float>(((r + n - 1) % n) * 10000 + static_cast<int>(i)));
  if (r < n / 2 * 2) {
    const int peer = r ^ 1;
    std::vector<uint16_t> a(3, static_cast<uint16_t>(r)), b(3);
    for (int k = 0; k < 3; ++k) {
      a[0] = static_cast<uint16_t>(r * 10 + k);
      if (r % 2 == 0) {
        c.send(a.data(), 3, DType::kBF16, peer);
        c.recv(b.data(), 3, DType::kBF16, peer);
      } else {
        c.recv(b.data(), 3, DType::kBF16, peer);
        c.send(a.data(), 3, DType::kBF16, peer);
      }
      EXPECT_EQ(b[0], peer * 10 + k);
    }
  }
  EXPECT_THROW(c.send(out.data(), 1, DType::kF32, r), CommError);  // to itself
  EXPECT_THROW(c.recv(in.data(), 1, DType::kF32, n), CommError);   // no such rank
}

TEST(MpiWorld, BarrierHoldsRanksUntilTheLastArrives) {
  Communicator& c = world();
  c.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  c.barrier();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Every rank leaves the barrier after rank 0 arrived, 200 ms after the start.
  EXPECT_GE(waited, 0.1);
}

// ---------------------------------------------------------------------------
// Every collective, fp32 and bf16, odd counts

class MpiCollective : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  int64_t count() const { return std::get<1>(GetParam()); }
};

std::string param_name(const ::testing::TestParamInfo<std::tuple<DType, int64_t>>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" + std::to_string(std::get<1>(info.param));
}

std::vector<float> rank_values(int rank, int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = small_int(rank, i);
  return v;
}

float sum_over_ranks(int size, int64_t i) {
  float s = 0;
  for (int r = 0; r < size; ++r) s += small_int(r, i);
  return s;
}

TEST_P(MpiCollective, AllReduceSumsEveryRank) {
  Communicator& c = world();
  const int64_t n = count();
  const std::vector<char> send = encode(rank_values(c.rank(), n), dtype());
  std::vector<char> recv(send.size(), 0x55);
  c.all_reduce(send.data(), recv.data(), n, dtype());
  const std::vector<float> got = decode(recv.data(), n, dtype());
  const std::vector<float> sent = decode(send.data(), n, dtype());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(got[i], sum_over_ranks(c.size(), i)) << "element " << i;
    EXPECT_EQ(sent[i], small_int(c.rank(), i)) << "send buffer changed at " << i;
  }
}

TEST_P(MpiCollective, AllReduceInPlace) {
  Communicator& c = world();
  const int64_t n = count();
  std::vector<char> buf = encode(rank_values(c.rank(), n), dtype());
  c.all_reduce(buf.data(), buf.data(), n, dtype());
  const std::vector<float> got = decode(buf.data(), n, dtype());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], sum_over_ranks(c.size(), i)) << "element " << i;
}

TEST_P(MpiCollective, ReduceScatterLeavesEachRankItsBlockOfTheSum) {
  Communicator& c = world();
  const int64_t n = count();  // per rank
  const std::vector<char> send = encode(rank_values(c.rank(), n * c.size()), dtype());
  std::vector<char> recv(n * dtype_bytes(dtype()), 0x55);
  c.reduce_scatter(send.data(), recv.data(), n, dtype());
  const std::vector<float> got = decode(recv.data(), n, dtype());
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(got[i], sum_over_ranks(c.size(), c.rank() * n + i)) << "element " << i;
}

TEST_P(MpiCollective, AllGatherConcatenatesBlocksInRankOrder) {
  Communicator& c = world();
  const int64_t n = count();
  const std::vector<char> send = encode(rank_values(c.rank(), n), dtype());
  std::vector<char> recv(n * c.size() * dtype_bytes(dtype()), 0x55);
  c.all_gather(send.data(), recv.data(), n, dtype());
  const std::vector<float> got = decode(recv.data(), n * c.size(), dtype());
  for (int r = 0; r < c.size(); ++r)
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[r * n + i], small_int(r, i)) << "rank " << r << " element " << i;
}

TEST_P(MpiCollective, AllGatherInPlaceFromOwnBlock) {
  Communicator& c = world();
  const int64_t n = count();
  const size_t elem = dtype_bytes(dtype());
  std::vector<char> buf(n * c.size() * elem, 0x55);
  const std::vector<char> mine = encode(rank_values(c.rank(), n), dtype());
  char* own = buf.data() + c.rank() * n * elem;
  std::memcpy(own, mine.data(), mine.size());
  c.all_gather(own, buf.data(), n, dtype());
  const std::vector<float> got = decode(buf.data(), n * c.size(), dtype());
  for (int r = 0; r < c.size(); ++r)
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[r * n + i], small_int(r, i)) << "rank " << r << " element " << i;
}

// Rank r sends block j (elements small_int(r, j * n + i)) to rank j, so rank
// me receives small_int(r, me * n + i) from every r, in rank order.
TEST_P(MpiCollective, AllToAllSendsBlockJToRankJ) {
  Communicator& c = world();
  const int64_t n = count();
  const std::vector<char> send = encode(rank_values(c.rank(), n * c.size()), dtype());
  std::vector<char> recv(send.size(), 0x55);
  c.all_to_all(send.data(), recv.data(), n, dtype());
  const std::vector<float> got = decode(recv.data(), n * c.size(), dtype());
  for (int r = 0; r < c.size(); ++r)
    for (int64_t i = 0; i < n; ++i)
      EXPECT_EQ(got[r * n + i], small_int(r, c.rank() * n + i)) << "from rank " << r << " element " << i;
  std::vector<char> overlap(send.size() * 2);
  EXPECT_NE(message_of([&] { c.all_to_all(overlap.data(), overlap.data() + 1, n, dtype()); }).find("overlap"),
            std::string::npos);
}

TEST_P(MpiCollective, BroadcastFromLastAndFirstRank) {
  Communicator& c = world();
  const int64_t n = count();
  for (int root : {c.size() - 1, 0}) {
    // Only the root holds the values; the others start with garbage.
    std::vector<char> buf = c.rank() == root ? encode(rank_values(root, n), dtype())
                                             : std::vector<char>(n * dtype_bytes(dtype()), 0x55);
    c.broadcast(buf.data(), n, dtype(), root);
    const std::vector<float> got = decode(buf.data(), n, dtype());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], small_int(root, i)) << "root " << root << " element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Counts, MpiCollective,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(int64_t{1}, int64_t{3}, int64_t{1001},
                                                              int64_t{65537})),
                         param_name);

TEST(MpiCollectiveEdge, ZeroCountsTouchNothing) {
  Communicator& c = world();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    c.all_reduce(nullptr, nullptr, 0, dt);
    c.reduce_scatter(nullptr, nullptr, 0, dt);
    c.all_gather(nullptr, nullptr, 0, dt);
    c.broadcast(nullptr, 0, dt, 0);
  }
  c.all_reduce_f64(nullptr, 0);
  c.all_reduce_max_f64(nullptr, 0);
  c.barrier();  // every rank got here: nothing above waited on a peer
}

// ---------------------------------------------------------------------------
// bf16 rounding: sums formed in fp32, rounded once per pairwise combination

TEST(MpiBf16, SumRoundsOnceToNearestEvenInFp32) {
  // Rank 0 holds a, rank 1 holds b, every other rank holds +0. Combining a
  // value with +0 is exact, so whatever order MPI combines the ranks in, the
  // result is float_to_bf16(a + b) (just a in a world of one). The first
  // entries are ties: 1 + 2^-8 is halfway between two bf16 values.
  Communicator& c = world();
  std::vector<float> a = {1.0f, 1.0f + 0x1p-7f, -1.0f, 3.0f}, b = {0x1p-8f, 0x1p-8f, -0x1p-8f, 0x1p-7f};
  std::mt19937 rng(1234);  // the same stream on every rank
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  while (a.size() < 4099) {
    a.push_back(bf16_to_float(float_to_bf16(u(rng))));
    b.push_back(bf16_to_float(float_to_bf16(u(rng) * 0.01f)));
  }
  const int64_t n = static_cast<int64_t>(a.size());
  std::vector<float> mine(n, 0.0f);
  if (c.rank() == 0) mine = a;
  if (c.rank() == 1) mine = b;
  std::vector<char> buf = encode(mine, DType::kBF16);
  c.all_reduce(buf.data(), buf.data(), n, DType::kBF16);
  const std::vector<float> got = decode(buf.data(), n, DType::kBF16);
  EXPECT_EQ(got[0], 1.0f);                                             // tie to even: down
  EXPECT_EQ(got[1], c.size() == 1 ? 1.0f + 0x1p-7f : 1.0f + 0x1p-6f);  // tie to even: up
  int rounded = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float expect = c.size() == 1 ? a[i] : bf16_to_float(float_to_bf16(a[i] + b[i]));
    EXPECT_EQ(got[i], expect) << "element " << i << ": " << a[i] << " + " << b[i];
    rounded += expect != a[i] + b[i];
  }
  if (c.size() > 1) {
    EXPECT_GT(rounded, 1000);  // the case really exercises rounding
  }
}

// fp16: the same rule with fp16's rounding, and a sum beyond 65504 is Inf
// (the overflow that dynamic loss scaling detects on the wire).
TEST(MpiF16, SumRoundsToNearestEvenAndOverflowsToInf) {
  Communicator& c = world();
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10; 40000 + 40000 > 65504.
  std::vector<float> a = {1.0f, 1.0f + 0x1p-10f, 40000.0f, -40000.0f, 0x1p-24f};
  std::vector<float> b = {0x1p-11f, 0x1p-11f, 40000.0f, -40000.0f, 0x1p-24f};
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  while (a.size() < 2053) {
    a.push_back(from_16(float_to_16(u(rng), DType::kF16), DType::kF16));
    b.push_back(from_16(float_to_16(u(rng) * 0.01f, DType::kF16), DType::kF16));
  }
  const int64_t n = static_cast<int64_t>(a.size());
  std::vector<float> mine(n, 0.0f);
  if (c.rank() == 0) mine = a;
  if (c.rank() == 1) mine = b;
  std::vector<char> buf = encode(mine, DType::kF16);
  c.all_reduce(buf.data(), buf.data(), n, DType::kF16);
  const std::vector<float> got = decode(buf.data(), n, DType::kF16);
  if (c.size() > 1) {
    EXPECT_EQ(got[0], 1.0f);                  // tie to even: down
    EXPECT_EQ(got[1], 1.0f + 0x1p-9f);        // tie to even: up
    EXPECT_TRUE(std::isinf(got[2]) && got[2] > 0);
    EXPECT_TRUE(std::isinf(got[3]) && got[3] < 0);
    EXPECT_EQ(got[4], 0x1p-23f);              // subnormals add exactly
  }
  for (int64_t i = 5; i < n; ++i) {
    const float expect = c.size() == 1 ? a[i] : from_16(float_to_16(a[i] + b[i], DType::kF16), DType::kF16);
    EXPECT_EQ(got[i], expect) << "element " << i;
  }
}

// ---------------------------------------------------------------------------
// Doubles

TEST(MpiF64, SumAndMaxOverRanks) {
  Communicator& c = world();
  const int64_t n = 1001;
  std::vector<double> sum(n), max(n);
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = 0.5 * c.rank() + static_cast<double>(i);
    max[i] = (i % 2 ? -1.0 : 1.0) * (c.rank() + 1) + 1e-3 * static_cast<double>(i);
  }
  c.all_reduce_f64(sum.data(), n);
  c.all_reduce_max_f64(max.data(), n);
  const int s = c.size();
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(sum[i], 0.5 * s * (s - 1) / 2 + static_cast<double>(s) * static_cast<double>(i)) << i;
    EXPECT_EQ(max[i], (i % 2 ? -1.0 : static_cast<double>(s)) + 1e-3 * static_cast<double>(i)) << i;
  }
}

// ---------------------------------------------------------------------------
// Determinism

std::vector<float> random_floats(uint64_t seed, int rank, int64_t n) {
  std::mt19937_64 rng(seed * 1000003 + static_cast<uint64_t>(rank));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng) * 1e3f;
  return v;
}

TEST(MpiDeterminism, RepeatedCollectivesAreBitIdenticalAndEqualOnEveryRank) {
  Communicator& c = world();
  const int64_t n = 100003;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const std::vector<char> send = encode(random_floats(42, c.rank(), n * c.size()), dt);
    const size_t elem = dtype_bytes(dt);
    std::vector<char> r1(n * c.size() * elem), r2(r1.size()), from_root(r1.size());
    c.all_reduce(send.data(), r1.data(), n * c.size(), dt);
    c.all_reduce(send.data(), r2.data(), n * c.size(), dt);
    from_root = r1;
    c.broadcast(from_root.data(), n * c.size(), dt, 0);
    std::vector<char> s1(n * elem), s2(n * elem);
    c.reduce_scatter(send.data(), s1.data(), n, dt);
    c.reduce_scatter(send.data(), s2.data(), n, dt);
    EXPECT_EQ(std::memcmp(r1.data(), r2.data(), r1.size()), 0) << dtype_name(dt) << " all_reduce run to run";
    // Replicas must stay identical: every rank holds rank 0's all-reduce bits.
    EXPECT_EQ(std::memcmp(r1.data(), from_root.data(), r1.size()), 0) << dtype_name(dt) << " all_reduce across ranks";
    EXPECT_EQ(std::memcmp(s1.data(), s2.data(), s1.size()), 0) << dtype_name(dt) << " reduce_scatter run to run";
  }
}

// ---------------------------------------------------------------------------
// Large counts: chunking and limits, with the per-call limit lowered to 100

TEST(MpiLimits, AllReduceBroadcastAndF64SplitIntoCallsWithinTheLimit) {
  std::unique_ptr<Communicator> small = detail::make_mpi_communicator(100);  // a second communicator
  const int64_t n = 1001;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const std::vector<char> send = encode(rank_values(small->rank(), n), dt);
    std::vector<char> out(send.size()), inplace = send;
    small->all_reduce(send.data(), out.data(), n, dt);
    small->all_reduce(inplace.data(), inplace.data(), n, dt);
    std::vector<char> bc = small->rank() == 0 ? send : std::vector<char>(send.size(), 0x55);
    small->broadcast(bc.data(), n, dt, 0);
    const std::vector<float> a = decode(out.data(), n, dt), b = decode(inplace.data(), n, dt),
                             d = decode(bc.data(), n, dt);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(a[i], sum_over_ranks(small->size(), i)) << i;
      EXPECT_EQ(b[i], sum_over_ranks(small->size(), i)) << i;
      EXPECT_EQ(d[i], small_int(0, i)) << i;
    }
  }
  std::vector<double> f(n, 1.0);
  small->all_reduce_f64(f.data(), n);
  for (double x : f) EXPECT_EQ(x, small->size());
}

TEST(MpiLimits, ReduceScatterAndAllGatherBeyondTheLimitThrowNamingIt) {
  std::unique_ptr<Communicator> small = detail::make_mpi_communicator(100);
  const int64_t n = 101;
  std::vector<float> full(n * small->size()), part(n);
  const std::string rs = message_of([&] { small->reduce_scatter(full.data(), part.data(), n, DType::kF32); });
  const std::string ag = message_of([&] { small->all_gather(part.data(), full.data(), n, DType::kF32); });
  const std::string prefix = "rank " + std::to_string(small->rank()) + ": ";
  EXPECT_NE(rs.find(prefix + "reduce_scatter: 101 elements per rank"), std::string::npos) << rs;
  EXPECT_NE(rs.find("limit of 100 elements per MPI call"), std::string::npos) << rs;
  EXPECT_NE(ag.find(prefix + "all_gather: 101 elements per rank"), std::string::npos) << ag;
  // Within the limit it works (size * count <= 100 for up to 4 ranks).
  const int64_t m = 25;
  const std::vector<float> mine = rank_values(small->rank(), m);
  std::vector<float> gathered(m * small->size());
  small->all_gather(mine.data(), gathered.data(), m, DType::kF32);
  for (int r = 0; r < small->size(); ++r)
    for (int64_t i = 0; i < m; ++i) EXPECT_EQ(gathered[r * m + i], small_int(r, i));
}

TEST(MpiLimits, DestroyingASecondCommunicatorKeepsMpiRunning) {
  { auto extra = make_mpi_communicator(); extra->barrier(); }
  int finalized = 1;
  MPI_Finalized(&finalized);
  EXPECT_EQ(finalized, 0);
  double one = 1.0;
  world().all_reduce_f64(&one, 1);
  EXPECT_EQ(one, world().size());
}

// ---------------------------------------------------------------------------
// Errors

TEST(MpiErrors, MpiErrorNamesRankCallAndMpiText) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(MPI_ERR_COUNT, text, &len);
  const std::string msg = detail::mpi_error("MPI_Reduce_scatter_block (reduce_scatter of 7 bf16)", MPI_ERR_COUNT).what();
  const std::string want = "rank " + std::to_string(world().rank()) +
                           ": MPI_Reduce_scatter_block (reduce_scatter of 7 bf16) failed: " + std::string(text, len);
  EXPECT_EQ(msg.rfind(want, 0), 0u) << msg;
}

TEST(MpiErrors, InvalidArgumentsThrowOnEveryRankBeforeCommunicating) {
  Communicator& c = world();
  const std::string prefix = "rank " + std::to_string(c.rank()) + ": ";
  std::vector<float> buf(8 * c.size() + 8);
  const std::string neg = message_of([&] { c.all_reduce(buf.data(), buf.data(), -1, DType::kF32); });
  const std::string root = message_of([&] { c.broadcast(buf.data(), 4, DType::kF32, c.size()); });
  const std::string rs =
      message_of([&] { c.reduce_scatter(buf.data(), buf.data() + 1, 4, DType::kBF16); });
  const std::string ag =
      message_of([&] { c.all_gather(buf.data() + c.rank() * 4 + 1, buf.data(), 4, DType::kF32); });
  const std::string ar = message_of([&] { c.all_reduce(buf.data(), buf.data() + 1, 4, DType::kF32); });
  const std::string f64 = message_of([&] { c.all_reduce_f64(nullptr, -3); });
  c.barrier();  // nobody is stuck in a collective
  EXPECT_EQ(neg, prefix + "all_reduce: count must be >= 0, got -1");
  EXPECT_EQ(root.rfind(prefix + "broadcast: root " + std::to_string(c.size()) + " is not a rank", 0), 0u) << root;
  EXPECT_EQ(rs.rfind(prefix + "reduce_scatter: recv overlaps send", 0), 0u) << rs;
  EXPECT_EQ(ag.rfind(prefix + "all_gather: send overlaps recv but is not this rank's block", 0), 0u) << ag;
  EXPECT_EQ(ar.rfind(prefix + "all_reduce: send and recv overlap", 0), 0u) << ar;
  EXPECT_EQ(f64, prefix + "all_reduce_f64: count must be >= 0, got -3");
}

// ---------------------------------------------------------------------------
// main

// On ranks other than 0 the default printer is replaced by one that prints
// only failures, each line prefixed with the rank.

int abort_mode(const std::string& mode) {
  if (mode == "single") make_single_communicator()->abort(7, "boom from the single communicator");
  std::unique_ptr<Communicator> c = make_mpi_communicator();
  if (c->rank() == c->size() - 1) c->abort(7, "boom from the last rank");
  c->barrier();  // the other ranks wait here until the abort ends them
  std::fprintf(stderr, "rank %d: still running after the abort\n", c->rank());
  return 3;
}

}  // namespace
}  // namespace zinc::comm::testing

int main(int argc, char** argv) {
  namespace zt = zinc::comm::testing;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--abort=", 0) == 0) return zt::abort_mode(arg.substr(8));
  }
  ::testing::InitGoogleTest(&argc, argv);
  zt::g_world = zinc::comm::make_mpi_communicator();
  const int rc = zt::run_all_tests_on_every_rank(*zt::g_world);
  zt::g_world.reset();  // the last communicator: finalises MPI
  return rc;
}
