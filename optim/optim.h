// zinc optim: Adam/AdamW over flat fp32 spans, learning-rate schedules and
// gradient-clipping math.
//
// The update follows DeepSpeed's CPU/fused Adam exactly (per element, step t
// counted from 1, g = grad * grad_scale):
//   Adam  (adam_w_mode false): g += weight_decay * p
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps          (no bias correction: sqrt(v) + eps)
//   AdamW (adam_w_mode true):  p -= lr * weight_decay * p
//   p -= lr / (1 - b1^t) * m / denom                 (no bias correction: lr * m / denom)
// then, if requested, the new p is written as bf16 (core's RNE conversion).
// This is the plain reference implementation; it is threaded over chunks and
// its result does not depend on the thread count (each element is
// independent). Functions are reentrant; callers own all buffers.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace zinc::optim {

struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;
  bool bias_correction = true;
};

// One Adam step over n elements. step >= 1. bf16_out may be null.
void adam_step(const AdamParams& p, int64_t step, float grad_scale, float* param, const float* grad,
               float* m, float* v, int64_t n, bf16* bf16_out);

// Gradient clipping by global L2 norm, as DeepSpeed computes it: the factor
// to multiply gradients by is max_norm / (norm + 1e-6) when that is below 1,
// else 1. max_norm <= 0 disables clipping (factor 1).
double clip_coefficient(double norm, double max_norm);

// Learning-rate schedules with DeepSpeed's names and formulas. lr_at(s) is the
// learning rate used by optimizer step s (s = 0 for the first step), i.e.
// DeepSpeed's value at last_batch_iteration = s. (DeepSpeed itself runs its
// very first step at the optimizer's configured lr, before the schedule's
// first step() call; zinc applies the schedule from the first step, so step
// 0 of a warmup starts at the warmup minimum.)
struct ScheduleParams {
  std::string type;  // "" = constant base_lr, "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
  double base_lr = 1e-3;  // the optimizer's lr (constant, and WarmupCosineLR's reference)
  double warmup_min_lr = 0.0, warmup_max_lr = 0.001;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // "log" | "linear"
  int64_t total_num_steps = 0;
  double warmup_min_ratio = 0.0, cos_min_ratio = 0.0001;
};

class LrSchedule {
 public:
  explicit LrSchedule(ScheduleParams p);
  double lr_at(int64_t step) const;
  const ScheduleParams& params() const { return p_; }

 private:
  double warmup_gamma(int64_t step) const;  // in [0, 1) during warmup
  ScheduleParams p_;
  int64_t warmup_steps_;  // max(2, warmup_num_steps), as DeepSpeed
};

}  // namespace zinc::optim
