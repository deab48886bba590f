#include "engine/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "core/cpu.h"
#include "core/alloc.h"
#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/device.h"
#include "engine/checkpoint.h"
#include "engine/engine_impl.h"
#include "engine/gpu_offload.h"
#include "engine/grad_reducer.h"
#include "engine/optimizer_state.h"
#include "engine/param_coordinator.h"
#include "engine/partition.h"
#include "engine/shard.h"
#include "offload/swapper.h"
#include "kernels/kernels.h"
#include "kernels/math.h"
#include "optim/loss_scaler.h"
#include "optim/optim.h"

// The step in docs/design.md's order: forward (blocks acquired through the
// ParamCoordinator: gathered, prefetched and freed at stage 3), backward
// (GradReducer: bucketed reduce-scatter on the reduction stream), step (norm,
// clip, AdamW over the owned shards through the OptimizerState, then the
// coordinator's parameter all-gather on the gather stream). What each stage
// keeps: Note [ZeRO stages] in engine/shard.h; the two streams:
// Communicator::twin in comm/comm.h.
//
namespace zinc {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The NVMe store's options: the aio section and a folder.
offload::NvmeOptions nvme_options(const Config& c, const std::string& path) {
  offload::NvmeOptions o;
  o.path = path;
  o.block_size = c.aio.block_size;
  o.queue_depth = static_cast<int>(c.aio.queue_depth);
  o.threads = static_cast<int>(c.aio.intra_op_parallelism);
  o.single_submit = c.aio.single_submit;
  o.overlap_events = c.aio.overlap_events;
  return o;
}

// Test hook: ZINC_NVME_FAULT=OPS:ERRNO makes every ring of every NVMe store
// (optimizer states and parameter shards) fail its I/O operation number
// OPS+1 with ERRNO (0: a short transfer), through the fault-injecting
// engine, so that failure paths can be exercised end to end. Null when unset.
using EngineFactory = std::function<std::unique_ptr<offload::IoEngine>(const offload::NvmeOptions&)>;
EngineFactory nvme_fault_factory() {
  const char* fault = std::getenv("ZINC_NVME_FAULT");
  if (!fault) return nullptr;
  long long ops = 0;
  int err = 0;
  if (std::sscanf(fault, "%lld:%d", &ops, &err) != 2)
    throw ConfigError("ZINC_NVME_FAULT", std::string("expected OPS:ERRNO, got \"") + fault + "\"");
  log_warn("NVMe fault injection: I/O operation " + std::to_string(ops + 1) + " of each ring fails (ZINC_NVME_FAULT)");
  return [ops, err](const offload::NvmeOptions& opt) {
    return offload::make_faulty_engine(offload::make_uring_engine(opt), ops, err);
  };
}

// The NVMe swapper's options from the config.
offload::SwapperOptions swapper_options(const Config& c) {
  offload::SwapperOptions o;
  const OffloadConfig& off = c.zero.offload_optimizer;
  o.nvme = nvme_options(c, off.nvme_path);
  o.buffer_count = off.buffer_count;
  o.pin_memory = off.pin_memory;
  o.sub_group_size = c.zero.sub_group_numel();
  o.gradients = c.gradients_on_nvme();
  o.engine_factory = nvme_fault_factory();
  return o;
}

optim::LossScaleParams loss_scale_params(const Fp16Config& f) {
  optim::LossScaleParams p;
  p.dynamic = f.loss_scale == 0;
  p.static_scale = f.loss_scale > 0 ? f.loss_scale : 1.0;
  p.initial_scale_power = static_cast<int>(f.initial_scale_power);
  p.window = f.loss_scale_window;
  p.hysteresis = f.hysteresis;
  p.consecutive_hysteresis = f.consecutive_hysteresis;
  p.min_scale = f.min_loss_scale;
  return p;
}

// Runs `make`, which sets up an NVMe store; an I/O error there (a folder
// that is missing or read-only, a disk too small for the preallocated files)
// comes from the config value that named the folder, so its message starts
// with that JSON path.
template <class F>
auto with_config_path(const char* json_path, F&& make) {
  try {
    return make();
  } catch (const IoError& e) {
    throw IoError(std::string(json_path) + ": " + e.what());
  }
}

}  // namespace

