// Tests of the NCCL backend, and main() for the nccl test binary (run by
// CTest under mpirun at -np 1 and 2; see comm_test_util.h for the rules every
// test follows). Built only when NCCL is (ZINC_WITH_NCCL).
//
// Two kinds of test:
//  - NcclRefusal: where NCCL cannot start (no GPU visible, fewer GPUs than
//    ranks on the machine), make_nccl_communicator and
//    make_communicator("nccl") throw CommError naming the rank and the
//    reason. These run on machines without a GPU.
//  - Nccl*: the collectives over device buffers, against sums computed on
//    the host. Without a usable GPU they skip, saying why.
//
// main() makes the MPI world and tries the NCCL communicator once; whether
// it started is the same on every rank (make_nccl_communicator agrees over
// MPI before NCCL starts), so every rank skips or runs the same tests.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "comm_test_util.h"
#include "core/cuda_util.h"
#include "core/device.h"
#include "core/error.h"
#include "tests/comm/mpi_test_main.h"

namespace zinc::comm::testing {
namespace {

std::unique_ptr<Communicator> g_world;
std::unique_ptr<Communicator> g_nccl;
std::string g_nccl_error;  // what make_nccl_communicator threw in main(), if it did

}  // namespace

Communicator& world() { return *g_world; }

namespace {

// Why the GPU tests cannot run here (empty when they can).
std::string gpu_skip_reason() {
  if (g_nccl) return "";
  const CudaStatus& cuda = cuda_status();
  if (cuda.devices == 0) return "no GPU: " + cuda.why;
  if (cuda.devices < world().local_size()) {
    return "fewer GPUs than ranks on this machine (" + std::to_string(cuda.devices) + " GPU(s), " +
           std::to_string(world().local_size()) + " ranks): NCCL needs one GPU per rank";
  }
  return "the NCCL communicator did not start: " + g_nccl_error;
}

// Skips where NCCL did not start; fails instead where ZINC_EXPECT_GPU=1
// says it must have (a GPU per rank; gpu-bundle/run.sh and the emulated
// runs set it).
#define ZINC_REQUIRE_NCCL()                                                                           \
  do {                                                                                                \
    if (!g_nccl) {                                                                                    \
      const char* zinc_expect_ = std::getenv("ZINC_EXPECT_GPU");                                      \
      if (zinc_expect_ && std::string(zinc_expect_) == "1" && cuda_status().devices >= world().local_size()) \
        FAIL() << "ZINC_EXPECT_GPU=1, a GPU per rank, but NCCL did not start: " << g_nccl_error;       \
      GTEST_SKIP() << gpu_skip_reason();                                                              \
    }                                                                                                 \
  } while (0)

Communicator& nccl() { return *g_nccl; }

// ---------------------------------------------------------------------------
// Refusals (these run on machines without a GPU)

// The message make_nccl_communicator must give on this machine, or empty
// when NCCL can start here (then the GPU tests cover it).
std::string expected_refusal(int rank) {
  const CudaStatus& cuda = cuda_status();
  const std::string prefix = "[rank " + std::to_string(rank) + "] nccl backend: ";
  if (cuda.devices == 0) return prefix + "no GPU visible (" + cuda.why + ")";
  if (cuda.devices < world().local_size()) {
    return prefix + std::to_string(world().local_size()) + " ranks run on this machine but it has only " +
           std::to_string(cuda.devices) + " visible GPU(s); NCCL cannot put two ranks on one GPU (run at most " +
           std::to_string(cuda.devices) + " ranks per machine)";
  }
  return "";
}

// libnccl is opened at run time (core/dynlib.h): it must load wherever the
// toolkit is, GPU or not.
TEST(NcclLibrary, LoadsWithoutAGpu) {
  const std::string lib = nccl_library();
  EXPECT_NE(lib.find("libnccl.so."), std::string::npos) << lib;
  EXPECT_NE(lib.find("(NCCL 2"), std::string::npos) << lib;
}

TEST(NcclRefusal, MakeNcclCommunicatorNamesTheRankAndTheReason) {
  const std::string want = expected_refusal(world().rank());
  if (want.empty()) GTEST_SKIP() << "NCCL starts on this machine (the GPU tests cover it)";
  const std::string got = message_of([] { make_nccl_communicator(world()); });
  EXPECT_EQ(got, want);
  EXPECT_EQ(g_nccl_error, want);  // main()'s attempt failed the same way
  if (cuda_status().devices == 0) {
    EXPECT_NE(got.find("no GPU visible"), std::string::npos) << got;
    EXPECT_FALSE(cuda_status().why.empty());
  }
  // Explicit device numbers are refused the same way.
  const std::string dev0 = message_of([] { make_nccl_communicator(world(), 0); });
  if (cuda_status().devices == 0) {
    EXPECT_EQ(dev0, want);
  }
  world().barrier();  // nobody was left waiting inside make_nccl_communicator
}

TEST(NcclRefusal, MakeCommunicatorNcclAndTheEnvironmentRefuseAlike) {
  const std::string want = expected_refusal(world().rank());
  if (want.empty()) GTEST_SKIP() << "NCCL starts on this machine (the GPU tests cover it)";
  const std::string by_mode = message_of([] { make_communicator("nccl"); });
  setenv("ZINC_COMM_BACKEND", "nccl", 1);
  const std::string by_env = message_of([] { make_communicator("mpi"); });
  unsetenv("ZINC_COMM_BACKEND");
  EXPECT_EQ(by_mode, want);
  EXPECT_EQ(by_env, want);
  // The MPI world is untouched by the failed attempts.
  double one = 1.0;
  world().all_reduce_f64(&one, 1);
  EXPECT_EQ(one, world().size());
}

TEST(NcclRefusal, WaitCudaEventWithoutAnEventIsANoOp) {
  wait_cuda_event(world(), nullptr);
  if (g_nccl) wait_cuda_event(nccl(), nullptr);
  SUCCEED();
}

// ---------------------------------------------------------------------------
// Device buffers

// `bytes` of device memory holding `host`.
cuda::DeviceBuffer upload(const std::vector<char>& host) {
  cuda::DeviceBuffer d(host.size());
  if (!host.empty()) cuda::copy_to_device(d.data(), host.data(), host.size());
  return d;
}

std::vector<char> download(const void* d, size_t bytes) {
  std::vector<char> host(bytes);
  if (bytes) cuda::copy_to_host(host.data(), d, bytes);
  return host;
}

// Garbage of `bytes` on the device (0x55 bytes: not any expected value).
cuda::DeviceBuffer garbage(size_t bytes) { return upload(std::vector<char>(bytes, 0x55)); }

std::vector<float> rank_values(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = small_int(rank, i);
  return v;
}

// Exact in fp32, bf16 and fp16: |sum| <= 8 * 16 ranks.
float sum_over_ranks(int size, int64_t i) {
  float s = 0;
  for (int r = 0; r < size; ++r) s += small_int(r, i);
  return s;
}

// ---------------------------------------------------------------------------
// The communicator itself

TEST(NcclWorld, RankSizeLocalSizeAndBackendMatchTheBootstrap) {
  ZINC_REQUIRE_NCCL();
  EXPECT_EQ(nccl().backend(), "nccl");
  EXPECT_EQ(nccl().rank(), world().rank());
  EXPECT_EQ(nccl().size(), world().size());
  EXPECT_EQ(nccl().local_size(), world().local_size());
}

// ---------------------------------------------------------------------------
// Every collective, fp32 / bf16 / fp16, odd counts

class NcclCollective : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  int64_t count() const { return std::get<1>(GetParam()); }
  size_t elem() const { return dtype_bytes(dtype()); }
};

std::string param_name(const ::testing::TestParamInfo<std::tuple<DType, int64_t>>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" + std::to_string(std::get<1>(info.param));
}

TEST_P(NcclCollective, AllReduceOutOfPlaceSumsEveryRank) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int64_t n = count();
  const std::vector<char> host = encode(rank_values(c.rank(), n), dtype());
  cuda::DeviceBuffer send = upload(host), recv = garbage(host.size());
  c.all_reduce(send.data(), recv.data(), n, dtype());
  const std::vector<float> got = decode(download(recv.data(), host.size()).data(), n, dtype());
  const std::vector<float> sent = decode(download(send.data(), host.size()).data(), n, dtype());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(got[i], sum_over_ranks(c.size(), i)) << "element " << i;
    EXPECT_EQ(sent[i], small_int(c.rank(), i)) << "send buffer changed at " << i;
  }
}

