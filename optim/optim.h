// zinc optim: Adam/AdamW and Lamb over flat fp32 spans, learning-rate
// schedules and gradient-clipping math.
//
// The update follows DeepSpeed's CPU/fused Adam (per element, step t counted
// from 1, g = grad * grad_scale); the exact operation order is
// Note [Adam arithmetic] in optim/detail/adam_math.h:
//   Adam  (adam_w_mode false): g += weight_decay * p
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   denom = sqrt(v) / sqrt(1 - b2^t) + eps          (no bias correction: sqrt(v) + eps)
//   AdamW (adam_w_mode true):  p -= lr * weight_decay * p
//   p -= lr / (1 - b1^t) * m / denom                 (no bias correction: lr * m / denom)
// then, if requested, the new p is written as bf16 (bit for bit
// zinc::float_to_bf16).
//
// Implementations: scalar (the reference), AVX2+FMA, AVX-512, and AVX-512
// with the AVX512-BF16 conversion instruction. The best one the CPU supports
// (under the ONEDNN_MAX_CPU_ISA cap, core/cpu.h)
// is chosen at first use and logged once; ZINC_OPTIM_ISA=scalar|avx2|avx512|
// avx512_bf16 (or set_isa) forces one. The vector paths use fused
// multiply-adds, so they differ from the scalar path by a few ulps; each path
// is deterministic and independent of the thread count (threads split the
// span at 64-byte boundaries; every element is computed the same way
// wherever it falls). Functions are reentrant; callers own all buffers.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace zinc::optim {

// DeepSpeed's optimizer.params for Adam and AdamW (the config parses straight
// into them: engine/config.h's OptimizerConfig), with DeepSpeed's defaults.
struct AdamParams {
  double lr = 1e-3;                   // lr (the schedule's base for WarmupCosineLR)
  double beta1 = 0.9, beta2 = 0.999;  // betas: [b1, b2]
  double eps = 1e-8;
  double weight_decay = 0.0;
  // adam_w_mode: decoupled (AdamW) weight decay. DeepSpeed's "Adam"
  // defaults to true as well; false gives L2-style Adam.
  bool adam_w_mode = true;
  bool bias_correction = true;

  bool operator==(const AdamParams&) const = default;
};

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Bf16 };
std::string_view isa_name(Isa isa);
// Throws zinc::Error for an unknown name.
Isa parse_isa(std::string_view name);
// True where the CPU has the path's instructions and ONEDNN_MAX_CPU_ISA does
// not cap them away (core/cpu.h).
bool isa_supported(Isa isa);
// The best supported path.
Isa detect_isa();
// The path adam_step and grad_squared_norm use: ZINC_OPTIM_ISA if set (an
// unsupported or unknown value is an error), else detect_isa().
Isa active_isa();
// Forces a path for this process; throws zinc::Error if it is not supported.
void set_isa(Isa isa);

// One flat span of optimizer state. grad is fp32 or bf16 (grad_dtype);
// bf16_out (may be null) receives the new weights in bf16.
struct AdamSpan {
  float* param = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  bf16* bf16_out = nullptr;
  int64_t n = 0;
};

// A bf16 copy-out of at least this many bytes (default kStreamMinBytes) into
// a 64-byte-aligned buffer uses non-temporal stores, which skip reading the
// lines they overwrite. Process-wide; tests move it.
// 1 MiB, a core's L2: the copy-out of a training step's update is read
// again by the next forward only after the whole pass over the states (far
// beyond the caches for any model worth offloading), so a span's own size
// says little; streaming a 11M-parameter block's copy (a layer of the ~100M
// Llama) made the update 10-13% faster than plain stores (AMD EPYC, 2
// threads, 2026-11-30; bench/RESULTS.md), and never slower down to 250K.
inline constexpr int64_t kStreamMinBytes = int64_t{1} << 20;
void set_stream_min_bytes(int64_t bytes);

// One Adam step over a span, threaded. step >= 1.
void adam_step(const AdamParams& p, int64_t step, float grad_scale, const AdamSpan& span);
void adam_step(const AdamParams& p, int64_t step, float grad_scale, const AdamSpan& span, Isa isa);
// Convenience for fp32 gradients.
inline void adam_step(const AdamParams& p, int64_t step, float grad_scale, float* param, const float* grad,
                      float* m, float* v, int64_t n, bf16* bf16_out) {
  adam_step(p, step, grad_scale, AdamSpan{param, grad, DType::kF32, m, v, bf16_out, n});
}

// Sum of squares of a gradient span in double, threaded, summed in fixed
// 16384-element chunks so the result does not depend on the thread count.
double grad_squared_norm(const void* grad, DType dtype, int64_t n);
double grad_squared_norm(const void* grad, DType dtype, int64_t n, Isa isa);

