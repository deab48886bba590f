#include "engine/engine.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "core/alloc.h"
#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "kernels/kernels.h"
#include "optim/optim.h"

namespace zinc {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// One block's state on this rank (stage 0: everything full).
struct BlockState {
  BlockLayout layout;
  AlignedBuffer master;   // 1-D, layout.numel fp32: the weights the optimizer updates
  AlignedBuffer compute;  // 1-D, layout.numel bf16 (empty in fp32: the model reads `master`)
  AlignedBuffer grad;     // 1-D, layout.numel fp32 accumulators
  AlignedBuffer exp_avg;     // Adam m, fp32
  AlignedBuffer exp_avg_sq;  // Adam v, fp32
  bool acquired = false;
  bool grads_reported = false;
};

optim::ScheduleParams schedule_params(const Config& c) {
  optim::ScheduleParams p;
  const SchedulerConfig& s = c.scheduler;
  p.type = s.type;
  p.base_lr = c.optimizer.lr;
  p.warmup_min_lr = s.warmup_min_lr;
  p.warmup_max_lr = s.warmup_max_lr;
  p.warmup_num_steps = s.warmup_num_steps;
  p.warmup_type = s.warmup_type;
  p.total_num_steps = s.total_num_steps;
  p.warmup_min_ratio = s.warmup_min_ratio;
  p.cos_min_ratio = s.cos_min_ratio;
  return p;
}

}  // namespace

struct Engine::Impl final : StepContext {
  Config cfg;
  std::shared_ptr<Model> model;
  DType dtype;
  std::vector<BlockState> blocks;
  optim::AdamParams adam;
  optim::LrSchedule schedule;
  int64_t num_params = 0;

  int64_t micro_steps = 0;     // backward() calls so far
  int64_t global_steps = 0;    // boundaries reached
  int64_t skipped_steps = 0;   // boundaries whose update was skipped (non-finite gradients)
  int64_t optimizer_steps = 0; // updates applied (Adam's t, the schedule's step)
  double grad_norm = 0;
  double lr = 0;
  bool forward_pending = false;  // a forward whose backward has not run
  double loss_sum = 0;           // sum of micro-batch losses in the current global batch
  int64_t loss_count = 0;
  double last_loss = NAN;
  StepTimings timings;

  Impl(std::shared_ptr<Model> m, const Config& c)
      : cfg(c), model(std::move(m)), dtype(c.bf16 ? DType::kBF16 : DType::kF32),
        schedule(schedule_params(c)) {
    adam.lr = c.optimizer.lr;
    adam.beta1 = c.optimizer.beta1;
    adam.beta2 = c.optimizer.beta2;
    adam.eps = c.optimizer.eps;
    adam.weight_decay = c.optimizer.weight_decay;
    adam.adam_w_mode = c.optimizer.adam_w_mode;
    adam.bias_correction = c.optimizer.bias_correction;
    lr = schedule.lr_at(0);
    allocate_and_init();
  }

  void allocate_and_init() {
    const std::vector<BlockSpec>& specs = model->blocks();
    if (specs.empty()) throw Error("model '" + model->name() + "' has no parameter blocks");
    blocks.resize(specs.size());
    for (size_t b = 0; b < specs.size(); ++b) {
      BlockState& s = blocks[b];
      s.layout = BlockLayout::from_spec(specs[b]);
      size_t n = static_cast<size_t>(s.layout.numel);
      s.master = make_buffer<float>(n);
      s.grad = make_buffer<float>(n);
      s.exp_avg = make_buffer<float>(n);
      s.exp_avg_sq = make_buffer<float>(n);
      if (dtype == DType::kBF16) s.compute = make_buffer<bf16>(n);
      float* w = s.master.as<float>();
      for (size_t p = 0; p < specs[b].params.size(); ++p) {
        const ParamSpec& ps = specs[b].params[p];
        float* dst = w + s.layout.offsets[p];
        int64_t cnt = s.layout.numels[p];
        num_params += cnt;
        // Each parameter has its own stream, so adding a parameter or a block
        // does not change the initial values of the others.
        Rng rng(mix_seed(cfg.run.seed, (static_cast<uint64_t>(b) << 20) + p));
        for (int64_t i = 0; i < cnt; ++i) {
          switch (ps.init) {
            case Init::kZeros: dst[i] = 0.0f; break;
            case Init::kOnes: dst[i] = 1.0f; break;
            case Init::kNormal: dst[i] = static_cast<float>(rng.normal() * ps.init_std); break;
          }
        }
      }
      if (dtype == DType::kBF16) convert_f32_to_bf16(w, s.compute.as<bf16>(), n);
    }
  }

