// The GPU path of the engine as one component (gpu_offload.h).
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
//   (block_updated); at stages 1-2 on several ranks each block goes
//   up on the copy stream, from the gather thread, as soon as its bucket's
//   all-gather has brought it, the buckets starting as the update finishes
//   their blocks (gathered_hook; Note [the gather streamed behind the
//   update] in param_coordinator.cpp), so that update too can run behind
//   the forward; at stage 3 the next acquire uploads it.
// With offload_optimizer "none" the states live on the GPU instead
// (DeviceMirror::enable_states; the rank's shard on several ranks):
// gradients stay there (on several ranks reduce-scattered into the shard),
// the norm is kernels::cuda::squared_norm's (summed over ranks on the host),
// optim::adam_step_cuda updates master, m, v and writes the compute
// parameters in place (on several ranks the rank's shard, then
// gather_params all-gathers the shards on the GPU), and the host
// OptimizerState is only refreshed for checkpoints and full_params. Its
// arithmetic is the CPU AdamW's (optim/detail/adam_update.h), so without
// clipping the two modes give the same weights.
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
// limits. On one rank with the shards in RAM (offload_param "cpu") a
// block's gather is its upload: the shard is the whole block, page-locked
// and registered, and the coordinator's gather stream copies it straight
// into the GPU's parameters (start_upload_gathers), so the trace's prefetch
// brings the next blocks up while the current one computes, within the
// stage3_* limits, with no copy in RAM. With the shards on NVMe the gathers
// are the host's: acquire uploads the gathered block
// (through page-locked staging on an upload stream of its own) and the GPU
// copy goes when the coordinator frees the host one (drop_freed_params). On
// several ranks with the shards in RAM each rank's compute shard also lives
// on the GPU (uploaded after every update and load) and the coordinator's
// gathers are all-gathers on the GPU, on the reductions' stream
// (start_device_gathers, ParamCoordinator::DeviceGather); a block's GPU copy
// comes and goes with the gather. Either way the stage3_* limits bound the
// GPU's parameters. From stage 2 the GPU accumulators exist only from a
// global batch's first backward to its reduction or copy (MirrorOptions), as
// the host's full gradients at stage 2. GPU-resident states at stage 3 keep
// the rank's shard of master, m, v (and the reduced gradient shard) on the
// GPU; the update writes the new compute shard to the GPU shard (with device
// gathers) and sends it down to the coordinator's host shard, and the blocks
// are gathered as above.
//
// Note [the update behind the forward]
// With ZeRO-Offload the CPU's AdamW is a large part of the step, and the
// GPU idles through it. Its arithmetic cannot start before backward ends:
// the clip coefficient needs every gradient's norm. But the next forward
// need not wait for all of it: block b's forward needs block b's new
// parameters only. So where each block's host compute copy is complete once
// its own update is (stage 0, or one rank; not stage 3), step() hands the
// host update to a thread of this path's own (start_update_behind) and
// returns. The update visits the blocks in index order, the forward's
// order; block_updated(b) queues b's upload on the copy stream and marks b
// ready; the next forward's on_acquire(b) waits for that mark, so block b's
// kernels run on the GPU while the CPU updates the blocks after it. The
// uploads wait only for the last backward's kernels (fence_param_reads),
// not for the forward queued since. Nothing else reads what the update
// writes before the engine settles it (Engine::Impl::settle_update): at the
// next backward (whose gradient copies land in the buffers the update
// reads), a checkpoint, an evaluation, full_params, and the engine's end.
// The update's arithmetic, and so the weights, are those of the update run
// in place, bit for bit. ZINC_GPU_UPDATE_BEHIND=0 runs it in place.
//
// Note [the norm on the GPU]
// Clipping needs the global norm of the gradients before any update. With
// ZeRO-Offload on one rank (no model parallelism, whose norm has rules of
// its own) it is taken on the GPU: at the boundary, grads_ready has the GPU
// sum each block's squares (note_grad_squares) before its accumulator is
// copied down and zeroed or freed, and the step adds them in block order
// (noted_grad_squared_norm). That is the arithmetic of the states wholly on
// the GPU (grad_squared_norm), on the same values, so ZeRO-Offload and
// GPU-resident AdamW give the same clip coefficient and, since the two
// AdamWs agree, the same weights bit for bit; and the host no longer reads
// every gradient once more for the norm before the update reads them
// (at the 355M GPT, about 1.4 GB).
//
// Note [a share of the states on the GPU]
// DeepSpeed's offload_optimizer.ratio (ZeRO-Offload++) is the share of the
// optimizer states offloaded; the rest live on the GPU and are updated
// there. zinc gives the GPU a prefix of the blocks in the forward's order
// (gpu_state_blocks: the longest one whose trained parameters fit in 1 -
// ratio of them), for two reasons. The forward needs those blocks first,
// and the GPU updates them at once, so the next forward starts on them
// while the CPU updates the rest behind it (Note [the update behind the
// forward]). And a whole block keeps one place for its states, its norm
// and its checkpoint spans. Those blocks' gradients never leave the GPU:
// their squares join the others' on the GPU (Note [the norm on the GPU]),
// the host update skips them (block_on_device), the GPU's AdamW, whose arithmetic is the CPU's
// (optim/detail/adam_update.h), updates them and writes their parameters
// in place, and their accumulators are zeroed after the step. The host's
// OptimizerState keeps a copy of every block's states for checkpoints and
// full_params, refreshed from the GPU before either reads it, as with the
// states wholly on the GPU. The weights are those of ratio 1 bit for bit,
// clipped or not. It costs the GPU 12 bytes per
// parameter of its blocks (master, m, v) and keeps their 4-byte gradient
// accumulators from one step to the next. At stage 3 the GPU's update
// writes the block's host shard, which the next gather uploads, as with
// the states wholly on the GPU. One rank, AdamW (Config::validate refuses
// the rest).
#include "engine/gpu_offload.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/device_mirror.h"

