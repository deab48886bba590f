#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "optim/optim.h"

namespace zinc::optim {

const char* schedule_type_name(ScheduleType t) {
  switch (t) {
    case ScheduleType::kConstant: return "constant";
    case ScheduleType::kWarmupLR: return "WarmupLR";
    case ScheduleType::kWarmupDecayLR: return "WarmupDecayLR";
    case ScheduleType::kWarmupCosineLR: return "WarmupCosineLR";
    case ScheduleType::kOneCycle: return "OneCycle";
  }
  return "?";
}

const char* warmup_type_name(WarmupType t) { return t == WarmupType::kLog ? "log" : "linear"; }

namespace {

constexpr unsigned bit(ScheduleType t) { return 1u << static_cast<unsigned>(t); }
constexpr unsigned kWarmupLrs = bit(ScheduleType::kWarmupLR) | bit(ScheduleType::kWarmupDecayLR);
constexpr unsigned kWarmups = kWarmupLrs | bit(ScheduleType::kWarmupCosineLR);
constexpr unsigned kDecays = bit(ScheduleType::kWarmupDecayLR) | bit(ScheduleType::kWarmupCosineLR);
constexpr unsigned kCosine = bit(ScheduleType::kWarmupCosineLR);
constexpr unsigned kOneCycle = bit(ScheduleType::kOneCycle);
constexpr double kInf = std::numeric_limits<double>::infinity();

ScheduleKey number(const char* name, double ScheduleParams::*f, unsigned types, double lo, double hi = kInf,
                   bool hi_open = false) {
  ScheduleKey k{.name = name, .number = f, .types = types, .lo = lo, .hi = hi};
  k.hi_open = hi_open;
  return k;
}
ScheduleKey integer(const char* name, int64_t ScheduleParams::*f, unsigned types, double lo) {
  return ScheduleKey{.name = name, .integer = f, .types = types, .lo = lo};
}

ScheduleKey required(ScheduleKey k) {
  k.required = true;
  return k;
}
ScheduleKey null_means(ScheduleKey k, int64_t v) {
  k.nullable = true;
  k.null_value = v;
  return k;
}

// DeepSpeed's keys and bounds; the order is the order of error messages.
const std::vector<ScheduleKey>& key_table() {
  using P = ScheduleParams;
  static const std::vector<ScheduleKey> keys = {
        number("warmup_min_lr", &P::warmup_min_lr, kWarmupLrs, 0),
        number("warmup_max_lr", &P::warmup_max_lr, kWarmupLrs, 0),
        number("warmup_min_ratio", &P::warmup_min_ratio, kCosine, 0, 1),
        number("cos_min_ratio", &P::cos_min_ratio, kCosine, 0, 1),
        integer("warmup_num_steps", &P::warmup_num_steps, kWarmups, 0),
        ScheduleKey{.name = "warmup_type", .warmup = &P::warmup_type, .types = kWarmups},
        required(integer("total_num_steps", &P::total_num_steps, kDecays, 1)),
        required(number("cycle_min_lr", &P::cycle_min_lr, kOneCycle, 0)),
        required(number("cycle_max_lr", &P::cycle_max_lr, kOneCycle, 0)),
        number("decay_lr_rate", &P::decay_lr_rate, kOneCycle, 0),
        integer("cycle_first_step_size", &P::cycle_first_step_size, kOneCycle, 1),
        null_means(integer("cycle_second_step_size", &P::cycle_second_step_size, kOneCycle, 0), -1),
        integer("cycle_first_stair_count", &P::cycle_first_stair_count, kOneCycle, 0),
        null_means(integer("cycle_second_stair_count", &P::cycle_second_stair_count, kOneCycle, 0), -1),
        integer("decay_step_size", &P::decay_step_size, kOneCycle, 0),
        ScheduleKey{.name = "cycle_momentum", .flag = &P::cycle_momentum, .types = kOneCycle},
        number("cycle_min_mom", &P::cycle_min_mom, kOneCycle, 0, 1, true),
        number("cycle_max_mom", &P::cycle_max_mom, kOneCycle, 0, 1, true),
        number("decay_mom_rate", &P::decay_mom_rate, kOneCycle, 0),
  };
  return keys;
}

}  // namespace

std::span<const ScheduleKey> schedule_keys() { return key_table(); }

LrSchedule::LrSchedule(ScheduleParams p, double base_lr) : p_(std::move(p)), base_lr_(base_lr) {
  warmup_steps_ = std::max<int64_t>(2, p_.warmup_num_steps);
  if (p_.type == ScheduleType::kOneCycle && p_.cycle_first_step_size + second_step_size() <= 0)
    throw Error("OneCycle: cycle_first_step_size + cycle_second_step_size must be > 0");
}

int64_t LrSchedule::second_step_size() const {
  return p_.cycle_second_step_size < 0 ? p_.cycle_first_step_size : p_.cycle_second_step_size;
}

int64_t LrSchedule::second_stair_count() const {
  return p_.cycle_second_stair_count < 0 ? p_.cycle_first_stair_count : p_.cycle_second_stair_count;
}

// DeepSpeed's OneCycle._get_scale_factor at last_batch_iteration = s, in
// the same floating-point operations (0.19: with its stairs).
double LrSchedule::one_cycle_scale(int64_t s) const {
  const double first = static_cast<double>(p_.cycle_first_step_size);
  const double second = static_cast<double>(second_step_size());
  const double total = first + second;
  const double ratio = first / total;
  const double i = static_cast<double>(s + 1);
  const double cycle = std::floor(1.0 + i / total);
  const double x = 1.0 + i / total - cycle;
  const bool rising = x <= ratio;
  const int64_t stairs = rising ? p_.cycle_first_stair_count : second_stair_count();
  if (stairs <= 0) return rising ? x / ratio : (x - 1.0) / (ratio - 1.0);
  // Quantised from the integer position in the cycle, not from the scale
  // (which can land 1e-16 under a stair at the peak), as DeepSpeed does.
  const double n = static_cast<double>(stairs);
  const double c = std::fmod(i, total);
  const double position = c <= first ? c * n / first : (total - c) * n / second;
  return std::floor(position) / n;
}

bool LrSchedule::in_cycle(int64_t s) const {
  return static_cast<double>(s) < static_cast<double>(p_.cycle_first_step_size + second_step_size());
}

ScheduleBetas LrSchedule::betas_at(int64_t s) const {
  if (!sets_betas()) throw Error("betas_at: the schedule does not set the betas (OneCycle with cycle_momentum only)");
  ScheduleBetas b;
  if (in_cycle(s)) {
    b.beta1 = p_.cycle_max_mom - (p_.cycle_max_mom - p_.cycle_min_mom) * one_cycle_scale(s);
  } else if (p_.decay_step_size == 0 || p_.decay_mom_rate == 0.0) {
    b.beta1 = p_.cycle_max_mom;
  } else {
    const double d = static_cast<double>(s - p_.cycle_first_step_size - second_step_size() + 1);
    b.beta1 = p_.cycle_max_mom * (1.0 + p_.decay_mom_rate * (d / static_cast<double>(p_.decay_step_size)));
  }
  return b;
}

// DeepSpeed's operations: log warmup multiplies by 1 / log(warmup steps).
double LrSchedule::warmup_gamma(int64_t s) const {
  if (p_.warmup_type == WarmupType::kLinear) return static_cast<double>(s) / static_cast<double>(warmup_steps_);
  const double inverse_log_warm_up = 1.0 / std::log(static_cast<double>(warmup_steps_));
  return inverse_log_warm_up * std::log(static_cast<double>(s + 1));
}

double LrSchedule::lr_at(int64_t s) const {
  const ScheduleType t = p_.type;
  if (t == ScheduleType::kConstant) return base_lr_;
  if (t == ScheduleType::kOneCycle) {
    if (in_cycle(s)) return p_.cycle_min_lr + (p_.cycle_max_lr - p_.cycle_min_lr) * one_cycle_scale(s);
    if (p_.decay_step_size == 0 || p_.decay_lr_rate == 0.0) return p_.cycle_min_lr;
    const double d = static_cast<double>(s - p_.cycle_first_step_size - second_step_size() + 1);
    return p_.cycle_min_lr / (1.0 + p_.decay_lr_rate * (d / static_cast<double>(p_.decay_step_size)));
  }
  if (t == ScheduleType::kWarmupLR || t == ScheduleType::kWarmupDecayLR) {
    double gamma;
    if (s < warmup_steps_) {
      gamma = warmup_gamma(s);
    } else if (t == ScheduleType::kWarmupLR) {
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
    double c = (1.0 + std::cos(M_PI * (real_step / real_total))) / 2.0;  // DeepSpeed's pi * progress
    ratio = std::max(0.0, p_.cos_min_ratio + (1.0 - p_.cos_min_ratio) * c);
  }
  return base_lr_ * ratio;
}

}  // namespace zinc::optim
