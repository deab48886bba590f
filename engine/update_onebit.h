// zinc engine, private: the 1-bit optimizers' update rule, OneBitAdam,
// ZeroOneAdam and OneBitLamb (Notes [1-bit Adam], [0/1 Adam] and [1-bit
// Lamb] in update_onebit.cpp): the steps in update_onebit.cpp, the
// checkpoint part in update_onebit_checkpoint.cpp. Threading: as UpdateRule.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/onebit.h"
#include "engine/update_rule.h"

namespace zinc {

// The 1-bit optimizers' rule. Their warm-up (and 0/1 Adam's variance steps)
// is the plain rule of their family, AdamW or Lamb, with bias correction
// off; past it, the steps below. One class for the three: they share the
// compressors, their error feedback and its checkpoint file, and differ in
// mode_at, the modes' updates and what follows an update.
class OneBitRule final : public UpdateRule {
 public:
  explicit OneBitRule(const Config& c) : type_(c.optimizer.type), onebit_(c.optimizer.onebit) {
    if (type_ == OptimizerType::kOneBitLamb) {
      auto r = std::make_unique<LambRule>(c.optimizer.lamb);
      lamb_rule_ = r.get();
      full_ = std::move(r);
    } else {
      auto r = std::make_unique<AdamWRule>(c.optimizer.adam);
      adam_rule_ = r.get();
      full_ = std::move(r);
    }
  }
  void attach(const UpdateContext& c) override {
    UpdateRule::attach(c);
    full_->attach(c);
  }
  void set_hyperparameters(double lr, std::optional<std::pair<double, double>> betas) override {
    full_->set_hyperparameters(lr, betas);
  }
  bool local_gradients(int64_t t) const override { return mode_at(t) != Mode::kFull; }
  double local_squares() const override;
  bool apply_on_device(DevicePath& device, int64_t t, float grad_scale) override {
    return mode_at(t) == Mode::kFull && full_->apply_on_device(device, t, grad_scale);
  }
  void apply(int64_t t, float grad_scale) override {
    const Mode mode = mode_at(t);
    if (mode == Mode::kFull) return full_->apply(t, grad_scale);
    apply_compressed(mode, t, grad_scale);
  }
  void after_update(int64_t t) override {
    if (type_ == OptimizerType::kZeroOneAdam) zero_one_after_step(t);
    if (type_ == OptimizerType::kOneBitLamb && t <= onebit_.freeze_step) onebit_lamb_after_full(t);
  }
  nlohmann::json save(const std::string& partial_dir) override;
  void prepare_load(const ckpt::TagFiles& files) override;
  void load_span(const StateSpan& sp) override;
  void finish_load(int64_t t) override;

  // What optimizer step t (1-based) does.
  enum class Mode {
    kFull,                // the family's plain step on the averaged gradient (warm-up; 0/1 Adam's variance steps)
    kCompressedMomentum,  // 1-bit Adam past the freeze: local momentum, averaged at 1 bit
    kCompressedGrad,      // 0/1 Adam between variance steps: the gradient averaged at 1 bit
    kLocal,               // 0/1 Adam past the freeze: local steps, synchronised at 1 bit
    kLambCompressed,      // 1-bit Lamb past the freeze: scaled momentum averaged at 1 bit
  };

 private:
  Mode mode_at(int64_t t) const;
  std::vector<BlockShard>& blocks() const { return *ctx_.blocks; }
  const optim::AdamParams& adam() const { return adam_rule_->params(); }
  const optim::LambParams& lamb() const { return lamb_rule_->params(); }
  void visit(const std::function<void(const StateSpan&)>& fn) { ctx_.visit_updating(fn, false); }
  void apply_compressed(Mode mode, int64_t t, float grad_scale);
  void onebit_span(const StateSpan& sp, Mode mode, float grad_scale, bool sync);
  void onebit_lamb_update_all(float grad_scale);
  void onebit_lamb_after_full(int64_t t);
  void zero_one_after_step(int64_t t);
  void onebit_make_compressors();
  int64_t onebit_tensor_count() const;

  const OptimizerType type_;
  const OneBitConfig onebit_;
  std::unique_ptr<UpdateRule> full_;  // the warm-up's rule
  AdamWRule* adam_rule_ = nullptr;    // full_, for OneBitAdam and ZeroOneAdam
  LambRule* lamb_rule_ = nullptr;     // full_, for OneBitLamb
  // One compressed all-reduce per parameter tensor, [block][param], made at
  // the first compressed step (world > 1), with their error feedback.
  std::vector<std::vector<comm::CompressedAllReduce>> onebit_ar;
  bool onebit_announced = false;
  std::vector<float> onebit_scratch;  // 0/1 Adam: a block's averaged gradient; 1-bit Lamb on one rank: the flat momentum
  // 0/1 Adam's schedule (replayed from the step count on a load) and, past
  // the freeze, each rank's accumulated local updates (per block) and the
  // sum of their learning rates since the last synchronisation.
  int64_t zo_var_interval = 1, zo_var_counter = 0, zo_local_interval = 1, zo_local_counter = 0;
  bool zo_errors_reset = false;
  double zo_lrs = 0;
  std::vector<std::vector<float>> zo_accum;
  // 1-bit Lamb (Note [1-bit Lamb]): per tensor (in block and layout order)
  // the warm-up's moving average of the trust ratio, the last factor and
  // the momentum scaling (set at the first compressed step); the fresh
  // variance estimate per block span; one compressed all-reduce over every
  // tensor's momentum, concatenated.
  std::vector<double> ob_lamb_coeff, ob_last_factor, ob_scaling;
  std::vector<std::vector<float>> ob_v_fresh;
  std::unique_ptr<comm::CompressedAllReduce> ob_flat;

  // A checkpoint's part, read and verified by prepare_load, applied by
  // load_span and finish_load.
  struct Saved {
    std::string why;             // why the rank-specific part is not used (empty: it is)
    std::vector<float> errors;   // worker then server error, tensor by tensor (1-bit Lamb: the one flat buffer)
    std::vector<float> accum, master, m;  // 0/1 Adam's, per block span, concatenated
    double lrs = 0;
    bool lamb = false;           // 1-bit Lamb's state (the same on every rank; any world size)
    std::vector<float> v_fresh;  // per block span, concatenated
    std::vector<double> lamb_coeff, last_factor, scaling;
  };
  Saved read_saved(const ckpt::TagFiles& files) const;
  Saved saved_;
};

}  // namespace zinc
