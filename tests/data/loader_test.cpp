// Tests for data/: the data-parallel loader (Note [data order] in
// data/data.cpp): how ranks split each global batch, epochs, resuming.
#include "data/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "core/error.h"

namespace zinc {
namespace {

// A source whose sample i is (T=1) inputs {i}, targets {i}: the loader tests
// read back which indices it chose.
class IndexSource final : public DataSource {
 public:
  explicit IndexSource(int64_t n) : n_(n) {}
  std::string describe() const override { return "index(" + std::to_string(n_) + ")"; }
  int64_t vocab_size() const override { return 1; }
  int64_t seq_len() const override { return 1; }
  int64_t num_samples() const override { return n_; }
  void sample(int64_t index, int32_t* inputs, int32_t* targets) const override {
    EXPECT_GE(index, 0);
    EXPECT_LT(index, n_);
    // The index split into 31-bit halves (sources may hold 2^40 samples).
    inputs[0] = static_cast<int32_t>(index & 0x7fffffff);
    targets[0] = static_cast<int32_t>(index >> 31);
  }

 private:
  int64_t n_;
};

int64_t index_of(const Batch& b, int64_t i) {
  return static_cast<int64_t>(b.inputs[i]) | static_cast<int64_t>(b.targets[i]) << 31;
}

// The indices a loader hands out in `steps` calls of next().
std::vector<int64_t> take(DataLoader& loader, int64_t steps) {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < steps; ++s) {
    Batch b = loader.next();
    EXPECT_EQ(b.B, loader.micro_batch());
    EXPECT_EQ(static_cast<int64_t>(b.inputs.size()), b.B * b.T);
    for (int64_t i = 0; i < b.B; ++i) out.push_back(index_of(b, i));
  }
  return out;
}

// ---------------------------------------------------------------------------
// DataLoader.

// Global batches seen by one rank-0 loader holding the whole batch.
std::vector<int64_t> single_rank_stream(std::shared_ptr<const DataSource> src, int64_t G,
                                        int64_t global_batches, uint64_t seed) {
  DataLoader l(std::move(src), G, 1, 1, 0, seed);
  return take(l, global_batches);
}

void expect_ranks_partition_global_batches(int W) {
  // N = 37 is not a multiple of G = 24: global batches straddle epochs.
  auto src = std::make_shared<IndexSource>(37);
  const int64_t micro = 3, gas = 8 / W, G = micro * gas * W, batches = 5;
  std::vector<int64_t> ref = single_rank_stream(src, G, batches, 11);
  std::vector<std::vector<int64_t>> per_rank;
  for (int r = 0; r < W; ++r) {
    DataLoader l(src, micro, gas, W, r, 11);
    per_rank.push_back(take(l, gas * batches));
  }
  for (int64_t g = 0; g < batches; ++g) {
    // Rank r's slice of global batch g is ref[g*G + r*G/W, ...), in order.
    std::vector<int64_t> joined;
    for (int r = 0; r < W; ++r) {
      auto begin = per_rank[r].begin() + g * (G / W);
      joined.insert(joined.end(), begin, begin + G / W);
    }
    EXPECT_EQ(joined, std::vector<int64_t>(ref.begin() + g * G, ref.begin() + (g + 1) * G))
        << "global batch " << g;
  }
}

TEST(DataLoader, TwoRanksSplitEachGlobalBatchExactly) { expect_ranks_partition_global_batches(2); }
TEST(DataLoader, FourRanksSplitEachGlobalBatchExactly) { expect_ranks_partition_global_batches(4); }

TEST(DataLoader, RanksReadDisjointSamplesWithinAnEpoch) {
  auto src = std::make_shared<IndexSource>(64);
  std::set<int64_t> seen;
  for (int r = 0; r < 4; ++r) {
    DataLoader l(src, 2, 2, 4, r, 5);
    for (int64_t i : take(l, 8)) EXPECT_TRUE(seen.insert(i).second) << "rank " << r << " index " << i;
  }
  EXPECT_EQ(seen.size(), 64u);  // 8 steps x gas 2 = 4 global batches of 16 = one epoch
}

TEST(DataLoader, GradAccumEqualsOneLargerMicroBatch) {
  auto src = std::make_shared<IndexSource>(50);
  DataLoader accum(src, 2, 4, 1, 0, 3);
  DataLoader big(src, 8, 1, 1, 0, 3);
  for (int g = 0; g < 20; ++g) {
    EXPECT_EQ(take(accum, 4), take(big, 1)) << "global batch " << g;
    EXPECT_EQ(accum.position(), big.position());
  }
}

TEST(DataLoader, ReshufflesEveryEpochAndSeesEachSampleOnce) {
  const int64_t N = 100;
  auto src = std::make_shared<IndexSource>(N);
  DataLoader l(src, 10, 1, 1, 0, 42);
  std::vector<int64_t> e0 = take(l, 10);
  EXPECT_EQ(l.epoch(), 0);
  std::vector<int64_t> e1 = take(l, 10);
  EXPECT_EQ(l.epoch(), 1);
  EXPECT_NE(e0, e1);
  std::vector<int64_t> identity(N);
  for (int64_t i = 0; i < N; ++i) identity[i] = i;
  EXPECT_NE(e0, identity);  // actually shuffled
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e0, identity);
  EXPECT_EQ(e1, identity);
}