  // ---- StepContext --------------------------------------------------------------
  DType compute_dtype() const override { return dtype; }
  BlockParams acquire(int block) override {
    BlockState& s = state(block);
    s.acquired = true;
    const void* base = dtype == DType::kBF16 ? s.compute.data() : s.master.data();
    return BlockParams{base, dtype, &s.layout};
  }
  void release(int block) override { state(block).acquired = false; }
  BlockGrads grads(int block) override {
    BlockState& s = state(block);
    return BlockGrads{s.grad.as<float>(), &s.layout};
  }
  void grads_ready(int block) override {
    BlockState& s = state(block);
    if (s.grads_reported)
      throw Error("model '" + model->name() + "' reported gradients of block " + std::to_string(block) +
                  " twice in one backward");
    s.grads_reported = true;
    // Stage 0 on one rank: nothing to communicate. (The ZeRO stages queue the
    // block's bucket on the comm stream here.)
  }

  BlockState& state(int block) {
    if (block < 0 || block >= static_cast<int>(blocks.size()))
      throw Error("model '" + model->name() + "' asked for block " + std::to_string(block) + " of " +
                  std::to_string(blocks.size()));
    return blocks[block];
  }

  // ---- training ---------------------------------------------------------------------
  void check_batch(const Batch& batch) const {
    if (batch.B <= 0 || batch.T <= 0 ||
        batch.inputs.size() != static_cast<size_t>(batch.B * batch.T) ||
        batch.targets.size() != batch.inputs.size())
      throw Error("batch: expected B*T inputs and targets, got B=" + std::to_string(batch.B) +
                  " T=" + std::to_string(batch.T) + " with " + std::to_string(batch.inputs.size()) +
                  " inputs and " + std::to_string(batch.targets.size()) + " targets");
  }

  float forward(const Batch& batch) {
    check_batch(batch);
    auto t0 = Clock::now();
    float loss = model->forward(*this, batch);
    timings.forward_s += seconds_since(t0);
    forward_pending = true;
    loss_sum += loss;
    loss_count += 1;
    return loss;
  }

  void backward() {
    if (!forward_pending) throw Error("Engine::backward() called without a preceding forward()");
    auto t0 = Clock::now();
    for (BlockState& s : blocks) s.grads_reported = false;
    model->backward(*this, 1.0f);
    for (size_t b = 0; b < blocks.size(); ++b)
      if (!blocks[b].grads_reported)
        throw Error("model '" + model->name() + "' did not call grads_ready for block " +
                    std::to_string(b) + " during backward");
    forward_pending = false;
    micro_steps += 1;
    timings.backward_s += seconds_since(t0);
  }

  bool at_boundary() const {
    return micro_steps > 0 && micro_steps % cfg.gradient_accumulation_steps == 0;
  }

