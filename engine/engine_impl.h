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

#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
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
#include "engine/update_rule.h"
#include "optim/loss_scaler.h"
#include "optim/optim.h"

namespace zinc {

// One line per part of `count` (tensor parts, expert ranks): "<label> i
// (ranks i, i + count, ...): what", from part_of(i, &why); ConfigError at
// `key` with why where a part cannot be made. engine/tensor_parallel.cpp.
std::vector<std::string> describe_parts(const std::string& label, const char* key, int count, int world,
                                        const std::function<TensorPart(int, std::string*)>& part_of);

// The losses of the current global batch's micro-batches on this rank and
// its part of the loss normaliser (Note [the loss normaliser] in engine.cpp).
struct BatchLoss {
  double loss_sum = 0;      // micro-batch losses summed
  int64_t count = 0;        // micro-batches
  double targets = 0;       // targets (positions not kIgnoreTarget)
  double positions = 0;     // B*T summed
  double positions_sq = 0;  // (B*T)^2 summed
  double target_loss = 0;   // mean loss x targets, summed
  void add(float loss, int64_t batch_targets, int64_t batch_positions) {
    loss_sum += loss;
    count += 1;
    const double p = static_cast<double>(batch_positions);
    targets += static_cast<double>(batch_targets);
    positions += p;
    positions_sq += p * p;
    target_loss += static_cast<double>(loss) * static_cast<double>(batch_targets);
  }
};

// What the step makes of the ranks' summed BatchLoss (Note [the loss
// normaliser] in engine.cpp): the factor that turns the summed gradients
// into the global batch's mean gradient, and the batch's loss (NaN without
// a target).
struct Normalised {
  bool no_targets = false;  // every target of the global batch masked
  double grad_scale = 0;    // with the loss scale divided out
  double loss = 0;
};

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
  // The optimizer: its hyperparameters, its state beyond master, m and v,
  // its update (Note [update rules] in update_rule.cpp).
  std::unique_ptr<UpdateRule> rule;
  optim::LrSchedule schedule;
  // fp16: Note [dynamic loss scaling] (optim/loss_scaler.h). Without fp16
  // the scale is 1 and never changes.
  bool loss_scaling = false;
  optim::LossScaler scaler;
  int64_t num_params = 0;
  int64_t num_trained = 0;  // outside frozen blocks
  // BlockParams::generation of the blocks held in place: one per engine
  // (a model handed to a second engine packs its weights again).
  uint64_t param_generation = 0;

  int64_t micro_steps = 0;      // backward() calls so far
  int64_t global_steps = 0;     // boundaries reached
  int64_t skipped_steps = 0;    // boundaries whose update was skipped (non-finite gradients, no targets)
  int64_t overflow_steps = 0;   // of those, fp16 overflows under dynamic loss scaling (this process's, not saved)
  int64_t optimizer_steps = 0;  // updates applied (Adam's t, the schedule's step)
  double grad_norm = 0;
  double lr = 0;
  bool forward_pending = false;  // a forward whose backward has not run
  // That forward's loss, targets and positions: they join batch_loss at its
  // backward, so a forward whose backward never runs (another forward
  // replaced it) counts for nothing, as in PyTorch.
  struct {
    float loss = 0;
    int64_t targets = 0, positions = 0;
  } pending;
  BatchLoss batch_loss;          // the current global batch's, this rank's
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
  // The GPU path's host update of optimizer step `behind_step` runs behind
  // the next forward (Note [the update behind the forward] in
  // gpu_offload.cpp): the rest of that step (the rule's after_update, the
  // reducer's reset, the device's after_step) waits for settle_update(),
  // which every entry point but forward calls first.
  bool update_behind = false;
  int64_t behind_step = 0;
  void settle_update();