namespace zinc {
namespace {

class CpuPath final : public DevicePath {};

class GpuOffload final : public DevicePath {
 public:
  GpuOffload(const Config& c, comm::Communicator* comm, int world, int rank, DType dtype)
      : cfg_(c), world_(world), rank_(rank), dtype_(dtype), gplan_(GpuPlan::make(c, world)),
        states_(c.zero.offload_optimizer.device == OffloadDevice::kNone),
        noted_norms_(!states_ && world == 1 && !c.pipelined() && !c.tensor_split() && !c.expert_split()) {
    const int dev = use_cuda_device(comm ? comm->local_rank() : 0);
    device_index_ = dev;
    if (rank == 0 || world <= 8) log_info("rank " + std::to_string(rank) + " computes on GPU " + std::to_string(dev));
    // More ranks on this machine than GPUs: they share them (local rank
    // modulo the GPUs), which runs but halves each one's memory and speed,
    // and NCCL refuses two ranks on one GPU (its collectives then stay in
    // host memory, or the run stops where it needs them on the GPU).
    if (comm && comm->local_rank() == 0 && comm->local_size() > cuda_status().devices)
      log_warn(std::to_string(comm->local_size()) + " ranks on this machine share " +
               std::to_string(cuda_status().devices) + " visible GPU(s): a GPU computes for several ranks, which "
               "NCCL does not take; start one rank per GPU (mpirun -np <GPUs>) or set CUDA_VISIBLE_DEVICES per rank");
    if (world > 1) make_gpu_reduction(*comm, dev);
  }

  // Note [pipeline stages on the GPU] in pipeline.cpp.
  std::shared_ptr<float> stage_buffer(int64_t n) override {
    ZINC_CHECK(gpu_, "GPU path: a stage buffer before the mirror exists");
    return gpu_->alloc_floats(n);
  }
  std::unique_ptr<comm::Communicator> device_communicator(comm::Communicator& host) override {
    try {
      return comm::make_nccl_communicator(host, device_index_);
    } catch (const Error& e) {
      throw Error(std::string("pipeline stages, tensor parts and sequence ranks on the GPU exchange activations over NCCL, which did "
                              "not start: ") + e.what());
    }
  }
  void before_device_transfer() override {
    if (gpu_) gpu_->sync_compute();
  }
  float* update_grads(int block) override { return states_ ? gpu_->state_grads(block) : nullptr; }
  void set_norm_ranges(std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges) override {
    if (states_) gpu_->set_norm_ranges(std::move(ranges));
  }
  void set_no_decay(std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges) override {
    gpu_->set_no_decay(std::move(ranges));  // the blocks whose states are on the GPU use them
  }

  void configure_reducer(GradReducer::Options& o) override {
    // GPU-resident states on one rank: the gradients stay on the GPU.
    o.host_grads = gplan_.host_grads;
    o.model_grads = false;  // the GPU's gradients are copied into the host buffers
    if (reduce_)
      o.device_reduce = [this](comm::Communicator& c, int block, float* shard_out) {
        // GPU-resident states keep the reduced shard on the GPU.
        gpu_->device_reduce(c, block, blocks()[static_cast<size_t>(block)].part.shard_numel,
                            states_ ? nullptr : shard_out);
      };
  }
  comm::CommStream* reduce_stream() const override { return reduce_ ? reduce_stream_.get() : nullptr; }

