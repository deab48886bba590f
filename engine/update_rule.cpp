// The update rules AdamW and Lamb, the registry, and the memory each rule
// adds (update_rule.h). The 1-bit rules: update_onebit.h.
//
// Note [update rules]
// -------------------
// The step ends in one call: the engine reduces the gradients, takes the
// global norm and the clip coefficient, decides whether to skip, and hands
// the update of optimizer step t, with the gradient scale, to its
// UpdateRule. A rule owns everything particular to its optimizer: its
// hyperparameters, any state beyond the fp32 master, m and v that
// OptimizerState keeps for every rule (Lamb's tensor map and trust ratios,
// the 1-bit optimizers' compressors, error feedback and schedules), its
// element loops (in optim/), its part of a checkpoint and of the memory
// estimate. The engine asks it a few questions at fixed points of the step
// (whether the boundary keeps its gradients local, their squares then, the
// update, what follows the update) and of a checkpoint (save, prepare a
// load, each span loaded, the load finished); it never asks which
// optimizer it is. Adding an optimizer is its own file, its config keys
// (engine/config_optim.cpp) and one line of make_update_rule.
#include "engine/update_rule.h"

#include <algorithm>

#include "comm/onebit.h"
#include "core/error.h"
#include "engine/update_onebit.h"

namespace zinc {


// ---- AdamW ------------------------------------------------------------------------------

void AdamWRule::set_hyperparameters(double lr, std::optional<std::pair<double, double>> betas) {
  adam_.lr = lr;
  if (betas) {
    adam_.beta1 = betas->first;
    adam_.beta2 = betas->second;
  }
}

bool AdamWRule::apply_on_device(DevicePath& device, int64_t t, float grad_scale) {
  return device.update(adam_, t, grad_scale);
}

void AdamWRule::apply(int64_t t, float grad_scale) {
  ctx_.visit_updating([&](const StateSpan& sp) { update_span(sp, t, grad_scale); }, false);
}

void AdamWRule::update_span(const StateSpan& sp, int64_t t, float grad_scale) {
  const DType dtype = ctx_.dtype;
  char* out = ctx_.compute_out(sp);  // where the span's new compute weights go
  bf16* out16 = dtype == DType::kBF16 ? reinterpret_cast<bf16*>(out) : nullptr;
  const float* grad = ctx_.grad(sp);
  if (ctx_.no_decay.empty() || adam_.weight_decay == 0.0) {
    optim::adam_step(adam_, t, grad_scale, optim::AdamSpan{sp.master, grad, DType::kF32, sp.m, sp.v, out16, sp.count});
  } else {
    // The span's parameters in turn, each with its own decay (padding with
    // the rest: it stays 0).
    const BlockShard& s = (*ctx_.blocks)[static_cast<size_t>(sp.block)];
    const int64_t flat = (ctx_.plan->optimizer_spans_block ? 0 : s.part.own_offset()) + sp.offset;
    const std::vector<char>& skip = ctx_.no_decay[static_cast<size_t>(sp.block)];
    for (const optim::LambSegment& g : lamb_segments(s.layout, flat, sp.count, 0)) {
      optim::AdamParams a = adam_;
      if (g.tensor >= 0 && skip[static_cast<size_t>(g.tensor)]) a.weight_decay = 0.0;
      optim::adam_step(a, t, grad_scale,
                       optim::AdamSpan{sp.master + g.begin, grad + g.begin, DType::kF32, sp.m + g.begin, sp.v + g.begin,
                                       out16 ? out16 + g.begin : nullptr, g.end - g.begin});
    }
  }
  // fp32 copied; fp16 converted in a second pass (the optimizer's fused
  // copy-out writes bf16 only).
  if (dtype != DType::kBF16 && out) convert_f32_to_16(sp.master, out, static_cast<size_t>(sp.count), dtype);
}

// ---- Lamb (Note [Lamb arithmetic] in optim/detail/lamb_math.h) --------------------------

std::vector<optim::LambSegment> lamb_segments(const BlockLayout& layout, int64_t flat_begin, int64_t count,
                                              int first_tensor) {
  std::vector<optim::LambSegment> segs;
  const int64_t end = flat_begin + count;
  int64_t at = flat_begin;  // first element not yet in a segment
  for (size_t p = 0; p < layout.offsets.size() && at < end; ++p) {
    const int64_t b = std::max(at, layout.offsets[p]);
    const int64_t e = std::min(end, layout.offsets[p] + layout.numels[p]);
    if (b >= e) continue;  // the tensor lies wholly before or after the range
    if (b > at) segs.push_back({at - flat_begin, b - flat_begin, -1});
    segs.push_back({b - flat_begin, e - flat_begin, first_tensor + static_cast<int>(p)});
    at = e;
  }
  if (at < end) segs.push_back({at - flat_begin, end - flat_begin, -1});
  return segs;
}

void LambRule::set_hyperparameters(double lr, std::optional<std::pair<double, double>> betas) {
  lamb_.lr = lr;
  if (betas) {
    lamb_.beta1 = betas->first;
    lamb_.beta2 = betas->second;
  }
}

std::vector<optim::LambSegment> LambRule::span_segments(const StateSpan& sp) const {
  const BlockShard& s = (*ctx_.blocks)[static_cast<size_t>(sp.block)];
  const int64_t flat = (ctx_.plan->optimizer_spans_block ? 0 : s.part.own_offset()) + sp.offset;
  return lamb_segments(s.layout, flat, sp.count, first_tensor_[static_cast<size_t>(sp.block)]);
}

void LambRule::number_tensors() {
  if (!first_tensor_.empty()) return;
  for (const BlockShard& s : *ctx_.blocks) {
    first_tensor_.push_back(tensors_);
    tensors_ += static_cast<int>(s.layout.offsets.size());
  }
}

void LambRule::set_ratios(std::vector<double>& sums) {
  if (ctx_.reduce_stream && !ctx_.plan->optimizer_spans_block)
    ctx_.reduce_stream->submit([&sums](comm::Communicator& c) {
      c.all_reduce_f64(sums.data(), static_cast<int64_t>(sums.size()));
    }).wait();
  // A tensor split over parts has one trust ratio, the whole tensor's (as
  // on one rank), not one per part.
  if (ctx_.sum_tensor_parts) ctx_.sum_tensor_parts(sums, first_tensor_);
  ratios_.assign(static_cast<size_t>(tensors_), 0.0);
  for (int k = 0; k < tensors_; ++k)
    ratios_[static_cast<size_t>(k)] =
        optim::lamb_trust_ratio(sums[2 * k], sums[2 * k + 1], lamb_.min_coeff, lamb_.max_coeff);
}

// GPU-resident states: the same two passes on the device, the sums added
// over ranks here as apply's.
bool LambRule::apply_on_device(DevicePath& device, int64_t t, float grad_scale) {
  number_tensors();
  std::vector<double> sums(static_cast<size_t>(2 * tensors_), 0.0);
  const auto segs = [this](int block, int64_t offset, int64_t count) {
    return lamb_segments((*ctx_.blocks)[static_cast<size_t>(block)].layout, offset, count,
                         first_tensor_[static_cast<size_t>(block)]);
  };
  if (!device.lamb_norms(lamb_, grad_scale, segs, sums.data())) return false;
  set_ratios(sums);
  device.lamb_update(lamb_, t, grad_scale, ratios_.data());
  return true;
}

void LambRule::apply(int64_t t, float grad_scale) {
  number_tensors();
  // Pass 1 reads every span (from NVMe without writing back) for each
  // tensor's sums of w^2 and u^2; with sharded optimizer state (stages 1-3)
  // the ranks' partial sums are added in one all-reduce; pass 2 applies the
  // update with each tensor's trust ratio.
  std::vector<double> sums(static_cast<size_t>(2 * tensors_), 0.0);
  ctx_.opt_state->for_each_read(
      [&](const StateSpan& sp) {
        const std::vector<optim::LambSegment> segs = span_segments(sp);
        optim::lamb_norms(lamb_, grad_scale,
                          optim::AdamSpan{sp.master, ctx_.grad(sp), DType::kF32, sp.m, sp.v, nullptr, sp.count},
                          segs, sums.data());
      },
      /*grads=*/ctx_.plan->grads_on_nvme);
  set_ratios(sums);
  const DType dtype = ctx_.dtype;
  ctx_.visit_updating(
      [&](const StateSpan& sp) {
        char* out = ctx_.compute_out(sp);
        bf16* out16 = dtype == DType::kBF16 ? reinterpret_cast<bf16*>(out) : nullptr;
        optim::lamb_apply(lamb_, t, grad_scale,
                          optim::AdamSpan{sp.master, ctx_.grad(sp), DType::kF32, sp.m, sp.v, out16, sp.count},
                          span_segments(sp), ratios_.data());
        if (dtype != DType::kBF16 && out) convert_f32_to_16(sp.master, out, static_cast<size_t>(sp.count), dtype);
      },
      false);
}

// ---- the registry -----------------------------------------------------------------------

std::vector<MemoryPart> update_rule_memory(const Config& c, const std::vector<BlockLayout>& layouts,
                                           int64_t span_numel, int world) {
  // The 1-bit optimizers past their warm-up (Notes [1-bit Adam], [0/1 Adam]
  // and [1-bit Lamb] in update_onebit.cpp): per tensor, a worker error of
  // its padded size, a server error of a chunk, and the same again as the
  // all-reduce's scratch.
  std::vector<MemoryPart> parts;
  if (c.optimizer.type == OptimizerType::kZeroOneAdam)
    parts.push_back({"0/1 Adam update accumulator (fp32)", 4 * span_numel,
                     "after var_freeze_step: each rank's local updates since the last synchronisation"});
  if (c.optimizer.type == OptimizerType::kOneBitLamb)
    parts.push_back({"1-bit Lamb fresh variance (fp32)", 4 * span_numel,
                     "from freeze_step on: a second variance estimate"});
  if (c.optimizer.one_bit() && world > 1) {
    int64_t errors = 0;
    for (const BlockLayout& l : layouts)
      for (int64_t n : l.numels) {
        const int64_t padded = comm::onebit_padded_size(n, world);
        errors += 2 * (padded + padded / world);
      }
    parts.push_back({"1-bit error feedback and scratch (fp32)", 4 * errors,
                     "from the first compressed step: worker and server errors per tensor, and the scratch"});
  }
  return parts;
}

std::unique_ptr<UpdateRule> make_update_rule(const Config& c) {
  switch (c.optimizer.type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW: return std::make_unique<AdamWRule>(c.optimizer.adam);
    case OptimizerType::kLamb: return std::make_unique<LambRule>(c.optimizer.lamb);
    case OptimizerType::kOneBitAdam: return std::make_unique<OneBitAdamRule>(c);
    case OptimizerType::kZeroOneAdam: return std::make_unique<ZeroOneAdamRule>(c);
    case OptimizerType::kOneBitLamb: return std::make_unique<OneBitLambRule>(c);
  }
  throw ConfigError("optimizer.type", "no update rule for this optimizer");
}

}  // namespace zinc