Engine::Impl::Impl(std::shared_ptr<Model> m, const Config& c, std::shared_ptr<comm::Communicator> cm)
    : cfg(c), model(std::move(m)), comm(std::move(cm)), dtype(c.compute_dtype()),
      schedule(c.scheduler, c.optimizer.lr()) {
  if (comm) {
    world = comm->size();
    rank = comm->rank();
  }
  world_all = world;
  world_rank = rank;
  static std::atomic<uint64_t> engines{0};
  param_generation = ++engines;
  if (world > 1) agree_on_config();
  if (c.model_parallel_size() > 1) setup_grid();  // comm, world and rank become the data-parallel group's
  if (c.expert_split()) setup_experts();          // ... or those that hold the same experts
  plan = StagePlan::make(c.zero.stage, world, c.zero.offload_param.device != OffloadDevice::kNone,
                         c.gradients_on_nvme());
  offload_device = c.zero.offload_optimizer.device;
  if (world > 1) {
    make_streams();
  } else if (plan.params_sharded || plan.grads_on_nvme) {
    // One rank with offloaded parameters: its reads and one-rank "gathers"
    // (copies) still run on a stream of their own, ahead of use; with the
    // gradients on NVMe their writes too (the reducer's stream).
    local_comm = comm::make_single_communicator();
    if (plan.params_sharded) {
      own_gather_stream = std::make_unique<comm::CommStream>(*local_comm);
      gather_stream = own_gather_stream.get();
    }
    if (plan.grads_on_nvme) reduce_stream = std::make_unique<comm::CommStream>(*local_comm);
  }
  const bool frozen = std::any_of(model->blocks().begin(), model->blocks().end(),
                                  [](const BlockSpec& b) { return b.frozen; });
  if (frozen && c.optimizer.one_bit())
    throw ConfigError("optimizer.type", "the 1-bit optimizers compress whole-model gradients and do not take "
                                        "frozen weights (LoRA) yet: use Adam, AdamW or Lamb");
  device = make_device_path(cfg, comm.get(), world, rank, dtype);
  rule = make_update_rule(c);
  lr = schedule.lr_at(0);
  loss_scaling = c.fp16.enabled;
  if (loss_scaling) scaler = optim::LossScaler(loss_scale_params(c.fp16));
  allocate_and_init();
  if (c.device != model->device())
    throw ConfigError("device", std::string("the config says \"") + device_name(c.device) + "\" but model '" +
                                    model->name() + "' computes on " + device_name(model->device()));
  device->attach(DeviceContext{&plan, &blocks, params.get(), reducer.get(), opt_state.get(), &memory});
  if (pipelined()) pipe_device_comm = device->device_communicator(*pipe_comm);  // collective over the stages
  if (pipe_device_comm && world_rank == 0)
    log_info("pipeline: the stages' activations go between the GPUs over " + pipe_device_comm->backend());
  if (tensor_split()) {
    tp_device_comm = device->device_communicator(*tp_comm);  // collective over the parts
    device->set_norm_ranges(part_norm_ranges());
  }
  if (tp_device_comm && world_rank == 0)
    log_info("tensor parallelism: the parts' partial sums are added on the GPUs over " + tp_device_comm->backend());
  if (cfg.sequence_split()) sp_device_comm = device->device_communicator(*sp_comm);  // all-to-all over the slices
  if (sp_device_comm && world_rank == 0)
    log_info("sequence parallelism: the attention's exchanges go between the GPUs over " + sp_device_comm->backend());
  UpdateContext uc;
  uc.cfg = &cfg;
  uc.plan = &plan;
  uc.blocks = &blocks;
  uc.opt_state = opt_state.get();
  uc.reduce_stream = reduce_stream.get();
  uc.world = world;
  uc.rank = rank;
  uc.dtype = dtype;
  uc.visit_updating = [this](const std::function<void(const StateSpan&)>& fn, bool overwrite) {
    visit_updating(fn, overwrite);
  };
  uc.compute_out = [this](const StateSpan& sp) { return compute_out(sp); };
  uc.grad = [this](const StateSpan& sp) { return update_grad(sp); };
  if (!c.optimizer.decay_vectors) {  // the Trainer's AdamW: no decay for biases and norm weights
    std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges(blocks.size());
    for (size_t b = 0; b < blocks.size(); ++b) {
      const BlockSpec& spec = specs()[b];
      std::vector<char> skip(spec.params.size(), 0);
      for (size_t p = 0; p < spec.params.size(); ++p) {
        skip[p] = spec.params[p].shape.ndim <= 1;
        const int64_t lo = blocks[b].layout.offsets[p];
        if (skip[p]) ranges[b].emplace_back(lo, lo + blocks[b].layout.numels[p]);
      }
      uc.no_decay.push_back(std::move(skip));
    }
    device->set_no_decay(std::move(ranges));
  }
  if (tensor_split())
    uc.sum_tensor_parts = [this](std::vector<double>& sums, const std::vector<int>& first_tensor) {
      sum_tensor_parts(sums, first_tensor);
    };
  rule->attach(uc);
}

Engine::Impl::~Impl() = default;  // quiesce_first waits for the work in flight

void Engine::Impl::quiesce() noexcept {
  // The device's shutdown waits for an update behind the forward (which may
  // start the next gathers), then the streams drain; then the device again,
  // for what those gathers queued on the GPU.
  if (device) device->shutdown();
  for (comm::CommStream* st : {reduce_stream.get(), own_gather_stream.get()}) {
    if (!st) continue;
    try {
      st->synchronize();
    } catch (const std::exception& e) {
      log_error(std::string("engine shutdown: a collective failed: ") + e.what());
    }
  }
  if (device) device->shutdown();
}

void Engine::Impl::make_streams() {
  reduce_stream = std::make_unique<comm::CommStream>(*comm);
  comm::Communicator* twin = comm->twin();  // collective the first time: every rank, here
  if (twin) {
    own_gather_stream = std::make_unique<comm::CommStream>(*twin);
    gather_stream = own_gather_stream.get();
  } else {
    if (world_rank == 0)
      log_warn("the " + comm->backend() +
               " transport cannot run two communicators at once (MPI without MPI_THREAD_MULTIPLE): "
               "parameter gathers share the gradient reductions' stream");
    gather_stream = reduce_stream.get();
  }
}

