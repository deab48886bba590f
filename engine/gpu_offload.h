// zinc engine, private: where the model computes, as the engine's step sees
// it. The engine calls its DevicePath at a few fixed points of the step
// (acquire and release, grads and grads_ready, the end of backward, the
// update, after the gather, save, load, full_params) and never asks which
// device it is: the CPU's DevicePath does nothing at any of them, and
// GpuOffload ("device": "cuda", Note [the GPU path] in gpu_offload.cpp) is
// all of the GPU path's state and logic. So engine.cpp reads as the CPU's
// step in docs/design.md's order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "core/dtype.h"
#include "engine/config.h"
#include "engine/grad_reducer.h"
#include "engine/model.h"
#include "engine/optimizer_state.h"
#include "engine/param_coordinator.h"
#include "engine/shard.h"
#include "optim/optim.h"

namespace zinc {

// The engine's state the device path works on, once the engine has
// allocated it (DevicePath::attach). Everything outlives the device path.
struct DeviceContext {
  const StagePlan* plan = nullptr;
  std::vector<BlockShard>* blocks = nullptr;
  ParamCoordinator* params = nullptr;
  GradReducer* reducer = nullptr;
  OptimizerState* opt_state = nullptr;
  StateMemory* memory = nullptr;
};

// Every hook's default is the CPU's: nothing.
class DevicePath {
 public:
  virtual ~DevicePath() = default;

  // ---- set-up, in this order ----
  // Before the engine allocates: the GradReducer's options, and the stream
  // its reductions run on (null: the engine's own reduce stream).
  virtual void configure_reducer(GradReducer::Options&) {}
  virtual comm::CommStream* reduce_stream() const { return nullptr; }
  // After it has allocated and initialised every block.
  virtual void attach(const DeviceContext&) {}

  // Makes the device current for the calling thread (every entry point).
  virtual void make_current() {}

  // ---- forward and backward ----
  // The block's parameters as the model reads them (`p` is the host's).
  virtual void on_acquire(int /*block*/, BlockParams& /*p*/) {}
  // After the coordinator released or freed blocks (a release, the end of a pass).
  virtual void on_release() noexcept {}
  // The block's gradient accumulator; null: the host's (the GradReducer's).
  virtual float* grads(int /*block*/) { return nullptr; }
  // The model reported the block's gradients; false: the engine hands the
  // block to the GradReducer itself.
  virtual bool grads_ready(int /*block*/, bool /*boundary*/) { return false; }
  // After the model's backward, before the coordinator's end of the pass.
  virtual void end_backward() {}

  // ---- model parallelism on the device (Note [pipeline stages on the GPU]
  // in pipeline.cpp, Note [tensor parts on the GPU] in tensor_parallel.cpp) ----
  // n floats where the model reads a stage's input and writes its output
  // (and their gradients); null: host memory, the engine's own.
  virtual std::shared_ptr<float> stage_buffer(int64_t /*n*/) { return nullptr; }
  // A communicator over the ranks of `host` (a pipeline or tensor-parts
  // group) that reaches that memory; null: none (the host's serves).
  // Collective over host's ranks.
  virtual std::unique_ptr<comm::Communicator> device_communicator(comm::Communicator& /*host*/) { return nullptr; }
  // Before a transfer of model buffers over that communicator: the kernels
  // queued so far (which write what goes, or still read what an arrival
  // overwrites) have finished.
  virtual void before_device_transfer() {}
  // Tensor parts with the optimizer states on the device: the gradient a
  // block's update reads, in device memory, its first element the state
  // range's first (the block's, or the rank's shard's), for the all-reduce
  // of the gradients every part sums (null: the host's, the engine's own);
  // and, per block, the ranges of flat elements whose squares the norm
  // counts on this part (a parameter every part holds whole: on part 0).
  virtual float* update_grads(int /*block*/) { return nullptr; }
  // Per block, the flat ranges whose parameters weight decay passes by
  // (OptimizerConfig::decay_vectors false), for an update on the device.
  virtual void set_no_decay(std::vector<std::vector<std::pair<int64_t, int64_t>>> /*ranges*/) {}
  virtual void set_norm_ranges(std::vector<std::vector<std::pair<int64_t, int64_t>>> /*ranges*/) {}