TEST_P(NcclCollective, AllReduceInPlace) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int64_t n = count();
  const std::vector<char> host = encode(rank_values(c.rank(), n), dtype());
  cuda::DeviceBuffer buf = upload(host);
  c.all_reduce(buf.data(), buf.data(), n, dtype());
  const std::vector<float> got = decode(download(buf.data(), host.size()).data(), n, dtype());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], sum_over_ranks(c.size(), i)) << "element " << i;
}

TEST_P(NcclCollective, ReduceScatterLeavesEachRankItsBlockOfTheSum) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int64_t n = count();  // per rank
  cuda::DeviceBuffer send = upload(encode(rank_values(c.rank(), n * c.size()), dtype()));
  cuda::DeviceBuffer recv = garbage(static_cast<size_t>(n) * elem());
  c.reduce_scatter(send.data(), recv.data(), n, dtype());
  const std::vector<float> got = decode(download(recv.data(), recv.bytes()).data(), n, dtype());
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], sum_over_ranks(c.size(), c.rank() * n + i)) << "element " << i;
}

TEST_P(NcclCollective, AllGatherOutOfPlaceConcatenatesBlocksInRankOrder) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int64_t n = count();
  cuda::DeviceBuffer send = upload(encode(rank_values(c.rank(), n), dtype()));
  cuda::DeviceBuffer recv = garbage(static_cast<size_t>(n * c.size()) * elem());
  c.all_gather(send.data(), recv.data(), n, dtype());
  const std::vector<float> got = decode(download(recv.data(), recv.bytes()).data(), n * c.size(), dtype());
  for (int r = 0; r < c.size(); ++r)
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[r * n + i], small_int(r, i)) << "rank " << r << " element " << i;
}