void Engine::Impl::allocate_and_init() {
  const std::vector<BlockSpec>& specs = this->specs();  // a tensor part's, or the model's
  if (specs.empty()) throw Error("model '" + model->name() + "' has no parameter blocks");
  blocks.resize(specs.size());
  std::vector<int64_t> spans;
  for (size_t b = 0; b < specs.size(); ++b) {
    BlockShard& s = blocks[b];
    s.layout = BlockLayout::from_spec(specs[b]);
    s.part = Partition::make(s.layout.numel, world, rank);
    s.absent = pipelined() && !pipe_plan.holds(static_cast<int>(b), stage);
    s.frozen = specs[b].frozen || s.absent;
    s.opt_numel = s.frozen ? 0 : plan.optimizer_numel(s.part);
    spans.push_back(s.opt_numel);
  }
  const offload::SwapperOptions nvme =
      offload_device == OffloadDevice::kNvme ? swapper_options(cfg) : offload::SwapperOptions{};
  opt_state = with_config_path("zero_optimization.offload_optimizer.nvme_path", [&] {
    return make_optimizer_state(offload_device, spans, cfg.zero.offload_optimizer.pin_memory, nvme, rank, memory);
  });
  // The coordinator before the weights: at stage 3 it takes each block's
  // initial shard as it is built (with offload_param "nvme" straight to
  // disk), so setup never holds every shard at once.
  const OffloadConfig& op = cfg.zero.offload_param;
  params = with_config_path("zero_optimization.offload_param.nvme_path", [&] {
    std::unique_ptr<offload::NvmeStore> param_store;
    if (plan.params_sharded && op.device == OffloadDevice::kNvme)
      param_store =
          std::make_unique<offload::NvmeStore>(nvme_options(cfg, op.nvme_path), rank, nvme_fault_factory());
    return std::make_unique<ParamCoordinator>(plan, blocks, dtype, gather_stream, memory, cfg.zero,
                                              std::move(param_store), op.pin_memory);
  });
  for (const BlockSpec& b : model->blocks()) {  // the whole model's, with tensor parts too
    for (const ParamSpec& ps : b.params) {
      num_params += ps.shape.numel();
      if (!b.frozen) num_trained += ps.shape.numel();
    }
  }
  for (size_t b = 0; b < specs.size(); ++b) {
    BlockShard& s = blocks[b];
    if (s.absent) continue;  // another stage's
    const size_t padded = static_cast<size_t>(s.part.padded_numel);
    // Every rank builds the initial weights of the elements its stage keeps
    // (at stage 3 its own shard, else the whole block), from the model's
    // initial_values (a pretrained checkpoint) or from the seed.
    AlignedBuffer full = make_buffer<float>(padded);
    float* w = full.as<float>();
    const int64_t keep_lo = plan.params_sharded ? s.part.own_offset() : 0;
    const int64_t keep_hi = plan.params_sharded ? keep_lo + s.part.shard_numel : s.layout.numel;
    for (size_t p = 0; p < specs[b].params.size(); ++p) {
      const ParamSpec& ps = specs[b].params[p];
      float* dst = w + s.layout.offsets[p];
      int64_t cnt = s.layout.numels[p];
      const int64_t lo = std::max<int64_t>(0, keep_lo - s.layout.offsets[p]);
      const int64_t hi = std::min<int64_t>(cnt, keep_hi - s.layout.offsets[p]);
      // A tensor part of a split parameter: the whole parameter's values,
      // of which the part keeps its own (Note [tensor parallelism]).
      const bool part = split_of(b, p, tp_rank).kind != TensorSplit::kWhole;
      std::vector<float> whole;
      if (part) {
        cnt = model->blocks()[b].params[p].shape.numel();
        whole.resize(static_cast<size_t>(cnt));
      }
      float* vals = part ? whole.data() : dst;
      if (part) {
        if (model->initial_values(static_cast<int>(b), static_cast<int>(p), 0, cnt, vals)) {
          cut_part(static_cast<int>(b), static_cast<int>(p), vals, dst);
          continue;
        }
      } else if (hi > lo && model->initial_values(static_cast<int>(b), static_cast<int>(p), lo, hi - lo, dst + lo)) {
        continue;
      }
      // Each parameter has its own stream, so adding a parameter or a block
      // does not change the initial values of the others.
      Rng rng(mix_seed(cfg.seed, (static_cast<uint64_t>(b) << 20) + p));
      for (int64_t i = 0; i < cnt; ++i) {
        switch (ps.init) {
          case Init::kZeros: vals[i] = 0.0f; break;
          case Init::kOnes: vals[i] = 1.0f; break;
          case Init::kNormal: vals[i] = static_cast<float>(rng.normal() * ps.init_std); break;
          case Init::kUniform: vals[i] = static_cast<float>((2.0 * rng.uniform() - 1.0) * ps.init_std); break;
        }
      }
      if (part) cut_part(static_cast<int>(b), static_cast<int>(p), vals, dst);
    }
    if (!s.frozen) opt_state->init_block(static_cast<int>(b), w + (plan.optimizer_spans_block ? 0 : s.part.own_offset()));
    if (plan.params_sharded) {
      // Stage 3: only the own shard (the coordinator gathers the rest).
      params->set_initial_shard(static_cast<int>(b), w + s.part.own_offset());
    } else if (is_16bit(dtype)) {
      s.compute = memory.alloc(padded * 2);
      convert_f32_to_16(w, s.compute.data(), padded, dtype);
    } else if (plan.compute_copy(dtype) || s.frozen) {  // a frozen block has no master to compute from
      s.compute = memory.alloc(padded * 4);
      std::memcpy(s.compute.data(), w, padded * 4);
    } else {
      s.master_compute = opt_state->master_in_memory(static_cast<int>(b));
    }
  }
  opt_state->finish_init();
  params->start();
  GradReducer::Options ro;
  ro.bucket_numel = cfg.zero.reduce_bucket_numel();
  ro.overlap = cfg.zero.overlap_comm;
  ro.wire = cfg.wire_dtype();
  if (plan.grads_on_nvme) {
    OptimizerState* st = opt_state.get();
    ro.spill = [st](int block, const float* shard) { st->write_gradients(block, shard); };
  }
  device->configure_reducer(ro);
  comm::CommStream* rs = device->reduce_stream();
  reducer = std::make_unique<GradReducer>(plan, blocks, rs ? rs : reduce_stream.get(), memory, ro);
  memory.release_kept();
}

