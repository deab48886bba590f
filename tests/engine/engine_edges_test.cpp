// Edges of the engine's step order and its checkpoints on one rank, found
// reviewing the GPU path; they hold on every path (the CPU's here).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "data/data.h"
#include "engine/engine.h"
#include "models/models.h"

namespace zinc {
namespace {

// The GPT of these tests, on the CPU.
models::GptConfig small_gpt(Device device, int64_t layers, int64_t width) {
  models::GptConfig g;
  g.vocab_size = 29;
  g.block_size = 16;
  g.n_layer = layers;
  g.n_head = 2;
  g.n_embd = width;
  g.device = device;
  return g;
}

// Checkpoint edges found reviewing the GPU path; they hold on every path.
// A checkpoint saved right after an overflow-skipped fp16 step (its gradient
// norm is not finite, saved as null) loads.
TEST(CheckpointEdges, SavedAfterAnOverflowSkippedStepLoads) {
  const std::string dir = (std::filesystem::temp_directory_path() / "zinc_ckpt_overflow").string();
  std::filesystem::remove_all(dir);
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                        {"fp16", {{"enabled", true}, {"initial_scale_power", 40}, {"hysteresis", 1}}}};
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  Engine e = Engine::initialize(models::make_gpt(g), cfg);
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  DataLoader loader(make_data_source(dc), 4, 1, 1, 0, 7);
  e.train_batch(loader);
  ASSERT_EQ(e.skipped_steps(), 1);
  ASSERT_FALSE(std::isfinite(e.global_grad_norm()));
  e.save_checkpoint(dir, "t");
  Engine e2 = Engine::initialize(models::make_gpt(g), cfg);
  e2.load_checkpoint(dir, "t");
  EXPECT_EQ(e2.skipped_steps(), 1);
  EXPECT_TRUE(std::isnan(e2.global_grad_norm()));
  EXPECT_EQ(e2.loss_scale(), e.loss_scale());
  std::filesystem::remove_all(dir);
}

// After a boundary backward whose step() has not run, saving or loading a
// checkpoint is refused (its gradients and losses belong to that step).
TEST(CheckpointEdges, RefusedBetweenABoundaryBackwardAndItsStep) {
  const std::string dir = (std::filesystem::temp_directory_path() / "zinc_ckpt_pending").string();
  std::filesystem::remove_all(dir);
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  Engine e = Engine::initialize(models::make_gpt(g), nlohmann::json{{"train_micro_batch_size_per_gpu", 4}});
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  DataLoader loader(make_data_source(dc), 4, 1, 1, 0, 7);
  e.train_batch(loader);
  e.save_checkpoint(dir, "ok");  // between global batches: fine
  e.forward(loader.next());
  e.backward();
  for (auto* call : {+[](Engine& en, const std::string& d) { en.save_checkpoint(d, "t"); },
                     +[](Engine& en, const std::string& d) { en.load_checkpoint(d, "ok"); }}) {
    try {
      call(e, dir);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("after step()"), std::string::npos) << err.what();
    }
  }
  e.step();
  e.load_checkpoint(dir, "ok");  // and fine again after the step
  std::filesystem::remove_all(dir);
}

// The next micro-batch after a boundary backward needs that step() first
// (its reductions may be in flight, its losses belong to it); inside an
// accumulation, step() is optional and does nothing.
TEST(EngineStepOrder, AMicroBatchAfterABoundaryBackwardNeedsItsStep) {
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  Engine e = Engine::initialize(models::make_gpt(g),
                                nlohmann::json{{"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 2}});
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  DataLoader loader(make_data_source(dc), 4, 2, 1, 0, 7);
  e.forward(loader.next());
  e.backward();  // inside the accumulation: no step needed
  e.forward(loader.next());
  e.backward();  // the boundary
  try {
    e.forward(loader.next());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("has not been stepped"), std::string::npos) << err.what();
  }
  e.step();
  EXPECT_EQ(e.global_steps(), 1);
  e.forward(loader.next());
  e.backward();
  e.step();  // inside the accumulation: nothing
  EXPECT_EQ(e.global_steps(), 1);
}
}  // namespace
}  // namespace zinc
