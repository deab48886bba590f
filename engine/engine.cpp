#include "engine/engine.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <set>

#include "core/cpu.h"
#include "core/alloc.h"
#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/device.h"
#include "engine/checkpoint.h"
#include "engine/device_mirror.h"
#include "engine/grad_reducer.h"
#include "engine/lamb_step.h"
#include "engine/optimizer_state.h"
#include "engine/param_coordinator.h"
#include "engine/partition.h"
#include "engine/shard.h"
#include "offload/swapper.h"
#include "kernels/kernels.h"
#include "optim/loss_scaler.h"
#include "optim/optim.h"

// The step in DESIGN.md's order: forward (blocks acquired through the
// ParamCoordinator: gathered, prefetched and freed at stage 3), backward
// (GradReducer: bucketed reduce-scatter on the reduction stream), step (norm,
// clip, AdamW over the owned shards through the OptimizerState, then the
// coordinator's parameter all-gather on the gather stream). What each stage
// keeps: Note [ZeRO stages] in engine/shard.h; the two streams:
// Communicator::twin in comm/comm.h.
//
// Note [the GPU path]
// With "device": "cuda" the model computes on the GPU and the engine runs
// ZeRO-Offload: everything the CPU path keeps stays where it is (fp32 master
// weights and Adam states in host RAM, pinned RAM or on NVMe; the host compute
// copy; the host gradient buffers the GradReducer reduces over the
// communicator), and a DeviceMirror (device_mirror.h) adds the GPU's copy of
// every block's compute parameters and a GPU gradient accumulator. So the
// optimizer step, clipping, loss scaling, the reductions and checkpoints are
// the CPU path's code, unchanged. Per step:
// - acquire(block) waits for the host copy as on the CPU (at stages 1-2 for
//   the all-gather after the last step), uploads it if the last step changed
//   it, and hands the model the GPU copy;
// - backward accumulates into the GPU buffers; at an accumulation boundary
//   grads_ready(block) starts the block's copy to pinned host memory on a copy
//   stream while backward goes on with earlier blocks, and blocks whose
//   copies have finished join the GradReducer's buckets in the order the
//   model reported them (the same on every rank);
// - step() is the CPU path's. At stage 0 or on one rank each block goes
//   up on the copy stream as soon as its update is done, from the
//   page-locked host compute copy, while the CPU updates the next block
//   (upload_after_update); at stages 1-2 on several ranks every block goes
//   up on the copy stream once the all-gather has brought it
//   (upload_after_gather); at stage 3 the next acquire uploads it.
// With offload_optimizer "none" the states live on the GPU instead
// (DeviceMirror::enable_states; the rank's shard on several ranks):
// gradients stay there (on several ranks reduce-scattered into the shard),
// the norm is kernels::cuda::squared_norm's (summed over ranks on the host),
// optim::adam_step_cuda updates master, m, v and writes the compute
// parameters in place (on several ranks the rank's shard, then
// gather_params all-gathers the shards on the GPU), and the host
// OptimizerState is only refreshed for checkpoints and full_params. Its arithmetic is the
// CPU AdamW's (optim/detail/adam_update.h), so without clipping the two
// modes give the same weights.
// On several ranks the gradients are reduced on the GPU: at a boundary
// grads_ready(block) marks the point on the compute stream
// (start_device_reduce, with the 16-bit wire copy made there), and the
// GradReducer's buckets, in the same order on every rank, call
// DeviceMirror::device_reduce on a stream of their own over a second
// communicator that reaches GPU memory (NCCL): a reduce-scatter on the
// GPU, then only the rank's shard comes back to the host shard buffer the
// CPU update reads. Every other
// collective (norm, parameter all-gather, checkpoints) stays on the host
// communicator.
// At stage 0 with GPU-resident states on several ranks the reduced shards
// are all-gathered back into the full accumulator on the GPU (as the CPU's
// stage 0 does on the host), and every rank updates every block.
// Stage 3 keeps the coordinator's state machine, trace, prefetch and
// limits. On one rank (the parameters offloaded) and with the shards on
// NVMe, its gathers are the host's: acquire uploads the gathered block
// (through page-locked staging on an upload stream of its own) and the GPU
// copy goes when the coordinator frees the host one
// (drop_freed_gpu_params). On several ranks with the shards in RAM each
// rank's compute shard also lives on the GPU (uploaded after every update
// and load) and the coordinator's gathers are all-gathers on the GPU, on
// the reductions' stream (start_device_gathers,
// ParamCoordinator::DeviceGather); a block's GPU copy comes and goes with
// the gather. Either way the stage3_* limits bound the GPU's parameters. From stage 2 the GPU accumulators exist only
// from a global batch's first backward to its reduction or copy
// (MirrorOptions), as the host's full gradients at stage 2. GPU-resident
// states at stage 3 keep the rank's shard of master, m, v (and the reduced
// gradient shard) on the GPU; the update writes the new compute shard to
// the GPU shard (with device gathers) and sends it down to the
// coordinator's host shard, and the blocks are gathered as above.

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
  o.sub_group_size = c.zero.sub_group_size;
  o.engine_factory = nvme_fault_factory();
  return o;
}