TEST_P(NcclCollective, AllGatherInPlaceFromOwnBlock) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int64_t n = count();
  std::vector<char> host(static_cast<size_t>(n * c.size()) * elem(), 0x55);
  const std::vector<char> mine = encode(rank_values(c.rank(), n), dtype());
  std::memcpy(host.data() + static_cast<size_t>(c.rank() * n) * elem(), mine.data(), mine.size());
  cuda::DeviceBuffer buf = upload(host);
  char* own = buf.as<char>() + static_cast<size_t>(c.rank() * n) * elem();
  c.all_gather(own, buf.data(), n, dtype());
  const std::vector<float> got = decode(download(buf.data(), buf.bytes()).data(), n * c.size(), dtype());
  for (int r = 0; r < c.size(); ++r)
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[r * n + i], small_int(r, i)) << "rank " << r << " element " << i;
}

TEST_P(NcclCollective, BroadcastFromEveryRoot) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int64_t n = count();
  for (int root = 0; root < c.size(); ++root) {
    // Only the root holds the values; the others start with garbage.
    cuda::DeviceBuffer buf =
        c.rank() == root ? upload(encode(rank_values(root, n), dtype())) : garbage(static_cast<size_t>(n) * elem());
    c.broadcast(buf.data(), n, dtype(), root);
    const std::vector<float> got = decode(download(buf.data(), buf.bytes()).data(), n, dtype());
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[i], small_int(root, i)) << "root " << root << " element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Counts, NcclCollective,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(int64_t{1}, int64_t{1001}, int64_t{65537})),
                         param_name);

TEST(NcclCollectiveEdge, ZeroCountsTouchNothing) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    c.all_reduce(nullptr, nullptr, 0, dt);
    c.reduce_scatter(nullptr, nullptr, 0, dt);
    c.all_gather(nullptr, nullptr, 0, dt);
    c.broadcast(nullptr, 0, dt, 0);
  }
  c.all_reduce_f64(nullptr, 0);
  c.all_reduce_max_f64(nullptr, 0);
  c.barrier();
}

// ---------------------------------------------------------------------------
// Point to point, all-to-all and split (Note [NCCL point to point] in
// nccl_communicator.cpp), over device buffers, against what each rank sent.

// Rank r's message to rank q: n values that name both.
std::vector<float> message(int from, int to, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(from * 1000 + to * 100 + i % 97);
  return v;
}

TEST(NcclPointToPoint, SendRecvAndExchangeAroundTheRing) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  if (c.size() < 2) GTEST_SKIP() << "needs two ranks";
  const int me = c.rank(), R = c.size(), next = (me + 1) % R, prev = (me + R - 1) % R;
  for (int64_t n : {int64_t{1}, int64_t{4099}}) {
    // exchange: each rank sends to the next and receives from the previous at once.
    cuda::DeviceBuffer out = upload(encode(message(me, next, n), DType::kF32)), in = garbage(n * sizeof(float));
    c.exchange(out.data(), n, next, in.data(), n, prev, DType::kF32);
    EXPECT_EQ(decode(download(in.data(), n * sizeof(float)).data(), n, DType::kF32), message(prev, me, n)) << n;
    // send and recv: even ranks send first, odd ranks receive first (no deadlock either way).
    cuda::DeviceBuffer back = garbage(n * sizeof(float));
    if (me % 2 == 0) {
      c.send(out.data(), n, DType::kF32, next);
      if (me != next) c.recv(back.data(), n, DType::kF32, prev);
    } else {
      c.recv(back.data(), n, DType::kF32, prev);
      c.send(out.data(), n, DType::kF32, next);
    }
    if (R % 2 == 0) {
      EXPECT_EQ(decode(download(back.data(), n * sizeof(float)).data(), n, DType::kF32), message(prev, me, n)) << n;
    }
  }
  // bf16 keeps its bits: no arithmetic on the way.
  const std::vector<float> vals = message(me, next, 33);
  cuda::DeviceBuffer o16 = upload(encode(vals, DType::kBF16)), i16 = garbage(33 * 2);
  c.exchange(o16.data(), 33, next, i16.data(), 33, prev, DType::kBF16);
  EXPECT_EQ(download(i16.data(), 33 * 2), encode(message(prev, me, 33), DType::kBF16));
  // A peer that is not another rank is refused before anything moves.
  try {
    c.send(nullptr, 1, DType::kF32, me);
    ADD_FAILURE() << "a send to itself was not refused";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("is not another rank"), std::string::npos) << e.what();
  }
}

