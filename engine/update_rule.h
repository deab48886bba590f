// zinc engine, private: the update rule, the end of the step (Note [update
// rules] in update_rule.cpp). AdamW, Lamb and the 1-bit optimizers each own
// their state behind UpdateRule, as the GPU path owns its own behind
// DevicePath: the step asks the rule at a few fixed points (does this
// boundary keep its gradients local, the norm's squares then, the update,
// what follows it, its part of a checkpoint) and never which optimizer it is.
// Threading: the training thread (the rule submits its collectives to the
// engine's reduction stream itself).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "core/dtype.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/gpu_offload.h"
#include "engine/grad_reducer.h"
#include "engine/memory_estimate.h"
#include "engine/optimizer_state.h"
#include "engine/shard.h"
#include "optim/optim.h"

namespace zinc {

// The engine's state a rule works on, once the engine has allocated it
// (UpdateRule::attach). Everything outlives the rule.
struct UpdateContext {
  const Config* cfg = nullptr;
  const StagePlan* plan = nullptr;
  std::vector<BlockShard>* blocks = nullptr;
  OptimizerState* opt_state = nullptr;
  comm::CommStream* reduce_stream = nullptr;  // null on one rank (without offloaded gradients)
  int world = 1, rank = 0;
  DType dtype = DType::kF32;  // the compute dtype
  // Visits every span the update writes, block by block; the engine's
  // coordinator and device path follow each finished block (its new compute
  // weights are complete). overwrite: fn sets every element (a load).
  std::function<void(const std::function<void(const StateSpan&)>&, bool overwrite)> visit_updating;
  // Where a span's new compute weights go; null where the master weights
  // are the compute weights (stage 0 in fp32).
  std::function<char*(const StateSpan&)> compute_out;
  // A span's reduced gradient (the full block's at stage 0, the rank's
  // shard otherwise, or what the state read from NVMe).
  std::function<const float*(const StateSpan&)> grad;
  // Tensor parts (null without them): per-tensor sums over this part's
  // share of each parameter (tensor k of block b is first_tensor[b] + p),
  // made the whole tensor's (summed over the parts; a parameter every part
  // holds whole counted once). Collective over the parts.
  std::function<void(std::vector<double>& sums, const std::vector<int>& first_tensor)> sum_tensor_parts;
  // Per block, per parameter: 1 where weight decay passes it by
  // (OptimizerConfig::decay_vectors false: the 1-D ones); empty: none.
  std::vector<std::vector<char>> no_decay;
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  // Once the engine's state exists, before any step or load.
  virtual void attach(const UpdateContext& c) { ctx_ = c; }

  // ---- the step ----
  // The learning rate of the update about to run and, where the schedule
  // sets them (OneCycle), its betas.
  virtual void set_hyperparameters(double lr, std::optional<std::pair<double, double>> betas) = 0;
  // Whether the boundary before optimizer step t (1-based) keeps each
  // rank's gradients local, unreduced (the 1-bit optimizers past their
  // warm-up): asked by backward and by the step.
  virtual bool local_gradients(int64_t /*t*/) const { return false; }
  // With local gradients: this rank's sum of their squares (the norm is the
  // root mean square over ranks).
  virtual double local_squares() const { return 0; }
  // The update of optimizer step t where the device holds the optimizer
  // states (false: the host updates, through apply()).
  virtual bool apply_on_device(DevicePath& /*device*/, int64_t /*t*/, float /*grad_scale*/) { return false; }
  // The update of optimizer step t over this rank's spans, with the
  // gradient scale (1/accumulation, 1/loss scale, the clip) folded in.
  virtual void apply(int64_t t, float grad_scale) = 0;
  // Whether apply() may run on another thread behind the next forward
  // (Note [the update behind the forward] in gpu_offload.cpp): it touches
  // only the spans it visits and the rule's own state, and no collective.
  virtual bool may_run_behind() const { return false; }
  // After the update of step t (on the host or the device) and the
  // parameters' gather: what the rule's schedule does next.
  virtual void after_update(int64_t /*t*/) {}