optim::ScheduleParams schedule_params(const Config& c) {
  optim::ScheduleParams p;
  const SchedulerConfig& s = c.scheduler;
  p.type = s.type == SchedulerType::kConstant ? "" : scheduler_type_name(s.type);
  p.base_lr = c.optimizer.lr;
  p.warmup_min_lr = s.warmup_min_lr;
  p.warmup_max_lr = s.warmup_max_lr;
  p.warmup_num_steps = s.warmup_num_steps;
  p.warmup_type = s.warmup_type == WarmupType::kLinear ? "linear" : "log";
  p.total_num_steps = s.total_num_steps;
  p.warmup_min_ratio = s.warmup_min_ratio;
  p.cos_min_ratio = s.cos_min_ratio;
  p.cycle_min_lr = s.cycle_min_lr;
  p.cycle_max_lr = s.cycle_max_lr;
  p.decay_lr_rate = s.decay_lr_rate;
  p.cycle_first_step_size = s.cycle_first_step_size;
  p.cycle_second_step_size = s.cycle_second_step_size;
  p.decay_step_size = s.decay_step_size;
  p.cycle_momentum = s.cycle_momentum;
  p.cycle_min_mom = s.cycle_min_mom;
  p.cycle_max_mom = s.cycle_max_mom;
  p.decay_mom_rate = s.decay_mom_rate;
  return p;
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

optim::LambParams lamb_params(const Config& c) {
  optim::LambParams l;
  l.lr = c.optimizer.lr;
  l.beta1 = c.optimizer.beta1;
  l.beta2 = c.optimizer.beta2;
  l.eps = c.optimizer.eps;
  l.weight_decay = c.optimizer.weight_decay;
  l.bias_correction = c.optimizer.bias_correction;
  l.eps_inside_sqrt = c.optimizer.eps_inside_sqrt;
  l.max_coeff = c.optimizer.max_coeff;
  l.min_coeff = c.optimizer.min_coeff;
  return l;
}

optim::AdamParams adam_params(const Config& c) {
  optim::AdamParams a;
  a.lr = c.optimizer.lr;
  a.beta1 = c.optimizer.beta1;
  a.beta2 = c.optimizer.beta2;
  a.eps = c.optimizer.eps;
  a.weight_decay = c.optimizer.weight_decay;
  a.adam_w_mode = c.optimizer.adam_w_mode;
  a.bias_correction = c.optimizer.bias_correction;
  return a;
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

ParamCoordinator::Options coordinator_options(const Config& c) {
  ParamCoordinator::Options o;
  o.allgather_bucket_numel = c.zero.allgather_bucket_size;
  o.prefetch_numel = c.zero.stage3_prefetch_bucket_size;
  o.persistence_numel = c.zero.stage3_param_persistence_threshold;
  o.model_persistence_numel = c.zero.stage3_model_persistence_threshold;
  o.max_live_numel = c.zero.stage3_max_live_parameters;
  o.max_reuse_distance = c.zero.stage3_max_reuse_distance;
  return o;
}

}  // namespace

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
  int64_t skipped_steps = 0;    // boundaries whose update was skipped (non-finite gradients)
  int64_t optimizer_steps = 0;  // updates applied (Adam's t, the schedule's step)
  double grad_norm = 0;
  double lr = 0;
  bool forward_pending = false;  // a forward whose backward has not run
  double loss_sum = 0;           // this rank's sum of micro-batch losses in the current global batch
  int64_t loss_count = 0;
  double last_loss = NAN;
  StepTimings timings;
  StateMemory memory;
  std::unique_ptr<OptimizerState> opt_state;  // master, m, v: RAM, pinned RAM or NVMe
  OffloadDevice offload_device = OffloadDevice::kNone;
  // "device": "cuda" (Note [the GPU path]): the GPU copies, which blocks the
  // last step changed (upload at the next acquire), and the blocks whose
  // gradient copies are in flight, in the order the model reported them.
  std::unique_ptr<DeviceMirror> gpu;
  bool gpu_states = false;  // offload_optimizer "none": master, m, v on the GPU (the rank's span)
  // Several ranks: gradients reduced on the GPU, over a communicator that
  // reaches GPU memory (NCCL),
  // on a stream of their own; only the rank's shard comes back to the host.
  bool gpu_reduce = false;
  std::unique_ptr<comm::Communicator> gpu_comm;
  std::unique_ptr<comm::CommStream> gpu_reduce_stream;
  // Stage 3 on several ranks (start_device_gathers): the parameter gathers
  // run on the GPU, on the reductions' stream.
  bool device_gathers = false;
  std::vector<char> gpu_stale;
  std::deque<int> gpu_copies;
  bool boundary_backward = false;
  bool step_pending = false;  // a boundary backward ran; its step() has not


  Impl(std::shared_ptr<Model> m, const Config& c, std::shared_ptr<comm::Communicator> cm)
      : cfg(c), model(std::move(m)), comm(std::move(cm)), dtype(c.compute_dtype()),
        schedule(schedule_params(c)) {
    if (comm) {
      world = comm->size();
      rank = comm->rank();
    }
    if (world > 1) agree_on_config();
    plan = StagePlan::make(c.zero.stage, world, c.zero.offload_param.device != OffloadDevice::kNone);
    offload_device = c.zero.offload_optimizer.device;
    if (world > 1) {
      make_streams();
    } else if (plan.params_sharded) {
      // One rank with offloaded parameters: its reads and one-rank "gathers"
      // (copies) still run on a stream of their own, ahead of use.
      local_comm = comm::make_single_communicator();
      own_gather_stream = std::make_unique<comm::CommStream>(*local_comm);
      gather_stream = own_gather_stream.get();
    }
    if (c.device == Device::kCuda) {
      const int dev = use_cuda_device(comm ? comm->local_rank() : 0);
      if (rank == 0 || world <= 8) log_info("rank " + std::to_string(rank) + " computes on GPU " + std::to_string(dev));
      if (world > 1) make_gpu_reduction(dev);
    }
    adam = adam_params(c);
    lamb = lamb_params(c);
    lr = schedule.lr_at(0);
    loss_scaling = c.fp16.enabled;
    if (loss_scaling) scaler = optim::LossScaler(loss_scale_params(c.fp16));
    allocate_and_init();
    if (c.device != model->device())
      throw ConfigError("device", std::string("the config says \"") + device_name(c.device) + "\" but model '" +
                                      model->name() + "' computes on " + device_name(model->device()));
    if (c.device == Device::kCuda) {
      std::vector<int64_t> padded;
      for (const BlockShard& s : blocks) padded.push_back(s.part.padded_numel);
      gpu = DeviceMirror::make(padded, dtype, GpuPlan::make(c, world).mirror);
      gpu_stale.assign(blocks.size(), 1);
      gpu_states = offload_device == OffloadDevice::kNone;
      if (gpu_reduce) {
        int64_t max_shard = 0;
        for (const BlockShard& s : blocks) max_shard = std::max(max_shard, s.part.shard_numel);
        // Stage 0's GPU-resident states update whole blocks: the reduced
        // shards come back into the full accumulator there.
        gpu->enable_device_reduce(c.wire_dtype(), max_shard, gpu_states && plan.optimizer_spans_block);
      }
      // The host compute copies the CPU update writes are page-locked, so
      // that each block's upload overlaps the update of the next. (Stage
      // 3's gathered copies come and go; its uploads go through the mirror's
      // own page-locked staging.)
      if (offload_device != OffloadDevice::kNone && !plan.params_sharded)
        for (BlockShard& s : blocks)
          if (!s.compute.empty()) gpu->register_host(s.compute.data(), s.compute.bytes());
      if (gpu_states) {
        // GPU-resident states: the initial master weights go up once; m
        // and v start at zero there as here.
        if (world > 1 && !gpu_reduce)
          throw Error("GPU-resident optimizer states on several ranks need the reduction on the GPU (NCCL), "
                      "which did not start (see the warning above); set "
                      "zero_optimization.offload_optimizer.device to \"cpu\" (ZeRO-Offload)");
        std::vector<int64_t> numel, offset;
        for (const BlockShard& s : blocks) {
          numel.push_back(s.opt_numel);
          offset.push_back(plan.optimizer_spans_block ? 0 : s.part.own_offset());
        }
        gpu->enable_states(numel, offset);
        for_each_host_span([&](const StateSpan& sp) {
          gpu->upload_states(sp.block, state_offset(sp), sp.count, sp.master, nullptr, nullptr);
        });
      }
      if (gpu_reduce && GpuPlan::make(c, world).device_gathers) start_device_gathers();
    }
  }

  // Stage 3 on several ranks with the reduction on the GPU and the shards
  // in RAM: the compute shards go up once (and after every update), and the
  // coordinator's gathers become all-gathers on the GPU, over the
  // reductions' communicator and on their stream. Not a communicator and
  // thread of their own, as the host's gathers have: NCCL calls on two
  // communicators of one GPU from two threads may deadlock (NCCL's thread
  // safety rules), so gathers and reductions go in one order, the same on
  // every rank; a gather can wait behind a reduction bucket. That order
  // includes where grads_ready falls among the acquires, which every rank's
  // model must keep alike (the coordinator checks the acquires only).
  void start_device_gathers() {
    std::vector<int64_t> shard;
    for (const BlockShard& s : blocks) shard.push_back(s.part.shard_numel);
    gpu->enable_param_shards(shard);
    upload_shards();
    ParamCoordinator::DeviceGather g;
    g.stream = gpu_reduce_stream.get();
    g.begin = [this](int b) { gpu->begin_gather(b); };
    g.gather = [this](comm::Communicator& c, int b) { gpu->gather_block(c, b); };
    g.end = [this](int b) { gpu->drop_params(b); };
    params->use_device_gather(std::move(g));
    memory.release_kept();  // the persistent blocks' RAM copies: no RAM gather comes again
    device_gathers = true;
    if (rank == 0) log_info("ZeRO-3: parameters are gathered on the GPU over " + gpu_comm->backend());
  }
  void upload_shards() {
    for (size_t b = 0; b < blocks.size(); ++b) gpu->upload_shard(static_cast<int>(b), blocks[b].own_compute());
  }

  ~Impl() override {
    if (gpu) {
      try {
        gpu->synchronize();
      } catch (const std::exception& e) {
        log_error(std::string("engine shutdown: the GPU failed: ") + e.what());
      }
    }
    // Work in flight refers to our buffers: let it finish before they go.
    for (comm::CommStream* st : {gpu_reduce_stream.get(), reduce_stream.get(), own_gather_stream.get()}) {
      if (!st) continue;
      try {
        st->synchronize();
      } catch (const std::exception& e) {
        log_error(std::string("engine shutdown: a collective failed: ") + e.what());
      }
    }
  }

  // Collective (every rank, at the same point): the communicator and stream
  // of the reductions on the GPU (NCCL). Where NCCL cannot start, the host
  // reduction stays.
  void make_gpu_reduction(int device) {
    // The mirror's GPU (a rank that sees one GPU of its own under a
    // per-rank CUDA_VISIBLE_DEVICES uses device 0). Every rank agrees
    // before NCCL starts (make_nccl_communicator), so all fall back together.
    try {
      gpu_comm = comm::make_nccl_communicator(*comm, device);
    } catch (const Error& e) {  // no GPU for it, or no libnccl
      if (rank == 0) log_warn(std::string("NCCL did not start (") + e.what() + ")");
      gpu_comm.reset();
    }
    if (!gpu_comm) {
      if (rank == 0)
        log_warn("no second communicator over " + comm->backend() +
                 ": gradients are reduced in host memory, not on the GPU");
      return;
    }
    gpu_reduce_stream = std::make_unique<comm::CommStream>(*gpu_comm);
    gpu_reduce = true;
    if (rank == 0) log_info("gradients are reduced on the GPU over " + gpu_comm->backend());
  }

  void make_streams() {
    reduce_stream = std::make_unique<comm::CommStream>(*comm);
    comm::Communicator* twin = comm->twin();  // collective the first time: every rank, here
    if (twin) {
      own_gather_stream = std::make_unique<comm::CommStream>(*twin);
      gather_stream = own_gather_stream.get();
    } else {
      if (rank == 0)
        log_warn("the " + comm->backend() +
                 " transport cannot run two communicators at once (MPI without MPI_THREAD_MULTIPLE): "
                 "parameter gathers share the gradient reductions' stream");
      gather_stream = reduce_stream.get();
    }
  }

  void allocate_and_init() {
    const std::vector<BlockSpec>& specs = model->blocks();
    if (specs.empty()) throw Error("model '" + model->name() + "' has no parameter blocks");
    blocks.resize(specs.size());
    std::vector<int64_t> spans;
    for (size_t b = 0; b < specs.size(); ++b) {
      BlockShard& s = blocks[b];
      s.layout = BlockLayout::from_spec(specs[b]);
      s.part = Partition::make(s.layout.numel, world, rank);
      s.opt_numel = plan.optimizer_numel(s.part);
      spans.push_back(s.opt_numel);
    }
    const offload::SwapperOptions nvme =
        offload_device == OffloadDevice::kNvme ? swapper_options(cfg) : offload::SwapperOptions{};
    opt_state = with_config_path("zero_optimization.offload_optimizer.nvme_path", [&] {
      return make_optimizer_state(offload_device, spans, cfg.zero.offload_optimizer.pin_memory, nvme, rank, memory);
    });
    for (size_t b = 0; b < specs.size(); ++b) {
      BlockShard& s = blocks[b];
      const size_t padded = static_cast<size_t>(s.part.padded_numel);
      // Every rank builds the full initial weights from the same seed and
      // keeps what its stage needs.
      AlignedBuffer full = make_buffer<float>(padded);
      float* w = full.as<float>();
      for (size_t p = 0; p < specs[b].params.size(); ++p) {
        const ParamSpec& ps = specs[b].params[p];
        float* dst = w + s.layout.offsets[p];
        int64_t cnt = s.layout.numels[p];
        num_params += cnt;
        // Each parameter has its own stream, so adding a parameter or a block
        // does not change the initial values of the others.
        Rng rng(mix_seed(cfg.seed, (static_cast<uint64_t>(b) << 20) + p));
        for (int64_t i = 0; i < cnt; ++i) {
          switch (ps.init) {
            case Init::kZeros: dst[i] = 0.0f; break;
            case Init::kOnes: dst[i] = 1.0f; break;
            case Init::kNormal: dst[i] = static_cast<float>(rng.normal() * ps.init_std); break;
          }
        }
      }
      opt_state->init_block(static_cast<int>(b), w + (plan.optimizer_spans_block ? 0 : s.part.own_offset()));
      if (plan.params_sharded) {
        // Stage 3: only the own shard (the coordinator gathers the rest).
        const size_t shard = static_cast<size_t>(s.part.shard_numel);
        const float* own = w + s.part.own_offset();
        const size_t bytes = shard * dtype_bytes(dtype);
        if (cfg.zero.offload_param.device == OffloadDevice::kCpu) {
          s.compute_shard_pinned = offload::PinnedBuffer(bytes, cfg.zero.offload_param.pin_memory);
          memory.add(static_cast<int64_t>(s.compute_shard_pinned.footprint()));
        } else {
          s.compute_shard = memory.alloc(bytes);
        }
        convert_f32_to_16(own, s.own_compute(), shard, dtype);
      } else if (is_16bit(dtype)) {
        s.compute = memory.alloc(padded * 2);
        convert_f32_to_16(w, s.compute.data(), padded, dtype);
      } else if (plan.compute_copy(dtype)) {
        s.compute = memory.alloc(padded * 4);
        std::memcpy(s.compute.data(), w, padded * 4);
      } else {
        s.master_compute = opt_state->master_in_memory(static_cast<int>(b));
      }
    }
    // The coordinator first: with offload_param "nvme" it moves the compute
    // shards out of RAM before the gradient buffers come in.
    const OffloadConfig& op = cfg.zero.offload_param;
    params = with_config_path("zero_optimization.offload_param.nvme_path", [&] {
      std::unique_ptr<offload::NvmeStore> param_store;
      if (plan.params_sharded && op.device == OffloadDevice::kNvme)
        param_store =
            std::make_unique<offload::NvmeStore>(nvme_options(cfg, op.nvme_path), rank, nvme_fault_factory());
      return std::make_unique<ParamCoordinator>(plan, blocks, dtype, gather_stream, memory, coordinator_options(cfg),
                                                std::move(param_store), op.pin_memory);
    });
    GradReducer::Options ro;
    ro.bucket_numel = cfg.zero.reduce_bucket_size;
    ro.overlap = cfg.zero.overlap_comm;
    ro.wire = cfg.wire_dtype();
    // GPU-resident states on one rank: the gradients stay on the GPU.
    ro.host_grads = cfg.device != Device::kCuda || GpuPlan::make(cfg, world).host_grads;
    if (gpu_reduce)
      ro.device_reduce = [this](comm::Communicator& c, int block, float* shard_out) {
        // GPU-resident states keep the reduced shard on the GPU.
        gpu->device_reduce(c, block, blocks[static_cast<size_t>(block)].part.shard_numel,
                           gpu_states ? nullptr : shard_out);
      };
    reducer = std::make_unique<GradReducer>(plan, blocks, gpu_reduce ? gpu_reduce_stream.get() : reduce_stream.get(),
                                            memory, ro);
    memory.release_kept();
  }

  // ---- StepContext --------------------------------------------------------------
  DType compute_dtype() const override { return dtype; }
  BlockParams acquire_params(int block) override {
    state(block);  // a block number outside the model is the model's error
    BlockParams p = params->acquire(block);
    if (device_gathers) {  // gathered on the GPU by the coordinator
      p.base = gpu->params(block);
      return p;
    }
    if (gpu) {
      drop_freed_gpu_params();  // making room may have freed others
      if (gpu_stale[static_cast<size_t>(block)] || !gpu->has_params(block)) {
        gpu->upload_params(block, p.base);
        gpu_stale[static_cast<size_t>(block)] = 0;
      }
      p.base = gpu->params(block);
    }
    return p;
  }
  void release_params(int block) noexcept override {
    params->release(block);
    if (gpu) drop_freed_gpu_params();
  }
  // Stage 3 on the GPU: a block's GPU parameters go when the coordinator
  // frees its host copy (at a release, or making room, or after the step),
  // so the GPU holds the blocks the coordinator holds gathered: the
  // stage3_* limits bound both.
  void drop_freed_gpu_params() noexcept {
    if (!plan.params_sharded) return;
    for (size_t b = 0; b < blocks.size(); ++b)
      if (blocks[b].param_state == ParamState::kSharded && gpu->has_params(static_cast<int>(b)))
        gpu->drop_params(static_cast<int>(b));
  }
  BlockGrads grads(int block) override {
    BlockShard& s = state(block);
    return BlockGrads{gpu ? gpu->grads(block) : reducer->grads(block), &s.layout};
  }
  void grads_ready(int block) override {
    BlockShard& s = state(block);
    if (s.grads_reported)
      throw Error("model '" + model->name() + "' reported gradients of block " + std::to_string(block) +
                  " twice in one backward");
    s.grads_reported = true;
    if (gpu && boundary_backward && gpu_reduce) {
      gpu->start_device_reduce(block);
      reducer->ready(block);
      return;
    }
    if (gpu && boundary_backward && !gpu_states) {
      gpu->start_grads_copy(block);
      gpu_copies.push_back(block);
      hand_over_gpu_grads(/*wait=*/false);
      return;
    }
    reducer->ready(block);
  }

  // GPU-resident states (one rank, so every span is a whole block's from
  // offset 0): the host OptimizerState is their copy for checkpoints and
  // full_params, refreshed from the GPU before either reads it.
  static int64_t state_offset(const StateSpan& sp) { return sp.offset; }
  void for_each_host_span(const std::function<void(const StateSpan&)>& fn) { opt_state->for_each(fn); }
  void states_to_host() {
    opt_state->for_each([&](const StateSpan& sp) {
      gpu->download_states(sp.block, state_offset(sp), sp.count, sp.master, sp.m, sp.v);
    });
  }

  // Blocks whose gradient copies have finished (all of them with wait) go
  // to the GradReducer, in the order the model reported them.
  void hand_over_gpu_grads(bool wait) {
    while (!gpu_copies.empty() && (wait || gpu->grads_copied(gpu_copies.front()))) {
      const int b = gpu_copies.front();
      gpu->finish_grads_copy(b, reducer->grads(b));
      reducer->ready(b);
      gpu_copies.pop_front();
    }
  }

  // A model that keeps a HeldParams past its forward or backward.
  void check_released(const char* phase) const {
    const int b = params->first_held();
    if (b >= 0)
      throw Error("model '" + model->name() + "' still holds the parameters of block " + std::to_string(b) +
                  " after " + phase + " (release its HeldParams before returning)");
  }

  BlockShard& state(int block) {
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

  // A boundary backward's step() must run before the next micro-batch: its
  // reductions may still be in flight (on the GPU, freeing the gradient
  // buffers the next backward would write), and its losses belong to it.
  void check_stepped(const char* what) const {
    if (step_pending)
      throw Error(std::string("Engine::") + what + "(): the global batch ending at micro-step " +
                  std::to_string(micro_steps) + " has not been stepped; call step() after every backward() "
                  "(it updates the weights at accumulation boundaries and does nothing elsewhere)");
  }

  float forward(const Batch& batch) {
    check_loaded("forward");
    check_stepped("forward");
    if (gpu) gpu->make_current();
    check_batch(batch);
    auto t0 = Clock::now();
    params->begin_pass(ParamCoordinator::Pass::kTrain);
    float loss = model->forward(*this, batch);
    check_released("forward");
    timings.forward_s += seconds_since(t0);
    forward_pending = true;
    loss_sum += loss;
    loss_count += 1;
    return loss;
  }

  void backward() {
    if (!forward_pending) throw Error("Engine::backward() called without a preceding forward()");
    check_stepped("backward");
    if (gpu) gpu->make_current();
    auto t0 = Clock::now();
    boundary_backward = (micro_steps + 1) % cfg.gradient_accumulation_steps == 0;
    reducer->begin_backward(boundary_backward);
    model->backward(*this, static_cast<float>(loss_scale()));
    check_released("backward");
    if (gpu) hand_over_gpu_grads(/*wait=*/true);
    params->end_pass();
    if (gpu) drop_freed_gpu_params();
    for (size_t b = 0; b < blocks.size(); ++b)
      if (!blocks[b].grads_reported)
        throw Error("model '" + model->name() + "' did not call grads_ready for block " +
                    std::to_string(b) + " during backward");
    reducer->end_backward();
    forward_pending = false;
    micro_steps += 1;
    step_pending = boundary_backward;
    timings.backward_s += seconds_since(t0);
  }

  double loss_scale() const { return loss_scaling ? scaler.scale() : 1.0; }
  static std::string num_text(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
  }

  bool at_boundary() const {
    return micro_steps > 0 && micro_steps % cfg.gradient_accumulation_steps == 0;
  }

  void step() {
    if (!at_boundary() || loss_count == 0) return;
    step_pending = false;
    if (gpu) gpu->make_current();
    auto t0 = Clock::now();
    const double inv_gas = 1.0 / static_cast<double>(cfg.gradient_accumulation_steps);
    const double inv_world = 1.0 / static_cast<double>(world);
    reducer->wait_all();  // every reduction of this step
    // Own-shard squares and the loss, summed over ranks in one collective.
    double sums[2] = {0.0, loss_sum};
    if (gpu_states) {
      sums[0] = gpu->grad_squared_norm();
    } else {
      for (BlockShard& s : blocks)
        sums[0] += optim::grad_squared_norm(reducer->reduced_shard(s), DType::kF32, s.part.shard_numel);
    }
    if (reduce_stream) {
      reduce_stream->submit([&sums](comm::Communicator& c) { c.all_reduce_f64(sums, 2); }).wait();
    }
    // Gradients are sums over ranks and micro-batches of per-micro-batch
    // mean-loss gradients: the mean is 1/(world * gas) of that, and with
    // fp16 they are of the loss times the loss scale.
    const double used_scale = loss_scale();
    const double scale = inv_gas * inv_world / used_scale;
    grad_norm = std::sqrt(sums[0]) * scale;
    global_steps += 1;
    const bool overflow = !std::isfinite(grad_norm);
    if (overflow) {
      skipped_steps += 1;
      if (rank == 0 && loss_scaling)
        log_info("step " + std::to_string(global_steps) + ": fp16 gradients overflowed at loss scale " +
                 num_text(used_scale) + "; the update is skipped");
      else if (rank == 0)
        log_warn("step " + std::to_string(global_steps) + ": gradient norm is not finite; the update is skipped");
    } else {
      const double clip = optim::clip_coefficient(grad_norm, cfg.gradient_clipping);
      const float grad_scale = static_cast<float>(scale * clip);
      lr = schedule.lr_at(optimizer_steps);
      set_hyperparameters(optimizer_steps);
      optimizer_steps += 1;
      if (gpu_states && plan.params_sharded) {
        // Stage 3: the update writes each block's new compute shard back to
        // the host (or its NVMe write buffer), and with device gathers to the
        // GPU shard, from where the coordinator gathers it.
        params->before_update();
        for (size_t b = 0; b < blocks.size(); ++b) {
          gpu->adam_step(static_cast<int>(b), adam, optimizer_steps, grad_scale,
                         params->shard_to_update(static_cast<int>(b)));
          params->finish_update(static_cast<int>(b));
        }
        gpu_stale.assign(blocks.size(), 1);
        params->gather_after_step();
        drop_freed_gpu_params();
      } else if (gpu_states) {
        for (size_t b = 0; b < blocks.size(); ++b) gpu->adam_step(static_cast<int>(b), adam, optimizer_steps, grad_scale);
        // Several ranks: every rank's new compute shards, all-gathered on the
        // GPU in block order (before the next forward reads them).
        if (gpu_reduce && !plan.optimizer_spans_block)
          gpu_reduce_stream->submit([this](comm::Communicator& c) {
            for (size_t b = 0; b < blocks.size(); ++b) gpu->gather_params(c, static_cast<int>(b));
          }).wait();
      } else {
        if (gpu) {
          gpu->wait_uploads();  // the last step's uploads have read the host copies
          gpu_stale.assign(blocks.size(), 1);  // upload_after_update clears what it uploads
        }
        params->before_update();
        update_all(grad_scale);
        if (device_gathers) upload_shards();
        params->gather_after_step();
        if (gpu) {
          drop_freed_gpu_params();
          upload_after_gather();
        }
      }
    }
    reducer->reset_after_step();
    if (gpu_states) gpu->zero_grads();
    if (loss_scaling) scaler.update(overflow);
    last_loss = sums[1] / static_cast<double>(loss_count * world);
    loss_sum = 0;
    loss_count = 0;
    timings.step_s += seconds_since(t0);
  }

  // AdamW over one span of the optimizer state: the gradient is the full
  // reduced gradient (the optimizer spans the block, stage 0) or the rank's
  // reduced shard; the new weights go to the compute copy, or at stage 3 the
  // compute shard (bf16 in the same pass, fp32 copied), unless the master
  // weights are the compute weights.
  // Where a span's compute weights go: the compute copy's part of it, or at
  // stage 3 the compute shard's; null where the master weights are the
  // compute weights.
  char* compute_out(const StateSpan& sp) {
    BlockShard& s = blocks[static_cast<size_t>(sp.block)];
    if (plan.params_sharded)
      return params->shard_to_update(sp.block) + static_cast<size_t>(sp.offset) * dtype_bytes(dtype);
    if (s.compute.empty()) return nullptr;
    const int64_t at = (plan.optimizer_spans_block ? 0 : s.part.own_offset()) + sp.offset;
    return s.compute.as<char>() + static_cast<size_t>(at) * dtype_bytes(dtype);
  }

  void update_span(const StateSpan& sp, float grad_scale) {
    BlockShard& s = blocks[static_cast<size_t>(sp.block)];
    const float* grad = (plan.optimizer_spans_block ? s.grad.as<float>() : reducer->reduced_shard(s)) + sp.offset;
    char* out = compute_out(sp);  // where the span's new compute weights go
    bf16* out16 = dtype == DType::kBF16 ? reinterpret_cast<bf16*>(out) : nullptr;
    optim::adam_step(adam, optimizer_steps, grad_scale,
                     optim::AdamSpan{sp.master, grad, DType::kF32, sp.m, sp.v, out16, sp.count});
    // fp32 copied; fp16 converted in a second pass (the optimizer's fused
    // copy-out writes bf16 only).
    if (dtype != DType::kBF16 && out) convert_f32_to_16(sp.master, out, static_cast<size_t>(sp.count), dtype);
  }

  // The spans come block by block: once the visitor moves past a block, its
  // new compute shard is complete and (on NVMe) goes back to disk.
  void update_all(float grad_scale) {
    if (cfg.optimizer.type == OptimizerType::kLamb) return lamb_update_all(grad_scale);
    visit_updating([&](const StateSpan& sp) { update_span(sp, grad_scale); });
  }

  // The optimizer's lr for optimizer step `s` (0-based) and, where the
  // schedule sets them (OneCycle's cycle_momentum, as DeepSpeed writes the
  // param group's betas), its betas.
  void set_hyperparameters(int64_t s) {
    adam.lr = lamb.lr = lr;
    if (!schedule.sets_betas()) return;
    const optim::ScheduleBetas b = schedule.betas_at(s);
    if (!(b.beta1 >= 0 && b.beta1 < 1))
      throw ConfigError("scheduler.params.decay_mom_rate",
                        "OneCycle's momentum reached " + std::to_string(b.beta1) + " at optimizer step " +
                            std::to_string(s) + "; beta1 must stay below 1 (lower decay_mom_rate)");
    adam.beta1 = lamb.beta1 = b.beta1;
    adam.beta2 = lamb.beta2 = b.beta2;
  }

  // ---- Lamb (Note [Lamb arithmetic] in optim/detail/lamb_math.h) ------------------
  // Tensor t of the model is parameter p of block b at lamb_first_tensor[b] + p.
  std::vector<int> lamb_first_tensor;
  int lamb_tensors = 0;

  const float* update_grad(const StateSpan& sp) {
    BlockShard& s = blocks[static_cast<size_t>(sp.block)];
    return (plan.optimizer_spans_block ? s.grad.as<float>() : reducer->reduced_shard(s)) + sp.offset;
  }
  std::vector<optim::LambSegment> lamb_span_segments(const StateSpan& sp) const {
    const BlockShard& s = blocks[static_cast<size_t>(sp.block)];
    const int64_t flat = (plan.optimizer_spans_block ? 0 : s.part.own_offset()) + sp.offset;
    return lamb_segments(s.layout, flat, sp.count, lamb_first_tensor[static_cast<size_t>(sp.block)]);
  }

  // Pass 1 reads every span (from NVMe without writing back) for each
  // tensor's sums of w^2 and u^2; with sharded optimizer state (stages 1-3)
  // the ranks' partial sums are added in one all-reduce; pass 2 applies the
  // update with each tensor's trust ratio.
  void lamb_update_all(float grad_scale) {
    if (lamb_first_tensor.empty()) {
      for (const BlockShard& s : blocks) {
        lamb_first_tensor.push_back(lamb_tensors);
        lamb_tensors += static_cast<int>(s.layout.offsets.size());
      }
    }
    std::vector<double> sums(static_cast<size_t>(2 * lamb_tensors), 0.0);
    opt_state->for_each_read([&](const StateSpan& sp) {
      const std::vector<optim::LambSegment> segs = lamb_span_segments(sp);
      optim::lamb_norms(lamb, grad_scale,
                        optim::AdamSpan{sp.master, update_grad(sp), DType::kF32, sp.m, sp.v, nullptr, sp.count}, segs,
                        sums.data());
    });
    if (reduce_stream && !plan.optimizer_spans_block)
      reduce_stream->submit([&sums](comm::Communicator& c) {
        c.all_reduce_f64(sums.data(), static_cast<int64_t>(sums.size()));
      }).wait();
    std::vector<double> ratios(static_cast<size_t>(lamb_tensors));
    for (int t = 0; t < lamb_tensors; ++t)
      ratios[static_cast<size_t>(t)] =
          optim::lamb_trust_ratio(sums[2 * t], sums[2 * t + 1], lamb.min_coeff, lamb.max_coeff);
    visit_updating([&](const StateSpan& sp) {
      char* out = compute_out(sp);
      bf16* out16 = dtype == DType::kBF16 ? reinterpret_cast<bf16*>(out) : nullptr;
      optim::lamb_apply(lamb, optimizer_steps, grad_scale,
                        optim::AdamSpan{sp.master, update_grad(sp), DType::kF32, sp.m, sp.v, out16, sp.count},
                        lamb_span_segments(sp), ratios.data());
      if (dtype != DType::kBF16 && out) convert_f32_to_16(sp.master, out, static_cast<size_t>(sp.count), dtype);
    });
  }
  // overwrite: fn sets every element of master, m and v (a load), so states
  // on NVMe need not be read first.
  void visit_updating(const std::function<void(const StateSpan&)>& fn, bool overwrite = false) {
    int last = -1;
    auto finish = [&](int b) {
      params->finish_update(b);
      upload_after_update(b);
    };
    auto visit = [&](const StateSpan& sp) {
      if (sp.block != last && last >= 0) finish(last);
      last = sp.block;
      fn(sp);
    };
    if (overwrite) opt_state->for_each_overwrite(visit);
    else opt_state->for_each(visit);
    if (last >= 0) finish(last);
  }

  // ZeRO-Offload on the GPU: a block whose host compute copy is complete
  // once its own update is (stage 0, or one rank: no all-gather to wait
  // for) goes up at once, on the copy stream, while the CPU updates the
  // next; otherwise upload_after_gather or the next acquire uploads it.
  void upload_after_update(int b) {
    // (Stage 3's host copy, where there is one, is the old gathered block:
    // the next acquire uploads the new one.)
    if (!gpu || gpu_states || plan.params_sharded || !(plan.optimizer_spans_block || world == 1)) return;
    BlockShard& s = blocks[static_cast<size_t>(b)];
    const void* host = !s.compute.empty() ? s.compute.data() : static_cast<const void*>(s.master_compute);
    if (!host) return;
    gpu->upload_params_async(b, host);
    gpu_stale[static_cast<size_t>(b)] = 0;
  }

  // Stages 1-2 on several ranks: once the all-gather has brought every
  // rank's new shards, each block goes up on the copy stream from its
  // page-locked host copy, all of them queued now, so the next forward's
  // first blocks wait only for their own upload and the rest overlap its
  // kernels (at the acquire, an upload on the compute stream would wait for
  // every kernel before it).
  void upload_after_gather() {
    if (gpu_states || !plan.gather_params_after_step) return;
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (!gpu_stale[b] || blocks[b].compute.empty()) continue;
      gpu->upload_params_async(static_cast<int>(b), blocks[b].compute.data());
      gpu_stale[b] = 0;
    }
  }

  // ---- ranks agree on what they train -------------------------------------------------
  // Every rank must be given the same config and model: ranks that differ
  // train diverging shards and save a checkpoint whose metadata names one
  // config. One all-reduce compares a digest (a cut 64-bit hash in two exact
  // halves, as max(x) == -max(-x) only when all are equal); where they
  // differ, rank 0's and the lowest differing rank's documents go to every
  // rank, which all stop with the same error naming the first differing key.
  nlohmann::json what_we_train() const {
    nlohmann::json blocks_spec = nlohmann::json::object();
    for (const BlockSpec& b : model->blocks()) {
      nlohmann::json ps = nlohmann::json::object();
      for (const ParamSpec& p : b.params)
        ps[p.name] = std::vector<int64_t>(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
      blocks_spec[b.name] = ps;  // object keys: a difference is named by block and parameter
    }
    return {{"config", cfg.source}, {"model", {{"name", model->name()}, {"blocks", blocks_spec}}}};
  }

  // `text` of rank `root` on every rank.
  std::string broadcast_text(const std::string& text, int root) {
    double len = rank == root ? static_cast<double>(text.size()) : 0.0;
    comm->all_reduce_max_f64(&len, 1);
    std::string buf(static_cast<size_t>(len) + (static_cast<size_t>(len) & 1), '\0');  // 2-byte elements
    if (rank == root) std::memcpy(buf.data(), text.data(), text.size());
    comm->broadcast(buf.data(), static_cast<int64_t>(buf.size() / 2), DType::kBF16, root);
    buf.resize(static_cast<size_t>(len));
    return buf;
  }

  void agree_on_config() {
    const nlohmann::json mine = what_we_train();
    const std::string text = mine.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    const uint64_t h = std::strtoull(ckpt::xxh3_hex(text.data(), text.size()).c_str(), nullptr, 16);
    const double hi = static_cast<double>(h >> 32), lo = static_cast<double>(h & 0xffffffffu);
    double v[4] = {hi, lo, -hi, -lo};
    comm->all_reduce_max_f64(v, 4);
    if (v[0] == -v[2] && v[1] == -v[3]) return;
    const std::string root_text = broadcast_text(text, 0);
    double lowest = root_text != text ? world - rank : 0;  // the lowest differing rank has the largest
    comm->all_reduce_max_f64(&lowest, 1);
    const int other = world - static_cast<int>(lowest);
    const nlohmann::json a = nlohmann::json::parse(root_text);
    const nlohmann::json b = nlohmann::json::parse(broadcast_text(text, other));
    std::string path, va, vb;
    first_difference(a, b, "", path, va, vb);
    if (path.rfind("config.", 0) == 0) path = path.substr(7);  // the config's own JSON path
    throw ConfigError(path, "the ranks were given different configs: rank " + std::to_string(other) + " has " + vb +
                                ", rank 0 has " + va + " (every rank must train the same config and model; nothing "
                                "was trained)");
  }

  // The first place where a and b differ (depth first, keys in order), the
  // path in the config's dotted form and both values (cut short).
  static bool first_difference(const nlohmann::json& a, const nlohmann::json& b, const std::string& at,
                               std::string& path, std::string& va, std::string& vb) {
    auto brief = [](const nlohmann::json* j) {
      if (!j) return std::string("nothing");
      std::string d = j->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      return d.size() > 80 ? d.substr(0, 77) + "..." : d;
    };
    auto join = [&](const std::string& k) { return at.empty() ? k : at + "." + k; };
    if (a.is_object() && b.is_object()) {
      std::set<std::string> keys;
      for (auto it = a.begin(); it != a.end(); ++it) keys.insert(it.key());
      for (auto it = b.begin(); it != b.end(); ++it) keys.insert(it.key());
      for (const std::string& k : keys) {
        const nlohmann::json* x = a.contains(k) ? &a[k] : nullptr;
        const nlohmann::json* y = b.contains(k) ? &b[k] : nullptr;
        if (x && y) {
          if (*x != *y) return first_difference(*x, *y, join(k), path, va, vb);
        } else {
          path = join(k), va = brief(x), vb = brief(y);
          return true;
        }
      }
      return false;
    }
    if (a.is_array() && b.is_array() && a.size() == b.size()) {
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != b[i]) return first_difference(a[i], b[i], at + "[" + std::to_string(i) + "]", path, va, vb);
      return false;
    }
    path = at, va = brief(&a), vb = brief(&b);
    return true;
  }

  // ---- checkpoints (Note [checkpoints] in engine/checkpoint.cpp) ---------------------
  // Whether any rank failed (the largest rank+1 that did, 0 if none): every
  // rank learns it, so that all fail together or none does.
  int failed_rank(bool failed) {
    double v = failed ? rank + 1 : 0;
    if (reduce_stream) reduce_stream->submit([&v](comm::Communicator& c) { c.all_reduce_max_f64(&v, 1); }).wait();
    return static_cast<int>(v);
  }

  // Every rank uses rank 0's tag, so that all write into one checkpoint;
  // checkpoint.tag_validation says whether a rank that passed another one
  // is an error (Fail), a warning (Warn) or neither (Ignore).
  std::string agree_on_tag(const std::string& tag) {
    if (world == 1) return tag;
    std::array<char, ckpt::kMaxTagBytes + 2> buf{};  // even: broadcast in 2-byte elements
    if (rank == 0) std::memcpy(buf.data(), tag.data(), tag.size());
    gather_stream->submit([&buf](comm::Communicator& c) {
      c.broadcast(buf.data(), static_cast<int64_t>(buf.size() / 2), DType::kBF16, 0);
    }).wait();
    const std::string root_tag(buf.data());
    const bool differs = root_tag != tag;
    const int bad = failed_rank(differs);
    const TagValidation tv = cfg.checkpoint.tag_validation;
    if (bad == 0 || tv == TagValidation::kIgnore) return root_tag;
    const std::string what =
        differs ? "rank " + std::to_string(rank) + " passed checkpoint tag \"" + tag + "\" but rank 0 passed \"" +
                      root_tag + "\""
                : "rank " + std::to_string(bad - 1) + " passed another checkpoint tag than rank 0's \"" + root_tag + "\"";
    if (tv == TagValidation::kFail) throw Error(what + " (checkpoint.tag_validation is Fail; nothing was saved)");
    if (differs || rank == 0) log_warn(what + "; saving under rank 0's tag (checkpoint.tag_validation: Warn)");
    return root_tag;
  }

  void check_between_batches(const char* what) const {
    if (forward_pending || micro_steps % cfg.gradient_accumulation_steps != 0)
      throw Error(std::string(what) + " must come between global batches (after step() at an accumulation "
                  "boundary), not after micro-step " + std::to_string(micro_steps));
    // A boundary backward whose step() has not run: its gradients and losses
    // (and on the GPU its reductions in flight) belong to that step.
    if (loss_count != 0)
      throw Error(std::string(what) + " must come after step(): the global batch ending at micro-step " +
                  std::to_string(micro_steps) + " has not been stepped");
  }

  nlohmann::json blocks_json() const {
    nlohmann::json out = nlohmann::json::array();
    const std::vector<BlockSpec>& specs = model->blocks();
    for (size_t b = 0; b < specs.size(); ++b) {
      nlohmann::json ps = nlohmann::json::array();
      for (size_t p = 0; p < specs[b].params.size(); ++p)
        ps.push_back({{"name", specs[b].params[p].name},
                      {"shape", std::vector<int64_t>(specs[b].params[p].shape.dims.begin(),
                                                     specs[b].params[p].shape.dims.begin() +
                                                         specs[b].params[p].shape.ndim)},
                      {"offset", blocks[b].layout.offsets[p]}});
      out.push_back({{"name", specs[b].name}, {"numel", blocks[b].layout.numel}, {"params", ps}});
    }
    return out;
  }

  void save_checkpoint(const std::string& dir, std::string tag, const nlohmann::json& client_state) {
    namespace fs = std::filesystem;
    check_loaded("save_checkpoint");
    check_between_batches("save_checkpoint");
    if (gpu) gpu->make_current();
    if (gpu_states) states_to_host();
    if (tag.empty()) tag = "global_step" + std::to_string(global_steps);
    ckpt::check_tag(tag);
    tag = agree_on_tag(tag);
    ckpt::count_save();
    const std::string partial = (fs::path(dir) / ("." + tag + ".partial")).string();
    std::string error;
    auto attempt = [&error](const std::function<void()>& fn) {
      if (!error.empty()) return;
      try {
        fn();
      } catch (const std::exception& e) {
        error = e.what();
      }
    };
    auto agree = [&](const char* phase) {
      const int bad = failed_rank(!error.empty());
      if (bad == 0) return;
      if (rank == 0) {
        std::error_code ec;
        fs::remove_all(partial, ec);  // no partial tag is left behind
      }
      if (!error.empty()) throw IoError(error);
      throw IoError("checkpoint " + (fs::path(dir) / tag).string() + ": rank " + std::to_string(bad - 1) +
                    " failed " + phase + " (its error is on its own output); nothing was committed");
    };
    // Rank 0 holds the folder's lock for the save (zinc-train holds it for
    // its whole run): another run's save could otherwise replace our tags.
    std::optional<ckpt::DirLock> lock;
    if (rank == 0)
      attempt([&] {
        lock.emplace(dir);
        fs::remove_all(partial);
        fs::create_directory(partial);
      });
    agree("to create the folder");
    // Every rank: its spans of master, m, v, streamed span by span (from
    // NVMe through the swapper's buffers).
    char name[32];
    std::snprintf(name, sizeof name, "rank%05d", rank);
    attempt([&] {
      std::vector<ckpt::RankWriter::Span> spans;
      for (size_t b = 0; b < blocks.size(); ++b)
        spans.push_back({static_cast<int>(b), plan.optimizer_spans_block ? 0 : blocks[b].part.own_offset(),
                         blocks[b].opt_numel});
      ckpt::RankWriter w((fs::path(partial) / (std::string(name) + ".bin")).string(), spans);
      // States in RAM stay put until finish(): written from where they are.
      const bool stable = offload_device != OffloadDevice::kNvme;
      opt_state->for_each_read([&](const StateSpan& sp) {
        w.write(sp.block, ckpt::kMaster, sp.offset, sp.master, sp.count, stable);
        w.write(sp.block, ckpt::kM, sp.offset, sp.m, sp.count, stable);
        w.write(sp.block, ckpt::kV, sp.offset, sp.v, sp.count, stable);
      });
      nlohmann::json index = w.finish();
      index["rank"] = rank;
      ckpt::write_file_atomic((fs::path(partial) / (std::string(name) + ".json")).string(), index.dump());
      ckpt::fault_point("index");
    });
    agree("to write its shards");
    if (rank == 0)
      attempt([&] {
        // Each rank's index by its size and checksum: the metadata (sealed
        // with its own checksum) vouches for every file of the tag.
        nlohmann::json ranks = nlohmann::json::array();
        for (int r = 0; r < world; ++r) {
          std::snprintf(name, sizeof name, "rank%05d.json", r);
          std::ifstream in(fs::path(partial) / name, std::ios::binary);
          const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
          if (!in.good() && !in.eof()) throw IoError("checkpoint: cannot read " + (fs::path(partial) / name).string());
          ranks.push_back({{"file", name},
                           {"bytes", static_cast<int64_t>(text.size())},
                           {"xxh3_64", ckpt::xxh3_hex(text.data(), text.size())}});
        }
        nlohmann::json meta = {
            {"format", "zinc-checkpoint"},
            {"version", 2},
            {"zinc_version", ZINC_VERSION},
            {"tag", tag},
            {"world_size", world},
            {"zero_stage", cfg.zero.stage},
            {"compute_dtype", dtype_name(dtype)},
            {"model", model->name()},
            {"blocks", blocks_json()},
            {"rank_indexes", ranks},
            {"training",
             {{"global_steps", global_steps},
              {"micro_steps", micro_steps},
              {"skipped_steps", skipped_steps},
              {"optimizer_steps", optimizer_steps},
              {"loss_scale",
               {{"scale", scaler.scale()},
                {"hysteresis", scaler.hysteresis_left()},
                {"iteration", scaler.iteration()},
                {"last_overflow", scaler.last_overflow_iteration()}}},
              {"lr", lr},
              {"grad_norm", std::isfinite(grad_norm) ? nlohmann::json(grad_norm) : nlohmann::json(nullptr)},
              {"last_loss", std::isfinite(last_loss) ? nlohmann::json(last_loss) : nlohmann::json(nullptr)}}},
            {"client_state", client_state},
            {"config", cfg.source}};
        ckpt::write_file_atomic((fs::path(partial) / "metadata.json").string(), ckpt::sealed_dump(meta, 1));
        ckpt::fault_point("metadata");
        ckpt::commit_tag(dir, partial, tag);
      });
    agree("to commit");
  }

  // Throws unless the checkpoint holds this model's blocks (names, sizes,
  // parameters); `names` gets the block names for the reader's messages.
  void check_same_model(const ckpt::TagFiles& files, std::vector<std::string>& names) const {
    const std::string where = "checkpoint " + files.dir;
    const nlohmann::json mine = blocks_json();
    const nlohmann::json& theirs = files.meta.at("blocks");
    if (theirs.size() != mine.size())
      throw Error(where + " holds a model of " + std::to_string(theirs.size()) + " blocks; this one has " +
                  std::to_string(mine.size()));
    for (size_t b = 0; b < mine.size(); ++b) {
      names.push_back(mine[b]["name"]);
      if (theirs[b]["params"].size() != mine[b]["params"].size() || theirs[b]["numel"] != mine[b]["numel"])
        throw Error(where + ": block " + std::to_string(b) + " '" + names.back() + "' differs from this model's");
      for (size_t p = 0; p < mine[b]["params"].size(); ++p)
        if (theirs[b]["params"][p] != mine[b]["params"][p])
          throw Error(where + ": block '" + names.back() + "' parameter " + theirs[b]["params"][p].dump() +
                      " differs from this model's " + mine[b]["params"][p].dump());
    }
  }

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

  void check_loaded(const char* what) const {
    if (!failed_load.empty())
      throw Error(std::string(what) + ": the engine's state is incomplete after a failed load (" + failed_load +
                  "); load a whole checkpoint first");
  }

  // Runs `fn` on every rank; if it failed on any, every rank throws (the
  // failing one its own error, the others one naming that rank).
  void on_every_rank(const std::string& what, const std::function<void()>& fn) {
    std::exception_ptr err;
    try {
      fn();
    } catch (...) {
      err = std::current_exception();
    }
    const int bad = failed_rank(err != nullptr);
    if (err) std::rethrow_exception(err);
    if (bad != 0)
      throw IoError(what + ": rank " + std::to_string(bad - 1) + " failed (its error is on its own output)");
  }

  nlohmann::json load_checkpoint(const std::string& dir, std::string tag) {
    check_between_batches("load_checkpoint");
    if (gpu) gpu->make_current();
    ckpt::TagFiles files;
    std::vector<std::string> names;
    on_every_rank("checkpoint " + dir + (tag.empty() ? "" : "/" + tag) + ": nothing was loaded", [&] {
      files = ckpt::open_tag(dir, std::move(tag));
      check_same_model(files, names);
    });
    const nlohmann::json& meta = files.meta;
    ckpt::CheckpointReader reader(files.dir, files.ranks, names);
    if (gpu) gpu->wait_uploads();
    params->before_update();
    auto read_states = [&] {
      visit_updating([&](const StateSpan& sp) {
        const BlockShard& s = blocks[static_cast<size_t>(sp.block)];
        const int64_t flat = (plan.optimizer_spans_block ? 0 : s.part.own_offset()) + sp.offset;
        reader.read(sp.block, ckpt::kMaster, flat, sp.count, sp.master);
        reader.read(sp.block, ckpt::kM, flat, sp.count, sp.m);
        reader.read(sp.block, ckpt::kV, flat, sp.count, sp.v);
        // The compute weights, as the update writes them: rounded to 16 bits or copied.
        char* out = compute_out(sp);
        if (!out) return;
        convert_f32_to_16(sp.master, out, static_cast<size_t>(sp.count), dtype);
      }, /*overwrite=*/true);  // every element is read from the checkpoint (zeros where none was saved)
    };
    try {
      on_every_rank("checkpoint " + files.dir + ": the load failed", read_states);
    } catch (const std::exception& e) {
      failed_load = e.what();  // Note [a failed load]
      throw;
    }
    failed_load.clear();
    if (device_gathers) {
      params->before_update();  // no gather in flight reads the GPU shards
      upload_shards();
    }
    // The GPU states before the gathers start (their synchronous copies
    // would otherwise wait for the gathers in flight).
    if (gpu_states)
      for_each_host_span([&](const StateSpan& sp) {
        gpu->upload_states(sp.block, state_offset(sp), sp.count, sp.master, sp.m, sp.v);
      });
    params->gather_after_step();
    if (gpu) {
      gpu_stale.assign(blocks.size(), 1);
      drop_freed_gpu_params();
    }
    const nlohmann::json& t = meta.at("training");
    global_steps = t.at("global_steps");
    micro_steps = t.at("micro_steps");
    skipped_steps = t.at("skipped_steps");
    optimizer_steps = t.at("optimizer_steps");
    lr = t.at("lr");
    grad_norm = t.at("grad_norm").is_null() ? NAN : t.at("grad_norm").get<double>();  // null: an overflowed step
    // The loss scale continues where it was (a checkpoint without fp16, or
    // from before zinc kept it, starts the scaler afresh).
    if (loss_scaling && cfg.fp16.loss_scale == 0 && t.contains("loss_scale") &&
        meta.value("compute_dtype", "") == "fp16") {
      const nlohmann::json& ls = t["loss_scale"];
      scaler.restore(ls.at("scale"), ls.at("hysteresis"), ls.at("iteration"), ls.at("last_overflow"));
    }
    last_loss = t.at("last_loss").is_null() ? NAN : t.at("last_loss").get<double>();
    // At another accumulation: the micro-step count follows the global steps.
    micro_steps = global_steps * cfg.gradient_accumulation_steps;
    step_pending = false;
    return meta.value("client_state", nlohmann::json::object());
  }

  std::vector<float> full_params(int block) {
    check_loaded("full_params");
    BlockShard& s = state(block);
    if (gpu) gpu->make_current();
    if (gpu_states) {
      if (float* hm = opt_state->master_in_memory(block))
        gpu->download_states(block, 0, s.opt_numel, hm, nullptr, nullptr);
      else
        states_to_host();
    }
    std::vector<float> own(static_cast<size_t>(s.opt_numel));
    opt_state->read_master(block, own.data());
    if (plan.optimizer_spans_block || world == 1) return own;
    std::vector<float> out(static_cast<size_t>(s.part.padded_numel));
    gather_stream->submit([&](comm::Communicator& c) {
      c.all_gather(own.data(), out.data(), s.part.shard_numel, DType::kF32);
    }).wait();
    return out;
  }
};

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
                      "too; reductions on the GPU over NCCL are not in the engine yet)");
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