  // ---- pipeline stages (Note [pipeline parallelism] in pipeline.cpp) -------------------
  // world and rank above are the data-parallel group's (the ranks of this
  // stage, which ZeRO partitions over); these are every rank's.
  int world_all = 1, world_rank = 0;
  int stages = 1, stage = 0;
  std::shared_ptr<comm::Communicator> world_comm;  // every rank (pipelined runs; comm is the group)
  std::unique_ptr<comm::Communicator> pipe_comm;   // this replica's stages, ranked by stage
  PipelinePlan pipe_plan;                          // the stages' layers and blocks (plan_pipeline)
  // On the GPU path: the same ranks as pipe_comm over NCCL, for the
  // activations in GPU memory (Note [pipeline stages on the GPU]).
  std::unique_ptr<comm::Communicator> pipe_device_comm;
  // ... and tp_comm's ranks over NCCL (Note [tensor parts on the GPU]).
  std::unique_ptr<comm::Communicator> tp_device_comm;
  std::unique_ptr<comm::Communicator> tied_comm;   // those two stages of this replica (on them only)
  PipelineStage pass_stage;                        // the pass under way (the whole model without stages)
  int64_t pipe_recomputed = 0;                     // forwards computed again before their backward
  double pipe_wait_s = 0;                          // in point-to-point transfers: the bubble and the wire
  bool pipelined() const { return stages > 1; }
  const PipelineStage& pipeline_stage() const override { return pass_stage; }
  // Splits comm into the grid's groups and picks this stage's layers.
  void setup_pipeline();
  // One global batch through the 1F1B schedule; the engine's step at its end.
  float train_pipeline(DataLoader& loader);
  // One micro-batch's loss through every stage (evaluate).
  float evaluate_pipeline(const Batch& batch);
  // Forward and backward of this stage for micro-batch `micro` of the
  // global batch (its index since the run began, for dropout).
  float stage_forward(const Batch& batch, int64_t micro, const float* in, float* out);
  void stage_backward(bool boundary, const float* dout, float* din);
  // The batch's squared gradient norm and loss sums over every rank,
  // summed block by block in block order (Note [the gradient norm over
  // stages] in pipeline.cpp): sums[0] the squares, 1.. BatchLoss's.
  void reduce_step_sums(double sums[7], bool local_grads);
  // The gradients of the blocks two stages share, summed between them
  // (Note [tied blocks across stages] in pipeline.cpp).
  void reduce_tied_gradients();