// Gradient clipping by global L2 norm, as DeepSpeed computes it: the factor
// to multiply gradients by is max_norm / (norm + 1e-6) when that is below 1,
// else 1. max_norm <= 0 disables clipping (factor 1).
double clip_coefficient(double norm, double max_norm);

// ---- Lamb ------------------------------------------------------------------
// DeepSpeed's FusedLamb (Note [Lamb arithmetic] in optim/detail/lamb_math.h):
// Adam's moments, then per parameter tensor a trust ratio ||w|| / ||u||
// clamped to [min_coeff, max_coeff] (1 where a norm is 0) that scales the
// step. Because the ratio needs the norms of whole tensors, which may be
// spread over several spans (NVMe sub-groups) and ranks (ZeRO shards), a
// step is two passes: lamb_norms over every span (read only), the sums added
// over ranks by the caller, lamb_trust_ratio per tensor, then lamb_apply over
// every span. lamb_step does all three for one span holding whole tensors.
// Same ISA paths, dispatch and determinism rules as adam_step.
// DeepSpeed's optimizer.params for Lamb (its FusedLamb, the defaults its
// own): the per-tensor trust ratio ||w|| / ||update|| is clamped to
// [min_coeff, max_coeff]. Lamb adds no memory over Adam (the same master, m
// and v) but reads the state twice per step: once for the norms, once for
// the update.
struct LambParams {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  bool eps_inside_sqrt = false;  // eps added under the square root: sqrt(v + eps)
  double max_coeff = 10.0, min_coeff = 0.01;

  bool operator==(const LambParams&) const = default;
};

// A run of a span's elements [begin, end) that belongs to parameter tensor
// `tensor` (an index into the caller's sums and ratios), or to no tensor
// (-1: alignment padding, updated with ratio 1 and left out of the norms).
// A span's segments must be in order and cover [0, span.n) exactly.
struct LambSegment {
  int64_t begin = 0, end = 0;
  int tensor = -1;
};

// Pass 1: for each segment of tensor t adds sum(w^2) to sums[2t] and
// sum(u^2) to sums[2t + 1] (double; each segment summed in fixed
// 16384-element pieces, so the sums do not depend on the thread count).
// Reads only.
void lamb_norms(const LambParams& p, float grad_scale, const AdamSpan& span, std::span<const LambSegment> segs,
                double* sums);
void lamb_norms(const LambParams& p, float grad_scale, const AdamSpan& span, std::span<const LambSegment> segs,
                double* sums, Isa isa);
// The trust ratio from a tensor's two sums (over all its elements).
double lamb_trust_ratio(double w_sq, double u_sq, double min_coeff, double max_coeff);
// Pass 2: the update of step `step` (>= 1) with ratios[t] for tensor t;
// writes param, m, v and bf16_out.
void lamb_apply(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& span,
                std::span<const LambSegment> segs, const double* ratios);
void lamb_apply(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& span,
                std::span<const LambSegment> segs, const double* ratios, Isa isa);
// Both passes over one span whose segments hold whole tensors (tensor
// indexes < segs.size()). Returns the ratios used, per tensor index.
std::vector<double> lamb_step(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& span,
                              std::span<const LambSegment> segs);
std::vector<double> lamb_step(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& span,
                              std::span<const LambSegment> segs, Isa isa);

// Learning-rate schedules with DeepSpeed's names and formulas. lr_at(s) is the
// learning rate used by optimizer step s (s = 0 for the first step), i.e.
// DeepSpeed's value at last_batch_iteration = s. (DeepSpeed itself runs its
// very first step at the optimizer's configured lr, before the schedule's
// first step() call; zinc applies the schedule from the first step, so step
// 0 of a warmup starts at the warmup minimum.)
//
// OneCycle (DeepSpeed's, last_batch_iteration = s): with i = s + 1,
// T = cycle_first_step_size + cycle_second_step_size and r =
// cycle_first_step_size / T, x = the fractional part of i / T and scale =
// x / r while x <= r, else (x - 1) / (r - 1); for s < T
//   lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
//   beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale
// after it, with d = s - T + 1,
//   lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)
//   beta1 = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)
// (lr stays at cycle_min_lr and beta1 at cycle_max_mom where decay_step_size
// or the rate is 0). With cycle_momentum DeepSpeed sets the optimizer's betas
// to (beta1, 0.99): beta2 is 0.99 whatever the optimizer's section says.
// Stairs (DeepSpeed 0.19): where the half of the cycle that x falls in has a
// stair count n > 0 (cycle_first_stair_count for the rise,
// cycle_second_stair_count for the fall; the second defaults to the first),
// the scale is quantised from the integer position c = fmod(i, T) in the
// cycle: scale = floor(c * n / first) / n while c <= first, else
// floor((T - c) * n / second) / n. lr and beta1 then hold flat across each
// of the n stairs of that half instead of moving every step.
// tests/deepspeed_parity checks every schedule here against DeepSpeed 0.19.8
// step by step.