float Engine::forward(const Batch& batch) { return impl_->forward(batch); }
void Engine::save_checkpoint(const std::string& dir, const std::string& tag, const nlohmann::json& client_state) {
  impl_->save_checkpoint(dir, tag, client_state);
}
nlohmann::json Engine::load_checkpoint(const std::string& dir, const std::string& tag) {
  return impl_->load_checkpoint(dir, tag);
}
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
  impl_->check_loaded("evaluate");
  impl_->check_batch(batch);
  if (impl_->gpu) impl_->gpu->make_current();
  impl_->params->begin_pass(ParamCoordinator::Pass::kEval);
  const float loss = impl_->model->forward(*impl_, batch);
  impl_->check_released("evaluate");
  impl_->params->end_pass();
  if (impl_->gpu) impl_->drop_freed_gpu_params();
  return loss;
}

bool Engine::is_gradient_accumulation_boundary() const { return impl_->at_boundary(); }
double Engine::global_grad_norm() const { return impl_->grad_norm; }
double Engine::learning_rate() const { return impl_->lr; }
double Engine::loss_scale() const { return impl_->loss_scale(); }
int64_t Engine::global_steps() const { return impl_->global_steps; }
int64_t Engine::skipped_steps() const { return impl_->skipped_steps; }
int64_t Engine::micro_steps() const { return impl_->micro_steps; }
double Engine::last_batch_loss() const { return impl_->last_loss; }
int Engine::rank() const { return impl_->rank; }
int Engine::world_size() const { return impl_->world; }
double Engine::comm_wait_seconds() const {
  double s = 0;
  for (const comm::CommStream* st :
       {impl_->reduce_stream.get(), impl_->own_gather_stream.get(), impl_->gpu_reduce_stream.get()})
    if (st) s += st->wait_seconds();
  return s;
}
double Engine::comm_busy_seconds() const {
  double s = 0;
  for (const comm::CommStream* st :
       {impl_->reduce_stream.get(), impl_->own_gather_stream.get(), impl_->gpu_reduce_stream.get()})
    if (st) s += st->busy_seconds();
  return s;
}
const Config& Engine::config() const { return impl_->cfg; }
Model& Engine::model() { return *impl_->model; }
DType Engine::compute_dtype() const { return impl_->dtype; }
int64_t Engine::num_parameters() const { return impl_->num_params; }
StepTimings Engine::timings() const { return impl_->timings; }
ParamGatherStats Engine::param_gather_stats() const { return impl_->params->stats(); }
std::vector<float> Engine::full_params(int block) const { return impl_->full_params(block); }

int64_t Engine::offload_bytes_read() const {
  return impl_->opt_state->bytes_read() + impl_->params->nvme_bytes_read();
}
int64_t Engine::offload_bytes_written() const {
  return impl_->opt_state->bytes_written() + impl_->params->nvme_bytes_written();
}

int64_t Engine::model_state_bytes() const { return impl_->memory.bytes(); }
int64_t Engine::model_state_peak_bytes() const { return impl_->memory.peak_bytes(); }
int64_t Engine::gpu_state_bytes() const { return impl_->gpu ? impl_->gpu->bytes() : 0; }
int64_t Engine::gpu_state_peak_bytes() const { return impl_->gpu ? impl_->gpu->peak_bytes() : 0; }

}  // namespace zinc
