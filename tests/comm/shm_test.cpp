// Multi-rank tests of the shared-memory backend and of make_communicator, and
// main() for the shm_test binary (run by CTest under mpirun at -np 2, 3 and 4
// on one machine). Expected values are computed from (seed, rank, world size)
// without communicating; the inputs are not small integers, so sums round and
// the reference fixes the order: fp32 summed in rank order 0..size-1, bf16
// widened, summed in fp32 in rank order and rounded once. Results must match
// bit for bit. The rules of comm_test_util.h apply (every rank issues every
// collective before any ASSERT).
#include <gtest/gtest.h>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "comm_test_util.h"
#include "core/error.h"
#include "tests/comm/mpi_test_main.h"

namespace zinc::comm::testing {
namespace {

std::unique_ptr<Communicator> g_mpi;    // plain MPI, for agreement between ranks
std::unique_ptr<Communicator> g_shm;    // make_communicator("shm"): default (1 MiB) slots
std::unique_ptr<Communicator> g_tiny;   // 4 KiB slots: every count above a few hundred chunks
// Hierarchical with 4 KiB slots and fake nodes of kFakeNode() ranks: at np 4
// two nodes of two, at np 3 three nodes of one (MPI only), at np 2 one node.
std::unique_ptr<Communicator> g_hier;

int fake_node(int size) { return size % 2 == 0 ? 2 : 1; }

}  // namespace

Communicator& world() { return *g_mpi; }

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Rank r's input element i under seed s: 24 random bits in [-1, 1) scaled by
// 2^e, e in [-8, 7], stored as dtype (so bf16 inputs are already rounded).
// The spread of exponents makes fp32 sums round differently in a different
// order, so the tests see the summation order.
float input(uint64_t seed, int rank, int64_t i, DType dtype) {
  const uint64_t h = mix(seed * 1000003u + static_cast<uint64_t>(rank) * 0x100000001b3ull + static_cast<uint64_t>(i));
  const double unit = static_cast<double>(h >> 40) / double(1 << 23) - 1.0;
  const float v = static_cast<float>(std::ldexp(unit, static_cast<int>(h & 15) - 8));
  return dtype == DType::kF32 ? v : from_16(float_to_16(v, dtype), dtype);
}

std::vector<float> inputs(uint64_t seed, int rank, int64_t n, DType dtype) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = input(seed, rank, i, dtype);
  return v;
}

// The sum over ranks of element i, in rank order, rounded once to dtype.
float reference_sum(uint64_t seed, int size, int64_t i, DType dtype) {
  float acc = 0;
  for (int r = 0; r < size; ++r) acc = r == 0 ? input(seed, r, i, dtype) : acc + input(seed, r, i, dtype);
  return dtype == DType::kF32 ? acc : from_16(float_to_16(acc, dtype), dtype);
}

// Mismatches of got (decoded) against want; prints the first few.
int64_t mismatches(const std::vector<float>& got, const std::function<float(int64_t)>& want, const char* what) {
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float w = want(static_cast<int64_t>(i));
    if (std::memcmp(&got[i], &w, 4) != 0 && bad++ < 3) {
      ADD_FAILURE() << what << " element " << i << ": got " << got[i] << " want " << w;
    }
  }
  return bad;
}

// ---------------------------------------------------------------------------
// Every collective, fp32 and bf16, odd counts, default and tiny slots

class ShmCollective : public ::testing::TestWithParam<std::tuple<bool, DType, int64_t>> {
 protected:
  Communicator& comm() { return std::get<0>(GetParam()) ? *g_tiny : *g_shm; }
  DType dtype() const { return std::get<1>(GetParam()); }
  int64_t count() const { return std::get<2>(GetParam()); }
};

TEST_P(ShmCollective, ReduceScatterMatchesTheRankOrderSum) {
  Communicator& c = comm();
  const DType dt = dtype();
  const int64_t n = count(), full = n * c.size();
  const uint64_t seed = 11 + static_cast<uint64_t>(n);
  const std::vector<char> send = encode(inputs(seed, c.rank(), full, dt), dt);
  std::vector<char> recv(static_cast<size_t>(n) * dtype_bytes(dt), 0x7f), again(recv.size());
  c.reduce_scatter(send.data(), recv.data(), n, dt);
  c.reduce_scatter(send.data(), again.data(), n, dt);
  const int64_t base = n * c.rank();
  EXPECT_EQ(mismatches(decode(recv.data(), n, dt),
                       [&](int64_t i) { return reference_sum(seed, c.size(), base + i, dt); }, "reduce_scatter"),
            0);
  EXPECT_EQ(std::memcmp(recv.data(), again.data(), recv.size()), 0) << "second run differs";
}

