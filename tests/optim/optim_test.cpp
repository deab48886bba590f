#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "optim/optim.h"

namespace zinc::optim {
namespace {

// Independent double-precision statement of DeepSpeed's Adam update.
void adam_reference(const AdamParams& p, int64_t t, double scale, std::vector<double>& w,
                    const std::vector<float>& g, std::vector<double>& m, std::vector<double>& v) {
  for (size_t i = 0; i < w.size(); ++i) {
    double gi = g[i] * scale;
    if (!p.adam_w_mode) gi += p.weight_decay * w[i];
    m[i] = p.beta1 * m[i] + (1 - p.beta1) * gi;
    v[i] = p.beta2 * v[i] + (1 - p.beta2) * gi * gi;
    double mhat = p.bias_correction ? m[i] / (1 - std::pow(p.beta1, t)) : m[i];
    double vfac = p.bias_correction ? 1 / std::sqrt(1 - std::pow(p.beta2, t)) : 1.0;
    if (p.adam_w_mode) w[i] -= p.lr * p.weight_decay * w[i];
    w[i] -= p.lr * mhat / (std::sqrt(v[i]) * vfac + p.eps);
  }
}

struct AdamCase {
  bool adamw;
  bool bias_correction;
  double wd;
};

class AdamAgainstReference : public ::testing::TestWithParam<AdamCase> {};

TEST_P(AdamAgainstReference, FiveStepsAgreeWithDoublePrecisionFormula) {
  AdamCase c = GetParam();
  AdamParams p;
  p.lr = 1e-2;
  p.weight_decay = c.wd;
  p.adam_w_mode = c.adamw;
  p.bias_correction = c.bias_correction;
  const size_t n = 1031;  // odd length
  Rng rng(11);
  std::vector<float> w(n), m(n, 0), v(n, 0), g(n);
  std::vector<double> wd(n), md(n, 0), vd(n, 0);
  for (size_t i = 0; i < n; ++i) wd[i] = w[i] = static_cast<float>(rng.normal());
  for (int64_t t = 1; t <= 5; ++t) {
    for (size_t i = 0; i < n; ++i) g[i] = static_cast<float>(rng.normal() * 0.1);
    adam_step(p, t, 0.5f, w.data(), g.data(), m.data(), v.data(), static_cast<int64_t>(n), nullptr);
    adam_reference(p, t, 0.5, wd, g, md, vd);
  }
  // fp32 arithmetic over 5 steps: a few ulps of the update size (lr = 1e-2).
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(w[i], wd[i], 2e-6 * (1 + std::fabs(wd[i]))) << i;
}

INSTANTIATE_TEST_SUITE_P(Modes, AdamAgainstReference,
                         ::testing::Values(AdamCase{true, true, 0.1}, AdamCase{false, true, 0.1},
                                           AdamCase{true, false, 0.0}, AdamCase{false, false, 0.01}));

// The moments decay by the fp32 betas, so a constant gradient's first
// moment after one step is (1 - float(beta1)) g and the second
// (1 - float(beta2)) g^2; the bias corrections must be those betas' too for
// the first step to move each weight by exactly lr (DeepSpeed's CPU Adam
// does so). With the exact double betas in the corrections it moved
// 6.7e-6 off at beta2 0.999 and 6.8e-4 off at 0.99999.
TEST(Adam, FirstStepOfAConstantGradientMovesExactlyLr) {
  for (double beta2 : {0.999, 0.9999, 0.99999, 0.95}) {
    AdamParams p;
    p.lr = 1e-3;
    p.beta1 = 0.9;
    p.beta2 = beta2;
    p.eps = 0;
    p.weight_decay = 0;
    std::vector<float> g{0.3f, -1e-3f, 7.0f, -2.5e-5f, 1.0f};
    const auto n = static_cast<int64_t>(g.size());
    std::vector<float> w(g.size(), 0.0f), m(g.size(), 0.0f), v(g.size(), 0.0f);
    adam_step(p, 1, 1.0f, w.data(), g.data(), m.data(), v.data(), n, nullptr);
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(w[i], -std::copysign(1e-3, g[i]), 4e-7 * 1e-3) << "beta2 " << beta2 << ", gradient " << g[i];
  }
}

TEST(Adam, AdamWAndL2ModesDifferWhenWeightDecayIsOn) {
  AdamParams a, b;
  a.weight_decay = b.weight_decay = 0.1;
  a.adam_w_mode = true;
  b.adam_w_mode = false;
  std::vector<float> w1{1.0f, -2.0f}, w2 = w1, g{0.3f, 0.1f}, m1(2), v1(2), m2(2), v2(2);
  adam_step(a, 1, 1.0f, w1.data(), g.data(), m1.data(), v1.data(), 2, nullptr);
  adam_step(b, 1, 1.0f, w2.data(), g.data(), m2.data(), v2.data(), 2, nullptr);
  EXPECT_NE(w1[0], w2[0]);
  EXPECT_NE(m1[0], m2[0]);  // L2 mode folds the decay into the gradient
}

TEST(Adam, Bf16CopyOutEqualsCoreConversionBitForBit) {
  AdamParams p;
  const size_t n = 777;
  Rng rng(5);
  std::vector<float> w(n), m(n), v(n), g(n);
  for (size_t i = 0; i < n; ++i) {
    w[i] = static_cast<float>(rng.normal());
    g[i] = static_cast<float>(rng.normal());
  }
  std::vector<bf16> out(n);
  adam_step(p, 1, 1.0f, w.data(), g.data(), m.data(), v.data(), static_cast<int64_t>(n), out.data());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i].bits, float_to_bf16(w[i]).bits);
}