  void attach(const DeviceContext& ctx) override {
    ctx_ = ctx;
    std::vector<int64_t> padded;
    MirrorOptions mo = gplan_.mirror;
    for (const BlockShard& s : blocks()) {
      padded.push_back(s.part.padded_numel);
      mo.frozen.push_back(s.frozen);
    }
    gpu_ = DeviceMirror::make(padded, dtype_, mo);
    stale_.assign(blocks().size(), 1);
    if (reduce_) {
      int64_t max_shard = 0;
      for (const BlockShard& s : blocks()) max_shard = std::max(max_shard, s.part.shard_numel);
      // Stage 0's GPU-resident states update whole blocks: the reduced
      // shards come back into the full accumulator there.
      gpu_->enable_device_reduce(cfg_.wire_dtype(), max_shard, states_ && plan().optimizer_spans_block);
    }
    // The host compute copies the CPU update writes are page-locked, so
    // that each block's upload overlaps the update of the next. (Stage
    // 3's gathered copies come and go; its uploads go through the mirror's
    // own page-locked staging.)
    if (!states_ && !plan().params_sharded)
      for (BlockShard& s : blocks())
        if (!s.compute.empty()) gpu_->register_host(s.compute.data(), s.compute.bytes());
    if (states_) {
      // GPU-resident states: the initial master weights go up once; m
      // and v start at zero there as here.
      if (world_ > 1 && !reduce_)
        throw Error("GPU-resident optimizer states on several ranks need the reduction on the GPU (NCCL), "
                    "which did not start (see the warning above); set "
                    "zero_optimization.offload_optimizer.device to \"cpu\" (ZeRO-Offload)");
      std::vector<int64_t> numel, offset;
      for (const BlockShard& s : blocks()) {
        numel.push_back(s.opt_numel);
        offset.push_back(state_offset(s));
      }
      gpu_->enable_states(numel, offset);
      ctx_.opt_state->for_each([&](const StateSpan& sp) {
        gpu_->upload_states(sp.block, sp.offset, sp.count, sp.master, nullptr, nullptr);
      });
    }
    if (!states_ && cfg_.zero.offload_optimizer.ratio < 1.0) start_partial_states();
    if (reduce_ && gplan_.device_gathers) start_device_gathers();
    if (gplan_.upload_gathers) start_upload_gathers();
  }

  void make_current() override { gpu_->make_current(); }

  void on_acquire(int block, BlockParams& p) override {
    if (behind_) wait_updated(block);
    if (device_gathers_) {  // gathered on the GPU by the coordinator
      p.base = gpu_->params(block);
      return;
    }
    drop_freed_params();  // making room may have freed others
    if (stale_[static_cast<size_t>(block)] || !gpu_->has_params(block)) {
      gpu_->upload_params(block, p.base);
      stale_[static_cast<size_t>(block)] = 0;
    }
    p.base = gpu_->params(block);
  }
  void on_release() noexcept override { drop_freed_params(); }
  float* grads(int block) override { return gpu_->grads(block); }
  bool grads_ready(int block, bool boundary) override {
    if (boundary && noted_norms_) gpu_->note_grad_squares(block);  // Note [the norm on the GPU]
    if (boundary && on_gpu(block)) {  // a share of the states on the GPU: the gradient stays there
      ctx_.reducer->ready(block);
      return true;
    }
    if (boundary && reduce_) {
      gpu_->start_device_reduce(block);
      ctx_.reducer->ready(block);
      return true;
    }
    if (boundary && !states_) {
      gpu_->start_grads_copy(block);
      copies_.push_back(block);
      hand_over_grads(/*wait=*/false);
      return true;
    }
    return false;
  }
  void end_backward() override { hand_over_grads(/*wait=*/true); }

  bool grad_squared_norm(double& sum) override {
    if (noted_norms_) {
      sum = gpu_->noted_grad_squared_norm();
      return true;
    }
    if (!states_) return false;
    sum = gpu_->grad_squared_norm();
    return true;
  }
  bool update(const optim::AdamParams& adam, int64_t step, float grad_scale) override {
    if (!states_) {  // the GPU's share of the states now; the host updates the rest
      if (!partial_) return false;
      // Stage 3: the new compute values go to the block's host shard (or
      // its NVMe write buffer), from where the next gather uploads them.
      ParamCoordinator* params = plan().params_sharded ? ctx_.params : nullptr;
      if (params) params->before_update();
      for (int b = 0; b < static_cast<int>(blocks().size()); ++b) {
        if (!on_gpu(b)) continue;
        gpu_->adam_step(b, adam, step, grad_scale, params ? params->shard_to_update(b) : nullptr);
        if (params) params->finish_update(b);
      }
      return false;
    }
    update_states([&](int b, void* host_out) { gpu_->adam_step(b, adam, step, grad_scale, host_out); });
    return true;
  }