TEST_P(ShmCollective, AllReduceMatchesTheRankOrderSumInAndOutOfPlace) {
  Communicator& c = comm();
  const DType dt = dtype();
  const int64_t n = count();
  const uint64_t seed = 23 + static_cast<uint64_t>(n);
  const std::vector<char> send = encode(inputs(seed, c.rank(), n, dt), dt);
  std::vector<char> recv(send.size(), 0x7f), inplace = send;
  c.all_reduce(send.data(), recv.data(), n, dt);
  c.all_reduce(inplace.data(), inplace.data(), n, dt);
  EXPECT_EQ(mismatches(decode(recv.data(), n, dt), [&](int64_t i) { return reference_sum(seed, c.size(), i, dt); },
                       "all_reduce"),
            0);
  EXPECT_EQ(std::memcmp(recv.data(), inplace.data(), recv.size()), 0) << "in place differs from out of place";
}

TEST_P(ShmCollective, AllGatherConcatenatesInRankOrderInAndOutOfPlace) {
  Communicator& c = comm();
  const DType dt = dtype();
  const int64_t n = count(), full = n * c.size();
  const uint64_t seed = 37 + static_cast<uint64_t>(n);
  const size_t elem = dtype_bytes(dt);
  const std::vector<char> mine = encode(inputs(seed, c.rank(), n, dt), dt);
  std::vector<char> out(static_cast<size_t>(full) * elem, 0x7f), inplace(out.size(), 0x7f);
  std::memcpy(inplace.data() + static_cast<size_t>(c.rank() * n) * elem, mine.data(), mine.size());
  c.all_gather(mine.data(), out.data(), n, dt);
  c.all_gather(inplace.data() + static_cast<size_t>(c.rank() * n) * elem, inplace.data(), n, dt);
  auto want = [&](int64_t i) { return input(seed, static_cast<int>(i / n), i % n, dt); };
  EXPECT_EQ(mismatches(decode(out.data(), full, dt), want, "all_gather"), 0);
  EXPECT_EQ(mismatches(decode(inplace.data(), full, dt), want, "all_gather in place"), 0);
}

INSTANTIATE_TEST_SUITE_P(Counts, ShmCollective,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(int64_t{1}, int64_t{3}, int64_t{1001},
                                                              int64_t{65537})));

// all_to_all moves bytes: exact on the default slots, the 4 KiB slots (many
// chunks per call) and the hierarchical backend (MPI between fake nodes),
// for odd byte counts (bf16 x 3) and blocks larger than a half slot.
TEST(ShmAllToAll, SendsBlockJToRankJOnEveryShmBackend) {
  for (Communicator* c : {g_shm.get(), g_tiny.get(), g_hier.get()}) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{1001}, int64_t{300001}}) {
        const int p = c->size();
        const uint64_t seed = 91 + static_cast<uint64_t>(n);
        const std::vector<char> send = encode(inputs(seed, c->rank(), n * p, dt), dt);
        std::vector<char> recv(send.size(), 0x7f);
        c->all_to_all(send.data(), recv.data(), n, dt);
        auto want = [&](int64_t i) { return input(seed, static_cast<int>(i / n), c->rank() * n + i % n, dt); };
        EXPECT_EQ(mismatches(decode(recv.data(), n * p, dt), want, "all_to_all"), 0)
            << c->backend() << " " << dtype_name(dt) << " n=" << n;
      }
    }
    std::vector<float> none;
    c->all_to_all(none.data(), none.data(), 0, DType::kF32);  // zero counts: no communication, no error
  }
}