BlockParams Engine::Impl::acquire_params(int block) {
  if (state(block).absent)  // a block number outside the model is the model's error
    throw Error("model '" + model->name() + "' asked for block " + std::to_string(block) + " '" +
                model->blocks()[static_cast<size_t>(block)].name + "', which pipeline stage " + std::to_string(stage) +
                " does not hold");
  BlockParams p = params->acquire(block);
  device->on_acquire(block, p);
  // A frozen block outside stage 3 keeps its one gathered copy for the
  // engine's life (gather_after_step skips it; nothing else writes it).
  if (state(block).frozen && !plan.params_sharded && cfg.device == Device::kCpu) p.generation = param_generation;
  return p;
}

void Engine::Impl::release_params(int block) noexcept {
  params->release(block);
  device->on_release();
}

BlockGrads Engine::Impl::grads(int block) {
  BlockShard& s = state(block);
  if (s.frozen)
    throw Error("model '" + model->name() + "' asked for the gradients of block " + std::to_string(block) + " '" +
                model->blocks()[static_cast<size_t>(block)].name + "', which is frozen");
  float* g = device->grads(block);  // the GPU's buffers are zeroed whole
  if (g) return BlockGrads{g, &s.layout};
  float* host = reducer->grads(block);
  return BlockGrads{host, &s.layout, reducer->take_fresh(block)};
}

void Engine::Impl::grads_ready(int block) {
  BlockShard& s = state(block);
  if (s.frozen)
    throw Error("model '" + model->name() + "' reported gradients of block " + std::to_string(block) + " '" +
                model->blocks()[static_cast<size_t>(block)].name + "', which is frozen");
  if (s.grads_reported)
    throw Error("model '" + model->name() + "' reported gradients of block " + std::to_string(block) +
                " twice in one backward");
  s.grads_reported = true;
  if (!device->grads_ready(block, boundary_backward)) reducer->ready(block);
}

void Engine::Impl::check_released(const char* phase) const {
  const int b = params->first_held();
  if (b >= 0)
    throw Error("model '" + model->name() + "' still holds the parameters of block " + std::to_string(b) +
                " after " + phase + " (release its HeldParams before returning)");
}

BlockShard& Engine::Impl::state(int block) {
  if (block < 0 || block >= static_cast<int>(blocks.size()))
    throw Error("model '" + model->name() + "' asked for block " + std::to_string(block) + " of " +
                std::to_string(blocks.size()));
  return blocks[block];
}

int64_t Engine::Impl::check_batch(const Batch& batch) const {
  if (batch.B <= 0 || batch.T <= 0 ||
      batch.inputs.size() != static_cast<size_t>(batch.B * batch.T) ||
      batch.targets.size() != batch.inputs.size())
    throw Error("batch: expected B*T inputs and targets, got B=" + std::to_string(batch.B) +
                " T=" + std::to_string(batch.T) + " with " + std::to_string(batch.inputs.size()) +
                " inputs and " + std::to_string(batch.targets.size()) + " targets");
  if (!batch.positions.empty()) {
    if (batch.positions.size() != batch.inputs.size())
      throw Error("batch.positions: expected none or B*T = " + std::to_string(batch.B * batch.T) + ", got " +
                  std::to_string(batch.positions.size()));
    for (int64_t b = 0; b < batch.B; ++b)
      for (int64_t t = 0; t < batch.T; ++t) {
        const int32_t p = batch.positions[static_cast<size_t>(b * batch.T + t)];
        const int32_t prev = t > 0 ? batch.positions[static_cast<size_t>(b * batch.T + t - 1)] : -1;
        if (p != 0 && p != prev + 1)
          throw Error("batch.positions: row " + std::to_string(b) + ", token " + std::to_string(t) + " has position " +
                      std::to_string(p) + "; each row starts at 0 and each next position is 0 (a new document) or " +
                      "the previous + 1");
      }
  }
  return count_targets(batch);
}

int64_t Engine::Impl::count_targets(const Batch& batch) {
  int64_t n = 0;
  for (int32_t t : batch.targets) n += t != kIgnoreTarget;
  return n;
}

void Engine::Impl::check_stepped(const char* what) const {
  if (step_pending)
    throw Error(std::string("Engine::") + what + "(): the global batch ending at micro-step " +
                std::to_string(micro_steps) + " has not been stepped; call step() after every backward() "
                "(it updates the weights at accumulation boundaries and does nothing elsewhere)");
}

float Engine::Impl::forward(const Batch& whole) {
  check_loaded("forward");
  check_stepped("forward");
  device->make_current();
  if (!sequence_ranks()) check_batch(whole);  // sequence_slice checks it with the replica's other ranks
  auto t0 = Clock::now();
  Batch slice;  // a sequence rank's part of the rows
  if (sequence_ranks()) slice = sequence_slice(whole);
  const Batch& batch = sequence_ranks() ? slice : whole;
  const int64_t targets = count_targets(batch);
  params->begin_pass(ParamCoordinator::Pass::kTrain);
  pass_dropout_seed = kernels::math::dropout_subkey(
      kernels::math::dropout_subkey(cfg.seed, static_cast<uint64_t>(micro_steps)), static_cast<uint64_t>(data_rank()));
  float loss = model->forward(*this, batch);
  check_released("forward");
  forward_pending = true;
  pending = {loss, targets, batch.B * batch.T};
  // A micro-batch without targets has no loss (NaN; the model's mean over
  // none is 0, which would read as a perfect one), as in evaluate().
  if (sequence_ranks())
    loss = sequence_loss(loss, targets);  // over the whole rows: NaN when none of them holds a target
  else if (targets == 0)
    loss = std::numeric_limits<float>::quiet_NaN();
  timings.forward_s += seconds_since(t0);
  return loss;
}

