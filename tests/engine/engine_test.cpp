// Engine behaviour on one rank: the step arithmetic (norm, clipping,
// accumulation, skipping) on a toy model whose gradient is known exactly, and
// accumulation equivalence on the built-in models.
#include <gtest/gtest.h>

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/kernels.h"
#include "engine/engine.h"
#include "models/models.h"
#include "tests/engine/tiny_models.h"
#include "tests/engine/checkpoint_util.h"
#include "tests/engine/estimate_util.h"
#include "engine/shard.h"

namespace zinc {
namespace {

// loss = 0.5 * sum_j (p_j - t_j)^2 over all parameters, with targets t_j
// derived from the batch's first tokens, so the gradient p - t is known.
class ToyModel final : public Model {
 public:
  ToyModel() {
    specs_.push_back({"a", {{"w", {5}}}});
    specs_.push_back({"b", {{"u", {3, 2}}, {"bias", {1}, Init::kOnes}}});
  }
  std::string name() const override { return "toy"; }
  const std::vector<BlockSpec>& blocks() const override { return specs_; }
  static float target(const Batch& b, int64_t j) {
    return 0.1f * static_cast<float>(b.inputs[static_cast<size_t>(j) % b.inputs.size()] % 7);
  }
  float forward(StepContext& ctx, const Batch& batch) override {
    last_ = batch;
    double loss = 0;
    int64_t j = 0;
    for (int blk = 0; blk < 2; ++blk) {
      HeldParams p = ctx.acquire(blk);
      for (size_t i = 0; i < specs_[blk].params.size(); ++i)
        for (int64_t k = 0; k < p.params().layout->numels[i]; ++k, ++j) {
          double d = p[static_cast<int>(i)].at(k) - target(batch, j);
          loss += 0.5 * d * d;
        }
      p.release();
    }
    return static_cast<float>(loss);
  }
  void backward(StepContext& ctx, float scale) override {
    int64_t j = 0;
    std::vector<std::pair<float*, float>> updates;
    for (int blk = 0; blk < 2; ++blk) {
      HeldParams p = ctx.acquire(blk);
      BlockGrads g = ctx.grads(blk);
      for (size_t i = 0; i < specs_[blk].params.size(); ++i)
        for (int64_t k = 0; k < p.params().layout->numels[i]; ++k, ++j) {
          float grad = scale * (p[static_cast<int>(i)].at(k) - target(last_, j));
          if (poison_) grad = std::numeric_limits<float>::quiet_NaN();
          g[static_cast<int>(i)][k] += grad;
        }
      p.release();
    }
    if (report_twice_) ctx.grads_ready(1);
    ctx.grads_ready(1);
    ctx.grads_ready(0);
  }
  bool poison_ = false;
  bool report_twice_ = false;

