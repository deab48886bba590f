// zinc engine, private: the 1-bit optimizers' update rules, OneBitAdam,
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

// What the three share: the warm-up's rule (their family's plain rule,
// AdamW or Lamb, with bias correction off), the compressed all-reduce per
// tensor with its error feedback, the announcement of the first compressed
// step, and the checkpoint file that holds each rank's part (the base
// writes and reads the error feedback; each rule its own sections). Each
// rule owns its own state: OneBitAdamRule none beyond this, ZeroOneAdamRule
// its schedule and local accumulators, OneBitLambRule its trust-ratio
// averages, momentum scales, fresh variance and flat compressor.
class OneBitRule : public UpdateRule {
 public:
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
  nlohmann::json save(const std::string& partial_dir) override;
  void prepare_load(const ckpt::TagFiles& files) override;
  void load_span(const StateSpan& sp) override;
  void finish_load(int64_t t) override;

  // One rank's 1-bit file as its rank index describes it, read and
  // verified (update_onebit_checkpoint.cpp).
  struct SavedFile;

  // What optimizer step t (1-based) does.
  enum class Mode {
    kFull,                // the family's plain step on the averaged gradient (warm-up; 0/1 Adam's variance steps)
    kCompressedMomentum,  // 1-bit Adam past the freeze: local momentum, averaged at 1 bit
    kCompressedGrad,      // 0/1 Adam between variance steps: the gradient averaged at 1 bit
    kLocal,               // 0/1 Adam past the freeze: local steps, synchronised at 1 bit
    kLambCompressed,      // 1-bit Lamb past the freeze: scaled momentum averaged at 1 bit
  };

 protected:
  OneBitRule(const Config& c, std::unique_ptr<UpdateRule> full)
      : type_(c.optimizer.type), onebit_(c.optimizer.onebit), full_(std::move(full)) {}

  virtual Mode mode_at(int64_t t) const = 0;
  virtual void apply_compressed(Mode mode, int64_t t, float grad_scale) = 0;

  // A checkpoint's part, read and verified by prepare_load, applied by
  // load_span and finish_load: the base's error feedback, then each rule's
  // own sections.
  struct Saved {
    std::string why;             // why the rank-specific part is not used (empty: it is)
    std::vector<float> errors;   // worker then server error, tensor by tensor (1-bit Lamb: the one flat buffer)
    std::vector<float> accum, master, m;  // 0/1 Adam's, per block span, concatenated
    double lrs = 0;
    bool lamb = false;           // 1-bit Lamb's state (the same on every rank; any world size)
    std::vector<float> v_fresh;  // per block span, concatenated
    std::vector<double> lamb_coeff, last_factor, scaling;
  };
  // The error feedback's floats in the file at this world size.
  virtual int64_t error_floats() const;
  // This rule's sections of the file: its bytes of each and the rank
  // index's extra entries (save), and reading them back (the file's bytes,
  // its index entry, where its own sections start).
  virtual void save_sections(std::string& /*errors*/, std::string& /*zero_one*/, std::string& /*lamb*/,
                             nlohmann::json& /*entry*/) const {}
  virtual void read_sections(const ckpt::TagFiles& /*files*/, const SavedFile& /*f*/, int /*saved_world*/,
                             Saved& /*out*/) const {}
  // After the states are loaded: the rule's own state from `saved` (its
  // schedule replayed to step t), the error feedback included.
  virtual void restore(const Saved& saved, int64_t t);

  std::vector<BlockShard>& blocks() const { return *ctx_.blocks; }
  void visit(const std::function<void(const StateSpan&)>& fn) { ctx_.visit_updating(fn, false); }
  void make_compressors();
  int64_t tensor_count() const;
  // The line rank 0 logs at the first compressed step (once per run or load).
  void announce(const std::string& line);
  // The per-tensor compressed step of the Adam pair over one block span
  // (Notes [1-bit Adam], [0/1 Adam]).
  void adam_span(const StateSpan& sp, Mode mode, float grad_scale, bool sync, const optim::AdamParams& adam,
                 std::vector<std::vector<float>>* accum, double lrs);

