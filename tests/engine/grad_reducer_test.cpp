// GradReducer on its own, across ranks (part of engine_multirank_test, run
// under mpirun -np 2 and -np 4 over MPI, shared memory and hierarchical):
// every stage's buckets land the sum over ranks in each rank's shard, no-sync
// micro-steps do not communicate, bf16 on the wire, and stage 2 frees each
// full gradient once its reduction has run. The gradients are small integers,
// so every sum is exact in fp32 and in bf16 and the checks are equalities.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "engine/grad_reducer.h"
#include "engine/shard.h"

namespace zinc {

extern std::shared_ptr<comm::Communicator> g_world;

namespace {

// Three blocks of awkward sizes (padded to world x 1024 elements each).
const int64_t kNumel[] = {3000, 1, 5000};

float local_grad(int rank, int block, int64_t i) { return static_cast<float>(4 * (rank + 1) + (i % 7) + block); }
float summed_grad(int world, int block, int64_t i) {
  float s = 0;
  for (int r = 0; r < world; ++r) s += local_grad(r, block, i);
  return s;
}

struct Fixture {
  StagePlan plan;
  std::vector<BlockShard> blocks;
  std::unique_ptr<comm::CommStream> stream;
  StateMemory memory;
  std::unique_ptr<GradReducer> reducer;