// all_to_all_v: rank r sends rank j (r + 2 j) % 5 elements (some pairs
// none), element i of that block being r * 1000 + j * 100 + i; on every
// shm backend and the single one's copy. Counts that disagree with the
// self block are refused with the rank.
TEST(ShmAllToAll, VariableBlocksArriveInRankOrder) {
  for (Communicator* c : {g_shm.get(), g_tiny.get(), g_hier.get()}) {
    const int p = c->size(), me = c->rank();
    auto count = [](int from, int to) { return static_cast<int64_t>((from + 2 * to) % 5); };
    std::vector<int64_t> sc(static_cast<size_t>(p)), rc(static_cast<size_t>(p));
    std::vector<float> send, want;
    for (int j = 0; j < p; ++j) {
      sc[static_cast<size_t>(j)] = count(me, j);
      rc[static_cast<size_t>(j)] = count(j, me);
      for (int64_t i = 0; i < count(me, j); ++i) send.push_back(static_cast<float>(me * 1000 + j * 100 + i));
      for (int64_t i = 0; i < count(j, me); ++i) want.push_back(static_cast<float>(j * 1000 + me * 100 + i));
    }
    std::vector<float> recv(want.size() + 1, -1.0f);
    c->all_to_all_v(send.data(), sc.data(), recv.data(), rc.data(), DType::kF32);
    recv.pop_back();
    EXPECT_EQ(recv, want) << c->backend();
    rc[static_cast<size_t>(me)] += 1;
    std::vector<float> big(want.size() + 8);
    std::string e;
    try {
      c->all_to_all_v(send.data(), sc.data(), big.data(), rc.data(), DType::kF32);
    } catch (const std::exception& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("all_to_all_v"), std::string::npos) << e;
  }
}

// Larger than a 32 MiB slot per rank (the default slot is 1 MiB), so every
// communicator chunks; all_reduce of 9 Mi + 5 fp32 elements is 36 MiB.
// split() keeps the backend: a group of the shm (and hierarchical) world is
// shm again, its sums stay inside the group, and point to point works.
TEST(ShmSplit, GroupsAreShmAndSumInsideTheGroup) {
  for (Communicator* w : {g_shm.get(), g_hier.get()}) {
    std::unique_ptr<Communicator> g = w->split(w->rank() / 2, w->rank());
    EXPECT_EQ(g->backend(), w->backend());
    const int first = w->rank() / 2 * 2, members = std::min(2, w->size() - first);
    ASSERT_EQ(g->size(), members);
    std::vector<float> v(3000, static_cast<float>(w->rank() + 1)), sum(3000);
    g->all_reduce(v.data(), sum.data(), 3000, DType::kF32);
    float want = 0;
    for (int r = first; r < first + members; ++r) want += static_cast<float>(r + 1);
    EXPECT_EQ(sum[2999], want) << w->backend();
    if (members == 2) {
      float got = -1, mine = static_cast<float>(w->rank());
      g->exchange(&mine, 1, 1 - g->rank(), &got, 1, 1 - g->rank(), DType::kF32);
      EXPECT_EQ(got, static_cast<float>(w->rank() ^ 1)) << w->backend();
    }
  }
}

TEST(ShmChunking, AllReduceLargerThanASlotMatchesTheReference) {
  Communicator& c = *g_shm;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const int64_t n = (int64_t{9} << 20) + 5;
    const uint64_t seed = 5;
    std::vector<char> buf = encode(inputs(seed, c.rank(), n, dt), dt);
    c.all_reduce(buf.data(), buf.data(), n, dt);
    EXPECT_EQ(mismatches(decode(buf.data(), n, dt), [&](int64_t i) { return reference_sum(seed, c.size(), i, dt); },
                         dt == DType::kF32 ? "all_reduce fp32" : "all_reduce bf16"),
              0);
  }
}

TEST(ShmChunking, ReduceScatterAndAllGatherLargerThanAHalfSlot) {
  Communicator& c = *g_shm;
  const DType dt = DType::kF32;
  const int64_t n = (int64_t{5} << 20) + 3;  // 20 MiB per block: many chunks
  const int64_t full = n * c.size();
  const uint64_t seed = 9;
  const std::vector<char> send = encode(inputs(seed, c.rank(), full, dt), dt);
  std::vector<char> shard(static_cast<size_t>(n) * 4);
  c.reduce_scatter(send.data(), shard.data(), n, dt);
  std::vector<char> gathered(send.size());
  c.all_gather(shard.data(), gathered.data(), n, dt);
  EXPECT_EQ(mismatches(decode(gathered.data(), full, dt),
                       [&](int64_t i) { return reference_sum(seed, c.size(), i, dt); }, "reduce_scatter+all_gather"),
            0);
}