TEST(NcclPointToPoint, AllToAllAndAllToAllVDeliverEveryBlock) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int me = c.rank(), R = c.size();
  const int64_t n = 257;
  std::vector<float> blocks;
  for (int q = 0; q < R; ++q) {
    const std::vector<float> m = message(me, q, n);
    blocks.insert(blocks.end(), m.begin(), m.end());
  }
  cuda::DeviceBuffer send = upload(encode(blocks, DType::kF32)), recv = garbage(blocks.size() * sizeof(float));
  c.all_to_all(send.data(), recv.data(), n, DType::kF32);
  const std::vector<float> got = decode(download(recv.data(), blocks.size() * sizeof(float)).data(), blocks.size(), DType::kF32);
  for (int q = 0; q < R; ++q)
    EXPECT_EQ(std::vector<float>(got.begin() + q * n, got.begin() + (q + 1) * n), message(q, me, n)) << "from " << q;
  // Counts per pair: rank a sends (a + b) % 3 * 5 values to rank b (some pairs none).
  auto count = [](int a, int b) { return static_cast<int64_t>((a + b) % 3 * 5); };
  std::vector<int64_t> sc(static_cast<size_t>(R)), rc(static_cast<size_t>(R));
  std::vector<float> vs, want;
  for (int q = 0; q < R; ++q) {
    sc[static_cast<size_t>(q)] = count(me, q);
    rc[static_cast<size_t>(q)] = count(q, me);
    const std::vector<float> m = message(me, q, count(me, q)), w = message(q, me, count(q, me));
    vs.insert(vs.end(), m.begin(), m.end());
    want.insert(want.end(), w.begin(), w.end());
  }
  cuda::DeviceBuffer vsend = upload(encode(vs, DType::kF32)), vrecv = garbage(std::max<size_t>(want.size(), 1) * 4);
  c.all_to_all_v(vsend.data(), sc.data(), vrecv.data(), rc.data(), DType::kF32);
  EXPECT_EQ(decode(download(vrecv.data(), want.size() * 4).data(), want.size(), DType::kF32), want);
}

TEST(NcclSplit, SplitGroupsRankByKeyAndReduceOnlyTheirOwn) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int me = c.rank(), R = c.size();
  // Two colours by parity, ranked in reverse order of the world's.
  std::unique_ptr<Communicator> part = c.split(me % 2, R - me);
  ASSERT_TRUE(part);
  EXPECT_EQ(part->backend(), "nccl");
  const int members = (R - me % 2 + 1) / 2;
  EXPECT_EQ(part->size(), members);
  int higher = 0;  // same-colour ranks above this one come first
  for (int q = me + 2; q < R; q += 2) ++higher;
  EXPECT_EQ(part->rank(), higher);
  const int64_t n = 1001;
  cuda::DeviceBuffer buf = upload(encode(rank_values(me, n), DType::kF32));
  part->all_reduce(buf.data(), buf.data(), n, DType::kF32);
  const std::vector<float> got = decode(download(buf.data(), n * 4).data(), n, DType::kF32);
  for (int64_t i = 0; i < n; i += 97) {
    float want = 0;
    for (int q = me % 2; q < R; q += 2) want += small_int(q, i);
    EXPECT_EQ(got[static_cast<size_t>(i)], want) << i;
  }
  if (part->size() > 1) {  // point to point inside the part, by the part's ranks
    const int pn = part->size(), pm = part->rank();
    cuda::DeviceBuffer o = upload(encode(message(pm, (pm + 1) % pn, 5), DType::kF32)), in = garbage(20);
    part->exchange(o.data(), 5, (pm + 1) % pn, in.data(), 5, (pm + pn - 1) % pn, DType::kF32);
    EXPECT_EQ(decode(download(in.data(), 20).data(), 5, DType::kF32), message((pm + pn - 1) % pn, pm, 5));
  }
  EXPECT_THROW(c.split(-1, 0), CommError);
  part.reset();  // collective
  world().barrier();
}

// ---------------------------------------------------------------------------
// 16-bit rounding (Note [NCCL 16-bit sums] in nccl_communicator.cpp): rank 0
// holds a, rank 1 holds b, the others +0. Adding +0 is exact, so whatever
// grouping NCCL uses (ring, tree, NVLS in fp32), the sum is a + b rounded
// once to nearest even, as the MPI backend gives.

void expect_two_rank_sum_rounds_once(DType dt, std::vector<float> a, std::vector<float> b, uint32_t seed) {
  Communicator& c = nccl();
  std::mt19937 rng(seed);  // the same stream on every rank
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  while (a.size() < 4099) {
    a.push_back(from_16(float_to_16(u(rng), dt), dt));
    b.push_back(from_16(float_to_16(u(rng) * 0.01f, dt), dt));
  }
  const int64_t n = static_cast<int64_t>(a.size());
  std::vector<float> mine(a.size(), 0.0f);
  if (c.rank() == 0) mine = a;
  if (c.rank() == 1) mine = b;
  cuda::DeviceBuffer buf = upload(encode(mine, dt));
  c.all_reduce(buf.data(), buf.data(), n, dt);
  const std::vector<float> got = decode(download(buf.data(), buf.bytes()).data(), n, dt);
  int rounded = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want = c.size() == 1 ? a[i] : from_16(float_to_16(a[i] + b[i], dt), dt);
    EXPECT_EQ(got[i], want) << dtype_name(dt) << " element " << i << ": " << a[i] << " + " << b[i];
    rounded += want != a[i] + b[i];
  }
  if (c.size() > 1) {
    EXPECT_GT(rounded, 1000) << "the case must really exercise rounding";
  }
}