void Engine::Impl::backward() {
  if (!forward_pending) throw Error("backward() without a forward() before it: call forward(batch) first (a backward runs the last "
                "forward's loss)");
  check_stepped("backward");
  device->make_current();
  settle_update();  // its gradient copies land where the last update read
  auto t0 = Clock::now();
  boundary_backward = (micro_steps + 1) % cfg.gradient_accumulation_steps == 0;
  // OneBitAdam past its warm-up: the boundary keeps its gradients local.
  run_backward(boundary_backward && !rule->local_gradients(optimizer_steps + 1));
  forward_pending = false;
  batch_loss.add(pending.loss, pending.targets, pending.positions);
  micro_steps += 1;
  step_pending = boundary_backward;
  timings.backward_s += seconds_since(t0);
}

void Engine::Impl::run_backward(bool reduce) {
  reducer->begin_backward(reduce);
  model->backward(*this, static_cast<float>(loss_scale()));
  check_released("backward");
  device->end_backward();
  params->end_pass();
  device->on_release();
  for (size_t b = 0; b < blocks.size(); ++b)
    if (!blocks[b].frozen && !blocks[b].grads_reported)
      throw Error("model '" + model->name() + "' did not call grads_ready for block " + std::to_string(b) +
                  " during backward" + (pipelined() ? " (pipeline stage " + std::to_string(stage) + ")" : ""));
  reducer->end_backward();
}

std::string Engine::Impl::num_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

bool Engine::Impl::at_boundary() const {
  return micro_steps > 0 && micro_steps % cfg.gradient_accumulation_steps == 0;
}

namespace {
// Note [the loss normaliser]
// Gradients are sums over ranks and micro-batches of each micro-batch's
// gradient of (sum of its targets' losses) / (B*T), times the loss scale
// with fp16. Every position a target: that is the mean loss of each, and
// the global mean is 1/(world * gas) of the sum. Some targets masked: the
// loss is the mean over the global batch's targets, as the HF Trainer
// computes it (num_items_in_batch over all ranks and micro-batches), so
// the sum is scaled by (B*T) / targets; that needs one B*T for all the
// global batch's micro-batches (sum of squares times count equals the
// square of the sum only then). Every rank decides from the same sums.
// `all`: the ranks' BatchLoss summed.
Normalised normalise(const BatchLoss& all, int64_t gas, int world, double loss_scale) {
  const bool masked = all.targets != all.positions;
  if (masked && all.positions_sq * static_cast<double>(all.count) != all.positions * all.positions)
    throw Error("step: the micro-batches of this global batch differ in B*T while some targets are masked; the mean "
                "over the targets needs one micro-batch shape per global batch");
  Normalised n;
  n.no_targets = masked && all.targets == 0;
  if (!masked) {
    n.grad_scale = 1.0 / static_cast<double>(gas) * (1.0 / static_cast<double>(world)) / loss_scale;
    n.loss = all.loss_sum / static_cast<double>(all.count);
  } else if (n.no_targets) {
    n.loss = std::numeric_limits<double>::quiet_NaN();  // no loss, and 0 would read as a perfect one
  } else {
    n.grad_scale = (all.positions / static_cast<double>(all.count)) / (all.targets * loss_scale);
    n.loss = all.target_loss / all.targets;
  }
  return n;
}
}  // namespace

void Engine::Impl::step() {
  if (!at_boundary() || batch_loss.count == 0) return;
  step_pending = false;
  device->make_current();
  settle_update();
  auto t0 = Clock::now();
  reducer->wait_all();  // every reduction of this step
  // A rule that keeps the gradients local (the 1-bit optimizers past their
  // warm-up, Note [1-bit Adam] in update_onebit.cpp): each rank's gradient
  // stands for the average, so it is scaled by the world size, and the norm
  // is the root mean square over ranks.
  const bool local_grads = rule->local_gradients(optimizer_steps + 1);
  const double local = local_grads ? static_cast<double>(world) : 1.0;
  // Own-shard squares and the batch's losses and counts, summed over ranks
  // in one collective.
  reduce_tied_gradients();
  sum_part_gradients();
  double sums[7];
  reduce_step_sums(sums, local_grads);
  const BatchLoss all{sums[1], static_cast<int64_t>(sums[5]), sums[2], sums[3], sums[4], sums[6]};
  const double used_scale = loss_scale();
  // Every rank refuses alike (the sums are the global batch's): the batch
  // is dropped, so that the engine can go on with the next one.
  auto drop_batch = [this] {
    reducer->reset_after_step();
    device->after_step();
    batch_loss = BatchLoss{};
  };
  Normalised n;
  try {
    n = normalise(all, cfg.gradient_accumulation_steps, data_world(), used_scale);
  } catch (const Error& e) {
    drop_batch();
    throw Error(std::string(e.what()) + "; this global batch is dropped (no update), and the next one can train");
  }
  // Without fp16's loss scaling a loss that is not finite has no overflow of
  // the scaled gradients to explain it: the tokens are finite, so the
  // weights, or the activations they produce, have overflowed since an
  // earlier update (a learning rate too high). Skipping on would skip every
  // step after, and save those weights over the run's good checkpoints:
  // refused instead, the batch dropped as above.
  if (!loss_scaling && !n.no_targets && !std::isfinite(n.loss)) {
    drop_batch();
    throw Error("step " + std::to_string(global_steps + 1) + ": the loss is " + (std::isnan(n.loss) ? "nan" : "inf") +
                " (" + (cfg.bf16 ? "bf16" : "fp32") +
                ", no loss scaling): the weights, or the activations they produce, have overflowed since an earlier "
                "update, and no later step can recover; this global batch is dropped (no update). Go back to a "
                "checkpoint saved before the loss grew, with a lower learning rate or gradient_clipping");
  }
  grad_norm = std::sqrt(sums[0] / local) * n.grad_scale * local;
  global_steps += 1;
  const bool overflow = !std::isfinite(grad_norm);
  if (n.no_targets || overflow) {
    skipped_steps += 1;
    overflow_steps += !n.no_targets && loss_scaling;
    const std::string why = n.no_targets  ? "every target of the global batch is masked"
                            : loss_scaling ? "fp16 gradients overflowed at loss scale " + num_text(used_scale)
                                           : "gradient norm is not finite";
    const std::string line = "step " + std::to_string(global_steps) + ": " + why + "; the update is skipped";
    if (world_rank == 0) (!n.no_targets && loss_scaling) ? log_info(line) : log_warn(line);  // fp16's overflows are routine
  } else {
    const float grad_scale =
        static_cast<float>(n.grad_scale * local * optim::clip_coefficient(grad_norm, cfg.gradient_clipping));
    lr = schedule.lr_at(optimizer_steps);
    set_hyperparameters(optimizer_steps);
    optimizer_steps += 1;
    if (!rule->apply_on_device(*device, optimizer_steps, grad_scale)) {  // else the device's states are updated
      device->before_host_update();
      params->before_update();
      // Note [the gather streamed behind the update] in param_coordinator.cpp.
      if (rule->may_run_behind()) params->stream_next_gather(device->gathered_hook());
      auto host_update = [this, t = optimizer_steps, grad_scale] {
        rule->apply(t, grad_scale);
        device->after_host_update();
        params->gather_after_step();
        device->after_gather();
      };
      // Note [the update behind the forward] in gpu_offload.cpp: with model
      // parallelism the next forward's collectives and transfers would
      // meet an update in flight, so only data parallelism.
      const bool data_parallel_only = !pipelined() && !tensor_split() && !sequence_ranks() && !expert_parts;
      if (data_parallel_only && rule->may_run_behind() && device->start_update_behind(host_update)) {
        update_behind = true;
        behind_step = optimizer_steps;
      } else {
        host_update();
      }
    }
    if (!update_behind) rule->after_update(optimizer_steps);
  }
  if (!update_behind) {
    reducer->reset_after_step();
    device->after_step();
  }
  if (loss_scaling && !n.no_targets) scaler.update(overflow);
  last_loss = n.loss;
  batch_loss = BatchLoss{};
  timings.step_s += seconds_since(t0);
}