  // ---- checkpoints ----
  // Its own part, in files of its own beside the rank's shard in the
  // partial folder; the entries it adds to the rank's index (null: none).
  virtual nlohmann::json save(const std::string& /*partial_dir*/) { return nullptr; }
  // Before a load changes anything: reads and verifies its part (kept
  // until finish_load); throws IoError naming the file.
  virtual void prepare_load(const ckpt::TagFiles& /*files*/) {}
  // While the states load: a span's values where they are this rank's own.
  virtual void load_span(const StateSpan& /*sp*/) {}
  // After the states and the step counters are loaded (t optimizer steps done).
  virtual void finish_load(int64_t /*t*/) {}

 protected:
  UpdateContext ctx_;
};

// ---- the rules the 1-bit ones build on (update_rule.cpp) ----

// Adam and AdamW (optim::adam_step, Note [Adam arithmetic]).
class AdamWRule : public UpdateRule {
 public:
  explicit AdamWRule(const optim::AdamParams& p) : adam_(p) {}
  void set_hyperparameters(double lr, std::optional<std::pair<double, double>> betas) override;
  bool apply_on_device(DevicePath& device, int64_t t, float grad_scale) override;
  void apply(int64_t t, float grad_scale) override;
  bool may_run_behind() const override { return true; }
  const optim::AdamParams& params() const { return adam_; }

 private:
  void update_span(const StateSpan& sp, int64_t t, float grad_scale);
  optim::AdamParams adam_;
};

// Lamb (Note [Lamb arithmetic] in optim/detail/lamb_math.h): per-tensor
// trust ratios in two passes, the norms summed over the ranks' shards.
class LambRule : public UpdateRule {
 public:
  explicit LambRule(const optim::LambParams& p) : lamb_(p) {}
  void set_hyperparameters(double lr, std::optional<std::pair<double, double>> betas) override;
  bool apply_on_device(DevicePath& device, int64_t t, float grad_scale) override;
  void apply(int64_t t, float grad_scale) override;
  // Its trust ratios' all-reduce runs only where the optimizer is sharded
  // over ranks, which the update behind the forward excludes.
  bool may_run_behind() const override { return !ctx_.reduce_stream || ctx_.plan->optimizer_spans_block; }
  const optim::LambParams& params() const { return lamb_; }
  // The trust ratios of the last update, per tensor (block and layout order).
  const std::vector<double>& ratios() const { return ratios_; }
  int tensors() const { return tensors_; }

 private:
  std::vector<optim::LambSegment> span_segments(const StateSpan& sp) const;
  // Numbers the model's tensors (first_tensor_, tensors_) at the first update.
  void number_tensors();
  // The ratios from this rank's sums, added over the ranks where the
  // states are sharded.
  void set_ratios(std::vector<double>& sums);
  optim::LambParams lamb_;
  // Tensor k of the model is parameter p of block b at first_tensor_[b] + p.
  std::vector<int> first_tensor_;
  int tensors_ = 0;
  std::vector<double> ratios_;
};

// The segments of the flat range [flat_begin, flat_begin + count) of a block
// laid out as `layout`, relative to flat_begin: parameter p becomes tensor
// first_tensor + p, gaps and padding tensor -1. They tile [0, count).
std::vector<optim::LambSegment> lamb_segments(const BlockLayout& layout, int64_t flat_begin, int64_t count,
                                              int first_tensor);

// The rule of c.optimizer.type (the registry: one line per optimizer).
std::unique_ptr<UpdateRule> make_update_rule(const Config& c);

// The model-state memory a rule adds beyond the fp32 master weights and
// Adam's m and v, for --estimate: `layouts` the blocks', `span_numel` this
// rank's optimizer span in elements.
std::vector<MemoryPart> update_rule_memory(const Config& c, const std::vector<BlockLayout>& layouts,
                                           int64_t span_numel, int world);

}  // namespace zinc