  bool lamb_norms(const optim::LambParams& p, float grad_scale, const LambSegmentsFn& segs, double* sums) override {
    // A share of the states on the GPU runs AdamW only (the config refuses Lamb there).
    ZINC_CHECK(!partial_, "Lamb with a share of the optimizer states on the GPU");
    if (!states_) return false;
    lamb_segs_.assign(blocks().size(), {});
    for (size_t b = 0; b < blocks().size(); ++b) {
      const BlockShard& s = blocks()[b];
      if (s.opt_numel == 0) continue;  // frozen: no states
      lamb_segs_[b] = segs(static_cast<int>(b), state_offset(s), s.opt_numel);
      gpu_->lamb_norms(static_cast<int>(b), p, grad_scale, lamb_segs_[b], sums);
    }
    return true;
  }
  void lamb_update(const optim::LambParams& p, int64_t step, float grad_scale, const double* ratios) override {
    ZINC_CHECK(states_ && lamb_segs_.size() == blocks().size(), "Lamb's update on the GPU before its norms");
    update_states([&](int b, void* host_out) {  // a frozen block's empty range as adam_step's
      gpu_->lamb_step(b, p, step, grad_scale, lamb_segs_[static_cast<size_t>(b)], ratios, host_out);
    });
  }

  // Where a block's GPU-resident states start in it (attach's offsets).
  int64_t state_offset(const BlockShard& s) const { return plan().optimizer_spans_block ? 0 : s.part.own_offset(); }