void Engine::Impl::settle_update() {
  if (!update_behind) return;
  update_behind = false;
  std::exception_ptr failed;
  try {
    device->finish_update_behind();
  } catch (...) {
    failed = std::current_exception();
  }
  if (!failed) rule->after_update(behind_step);
  reducer->reset_after_step();
  device->after_step();
  if (failed) std::rethrow_exception(failed);
}

char* Engine::Impl::compute_out(const StateSpan& sp) {
  BlockShard& s = blocks[static_cast<size_t>(sp.block)];
  if (plan.params_sharded)
    return params->shard_to_update(sp.block) + static_cast<size_t>(sp.offset) * dtype_bytes(dtype);
  if (s.compute.empty()) return nullptr;
  const int64_t at = (plan.optimizer_spans_block ? 0 : s.part.own_offset()) + sp.offset;
  return s.compute.as<char>() + static_cast<size_t>(at) * dtype_bytes(dtype);
}

void Engine::Impl::set_hyperparameters(int64_t s) {
  if (!schedule.sets_betas()) return rule->set_hyperparameters(lr, std::nullopt);
  const optim::ScheduleBetas b = schedule.betas_at(s);
  if (!(b.beta1 >= 0 && b.beta1 < 1))
    throw ConfigError("scheduler.params.decay_mom_rate",
                      "OneCycle's momentum reached " + std::to_string(b.beta1) + " at optimizer step " +
                          std::to_string(s) + "; beta1 must stay below 1 (lower decay_mom_rate)");
  rule->set_hyperparameters(lr, std::make_pair(b.beta1, b.beta2));
}

const float* Engine::Impl::update_grad(const StateSpan& sp) {
  if (plan.grads_on_nvme) {
    ZINC_CHECK(sp.grad != nullptr, "the optimizer state read no gradient for a span");
    return sp.grad;
  }
  BlockShard& s = blocks[static_cast<size_t>(sp.block)];
  return (plan.optimizer_spans_block ? s.grad.as<float>() : reducer->reduced_shard(s)) + sp.offset;
}

void Engine::Impl::visit_updating(const std::function<void(const StateSpan&)>& fn, bool overwrite) {
  int last = -1;
  auto finish = [&](int b) {
    params->finish_update(b);
    device->block_updated(b);
  };
  auto visit = [&](const StateSpan& sp) {
    // The device updates its share of the states (Note [a share of the
    // states on the GPU] in gpu_offload.cpp); a load sets every block's.
    if (!overwrite && device->block_on_device(sp.block)) return;
    if (sp.block != last && last >= 0) finish(last);
    last = sp.block;
    fn(sp);
  };
  if (overwrite) opt_state->for_each_overwrite(visit);
  else opt_state->for_each(visit);
  if (last >= 0) finish(last);
}

std::vector<float> Engine::Impl::full_params(int block) {
  check_loaded("full_params");
  BlockShard& s = state(block);
  // A tensor part's block: the parts gathered into the whole model's layout.
  auto here = [&] { return tensor_split() ? whole_from_parts(block, full_params_here(block)) : full_params_here(block); };
  if (pipelined()) {
    // The stage that holds the block gathers it over its group, then sends
    // it to the other stages of each replica.
    const int owner = pipe_plan.block_stage[static_cast<size_t>(block)];
    std::vector<float> out;
    if (owner == stage) {
      out = here();
    } else {
      out.resize(static_cast<size_t>(
          tensor_split() ? BlockLayout::from_spec(model->blocks()[static_cast<size_t>(block)]).numel : s.part.padded_numel));
    }
    pipe_comm->broadcast(out.data(), static_cast<int64_t>(out.size()), DType::kF32, owner);
    return out;
  }
  return here();
}

