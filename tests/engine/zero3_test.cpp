// ZeRO-3 across ranks (part of engine_multirank_test, run under mpirun -np 2
// and -np 4 over MPI, shared memory and hierarchical): stage 3 computes
// exactly what stage 2 computes, with every optimizer offload and the
// parameter shards in RAM, page-locked (offload_param cpu) or on NVMe, in fp32 and
// bf16, with overlap and with no-sync accumulation; persistent blocks stay
// gathered; prefetching runs ahead within the live-element bound; a change
// of acquire order warns once and still trains correctly; and ranks that
// acquire different blocks fail on every rank with the block named.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"
#include "engine/engine.h"
#include "tests/engine/train_util.h"

namespace zinc {

extern std::shared_ptr<comm::Communicator> g_world;

namespace {

using testing_train::RunSpec;
using testing_train::train;

// Stage 3 keys that make every mechanism work on the tiny models: the
// final norm (24 elements) persists, the embeddings and layers do not; a
// block is freed on release; one block is prefetched ahead.
nlohmann::json stage3_keys(int64_t prefetch = 1, int64_t max_live = 1000000000) {
  return {{"stage3_param_persistence_threshold", 100},
          {"stage3_prefetch_bucket_size", prefetch},
          {"stage3_max_reuse_distance", 0},
          {"stage3_max_live_parameters", max_live}};
}

// The tiny GPT, with one extra acquire and release of `block` at the start
// of the forwards for which `when(forward number, rank)` holds: the acquire
// order changes and the arithmetic does not.
class ExtraAcquire final : public Model {
 public:
  ExtraAcquire(std::function<bool(int, int)> when, int block)
      : inner_(testing_models::tiny_gpt()), when_(std::move(when)), block_(block) {}
  std::string name() const override { return "gpt+extra-acquire"; }
  const std::vector<BlockSpec>& blocks() const override { return inner_->blocks(); }
  float forward(StepContext& ctx, const Batch& batch) override {
    if (when_(forwards_++, g_world->rank())) HeldParams p = ctx.acquire(block_);
    return inner_->forward(ctx, batch);
  }
  void backward(StepContext& ctx, float scale) override { inner_->backward(ctx, scale); }