  // GPU-resident states: step(b, host_out) updates block b, then what
  // follows the update. Stage 3: each block's new compute shard goes back
  // to the host (or its NVMe write buffer), and with device gathers to the
  // GPU shard, from where the coordinator gathers it. Several ranks below
  // stage 3: every rank's new compute shards, all-gathered on the GPU in
  // block order (before the next forward reads them).
  template <class Step>
  void update_states(Step&& step) {
    const int n = static_cast<int>(blocks().size());
    if (plan().params_sharded) {
      ParamCoordinator& params = *ctx_.params;
      params.before_update();
      for (int b = 0; b < n; ++b) {
        step(b, params.shard_to_update(b));
        params.finish_update(b);
      }
      stale_.assign(blocks().size(), 1);
      params.gather_after_step();
      drop_freed_params();
      return;
    }
    for (int b = 0; b < n; ++b) step(b, nullptr);
    if (reduce_ && !plan().optimizer_spans_block)
      reduce_stream_->submit([this, n](comm::Communicator& c) {
        for (int b = 0; b < n; ++b) gpu_->gather_params(c, b);
      }).wait();
  }
  void before_host_update() override {
    gather_hooked_ = false;
    gpu_->wait_uploads();  // the last step's uploads have read the host copies
    // block_updated clears what it uploads; below stage 3 the GPU's share of
    // the states wrote its parameters there (update), and its host copy is
    // stale (at stage 3 the update wrote the host shard, which goes up).
    for (size_t b = 0; b < blocks().size(); ++b)  // a frozen block never changes: its upload stays
      stale_[b] = !blocks()[b].frozen && (plan().params_sharded || !on_gpu(static_cast<int>(b)));
  }
  bool block_on_device(int block) const override { return on_gpu(block); }
  // ZeRO-Offload: a block whose host compute copy is complete once its own
  // update is (stage 0, or one rank: no all-gather to wait for) goes up at
  // once, on the copy stream, while the CPU updates the next; otherwise
  // after_gather or the next acquire uploads it. (Stage 3's host copy,
  // where there is one, is the old gathered block: the next acquire uploads
  // the new one.)
  void block_updated(int b) override {
    if (!uploads_after_update()) return;
    BlockShard& s = blocks()[static_cast<size_t>(b)];
    const void* host = !s.compute.empty() ? s.compute.data() : static_cast<const void*>(s.master_compute);
    if (host) {
      gpu_->upload_params_async(b, host);
      stale_[static_cast<size_t>(b)] = 0;
    }
    if (behind_) mark_updated(b);
  }
  // Note [the update behind the forward].
  bool start_update_behind(std::function<void()> update) override {
    if (!behind_allowed_ || !(uploads_after_update() || gather_hooked_)) return false;
    if (!behind_stream_) {
      behind_comm_ = comm::make_single_communicator();
      behind_stream_ = std::make_unique<comm::CommStream>(*behind_comm_);
    }
    {
      std::lock_guard<std::mutex> lock(behind_mu_);
      updated_.assign(blocks().size(), 0);
      for (size_t b = 0; b < blocks().size(); ++b)  // no host update to wait for
        updated_[b] = blocks()[b].frozen || on_gpu(static_cast<int>(b));
      behind_done_ = false;
      behind_error_.clear();
    }
    gpu_->fence_param_reads(true);
    behind_ = true;
    behind_job_ = behind_stream_->submit([this, update = std::move(update)](comm::Communicator&) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        gpu_->make_current();  // this thread's CUDA calls go to the engine's GPU
        update();
      } catch (const std::exception& e) {
        end_behind(t0, e.what());
        throw;
      } catch (...) {  // every way out marks the end, or an acquire would wait for ever
        end_behind(t0, "an exception that is not a std::exception");
        throw;
      }
      end_behind(t0, "");
    });
    return true;
  }
  void finish_update_behind() override {
    if (!behind_) return;
    behind_ = false;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      behind_job_.wait();
    } catch (...) {
      count_wait(t0, true);
      gpu_->fence_param_reads(false);
      throw;
    }
    count_wait(t0, true);
    gpu_->fence_param_reads(false);
  }
  void update_behind_seconds(double& ran, double& waited) const override {
    std::lock_guard<std::mutex> lock(behind_mu_);
    ran = behind_ran_s_;
    waited = behind_wait_s_;
  }
  void after_host_update() override {
    if (device_gathers_ && !upload_gathers_) upload_shards();
  }
  // Stages 1-2 on several ranks: once the all-gather has brought every
  // rank's new shards, each block goes up on the copy stream from its
  // page-locked host copy, all of them queued now, so the next forward's
  // first blocks wait only for their own upload and the rest overlap its
  // kernels (at the acquire, an upload on the compute stream would wait for
  // every kernel before it).
  void after_gather() override {
    drop_freed_params();
    if (states_ || !plan().gather_params_after_step) return;
    for (size_t b = 0; b < blocks().size(); ++b) {
      if (!stale_[b] || blocks()[b].compute.empty()) continue;
      gpu_->upload_params_async(static_cast<int>(b), blocks()[b].compute.data());
      stale_[b] = 0;
    }
  }
  // Stages 1-2 on several ranks, ZeRO-Offload (Note [the gather streamed
  // behind the update] in param_coordinator.cpp): each block goes up on the
  // copy stream as soon as its bucket's all-gather is in, from the gather
  // thread, while the host updates and gathers the blocks after it; with
  // the update behind the forward, block b's forward waits for that alone.
  // The engine's thread reads stale_[b] after wait_updated(b), or after the
  // step's gather has ended.
  std::function<void(int)> gathered_hook() override {
    if (states_ || partial_ || !plan().gather_params_after_step) return {};
    gather_hooked_ = true;
    return [this](int b) {
      BlockShard& s = blocks()[static_cast<size_t>(b)];
      if (stale_[static_cast<size_t>(b)] && !s.compute.empty()) {
        gpu_->make_current();  // the gather thread's CUDA calls go to the engine's GPU
        gpu_->upload_params_async(b, s.compute.data());
        stale_[static_cast<size_t>(b)] = 0;
      }
      if (behind_) mark_updated(b);
    };
  }
  void after_step() override {
    if (states_ || partial_) gpu_->zero_grads();  // the accumulators of the blocks whose states are here
  }

  // GPU-resident states: the host OptimizerState is their copy for
  // checkpoints and full_params, refreshed from the GPU before either reads it.
  void states_to_host() override {
    if (!states_ && !partial_) return;
    ctx_.opt_state->for_each([&](const StateSpan& sp) {
      if (states_ || on_gpu(sp.block)) gpu_->download_states(sp.block, sp.offset, sp.count, sp.master, sp.m, sp.v);
    });
  }
  void before_load() override { gpu_->wait_uploads(); }
  void after_load_states() override {
    if (device_gathers_ && !upload_gathers_) {
      ctx_.params->before_update();  // no gather in flight reads the GPU shards
      upload_shards();
    }
    // The GPU states before the gathers start (their synchronous copies
    // would otherwise wait for the gathers in flight).
    if (states_ || partial_)
      ctx_.opt_state->for_each([&](const StateSpan& sp) {
        if (states_ || on_gpu(sp.block)) gpu_->upload_states(sp.block, sp.offset, sp.count, sp.master, sp.m, sp.v);
      });
  }
  void after_load_gather() override {
    stale_.assign(blocks().size(), 1);
    drop_freed_params();
  }
  bool params_to_host(const BlockParams& p, void* host, size_t bytes) override {
    gpu_->make_current();
    gpu_->read_back(p.base, host, bytes);  // after the acquire's upload or gather
    return true;
  }
  void master_to_host(int block) override {
    if (!states_ && !on_gpu(block)) return;
    if (float* hm = ctx_.opt_state->master_in_memory(block))
      gpu_->download_states(block, 0, blocks()[static_cast<size_t>(block)].opt_numel, hm, nullptr, nullptr);
    else
      states_to_host();
  }

  void shutdown() noexcept override {
    if (behind_) {
      try {
        finish_update_behind();
      } catch (const std::exception& e) {
        log_error(std::string("engine shutdown: the last optimizer update failed: ") + e.what());
      }
    }
    if (gpu_) {
      try {
        gpu_->synchronize();
      } catch (const std::exception& e) {
        log_error(std::string("engine shutdown: the GPU failed: ") + e.what());
      }
    }
    if (reduce_stream_) {
      try {
        reduce_stream_->synchronize();
      } catch (const std::exception& e) {
        log_error(std::string("engine shutdown: a collective failed: ") + e.what());
      }
    }
  }
  int64_t bytes() const override { return gpu_ ? gpu_->bytes() : 0; }
  int64_t peak_bytes() const override { return gpu_ ? gpu_->peak_bytes() : 0; }

 private:
  std::vector<BlockShard>& blocks() { return *ctx_.blocks; }
  const StagePlan& plan() const { return *ctx_.plan; }

  // Collective (every rank, at the same point): the communicator and stream
  // of the reductions on the GPU (NCCL). Where NCCL cannot start, the host
  // reduction stays.
  void make_gpu_reduction(comm::Communicator& comm, int device) {
    // The mirror's GPU (a rank that sees one GPU of its own under a
    // per-rank CUDA_VISIBLE_DEVICES uses device 0). Every rank agrees
    // before NCCL starts (make_nccl_communicator), so all fall back together.
    try {
      comm_ = comm::make_nccl_communicator(comm, device);
    } catch (const Error& e) {  // no GPU for it, or no libnccl
      if (rank_ == 0) log_warn(std::string("NCCL did not start (") + e.what() + ")");
      comm_.reset();
    }
    if (!comm_) {
      if (rank_ == 0)
        log_warn("no second communicator over " + comm.backend() +
                 ": gradients are reduced in host memory, not on the GPU");
      return;
    }
    reduce_stream_ = std::make_unique<comm::CommStream>(*comm_);
    reduce_ = true;
    if (rank_ == 0) log_info("gradients are reduced on the GPU over " + comm_->backend());
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
    for (const BlockShard& s : blocks()) shard.push_back(s.part.shard_numel);
    gpu_->enable_param_shards(shard);
    upload_shards();
    ParamCoordinator::DeviceGather g;
    g.stream = reduce_stream_.get();
    g.begin = [this](int b) { gpu_->begin_gather(b); };
    g.gather = [this](comm::Communicator& c, int b) { gpu_->gather_block(c, b); };
    g.end = [this](int b) { gpu_->drop_params(b); };
    ctx_.params->use_device_gather(std::move(g));
    ctx_.memory->release_kept();  // the persistent blocks' RAM copies: no RAM gather comes again
    device_gathers_ = true;
    if (rank_ == 0) log_info("ZeRO-3: parameters are gathered on the GPU over " + comm_->backend());
  }
  // Stage 3 on one rank with the shards in page-locked RAM: a block's
  // gather is its upload from the shard (the whole block), run by the
  // coordinator on its gather stream's thread, so the trace's prefetch and
  // the stage3_* limits apply to the uploads: the next blocks come up while
  // the current one computes, and the GPU holds what the coordinator counts
  // live. No gathered copy in RAM and no staging copy: one DMA per block.
  void start_upload_gathers() {
    for (BlockShard& s : blocks()) {
      ZINC_CHECK(s.part.shard_numel == s.part.padded_numel && s.own_compute(),
                 "stage 3 on one rank: each block's shard is the whole block, in RAM");
      gpu_->register_host(s.own_compute(), static_cast<size_t>(s.part.shard_numel) * dtype_bytes(dtype_));
    }
    gpu_->enable_host_gathers();
    ParamCoordinator::DeviceGather g;  // no stream: the coordinator's own gather stream
    g.begin = [this](int b) { gpu_->begin_gather(b); };
    g.gather = [this](comm::Communicator&, int b) {
      gpu_->load_block(b, blocks()[static_cast<size_t>(b)].own_compute());
    };
    g.end = [this](int b) { gpu_->drop_params(b); };
    ctx_.params->use_device_gather(std::move(g));
    ctx_.memory->release_kept();  // the persistent blocks' RAM copies: no RAM gather comes again
    device_gathers_ = upload_gathers_ = true;
    log_info("ZeRO-3: each block's gather is its upload from page-locked RAM, prefetched along the trace");
  }
  void upload_shards() {
    for (size_t b = 0; b < blocks().size(); ++b)
      gpu_->upload_shard(static_cast<int>(b), blocks()[b].own_compute());
  }

  // Stage 3 on the GPU: a block's GPU parameters go when the coordinator
  // frees its host copy (at a release, or making room, or after the step),
  // so the GPU holds the blocks the coordinator holds gathered: the
  // stage3_* limits bound both.
  void drop_freed_params() noexcept {
    if (!plan().params_sharded) return;
    for (size_t b = 0; b < blocks().size(); ++b)
      if (blocks()[b].param_state == ParamState::kSharded && gpu_->has_params(static_cast<int>(b)))
        gpu_->drop_params(static_cast<int>(b));
  }

  // Note [a share of the states on the GPU]: blocks [0, k) in the forward's
  // order keep master, m and v on the GPU (DeviceMirror::enable_states for
  // them alone), the rest stay offloaded.
  void start_partial_states() {
    const double ratio = cfg_.zero.offload_optimizer.ratio;
    ZINC_CHECK(world_ == 1, "offload_optimizer.ratio below 1: one rank");
    std::vector<int64_t> trained;
    for (const BlockShard& s : blocks()) trained.push_back(s.frozen ? 0 : s.opt_numel);
    gpu_states_ = gpu_state_blocks(trained, ratio);
    std::vector<int64_t> numel, offset;
    int64_t here = 0, all = 0;
    for (size_t b = 0; b < blocks().size(); ++b) {
      ZINC_CHECK(trained[b] == 0 || trained[b] == blocks()[b].part.padded_numel, "one rank: the states span the block");
      numel.push_back(gpu_states_[b] ? trained[b] : 0);
      offset.push_back(0);
      here += numel.back();
      all += trained[b];
      partial_ = partial_ || gpu_states_[b];
    }
    char share[64], r[32];
    std::snprintf(share, sizeof share, "%.1f%%", all > 0 ? 100.0 * static_cast<double>(here) / all : 0.0);
    std::snprintf(r, sizeof r, "%g", ratio);
    if (!partial_) {
      log_warn(std::string("zero_optimization.offload_optimizer.ratio ") + r +
               ": the first block's states are more than the GPU's share, so every block's are offloaded");
      return;
    }
    gpu_->enable_states(numel, offset);
    ctx_.opt_state->for_each([&](const StateSpan& sp) {
      if (on_gpu(sp.block)) gpu_->upload_states(sp.block, sp.offset, sp.count, sp.master, nullptr, nullptr);
    });
    int last = 0;
    while (last + 1 < static_cast<int>(gpu_states_.size()) && gpu_states_[static_cast<size_t>(last + 1)]) ++last;
    log_info(std::string("offload_optimizer.ratio ") + r + ": blocks 0-" + std::to_string(last) +
             " keep their optimizer states on the GPU (" + share + " of the trained parameters), the rest are " +
             "offloaded");
  }
  bool on_gpu(int block) const { return partial_ && gpu_states_[static_cast<size_t>(block)]; }

  // ZeRO-Offload: each block's host compute copy is complete once its own
  // update is (stage 0, or one rank: no all-gather to wait for), so it goes
  // up at block_updated.
  bool uploads_after_update() const {
    return !states_ && !plan().params_sharded && (plan().optimizer_spans_block || world_ == 1);
  }

  // ---- the update behind the forward ----
  // The update's thread: block b's new parameters are queued for upload.
  void mark_updated(int b) {
    {
      std::lock_guard<std::mutex> lock(behind_mu_);
      updated_[static_cast<size_t>(b)] = 1;
    }
    behind_cv_.notify_all();
  }
  // The update's thread, at its end (error: empty when it succeeded).
  void end_behind(std::chrono::steady_clock::time_point t0, const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(behind_mu_);
      behind_done_ = true;
      behind_error_ = error;
      behind_last_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    behind_cv_.notify_all();
  }
  // The engine's thread. settled: the update has ended and is counted now,
  // so that update_behind_seconds moves with the engine's calls (the update
  // of step k in the call that settles it), never with the thread's timing.
  void count_wait(std::chrono::steady_clock::time_point t0, bool settled = false) {
    std::lock_guard<std::mutex> lock(behind_mu_);
    behind_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (settled) behind_ran_s_ += std::exchange(behind_last_s_, 0.0);
  }
  // The engine's thread: waits until block b's update is done.
  void wait_updated(int b) {
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(behind_mu_);
    const auto ready = [&] { return updated_[static_cast<size_t>(b)] != 0 || behind_done_; };
    if (!ready()) {
      behind_cv_.wait(lock, ready);
      behind_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    if (!updated_[static_cast<size_t>(b)] && !behind_error_.empty())
      throw Error("block " + std::to_string(b) + " was not updated: the last step's optimizer update failed: " +
                  behind_error_);
  }

  // Blocks whose gradient copies have finished (all of them with wait) go
  // to the GradReducer, in the order the model reported them.
  void hand_over_grads(bool wait) {
    while (!copies_.empty() && (wait || gpu_->grads_copied(copies_.front()))) {
      const int b = copies_.front();
      gpu_->finish_grads_copy(b, ctx_.reducer->grads(b));
      ctx_.reducer->ready(b);
      copies_.pop_front();
    }
  }

  const Config& cfg_;
  const int world_, rank_;
  const DType dtype_;
  const GpuPlan gplan_;  // what the GPU keeps where (also --estimate's)
  const bool states_;    // offload_optimizer "none": master, m, v on the GPU (the rank's span)
  // ZeRO-Offload on one rank without model parallelism: the norm is the
  // GPU's (Note [the norm on the GPU]).
  const bool noted_norms_;
  // offload_optimizer.ratio below 1 (Note [a share of the states on the
  // GPU]): the blocks whose states are on the GPU, and whether there are any.
  std::vector<char> gpu_states_;
  bool partial_ = false;
  DeviceContext ctx_;
  std::unique_ptr<DeviceMirror> gpu_;
  int device_index_ = 0;  // the GPU this rank computes on
  // Several ranks: gradients reduced on the GPU, over a communicator that
  // reaches GPU memory (NCCL), on a stream of their own; only the rank's
  // shard comes back to the host.
  bool reduce_ = false;
  std::unique_ptr<comm::Communicator> comm_;
  std::unique_ptr<comm::CommStream> reduce_stream_;
  // Stage 3 on several ranks (start_device_gathers): the parameter gathers
  // run on the GPU, on the reductions' stream.
  bool device_gathers_ = false;
  // Stage 3 on one rank (start_upload_gathers): those gathers are uploads
  // from the page-locked shards, on the coordinator's gather stream.
  bool upload_gathers_ = false;
  std::vector<char> stale_;  // blocks the last step changed: uploaded at the next acquire
  bool gather_hooked_ = false;  // this step's gather uploads each block as it arrives (gathered_hook)
  std::vector<std::vector<optim::LambSegment>> lamb_segs_;  // Lamb: each block's segments, from its norms to its update
  // Note [the update behind the forward]: the thread the update runs on,
  // whether one is in flight (the engine's thread reads and writes it),
  // and what it has done (behind_mu_).
  const bool behind_allowed_ = [] {
    return env_choice("ZINC_GPU_UPDATE_BEHIND", {"0", "1"}) != "0";
  }();
  std::unique_ptr<comm::Communicator> behind_comm_;
  std::unique_ptr<comm::CommStream> behind_stream_;
  comm::CommHandle behind_job_;
  bool behind_ = false;
  mutable std::mutex behind_mu_;
  std::condition_variable behind_cv_;
  std::vector<char> updated_;  // per block: its update is done and its upload queued
  bool behind_done_ = false;
  std::string behind_error_;
  double behind_ran_s_ = 0, behind_wait_s_ = 0;
  double behind_last_s_ = 0;  // the last update's seconds, counted when the engine settles it
  std::deque<int> copies_;   // blocks whose gradient copies are in flight, in the order reported
};

}  // namespace

std::vector<char> gpu_state_blocks(const std::vector<int64_t>& trained_numel, double ratio) {
  std::vector<char> on(trained_numel.size(), 0);
  if (ratio >= 1.0) return on;
  int64_t total = 0;
  for (int64_t n : trained_numel) total += n;
  const double budget = (1.0 - ratio) * static_cast<double>(total);
  int64_t used = 0;
  for (size_t b = 0; b < trained_numel.size(); ++b) {
    if (trained_numel[b] == 0) continue;  // frozen: no states
    if (static_cast<double>(used + trained_numel[b]) > budget) break;
    used += trained_numel[b];
    on[b] = 1;
  }
  return on;
}

std::unique_ptr<DevicePath> make_device_path(const Config& c, comm::Communicator* comm, int world, int rank,
                                             DType dtype) {
  if (c.device == Device::kCuda) return std::make_unique<GpuOffload>(c, comm, world, rank, dtype);
  return std::make_unique<CpuPath>();
}

}  // namespace zinc