std::vector<float> Engine::Impl::full_params_here(int block) {
  BlockShard& s = state(block);
  if (s.frozen) {
    // No master copy: the compute parameters, gathered as a pass would
    // (every rank takes part at stage 3), read back from the device where
    // the pass would compute on them there.
    params->begin_pass(ParamCoordinator::Pass::kEval);
    std::vector<float> out(static_cast<size_t>(s.part.padded_numel));
    BlockParams p;
    try {
      p = acquire_params(block);
    } catch (...) {
      params->end_pass();
      throw;
    }
    try {
      const size_t bytes = out.size() * dtype_bytes(dtype);
      std::vector<char> staged(cfg.device == Device::kCuda ? bytes : 0);  // the device's copy, read back
      const void* base = device->params_to_host(p, staged.data(), bytes) ? staged.data() : p.base;
      if (is_16bit(dtype))
        convert_16_to_f32(base, out.data(), out.size(), dtype);
      else
        std::memcpy(out.data(), base, out.size() * 4);
    } catch (...) {
      release_params(block);
      params->end_pass();
      throw;
    }
    release_params(block);
    params->end_pass();
    return out;
  }
  device->make_current();
  device->master_to_host(block);
  std::vector<float> own(static_cast<size_t>(s.opt_numel));
  opt_state->read_master(block, own.data());
  if (plan.optimizer_spans_block || world == 1) return own;
  std::vector<float> out(static_cast<size_t>(s.part.padded_numel));
  gather_stream->submit([&](comm::Communicator& c) {
    c.all_gather(own.data(), out.data(), s.part.shard_numel, DType::kF32);
  }).wait();
  return out;
}


Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;
Engine::~Engine() = default;

Engine Engine::initialize(std::shared_ptr<Model> model, const Config& config,
                          std::shared_ptr<comm::Communicator> comm) {
  if (!model) throw Error("Engine::initialize: model is null");
  config.validate();
  cpu_isa();  // a bad ONEDNN_MAX_CPU_ISA is an error here, not inside a kernel
  const int world = comm ? comm->size() : 1;
  if (comm && comm->backend() == "nccl")
    throw ConfigError("comm.backend",
                      "the engine reduces gradients and gathers parameters in host memory, which NCCL cannot "
                      "address: use \"mpi\", \"shm\", \"hierarchical\" or \"auto\" (with \"device\": \"cuda\" "
                      "too: the engine then reduces the gradients on the GPU over NCCL beside it)");
  if (config.world_size != world)
    throw ConfigError("", "the config was parsed for world size " + std::to_string(config.world_size) +
                              " but the communicator has " + std::to_string(world) + " ranks");
  return Engine(std::make_unique<Impl>(std::move(model), config, std::move(comm)));
}

Engine Engine::initialize(std::shared_ptr<Model> model, const nlohmann::json& config,
                          std::shared_ptr<comm::Communicator> comm) {
  const int world = comm ? comm->size() : 1;
  return initialize(std::move(model), Config::parse(config, world), std::move(comm));
}

float Engine::forward(const Batch& batch) {
  impl_->refuse_with_stages("forward");
  return impl_->forward(batch);
}
void Engine::save_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& client_state) {
  impl_->settle_update();
  impl_->save_checkpoint(dir, tag, client_state);
}
nlohmann::json Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  impl_->settle_update();
  return impl_->load_checkpoint(dir, tag);
}
void Engine::backward() {
  impl_->refuse_with_stages("backward");
  impl_->backward();
}
void Engine::step() { impl_->step(); }

float Engine::train_batch(DataLoader& loader) {
  if (loader.micro_batch() != impl_->cfg.train_micro_batch_size_per_gpu)
    throw Error("train_batch: the loader's micro-batch (" + std::to_string(loader.micro_batch()) +
                ") differs from train_micro_batch_size_per_gpu (" +
                std::to_string(impl_->cfg.train_micro_batch_size_per_gpu) + ")");
  check_batch_start();
  if (impl_->pipelined()) return impl_->train_pipeline(loader);
  for (int64_t i = 0; i < impl_->cfg.gradient_accumulation_steps; ++i) {
    Batch b = loader.next();
    forward(b);
    backward();
    step();
  }
  return static_cast<float>(impl_->last_loss);
}

float Engine::train_batch(const std::vector<Batch>& micro_batches) {
  check_batch_start();
  impl_->refuse_with_stages("train_batch of the caller's micro-batches");
  if (static_cast<int64_t>(micro_batches.size()) != impl_->cfg.gradient_accumulation_steps)
    throw Error("train_batch: a global batch is gradient_accumulation_steps = " +
                std::to_string(impl_->cfg.gradient_accumulation_steps) + " micro-batches, got " +
                std::to_string(micro_batches.size()));
  for (const Batch& b : micro_batches) {
    forward(b);
    backward();
    step();
  }
  return static_cast<float>(impl_->last_loss);
}

// One whole global batch: started inside one (after forward/backward calls
// of the caller's own), its micro-batches would straddle two. (A forward
// whose backward never ran is replaced, as by any forward.)
void Engine::check_batch_start() const {
  if (impl_->micro_steps % impl_->cfg.gradient_accumulation_steps != 0 || impl_->batch_loss.count != 0)
    throw Error("train_batch() inside a global batch (after micro-step " + std::to_string(impl_->micro_steps) +
                " of " + std::to_string(impl_->cfg.gradient_accumulation_steps) +
                " per batch): finish it with forward(), backward() and step() first; train_batch trains one whole "
                "global batch");
}