 private:
  std::shared_ptr<Model> inner_;
  std::function<bool(int, int)> when_;
  int block_;
  int forwards_ = 0;
};

TEST(Zero3, BitIdenticalToStage2InFp32AndBf16WithAndWithoutOverlap) {
  for (const char* kind : {"gpt", "mlp"})
    for (bool bf16 : {false, true})
      for (bool overlap : {false, true}) {
        RunSpec r;
        r.model = kind;
        r.bf16 = bf16;
        r.overlap = overlap;
        r.bucket = 3000;
        r.steps = 8;
        r.stage = 2;
        const std::vector<float> stage2 = train(r, g_world);
        r.stage = 3;
        r.zero_extra = stage3_keys(3000);
        ParamGatherStats st;
        r.inspect = [&st](Engine& e) { st = e.param_gather_stats(); };
        EXPECT_EQ(train(r, g_world), stage2) << kind << " bf16 " << bf16 << " overlap " << overlap;
        EXPECT_GT(st.gathers, 0);
        EXPECT_GT(st.trace_length, 0);
        EXPECT_EQ(st.departures, 0);
      }
}

TEST(Zero3, BitIdenticalToStage2WithEveryOptimizerAndParameterOffload) {
  for (const char* device : {"none", "cpu", "nvme"}) {
    RunSpec r;
    r.bf16 = true;
    r.overlap = true;
    r.steps = 6;
    r.offload = device;
    r.stage = 2;
    const std::vector<float> stage2 = train(r, g_world);
    r.stage = 3;
    for (const char* param : {"none", "cpu", "nvme"}) {
      r.zero_extra = stage3_keys(2048 * g_world->size());  // read and gather one block ahead
      r.zero_extra["offload_param"] = {{"device", param}, {"pin_memory", true}, {"nvme_path", ::testing::TempDir()}};
      EXPECT_EQ(train(r, g_world), stage2) << "offload_optimizer " << device << ", offload_param " << param;
    }
  }
}

TEST(Zero3, NoSyncAccumulationEqualsStage2) {
  RunSpec r;
  r.gas = 2;
  r.overlap = true;
  r.steps = 6;
  r.stage = 2;
  const std::vector<float> stage2 = train(r, g_world);
  r.stage = 3;
  r.zero_extra = stage3_keys();
  EXPECT_EQ(train(r, g_world), stage2);
}

TEST(Zero3, SmallBlocksPersistAndLargerOnesAreGatheredForEachUse) {
  // The GPT's forward acquires the embeddings, each layer, the final norm
  // and the (tied) embeddings again; its backward the embeddings, the norm
  // and the layers. Persisting the norm saves its two gathers per pass;
  // persisting everything leaves one gather per block and step.
  std::vector<int64_t> gathers;
  std::vector<std::vector<float>> weights;
  // Last: every block is small enough, but the model-wide limit of 300
  // elements keeps the embeddings (264) and the norm (24), in block order.
  for (int64_t threshold : {int64_t{0}, int64_t{100}, int64_t{1} << 40, int64_t{1} << 40}) {
    RunSpec r;
    r.stage = 3;
    r.steps = 4;
    r.zero_extra = stage3_keys(1);
    r.zero_extra["stage3_param_persistence_threshold"] = threshold;
    if (gathers.size() == 3) r.zero_extra["stage3_model_persistence_threshold"] = 300;
    ParamGatherStats st;
    r.inspect = [&st](Engine& e) { st = e.param_gather_stats(); };
    weights.push_back(train(r, g_world));
    gathers.push_back(st.gathers);
  }
  // Four steps of one pass each. A persistent block is gathered at the
  // start and again after each step; a gathered-per-use one twice per pass.
  const int64_t nblocks = 4, steps = 4;  // embeddings, 2 layers, norm
  EXPECT_EQ(gathers[0] - gathers[1], 2 * steps - (1 + steps)) << "the norm persisting";
  EXPECT_EQ(gathers[2], nblocks * (1 + steps)) << "everything persisting";
  EXPECT_EQ(gathers[3], 2 * 2 * steps + 2 * (1 + steps)) << "two layers gathered per use, two blocks persisting";
  for (size_t i = 1; i < weights.size(); ++i) EXPECT_EQ(weights[i], weights[0]) << i;
}

TEST(Zero3, PrefetchRunsAheadAndLiveElementsStayWithinTheLimitPlusOneBlock) {
  // Blocks pad to 1024 elements per rank. Room for three blocks at once.
  const int64_t block = 1024 * g_world->size();
  for (int64_t prefetch : {block, 2 * block}) {
    RunSpec r;
    r.stage = 3;
    r.steps = 5;
    r.zero_extra = stage3_keys(prefetch, 3 * block);
    ParamGatherStats st;
    r.inspect = [&st](Engine& e) { st = e.param_gather_stats(); };
    RunSpec ref = r;
    ref.stage = 2;
    EXPECT_EQ(train(r, g_world), train(ref, g_world)) << "prefetch " << prefetch;
    EXPECT_GT(st.prefetched, 0) << "gathers started before the acquires that needed them";
    EXPECT_LE(st.peak_live_numel, 3 * block + block) << "prefetch " << prefetch;
  }
}

TEST(Zero3, AChangedAcquireOrderWarnsOnceAndTrainsLikeStage2) {
  // Forwards 3 and 4 acquire the last layer first; then the old order
  // returns: two departures, one warning, stage 2's weights.
  auto when = [](int forward, int) { return forward == 3 || forward == 4; };
  RunSpec r;
  r.stage = 3;
  r.steps = 8;
  r.zero_extra = stage3_keys(2048 * g_world->size());
  r.make = [when] { return std::make_shared<ExtraAcquire>(when, 2); };
  ParamGatherStats st;
  r.inspect = [&st](Engine& e) { st = e.param_gather_stats(); };
  ::testing::internal::CaptureStderr();
  const std::vector<float> w = train(r, g_world);
  const std::string err = ::testing::internal::GetCapturedStderr();
  RunSpec ref = r;
  ref.stage = 2;
  ref.inspect = nullptr;
  EXPECT_EQ(w, train(ref, g_world));
  EXPECT_EQ(st.departures, 2);
  size_t warnings = 0;
  for (size_t at = err.find("ZeRO-3: a training pass"); at != std::string::npos;
       at = err.find("ZeRO-3: a training pass", at + 1))
    ++warnings;
  EXPECT_EQ(warnings, 1u) << err;
}

TEST(Zero3, RanksThatAcquireDifferentBlocksFailOnEveryRankNamingThem) {
  if (g_world->size() < 2) GTEST_SKIP();
  // Rank 1 acquires block 2 before anything else in its first forward; the
  // others start with block 0 (the embeddings).
  auto when = [](int forward, int rank) { return forward == 0 && rank == 1; };
  RunSpec r;
  r.stage = 3;
  r.steps = 1;
  r.zero_extra = stage3_keys();
  r.make = [when] { return std::make_shared<ExtraAcquire>(when, 2); };
  std::string message = "(no error)";
  try {
    train(r, g_world);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("acquires part at position 0"), std::string::npos) << message;
  EXPECT_NE(message.find("block 0 on one rank, block 2 on another"), std::string::npos) << message;
}

}  // namespace
}  // namespace zinc