TEST(Adam, ResultDoesNotDependOnThreadCount) {
  AdamParams p;
  p.weight_decay = 0.01;
  const size_t n = 300001;
  Rng rng(9);
  std::vector<float> w(n), g(n);
  for (size_t i = 0; i < n; ++i) {
    w[i] = static_cast<float>(rng.normal());
    g[i] = static_cast<float>(rng.normal());
  }
  std::vector<float> w1 = w, w2 = w, m1(n), v1(n), m2(n), v2(n);
  omp_set_num_threads(1);
  adam_step(p, 3, 0.7f, w1.data(), g.data(), m1.data(), v1.data(), static_cast<int64_t>(n), nullptr);
  omp_set_num_threads(2);
  adam_step(p, 3, 0.7f, w2.data(), g.data(), m2.data(), v2.data(), static_cast<int64_t>(n), nullptr);
  EXPECT_EQ(std::memcmp(w1.data(), w2.data(), n * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(v1.data(), v2.data(), n * sizeof(float)), 0);
}

TEST(Clip, CoefficientIsMaxNormOverNormOnlyWhenAbove) {
  EXPECT_DOUBLE_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_NEAR(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6), 1e-15);
  EXPECT_DOUBLE_EQ(clip_coefficient(100.0, 0.0), 1.0);  // 0 disables clipping
  // At norm == max_norm DeepSpeed's 1e-6 guard already clips, by 1/(1 + 1e-6).
  EXPECT_NEAR(clip_coefficient(1.0, 1.0), 1.0 / (1.0 + 1e-6), 1e-15);
}

TEST(Schedule, ConstantWithoutScheduler) {
  ScheduleParams p;
  LrSchedule s(p, 3e-4);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 3e-4);
  EXPECT_DOUBLE_EQ(s.lr_at(1000), 3e-4);
}

TEST(Schedule, WarmupLrLogAndLinear) {
  ScheduleParams p;
  p.type = ScheduleType::kWarmupLR;
  p.warmup_min_lr = 0.1;
  p.warmup_max_lr = 1.1;
  p.warmup_num_steps = 10;
  LrSchedule log_s(p, 1e-3);
  EXPECT_DOUBLE_EQ(log_s.lr_at(0), 0.1);  // log(1) = 0
  EXPECT_NEAR(log_s.lr_at(4), 0.1 + std::log(5.0) / std::log(10.0), 1e-12);
  EXPECT_NEAR(log_s.lr_at(9), 0.1 + 1.0, 1e-12);  // log(10)/log(10)
  EXPECT_DOUBLE_EQ(log_s.lr_at(10), 1.1);
  EXPECT_DOUBLE_EQ(log_s.lr_at(500), 1.1);
  p.warmup_type = WarmupType::kLinear;
  LrSchedule lin(p, 1e-3);
  EXPECT_NEAR(lin.lr_at(5), 0.1 + 0.5, 1e-12);
  EXPECT_NEAR(lin.lr_at(9), 0.1 + 0.9, 1e-12);
  EXPECT_DOUBLE_EQ(lin.lr_at(10), 1.1);
}