TEST(NcclRounding, Bf16SumOfTwoRanksRoundsOnceToNearestEven) {
  ZINC_REQUIRE_NCCL();
  // 1 + 2^-8 is halfway between two bf16 values (tie to even: down); the
  // second tie rounds up.
  expect_two_rank_sum_rounds_once(DType::kBF16, {1.0f, 1.0f + 0x1p-7f, -1.0f, 3.0f},
                                  {0x1p-8f, 0x1p-8f, -0x1p-8f, 0x1p-7f}, 1234);
}

TEST(NcclRounding, Fp16SumOfTwoRanksRoundsOnceAndOverflowsToInf) {
  ZINC_REQUIRE_NCCL();
  // 1 + 2^-11 is an fp16 tie; 40000 + 40000 > 65504 is Inf.
  expect_two_rank_sum_rounds_once(DType::kF16, {1.0f, 1.0f + 0x1p-10f, 40000.0f, -40000.0f, 0x1p-24f},
                                  {0x1p-11f, 0x1p-11f, 40000.0f, -40000.0f, 0x1p-24f}, 99);
}

// ---------------------------------------------------------------------------
// Host doubles and the barrier

TEST(NcclHost, AllReduceF64SumsAndMaxesHostDoubles) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int R = c.size(), me = c.rank();
  std::vector<double> sum = {1.0, me + 0.25, -1e300 * (me == 0), 1e-300};
  std::vector<double> mx = {static_cast<double>(me), -static_cast<double>(me), me == R - 1 ? 7.5 : -3.0};
  std::vector<double> big(3000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<double>(i) * (me + 1);
  c.all_reduce_f64(sum.data(), static_cast<int64_t>(sum.size()));
  c.all_reduce_max_f64(mx.data(), static_cast<int64_t>(mx.size()));
  c.all_reduce_f64(big.data(), static_cast<int64_t>(big.size()));  // grows the scratch
  EXPECT_EQ(sum[0], R);
  EXPECT_EQ(sum[1], R * (R - 1) / 2.0 + 0.25 * R);
  EXPECT_EQ(sum[2], -1e300);
  EXPECT_EQ(sum[3], 1e-300 * R);
  EXPECT_EQ(mx[0], R - 1);
  EXPECT_EQ(mx[1], 0.0);
  EXPECT_EQ(mx[2], 7.5);
  for (size_t i = 0; i < big.size(); ++i) EXPECT_EQ(big[i], static_cast<double>(i) * R * (R + 1) / 2) << i;
}

TEST(NcclHost, BarrierHoldsRanksUntilTheLastArrives) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  c.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  if (c.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  c.barrier();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(waited, 0.1);  // every rank leaves after rank 0 arrived, 200 ms in
}

// ---------------------------------------------------------------------------
// duplicate() / twin(): two streams that do not wait for each other