// scheduler.type; kConstant when there is no scheduler section.
enum class ScheduleType { kConstant, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle };
// "constant" | "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR" | "OneCycle"
const char* schedule_type_name(ScheduleType t);

// scheduler.params.warmup_type
enum class WarmupType { kLog, kLinear };

// DeepSpeed's scheduler section (the config parses straight into it:
// engine/config.h's SchedulerConfig); defaults as DeepSpeed's.
struct ScheduleParams {
  ScheduleType type = ScheduleType::kConstant;
  // WarmupLR / WarmupDecayLR: the lr rises from warmup_min_lr to
  // warmup_max_lr over warmup_num_steps optimizer steps. (Config::parse
  // sets WarmupLR's to the optimizer's lr when the config does not give it,
  // as DeepSpeed 0.19 does; WarmupDecayLR keeps 0.001.)
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 0.001;
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  // WarmupDecayLR / WarmupCosineLR: the step at which the decay ends
  // (required for those, no default).
  int64_t total_num_steps = 0;
  // WarmupCosineLR: ratios of the optimizer's lr.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
  // OneCycle (formulas above): the lr climbs from cycle_min_lr to
  // cycle_max_lr over cycle_first_step_size steps and falls back over
  // cycle_second_step_size (-1: the same), in stairs where the stair counts
  // say so, then decays by decay_lr_rate every decay_step_size steps (0:
  // holds cycle_min_lr). With cycle_momentum the
  // optimizer's beta1 moves inversely between cycle_max_mom and
  // cycle_min_mom (and, as in DeepSpeed, beta2 becomes 0.99).
  double cycle_min_lr = 0.0, cycle_max_lr = 0.0;  // required
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  int64_t cycle_second_step_size = -1;
  // Stairs per half of the cycle (0: continuous); second -1: the same as the
  // first, as DeepSpeed's None.
  int64_t cycle_first_stair_count = 0;
  int64_t cycle_second_stair_count = -1;
  int64_t decay_step_size = 0;
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;

  bool operator==(const ScheduleParams&) const = default;
};

// One key of scheduler.params: the field it fills, the schedules that take
// it, its allowed interval and whether it is required. The config reads and
// writes the section from this table alone (engine/config_optim.cpp and
// config_json.cpp), so a new key is a field of ScheduleParams, a row of the
// table (schedule.cpp) and its use in LrSchedule.
struct ScheduleKey {
  const char* name;
  // Exactly one is set: the field the key fills.
  double ScheduleParams::*number = nullptr;
  int64_t ScheduleParams::*integer = nullptr;
  bool ScheduleParams::*flag = nullptr;
  WarmupType ScheduleParams::*warmup = nullptr;
  unsigned types = 0;  // bit (1 << ScheduleType) for each schedule that takes it
  double lo = 0, hi = std::numeric_limits<double>::infinity();  // allowed interval; lo is open where lo_open, hi where hi_open
  bool lo_open = false, hi_open = false;
  bool required = false;  // required by each schedule that takes it (DeepSpeed has no default)
  // JSON null keeps the field at `null_value` (written back as null).
  bool nullable = false;
  int64_t null_value = 0;

  bool takes(ScheduleType t) const { return (types >> static_cast<unsigned>(t)) & 1u; }
};
std::span<const ScheduleKey> schedule_keys();
// warmup_type's spellings, as DeepSpeed's.
const char* warmup_type_name(WarmupType t);

// The Adam/Lamb betas a schedule sets for a step (OneCycle with
// cycle_momentum); absent otherwise.
struct ScheduleBetas {
  double beta1 = 0.9, beta2 = 0.99;
};

class LrSchedule {
 public:
  // base_lr: the optimizer's lr (the constant schedule's, and
  // WarmupCosineLR's reference).
  LrSchedule(ScheduleParams p, double base_lr);
  double lr_at(int64_t step) const;
  // True where betas_at gives a value (OneCycle with cycle_momentum).
  bool sets_betas() const { return p_.type == ScheduleType::kOneCycle && p_.cycle_momentum; }
  // The betas used by optimizer step `step` where sets_betas().
  ScheduleBetas betas_at(int64_t step) const;
  const ScheduleParams& params() const { return p_; }

 private:
  double one_cycle_scale(int64_t step) const;  // in [0, 1] within the cycle
  bool in_cycle(int64_t step) const;
  int64_t second_step_size() const;
  int64_t second_stair_count() const;
  double warmup_gamma(int64_t step) const;  // in [0, 1) during warmup
  ScheduleParams p_;
  double base_lr_;
  int64_t warmup_steps_;  // max(2, warmup_num_steps), as DeepSpeed
};

}  // namespace zinc::optim