  const OptimizerType type_;  // for messages
  const OneBitConfig onebit_;
  std::unique_ptr<UpdateRule> full_;  // the warm-up's rule
  // One compressed all-reduce per parameter tensor, [block][param], made at
  // the first compressed step (world > 1), with their error feedback (the
  // Adam pair).
  std::vector<std::vector<comm::CompressedAllReduce>> onebit_ar;
  bool onebit_announced = false;
  std::vector<float> onebit_scratch;  // 0/1 Adam: a block's averaged gradient; 1-bit Lamb on one rank: the flat momentum

 private:
  Saved read_saved(const ckpt::TagFiles& files) const;
  Saved saved_;
};

// 1-bit Adam (Note [1-bit Adam]).
class OneBitAdamRule final : public OneBitRule {
 public:
  explicit OneBitAdamRule(const Config& c);

 private:
  Mode mode_at(int64_t t) const override {
    return t <= onebit_.freeze_step ? Mode::kFull : Mode::kCompressedMomentum;
  }
  void apply_compressed(Mode mode, int64_t t, float grad_scale) override;
  const AdamWRule* adam_;  // full_
};

// 0/1 Adam (Note [0/1 Adam]): its schedule and, past the freeze, the ranks'
// local accumulators.
class ZeroOneAdamRule final : public OneBitRule {
 public:
  explicit ZeroOneAdamRule(const Config& c);
  void after_update(int64_t t) override;

 private:
  Mode mode_at(int64_t t) const override;
  void apply_compressed(Mode mode, int64_t t, float grad_scale) override;
  void save_sections(std::string& errors, std::string& zero_one, std::string& lamb,
                     nlohmann::json& entry) const override;
  void read_sections(const ckpt::TagFiles& files, const SavedFile& f, int saved_world, Saved& out) const override;
  void restore(const Saved& saved, int64_t t) override;

  const AdamWRule* adam_;  // full_
  // The schedule (replayed from the step count on a load) and, past the
  // freeze, each rank's accumulated local updates (per block) and the sum
  // of their learning rates since the last synchronisation.
  int64_t var_interval_ = 1, var_counter_ = 0, local_interval_ = 1, local_counter_ = 0;
  bool errors_reset_ = false;
  double lrs_ = 0;
  std::vector<std::vector<float>> accum_;
};

// 1-bit Lamb (Note [1-bit Lamb]): per tensor (in block and layout order) the
// warm-up's moving average of the trust ratio, the last factor and the
// momentum scaling (set at the first compressed step); the fresh variance
// estimate per block span; one compressed all-reduce over every tensor's
// momentum, concatenated.
class OneBitLambRule final : public OneBitRule {
 public:
  explicit OneBitLambRule(const Config& c);
  void after_update(int64_t t) override {
    if (t <= onebit_.freeze_step) after_full(t);
  }

 private:
  Mode mode_at(int64_t t) const override { return t <= onebit_.freeze_step ? Mode::kFull : Mode::kLambCompressed; }
  void apply_compressed(Mode mode, int64_t t, float grad_scale) override;
  void after_full(int64_t t);
  void update_all(float grad_scale);
  const optim::LambParams& lamb() const { return lamb_->params(); }
  int64_t error_floats() const override;
  void save_sections(std::string& errors, std::string& zero_one, std::string& lamb,
                     nlohmann::json& entry) const override;
  void read_sections(const ckpt::TagFiles& files, const SavedFile& f, int saved_world, Saved& out) const override;
  void restore(const Saved& saved, int64_t t) override;

  const LambRule* lamb_;  // full_
  std::vector<double> coeff_, last_factor_, scaling_;
  std::vector<std::vector<float>> v_fresh_;
  std::unique_ptr<comm::CompressedAllReduce> flat_;
};

}  // namespace zinc
