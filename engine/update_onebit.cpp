// The 1-bit update rules, OneBitAdam, ZeroOneAdam and OneBitLamb (Note
// [update rules] in update_rule.cpp): the compressed steps, their state and
// their checkpoint part. The element loops are optim/onebit_kernels.h's.
//
// Note [1-bit Adam]
// ~~~~~~~~~~~~~~~~~
// DeepSpeed's OnebitAdam (deepspeed/runtime/fp16/onebit/adam.py; Tang et
// al. 2021), read at deepspeedai/DeepSpeed master, and what zinc does:
//
//  - Warm-up, optimizer steps 1..freeze_step: plain Adam on the averaged
//    gradient, with no bias correction (DeepSpeed's update is
//    m / (sqrt(v) + eps) whatever bias_correction says) and decoupled weight
//    decay. zinc runs its own Adam kernel with exactly those settings, so
//    the warm-up equals zinc's AdamW with bias_correction false bit for bit
//    (tests/engine/onebit_engine_test.cpp checks it).
//  - After freeze_step updates: the variance v stays as it is. No gradient
//    is reduced at the accumulation boundary (DeepSpeed turns off its
//    engine's backward all-reduce); each rank folds its own gradient into
//    its momentum, m = b1 m + (1 - b1) g_r, then m := the compressed
//    average of the ranks' m (comm/onebit.h: one scale per tensor and rank,
//    the signs at 1 bit, worker and server error feedback), one tensor at a
//    time as DeepSpeed does per parameter; then w -= lr (m / (sqrt(v) + eps)
//    + wd w), in zinc's AdamW order (the decay first). Every rank ends with
//    the same m and w. On one rank nothing is compressed (DeepSpeed skips it
//    too): Adam with a frozen variance.
//  - The local gradient g_r is scaled so that its average over ranks is the
//    global batch's mean gradient (the engine's usual scale times the world
//    size; Note [the loss normaliser] in engine.cpp). The gradient norm that
//    clipping and the overflow check use is sqrt(mean over ranks of
//    |g_r|^2), computed from one all-reduce, so every rank clips by the same
//    factor and skips (a non-finite gradient anywhere) together. DeepSpeed
//    clips each rank by its own local norm there; a common factor keeps the
//    ranks' inputs to the average on one scale.
//  - Different from DeepSpeed on purpose: DeepSpeed's first step() only
//    allocates its buffers (the weights do not move and that batch's
//    gradient is dropped), and that step counts towards freeze_step, so it
//    runs freeze_step - 1 real Adam updates; zinc updates at every step and
//    runs freeze_step. exp_avg_mask (a Python param-group field) has no
//    config key and is not implemented. DeepSpeed resets the error feedback
//    at every checkpoint load (it saves rank 0's only); zinc saves each
//    rank's and restores them when the world size is the same, so a resume
//    is bit-exact across the freeze, and starts them from zero (with a
//    warning) when it is not.
//  - Stage 0 only: DeepSpeed asserts "1bit-Adam is not compatible with ZeRO"
//    for any stage above 0 (engine.py), and so does zinc's config.
//
// Note [0/1 Adam]
// ~~~~~~~~~~~~~~~
// DeepSpeed's ZeroOneAdam (deepspeed/runtime/fp16/onebit/zoadam.py; Lu et
// al. 2022), with zinc's t = the optimizer step (1-based) being applied:
//  - Before the freeze (t <= var_freeze_step): where t is a multiple of
//    var_interval the gradients are averaged in full and the step is
//    Adam's (no bias correction; zinc's Adam kernel, so these steps equal
//    AdamW with bias_correction false bit for bit); var_interval starts at
//    1 and doubles after every var_update_scaler such steps. At the other
//    steps each rank's gradient is averaged at 1 bit (per tensor, with
//    error feedback), folded into the momentum, and the weights move with
//    the variance as it stands.
//  - At the freeze the error feedback restarts from zero, as DeepSpeed's
//    does (reinitial_error_buffer).
//  - After it: every rank steps on its own gradient (m = b1 m + (1 - b1) g,
//    u = m / (sqrt(v) + eps) + wd w, w -= lr u) and accumulates -lr u and
//    the lr; every local_step_interval steps (1, doubling every
//    local_step_scaler steps up to local_step_clipper) the ranks undo their
//    local steps, average the accumulated updates times sqrt(v) + eps at 1
//    bit, set m to minus that over the summed lr, and apply it divided by
//    sqrt(v) + eps. Between synchronisations the ranks' weights differ; a
//    checkpoint keeps each rank's own (with the accumulator and the lr sum)
//    and a resume at the same world size is bit-exact; at another it takes
//    one copy and the accumulation restarts.
//  - Different from DeepSpeed: DeepSpeed counts its buffer-allocating first
//    step, so its variance and synchronisation steps fall at t + 1 where
//    zinc's fall at t; on one rank DeepSpeed leaves the momentum unchanged at
//    the steps between variance updates, where zinc folds in the gradient.
// Note [1-bit Lamb]
// ~~~~~~~~~~~~~~~~~
// DeepSpeed's OnebitLamb (deepspeed/runtime/fp16/onebit/lamb.py; Li et al.
// 2021), with zinc's t as above:
//  - Warm-up, t <= freeze_step: Lamb on the averaged gradient with no bias
//    correction (zinc's Lamb kernel: equal to zinc's "Lamb" with
//    bias_correction false bit for bit), and per tensor a moving average of
//    the trust ratio, c = coeff_beta c + (1 - coeff_beta) ratio, wherever the
//    ratio is not exactly 1; at t = freeze_step a copy of the variance
//    starts the "fresh" variance.
//  - After: at the first such step each tensor's momentum gets a scale
//    s_t = (mean over tensors of rms(m)) / rms(m_t) (1 where rms(m_t) is
//    0, where DeepSpeed divides by zero). Every step: m_t = (b1 m_t + (1 -
//    b1) g_t) s_t on each rank's own gradient; all tensors' m concatenated
//    (no alignment gaps) are averaged at 1 bit in one buffer, as DeepSpeed
//    does; m_t /= s_t; the gradient is reconstructed as (m - b1 m_last) / (1
//    - b1) and folded into the fresh variance; u = m / (sqrt(v) + eps) + wd
//    w with the frozen v; the factor is max(denom / (sqrt(v_fresh) + eps))
//    over the tensor, blended towards 1 by |m / denom| / |u| with weight
//    decay, clamped to [factor_min, factor_max] and to within
//    factor_threshold of the last factor; w -= lr c factor u.
//  - The same state on every rank except the error feedback; a checkpoint
//    keeps it (the fresh variance, c, the factors, the scales) and restores
//    it at any world size, the error feedback only at the same one.
#include "engine/update_onebit.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "kernels/kernels.h"
#include "optim/onebit_kernels.h"