// Back-to-back collectives of different kinds and sizes reuse the slots
// without waiting for anything but the flags; interleave them with the tiny
// communicator so the half-slot alternation crosses call boundaries.
TEST(ShmSequence, ManyMixedCollectivesStayCorrect) {
  Communicator& c = *g_tiny;
  int64_t bad = 0;
  for (int k = 0; k < 40; ++k) {
    const int64_t n = 1 + (k * 389) % 2000;
    const DType dt = k % 3 == 0 ? DType::kBF16 : DType::kF32;
    const uint64_t seed = 100 + static_cast<uint64_t>(k);
    std::vector<char> buf = encode(inputs(seed, c.rank(), n, dt), dt);
    c.all_reduce(buf.data(), buf.data(), n, dt);
    const std::vector<float> got = decode(buf.data(), n, dt);
    for (int64_t i = 0; i < n; ++i) bad += got[i] != reference_sum(seed, c.size(), i, dt);
    std::vector<char> part = encode(inputs(seed, c.rank(), 3, dt), dt);
    std::vector<char> all(part.size() * c.size());
    c.all_gather(part.data(), all.data(), 3, dt);
    const std::vector<float> g = decode(all.data(), 3 * c.size(), dt);
    for (int64_t i = 0; i < 3 * c.size(); ++i) bad += g[i] != input(seed, static_cast<int>(i / 3), i % 3, dt);
  }
  EXPECT_EQ(bad, 0);
}

TEST(ShmCollective, ZeroCountsReturnWithoutCommunicating) {
  Communicator& c = *g_shm;
  float x = 1.5f;
  c.all_reduce(&x, &x, 0, DType::kF32);
  c.reduce_scatter(&x, nullptr, 0, DType::kF32);
  c.all_gather(&x, &x, 0, DType::kBF16);
  EXPECT_EQ(x, 1.5f);
}

// Each duplicate has its own window: collectives on two streams at once,
// chunked through small slots, stay correct (comm_test_util.h).
TEST(ShmDuplicate, StreamsOnTheCommunicatorAndItsDuplicateDoNotWaitForEachOther) {
  expect_duplicate_streams_independent(*g_shm);
  expect_duplicate_streams_independent(*g_tiny);
}

TEST(Hierarchical, StreamsOnTheCommunicatorAndItsDuplicateDoNotWaitForEachOther) {
  expect_duplicate_streams_independent(*g_hier);
}

TEST(ShmCollective, DelegatedCollectivesWork) {
  Communicator& c = *g_shm;
  double v[2] = {1.0, static_cast<double>(c.rank())};
  c.all_reduce_f64(v, 2);
  double m = c.rank();
  c.all_reduce_max_f64(&m, 1);
  std::vector<float> b(5, c.rank() == 1 ? 3.25f : 0.0f);
  c.broadcast(b.data(), 5, DType::kF32, 1);
  c.barrier();
  EXPECT_EQ(v[0], c.size());
  EXPECT_EQ(v[1], c.size() * (c.size() - 1) / 2.0);
  EXPECT_EQ(m, c.size() - 1);
  for (float f : b) EXPECT_EQ(f, 3.25f);
}

// ---------------------------------------------------------------------------
// Hierarchical: shm inside fake nodes, MPI between them. The summation order
// differs from the flat path (node sums first), so sums of rounding inputs
// agree within a tolerance: fp32 |got - ref| <= 1e-6 * sum_r |x_r|; bf16
// (node sums rounded once, then pairwise bf16 sums across nodes) within
// 2^-7 * sum_r |x_r|, a few bf16 ulps. Small-integer inputs sum exactly and
// must match exactly; all_gather moves bits and must match exactly.

float tolerance(uint64_t seed, int size, int64_t i, DType dt) {
  float mag = 0;
  for (int r = 0; r < size; ++r) mag += std::fabs(input(seed, r, i, dt));
  return (dt == DType::kF32 ? 1e-6f : dt == DType::kF16 ? 1.0f / 1024 : 1.0f / 128) * mag + 1e-30f;
}

int64_t outside(const std::vector<float>& got, uint64_t seed, int size, int64_t base, DType dt, const char* what) {
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t g = base + static_cast<int64_t>(i);
    const float want = reference_sum(seed, size, g, dt);
    if (!(std::fabs(got[i] - want) <= tolerance(seed, size, g, dt)) && bad++ < 3) {
      ADD_FAILURE() << what << " element " << g << ": got " << got[i] << " want " << want;
    }
  }
  return bad;
}

class HierCollective : public ::testing::TestWithParam<std::tuple<DType, int64_t>> {};

