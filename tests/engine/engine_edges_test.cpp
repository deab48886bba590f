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

// Synthetic data over small_gpt's vocabulary, rows of 16, for one rank.
DataLoader small_loader(int64_t micro, int64_t gas) {
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  return DataLoader(make_data_source(dc), micro, gas, 1, 0, 7);
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
  DataLoader loader = small_loader(4, 1);
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

// Without loss scaling a loss that is not finite means the weights have
// overflowed (the tokens are finite): refused at once, in fp32 and bf16,
// rather than skipping every later step (and saving those weights).
TEST(EngineStepOrder, ALossThatIsNotFiniteWithoutLossScalingEndsTheRun) {
  for (bool bf16 : {false, true}) {
    nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                          {"bf16", {{"enabled", bf16}}},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e30}}}}}};
    Engine e = Engine::initialize(models::make_gpt(small_gpt(Device::kCpu, 1, 16)), cfg);
    DataLoader loader = small_loader(4, 1);
    std::string what;
    int step = 0;
    for (; step < 10 && what.empty(); ++step) {
      try {
        e.train_batch(loader);
      } catch (const Error& err) {
        what = err.what();
      }
    }
    EXPECT_NE(what.find("the loss is nan"), std::string::npos) << what;
    EXPECT_NE(what.find(bf16 ? "(bf16, no loss scaling)" : "(fp32, no loss scaling)"), std::string::npos) << what;
    EXPECT_EQ(e.skipped_steps(), 0) << "bf16 " << bf16;
    EXPECT_GE(step, 2);  // the first loss is finite
  }
}

// After a boundary backward whose step() has not run, saving or loading a
// checkpoint is refused (its gradients and losses belong to that step).
TEST(CheckpointEdges, RefusedBetweenABoundaryBackwardAndItsStep) {
  const std::string dir = (std::filesystem::temp_directory_path() / "zinc_ckpt_pending").string();
  std::filesystem::remove_all(dir);
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  Engine e = Engine::initialize(models::make_gpt(g), nlohmann::json{{"train_micro_batch_size_per_gpu", 4}});
  DataLoader loader = small_loader(4, 1);
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
  DataLoader loader = small_loader(4, 2);
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

// A forward whose backward never runs (another forward replaced it) counts
// for nothing, as in PyTorch: its loss and targets joined the global batch
// once, which with masked targets rescaled the gradient (5x in the hostile
// sweep's case).
TEST(EngineStepOrder, AForwardWithoutItsBackwardIsNotCounted) {
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  const nlohmann::json cfg{{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 1}};
  DataLoader loader = small_loader(2, 1);
  Batch kept = loader.next(), dropped = loader.next();
  for (size_t i = 0; i < kept.targets.size(); i += 3) kept.targets[i] = -100;  // some masked
  for (size_t i = 0; i < dropped.targets.size(); ++i) dropped.targets[i] = i % 2 ? -100 : dropped.targets[i];
  Engine plain = Engine::initialize(models::make_gpt(g), cfg);
  plain.forward(kept);
  plain.backward();
  plain.step();
  Engine twice = Engine::initialize(models::make_gpt(g), cfg);
  twice.forward(dropped);  // its backward never runs
  twice.forward(kept);
  twice.backward();
  twice.step();
  EXPECT_EQ(twice.global_grad_norm(), plain.global_grad_norm());
  EXPECT_EQ(twice.last_batch_loss(), plain.last_batch_loss());
  for (size_t b = 0; b < plain.model().blocks().size(); ++b)
    EXPECT_EQ(twice.full_params(static_cast<int>(b)), plain.full_params(static_cast<int>(b))) << "block " << b;
}

// An evaluation between a forward and its backward is refused: the model
// keeps one pass's activations, and the backward then differentiated the
// evaluation's batch (a silently wrong gradient at every stage). After
// the backward it evaluates, and the run is the one without evaluations.
TEST(EngineStepOrder, AnEvaluationBetweenForwardAndBackwardIsRefused) {
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  const nlohmann::json cfg{{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 1}};
  DataLoader loader = small_loader(2, 1);
  const Batch a = loader.next(), other = loader.next();
  Engine plain = Engine::initialize(models::make_gpt(g), cfg);
  plain.forward(a);
  plain.backward();
  plain.step();
  Engine e = Engine::initialize(models::make_gpt(g), cfg);
  e.forward(a);
  try {
    e.evaluate(other);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("between forward() and backward()"), std::string::npos) << err.what();
  }
  e.backward();
  EXPECT_TRUE(std::isfinite(e.evaluate(other)));  // after the backward: allowed, and harmless
  e.step();
  EXPECT_EQ(e.global_grad_norm(), plain.global_grad_norm());
  for (size_t b = 0; b < plain.model().blocks().size(); ++b)
    EXPECT_EQ(e.full_params(static_cast<int>(b)), plain.full_params(static_cast<int>(b))) << "block " << b;
}

