// zinc engine, private: the GPU side of a "device": "cuda" run (Note [the
// GPU path] in engine.cpp). The engine keeps every piece of its host state
// as on the CPU (master weights and optimizer states, the host compute copy,
// the host gradient buffers the GradReducer reduces); the mirror adds, per
// block, the full compute parameters and an fp32 gradient accumulator in GPU
// memory, and moves data between the two:
// - upload_params: host compute copy -> GPU, ordered before the model's next
//   kernels on the compute stream (the legacy default stream, models/detail/ops.h);
// - start_grads_copy: at an accumulation boundary, once the compute stream
//   has produced the block's gradients, copy them to pinned host memory on
//   a copy stream of their own (backward goes on meanwhile) and zero the GPU
//   accumulator for the next global batch; grads_copied / finish_grads_copy
//   hand them to the host buffer.
// At stage 3 and stage 2 the GPU keeps less (MirrorOptions): a block's
// parameters only while the engine holds it gathered (upload_params to
// drop_params), and its gradient accumulator only from the first grads() of
// a global batch to its boundary copy or reduction. The CUDA mirror takes
// these buffers from the stream-ordered pool (cudaMallocAsync), so coming
// and going every step costs no device-wide synchronisation.
// No CUDA type appears here: the implementation is device_mirror_cuda.cpp in
// CUDA builds, else make() throws (device_mirror.cpp). Without a GPU, kernel
// emulation (tests/cuda_emu) runs device_mirror_cuda.cpp itself on the CPU.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "core/dtype.h"
#include "engine/config.h"
#include "optim/optim.h"

namespace zinc {

// What the GPU keeps between uses (the engine sets these from the stage).
struct MirrorOptions {
  // Stage 3 (StagePlan::params_sharded): a block's GPU parameters exist from
  // upload_params to drop_params only.
  bool transient_params = false;
  // Stages 2-3: a block's GPU gradient accumulator is allocated (zeroed) by
  // grads() and freed once its boundary copy or reduction has read it.
  bool transient_grads = false;
  // Per block: frozen (LoRA's base), so no gradient accumulator (empty:
  // none frozen). The engine's, not the config's.
  std::vector<char> frozen;
};

// What the GPU path keeps where, from the config and the world size alone
// ("device": "cuda"): the engine and --estimate (memory_estimate.cpp) both
// ask here, so the two cannot disagree.
struct GpuPlan {
  MirrorOptions mirror;
  // The gradients reach host memory (not so with GPU-resident optimizer
  // states on one rank: the update reads them on the GPU).
  bool host_grads = true;
  // Stage 3 on several ranks with the shards in RAM: the parameter gathers
  // run on the GPU (when the GPU reduction starts; else in host memory).
  bool device_gathers = false;
  // Stage 3 on one rank with the shards in RAM: a block's gather is its
  // upload from the page-locked shard (no gathered copy or staging in RAM).
  bool upload_gathers = false;
  static GpuPlan make(const Config& c, int world);
};

class DeviceMirror {
 public:
  // padded_numel: each block's flat length (compute params and gradients alike).
  static std::unique_ptr<DeviceMirror> make(const std::vector<int64_t>& padded_numel, DType compute,
                                            const MirrorOptions& options = {});
  virtual ~DeviceMirror() = default;

