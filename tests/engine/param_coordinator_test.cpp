// HeldParams and the ParamCoordinator on their own: a held block is released
// exactly once, whatever way the handle goes; the coordinator counts holds
// and hands out the compute copy (or the fp32 master where it is the compute
// copy); and the engine refuses a model that keeps a block past its forward.
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/param_coordinator.h"
#include "engine/shard.h"

namespace zinc {
namespace {

// Counts what a model's handles do.
class CountingContext final : public StepContext {
 public:
  DType compute_dtype() const override { return DType::kF32; }
  BlockGrads grads(int) override { return {}; }
  void grads_ready(int) override {}
  std::vector<int> acquired = std::vector<int>(3, 0), released = std::vector<int>(3, 0);
  float data[4] = {1, 2, 3, 4};
  BlockLayout layout = [] {
    BlockLayout l;
    l.offsets = {0};
    l.numels = {4};
    l.numel = 32;
    return l;
  }();

 protected:
  BlockParams acquire_params(int block) override {
    acquired[block] += 1;
    return {data, DType::kF32, &layout};
  }
  void release_params(int block) noexcept override { released[block] += 1; }
};

TEST(HeldParams, ReleasesOnceOnScopeExitExplicitReleaseMoveAndException) {
  CountingContext ctx;
  {
    HeldParams p = ctx.acquire(0);
    EXPECT_EQ(p[0].at(2), 3.0f);
    EXPECT_TRUE(p.held());
  }
  EXPECT_EQ(ctx.released[0], 1);
  {
    HeldParams p = ctx.acquire(1);
    p.release();
    p.release();  // no-op
    EXPECT_FALSE(p.held());
  }
  EXPECT_EQ(ctx.released[1], 1);
  {
    HeldParams a = ctx.acquire(2);
    HeldParams b = std::move(a);  // the hold moves; released once, by b
    EXPECT_FALSE(a.held());
    HeldParams c;
    c = std::move(b);
  }
  EXPECT_EQ(ctx.released[2], 1);
  try {
    HeldParams p = ctx.acquire(0);
    throw std::runtime_error("model failed mid-block");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(ctx.acquired[0], 2);
  EXPECT_EQ(ctx.released[0], 2);
}

TEST(ParamCoordinator, HandsOutTheComputeCopyAndCountsHolds) {
  std::vector<BlockShard> blocks(2);
  std::vector<float> master(64, 1.5f);
  for (BlockShard& s : blocks) {
    s.layout.offsets = {0};
    s.layout.numels = {64};
    s.layout.numel = 64;
  }
  blocks[0].master_compute = master.data();                // stage 0, fp32: the master is the compute copy
  blocks[1].compute = AlignedBuffer(64 * sizeof(float));  // a separate compute copy
  ParamCoordinator pc(blocks, DType::kF32);
  BlockParams p0 = pc.acquire(0);
  EXPECT_EQ(p0.base, master.data());
  BlockParams p1 = pc.acquire(1);
  EXPECT_EQ(p1.base, blocks[1].compute.data());
  EXPECT_EQ(p1.layout, &blocks[1].layout);
  pc.acquire(1);  // a block may be held twice (the tied embedding)
  EXPECT_EQ(pc.first_held(), 0);
  pc.release(0);
  EXPECT_EQ(pc.first_held(), 1);
  pc.release(1);
  pc.release(1);
  EXPECT_EQ(pc.first_held(), -1);
}

// Keeps the block it acquired in forward in a member: a leak the engine
// must refuse rather than leave the block held into the next step.
class LeakyModel final : public Model {
 public:
  LeakyModel() { specs_.push_back({"only", {{"w", {8}}}}); }
  std::string name() const override { return "leaky"; }
  const std::vector<BlockSpec>& blocks() const override { return specs_; }
  float forward(StepContext& ctx, const Batch&) override {
    kept_ = ctx.acquire(0);
    return 0.0f;
  }
  void backward(StepContext& ctx, float) override { ctx.grads_ready(0); }
  void drop() { kept_.release(); }  // a handle must not outlive the engine

 private:
  std::vector<BlockSpec> specs_;
  HeldParams kept_;
};

TEST(ParamCoordinator, EngineRefusesAModelThatKeepsABlockPastForward) {
  auto model = std::make_shared<LeakyModel>();
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 1}, {"gradient_accumulation_steps", 1}};
  Engine e = Engine::initialize(model, cfg);
  Batch b;
  b.B = 1;
  b.T = 2;
  b.inputs = {0, 1};
  b.targets = {1, 0};
  try {
    e.forward(b);
    FAIL() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("model 'leaky' still holds the parameters of block 0 after forward"),
              std::string::npos)
        << err.what();
  }
  model->drop();
}

}  // namespace
}  // namespace zinc