TEST(NcclTwin, DuplicateStreamsRunCollectivesFromTwoThreadsAtOnce) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  Communicator* twin = c.twin();
  ASSERT_NE(twin, nullptr) << "duplicate() returned null: NCCL older than 2.18 has no ncclCommSplit";
  EXPECT_EQ(twin, c.twin());  // made once
  EXPECT_EQ(twin->backend(), "nccl");
  EXPECT_EQ(twin->rank(), c.rank());
  EXPECT_EQ(twin->size(), c.size());
  const int R = c.size(), me = c.rank();
  const int64_t n = 777;
  const size_t bytes = static_cast<size_t>(n) * 4;
  {
    // Work on the first stream that cannot finish until a gather on the
    // twin's stream has run on this rank does finish.
    CommStream reduce(c), gather(*twin);
    std::promise<void> gathered;
    std::shared_future<void> gathered_f = gathered.get_future().share();
    cuda::DeviceBuffer sum = upload(encode(rank_values(me, n), DType::kF32));
    CommHandle blocked = reduce.submit([&, gathered_f](Communicator& cc) {
      if (gathered_f.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
        throw std::runtime_error("the gather on the twin did not run while the other stream was busy");
      cc.all_reduce(sum.data(), sum.data(), n, DType::kF32);
    });
    std::vector<float> mine(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) mine[static_cast<size_t>(i)] = static_cast<float>(me * 1000 + i);
    std::vector<char> parts_host(bytes * static_cast<size_t>(R), 0x55);
    const std::vector<char> mine_bytes = encode(mine, DType::kF32);
    std::memcpy(parts_host.data() + bytes * static_cast<size_t>(me), mine_bytes.data(), bytes);
    cuda::DeviceBuffer parts = upload(parts_host);
    gather.submit([&](Communicator& cc) { cc.all_gather(parts.as<char>() + bytes * me, parts.data(), n, DType::kF32); })
        .wait();
    gathered.set_value();
    blocked.wait();
    const std::vector<float> got_parts = decode(download(parts.data(), parts.bytes()).data(), n * R, DType::kF32);
    const std::vector<float> got_sum = decode(download(sum.data(), bytes).data(), n, DType::kF32);
    for (int r = 0; r < R; ++r)
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(got_parts[static_cast<size_t>(r * n + i)], static_cast<float>(r * 1000 + i)) << "rank " << r;
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got_sum[static_cast<size_t>(i)], sum_over_ranks(R, i)) << i;
  }
  {
    // Many collectives submitted alternately to both streams, running at
    // the same time, all give the right results.
    constexpr int kRounds = 40;
    CommStream a(c), b(*twin);
    std::vector<cuda::DeviceBuffer> sums, gathers;
    for (int k = 0; k < kRounds; ++k) {
      sums.push_back(upload(encode(rank_values(me + k, n), DType::kF32)));
      std::vector<char> g(bytes * static_cast<size_t>(R), 0x55);
      const std::vector<char> v =
          encode(std::vector<float>(static_cast<size_t>(n), static_cast<float>(k * 7 + me)), DType::kF32);
      std::memcpy(g.data() + bytes * static_cast<size_t>(me), v.data(), bytes);
      gathers.push_back(upload(g));
    }
    for (int k = 0; k < kRounds; ++k) {
      void* s = sums[static_cast<size_t>(k)].data();
      char* g = gathers[static_cast<size_t>(k)].as<char>();
      a.submit([s, n](Communicator& cc) { cc.all_reduce(s, s, n, DType::kF32); });
      b.submit([g, n, me, bytes](Communicator& cc) { cc.all_gather(g + bytes * me, g, n, DType::kF32); });
    }
    a.synchronize();
    b.synchronize();
    for (int k = 0; k < kRounds; ++k) {
      const std::vector<float> s = decode(download(sums[static_cast<size_t>(k)].data(), bytes).data(), n, DType::kF32);
      const std::vector<float> g = decode(
          download(gathers[static_cast<size_t>(k)].data(), bytes * static_cast<size_t>(R)).data(), n * R, DType::kF32);
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int r = 0; r < R; ++r) want += small_int(r + k, i);
        EXPECT_EQ(s[static_cast<size_t>(i)], want) << "round " << k << " element " << i;
      }
      for (int r = 0; r < R; ++r)
        EXPECT_EQ(g[static_cast<size_t>(r * n)], static_cast<float>(k * 7 + r)) << "round " << k;
    }
  }
}

// ---------------------------------------------------------------------------
// CommStream over device buffers, ordered after a producer on a compute stream

TEST(NcclCommStream, ReducesWhatAComputeStreamProducedAfterItsEvent) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const int64_t n = int64_t{1} << 22;  // 16 MiB of fp32
  const size_t bytes = static_cast<size_t>(n) * 4;
  // The gradients' buffer starts as garbage; the compute stream first runs a
  // long copy (so that the producer is still busy when the collective is
  // submitted), then writes the real values from pinned memory, and records
  // the event. A collective that did not wait for it would read garbage.
  cuda::DeviceBuffer grads = garbage(bytes);
  cuda::DeviceBuffer busy_src(size_t{256} << 20), busy_dst(size_t{256} << 20);
  cuda::PinnedBuffer values(bytes);
  const std::vector<char> mine = encode(rank_values(c.rank(), n), DType::kF32);
  std::memcpy(values.data(), mine.data(), bytes);
  cuda::Stream compute;
  cuda::Event produced;
  CommStream stream(c);
  std::vector<CommHandle> handles;
  for (int round = 0; round < 3; ++round) {
    ZINC_CUDA_CHECK(
        cudaMemcpyAsync(busy_dst.data(), busy_src.data(), busy_src.bytes(), cudaMemcpyDeviceToDevice, compute.get()),
        "busy copy");
    ZINC_CUDA_CHECK(cudaMemcpyAsync(grads.data(), values.data(), bytes, cudaMemcpyHostToDevice, compute.get()),
                    "upload");
    produced.record(compute.get());
    void* g = grads.data();
    void* ev = produced.get();
    CommHandle h = stream.submit([g, ev, n](Communicator& cc) {
      wait_cuda_event(cc, ev);
      cc.all_reduce(g, g, n, DType::kF32);
    });
    h.wait();  // the reduction has completed on the GPU when the handle is done
    const std::vector<float> got = decode(download(g, bytes).data(), n, DType::kF32);
    int wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += got[static_cast<size_t>(i)] != sum_over_ranks(c.size(), i);
    EXPECT_EQ(wrong, 0) << "round " << round << ": elements that are not the sum of the produced values";
  }
  stream.synchronize();
}

TEST(NcclCommStream, WaitCudaEventOnAHostBackendWaitsForTheEvent) {
  ZINC_REQUIRE_NCCL();
  cuda::DeviceBuffer src(size_t{256} << 20), dst(size_t{256} << 20);
  cuda::Stream s;
  cuda::Event e;
  ZINC_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.bytes(), cudaMemcpyDeviceToDevice, s.get()), "copy");
  e.record(s.get());
  wait_cuda_event(world(), e.get());  // the MPI backend: the host waits
  EXPECT_TRUE(e.done());
}

// ---------------------------------------------------------------------------
// Errors: refused on every rank before any communication