TEST(Schedule, WarmupNumStepsBelowTwoActsAsTwoLikeDeepSpeed) {
  ScheduleParams p;
  p.type = ScheduleType::kWarmupLR;
  p.warmup_num_steps = 0;
  p.warmup_max_lr = 1.0;
  LrSchedule s(p, 1e-3);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.0);
  EXPECT_NEAR(s.lr_at(1), std::log(2.0) / std::log(2.0), 1e-12);
  EXPECT_DOUBLE_EQ(s.lr_at(2), 1.0);
}

TEST(Schedule, WarmupDecayLrDecaysLinearlyToZero) {
  ScheduleParams p;
  p.type = ScheduleType::kWarmupDecayLR;
  p.warmup_min_lr = 0.0;
  p.warmup_max_lr = 2.0;
  p.warmup_num_steps = 10;
  p.total_num_steps = 30;
  p.warmup_type = WarmupType::kLinear;
  LrSchedule s(p, 1e-3);
  EXPECT_NEAR(s.lr_at(3), 0.6, 1e-12);
  EXPECT_NEAR(s.lr_at(10), 2.0, 1e-12);   // (30-10)/20
  EXPECT_NEAR(s.lr_at(20), 1.0, 1e-12);   // (30-20)/20
  EXPECT_NEAR(s.lr_at(29), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(s.lr_at(30), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(45), 0.0);
}

TEST(Schedule, WarmupCosineLrIsARatioOfTheOptimizerLr) {
  ScheduleParams p;
  p.type = ScheduleType::kWarmupCosineLR;
  p.warmup_min_ratio = 0.2;
  p.warmup_num_steps = 10;
  p.total_num_steps = 20;
  p.cos_min_ratio = 0.01;
  p.warmup_type = WarmupType::kLinear;
  LrSchedule s(p, 0.5);  // the optimizer's lr
  EXPECT_NEAR(s.lr_at(0), 0.5 * 0.2, 1e-12);
  EXPECT_NEAR(s.lr_at(5), 0.5 * (0.2 + 0.8 * 0.5), 1e-12);
  // After warmup: ratio = cos_min + (1 - cos_min) * (1 + cos(pi * (s - w + 1) / (total - w))) / 2
  EXPECT_NEAR(s.lr_at(10), 0.5 * (0.01 + 0.99 * (1 + std::cos(M_PI * 1 / 10.0)) / 2), 1e-12);
  EXPECT_NEAR(s.lr_at(14), 0.5 * (0.01 + 0.99 * 0.5), 1e-12);  // quarter: cos(pi/2) = 0
  EXPECT_NEAR(s.lr_at(19), 0.5 * 0.01, 1e-12);                 // end: cos(pi) = -1
  EXPECT_NEAR(s.lr_at(40), 0.5 * 0.01, 1e-12);                 // stays at the minimum
}

// The type is an enum (an unknown DeepSpeed type is the config's error:
// ConfigScheduler in config_test); each has DeepSpeed's name.
TEST(Schedule, EveryTypeHasDeepSpeedsName) {
  EXPECT_STREQ(schedule_type_name(ScheduleType::kConstant), "constant");
  EXPECT_STREQ(schedule_type_name(ScheduleType::kWarmupLR), "WarmupLR");
  EXPECT_STREQ(schedule_type_name(ScheduleType::kWarmupDecayLR), "WarmupDecayLR");
  EXPECT_STREQ(schedule_type_name(ScheduleType::kWarmupCosineLR), "WarmupCosineLR");
  EXPECT_STREQ(schedule_type_name(ScheduleType::kOneCycle), "OneCycle");
}

// DeepSpeed's OneCycle written out plainly at last_batch_iteration = s
// (scale from the position i = s + 1 within the cycle).
struct OneCycleRef {
  double min_lr, max_lr, lr_rate, min_mom, max_mom, mom_rate;
  int64_t first, second, decay_size;
  double scale(int64_t s) const {
    const double total = static_cast<double>(first + second);
    const double pos = std::fmod(static_cast<double>(s + 1), total) / total;  // x in [0, 1)
    const double r = static_cast<double>(first) / total;
    return pos <= r ? pos / r : (1.0 - pos) / (1.0 - r);
  }
  double lr(int64_t s) const {
    if (s < first + second) return min_lr + (max_lr - min_lr) * scale(s);
    if (decay_size == 0) return min_lr;
    return min_lr / (1.0 + lr_rate * static_cast<double>(s - first - second + 1) / static_cast<double>(decay_size));
  }
  double mom(int64_t s) const {
    if (s < first + second) return max_mom - (max_mom - min_mom) * scale(s);
    if (decay_size == 0) return max_mom;
    return max_mom * (1.0 + mom_rate * static_cast<double>(s - first - second + 1) / static_cast<double>(decay_size));
  }
};

ScheduleParams one_cycle(const OneCycleRef& r) {
  ScheduleParams p;
  p.type = ScheduleType::kOneCycle;
  p.cycle_min_lr = r.min_lr;
  p.cycle_max_lr = r.max_lr;
  p.decay_lr_rate = r.lr_rate;
  p.cycle_first_step_size = r.first;
  p.cycle_second_step_size = r.second;
  p.decay_step_size = r.decay_size;
  p.cycle_min_mom = r.min_mom;
  p.cycle_max_mom = r.max_mom;
  p.decay_mom_rate = r.mom_rate;
  return p;
}

TEST(Schedule, OneCycleRisesFallsAndDecaysAsDeepSpeedWithMomentumInverse) {
  // Uneven halves: 4 steps up, 6 down, then decay every 5 steps.
  const OneCycleRef r{0.01, 0.1, 0.5, 0.85, 0.95, 0.02, 4, 6, 5};
  LrSchedule s(one_cycle(r), 1e-3);
  ASSERT_TRUE(s.sets_betas());
  for (int64_t k = 0; k < 40; ++k) {
    EXPECT_NEAR(s.lr_at(k), r.lr(k), 1e-14) << "step " << k;
    EXPECT_NEAR(s.betas_at(k).beta1, r.mom(k), 1e-14) << "step " << k;
    EXPECT_EQ(s.betas_at(k).beta2, 0.99);  // DeepSpeed's fixed second beta
  }
  // Landmarks: the peak at i = 4 (s = 3), the floor at the cycle's end, the decay.
  EXPECT_NEAR(s.lr_at(0), 0.01 + 0.09 * 0.25, 1e-14);
  EXPECT_NEAR(s.lr_at(3), 0.1, 1e-14);
  EXPECT_NEAR(s.betas_at(3).beta1, 0.85, 1e-14);
  EXPECT_NEAR(s.lr_at(9), 0.01, 1e-14);  // i = 10 = T: the cycle closes at the minimum
  EXPECT_NEAR(s.betas_at(9).beta1, 0.95, 1e-14);
  EXPECT_NEAR(s.lr_at(10), 0.01 / (1 + 0.5 * 1 / 5.0), 1e-14);
  EXPECT_NEAR(s.lr_at(24), 0.01 / (1 + 0.5 * 15 / 5.0), 1e-14);
  EXPECT_NEAR(s.betas_at(24).beta1, 0.95 * (1 + 0.02 * 15 / 5.0), 1e-14);
}

TEST(Schedule, OneCycleWithoutDecayHoldsTheFloorAndDefaultsTheSecondHalf) {
  OneCycleRef r{0.2, 1.0, 0.0, 0.8, 0.9, 0.0, 5, 5, 0};
  ScheduleParams p = one_cycle(r);
  p.cycle_second_step_size = -1;  // = first, as DeepSpeed's None
  p.decay_lr_rate = 0.7;          // no effect: decay_step_size is 0
  p.cycle_momentum = false;
  LrSchedule s(p, 1e-3);
  EXPECT_FALSE(s.sets_betas());
  EXPECT_THROW(s.betas_at(0), Error);
  for (int64_t k = 0; k < 30; ++k) EXPECT_NEAR(s.lr_at(k), r.lr(k), 1e-14) << "step " << k;
  EXPECT_NEAR(s.lr_at(4), 1.0, 1e-14);
  EXPECT_NEAR(s.lr_at(7), 0.2 + 0.8 * 0.4, 1e-14);
  EXPECT_DOUBLE_EQ(s.lr_at(100), 0.2);
}

}  // namespace
}  // namespace zinc::optim