TEST_P(HierCollective, AgreesWithTheRankOrderSumWithinTolerance) {
  Communicator& c = *g_hier;
  const auto [dt, n] = GetParam();
  const int64_t full = n * c.size();
  const size_t elem = dtype_bytes(dt);
  const uint64_t seed = 71 + static_cast<uint64_t>(n);
  const std::vector<char> send = encode(inputs(seed, c.rank(), full, dt), dt);
  std::vector<char> shard(static_cast<size_t>(n) * elem), ar(send.size()), inplace = send;
  c.reduce_scatter(send.data(), shard.data(), n, dt);
  c.all_reduce(send.data(), ar.data(), full, dt);
  c.all_reduce(inplace.data(), inplace.data(), full, dt);
  // all_gather: exact, in place and not.
  const std::vector<char> mine = encode(inputs(seed + 1, c.rank(), n, dt), dt);
  std::vector<char> gathered(send.size(), 0x7f), ag_inplace(send.size(), 0x7f);
  std::memcpy(ag_inplace.data() + static_cast<size_t>(c.rank() * n) * elem, mine.data(), mine.size());
  c.all_gather(mine.data(), gathered.data(), n, dt);
  c.all_gather(ag_inplace.data() + static_cast<size_t>(c.rank() * n) * elem, ag_inplace.data(), n, dt);
  // Small integers: exact sums, so the hierarchical result equals the flat one.
  std::vector<float> ints(static_cast<size_t>(full));
  for (int64_t i = 0; i < full; ++i) ints[i] = small_int(c.rank(), i);
  const std::vector<char> int_send = encode(ints, dt);
  std::vector<char> int_shard(shard.size()), int_flat(shard.size());
  c.reduce_scatter(int_send.data(), int_shard.data(), n, dt);
  g_shm->reduce_scatter(int_send.data(), int_flat.data(), n, dt);

  EXPECT_EQ(outside(decode(shard.data(), n, dt), seed, c.size(), n * c.rank(), dt, "reduce_scatter"), 0);
  EXPECT_EQ(outside(decode(ar.data(), full, dt), seed, c.size(), 0, dt, "all_reduce"), 0);
  EXPECT_EQ(std::memcmp(ar.data(), inplace.data(), ar.size()), 0) << "in place differs from out of place";
  auto want = [&](int64_t i) { return input(seed + 1, static_cast<int>(i / n), i % n, dt); };
  EXPECT_EQ(mismatches(decode(gathered.data(), full, dt), want, "all_gather"), 0);
  EXPECT_EQ(mismatches(decode(ag_inplace.data(), full, dt), want, "all_gather in place"), 0);
  EXPECT_EQ(std::memcmp(int_shard.data(), int_flat.data(), int_shard.size()), 0) << "exact sums differ from flat shm";
  // With one node (np 2) the order is the rank order: bit-identical to the
  // reference for fp32. (With one rank per node, np 3, the order is Open
  // MPI's, which is not the rank order for large counts.)
  if (dt == DType::kF32 && c.local_size() == c.size()) {
    EXPECT_EQ(mismatches(decode(shard.data(), n, dt),
                         [&](int64_t i) { return reference_sum(seed, c.size(), n * c.rank() + i, dt); },
                         "reduce_scatter (rank order)"),
              0);
  }
}

INSTANTIATE_TEST_SUITE_P(Counts, HierCollective,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                                            ::testing::Values(int64_t{1}, int64_t{3}, int64_t{1001},
                                                              int64_t{65537})));

TEST(Hierarchical, ReportsItsLayoutAndAutoPicksItForSeveralNodes) {
  Communicator& c = *g_hier;
  const int k = fake_node(c.size());
  EXPECT_EQ(c.backend(), "hierarchical");
  EXPECT_EQ(c.local_size(), k);
  setenv("ZINC_COMM_FAKE_NODE_SIZE", std::to_string(k).c_str(), 1);
  const std::string chosen = make_communicator("auto")->backend();
  const std::string shm_error = message_of([] { make_communicator("shm"); });
  unsetenv("ZINC_COMM_FAKE_NODE_SIZE");
  if (k == c.size()) {
    EXPECT_EQ(chosen, "shm");
  } else {
    EXPECT_EQ(chosen, "hierarchical");
    EXPECT_NE(shm_error.find("the shm backend needs every rank on one machine"), std::string::npos) << shm_error;
  }
}

// ---------------------------------------------------------------------------
// Selection and errors