namespace zinc {

namespace {
// f(from, to) for each alignment gap of a block span of n elements: after
// each tensor up to the next one (or n). The compressors see the tensors
// only; the elementwise passes treat the gaps as the tensors.
template <class F>
void for_each_gap(const BlockLayout& l, int64_t n, F&& f) {
  for (size_t t = 0; t < l.offsets.size(); ++t) {
    const int64_t from = l.offsets[t] + l.numels[t], to = t + 1 < l.offsets.size() ? l.offsets[t + 1] : n;
    if (to > from) f(from, to);
  }
}

// Averages each tensor of a block at 1 bit on the reduce stream: fill(offset,
// n, x) writes the tensor's n elements (at offset in the block) into the
// compressor's input x, and the average lands in out + offset.
template <class Fill>
void average_tensors(comm::CommStream& stream, std::vector<comm::CompressedAllReduce>& per, const BlockLayout& l,
                     float* out, Fill&& fill) {
  stream.submit([&](comm::Communicator& c) {
    for (size_t t = 0; t < per.size(); ++t) {
      fill(l.offsets[t], l.numels[t], per[t].input());
      per[t].average_input(c, out + l.offsets[t]);
    }
  }).wait();
}
}  // namespace

// ---- what the three share ---------------------------------------------------------------

double OneBitRule::local_squares() const {
  double sum = 0;
  for (BlockShard& s : blocks())
    if (!s.grad.empty()) sum += optim::grad_squared_norm(s.grad.as<float>(), DType::kF32, s.part.padded_numel);
  return sum;
}

void OneBitRule::make_compressors() {
  onebit_ar.clear();
  if (ctx_.world == 1) return;
  for (const BlockShard& s : blocks()) {
    std::vector<comm::CompressedAllReduce> per;
    for (int64_t n : s.layout.numels) per.emplace_back(n, ctx_.world);
    onebit_ar.push_back(std::move(per));
  }
}

int64_t OneBitRule::tensor_count() const {
  int64_t n = 0;
  for (const BlockShard& s : blocks()) n += static_cast<int64_t>(s.layout.numels.size());
  return n;
}

void OneBitRule::announce(const std::string& line) {
  if (!onebit_announced && ctx_.rank == 0) log_info(line);
  onebit_announced = true;
}

void OneBitRule::adam_span(const StateSpan& sp, Mode mode, float grad_scale, bool sync, const optim::AdamParams& adam,
                           std::vector<std::vector<float>>* accum, double lrs) {
  BlockShard& s = blocks()[static_cast<size_t>(sp.block)];
  ZINC_CHECK(ctx_.plan->optimizer_spans_block && sp.offset == 0 && sp.count >= s.layout.numel,
             "1-bit optimizers: a span that is not a whole block (stage 0 keeps whole blocks)");
  const int64_t n = sp.count;
  const float* g = s.grad.as<float>();
  float* m = sp.m;
  float* w = sp.master;
  const float* v = sp.v;
  const float b1 = static_cast<float>(adam.beta1), one_minus_b1 = static_cast<float>(1.0 - adam.beta1);
  const float lr = static_cast<float>(adam.lr), eps = static_cast<float>(adam.eps);
  const float wd = static_cast<float>(adam.weight_decay);
  std::vector<comm::CompressedAllReduce>* per =
      ctx_.world > 1 ? &onebit_ar[static_cast<size_t>(sp.block)] : nullptr;  // nothing to average on one rank
  const optim::OneBitConsts c{b1,  one_minus_b1, lr, eps, wd, static_cast<float>(-adam.lr * adam.weight_decay),
                     grad_scale, adam.weight_decay > 0};
  switch (mode) {
    case Mode::kCompressedMomentum: {  // Note [1-bit Adam]: the new momentum is averaged into m
      auto fill = [&](int64_t off, int64_t nt, float* x) { optim::onebit_momentum_into(nt, m + off, g + off, x, c); };
      if (per) {
        average_tensors(*ctx_.reduce_stream, *per, s.layout, m, fill);
        for_each_gap(s.layout, n, [&](int64_t from, int64_t to) { fill(from, to - from, m + from); });
      } else {
        fill(0, n, m);
      }
      break;
    }
    case Mode::kCompressedGrad: {  // Note [0/1 Adam], before the freeze: the gradient averaged, folded into m
      if (per) {
        std::vector<float>& avg = onebit_scratch;  // kept from step to step: no page faults
        avg.resize(static_cast<size_t>(n));
        auto fill = [&](int64_t off, int64_t nt, float* x) {
          for (int64_t i = 0; i < nt; ++i) x[i] = g[off + i] * grad_scale;
        };
        average_tensors(*ctx_.reduce_stream, *per, s.layout, avg.data(), fill);
        for_each_gap(s.layout, n, [&](int64_t from, int64_t to) { fill(from, to - from, avg.data() + from); });
        optim::OneBitConsts unscaled = c;  // the average is already scaled
        unscaled.grad_scale = 1.0f;
        optim::onebit_momentum_into(n, m, avg.data(), m, unscaled);
      } else {
        optim::onebit_momentum_into(n, m, g, m, c);
      }
      break;
    }
    case Mode::kLocal: {  // Note [0/1 Adam], after the freeze
      float* acc = (*accum)[static_cast<size_t>(sp.block)].data();
      if (!sync) {
        optim::zero_one_local_step(n, m, g, v, w, acc, c);
      } else {
        // This step's local step, then undo all of them; the accumulated
        // updates times sqrt(v) + eps are averaged into acc.
        auto undo = [&](int64_t off, int64_t nt, float* x) {
          optim::zero_one_local_sync(nt, m + off, g + off, v + off, w + off, acc + off, x, c);
        };
        if (per) {
          average_tensors(*ctx_.reduce_stream, *per, s.layout, acc, undo);
          for_each_gap(s.layout, n, [&](int64_t from, int64_t to) { undo(from, to - from, acc + from); });
        } else {
          undo(0, n, acc);
        }
        optim::zero_one_sync_apply(n, m, w, acc, v, static_cast<float>(lrs), eps);
      }
      if (char* out = ctx_.compute_out(sp)) convert_f32_to_16(w, out, static_cast<size_t>(n), ctx_.dtype);
      return;
    }
    case Mode::kFull:
    case Mode::kLambCompressed:
      ZINC_CHECK(false, "1-bit optimizers: a step reached the wrong update");
  }
  optim::onebit_frozen_update(n, w, m, v, c);  // the frozen-variance update, in zinc's AdamW order (the decay first)
  if (char* out = ctx_.compute_out(sp)) convert_f32_to_16(w, out, static_cast<size_t>(n), ctx_.dtype);
}

namespace {
// The wire bytes of the Adam pair's compressors, against the fp32 ring
// all-reduce's, for the announcement.
std::string adam_wire_text(const std::vector<std::vector<comm::CompressedAllReduce>>& ar,
                           const std::vector<BlockShard>& blocks, int world) {
  int64_t full = 0, compressed = 0;
  for (const auto& per : ar)
    for (const comm::CompressedAllReduce& a : per) compressed += a.wire_bytes_per_rank();
  for (const BlockShard& s : blocks) full += s.layout.param_numel();
  full = world > 1 ? 2 * full * 4 * (world - 1) / world : 0;  // ring all-reduce of fp32 gradients
  return " (" + std::to_string(compressed) + " bytes per rank, against " + std::to_string(full) +
         " for the fp32 gradient all-reduce)";
}
}  // namespace

// ---- 1-bit Adam ------------------------------------------------------------------------

OneBitAdamRule::OneBitAdamRule(const Config& c) : OneBitRule(c, std::make_unique<AdamWRule>(c.optimizer.adam)) {
  adam_ = static_cast<const AdamWRule*>(full_.get());
}

void OneBitAdamRule::apply_compressed(Mode mode, int64_t t, float grad_scale) {
  if (ctx_.world > 1 && onebit_ar.empty()) make_compressors();
  if (!onebit_announced)
    announce("OneBitAdam: the variance is frozen after " + std::to_string(onebit_.freeze_step) +
             " Adam steps; from optimizer step " + std::to_string(t) +
             " each rank sends its momentum at 1 bit per element" + adam_wire_text(onebit_ar, blocks(), ctx_.world));
  visit([&](const StateSpan& sp) { adam_span(sp, mode, grad_scale, false, adam_->params(), nullptr, 0); });
}

// ---- 0/1 Adam --------------------------------------------------------------------------

ZeroOneAdamRule::ZeroOneAdamRule(const Config& c) : OneBitRule(c, std::make_unique<AdamWRule>(c.optimizer.adam)) {
  adam_ = static_cast<const AdamWRule*>(full_.get());
}

OneBitRule::Mode ZeroOneAdamRule::mode_at(int64_t t) const {
  if (t > onebit_.var_freeze_step) return Mode::kLocal;
  return t % var_interval_ == 0 ? Mode::kFull : Mode::kCompressedGrad;
}

void ZeroOneAdamRule::after_update(int64_t t) {
  const OneBitConfig& b = onebit_;
  if (t <= b.var_freeze_step) {
    if (t % var_interval_ == 0 && ++var_counter_ == b.var_update_scaler) {
      var_counter_ = 0;
      var_interval_ *= 2;
    }
  } else if (++local_counter_ == b.local_step_scaler) {
    local_counter_ = 0;
    local_interval_ = std::min(b.local_step_clipper, local_interval_ * 2);
  }
  if (t >= b.var_freeze_step && !errors_reset_) {  // the next step is frozen
    errors_reset_ = true;
    if (!onebit_ar.empty()) make_compressors();
  }
}

void ZeroOneAdamRule::apply_compressed(Mode mode, int64_t t, float grad_scale) {
  if (ctx_.world > 1 && onebit_ar.empty()) make_compressors();
  if (!onebit_announced)
    announce("ZeroOneAdam: from optimizer step " + std::to_string(t) +
             ", steps between variance updates average the gradient at 1 bit per element" +
             adam_wire_text(onebit_ar, blocks(), ctx_.world) + "; the variance freezes after step " +
             std::to_string(onebit_.var_freeze_step));
  bool sync = false;
  if (mode == Mode::kLocal) {
    if (accum_.empty())
      for (const BlockShard& s : blocks()) accum_.emplace_back(static_cast<size_t>(s.opt_numel), 0.0f);
    lrs_ += adam_->params().lr;
    sync = t % local_interval_ == 0;
  }
  visit([&](const StateSpan& sp) { adam_span(sp, mode, grad_scale, sync, adam_->params(), &accum_, lrs_); });
  if (sync) lrs_ = 0;
}

// ---- 1-bit Lamb ------------------------------------------------------------------------

OneBitLambRule::OneBitLambRule(const Config& c) : OneBitRule(c, std::make_unique<LambRule>(c.optimizer.lamb)) {
  lamb_ = static_cast<const LambRule*>(full_.get());
}

void OneBitLambRule::after_full(int64_t t) {
  const int64_t tensors = tensor_count();
  if (coeff_.empty()) {
    coeff_.assign(static_cast<size_t>(tensors), 0.0);
    last_factor_.assign(static_cast<size_t>(tensors), 1.0);
  }
  ZINC_CHECK(static_cast<int64_t>(lamb_->ratios().size()) == tensors, "1-bit Lamb: no trust ratios from the step");
  const double cb = onebit_.coeff_beta;
  for (size_t k = 0; k < lamb_->ratios().size(); ++k)
    if (lamb_->ratios()[k] != 1.0) coeff_[k] = cb * coeff_[k] + (1.0 - cb) * lamb_->ratios()[k];
  if (t == onebit_.freeze_step) {
    v_fresh_.clear();
    ctx_.opt_state->for_each_read([&](const StateSpan& sp) { v_fresh_.emplace_back(sp.v, sp.v + sp.count); });
  }
}

void OneBitLambRule::apply_compressed(Mode /*mode*/, int64_t t, float grad_scale) {
  update_all(grad_scale);
  if (!onebit_announced) {
    int64_t total = 0;
    for (const BlockShard& s : blocks()) total += s.layout.param_numel();
    announce("OneBitLamb: the variance is frozen after " + std::to_string(onebit_.freeze_step) +
             " Lamb steps; from optimizer step " + std::to_string(t) +
             " each rank sends its scaled momentum at 1 bit per element (" +
             std::to_string(flat_ ? flat_->wire_bytes_per_rank() : 0) + " bytes per rank, against " +
             std::to_string(ctx_.world > 1 ? 2 * total * 4 * (ctx_.world - 1) / ctx_.world : 0) +
             " for the fp32 gradient all-reduce)");
  }
}

void OneBitLambRule::update_all(float grad_scale) {
  ZINC_CHECK(ctx_.cfg->zero.offload_optimizer.device == OffloadDevice::kNone,
             "1-bit Lamb: the optimizer states must be in RAM (stage 0)");
  const OneBitConfig& ob = onebit_;
  const int64_t tensors = tensor_count();
  if (coeff_.empty()) {  // resumed past the freeze from a checkpoint of another optimizer
    coeff_.assign(static_cast<size_t>(tensors), 0.0);
    last_factor_.assign(static_cast<size_t>(tensors), 1.0);
  }
  std::vector<StateSpan> spans;  // every block's whole span, in RAM: the pointers stay valid
  ctx_.opt_state->for_each_read([&](const StateSpan& sp) { spans.push_back(sp); });
  ZINC_CHECK(spans.size() == blocks().size(), "1-bit Lamb: a span that is not a whole block (stage 0 keeps whole blocks)");
  if (v_fresh_.empty())  // resumed past the freeze without it: start from the frozen variance
    for (const StateSpan& sp : spans) v_fresh_.emplace_back(sp.v, sp.v + sp.count);
  const float b1 = static_cast<float>(lamb().beta1), one_minus_b1 = static_cast<float>(1.0 - lamb().beta1);
  const float b2 = static_cast<float>(lamb().beta2), one_minus_b2 = static_cast<float>(1.0 - lamb().beta2);
  const float eps = static_cast<float>(lamb().eps), wd = static_cast<float>(lamb().weight_decay);
  // The momentum scales, once.
  if (scaling_.empty()) {
    std::vector<double> rms;
    for (size_t b = 0; b < blocks().size(); ++b) {
      const BlockLayout& l = blocks()[b].layout;
      for (size_t t = 0; t < l.offsets.size(); ++t) {
        double sq = 0;
        const float* m = spans[b].m + l.offsets[t];
        for (int64_t i = 0; i < l.numels[t]; ++i) sq += double(m[i]) * double(m[i]);
        rms.push_back(std::sqrt(sq) / std::sqrt(static_cast<double>(l.numels[t])));
      }
    }
    double united = 0;
    for (double r : rms) united += r;
    united /= static_cast<double>(rms.size());
    for (double r : rms) scaling_.push_back(r > 0 ? united / r : 1.0);
  }
  // Local momentum, scaled, into one flat buffer: the compressor's input (or
  // a scratch buffer on one rank). m keeps the momentum before the step,
  // which the gradient's reconstruction needs, until the elementwise pass.
  int64_t total = 0;
  for (const BlockShard& s : blocks()) total += s.layout.param_numel();
  if (ctx_.world > 1 && !flat_) flat_ = std::make_unique<comm::CompressedAllReduce>(total, ctx_.world);
  if (ctx_.world == 1) onebit_scratch.resize(static_cast<size_t>(total));  // kept from step to step: no page faults
  float* flat = ctx_.world > 1 ? flat_->input() : onebit_scratch.data();
  const optim::OneBitConsts ac{b1, one_minus_b1, 0.0f, eps, wd, 0.0f, grad_scale, lamb().weight_decay > 0};
  {
    int64_t at = 0;
    size_t k = 0;
    for (size_t b = 0; b < blocks().size(); ++b) {
      const BlockLayout& l = blocks()[b].layout;
      const float* g = blocks()[b].grad.as<float>();
      const float* m = spans[b].m;
      for (size_t t = 0; t < l.offsets.size(); ++t, ++k) {
        const float sc = static_cast<float>(scaling_[k]);
        const int64_t off = l.offsets[t], n = l.numels[t];
        optim::onebit_lamb_momentum(n, m + off, g + off, flat + at, sc, ac);
        at += n;
      }
    }
  }
  if (ctx_.world > 1) ctx_.reduce_stream->submit([&](comm::Communicator& c) { flat_->average_input(c, flat); }).wait();
  // Per tensor: the averaged momentum, the fresh variance, the coefficient.
  std::vector<float> coeff(static_cast<size_t>(tensors));
  {
    int64_t at = 0;
    size_t k = 0;
    for (size_t b = 0; b < blocks().size(); ++b) {
      const BlockLayout& l = blocks()[b].layout;
      float* vf = v_fresh_[b].data();
      for (size_t t = 0; t < l.offsets.size(); ++t, ++k) {
        const int64_t off = l.offsets[t], n = l.numels[t];
        const optim::OneBitLambConsts lc{static_cast<float>(scaling_[k]), b1, one_minus_b1, b2, one_minus_b2, eps, wd};
        const optim::OneBitLambSums r =
            optim::onebit_lamb_elementwise(n, flat + at, spans[b].m + off, vf + off, spans[b].v + off, spans[b].master + off, lc);
        at += n;
        double factor = r.ratio_max;
        if (lamb().weight_decay > 0) {
          const double ratio = r.u_sq > 0 ? std::min(1.0, std::sqrt(r.prelim_sq) / std::sqrt(r.u_sq)) : 1.0;
          factor = factor * ratio + (1.0 - ratio);
        }
        factor = std::clamp(factor, ob.factor_min, ob.factor_max);
        factor = std::min(factor, last_factor_[k] * (1.0 + ob.factor_threshold));
        factor = std::max(factor, last_factor_[k] * (1.0 - ob.factor_threshold));
        last_factor_[k] = factor;
        coeff[k] = static_cast<float>(-lamb().lr * (coeff_[k] * factor));
      }
    }
  }
  // The update, block by block (the compute copy follows each).
  size_t first = 0;
  visit([&](const StateSpan& sp) {
    const BlockLayout& l = blocks()[static_cast<size_t>(sp.block)].layout;
    size_t k = first;
    for (size_t t = 0; t < l.offsets.size(); ++t, ++k) {
      const int64_t off = l.offsets[t];
      optim::onebit_lamb_apply(l.numels[t], sp.master + off, sp.m + off, sp.v + off, coeff[k], eps, wd);
    }
    first = k;
    if (char* out = ctx_.compute_out(sp)) convert_f32_to_16(sp.master, out, static_cast<size_t>(sp.count), ctx_.dtype);
  });
}

}  // namespace zinc
