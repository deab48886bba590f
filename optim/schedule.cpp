#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "optim/optim.h"

namespace zinc::optim {

LrSchedule::LrSchedule(ScheduleParams p) : p_(std::move(p)) {
  warmup_steps_ = std::max<int64_t>(2, p_.warmup_num_steps);
  if (!p_.type.empty() && p_.type != "WarmupLR" && p_.type != "WarmupDecayLR" &&
      p_.type != "WarmupCosineLR")
    throw Error("unknown learning-rate schedule '" + p_.type + "'");
}

double LrSchedule::warmup_gamma(int64_t s) const {
  if (p_.warmup_type == "linear") return static_cast<double>(s) / static_cast<double>(warmup_steps_);
  return std::log(static_cast<double>(s + 1)) / std::log(static_cast<double>(warmup_steps_));
}

double LrSchedule::lr_at(int64_t s) const {
  const std::string& t = p_.type;
  if (t.empty()) return p_.base_lr;
  if (t == "WarmupLR" || t == "WarmupDecayLR") {
    double gamma;
    if (s < warmup_steps_) {
      gamma = warmup_gamma(s);
    } else if (t == "WarmupLR") {
      gamma = 1.0;
    } else {
      double span = std::max<double>(1.0, static_cast<double>(p_.total_num_steps - warmup_steps_));
      gamma = std::max(0.0, static_cast<double>(p_.total_num_steps - s) / span);
    }
    return p_.warmup_min_lr + (p_.warmup_max_lr - p_.warmup_min_lr) * gamma;
  }
  // WarmupCosineLR: a ratio of the optimizer's lr.
  double ratio;
  if (s < warmup_steps_) {
    ratio = p_.warmup_min_ratio + (1.0 - p_.warmup_min_ratio) * warmup_gamma(s);
  } else {
    double real_total = static_cast<double>(std::max<int64_t>(1, p_.total_num_steps - warmup_steps_));
    // Past total_num_steps the ratio stays at its minimum instead of rising again.
    double real_step = std::min(real_total, static_cast<double>(s - warmup_steps_ + 1));
    double c = (1.0 + std::cos(M_PI * real_step / real_total)) / 2.0;
    ratio = std::max(0.0, p_.cos_min_ratio + (1.0 - p_.cos_min_ratio) * c);
  }
  return p_.base_lr * ratio;
}

}  // namespace zinc::optim