 private:
  std::vector<BlockSpec> specs_;
  Batch last_;
};

Batch toy_batch(int32_t first) {
  Batch b;
  b.B = 1;
  b.T = 11;
  for (int32_t i = 0; i < 11; ++i) {
    b.inputs.push_back(first + 3 * i);
    b.targets.push_back(0);
  }
  return b;
}

// All parameters of an engine, in block order (padding included).
std::vector<float> params_of(const Engine& e, int blocks) {
  std::vector<float> out;
  for (int b = 0; b < blocks; ++b) {
    std::vector<float> s = e.full_params(b);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

// The toy's parameters and mean targets, in the same order as params_of
// without padding, for checking gradients by hand.
struct ToyState {
  std::vector<float> p, mean_t;
};
ToyState toy_state(const Engine& e, const std::vector<Batch>& micro) {
  ToyState s;
  int64_t j = 0;
  for (int blk = 0; blk < 2; ++blk) {
    std::vector<float> m = e.full_params(blk);
    BlockLayout l = BlockLayout::from_spec(const_cast<Engine&>(e).model().blocks()[blk]);
    for (size_t i = 0; i < l.offsets.size(); ++i)
      for (int64_t k = 0; k < l.numels[i]; ++k, ++j) {
        s.p.push_back(m[static_cast<size_t>(l.offsets[i] + k)]);
        double t = 0;
        for (const Batch& b : micro) t += ToyModel::target(b, j);
        s.mean_t.push_back(static_cast<float>(t / static_cast<double>(micro.size())));
      }
  }
  return s;
}

nlohmann::json toy_config() {
  // beta1 = beta2 = 0, no bias correction and a huge eps make Adam's update
  // -lr/eps * g * (1 - O(|g|/eps)), i.e. proportional to the scaled gradient:
  // the step then shows exactly what the engine fed the optimizer.
  return {{"train_micro_batch_size_per_gpu", 1},
          {"gradient_accumulation_steps", 1},
          {"gradient_clipping", 0.0},
          {"optimizer",
           {{"type", "Adam"},
            {"params",
             {{"lr", 1e6}, {"eps", 1e6}, {"betas", {0.0, 0.0}}, {"bias_correction", false}, {"weight_decay", 0.0}}}}}};
}

double norm_of(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return std::sqrt(s);
}

TEST(EngineStep, ReportsPreClipNormAndAppliesTheGradient) {
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(model, toy_config());
  Batch b = toy_batch(1);
  ToyState before = toy_state(e, {b});
  e.forward(b);
  e.backward();
  EXPECT_TRUE(e.is_gradient_accumulation_boundary());
  e.step();
  EXPECT_EQ(e.global_steps(), 1);
  EXPECT_NEAR(e.global_grad_norm(), norm_of(before.p, before.mean_t), 1e-5);
  ToyState after = toy_state(e, {b});
  for (size_t i = 0; i < before.p.size(); ++i)
    EXPECT_NEAR(after.p[i] - before.p[i], -(before.p[i] - before.mean_t[i]), 2e-5) << i;
}

TEST(EngineStep, ClippingScalesTheGradientByMaxNormOverNorm) {
  nlohmann::json cfg = toy_config();
  cfg["gradient_clipping"] = 0.05;
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(model, cfg);
  Batch b = toy_batch(4);
  ToyState before = toy_state(e, {b});
  const double norm = norm_of(before.p, before.mean_t);
  ASSERT_GT(norm, 0.05);
  e.forward(b);
  e.backward();
  e.step();
  EXPECT_NEAR(e.global_grad_norm(), norm, 1e-5);  // reported before clipping
  const double coef = 0.05 / (norm + 1e-6);
  ToyState after = toy_state(e, {b});
  for (size_t i = 0; i < before.p.size(); ++i)
    EXPECT_NEAR(after.p[i] - before.p[i], -coef * (before.p[i] - before.mean_t[i]), 1e-6) << i;
  EXPECT_NEAR(norm_of(after.p, before.p), 0.05, 1e-5);  // the step has exactly the clip norm
}

TEST(EngineStep, AccumulationAveragesMicroBatchesAndStepsOnlyAtTheBoundary) {
  nlohmann::json cfg = toy_config();
  cfg["gradient_accumulation_steps"] = 3;
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(model, cfg);
  std::vector<Batch> micro = {toy_batch(1), toy_batch(2), toy_batch(5)};
  ToyState before = toy_state(e, micro);
  for (int i = 0; i < 3; ++i) {
    e.forward(micro[i]);
    e.backward();
    EXPECT_EQ(e.is_gradient_accumulation_boundary(), i == 2);
    e.step();
    EXPECT_EQ(e.global_steps(), i == 2 ? 1 : 0);
  }
  EXPECT_NEAR(e.global_grad_norm(), norm_of(before.p, before.mean_t), 1e-5);
  ToyState after = toy_state(e, micro);
  for (size_t i = 0; i < before.p.size(); ++i)
    EXPECT_NEAR(after.p[i] - before.p[i], -(before.p[i] - before.mean_t[i]), 2e-5) << i;
}

TEST(EngineStep, NonFiniteGradientSkipsTheUpdate) {
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(model, toy_config());
  std::vector<float> before = params_of(e, 2);
  model->poison_ = true;
  e.forward(toy_batch(1));
  e.backward();
  e.step();
  EXPECT_EQ(e.skipped_steps(), 1);
  EXPECT_FALSE(std::isfinite(e.global_grad_norm()));
  EXPECT_EQ(params_of(e, 2), before);
  // The next good step works from clean gradients.
  model->poison_ = false;
  e.forward(toy_batch(1));
  e.backward();
  e.step();
  EXPECT_TRUE(std::isfinite(e.global_grad_norm()));
  EXPECT_NE(params_of(e, 2), before);
}

// ---- fp16: Note [dynamic loss scaling] ----------------------------------------------

nlohmann::json fp16_toy_config(nlohmann::json fp16) {
  nlohmann::json c = toy_config();
  fp16["enabled"] = true;
  c["fp16"] = fp16;
  return c;
}

// One global batch of the toy, poisoned (NaN gradients: an injected
// overflow) or not; returns the loss scale the next batch will use.
double toy_step(Engine& e, ToyModel& m, bool overflow) {
  m.poison_ = overflow;
  e.forward(toy_batch(1));
  e.backward();
  e.step();
  m.poison_ = false;
  return e.loss_scale();
}

TEST(LossScale, InjectedOverflowSkipsTheStepAndHysteresisDelaysTheCut) {
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(
      model, fp16_toy_config({{"initial_scale_power", 8}, {"hysteresis", 2}, {"loss_scale_window", 3}}));
  EXPECT_EQ(e.loss_scale(), 256);
  const std::vector<float> before = params_of(e, 2);
  const double lr_before = e.learning_rate();
  // First overflow: skipped, the hysteresis absorbs it (2 -> 1), the scale stays.
  EXPECT_EQ(toy_step(e, *model, true), 256);
  EXPECT_EQ(params_of(e, 2), before);
  EXPECT_EQ(e.skipped_steps(), 1);
  // Second: skipped, and now the scale halves.
  EXPECT_EQ(toy_step(e, *model, true), 128);
  EXPECT_EQ(params_of(e, 2), before);
  EXPECT_EQ(e.skipped_steps(), 2);
  EXPECT_EQ(e.learning_rate(), lr_before);  // the schedule did not advance
  // Clean steps update; the third clean step since the overflow doubles the scale.
  EXPECT_EQ(toy_step(e, *model, false), 128);
  EXPECT_NE(params_of(e, 2), before);
  EXPECT_EQ(toy_step(e, *model, false), 128);
  EXPECT_EQ(toy_step(e, *model, false), 256);
  EXPECT_EQ(e.skipped_steps(), 2);
  EXPECT_EQ(e.global_steps(), 5);
  // The window restarts: three more clean steps double it again.
  EXPECT_EQ(toy_step(e, *model, false), 256);
  EXPECT_EQ(toy_step(e, *model, false), 256);
  EXPECT_EQ(toy_step(e, *model, false), 512);
  // The hysteresis was refilled when the scale grew: one overflow is absorbed again.
  EXPECT_EQ(toy_step(e, *model, true), 512);
  EXPECT_EQ(toy_step(e, *model, true), 256);
}

TEST(LossScale, ConsecutiveHysteresisRefillsAfterEveryCleanStep) {
  for (bool consecutive : {false, true}) {
    auto model = std::make_shared<ToyModel>();
    Engine e = Engine::initialize(model, fp16_toy_config({{"initial_scale_power", 10},
                                                          {"hysteresis", 2},
                                                          {"loss_scale_window", 100},
                                                          {"consecutive_hysteresis", consecutive}}));
    // overflow, clean, overflow: only without consecutive_hysteresis does the
    // second overflow find the hysteresis spent.
    toy_step(e, *model, true);
    toy_step(e, *model, false);
    EXPECT_EQ(toy_step(e, *model, true), consecutive ? 1024 : 512) << consecutive;
  }
}

TEST(LossScale, GradientsAreUnscaledBeforeNormClippingAndTheUpdate) {
  // The same toy step with and without fp16: the reported norm is the
  // unscaled one, and the update matches (to fp16's rounding of the weights).
  auto m32 = std::make_shared<ToyModel>(), m16 = std::make_shared<ToyModel>();
  Engine e32 = Engine::initialize(m32, toy_config());
  Engine e16 = Engine::initialize(m16, fp16_toy_config({{"initial_scale_power", 12}}));
  EXPECT_EQ(e16.loss_scale(), 4096);
  toy_step(e32, *m32, false);
  toy_step(e16, *m16, false);
  EXPECT_NEAR(e16.global_grad_norm(), e32.global_grad_norm(), 1e-3 * e32.global_grad_norm());
  const std::vector<float> a = params_of(e16, 2), b = params_of(e32, 2);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 2e-3) << i;
}

TEST(LossScale, StaticScaleNeverChangesButAnOverflowStillSkips) {
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(model, fp16_toy_config({{"loss_scale", 128}}));
  const std::vector<float> before = params_of(e, 2);
  EXPECT_EQ(toy_step(e, *model, true), 128);
  EXPECT_EQ(params_of(e, 2), before);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(toy_step(e, *model, false), 128);
  EXPECT_EQ(e.skipped_steps(), 1);
}

TEST(LossScale, AnOverflowAtTheMinimumScaleIsAnError) {
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(
      model, fp16_toy_config({{"initial_scale_power", 1}, {"hysteresis", 1}, {"min_loss_scale", 1}}));
  EXPECT_EQ(toy_step(e, *model, true), 1);
  try {
    toy_step(e, *model, true);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("fp16.min_loss_scale"), std::string::npos) << err.what();
  }
}

TEST(EngineProtocol, MisuseIsAnErrorNotACrash) {
  auto model = std::make_shared<ToyModel>();
  Engine e = Engine::initialize(model, toy_config());
  EXPECT_THROW(e.backward(), Error);  // no forward yet
  Batch bad = toy_batch(1);
  bad.targets.pop_back();
  EXPECT_THROW(e.forward(bad), Error);
  model->report_twice_ = true;
  e.forward(toy_batch(1));
  EXPECT_THROW(e.backward(), Error);
  EXPECT_THROW(Engine::initialize(nullptr, toy_config()), Error);
}

TEST(EngineSchedule, LearningRateFollowsTheScheduleFromTheFirstStep) {
  nlohmann::json cfg = toy_config();
  cfg["optimizer"]["params"]["lr"] = 0.5;
  cfg["scheduler"] = {{"type", "WarmupLR"},
                      {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 0.5}, {"warmup_num_steps", 4},
                                  {"warmup_type", "linear"}}}};
  Engine e = Engine::initialize(std::make_shared<ToyModel>(), cfg);
  std::vector<double> seen;
  for (int s = 0; s < 6; ++s) {
    e.forward(toy_batch(s));
    e.backward();
    e.step();
    seen.push_back(e.learning_rate());
  }
  std::vector<double> expect = {0.0, 0.125, 0.25, 0.375, 0.5, 0.5};
  for (size_t i = 0; i < expect.size(); ++i) EXPECT_NEAR(seen[i], expect[i], 1e-12) << i;
}