float Engine::evaluate(const Batch& batch) {
  // The model keeps one pass's activations: an evaluation there would
  // replace those the pending backward reads (its gradient was then the
  // evaluation batch's, without a word).
  if (impl_->forward_pending)
    throw Error("evaluate() between forward() and backward(): the evaluation would replace the activations "
                "the backward reads; call backward() first (a step() does not end a forward that has no backward)");
  if (impl_->pipelined()) return impl_->evaluate_pipeline(batch);
  impl_->check_loaded("evaluate");
  impl_->device->make_current();
  impl_->settle_update();
  Batch slice;  // a sequence rank's part of the rows (sequence_slice checks the batch)
  if (impl_->sequence_ranks()) slice = impl_->sequence_slice(batch);
  const int64_t targets = impl_->sequence_ranks() ? Impl::count_targets(batch) : impl_->check_batch(batch);
  impl_->device->make_current();
  impl_->params->begin_pass(ParamCoordinator::Pass::kEval);
  impl_->pass_dropout_seed = 0;  // nothing dropped in an evaluation
  float loss = impl_->model->forward(*impl_, impl_->sequence_ranks() ? slice : batch);
  if (impl_->sequence_ranks()) loss = impl_->sequence_loss(loss, impl_->count_targets(slice));
  impl_->check_released("evaluate");
  impl_->params->end_pass();
  impl_->device->on_release();
  // A batch without targets has no loss (the model's mean over none is 0,
  // which would read as a perfect one).
  return targets > 0 ? loss : std::numeric_limits<float>::quiet_NaN();
}

bool Engine::is_gradient_accumulation_boundary() const { return impl_->at_boundary(); }
double Engine::global_grad_norm() const { return impl_->grad_norm; }
double Engine::learning_rate() const { return impl_->lr; }
double Engine::loss_scale() const { return impl_->loss_scale(); }
int64_t Engine::global_steps() const { return impl_->global_steps; }
int64_t Engine::skipped_steps() const { return impl_->skipped_steps; }
int64_t Engine::overflow_steps() const { return impl_->overflow_steps; }
int64_t Engine::micro_steps() const { return impl_->micro_steps; }
double Engine::last_batch_loss() const { return impl_->last_loss; }
int Engine::rank() const { return impl_->world_rank; }
int Engine::world_size() const { return impl_->world_all; }
int Engine::data_parallel_rank() const { return impl_->data_rank() / impl_->sp_size; }
int Engine::data_parallel_size() const { return impl_->data_world() / impl_->sp_size; }
int Engine::expert_parallel_rank() const { return impl_->expert_parts ? impl_->tp_rank : 0; }
int Engine::expert_parallel_size() const { return impl_->expert_parts ? impl_->tp_size : 1; }
double Engine::expert_wait_seconds() const { return impl_->ep_wait_s; }
int Engine::sequence_parallel_rank() const { return impl_->sp_rank; }
int Engine::sequence_parallel_size() const { return impl_->sp_size; }
double Engine::sequence_wait_seconds() const { return impl_->sp_wait_s; }
int Engine::pipeline_stage() const { return impl_->stage; }
int64_t Engine::pipeline_recomputed_forwards() const { return impl_->pipe_recomputed; }
double Engine::pipeline_wait_seconds() const { return impl_->pipe_wait_s; }
double Engine::tensor_wait_seconds() const { return impl_->tp_wait_s; }
int Engine::tensor_parallel_rank() const { return impl_->expert_parts ? 0 : impl_->tp_rank; }
int Engine::tensor_parallel_size() const { return impl_->expert_parts ? 1 : impl_->tp_size; }
double Engine::comm_wait_seconds() const {
  double s = 0;
  for (const comm::CommStream* st :
       {impl_->reduce_stream.get(), impl_->own_gather_stream.get(), impl_->device->reduce_stream()})
    if (st) s += st->wait_seconds();
  return s;
}
double Engine::comm_busy_seconds() const {
  double s = 0;
  for (const comm::CommStream* st :
       {impl_->reduce_stream.get(), impl_->own_gather_stream.get(), impl_->device->reduce_stream()})
    if (st) s += st->busy_seconds();
  return s;
}
const Config& Engine::config() const { return impl_->cfg; }
Model& Engine::model() { return *impl_->model; }
DType Engine::compute_dtype() const { return impl_->dtype; }
int64_t Engine::num_parameters() const { return impl_->num_params; }
int64_t Engine::num_trained_parameters() const { return impl_->num_trained; }
StepTimings Engine::timings() const {
  StepTimings t = impl_->timings;
  impl_->device->update_behind_seconds(t.update_behind_s, t.update_wait_s);
  return t;
}
ParamGatherStats Engine::param_gather_stats() const { return impl_->params->stats(); }
std::vector<float> Engine::full_params(int block) const {
  impl_->device->make_current();
  impl_->settle_update();
  return impl_->full_params(block);
}

int64_t Engine::offload_bytes_read() const {
  impl_->settle_update();  // an update in flight reads and writes the states
  return impl_->opt_state->bytes_read() + impl_->params->nvme_bytes_read();
}
int64_t Engine::offload_bytes_written() const {
  impl_->settle_update();
  return impl_->opt_state->bytes_written() + impl_->params->nvme_bytes_written();
}

int64_t Engine::model_state_bytes() const { return impl_->memory.bytes(); }
int64_t Engine::model_state_peak_bytes() const { return impl_->memory.peak_bytes(); }
int64_t Engine::gpu_state_bytes() const { return impl_->device->bytes(); }
int64_t Engine::gpu_state_peak_bytes() const { return impl_->device->peak_bytes(); }

}  // namespace zinc