// train_batch trains one whole global batch: called inside one (after a
// micro-batch of the caller's own), it is refused, and the caller's batch
// can still be finished (it mixed the two and left the engine mid-batch).
TEST(EngineStepOrder, TrainBatchInsideAGlobalBatchIsRefused) {
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  const nlohmann::json cfg{{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 2}};
  DataLoader loader = small_loader(2, 2);
  Engine e = Engine::initialize(models::make_gpt(g), cfg);
  e.forward(loader.next());
  e.backward();
  e.step();  // micro-step 1 of 2
  try {
    e.train_batch(loader);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("train_batch() inside a global batch (after micro-step 1 of 2"),
              std::string::npos)
        << err.what();
  }
  EXPECT_EQ(e.micro_steps(), 1);
  e.forward(loader.next());
  e.backward();
  e.step();
  EXPECT_EQ(e.global_steps(), 1);
  EXPECT_NO_THROW(e.train_batch(loader));
  EXPECT_EQ(e.global_steps(), 2);
}

// The Hugging Face Trainer's own AdamW (a `trainer` section without an
// optimizer: OptimizerConfig::decay_vectors false) decays no bias and no
// norm weight: one step from the same weights with and without weight
// decay (the same gradients, so the same Adam part) leaves every 1-D
// parameter the same, at every ZeRO stage, and moves every matrix by the
// decay.
TEST(EngineWeightDecay, TheTrainersAdamWDecaysNoBiasOrNormWeight) {
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  for (int stage : {0, 1, 3}) {
    auto run = [&](double wd) {
      nlohmann::json j{{"train_micro_batch_size_per_gpu", 2},
                       {"gradient_accumulation_steps", 1},
                       {"zero_optimization", {{"stage", stage}}},
                       {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 0.05}, {"weight_decay", wd}}}}}};
      Config c = Config::parse(j);
      c.optimizer.decay_vectors = false;
      Engine e = Engine::initialize(models::make_gpt(g), c);
      DataLoader loader = small_loader(2, 1);
      e.train_batch(loader);
      std::vector<std::vector<float>> w;
      for (size_t b = 0; b < e.model().blocks().size(); ++b) w.push_back(e.full_params(static_cast<int>(b)));
      return std::make_pair(std::move(w), e.model().blocks());
    };
    const auto [with, specs] = run(0.5);
    const auto [without, unused] = run(0.0);
    int vectors = 0, matrices = 0;
    for (size_t b = 0; b < specs.size(); ++b) {
      const BlockLayout l = BlockLayout::from_spec(specs[b]);
      for (size_t p = 0; p < specs[b].params.size(); ++p) {
        bool same = true;
        for (int64_t i = l.offsets[p]; i < l.offsets[p] + l.numels[p]; ++i)
          same = same && with[b][static_cast<size_t>(i)] == without[b][static_cast<size_t>(i)];
        if (specs[b].params[p].shape.ndim <= 1) {
          EXPECT_TRUE(same) << "stage " << stage << ": " << specs[b].params[p].name << " was decayed";
          ++vectors;
        } else {
          EXPECT_FALSE(same) << "stage " << stage << ": " << specs[b].params[p].name << " was not decayed";
          ++matrices;
        }
      }
    }
    EXPECT_GT(vectors, 4);
    EXPECT_GT(matrices, 4);
  }
}

// A global batch the step refuses (micro-batches of two shapes with masked
// targets: the mean over the targets needs one) is dropped, and the engine
// trains the next one: it refused every later step before.
TEST(EngineStepOrder, AGlobalBatchTheStepRefusesIsDroppedAndTheNextTrains) {
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  const nlohmann::json cfg{{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 2}};
  DataLoader loader = small_loader(2, 2);
  Engine e = Engine::initialize(models::make_gpt(g), cfg);
  Batch a = loader.next(), b = loader.next();
  a.targets[0] = -100;
  Batch shorter = b;  // another T
  shorter.T = 8;
  shorter.inputs.resize(16);
  shorter.targets.resize(16);
  e.forward(a);
  e.backward();
  e.forward(shorter);
  e.backward();
  try {
    e.step();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("this global batch is dropped"), std::string::npos) << err.what();
  }
  EXPECT_EQ(e.global_steps(), 0);
  // The next global batch trains as the first one of a fresh engine does.
  Engine fresh = Engine::initialize(models::make_gpt(g), cfg);
  for (Engine* x : {&e, &fresh}) {
    x->forward(a);
    x->backward();
    x->forward(b);
    x->backward();
    x->step();
  }
  EXPECT_EQ(e.global_steps(), 1);
  EXPECT_EQ(e.global_grad_norm(), fresh.global_grad_norm());
  for (size_t k = 0; k < e.model().blocks().size(); ++k)
    EXPECT_EQ(e.full_params(static_cast<int>(k)), fresh.full_params(static_cast<int>(k))) << "block " << k;
}
}  // namespace
}  // namespace zinc