  // ---- tensor parts (Note [tensor parallelism] in tensor_parallel.cpp) ------------------
  // The ranks of one stage of one replica split each layer into tp_size
  // parts; this rank computes part tp_rank. Grid rank = (stage * replicas
  // + replica) * tp_size + tp_rank.
  int tp_size = 1, tp_rank = 0;
  double tp_wait_s = 0;  // in the parts' all-reduces (the training thread waits them out)
  std::unique_ptr<comm::Communicator> tp_comm;      // the parts of this stage of this replica
  std::vector<TensorPart> tp_parts;                 // every part's blocks and splits (Model::tensor_part)
  bool tensor_split() const { return tp_size > 1; }
  // Expert parallelism (Note [expert parallelism] in expert_parallel.cpp)
  // runs on the same machinery: its parts (tp_*) are the expert ranks,
  // which hold a share of the experts and the whole dense weights, and,
  // unlike tensor parts, train on batches of their own. Grid rank =
  // replica * tp_size + tp_rank; comm, world and rank are the ranks that
  // hold the same experts.
  bool expert_parts = false;
  std::vector<uint16_t> ep_wire;  // a dense run's gradient in communication_data_type (sum_part_gradients)
  double ep_wait_s = 0;  // in the experts' exchanges
  void setup_experts();
  void expert_counts(const int32_t* send, int32_t* recv, int64_t per_rank) override;
  void expert_exchange(const float* send, const int64_t* send_rows, float* recv, const int64_t* recv_rows,
                       int64_t width) override;
  // This rank's batches among all the run's: the replica's, or with expert
  // ranks (each with its own batches) replica * tp_size + tp_rank of
  // world * tp_size.
  int data_rank() const { return expert_parts ? rank * tp_size + tp_rank : rank; }
  int data_world() const { return expert_parts ? world * tp_size : world; }
  // Part r's TensorPart checked against the whole model's blocks.
  void check_part(const TensorPart& part, int r, const char* what) const;
  // The blocks the engine keeps: this part's, or the model's.
  const std::vector<BlockSpec>& specs() const {
    return tp_parts.empty() ? model->blocks() : tp_parts[static_cast<size_t>(tp_rank)].blocks;
  }
  // Splits comm into the grid's groups (tensor parts, pipeline stages,
  // replicas); comm, world and rank become the replicas'.
  void setup_grid();
  void tensor_all_reduce(float* data, int64_t n) override;
  void tensor_all_reduce_f64(double* data, int64_t n) override;
  void tensor_all_reduce_max_f64(double* data, int64_t n) override;
  // How parameter p of block b of part `part` is cut (whole without parts).
  const TensorSplit& split_of(size_t b, size_t p, int part) const;
  // The gradients of whole parameters that each part applies to its own
  // share (TensorSplit::sum_grads), summed over the parts.
  void sum_part_gradients();
  // Block b's squared gradient norm on this rank: its own shard, where a
  // whole parameter counts on part 0 only.
  double block_squares(size_t b);
  // Per block, the flat ranges whose squares count in this part's norm
  // (DevicePath::set_norm_ranges).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> part_norm_ranges() const;
  // Lamb's per-tensor sums made the whole tensors' (UpdateContext::sum_tensor_parts).
  void sum_tensor_parts(std::vector<double>& sums, const std::vector<int>& first_tensor);
  // The whole model's block `block` (model->blocks()' layout) from this
  // part's flat values `part`: every part's, gathered over the parts.
  std::vector<float> whole_from_parts(int block, const std::vector<float>& part);
  // For a checkpoint of tensor parts: the whole states (master, m, v) of
  // the blocks this rank writes, of those `saves` says its stage saves.
  // Collective over the stage's ranks.
  std::map<int, std::array<std::vector<float>, 3>> gather_whole_states(const std::function<bool(size_t)>& saves);
  // Parameter p of block b of this part, cut from the whole parameter's
  // values (`whole`, row-major).
  void cut_part(int b, int p, const float* whole, float* out) const;

  // ---- sequence ranks (Note [sequence parallelism] in sequence_parallel.cpp) ------------
  // The sp_size ranks of a replica each compute slice sp_rank of its rows;
  // grid rank = replica * sp_size + sp_rank. ZeRO's group (comm, world,
  // rank) spans every rank.
  int sp_size = 1, sp_rank = 0;
  double sp_wait_s = 0;                          // in the attention's all-to-alls
  std::unique_ptr<comm::Communicator> sp_comm;   // the sequence ranks of this replica
  std::unique_ptr<comm::Communicator> sp_device_comm;  // the same ranks over NCCL (the GPU path)
  SequenceSplit sp_pass;                         // the pass under way's
  std::vector<int32_t> sp_positions;             // its whole rows' positions (packed documents)
  bool sequence_ranks() const { return sp_size > 1; }
  void setup_sequence(int replica);
  // This rank's slice of a micro-batch (and sp_pass for the model), after
  // checking that the replica's ranks were given the same one.
  Batch sequence_slice(const Batch& whole);
  // The micro-batch's loss over its whole rows from this slice's.
  float sequence_loss(float loss, int64_t targets);
  const SequenceSplit& sequence_split() const override { return sp_pass; }
  void sequence_all_to_all(const float* send, float* recv, int64_t per_rank) override;

  Impl(std::shared_ptr<Model> m, const Config& c, std::shared_ptr<comm::Communicator> cm);
  ~Impl() override;
  void make_streams();
  void allocate_and_init();