  void step() {
    if (!at_boundary() || loss_count == 0) return;
    auto t0 = Clock::now();
    const double inv_gas = 1.0 / static_cast<double>(cfg.gradient_accumulation_steps);
    double sumsq = 0;
    for (BlockState& s : blocks) sumsq += optim::grad_squared_norm(s.grad.data(), DType::kF32, s.layout.numel);
    grad_norm = std::sqrt(sumsq) * inv_gas;
    global_steps += 1;
    if (!std::isfinite(grad_norm)) {
      skipped_steps += 1;
      log_warn("step " + std::to_string(global_steps) +
               ": gradient norm is not finite; the update is skipped");
    } else {
      const double clip = optim::clip_coefficient(grad_norm, cfg.gradient_clipping);
      const float grad_scale = static_cast<float>(inv_gas * clip);
      lr = schedule.lr_at(optimizer_steps);
      adam.lr = lr;
      optimizer_steps += 1;
      for (BlockState& s : blocks) {
        bf16* out = dtype == DType::kBF16 ? s.compute.as<bf16>() : nullptr;
        optim::adam_step(adam, optimizer_steps, grad_scale,
                         optim::AdamSpan{s.master.as<float>(), s.grad.data(), DType::kF32, s.exp_avg.as<float>(),
                                         s.exp_avg_sq.as<float>(), out, s.layout.numel});
      }
    }
    for (BlockState& s : blocks) std::memset(s.grad.data(), 0, s.grad.bytes());
    last_loss = loss_sum / static_cast<double>(loss_count);
    loss_sum = 0;
    loss_count = 0;
    timings.step_s += seconds_since(t0);
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;
Engine::~Engine() = default;

Engine Engine::initialize(std::shared_ptr<Model> model, const Config& config) {
  if (!model) throw Error("Engine::initialize: model is null");
  config.validate();
  if (config.world_size != 1)
    throw ConfigError("", "this build of zinc runs one rank; the config was parsed for world size " +
                              std::to_string(config.world_size));
  return Engine(std::make_unique<Impl>(std::move(model), config));
}

Engine Engine::initialize(std::shared_ptr<Model> model, const nlohmann::json& config) {
  return initialize(std::move(model), Config::parse(config, 1));
}

float Engine::forward(const Batch& batch) { return impl_->forward(batch); }
void Engine::backward() { impl_->backward(); }
void Engine::step() { impl_->step(); }

float Engine::train_batch(DataLoader& loader) {
  if (loader.micro_batch() != impl_->cfg.train_micro_batch_size_per_gpu)
    throw Error("train_batch: the loader's micro-batch (" + std::to_string(loader.micro_batch()) +
                ") differs from train_micro_batch_size_per_gpu (" +
                std::to_string(impl_->cfg.train_micro_batch_size_per_gpu) + ")");
  for (int64_t i = 0; i < impl_->cfg.gradient_accumulation_steps; ++i) {
    Batch b = loader.next();
    forward(b);
    backward();
    step();
  }
  return static_cast<float>(impl_->last_loss);
}

float Engine::evaluate(const Batch& batch) {
  impl_->check_batch(batch);
  return impl_->model->forward(*impl_, batch);
}

bool Engine::is_gradient_accumulation_boundary() const { return impl_->at_boundary(); }
double Engine::global_grad_norm() const { return impl_->grad_norm; }
double Engine::learning_rate() const { return impl_->lr; }
int64_t Engine::global_steps() const { return impl_->global_steps; }
int64_t Engine::skipped_steps() const { return impl_->skipped_steps; }
int64_t Engine::micro_steps() const { return impl_->micro_steps; }
double Engine::last_batch_loss() const { return impl_->last_loss; }
const Config& Engine::config() const { return impl_->cfg; }
Model& Engine::model() { return *impl_->model; }
DType Engine::compute_dtype() const { return impl_->dtype; }
int64_t Engine::num_parameters() const { return impl_->num_params; }
StepTimings Engine::timings() const { return impl_->timings; }

std::span<const float> Engine::master_params(int block) const {
  const BlockState& s = impl_->blocks.at(static_cast<size_t>(block));
  return {s.master.as<float>(), static_cast<size_t>(s.layout.numel)};
}

int64_t Engine::model_state_bytes() const {
  int64_t total = 0;
  for (const BlockState& s : impl_->blocks)
    total += static_cast<int64_t>(s.master.bytes() + s.compute.bytes() + s.grad.bytes() +
                                  s.exp_avg.bytes() + s.exp_avg_sq.bytes());
  return total;
}

}  // namespace zinc