  // The block's GPU compute parameters, for the model's kernels: the compute
  // stream first waits for an upload in flight (upload_params_async).
  virtual const void* params(int block) = 0;
  // Makes the mirror's GPU the calling thread's current device (the engine
  // calls it at each entry point: a thread other than the constructor's may
  // drive it).
  virtual void make_current() = 0;
  // ---- pipeline stages (Note [pipeline stages on the GPU] in
  // engine/pipeline.cpp) ----
  // n floats of GPU memory (a stage's input, output or their gradients),
  // freed when the last reference goes.
  virtual std::shared_ptr<float> alloc_floats(int64_t n) = 0;
  // Waits until the compute stream's kernels so far have finished (before
  // another stream, NCCL's, reads what they wrote).
  virtual void sync_compute() = 0;
  // The block's GPU gradient accumulator; the compute stream first waits for
  // the copy and zeroing of the last boundary.
  virtual float* grads(int block) = 0;
  // Copies the block's host compute parameters (compute dtype, padded) to
  // the GPU (with transient_params: allocating them there first, and `host`
  // may be rewritten or freed as soon as this returns).
  virtual void upload_params(int block, const void* host) = 0;
  // transient_params: whether the block's parameters are on the GPU now,
  // and freeing them once the kernels queued so far have read them. No-throw
  // (the engine calls it from a release): a failure is logged.
  virtual bool has_params(int block) = 0;
  virtual void drop_params(int block) noexcept = 0;
  // Bytes of GPU memory the mirror holds now and at most so far (parameters,
  // gradients, states, wire copies and scratch; not the activations).
  virtual int64_t bytes() const = 0;
  virtual int64_t peak_bytes() const = 0;
  // The same on the copy stream, overlapping whatever the host does next
  // (ZeRO-Offload uploads block b while the CPU updates block b + 1). Truly
  // asynchronous where `host` was registered (register_host).
  virtual void upload_params_async(int block, const void* host) = 0;
  // on: the asynchronous uploads from now on wait only for the kernels the
  // compute stream has queued so far (the last backward's, which read the
  // old parameters), not for those queued later (the next forward's, which
  // wait for them: the update runs behind that forward, on another thread,
  // Note [the update behind the forward] in gpu_offload.cpp). off: each
  // upload waits for everything queued before it, as before.
  virtual void fence_param_reads(bool on) = 0;
  // Waits until no upload (async or on the compute stream) reads host
  // memory, before the host rewrites it.
  virtual void wait_uploads() = 0;
  // Page-locks [p, p + bytes) for asynchronous copies (cudaHostRegister)
  // until the mirror goes.
  virtual void register_host(void* p, size_t bytes) = 0;
  virtual void start_grads_copy(int block) = 0;
  virtual bool grads_copied(int block) = 0;
  // Waits for the copy and writes the block's gradients into `host` (padded fp32).
  virtual void finish_grads_copy(int block, float* host) = 0;
  // ---- GPU-resident optimizer states (offload_optimizer "none" with
  // "device": "cuda", stages 0-2): fp32 master weights, m and v per block in
  // GPU memory, updated by optim::adam_step_cuda (or optim::LambCuda),
  // which writes the compute parameters in the same pass. ----
  // Per block: the states' length (the padded block on one rank, the rank's
  // shard on several; 0: the block's states are not here, a share of them
  // on the GPU) and where they start in the block (0, or the shard's
  // offset). On several ranks the reduced gradient shard also stays on the GPU.
  virtual void enable_states(const std::vector<int64_t>& numel, const std::vector<int64_t>& offset) = 0;
  // Elements [offset, offset + count) of a block's states from / to host
  // memory (synchronous; m or v may be null to skip them).
  virtual void upload_states(int block, int64_t offset, int64_t count, const float* master, const float* m,
                             const float* v) = 0;
  virtual void download_states(int block, int64_t offset, int64_t count, float* master, float* m, float* v) = 0;
  // Tensor parts (Note [tensor parts on the GPU] in tensor_parallel.cpp):
  // per block, the ranges [first, end) of its flat elements that
  // grad_squared_norm counts on this part (a parameter every part holds
  // whole counts on part 0 only); an empty list counts none of the block.
  // Never called: every element counts.
  virtual void set_norm_ranges(std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges) = 0;
  // Per block, the ranges [first, end) of its flat elements whose
  // parameters weight decay passes by (the Trainer's AdamW: biases and
  // norm weights); adam_step applies the decay elsewhere only.
  virtual void set_no_decay(std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges) = 0;
  // GPU-resident states: the fp32 gradient the block's update reads (the
  // reduced shard on several ranks, else the accumulator), whose first
  // element is the state range's first, for the all-reduce over the parts.
  virtual float* state_grads(int block) = 0;
  // Sum of squares of every block's GPU gradient (the accumulator on one
  // rank, the reduced shard on several, with gather_back the rank's shard of
  // the accumulator), blocks in order, each in
  // kernels::squared_norm's order (waits for the result; this rank's part).
  virtual double grad_squared_norm() = 0;
  // One AdamW step of a block over its GPU states and gradient, writing the
  // compute parameters of its range (then gather_params on several ranks),
  // or with `host_out` (stage 3, whose GPU parameters come and go) to host
  // memory instead: the state range's compute values, synchronously (and
  // with enable_param_shards to the GPU shard too).
  virtual void adam_step(int block, const optim::AdamParams& p, int64_t step, float grad_scale,
                         void* host_out = nullptr) = 0;
  // Lamb over the same states (Note [Lamb arithmetic] in optim/detail/
  // lamb_math.h, optim::LambCuda): pass 1 adds each tensor's sums of w^2
  // and u^2 over the block's state range into `sums` (host; segs over that
  // range as optim::lamb_norms takes them), waiting for the result; pass 2
  // is adam_step with the tensors' trust ratios.
  virtual void lamb_norms(int block, const optim::LambParams& p, float grad_scale,
                          std::span<const optim::LambSegment> segs, double* sums) = 0;
  virtual void lamb_step(int block, const optim::LambParams& p, int64_t step, float grad_scale,
                         std::span<const optim::LambSegment> segs, const double* ratios, void* host_out = nullptr) = 0;
  // ZeRO-Offload on one rank (Note [the norm on the GPU] in gpu_offload.cpp):
  // at a boundary, the sum of squares of the block's accumulator, on the
  // compute stream before anything reads or frees it; then the sum of
  // every block's, blocks in order, each in kernels::squared_norm's order
  // (waits for the result): grad_squared_norm's arithmetic on the same
  // values, so the same bits as the states wholly on the GPU.
  virtual void note_grad_squares(int block) = 0;
  virtual double noted_grad_squared_norm() = 0;
  // Zeroes the GPU gradient accumulators of the blocks whose states are
  // here (after a step).
  virtual void zero_grads() = 0;
  // Several ranks, comm thread: all-gathers the block's updated compute
  // shards over `c` (in place on the GPU), after the step's updates.
  virtual void gather_params(comm::Communicator& c, int block) = 0;