  // ---- StepContext --------------------------------------------------------------
  DType compute_dtype() const override { return dtype; }
  float coming_loss_scale() const override { return static_cast<float>(loss_scale()); }
  BlockParams acquire_params(int block) override;
  void release_params(int block) noexcept override;
  BlockGrads grads(int block) override;
  void grads_ready(int block) override;
  uint64_t dropout_seed() const override { return pass_dropout_seed; }
  uint64_t pass_dropout_seed = 0;  // this forward's (0 in an evaluation)

  // A model that keeps a HeldParams past its forward or backward.
  void check_released(const char* phase) const;
  BlockShard& state(int block);

  // ---- training ---------------------------------------------------------------------
  // Returns the batch's target count.
  int64_t check_batch(const Batch& batch) const;
  static int64_t count_targets(const Batch& batch);

  // A boundary backward's step() must run before the next micro-batch: its
  // reductions may still be in flight (on the GPU, freeing the gradient
  // buffers the next backward would write), and its losses belong to it.
  void check_stepped(const char* what) const;
  float forward(const Batch& batch);
  void backward();
  // The model's backward between the reducer's begin and end (`reduce`: at
  // a boundary), with the checks that every trained block reported.
  void run_backward(bool reduce);

  double loss_scale() const { return loss_scaling ? scaler.scale() : 1.0; }
  static std::string num_text(double v);
  bool at_boundary() const;
  void step();

  // Where a span's compute weights go: the compute copy's part of it, or at
  // stage 3 the compute shard's; null where the master weights are the
  // compute weights.
  char* compute_out(const StateSpan& sp);
  // A span's reduced gradient: the full block's (the optimizer spans the
  // block, stage 0), the rank's reduced shard, or what the state read from NVMe.
  const float* update_grad(const StateSpan& sp);

  // The optimizer's lr for optimizer step `s` (0-based) and, where the
  // schedule sets them (OneCycle's cycle_momentum, as DeepSpeed writes the
  // param group's betas), its betas.
  void set_hyperparameters(int64_t s);

  // The spans come block by block: once the visitor moves past a block, its
  // new compute shard is complete and (on NVMe) goes back to disk.
  // overwrite: fn sets every element of master, m and v (a load), so states
  // on NVMe need not be read first.
  void visit_updating(const std::function<void(const StateSpan&)>& fn, bool overwrite = false);

  // ---- ranks agree on what they train -------------------------------------------------
  // Every rank must be given the same config and model (engine/rank_agreement.h):
  // ranks that differ train diverging shards and save a checkpoint whose
  // metadata names one config; at ZeRO stage 0 also the same optimizer
  // kernels, as every rank updates the whole model.
  nlohmann::json what_we_train() const;
  void agree_on_config();

  // ---- checkpoints (Note [checkpoints] in engine/checkpoint.cpp) ---------------------
  // Whether any rank failed (the largest rank+1 that did, 0 if none): every
  // rank learns it, so that all fail together or none does.
  int failed_rank(bool failed);
  // Every rank opened the same checkpoint (its tag and metadata), or all throw.
  void agree_on_checkpoint(const std::string& dir, const ckpt::TagFiles& files);

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
  std::vector<float> full_params_here(int block);  // this stage's block, over the data-parallel group
  // forward() and backward() of a pipelined run: refused (train_batch runs the schedule).
  void refuse_with_stages(const char* what) const;

  // Work in flight (a prefetch gather on the gather stream, a reduction, an
  // update behind the forward) refers to the members above: quiesce() waits
  // for it. The guard is the last member, so it is destroyed first, both in
  // ~Impl and when the constructor throws (members built so far are then
  // destroyed without ~Impl's body running: a GPU with no room for the
  // activations failed the start while stage 3's first gathers were still
  // uploading into the GpuOffload about to go).
  void quiesce() noexcept;
  struct QuiesceFirst {
    Impl* self;
    ~QuiesceFirst() { self->quiesce(); }
  } quiesce_first{this};
};

}  // namespace zinc