TEST(DataLoader, ShuffleSeedChangesTheOrder) {
  auto src = std::make_shared<IndexSource>(100);
  DataLoader a(src, 10, 1, 1, 0, 1), b(src, 10, 1, 1, 0, 2);
  EXPECT_NE(take(a, 10), take(b, 10));
}

TEST(DataLoader, SourceSmallerThanGlobalBatchWrapsEpochs) {
  const int64_t N = 3;
  auto src = std::make_shared<IndexSource>(N);
  DataLoader l(src, 4, 2, 1, 0, 9);  // G = 8 > N
  std::vector<int64_t> got = take(l, 6);  // 24 positions = 8 epochs
  for (int64_t e = 0; e < 8; ++e) {
    std::vector<int64_t> ep(got.begin() + e * N, got.begin() + (e + 1) * N);
    std::sort(ep.begin(), ep.end());
    EXPECT_EQ(ep, (std::vector<int64_t>{0, 1, 2})) << "epoch " << e;
  }
}

TEST(DataLoader, SetPositionResumesTheSameStream) {
  auto src = std::make_shared<IndexSource>(37);
  for (int r = 0; r < 2; ++r) {
    DataLoader a(src, 3, 2, 2, r, 77);
    take(a, 7);  // mid global batch, crossing an epoch
    const int64_t pos = a.position();
    EXPECT_EQ(pos, 7 * 3 * 2);
    std::vector<int64_t> expected = take(a, 9);
    DataLoader b(src, 3, 2, 2, r, 77);
    take(b, 2);  // a different epoch loaded before the jump
    b.set_position(pos);
    EXPECT_EQ(take(b, 9), expected) << "rank " << r;
    EXPECT_EQ(b.position(), a.position());
  }
}

TEST(DataLoader, SetPositionAtStepBoundaryWorksAcrossLayouts) {
  // Saved by a one-rank run with G = 12 after 3 steps; resumed by 2 ranks
  // with micro 2 x gas 3: the next global batch is the same 12 samples.
  auto src = std::make_shared<IndexSource>(37);
  DataLoader ref(src, 12, 1, 1, 0, 5);
  take(ref, 3);
  const int64_t pos = ref.position();
  std::vector<int64_t> expected = take(ref, 1);
  std::vector<int64_t> joined;
  for (int r = 0; r < 2; ++r) {
    DataLoader l(src, 2, 3, 2, r, 5);
    l.set_position(pos);
    std::vector<int64_t> part = take(l, 3);
    joined.insert(joined.end(), part.begin(), part.end());
  }
  EXPECT_EQ(joined, expected);
}

TEST(DataLoader, SetPositionOffMicroBatchBoundaryThrows) {
  auto src = std::make_shared<IndexSource>(37);
  DataLoader l(src, 3, 2, 2, 0, 1);
  EXPECT_THROW(l.set_position(5), Error);
  EXPECT_THROW(l.set_position(-6), Error);
}

// Epochs too large to materialise use a lazy bijection: positions still map
// to distinct in-range samples, differently per epoch and per seed.
TEST(DataLoader, HugeEpochUsesALazyPermutation) {
  for (int64_t N : {int64_t{1} << 40, (int64_t{1} << 30) + 7}) {
    auto src = std::make_shared<IndexSource>(N);
    DataLoader a(src, 1000, 1, 1, 0, 1), b(src, 1000, 1, 1, 0, 2);
    std::vector<int64_t> xa = take(a, 20), xb = take(b, 20);
    std::set<int64_t> distinct(xa.begin(), xa.end());
    EXPECT_EQ(distinct.size(), xa.size());
    for (int64_t i : xa) {
      EXPECT_GE(i, 0);
      EXPECT_LT(i, N);
    }
    EXPECT_NE(xa, xb);
    // Epoch 1 starts at position N and orders differently from epoch 0.
    DataLoader c(src, 1, 1, 1, 0, 1);
    c.set_position(N);
    std::vector<int64_t> xc = take(c, 100);
    EXPECT_EQ(c.epoch(), 1);
    EXPECT_NE(std::vector<int64_t>(xa.begin(), xa.begin() + 100), xc);
  }
}

TEST(DataLoader, ServesSyntheticBatches) {
  std::shared_ptr<const DataSource> src = make_data_source(synthetic_cfg(16, 8, 0.8, 1));
  DataLoader l(src, 4, 1, 1, 0, 0);
  Batch b = l.next();
  EXPECT_EQ(b.B, 4);
  EXPECT_EQ(b.T, 8);
  ASSERT_EQ(b.inputs.size(), 32u);
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t t = 0; t + 1 < 8; ++t) EXPECT_EQ(b.targets[i * 8 + t], b.inputs[i * 8 + t + 1]);
  EXPECT_EQ(l.position(), 4);
}

}  // namespace
}  // namespace zinc