  Fixture(int stage, const GradReducer::Options& o) {
    const int world = g_world->size(), rank = g_world->rank();
    plan = StagePlan::make(stage, world);
    blocks.resize(3);
    for (int b = 0; b < 3; ++b) blocks[b].part = Partition::make(kNumel[b], world, rank);
    if (world > 1) stream = std::make_unique<comm::CommStream>(*g_world);
    reducer = std::make_unique<GradReducer>(plan, blocks, stream.get(), memory, o);
  }
  ~Fixture() {
    if (stream) stream->synchronize();
  }
  // One backward: the model's order (last block first), `times` adds of the
  // local gradient.
  void backward(bool boundary) {
    reducer->begin_backward(boundary);
    for (int b = 2; b >= 0; --b) {
      float* g = reducer->grads(b);
      for (int64_t i = 0; i < kNumel[b]; ++i) g[i] += local_grad(g_world->rank(), b, i);
      blocks[b].grads_reported = true;
      reducer->ready(b);
    }
    reducer->end_backward();
  }
  // The own shard holds `times` x the sum over ranks (padding: zero).
  void expect_reduced(int times, const std::string& what) {
    for (int b = 0; b < 3; ++b) {
      BlockShard& s = blocks[b];
      const float* shard = reducer->reduced_shard(s);
      int bad = 0;
      for (int64_t j = 0; j < s.part.shard_numel; ++j) {
        const int64_t i = s.part.own_offset() + j;
        const float want = i < kNumel[b] ? static_cast<float>(times) * summed_grad(g_world->size(), b, i) : 0.0f;
        if (shard[j] != want && bad++ < 3)
          ADD_FAILURE() << what << ": block " << b << " element " << i << ": " << shard[j] << " != " << want;
      }
    }
  }
};

std::string name(int stage, const GradReducer::Options& o) {
  return "stage " + std::to_string(stage) + " bucket " + std::to_string(o.bucket_numel) +
         (o.overlap ? " overlap" : "") + (is_16bit(o.wire) ? " " + std::string(dtype_name(o.wire)) + " wire" : "");
}

TEST(GradReducer, EveryStageReducesEveryBlockIntoItsShard) {
  for (int stage : {0, 1, 2})
    for (int64_t bucket : {int64_t{1}, int64_t{1} << 30})
      for (bool overlap : {false, true})
        for (DType wire : {DType::kF32, DType::kBF16, DType::kF16}) {
          GradReducer::Options o{bucket, overlap, wire, {}, true, {}};
          Fixture f(stage, o);
          f.backward(true);
          f.reducer->wait_all();
          for (const BlockShard& s : f.blocks)
            EXPECT_TRUE(s.grad_state == GradState::kReduced || s.grad_state == GradState::kFreed) << name(stage, o);
          f.expect_reduced(1, name(stage, o));
          // One bucket per block, or one for all three.
          EXPECT_EQ(f.reducer->buckets_submitted(), bucket == 1 ? 3 : 1) << name(stage, o);
          if (stage == 0) {  // the all-gather put the sum back into the full gradient
            for (int b = 0; b < 3; ++b)
              for (int64_t i = 0; i < kNumel[b]; ++i)
                ASSERT_EQ(f.blocks[b].grad.as<float>()[i], summed_grad(g_world->size(), b, i)) << name(stage, o);
          }
          f.reducer->reset_after_step();
          for (const BlockShard& s : f.blocks) {
            if (stage == 2) {
              EXPECT_EQ(s.grad_state, GradState::kFreed) << name(stage, o);
              EXPECT_TRUE(s.grad.empty()) << name(stage, o);
            } else {
              EXPECT_EQ(s.grad_state, GradState::kAccumulating) << name(stage, o);
              for (int64_t i = 0; i < s.part.padded_numel; ++i) ASSERT_EQ(s.grad.as<float>()[i], 0.0f);
            }
          }
        }
}

TEST(GradReducer, NoSyncMicroStepsAccumulateWithoutCommunicating) {
  for (int stage : {0, 1, 2}) {
    GradReducer::Options o{1, true, DType::kF32, {}, true, {}};
    Fixture f(stage, o);
    f.backward(false);  // inside an accumulation: local sums only
    EXPECT_EQ(f.reducer->buckets_submitted(), 0) << "stage " << stage;
    for (int b = 0; b < 3; ++b) {
      EXPECT_EQ(f.blocks[b].grad_state, GradState::kAccumulating);
      for (int64_t i = 0; i < kNumel[b]; ++i)
        ASSERT_EQ(f.blocks[b].grad.as<float>()[i], local_grad(g_world->rank(), b, i)) << "stage " << stage;
    }
    f.backward(true);  // the boundary reduces both micro-steps' sum
    f.reducer->wait_all();
    f.expect_reduced(2, "no-sync stage " + std::to_string(stage));
    f.reducer->reset_after_step();
  }
}

TEST(GradReducer, Stage2FreesEachFullGradientOnceReduced) {
  GradReducer::Options o{1, false, DType::kF32, {}, true, {}};  // backward waits for each bucket
  Fixture f(2, o);
  const int64_t base = f.memory.bytes();
  for (const BlockShard& s : f.blocks)
    EXPECT_EQ(s.grad_state, g_world->size() > 1 ? GradState::kFreed : GradState::kAccumulating);
  f.backward(true);
  if (g_world->size() > 1) {
    // Without overlap every bucket was waited for, so every full gradient
    // is already gone; the peak held them while backward ran.
    for (const BlockShard& s : f.blocks) EXPECT_EQ(s.grad_state, GradState::kFreed);
    EXPECT_EQ(f.memory.bytes(), base);
    EXPECT_GT(f.memory.peak_bytes(), base);
  }
  f.reducer->wait_all();
  f.expect_reduced(1, "stage 2");
  f.reducer->reset_after_step();
  EXPECT_EQ(f.memory.bytes(), base);
}

// Note [gradients written, not zeroed] (engine/model.h): a block's marked
// parameter is handed out fresh once per window, kept (not zeroed) by
// reset_after_step, and zeroed by the reducer where a backward reports the
// block without asking for its gradients.
TEST(GradReducer, MarkedParametersAreWrittenNotZeroed) {
  const int world = g_world->size(), rank = g_world->rank();
  // Block 0: a marked weight of 1000 elements, an unmarked bias of 7 (after
  // an alignment gap), and the padding; block 1: the marked weight alone.
  BlockSpec spec0{"b0", {{"w", {10, 100}, Init::kNormal, 0.02f, true}, {"bias", {7}}}};
  BlockSpec spec1{"b1", {{"w", {3, 11}, Init::kNormal, 0.02f, true}}};
  for (int stage : {0, 1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    StagePlan plan = StagePlan::make(stage, world);
    std::vector<BlockShard> blocks(2);
    blocks[0].layout = BlockLayout::from_spec(spec0);
    blocks[1].layout = BlockLayout::from_spec(spec1);
    for (BlockShard& b : blocks) b.part = Partition::make(b.layout.numel, world, rank);
    std::unique_ptr<comm::CommStream> stream;
    if (world > 1) stream = std::make_unique<comm::CommStream>(*g_world);
    StateMemory memory;
    GradReducer r(plan, blocks, stream.get(), memory, GradReducer::Options{1, false, DType::kF32, {}, true, {}});
    const BlockLayout& l0 = blocks[0].layout;
    // One micro-step of a model: the weight written when fresh (else added
    // to), the bias added to; block 1 asked for only when `touch1`.
    auto backward = [&](bool boundary, bool touch1, float value) {
      r.begin_backward(boundary);
      for (int b : {1, 0}) {
        if (b == 0 || touch1) {
          float* g = r.grads(b);
          const bool fresh = r.take_fresh(b);
          const int64_t n = blocks[static_cast<size_t>(b)].layout.numels[0];
          for (int64_t i = 0; i < n; ++i) g[i] = fresh ? value : g[i] + value;
          if (b == 0)
            for (int64_t i = 0; i < l0.numels[1]; ++i) g[l0.offsets[1] + i] += value;
        }
        blocks[static_cast<size_t>(b)].grads_reported = true;
        r.ready(b);
      }
      r.end_backward();
    };
    // The sum over ranks of one element, every element of the parameters
    // taking `per_rank` on each rank; gaps and padding zero.
    auto expect = [&](int b, float w, float bias, const std::string& what) {
      BlockShard& s = blocks[static_cast<size_t>(b)];
      const float* shard = r.reduced_shard(s);
      const BlockLayout& l = s.layout;
      for (int64_t j = 0; j < s.part.shard_numel; ++j) {
        const int64_t i = s.part.own_offset() + j;
        float want = 0.0f;
        if (i < l.numels[0]) want = w * static_cast<float>(world);
        else if (l.offsets.size() > 1 && i >= l.offsets[1] && i < l.offsets[1] + l.numels[1])
          want = bias * static_cast<float>(world);
        ASSERT_EQ(shard[j], want) << what << ": block " << b << " element " << i;
      }
    };
    backward(true, true, 1.0f);
    r.wait_all();
    expect(0, 1.0f, 1.0f, "step 1");
    expect(1, 1.0f, 0.0f, "step 1");
    r.reset_after_step();
    if (stage != 2) {  // kept: the weight's old sum stays, the rest is zero
      const float* g = blocks[0].grad.as<float>();
      EXPECT_NE(g[0], 0.0f);
      for (int64_t i = l0.numels[0]; i < blocks[0].part.padded_numel; ++i) ASSERT_EQ(g[i], 0.0f) << i;
    }
    // Two micro-steps: the first writes, the second adds; block 1 is
    // reported without a product into it, so it holds zeros, not step 1's.
    backward(false, false, 2.0f);
    backward(true, false, 3.0f);
    r.wait_all();
    expect(0, 5.0f, 5.0f, "step 2");
    expect(1, 0.0f, 0.0f, "step 2");
    r.reset_after_step();
    if (stream) stream->synchronize();
  }
}

}  // namespace
}  // namespace zinc