// Lamb through the engine against a double-precision reference of DeepSpeed's
// FusedLamb on the toy (gradient = p - target): one trust ratio per tensor
// (block "b" holds two tensors, "u" and "bias", in one flat vector with
// padding), with OneCycle moving the lr and beta1 every step and setting
// beta2 to 0.99.
TEST(EngineLamb, ToyMatchesDoubleReferencePerTensorWithOneCycleMomentum) {
  nlohmann::json cfg = toy_config();
  cfg["optimizer"] = {{"type", "Lamb"},
                      {"params", {{"lr", 0.1}, {"betas", {0.9, 0.999}}, {"eps", 1e-6}, {"weight_decay", 0.01},
                                  {"max_coeff", 3.0}, {"min_coeff", 0.05}}}};
  cfg["scheduler"] = {{"type", "OneCycle"},
                      {"params", {{"cycle_min_lr", 0.01}, {"cycle_max_lr", 0.1}, {"cycle_first_step_size", 2},
                                  {"cycle_second_step_size", 3}, {"cycle_min_mom", 0.85}, {"cycle_max_mom", 0.95}}}};
  Engine e = Engine::initialize(std::make_shared<ToyModel>(), cfg);
  std::vector<double> p;
  for (float x : toy_state(e, {toy_batch(0)}).p) p.push_back(x);
  const std::vector<std::pair<size_t, size_t>> tensors = {{0, 5}, {5, 11}, {11, 12}};  // w, u, bias
  std::vector<double> m(p.size(), 0.0), v(p.size(), 0.0);
  const double scale[] = {0.5, 1.0, 2.0 / 3.0, 1.0 / 3.0};  // (i mod 5) / 2 rising, then falling over 3
  std::vector<double> ratios_seen;
  for (int s = 0; s < 4; ++s) {
    const Batch b = toy_batch(s);
    const std::vector<float> target = toy_state(e, {b}).mean_t;
    const double lr = 0.01 + 0.09 * scale[s], b1 = 0.95 - 0.1 * scale[s], b2 = 0.99;
    const int t = s + 1;
    std::vector<double> u(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = p[i] - target[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      u[i] = m[i] / (std::sqrt(v[i]) + 1e-6) + 0.01 * p[i];
    }
    const double step_size = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
    for (auto [lo, hi] : tensors) {
      double wn = 0, un = 0;
      for (size_t i = lo; i < hi; ++i) {
        wn += p[i] * p[i];
        un += u[i] * u[i];
      }
      const double ratio = std::clamp(std::sqrt(wn) / std::sqrt(un), 0.05, 3.0);
      ratios_seen.push_back(ratio);
      for (size_t i = lo; i < hi; ++i) p[i] -= step_size * ratio * u[i];
    }
    e.forward(b);
    e.backward();
    e.step();
    EXPECT_NEAR(e.learning_rate(), lr, 1e-12) << "step " << s;
    const std::vector<float> got = toy_state(e, {b}).p;
    for (size_t i = 0; i < p.size(); ++i) ASSERT_NEAR(got[i], p[i], 2e-6 * (1 + std::fabs(p[i]))) << "step " << s << " i " << i;
  }
  // The reference went through the clamps and between them (else it proves less).
  EXPECT_TRUE(std::count(ratios_seen.begin(), ratios_seen.end(), 3.0) > 0 ||
              std::count(ratios_seen.begin(), ratios_seen.end(), 0.05) > 0);
  EXPECT_TRUE(std::any_of(ratios_seen.begin(), ratios_seen.end(), [](double r) { return r > 0.05 && r < 3.0; }));
}

// A OneCycle whose momentum decays past 1 stops with the key to change.
TEST(EngineLamb, OneCycleMomentumReachingOneIsAnError) {
  nlohmann::json cfg = toy_config();
  cfg["scheduler"] = {{"type", "OneCycle"},
                      {"params", {{"cycle_min_lr", 0.01}, {"cycle_max_lr", 0.1}, {"cycle_first_step_size", 1},
                                  {"decay_step_size", 1}, {"decay_mom_rate", 0.5}}}};
  Engine e = Engine::initialize(std::make_shared<ToyModel>(), cfg);
  try {
    for (int s = 0; s < 4; ++s) {
      e.forward(toy_batch(s));
      e.backward();
      e.step();
    }
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& err) {
    EXPECT_NE(std::string(err.what()).find("scheduler.params.decay_mom_rate"), std::string::npos) << err.what();
  }
}

// ---- built-in models: k micro-batches of b == one batch of k*b ---------------

using testing_models::tiny_gpt;
using testing_models::tiny_mlp;

std::vector<float> train_steps(std::shared_ptr<Model> model, int64_t micro, int64_t gas, bool bf16,
                               int steps, std::vector<float>* losses = nullptr, double determinism = 0.8) {
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", micro},
                        {"gradient_accumulation_steps", gas},
                        {"gradient_clipping", 1.0},
                        {"bf16", {{"enabled", bf16}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  Engine e = Engine::initialize(model, cfg);
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  dc.determinism = determinism;
  std::shared_ptr<const DataSource> src = make_data_source(dc);
  DataLoader loader(src, micro, gas, 1, 0, 7);
  for (int s = 0; s < steps; ++s) {
    float l = e.train_batch(loader);
    if (losses) losses->push_back(l);
  }
  return params_of(e, static_cast<int>(model->blocks().size()));
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  EXPECT_LT(worst, tol);
}

TEST(EngineAccumulation, GptFourMicroBatchesOfTwoEqualOneBatchOfEight) {
  // The two runs differ only in how matmuls split the batch dimension, so
  // the weights agree to fp32 rounding after several Adam steps.
  std::vector<float> l1, l2;
  auto a = train_steps(tiny_gpt(), 2, 4, false, 5, &l1);
  auto b = train_steps(tiny_gpt(), 8, 1, false, 5, &l2);
  expect_close(a, b, 2e-5);
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l1[i], l2[i], 1e-5);
}

TEST(EngineAccumulation, MlpThreeMicroBatchesOfTwoEqualOneBatchOfSix) {
  auto a = train_steps(tiny_mlp(), 2, 3, false, 5);
  auto b = train_steps(tiny_mlp(), 6, 1, false, 5);
  expect_close(a, b, 2e-5);
}

TEST(EngineTraining, GptLearnsADeterministicSourceInFp32AndBf16) {
  // p = 1: every token after the second is a function of the two before, so
  // the loss must fall from log(13) = 2.56 towards log(13)/9 = 0.28.
  for (bool bf16 : {false, true}) {
    std::vector<float> losses;
    train_steps(tiny_gpt(), 16, 1, bf16, 200, &losses, 1.0);
    double head = 0, tail = 0;
    for (int i = 0; i < 10; ++i) {
      head += losses[static_cast<size_t>(i)] / 10;
      tail += losses[losses.size() - 1 - static_cast<size_t>(i)] / 10;
    }
    EXPECT_GT(head, 2.3) << (bf16 ? "bf16" : "fp32");
    EXPECT_LT(tail, head - 1.0) << (bf16 ? "bf16" : "fp32");
  }
}

// bf16 on a CPU without native bf16 matmul (Note [bf16 matmul without native
// bf16]): the fallback trains like fp32. Forced here where the native path
// exists, automatic where it does not; mean loss over the last 20 of 200 steps.
TEST(EngineTraining, Bf16ViaFp32TracksFp32Loss) {
  auto tail_mean = [](const std::vector<float>& l) {
    double t = 0;
    for (size_t i = l.size() - 20; i < l.size(); ++i) t += l[i] / 20.0;
    return t;
  };
  std::vector<float> f32, via;
  train_steps(tiny_gpt(), 16, 1, false, 200, &f32);
  kernels::set_matmul_bf16_path_for_testing(kernels::MatmulBf16Path::kViaF32);
  train_steps(tiny_gpt(), 16, 1, true, 200, &via);
  kernels::set_matmul_bf16_path_for_testing(kernels::MatmulBf16Path::kAuto);
  EXPECT_LT(tail_mean(f32), tail_mean({f32.begin(), f32.begin() + 20}) - 0.3);  // it learned
  EXPECT_NEAR(tail_mean(via), tail_mean(f32), 0.05);
}

// fp16 on the real GPT: a first scale of 2^40 makes the scaled gradients
// overflow fp16 inside the matmuls, so the first steps are skipped while the
// scale falls (hysteresis 1: halved each time); then it learns.
TEST(EngineTraining, Fp16OverflowsAtAHugeScaleThenLearns) {
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 16},
                        {"gradient_clipping", 1.0},
                        {"fp16", {{"enabled", true}, {"initial_scale_power", 40}, {"hysteresis", 1}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  auto model = tiny_gpt();
  Engine e = Engine::initialize(model, cfg);
  EXPECT_EQ(e.compute_dtype(), DType::kF16);
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  dc.determinism = 1.0;
  DataLoader loader(make_data_source(dc), 16, 1, 1, 0, 7);
  std::vector<float> losses;  // of the steps that updated
  double scale = e.loss_scale();
  int64_t skipped = 0;
  while (e.global_steps() - e.skipped_steps() < 200) {
    const float loss = e.train_batch(loader);
    if (e.skipped_steps() > skipped) {
      EXPECT_EQ(e.loss_scale(), scale / 2) << "step " << e.global_steps();  // hysteresis 1: halved
      skipped = e.skipped_steps();
    } else {
      losses.push_back(loss);
    }
    scale = e.loss_scale();
    ASSERT_LT(e.global_steps(), 400);
  }
  EXPECT_GE(e.skipped_steps(), 20);  // 2^40 cannot hold: 20 or more halvings
  EXPECT_LT(e.loss_scale(), std::ldexp(1.0, 21));
  for (float w : params_of(e, static_cast<int>(model->blocks().size()))) ASSERT_TRUE(std::isfinite(w));
  double head = 0, tail = 0;
  for (size_t i = 0; i < 10; ++i) {
    head += losses[i] / 10;
    tail += losses[losses.size() - 1 - i] / 10;
  }
  EXPECT_LT(tail, head - 1.0);
}

// fp16 at DeepSpeed's default first scale (2^16) trains like fp32: mean loss
// over the last 20 of 200 steps within 0.05 nats.
TEST(EngineTraining, Fp16TracksFp32Loss) {
  auto tail_mean = [](const std::vector<float>& l) {
    double t = 0;
    for (size_t i = l.size() - 20; i < l.size(); ++i) t += l[i] / 20.0;
    return t;
  };
  std::vector<float> f32;
  train_steps(tiny_gpt(), 16, 1, false, 200, &f32);
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 16},
                        {"gradient_clipping", 1.0},
                        {"fp16", {{"enabled", true}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  Engine e = Engine::initialize(tiny_gpt(), cfg);
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  dc.determinism = 0.8;
  DataLoader loader(make_data_source(dc), 16, 1, 1, 0, 7);
  std::vector<float> f16;
  for (int s = 0; s < 200; ++s) f16.push_back(e.train_batch(loader));
  EXPECT_EQ(e.skipped_steps(), 0);
  EXPECT_LT(tail_mean(f32), tail_mean({f32.begin(), f32.begin() + 20}) - 0.3);  // it learned
  EXPECT_NEAR(tail_mean(f16), tail_mean(f32), 0.05);
}

TEST(EngineTraining, SameSeedSameWeightsBitForBit) {
  auto a = train_steps(tiny_gpt(), 4, 2, true, 3);
  auto b = train_steps(tiny_gpt(), 4, 2, true, 3);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace zinc

namespace zinc {
namespace {

// ---- optimizer-state offload: where the states live must not change a bit ----

std::vector<float> train_offload(int stage, const std::string& device, bool bf16, const std::string& dir,
                                 const std::string& param_device = "none") {
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                        {"gradient_accumulation_steps", 2},
                        {"bf16", {{"enabled", bf16}}},
                        {"zero_optimization",
                         {{"stage", stage},
                          {"sub_group_size", 2048},
                          {"offload_optimizer",
                           {{"device", device}, {"nvme_path", dir}, {"buffer_count", 3}, {"pin_memory", true}}}}},
                        {"aio", {{"block_size", 8192}, {"queue_depth", 4}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  if (device == "none") cfg["zero_optimization"].erase("offload_optimizer");
  if (param_device != "none") {
    cfg["zero_optimization"]["offload_param"] = {{"device", param_device}, {"nvme_path", dir}, {"pin_memory", true}};
    cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0;  // read every block from disk at each use
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 2048;
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0;  // every block offloaded
  }
  auto model = testing_models::tiny_gpt();
  Engine e = Engine::initialize(model, cfg);
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  DataLoader loader(std::shared_ptr<const DataSource>(make_data_source(dc)), 4, 2, 1, 0, 7);
  for (int s = 0; s < 20; ++s) e.train_batch(loader);
  if (device == "nvme" || param_device == "nvme") {
    EXPECT_GT(e.offload_bytes_read(), 0);
    EXPECT_GT(e.offload_bytes_written(), 0);
  }
  if (param_device != "none") {
    EXPECT_GT(e.param_gather_stats().prefetched, 0);  // read and copied ahead of use
  }
  return params_of(e, static_cast<int>(model->blocks().size()));
}

TEST(EngineOffload, WeightsAreBitIdenticalWithOffloadNoneCpuAndNvme) {
  const std::string dir = ::testing::TempDir();
  for (int stage : {1, 2})
    for (bool bf16 : {false, true}) {
      std::vector<float> none = train_offload(stage, "none", bf16, dir);
      EXPECT_EQ(train_offload(stage, "cpu", bf16, dir), none) << "cpu, stage " << stage << " bf16 " << bf16;
      EXPECT_EQ(train_offload(stage, "nvme", bf16, dir), none) << "nvme, stage " << stage << " bf16 " << bf16;
    }
}

// One rank at stage 3 with its parameters offloaded: each block is read
// from NVMe (or page-locked RAM) into RAM while in use, and the weights are
// those of stage 2.
TEST(EngineOffload, OneRankStage3WithOffloadedParametersTrainsLikeStage2) {
  const std::string dir = ::testing::TempDir();
  for (bool bf16 : {false, true}) {
    const std::vector<float> stage2 = train_offload(2, "none", bf16, dir);
    for (const char* param : {"cpu", "nvme"})
      for (const char* opt : {"none", "nvme"})
        EXPECT_EQ(train_offload(3, opt, bf16, dir, param), stage2)
            << "offload_param " << param << ", offload_optimizer " << opt << ", bf16 " << bf16;
  }
}

}  // namespace
}  // namespace zinc

namespace zinc {
namespace {

// One rank: zinc-train --estimate's model state is the engine's peak, for
// every stage and offload (ZeRO-3 shards only with its parameters offloaded).
TEST(MemoryEstimate, OneRankModelStateEqualsTheEnginesPeak) {
  using testing_train::RunSpec;
  for (const std::string model : {"gpt", "mlp"})
    testing_train::for_each_stage_and_offload([&](bool bf16, int stage, const std::string& offload,
                                                  const std::string& what) {
      RunSpec r;
      r.model = model;
      r.bf16 = bf16;
      r.stage = stage;
      r.offload = offload;
      testing_train::expect_estimate_exact(r, nullptr, model + " " + what);
    });
  for (const std::string param : {"cpu", "nvme"}) {
    RunSpec r;
    r.bf16 = true;
    r.stage = 3;
    r.offload = "nvme";
    r.zero_extra = {{"offload_param", {{"device", param}, {"nvme_path", ::testing::TempDir()}}},
                    {"stage3_param_persistence_threshold", 100}};
    testing_train::expect_estimate_exact(r, nullptr, "one rank, offload_param " + param);
  }
}

// The models' activation memory is what their forward and backward
// allocate. The pass runs on a fresh thread, whose thread-local kernel
// scratch starts empty, so the heap grows by the activations and the
// scratch together (within the allocator's own overhead).
int64_t heap_bytes() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

// The GPT with gradient_checkpointing is counted as well, and its measured
// growth must be below the plain GPT's by about n_layer - 1 sets of layer
// activations.
TEST(MemoryEstimate, ModelActivationsAndScratchAreWhatForwardAndBackwardAllocate) {
  models::GptConfig g;
  g.vocab_size = 200;
  g.block_size = 64;
  g.n_layer = 3;
  g.n_head = 4;
  g.n_embd = 128;
  models::MlpConfig m;
  m.vocab_size = 200;
  m.context = 4;
  m.n_embd = 32;
  m.hidden = 256;
  for (const std::string precision : {"fp32", "bf16", "fp16"}) {
    const bool bf16 = precision == "bf16", fp16 = precision == "fp16";
    int64_t gpt_grew[2] = {0, 0};  // plain, checkpointed
    for (const std::string kind : {"gpt", "gpt checkpointed", "mlp"}) {
      const bool gpt = kind != "mlp";
      const std::string what = kind + " " + precision;
      models::GptConfig gk = g;
      gk.gradient_checkpointing = kind == "gpt checkpointed";
      const nlohmann::json cfg = {{"train_batch_size", 4},
                                  {"bf16", {{"enabled", bf16}}},
                                  {"fp16", {{"enabled", fp16}}},
                                  {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
      Batch batch;
      batch.B = 4;
      batch.T = 64;
      for (int64_t i = 0; i < batch.B * batch.T; ++i) {
        batch.inputs.push_back(static_cast<int32_t>(i * 7 % 200));
        batch.targets.push_back(static_cast<int32_t>(i * 13 % 200));
      }
      // A pass of the heap growth on a fresh thread; the first of two
      // warms what a process allocates once (a kernel's first call).
      int64_t grew = 0;
      ActivationMemory want;
      for (int round = 0; round < 2; ++round) {
        std::shared_ptr<Model> model = gpt ? models::make_gpt(gk) : models::make_mlp(m);
        Engine e = Engine::initialize(model, cfg);
        want = *model->activation_memory(batch.B, batch.T, e.compute_dtype());
        std::thread pass([&] {
          const int64_t before = heap_bytes();
          e.forward(batch);
          e.backward();
          grew = heap_bytes() - before;
        });
        pass.join();
      }
      const double expect = static_cast<double>(want.saved + want.workspace);
      EXPECT_GT(want.saved, 0) << what;
      EXPECT_NEAR(static_cast<double>(grew), expect, 0.02 * expect)
          << what << ": saved " << want.saved << " + scratch " << want.workspace;
      if (gpt) gpt_grew[gk.gradient_checkpointing ? 1 : 0] = grew;
    }
    // Two sets of layer activations fewer: (N,C) is 4*64*128*4 = 128 KiB,
    // a set is 15 of them plus the probabilities (4*4*64*64*4 = 256 KiB).
    EXPECT_LT(gpt_grew[1], gpt_grew[0] - 2 * (15 * 128 + 256) * 1024 * 9 / 10)
        << precision << ": checkpointed " << gpt_grew[1] << " vs plain " << gpt_grew[0];
  }
}

TEST(GradientCheckpointing, LossesNormsAndWeightsAreBitIdenticalOnOneRank) {
  testing_train::expect_gradient_checkpointing_bit_identical(nullptr);
}

}  // namespace
}  // namespace zinc

namespace zinc {
namespace {

// A freed state buffer comes back, cleared, for the next request of its
// size; other sizes get new memory; release_kept returns what is kept.
TEST(StateMemory, KeepsFreedBuffersForTheSameSizeAndClearsThem) {
  StateMemory m;
  AlignedBuffer a = m.alloc(3 << 20);
  void* where = a.data();
  std::memset(a.data(), 0x5a, a.bytes());
  m.free(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(m.bytes(), 0);
  EXPECT_EQ(m.kept_bytes(), 3 << 20);
  AlignedBuffer other = m.alloc(1 << 20);  // another size: new memory
  EXPECT_EQ(m.kept_bytes(), 3 << 20);
  AlignedBuffer b = m.alloc(3 << 20);
  EXPECT_EQ(b.data(), where);
  EXPECT_EQ(m.kept_bytes(), 0);
  for (size_t i = 0; i < b.bytes(); i += 4093) ASSERT_EQ(b.as<unsigned char>()[i], 0) << i;
  EXPECT_EQ(m.bytes(), (3 << 20) + (1 << 20));
  EXPECT_EQ(m.peak_bytes(), (3 << 20) + (1 << 20));
  m.free(other);
  m.release_kept();
  EXPECT_EQ(m.kept_bytes(), 0);
}

}  // namespace
}  // namespace zinc

namespace zinc {
namespace {

std::string fresh_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "zinc-ckpt-" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

// One rank: a resumed run continues bit for bit (stage 3 with its
// parameters offloaded is the one-rank ZeRO-3).
TEST(Checkpoint, OneRankResumesBitExactAtEveryStageAndOffload) {
  testing_train::for_each_stage_and_offload([](bool bf16, int stage, const std::string& offload,
                                               const std::string& what) {
    testing_train::RunSpec r;
    r.bf16 = bf16;
    r.stage = stage;
    r.offload = offload;
    if (stage == 3 && offload != "none")
      r.zero_extra = {{"offload_param", {{"device", offload}, {"nvme_path", ::testing::TempDir()}}}};
    testing_train::expect_bit_exact_resume(r, nullptr, fresh_dir("resume"), 3, what);
  });
}

// fp16: the loss scale, its hysteresis and window position come back with
// the checkpoint (a resumed run that restarted at 2^20 would skip steps the
// straight run takes). The scale falls from 2^20 and grows every 2 clean steps.
TEST(Checkpoint, Fp16ResumesBitExactWithItsLossScale) {
  for (int stage : {0, 3}) {
    testing_train::RunSpec r;
    r.stage = stage;
    r.top_extra = {{"fp16", {{"enabled", true}, {"initial_scale_power", 20}, {"hysteresis", 2}, {"loss_scale_window", 2}}}};
    testing_train::expect_bit_exact_resume(r, nullptr, fresh_dir("resume16"), 6, "fp16 stage " + std::to_string(stage));
  }
}

// Lamb keeps no state beyond master, m and v: a resumed run continues bit for
// bit, its OneCycle lr and momentum included.
TEST(Checkpoint, OneRankLambResumesBitExact) {
  testing_train::for_each_stage_and_offload([](bool bf16, int stage, const std::string& offload,
                                               const std::string& what) {
    if (offload == "cpu") return;  // the same walk as RAM; nvme and none cover both state paths
    testing_train::RunSpec r;
    r.bf16 = bf16;
    r.stage = stage;
    r.offload = offload;
    r.optimizer = {{"type", "Lamb"}, {"params", {{"lr", 5e-3}, {"weight_decay", 0.01}}}};
    r.scheduler = {{"type", "OneCycle"},
                   {"params", {{"cycle_min_lr", 1e-3}, {"cycle_max_lr", 5e-3}, {"cycle_first_step_size", 2}}}};
    if (stage == 3 && offload != "none")
      r.zero_extra = {{"offload_param", {{"device", offload}, {"nvme_path", ::testing::TempDir()}}}};
    testing_train::expect_bit_exact_resume(r, nullptr, fresh_dir("lamb-resume"), 3, "Lamb " + what);
  });
}

// A save reads the optimizer states on NVMe and writes nothing back to the
// store (the walk is a reader's); a load writes them without reading the old
// ones first; the weights come back.
TEST(Checkpoint, NvmeStatesAreOnlyReadBySaveAndOnlyWrittenByLoad) {
  testing_train::RunSpec r;
  r.stage = 1;
  r.offload = "nvme";
  const std::string dir = fresh_dir("nvme-read-only");
  auto model = testing_train::make_model(r.model);
  Engine e = Engine::initialize(model, testing_train::make_config(r));
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  DataLoader loader(std::shared_ptr<const DataSource>(make_data_source(dc)), r.global_batch, 1, 1, 0, 7);
  for (int s = 0; s < 2; ++s) e.train_batch(loader);  // weights that a fresh engine does not have
  const int64_t read0 = e.offload_bytes_read(), written0 = e.offload_bytes_written();
  e.save_checkpoint(dir);
  EXPECT_GT(e.offload_bytes_read(), read0);
  EXPECT_EQ(e.offload_bytes_written(), written0);
  const std::vector<float> before = testing_train::all_weights(e);
  Engine again = Engine::initialize(testing_train::make_model(r.model), testing_train::make_config(r));
  EXPECT_NE(testing_train::all_weights(again), before);
  // A load writes the states to the store without reading the old ones.
  const int64_t read1 = again.offload_bytes_read(), written1 = again.offload_bytes_written();
  again.load_checkpoint(dir);
  EXPECT_EQ(again.offload_bytes_read(), read1);
  EXPECT_GT(again.offload_bytes_written(), written1);
  EXPECT_EQ(testing_train::all_weights(again), before);
}

// A flipped byte and a cut file are each an error naming the file, the
// block and the state; so is a checkpoint of another model.
TEST(Checkpoint, CorruptedTruncatedAndForeignCheckpointsAreNamedErrors) {
  testing_train::RunSpec r;
  const std::string dir = fresh_dir("bad");
  testing_train::train_segment(r, nullptr, 1, "", dir);
  const std::string bin = dir + "/global_step1/rank00000.bin";
  auto expect_load_error = [&](const std::string& want, testing_train::RunSpec spec) {
    std::string what;
    try {
      testing_train::train_segment(spec, nullptr, 1, dir);
    } catch (const std::exception& e) {
      what = e.what();
    }
    EXPECT_NE(what.find(want), std::string::npos) << "want '" << want << "' in: " << what;
    return what;
  };
  auto flip = [&] {  // one bit of a byte of the first block's master weights
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(100);
    f.write(&c, 1);
  };
  flip();
  const std::string corrupt = expect_load_error("rank00000.bin is corrupted", r);
  EXPECT_NE(corrupt.find("block '"), std::string::npos) << corrupt;
  flip();  // back
  // Cut 100 bytes into the last block's Adam v (its place from the index:
  // regions start 4 KiB aligned, so the file's end is padding).
  const nlohmann::json index = read_json_file(dir + "/global_step1/rank00000.json");
  std::filesystem::resize_file(bin, index["blocks"].back()["v"]["file_offset"].get<uint64_t>() + 100);
  const std::string cut = expect_load_error("rank00000.bin is truncated", r);
  EXPECT_NE(cut.find("Adam v"), std::string::npos) << cut;
  testing_train::train_segment(r, nullptr, 1, "", dir);  // whole again (the tag saved anew replaces the cut one)
  testing_train::RunSpec mlp = r;
  mlp.model = "mlp";
  expect_load_error("differs from this model", mlp);
  std::filesystem::remove(dir + "/latest");
  expect_load_error("latest not found", r);
}

}  // namespace
}  // namespace zinc
