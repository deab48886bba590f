// zinc optim: loss scaling for fp16 training, with DeepSpeed's rules.
//
// Note [dynamic loss scaling]
// fp16 holds magnitudes from 2^-24 to 65504 only, so small gradients flush
// to zero. Backward therefore runs on loss * scale, and the step divides the
// gradients by the same scale. A scale too large makes some gradient (or a
// sum of them on the wire) overflow to Inf or NaN: the step is then skipped
// and the scale lowered. Per global batch, update(overflow):
//   overflow: if hysteresis is 1 (or the configured hysteresis is 1), the
//     scale is divided by 2 (not below min_scale); otherwise the remaining
//     hysteresis drops by one and the scale stays. An overflow at min_scale
//     is an error: the run cannot make progress (DeepSpeed raises too).
//   no overflow: with consecutive_hysteresis the hysteresis is refilled at
//     once; when the steps since the last overflow are a multiple of
//     window, the scale doubles (and, without consecutive_hysteresis, the
//     hysteresis is refilled).
//   The iteration counter counts both.
// A static scale (fp16.loss_scale > 0) never changes; an overflow still
// skips the step (zinc skips every non-finite step). Plain value type.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace zinc::optim {

struct LossScaleParams {
  bool dynamic = true;       // fp16.loss_scale == 0
  double static_scale = 1;   // fp16.loss_scale when > 0
  int initial_scale_power = 16;
  int64_t window = 1000;     // fp16.loss_scale_window
  int64_t hysteresis = 2;    // fp16.hysteresis (DeepSpeed's delayed_shift)
  bool consecutive_hysteresis = false;
  double min_scale = 1;      // fp16.min_loss_scale
};

class LossScaler {
 public:
  LossScaler() = default;
  explicit LossScaler(const LossScaleParams& p)
      : p_(p),
        scale_(p.dynamic ? std::ldexp(1.0, p.initial_scale_power) : p.static_scale),
        hysteresis_(p.hysteresis) {}

  double scale() const { return scale_; }
  int64_t hysteresis_left() const { return hysteresis_; }
  int64_t iteration() const { return iter_; }
  int64_t last_overflow_iteration() const { return last_overflow_; }
  const LossScaleParams& params() const { return p_; }

  // After each global batch: whether its gradients overflowed.
  void update(bool overflow) {
    if (!p_.dynamic) {
      iter_ += 1;
      return;
    }
    if (overflow) {
      if (p_.hysteresis == 1 || hysteresis_ == 1) {
        if (scale_ <= p_.min_scale)
          throw Error("fp16: the gradients overflow at the smallest loss scale (fp16.min_loss_scale " +
                      std::to_string(p_.min_scale) + "); training cannot make progress (lower the learning rate "
                      "or use bf16)");
        scale_ = std::max(scale_ / 2, p_.min_scale);
      } else {
        hysteresis_ -= 1;
      }
      last_overflow_ = iter_;
    } else {
      if (p_.consecutive_hysteresis) hysteresis_ = p_.hysteresis;
      // DeepSpeed 0.19's rule: the steps since the last overflow, not
      // counting this one, a positive multiple of the window.
      if (const int64_t stable = iter_ - last_overflow_ - 1; stable > 0 && stable % p_.window == 0) {
        if (!p_.consecutive_hysteresis) hysteresis_ = p_.hysteresis;
        scale_ *= 2;
      }
    }
    iter_ += 1;
  }

  // Checkpoints restore the whole state.
  void restore(double scale, int64_t hysteresis, int64_t iteration, int64_t last_overflow) {
    scale_ = scale;
    hysteresis_ = hysteresis;
    iter_ = iteration;
    last_overflow_ = last_overflow;
  }

 private:
  LossScaleParams p_{};
  double scale_ = 1;
  int64_t hysteresis_ = 2;
  int64_t iter_ = 0;
  int64_t last_overflow_ = -1;
};

}  // namespace zinc::optim