  // ---- the step ----
  // This rank's sum of squared gradients where the device holds them
  // (false: the host's reduced gradients are summed).
  virtual bool grad_squared_norm(double& /*sum*/) { return false; }
  // Whether the device updates this block (update()) and the host update
  // passes it by.
  virtual bool block_on_device(int /*block*/) const { return false; }
  // Applies the AdamW update where the device holds the optimizer states
  // (false: the host updates, between before_host_update and after_gather).
  virtual bool update(const optim::AdamParams& /*adam*/, int64_t /*step*/, float /*grad_scale*/) { return false; }
  // Lamb where the device holds the optimizer states (LambRule::
  // apply_on_device, Note [Lamb arithmetic] in optim/detail/lamb_math.h).
  // Pass 1 adds each tensor's sums of w^2 and u^2 over this rank's states
  // into `sums`, segs(block, offset, count) giving the segments of a
  // block's state range [offset, offset + count) (false: the host holds the
  // states, nothing done); the caller adds the sums over ranks. Pass 2 is
  // the update with the tensors' trust ratios, and what follows it as
  // update()'s.
  using LambSegmentsFn = std::function<std::vector<optim::LambSegment>(int block, int64_t offset, int64_t count)>;
  virtual bool lamb_norms(const optim::LambParams& /*p*/, float /*grad_scale*/, const LambSegmentsFn& /*segs*/,
                          double* /*sums*/) {
    return false;
  }
  virtual void lamb_update(const optim::LambParams& /*p*/, int64_t /*step*/, float /*grad_scale*/,
                           const double* /*ratios*/) {}
  // Around the host update: before the coordinator's before_update, after
  // each block's update (and each block a load has read), after all, and
  // after the coordinator's gather.
  virtual void before_host_update() {}
  virtual void block_updated(int /*block*/) {}
  virtual void after_host_update() {}
  virtual void after_gather() {}
  // Stages 1-2 on several ranks: what runs on the coordinator's gather
  // thread as each block's all-gather after the update arrives, while the
  // update goes on (ParamCoordinator::stream_next_gather; empty: the
  // gather waits for the whole update, and after_gather follows it).
  virtual std::function<void(int)> gathered_hook() { return {}; }
  // After the reducer's reset, at the end of every step.
  virtual void after_step() {}
  // ---- the host update behind the next forward (Note [the update behind
  // the forward] in gpu_offload.cpp) ----
  // Runs `update` (the host update and what follows it up to after_gather)
  // on a thread of the device path's own and returns true; the next
  // forward's on_acquire(block) waits for the block's block_updated. False:
  // not here (the engine runs it itself, now).
  virtual bool start_update_behind(std::function<void()> /*update*/) { return false; }
  // Waits for that update (nothing in flight: returns at once); rethrows
  // its error.
  virtual void finish_update_behind() {}
  // Seconds such updates have run, and seconds the engine's thread waited
  // for them (at an acquire or finish_update_behind), since the start; an
  // update's run counts from the finish_update_behind that settles it.
  virtual void update_behind_seconds(double& /*ran*/, double& /*waited*/) const {}

  // ---- checkpoints and reads ----
  // Before a save reads the host's optimizer states.
  virtual void states_to_host() {}
  // Around a load: before the coordinator's before_update; after the states
  // are read; after the coordinator's gather.
  virtual void before_load() {}
  virtual void after_load_states() {}
  virtual void after_load_gather() {}
  // Before full_params reads a block's master weights from the host.
  virtual void master_to_host(int /*block*/) {}
  // full_params of a frozen block (LoRA's base): `bytes` of the compute
  // parameters an acquire gave (p, after on_acquire) into host memory, where
  // they live on the device (false: p.base is host memory).
  virtual bool params_to_host(const BlockParams& /*p*/, void* /*host*/, size_t /*bytes*/) { return false; }

  // Waits for the device's work (the engine's shutdown); logs failures.
  virtual void shutdown() noexcept {}
  // Bytes of device memory held for model state now and at most so far.
  virtual int64_t bytes() const { return 0; }
  virtual int64_t peak_bytes() const { return 0; }
};

// offload_optimizer.ratio below 1 (Note [a share of the states on the GPU]
// in gpu_offload.cpp): per block (trained parameters, 0 for a frozen one),
// whether its optimizer states live on the GPU: the longest prefix whose
// parameters are at most 1 - ratio of them all (memory_estimate.cpp asks too).
std::vector<char> gpu_state_blocks(const std::vector<int64_t>& trained_numel, double ratio);

// The CPU's DevicePath, or (c.device cuda) GpuOffload: collective on
// several ranks (the GPU's communicator starts here), so every rank calls it
// at the same point.
std::unique_ptr<DevicePath> make_device_path(const Config& c, comm::Communicator* comm, int world, int rank,
                                             DType dtype);

}  // namespace zinc