TEST(NcclErrors, InvalidArgumentsThrowBeforeCommunicating) {
  ZINC_REQUIRE_NCCL();
  Communicator& c = nccl();
  const std::string prefix = "rank " + std::to_string(c.rank()) + ": ";
  cuda::DeviceBuffer buf(static_cast<size_t>(8 * c.size() + 8) * 4);
  float* p = buf.as<float>();
  const DType bad = static_cast<DType>(9);
  const std::string dtype_ar = message_of([&] { c.all_reduce(p, p, 4, bad); });
  // (A bad dtype counts 2 bytes per element in the shared checks: this
  // rank's block of 4 starts 8 bytes per rank in.)
  const std::string dtype_ag = message_of([&] { c.all_gather(buf.as<char>() + c.rank() * 8, p, 4, bad); });
  const std::string dtype_rs = message_of([&] { c.reduce_scatter(p, p + 4 * c.size(), 4, bad); });
  const std::string dtype_bc = message_of([&] { c.broadcast(p, 4, bad, 0); });
  const std::string neg = message_of([&] { c.all_reduce(p, p, -1, DType::kF32); });
  const std::string root = message_of([&] { c.broadcast(p, 4, DType::kF32, c.size()); });
  const std::string rs = message_of([&] { c.reduce_scatter(p, p + 1, 4, DType::kBF16); });
  const std::string ag = message_of([&] { c.all_gather(p + c.rank() * 4 + 1, p, 4, DType::kF32); });
  const std::string f64 = message_of([&] { c.all_reduce_f64(nullptr, -3); });
  c.barrier();  // nobody is stuck in a collective
  EXPECT_EQ(dtype_ar, prefix + "all_reduce: unknown dtype 9");
  EXPECT_EQ(dtype_ag, prefix + "all_gather: unknown dtype 9");
  EXPECT_EQ(dtype_rs, prefix + "reduce_scatter: unknown dtype 9");
  EXPECT_EQ(dtype_bc, prefix + "broadcast: unknown dtype 9");
  EXPECT_EQ(neg, prefix + "all_reduce: count must be >= 0, got -1");
  EXPECT_EQ(root.rfind(prefix + "broadcast: root " + std::to_string(c.size()) + " is not a rank", 0), 0u) << root;
  EXPECT_EQ(rs.rfind(prefix + "reduce_scatter: recv overlaps send", 0), 0u) << rs;
  EXPECT_EQ(ag.rfind(prefix + "all_gather: send overlaps recv but is not this rank's block", 0), 0u) << ag;
  EXPECT_EQ(f64, prefix + "all_reduce_f64: count must be >= 0, got -3");
}

TEST(NcclErrors, ADeviceNumberBeyondTheVisibleGpusIsRefused) {
  ZINC_REQUIRE_NCCL();
  const int n = cuda_status().devices;
  const std::string got = message_of([n] { make_nccl_communicator(world(), n); });
  EXPECT_EQ(got, "[rank " + std::to_string(world().rank()) + "] nccl backend: device " + std::to_string(n) +
                     " is not one of the " + std::to_string(n) + " visible GPU(s)");
  world().barrier();
}

// ---------------------------------------------------------------------------
// A collective whose peers never come (Note [NCCL completion] and Note [a
// failed NCCL collective] in comm/nccl_communicator.cpp)

// The limit is the bootstrap's (comm.timeout_seconds), through splits and
// duplicates too.
TEST(NcclTimeout, TheLimitIsTheBootstraps) {
  ZINC_REQUIRE_NCCL();
  std::unique_ptr<Communicator> host = make_communicator("mpi", 7.5);
  ASSERT_EQ(host->timeout_seconds(), 7.5);
  std::unique_ptr<Communicator> c = make_nccl_communicator(*host);
  EXPECT_EQ(c->timeout_seconds(), 7.5);
  std::unique_ptr<Communicator> d = c->duplicate();
  if (d) {
    EXPECT_EQ(d->timeout_seconds(), 7.5);
  }
  std::unique_ptr<Communicator> s = c->split(0, world().rank());
  EXPECT_EQ(s->timeout_seconds(), 7.5);
  EXPECT_EQ(nccl().timeout_seconds(), kCommTimeoutSeconds);  // main()'s, over a default MPI world
  s.reset();
  d.reset();
  c.reset();
  std::unique_ptr<Communicator> by_mode = make_communicator("nccl", 3.25);
  EXPECT_EQ(by_mode->timeout_seconds(), 3.25);
  by_mode.reset();
  world().barrier();
}

