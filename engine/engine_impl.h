// zinc engine, private: Engine::Impl, the engine's state, shared by the
// units that define its parts:
// - engine.cpp: construction and the step in docs/design.md's order (forward,
//   backward, step, the optimizer update), and the public Engine API;
// - checkpoint_io.cpp: the checkpoint protocol (save, load, the ranks'
//   agreement on each phase), beside the format in checkpoint.cpp;
// - engine_ranks.cpp: the ranks' agreement on what they train.
// Where the model computes is the DevicePath's business (gpu_offload.h): the
// step calls it at fixed points and never asks which device it is.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "comm/onebit.h"
#include "core/dtype.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/gpu_offload.h"
#include "engine/grad_reducer.h"
#include "engine/model.h"
#include "engine/optimizer_state.h"
#include "engine/param_coordinator.h"
#include "engine/shard.h"
#include "optim/loss_scaler.h"
#include "optim/optim.h"

namespace zinc {

struct Engine::Impl final : StepContext {
  Config cfg;
  std::shared_ptr<Model> model;
  std::shared_ptr<comm::Communicator> comm;
  // Two ordered streams (world > 1 only): gradient reductions and the
  // gradient-norm sum on `reduce_stream` over `comm`; parameter gathers on
  // `gather_stream` over comm's twin (Communicator::twin), so a gather never
  // queues behind a reduction. Where the transport has no twin (MPI below
  // MPI_THREAD_MULTIPLE) both are the one stream.
  std::unique_ptr<comm::Communicator> local_comm;  // one rank, parameters offloaded (below)
  std::unique_ptr<comm::CommStream> reduce_stream, own_gather_stream;
  comm::CommStream* gather_stream = nullptr;
  int world = 1, rank = 0;
  StagePlan plan;
  DType dtype;
  std::vector<BlockShard> blocks;
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<ParamCoordinator> params;
  optim::AdamParams adam;
  optim::LambParams lamb;  // used when cfg.optimizer.type is Lamb
  optim::LrSchedule schedule;
  // fp16: Note [dynamic loss scaling] (optim/loss_scaler.h). Without fp16
  // the scale is 1 and never changes.
  bool loss_scaling = false;
  optim::LossScaler scaler;
  int64_t num_params = 0;

  int64_t micro_steps = 0;      // backward() calls so far
  int64_t global_steps = 0;     // boundaries reached
  int64_t skipped_steps = 0;    // boundaries whose update was skipped (non-finite gradients, no targets)
  int64_t overflow_steps = 0;   // of those, fp16 overflows under dynamic loss scaling (this process's, not saved)
  int64_t optimizer_steps = 0;  // updates applied (Adam's t, the schedule's step)
  double grad_norm = 0;
  double lr = 0;
  bool forward_pending = false;  // a forward whose backward has not run
  double loss_sum = 0;           // this rank's sum of micro-batch losses in the current global batch
  int64_t loss_count = 0;
  // This rank's part of the normaliser (Note [the loss normaliser] in
  // engine.cpp), over the micro-batches of the current global batch:
  double target_count = 0;       // targets (positions not kIgnoreTarget)
  double position_count = 0;     // B*T summed
  double position_sq = 0;        // (B*T)^2 summed
  double target_loss_sum = 0;    // mean loss x targets, summed
  double last_loss = NAN;
  StepTimings timings;
  StateMemory memory;
  std::unique_ptr<OptimizerState> opt_state;  // master, m, v: RAM, pinned RAM or NVMe
  OffloadDevice offload_device = OffloadDevice::kNone;
  // Where the model computes: nothing to do on the CPU; GpuOffload with
  // "device": "cuda" (Note [the GPU path] in gpu_offload.cpp).
  std::unique_ptr<DevicePath> device;
  bool boundary_backward = false;
  bool step_pending = false;  // a boundary backward ran; its step() has not

  Impl(std::shared_ptr<Model> m, const Config& c, std::shared_ptr<comm::Communicator> cm);
  ~Impl() override;
  void make_streams();
  void allocate_and_init();

  // ---- StepContext --------------------------------------------------------------
  DType compute_dtype() const override { return dtype; }
  BlockParams acquire_params(int block) override;
  void release_params(int block) noexcept override;
  BlockGrads grads(int block) override;
  void grads_ready(int block) override;

  // A model that keeps a HeldParams past its forward or backward.
  void check_released(const char* phase) const;
  BlockShard& state(int block);

  // ---- training ---------------------------------------------------------------------
  // Returns the batch's target count.
  int64_t check_batch(const Batch& batch) const;