TEST(MakeCommunicator, ModesAndTheEnvironmentOverride) {
  Communicator& c = *g_shm;
  EXPECT_EQ(c.backend(), "shm");
  EXPECT_EQ(c.local_size(), c.size());
  EXPECT_EQ(c.rank(), g_mpi->rank());
  EXPECT_EQ(make_communicator("mpi")->backend(), "mpi");
  // One machine, several ranks: shm.
  EXPECT_EQ(make_communicator("auto")->backend(), c.size() > 1 ? "shm" : "mpi");
  setenv("ZINC_COMM_BACKEND", "mpi", 1);
  EXPECT_EQ(make_communicator("shm")->backend(), "mpi");
  setenv("ZINC_COMM_BACKEND", "shm", 1);
  EXPECT_EQ(make_communicator("mpi")->backend(), "shm");
  // (nccl is a known backend now: nccl_test covers it.)
  setenv("ZINC_COMM_BACKEND", "gloo", 1);
  const std::string bad = message_of([] { make_communicator("auto"); });
  unsetenv("ZINC_COMM_BACKEND");
  EXPECT_NE(bad.find("unknown backend \"gloo\""), std::string::npos) << bad;
  EXPECT_NE(bad.find("expected mpi, shm, hierarchical, nccl or auto"), std::string::npos) << bad;
  EXPECT_NE(bad.find("ZINC_COMM_BACKEND"), std::string::npos) << bad;
  // Ranks that choose different backends (ZINC_COMM_BACKEND on one rank, an
  // MPMD launch of two configs) all stop with one line, before any of
  // them waits in a collective the others never issue.
  if (c.size() > 1) {
    setenv("ZINC_COMM_BACKEND", c.rank() == 0 ? "mpi" : "shm", 1);
    const std::string split = message_of([] { make_communicator("auto"); });
    unsetenv("ZINC_COMM_BACKEND");
    EXPECT_NE(split.find("rank " + std::to_string(c.rank()) + ": make_communicator: the ranks chose different "
                         "backends: this rank \"" + (c.rank() == 0 ? "mpi" : "shm") + "\" (from ZINC_COMM_BACKEND), "
                         "another rank \"" + (c.rank() == 0 ? "shm" : "mpi") + "\""),
              std::string::npos)
        << split;
  }
}

TEST(ShmErrors, InvalidArgumentsThrowTheSameErrorsAsMpiBeforeCommunicating) {
  Communicator& c = *g_shm;
  const std::string prefix = "rank " + std::to_string(c.rank()) + ": ";
  std::vector<float> buf(8 * c.size() + 8);
  const std::string neg = message_of([&] { c.all_reduce(buf.data(), buf.data(), -1, DType::kF32); });
  const std::string rs = message_of([&] { c.reduce_scatter(buf.data(), buf.data() + 1, 4, DType::kBF16); });
  const std::string ag = message_of([&] { c.all_gather(buf.data() + c.rank() * 4 + 1, buf.data(), 4, DType::kF32); });
  const std::string ar = message_of([&] { c.all_reduce(buf.data(), buf.data() + 1, 4, DType::kF32); });
  const std::string root = message_of([&] { c.broadcast(buf.data(), 4, DType::kF32, c.size()); });
  c.barrier();
  EXPECT_EQ(neg, prefix + "all_reduce: count must be >= 0, got -1");
  EXPECT_EQ(rs.rfind(prefix + "reduce_scatter: recv overlaps send", 0), 0u) << rs;
  EXPECT_EQ(ag.rfind(prefix + "all_gather: send overlaps recv but is not this rank's block", 0), 0u) << ag;
  EXPECT_EQ(ar.rfind(prefix + "all_reduce: send and recv overlap", 0), 0u) << ar;
  EXPECT_EQ(root.rfind(prefix + "broadcast: root " + std::to_string(c.size()) + " is not a rank", 0), 0u) << root;
  // The slots are still in step after the errors.
  float x = 1.0f;
  c.all_reduce(&x, &x, 1, DType::kF32);
  EXPECT_EQ(x, c.size());
}