// Under the kernel emulation, ZINC_EMU_NCCL_STALL=1 makes every rank's
// collective one whose peers never come, as when a peer rank died: the
// call returns and its kernel waits on the GPU. complete() gives it up at
// the limit, aborts the communicator at once (so a wait for the whole
// device, which a teardown runs, does not wait for that kernel forever: the
// emulation ends the process if it would), and later calls name the first
// failure.
TEST(NcclTimeout, ACollectiveWhosePeersNeverComeIsAbortedAtTheLimit) {
  ZINC_REQUIRE_NCCL();
  if (!std::getenv("ZINC_EMU_GPUS")) GTEST_SKIP() << "needs the kernel emulation (ZINC_EMU_NCCL_STALL)";
  std::unique_ptr<Communicator> host = make_communicator("mpi", 1.0);
  std::unique_ptr<Communicator> c = make_nccl_communicator(*host);
  const std::string prefix = "[rank " + std::to_string(c->rank()) + "] nccl ";
  auto expect_parts = [](const std::string& text, const std::vector<std::string>& parts) {
    for (const std::string& part : parts) EXPECT_NE(text.find(part), std::string::npos) << part << " in: " << text;
  };
  cuda::DeviceBuffer buf(64 * sizeof(float));
  float* p = buf.as<float>();
  c->all_reduce(p, p, 16, DType::kF32);  // the peers come
  setenv("ZINC_EMU_NCCL_STALL", "1", 1);
  const auto t0 = std::chrono::steady_clock::now();
  const std::string got = message_of([&] { c->all_reduce(p, p, 16, DType::kF32); });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  unsetenv("ZINC_EMU_NCCL_STALL");
  expect_parts(got, {prefix + "all_reduce of 16 fp32: ", "no completion after 1 s, past comm.timeout_seconds",
                     "a rank has stopped", "(the NCCL communicator was aborted)"});
  EXPECT_GE(took, 1.0);
  EXPECT_LT(took, 30.0);
  const std::string later = message_of([&] { c->barrier(); });
  expect_parts(later, {prefix + "barrier: the NCCL communicator was aborted after an earlier failure (all_reduce "
                                "of 16 fp32: no completion after 1 s"});
  expect_parts(message_of([&] { c->duplicate(); }), {prefix + "duplicate: the NCCL communicator was aborted"});
  // The aborted collective's kernel is gone: a wait for the whole device ends.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  c.reset();  // an aborted communicator is not finalised: no peer waits
  // Point to point (pipeline stages' activations) alike: a group of sends
  // and receives whose peer never comes.
  if (world().size() > 1) {
    std::unique_ptr<Communicator> q = make_nccl_communicator(*host);
    const int next = (q->rank() + 1) % q->size(), prev = (q->rank() + q->size() - 1) % q->size();
    setenv("ZINC_EMU_NCCL_STALL", "1", 1);
    const std::string p2p = message_of([&] { q->exchange(p, 16, next, p + 16, 16, prev, DType::kF32); });
    unsetenv("ZINC_EMU_NCCL_STALL");
    expect_parts(p2p, {prefix + "exchange of 16 fp32: no completion after 1 s", "(the NCCL communicator was aborted)"});
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // A duplicate whose peers never come: ncclCommSplit has no limit of its
  // own (the emulation ends the process if it is reached), so the ranks
  // meet first, and that meeting is given up at the limit.
  {
    std::unique_ptr<Communicator> r = make_nccl_communicator(*host);
    setenv("ZINC_EMU_NCCL_STALL", "1", 1);
    const std::string dup = message_of([&] { r->duplicate(); });
    unsetenv("ZINC_EMU_NCCL_STALL");
    expect_parts(dup, {prefix + "duplicate: no completion after 1 s", "(the NCCL communicator was aborted)"});
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  world().barrier();
}

// ---------------------------------------------------------------------------
// make_communicator("nccl") on a machine where NCCL starts

TEST(NcclSelect, MakeCommunicatorNcclBuildsAWorkingNcclCommunicator) {
  ZINC_REQUIRE_NCCL();
  std::unique_ptr<Communicator> c = make_communicator("nccl");
  EXPECT_EQ(c->backend(), "nccl");
  EXPECT_EQ(c->size(), world().size());
  double v = 1.0;
  c->all_reduce_f64(&v, 1);
  EXPECT_EQ(v, world().size());
  c.reset();  // collective teardown, with its MPI bootstrap
  world().barrier();
}

}  // namespace
}  // namespace zinc::comm::testing

int main(int argc, char** argv) {
  namespace zt = zinc::comm::testing;
  ::testing::InitGoogleTest(&argc, argv);
  zt::g_world = zinc::comm::make_mpi_communicator();
  try {
    zt::g_nccl = zinc::comm::make_nccl_communicator(*zt::g_world);
  } catch (const zinc::CommError& e) {
    zt::g_nccl_error = e.what();
  }
  if (zt::g_nccl) {
    // The GPU make_nccl_communicator picked: the tests allocate there.
    const int local = zt::g_world->local_size();
    const int dev = (zt::g_world->rank() % local) % zinc::cuda_status().devices;
    ZINC_CUDA_CHECK(cudaSetDevice(dev), "cudaSetDevice");
  } else if (zt::g_world->rank() == 0) {
    std::fprintf(stderr, "nccl_test: GPU tests skip: %s\n", zt::gpu_skip_reason().c_str());
  }
  const int rc = zt::run_all_tests_on_every_rank(*zt::g_world);
  zt::g_nccl.reset();   // collective, before MPI goes
  zt::g_world.reset();  // the last communicator: finalises MPI
  return rc;
}