  // A boundary backward's step() must run before the next micro-batch: its
  // reductions may still be in flight (on the GPU, freeing the gradient
  // buffers the next backward would write), and its losses belong to it.
  void check_stepped(const char* what) const;
  float forward(const Batch& batch);
  void backward();

  double loss_scale() const { return loss_scaling ? scaler.scale() : 1.0; }
  static std::string num_text(double v);
  bool at_boundary() const;
  void step();

  // AdamW over one span of the optimizer state: the gradient is the full
  // reduced gradient (the optimizer spans the block, stage 0) or the rank's
  // reduced shard; the new weights go to the compute copy, or at stage 3 the
  // compute shard (bf16 in the same pass, fp32 copied), unless the master
  // weights are the compute weights.
  // Where a span's compute weights go: the compute copy's part of it, or at
  // stage 3 the compute shard's; null where the master weights are the
  // compute weights.
  char* compute_out(const StateSpan& sp);
  void update_span(const StateSpan& sp, float grad_scale);

  // The spans come block by block: once the visitor moves past a block, its
  // new compute shard is complete and (on NVMe) goes back to disk.
  void update_all(float grad_scale);

  // The optimizer's lr for optimizer step `s` (0-based) and, where the
  // schedule sets them (OneCycle's cycle_momentum, as DeepSpeed writes the
  // param group's betas), its betas.
  void set_hyperparameters(int64_t s);

  // ---- Lamb (Note [Lamb arithmetic] in optim/detail/lamb_math.h) ------------------
  // Tensor t of the model is parameter p of block b at lamb_first_tensor[b] + p.
  std::vector<int> lamb_first_tensor;
  int lamb_tensors = 0;
  const float* update_grad(const StateSpan& sp);
  std::vector<optim::LambSegment> lamb_span_segments(const StateSpan& sp) const;

  // Pass 1 reads every span (from NVMe without writing back) for each
  // tensor's sums of w^2 and u^2; with sharded optimizer state (stages 1-3)
  // the ranks' partial sums are added in one all-reduce; pass 2 applies the
  // update with each tensor's trust ratio.
  void lamb_update_all(float grad_scale);
  // overwrite: fn sets every element of master, m and v (a load), so states
  // on NVMe need not be read first.
  void visit_updating(const std::function<void(const StateSpan&)>& fn, bool overwrite = false);

  // ---- OneBitAdam and ZeroOneAdam (Notes [1-bit Adam], [0/1 Adam] in onebit_step.cpp) ----
  // What the step about to run (optimizer step optimizer_steps + 1) does.
  enum class OneBitMode {
    kFull,                // plain Adam on the averaged gradient (warm-up; 0/1 Adam's variance steps)
    kCompressedMomentum,  // 1-bit Adam past the freeze: local momentum, averaged at 1 bit
    kCompressedGrad,      // 0/1 Adam between variance steps: the gradient averaged at 1 bit
    kLocal,               // 0/1 Adam past the freeze: local steps, synchronised at 1 bit
    kLambCompressed,      // 1-bit Lamb past the freeze: scaled momentum averaged at 1 bit
  };
  OneBitMode onebit_mode() const;
  // Gradients stay local at the boundary (any mode but kFull).
  bool onebit_local_grads() const;
  bool onebit_step_now = false;  // the step being applied is one of onebit_update_all's
  OneBitMode onebit_now = OneBitMode::kFull;
  // One compressed all-reduce per parameter tensor, [block][param], made at
  // the first compressed step (world > 1), with their error feedback.
  std::vector<std::vector<comm::CompressedAllReduce>> onebit_ar;
  bool onebit_announced = false;
  // 0/1 Adam's schedule (replayed from the step count on a load) and, past
  // the freeze, each rank's accumulated local updates (per block) and the
  // sum of their learning rates since the last synchronisation.
  int64_t zo_var_interval = 1, zo_var_counter = 0, zo_local_interval = 1, zo_local_counter = 0;
  bool zo_errors_reset = false;
  double zo_lrs = 0;
  std::vector<std::vector<float>> zo_accum;
  void zero_one_after_step(int64_t t);
  // 1-bit Lamb (Note [1-bit Lamb]): per tensor (in block and layout order)
  // the warm-up's moving average of the trust ratio, the last factor and
  // the momentum scaling (set at the first compressed step); the fresh
  // variance estimate per block span; one compressed all-reduce over every
  // tensor's momentum, concatenated.
  std::vector<double> ob_lamb_coeff, ob_last_factor, ob_scaling;
  std::vector<std::vector<float>> ob_v_fresh;
  std::unique_ptr<comm::CompressedAllReduce> ob_flat;
  std::vector<double> lamb_ratios;  // the trust ratios of lamb_update_all's last step, per tensor
  std::vector<float> onebit_scratch;  // 0/1 Adam: a block's averaged gradient; 1-bit Lamb on one rank: the flat momentum
  void onebit_lamb_after_full(int64_t t);
  void onebit_lamb_update_all(float grad_scale);
  int64_t onebit_tensor_count() const;
  // This rank's sum of squares of its own (unreduced) gradients.
  double onebit_local_squares();
  void onebit_update_all(float grad_scale);
  void onebit_span(const StateSpan& sp, float grad_scale, bool sync);
  void onebit_make_compressors();
  // The rank's own part of a checkpoint: the error feedback and, with 0/1
  // Adam past the freeze, its weights, momentum and accumulated updates
  // (which differ between ranks between synchronisations), in a file beside
  // its shard (nothing when none of it exists, or on one rank).
  nlohmann::json onebit_save(const std::string& partial_dir);
  struct OneBitSaved {
    std::string why;             // why the rank-specific part is not used (empty: it is)
    std::vector<float> errors;   // worker then server error, tensor by tensor (1-bit Lamb: the one flat buffer)
    std::vector<float> accum, master, m;  // 0/1 Adam's, per block span, concatenated
    double lrs = 0;
    bool lamb = false;           // 1-bit Lamb's state (the same on every rank; any world size)
    std::vector<float> v_fresh;  // per block span, concatenated
    std::vector<double> lamb_coeff, last_factor, scaling;
  };
  // Reads and verifies this rank's part (before anything is loaded).
  OneBitSaved onebit_read(const ckpt::TagFiles& files) const;
  // While the states load: a span's rank-specific weights and momentum.
  void onebit_overwrite_span(const OneBitSaved& saved, const StateSpan& sp) const;
  // After the states and step counters are loaded.
  void onebit_restore(const OneBitSaved& saved);