  // ---- reductions on the GPU (several ranks, stages 1-2): the GradReducer
  // calls device_reduce for each block of a bucket on its stream's thread,
  // whose communicator reaches GPU memory (NCCL). ----
  // wire: the dtype on the wire; max_shard: the largest shard (elements).
  // gather_back (stage 0, GPU-resident states): device_reduce all-gathers the
  // reduced shards back into the full accumulator, which the update reads;
  // the norm then covers the rank's shard of it.
  virtual void enable_device_reduce(DType wire, int64_t max_shard, bool gather_back = false) = 0;
  // Training thread, at a boundary's grads_ready: (16-bit wire) converts the
  // accumulator on the compute stream, and marks the point the reduction
  // waits for.
  virtual void start_device_reduce(int block) = 0;
  // Comm thread: waits for that point, reduce-scatters the block over `c`,
  // writes the rank's shard (shard_numel elements) into host `shard_out` as
  // fp32, and zeroes the accumulator for the next global batch (the compute
  // stream waits for that at the next grads(); the engine waits for every
  // reduction before the next backward).
  // With shard_out null (GPU-resident states) the shard stays on the GPU;
  // with gather_back the full reduced gradient does (zeroed after the step).
  virtual void device_reduce(comm::Communicator& c, int block, int64_t shard_numel, float* shard_out) = 0;

  // ---- stage 3 gathers on the GPU (several ranks, shards in RAM): each
  // block's compute shard also lives on the GPU, and a gather fills the
  // block's (transient) parameters there. ----
  // Per block: the shard's length (elements).
  virtual void enable_param_shards(const std::vector<int64_t>& shard_numel) = 0;
  // The rank's compute shard from host memory (synchronous), after the
  // host wrote it (the CPU update, a checkpoint load).
  virtual void upload_shard(int block, const void* host) = 0;
  // Training thread: the block's GPU parameters, before gather_block is
  // submitted (drop_params frees them).
  virtual void begin_gather(int block) = 0;
  // Comm thread: all-gathers every rank's shard into the block's GPU
  // parameters over `c` (a communicator that reaches GPU memory).
  virtual void gather_block(comm::Communicator& c, int block) = 0;

  // ---- stage 3 on one rank with the shards in page-locked RAM: a block's
  // gather is its upload, straight from the shard (which is the whole
  // block), on the coordinator's gather thread. begin_gather and
  // drop_params as above. ----
  virtual void enable_host_gathers() = 0;
  // Comm thread: the block's GPU parameters from `host` (page-locked,
  // registered), after begin_gather; returns once they have landed.
  virtual void load_block(int block, const void* host) = 0;

  // Waits for everything the mirror and the compute stream have queued.
  virtual void synchronize() = 0;
  // `bytes` of device memory (a block's parameters) into host memory,
  // after the device's work so far (synchronous).
  virtual void read_back(const void* device, void* host, size_t bytes) = 0;
};

}  // namespace zinc