// A rank that never joins a collective: the others give up after the timeout
// with an error naming it, instead of hanging; the rest of the job goes on.
TEST(ShmErrors, AWaitForAMissingPeerTimesOutNamingThePeer) {
  Communicator& c = *g_shm;
  if (c.size() < 2) GTEST_SKIP();
  // 2 s, not less: the same limit holds the MPI calls that set the
  // communicator up (Note [MPI collectives: the time limit]), where ranks
  // on a loaded machine may arrive a second apart.
  setenv("ZINC_COMM_TIMEOUT", "2", 1);
  std::unique_ptr<Communicator> shm = make_communicator("shm");
  unsetenv("ZINC_COMM_TIMEOUT");
  // Called directly (the waiting thread sleeps) and through a CommStream
  // with the caller blocked on it (the communication thread polls).
  std::string err, err_stream;
  if (c.rank() == 0) {
    float x = 1.0f;
    err = message_of([&] { shm->all_reduce(&x, &x, 1, DType::kF32); });
    CommStream stream(*shm);
    std::vector<float> in(static_cast<size_t>(c.size()), 1.0f);
    float out = 0;
    err_stream = message_of([&] {
      stream.submit([&](Communicator& s) { s.reduce_scatter(in.data(), &out, 1, DType::kF32); }).wait();
    });
  }
  // Rank 1 keeps its communicator open until rank 0 is done: a rank that
  // closed it ends the others' waits at once (the next test).
  c.barrier();
  shm.reset();  // every rank: the destructor waits for all to close theirs
  if (c.rank() == 0) {
    EXPECT_EQ(err.rfind("rank 0: all_reduce: waited", 0), 0u) << err;
    EXPECT_NE(err.find("for local rank 1 (rank 1)"), std::string::npos) << err;
    EXPECT_NE(err.find("ZINC_COMM_TIMEOUT"), std::string::npos) << err;
    EXPECT_NE(err_stream.find("rank 0: reduce_scatter: waited"), std::string::npos) << err_stream;
  }
  // Bad timeouts are refused before any communication, on every rank.
  setenv("ZINC_COMM_TIMEOUT", "soon", 1);
  const std::string bad_env = message_of([] { make_communicator("shm"); });
  unsetenv("ZINC_COMM_TIMEOUT");
  EXPECT_NE(bad_env.find("ZINC_COMM_TIMEOUT=\"soon\" is not a positive number of seconds"), std::string::npos)
      << bad_env;
  const std::string bad_arg = message_of([] { make_communicator("shm", 0.0); });
  EXPECT_NE(bad_arg.find("timeout must be a positive number of seconds"), std::string::npos) << bad_arg;
}