  // ---- ranks agree on what they train -------------------------------------------------
  // Every rank must be given the same config and model: ranks that differ
  // train diverging shards and save a checkpoint whose metadata names one
  // config. One all-reduce compares a digest (a cut 64-bit hash in two exact
  // halves, as max(x) == -max(-x) only when all are equal); where they
  // differ, rank 0's and the lowest differing rank's documents go to every
  // rank, which all stop with the same error naming the first differing key.
  nlohmann::json what_we_train() const;

  // `text` of rank `root` on every rank.
  std::string broadcast_text(const std::string& text, int root);
  void agree_on_config();

  // The first place where a and b differ (depth first, keys in order), the
  // path in the config's dotted form and both values (cut short).
  static bool first_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& at,
                               std::string& path, std::string& va, std::string& vb);

  // ---- checkpoints (Note [checkpoints] in engine/checkpoint.cpp) ---------------------
  // Whether any rank failed (the largest rank+1 that did, 0 if none): every
  // rank learns it, so that all fail together or none does.
  int failed_rank(bool failed);

  // Every rank uses rank 0's tag, so that all write into one checkpoint;
  // checkpoint.tag_validation says whether a rank that passed another one
  // is an error (Fail), a warning (Warn) or neither (Ignore).
  std::string agree_on_tag(const std::string& tag);
  void check_between_batches(const char* what) const;
  nlohmann::json blocks_json() const;
  void save_checkpoint(const std::string& dir, std::string tag, const nlohmann::json& client_state);

  // Throws unless the checkpoint holds this model's blocks (names, sizes,
  // parameters); `names` gets the block names for the reader's messages.
  void check_same_model(const ckpt::TagFiles& files, std::vector<std::string>& names) const;

  // Note [a failed load]
  // ---------------------
  // A load is verified before it changes anything: open_tag checks every
  // file of the tag (checksums of the metadata and indexes, their structure,
  // the shard files' sizes), then the checkpoint's blocks are compared with
  // this model's. Only what shows while reading (a chunk of a shard file
  // that fails its checksum, a read error) is found after some states were
  // overwritten. Then the engine refuses forward (so backward and step),
  // evaluate, save_checkpoint and full_params until a load succeeds: training on from
  // half-loaded states would look like a resumed run and is not one. The
  // ranks agree on the outcome of each phase (failed_rank) before any
  // collective, so all fail together and none waits for another.
  std::string failed_load;  // the failed load's error while the state is incomplete

  void check_loaded(const char* what) const;

  // Runs `fn` on every rank; if it failed on any, every rank throws (the
  // failing one its own error, the others one naming that rank).
  void on_every_rank(const std::string& what, const std::function<void()>& fn);
  nlohmann::json load_checkpoint(const std::string& dir, std::string tag);
  std::vector<float> full_params(int block);
};

}  // namespace zinc