// A rank whose error unwinds past a communicator while the others wait in
// a collective it left: its destructor does not wait for them in a barrier,
// which held its error until the others timed out (zinc-train's ranks sat
// there for comm.timeout_seconds before the error could end the job); the
// others' wait still times out naming it, and unwinds the same way.
TEST(ShmErrors, ARankUnwindingAnErrorDoesNotWaitForTheOthers) {
  Communicator& c = *g_shm;
  if (c.size() < 2) GTEST_SKIP();
  setenv("ZINC_COMM_TIMEOUT", "3", 1);
  std::unique_ptr<Communicator> shm = make_communicator("shm");
  unsetenv("ZINC_COMM_TIMEOUT");
  double unwound_s = -1;
  std::string err;
  if (c.rank() == 1) {
    const auto t0 = std::chrono::steady_clock::now();
    err = message_of([&] {
      std::unique_ptr<Communicator> mine = std::move(shm);
      throw CommError("a failure on rank 1 alone");
    });
    unwound_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else {
    err = message_of([&] {
      std::unique_ptr<Communicator> mine = std::move(shm);
      float x = 1.0f;
      mine->all_reduce(&x, &x, 1, DType::kF32);
    });
  }
  c.barrier();
  if (c.rank() == 1) {
    EXPECT_EQ(err, "a failure on rank 1 alone");
    EXPECT_LT(unwound_s, 1.0) << "the failing rank waited in its communicator's destructor";
  } else {  // rank 1 left: seen at once, not after the timeout
    EXPECT_NE(err.find("all_reduce: local rank 1 (rank 1) has closed its communicator"), std::string::npos) << err;
  }
}

// A rank that closes its communicator (a Python script that caught an error
// on one rank and ends) while the others wait in a collective: they stop at
// once with an error naming it, in every kind of collective, the f64
// reductions, broadcast and barrier included (they went to MPI, which waited
// without a limit), and then close theirs too, without waiting.
TEST(ShmErrors, ARankThatClosedItsCommunicatorEndsTheOthersWaitsAtOnce) {
  Communicator& c = *g_shm;
  if (c.size() < 2) GTEST_SKIP();
  std::unique_ptr<Communicator> shm = make_communicator("shm", 600.0);
  std::vector<std::string> errs;
  const auto t0 = std::chrono::steady_clock::now();
  if (c.rank() == c.size() - 1) {
    shm.reset();  // closed without a collective: no error here
  } else {
    double v = 1;
    std::vector<float> b(7, 1.0f);
    float x = 1.0f;
    errs.push_back(message_of([&] { shm->all_reduce_f64(&v, 1); }));
    errs.push_back(message_of([&] { shm->all_reduce_max_f64(&v, 1); }));
    errs.push_back(message_of([&] { shm->broadcast(b.data(), 7, DType::kF32, 0); }));
    errs.push_back(message_of([&] { shm->barrier(); }));
    errs.push_back(message_of([&] { shm->all_reduce(&x, &x, 1, DType::kF32); }));
    shm.reset();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  c.barrier();
  EXPECT_LT(took, 30.0) << "a wait for the rank that left lasted toward the 600 s timeout";
  const std::string last = std::to_string(c.size() - 1);
  const char* ops[] = {"all_reduce_f64", "all_reduce_max_f64", "broadcast", "barrier", "all_reduce"};
  for (size_t i = 0; i < errs.size(); ++i)
    EXPECT_NE(errs[i].find(std::string(ops[i]) + ": local rank " + last + " (rank " + last +
                           ") has closed its communicator"),
              std::string::npos)
        << errs[i];
}

// f64 sums in rank order, maxima, and broadcasts of any dtype from any root,
// over chunks (4 KiB slots: 256 doubles a chunk) and on the hierarchical
// backend (MPI between its fake nodes).
TEST(ShmCollective, F64ReductionsAndBroadcastsOverManyChunks) {
  for (Communicator* cp : {g_shm.get(), g_tiny.get(), g_hier.get()}) {
    Communicator& c = *cp;
    const int64_t n = 1001;
    std::vector<double> sum(static_cast<size_t>(n)), mx(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      sum[i] = static_cast<double>(input(7, c.rank(), i, DType::kF32)) * 1e-3;
      mx[i] = -static_cast<double>((i * 7 + c.rank() * 13) % 101);
    }
    c.all_reduce_f64(sum.data(), n);
    c.all_reduce_max_f64(mx.data(), n);
    const int root = c.size() - 1;
    std::vector<uint16_t> b(3001);
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(c.rank() == root ? i * 31 + 5 : 0);
    c.broadcast(b.data(), static_cast<int64_t>(b.size()), DType::kBF16, root);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      double want = 0, want_max = -1e300;
      for (int r = 0; r < c.size(); ++r) {
        want += static_cast<double>(input(7, r, i, DType::kF32)) * 1e-3;
        want_max = std::max(want_max, -static_cast<double>((i * 7 + r * 13) % 101));
      }
      // Rank order on one machine (bit for bit); hierarchical: MPI's order across its nodes.
      const double tol = c.backend() == "hierarchical" ? 1e-15 * c.size() : 0.0;
      if ((std::fabs(sum[i] - want) > tol || mx[i] != want_max) && bad++ < 3)
        ADD_FAILURE() << c.backend() << " element " << i << ": sum " << sum[i] << " want " << want << ", max "
                      << mx[i] << " want " << want_max;
    }
    for (size_t i = 0; i < b.size(); ++i)
      if (b[i] != static_cast<uint16_t>(i * 31 + 5) && bad++ < 6) ADD_FAILURE() << "broadcast element " << i;
    EXPECT_EQ(bad, 0) << c.backend();
  }
}

}  // namespace
}  // namespace zinc::comm::testing

int main(int argc, char** argv) {
  namespace zt = zinc::comm::testing;
  ::testing::InitGoogleTest(&argc, argv);
  unsetenv("ZINC_COMM_BACKEND");
  zt::g_mpi = zinc::comm::make_mpi_communicator();
  zt::g_shm = zinc::comm::make_communicator("shm");
  zt::g_tiny = zinc::comm::detail::make_shm_communicator(4096);
  zt::g_hier = zinc::comm::detail::make_hierarchical_communicator(4096, zt::fake_node(zt::g_mpi->size()));
  const int rc = zt::run_all_tests_on_every_rank(*zt::g_mpi);
  zt::g_hier.reset();
  zt::g_tiny.reset();
  zt::g_shm.reset();
  zt::g_mpi.reset();  // the last communicator: finalises MPI
  return rc;
}
