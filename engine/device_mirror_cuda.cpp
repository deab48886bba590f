// The GPU mirror of device_mirror.h (CUDA builds).
//
// Streams: the models' kernels run on the compute stream (the legacy default
// stream, models/detail/ops.h); `copy_` carries the gradients' copies to
// the host and the stage 0-2 uploads after an update; `upload_` the stage 3
// uploads (so the parameters of the next block come up while the gradients
// of the last go down); `reduce_copy_` the comm thread's copies around a
// reduction; `gather_copy_` stage 3's uploads on one rank, which run on the
// coordinator's gather thread (load_block). Events order them
// (Block::produced, copied, uploaded, allocated).
//
// Memory: the parameters and gradient accumulators come from a
// stream-ordered pool of the mirror's own (cudaMallocFromPoolAsync), whose
// release threshold is raised so freed memory stays in the pool until the
// mirror goes: with MirrorOptions' transient buffers a
// block's come and go every step without cudaFree's device-wide
// synchronisation (which would stall a reduction in flight). A buffer is
// used only on its allocating stream or after an event recorded there after
// the allocation, and freed on a stream that has seen its last use (the
// pool itself orders a later reuse: its default reuse policies).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/device_mirror.h"
#include "kernels/gpu_profile.h"
#include "kernels/kernels_cuda.h"
#include "optim/optim_cuda.h"

namespace zinc {
namespace {

constexpr cudaStream_t kCompute = nullptr;  // the models' compute stream (models/detail/ops.h)

// Device memory from the stream-ordered pool; the mirror frees it.
struct PoolMem {
  void* p = nullptr;
  size_t bytes = 0;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

class CudaMirror final : public DeviceMirror {
 public:
  CudaMirror(const std::vector<int64_t>& padded, DType compute, const MirrorOptions& options)
      : compute_(compute), options_(options) {
    ZINC_CUDA_CHECK(cudaGetDevice(&device_), "cudaGetDevice");
    int pools = 0;
    ZINC_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_),
                    "cudaDeviceGetAttribute(MemoryPoolsSupported)");
    if (!pools)
      throw Error("device \"cuda\": GPU " + std::to_string(device_) +
                  " has no stream-ordered memory pool (cudaMallocAsync), which zinc's GPU path uses");
    // A pool of the mirror's own: freed blocks stay in it for the next step
    // (the release threshold), and it all goes back when the mirror does,
    // leaving the device's default pool and other allocators alone.
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    ZINC_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
    try {
      uint64_t keep = UINT64_MAX;
      ZINC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep),
                      "cudaMemPoolSetAttribute(ReleaseThreshold)");
      // A block freed on the compute stream (drop_params) is not handed to
      // an allocation on the upload stream by making that stream wait for
      // the compute stream: stage 3's next uploads would queue behind the
      // kernels. The pool reuses it once the free has run, or grows.
      int no = 0;
      ZINC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &no),
                      "cudaMemPoolSetAttribute(ReuseAllowInternalDependencies)");
      blocks_.resize(padded.size());
      for (size_t b = 0; b < padded.size(); ++b) {
        Block& k = blocks_[b];
        k.numel = padded[b];
        if (!options_.transient_params) alloc(k.params, param_bytes(k), kCompute, "parameters", b);
        const bool frozen = b < options_.frozen.size() && options_.frozen[b];  // no gradients
        if (!options_.transient_grads && !frozen) {
          alloc(k.grads, grad_bytes(k), kCompute, "gradient accumulator", b);
          ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.p, 0, k.grads.bytes, kCompute), "zeroing the GPU gradient buffers");
        }
        k.produced = std::make_unique<cuda::Event>();
        k.copied = std::make_unique<cuda::Event>();
        k.uploaded = std::make_unique<cuda::Event>();
      }
      // The buffers that stay are used from every stream: their allocation
      // completes before anything else is queued.
      ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "allocating the GPU parameters and gradients");
    } catch (...) {
      free_pool();  // the destructor does not run: nothing stays reserved after a failed start
      throw;
    }
  }

  ~CudaMirror() override {
    free_pool();
    for (void* p : registered_) cudaHostUnregister(p);
  }

  // Every pool buffer and the pool itself, once nothing in flight reads them.
  void free_pool() noexcept {
    cudaDeviceSynchronize();
    for (Block& k : blocks_)
      for (PoolMem* m : {&k.params, &k.grads, &k.wire})
        if (m->p) cudaFreeAsync(m->p, kCompute);
    cudaStreamSynchronize(kCompute);
    if (pool_) cudaMemPoolDestroy(pool_);  // its memory goes back to the device
    pool_ = nullptr;
  }

  const void* params(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (!k.params.p) throw Error("GPU path: block " + std::to_string(block) + "'s parameters are not on the GPU");
    if (k.upload_pending) {
      k.uploaded->wait_on(kCompute);
      k.upload_pending = false;
    }
    return k.params.p;
  }

  void make_current() override { ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice (the engine's GPU)"); }

  std::shared_ptr<float> alloc_floats(int64_t n) override {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
    void* p = ::zinc::cuda::gpu_malloc(bytes, "a pipeline stage's transfer buffer");
    return std::shared_ptr<float>(static_cast<float*>(p), [](float* q) { cudaFree(q); });
  }
  void sync_compute() override { ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "cudaStreamSynchronize (the compute stream)"); }

  void upload_params_async(int block, const void* host) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    // After the last backward's kernels, which still read these parameters:
    // with a fence, after the kernels queued when it was set (the update
    // runs behind the next forward, whose kernels an upload must not wait
    // for); else after everything the compute stream has queued. Then on
    // the copy stream.
    if (fenced_) {
      reads_fence_->wait_on(copy_.get());
    } else {
      k.produced->record(kCompute);
      k.produced->wait_on(copy_.get());
    }
    {
      kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kCopy, copy_.get());
      ZINC_CUDA_CHECK(cudaMemcpyAsync(k.params.p, host, k.params.bytes, cudaMemcpyHostToDevice, copy_.get()),
                      ("upload of block " + std::to_string(block) + "'s parameters").c_str());
    }
    k.uploaded->record(copy_.get());
    k.upload_pending = true;
  }

  void fence_param_reads(bool on) override {
    fenced_ = false;
    if (!on) return;
    if (!reads_fence_) reads_fence_ = std::make_unique<cuda::Event>();
    reads_fence_->record(kCompute);
    fenced_ = true;
  }

  // Every stream that reads host memory for an upload: the acquire-path
  // uploads (upload_params) run on the compute stream and read the
  // page-locked host copies asynchronously too.
  void wait_uploads() override {
    copy_.synchronize("wait for the parameter uploads");
    upload_.synchronize("wait for the parameter uploads (stage 3)");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "wait for the parameter uploads (compute stream)");
  }

  void register_host(void* p, size_t bytes) override {
    if (!p || !bytes) return;
    ZINC_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterDefault),
                    ("page-locking " + std::to_string(bytes) + " bytes of host compute parameters").c_str());
    registered_.push_back(p);
  }

  float* grads(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (k.copy_pending) {
      k.copied->wait_on(kCompute);  // the accumulator was copied out and zeroed (or freed)
      k.copy_pending = false;
    }
    if (!k.grads.p) {  // transient_grads: a new global batch's accumulator
      alloc(k.grads, grad_bytes(k), kCompute, "gradient accumulator", block);
      ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.p, 0, k.grads.bytes, kCompute), "zeroing a GPU gradient buffer");
    }
    return k.grads.as<float>();
  }

  void upload_params(int block, const void* host) override {
    if (options_.transient_params) return upload_transient(block, host);
    Block& k = blocks_[static_cast<size_t>(block)];
    if (k.upload_pending) {  // an older upload must not land after this one
      k.uploaded->wait_on(kCompute);
      k.upload_pending = false;
    }
    kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kCopy, kCompute);
    ZINC_CUDA_CHECK(cudaMemcpyAsync(k.params.p, host, k.params.bytes, cudaMemcpyHostToDevice, kCompute),
                    ("upload of block " + std::to_string(block) + "'s parameters").c_str());
  }

  bool has_params(int block) override { return blocks_[static_cast<size_t>(block)].params.p != nullptr; }

  void drop_params(int block) noexcept override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (!options_.transient_params || !k.params.p) return;
    try {
      if (k.upload_pending) {  // uploaded but never read: the free still comes after the copy
        k.uploaded->wait_on(kCompute);
        k.upload_pending = false;
      }
      release(k.params, kCompute);  // after the kernels queued so far, which read it
    } catch (const std::exception& e) {
      log_error("GPU path: freeing block " + std::to_string(block) + "'s GPU parameters failed: " + e.what());
    }
  }

  int64_t bytes() const override { return bytes_.load(); }
  int64_t peak_bytes() const override { return peak_.load(); }

  void start_grads_copy(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    ZINC_CHECK(k.grads.p != nullptr, "start_grads_copy of block " + std::to_string(block) + " without gradients");
    if (k.staging.bytes() == 0) {  // page-locked staging only where copies of whole blocks happen (one rank)
      k.staging = cuda::PinnedBuffer(grad_bytes(k));
    }
    k.produced->record(kCompute);
    k.produced->wait_on(copy_.get());
    {
      kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kCopy, copy_.get());
      ZINC_CUDA_CHECK(cudaMemcpyAsync(k.staging.data(), k.grads.p, k.grads.bytes, cudaMemcpyDeviceToHost, copy_.get()),
                      ("copy of block " + std::to_string(block) + "'s gradients to the host").c_str());
    }
    done_with_grads(k, copy_.get());
    k.copied->record(copy_.get());
    k.copy_pending = true;
  }

  bool grads_copied(int block) override { return blocks_[static_cast<size_t>(block)].copied->done(); }

  void finish_grads_copy(int block, float* host) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    k.copied->synchronize();
    std::memcpy(host, k.staging.data(), k.staging.bytes());
  }

  void enable_states(const std::vector<int64_t>& numel, const std::vector<int64_t>& offset) override {
    for (size_t i = 0; i < blocks_.size(); ++i) {
      Block& k = blocks_[i];
      k.state_numel = numel[i];
      k.state_offset = offset[i];
      if (k.state_numel == 0) continue;  // not here (a share of the states on the GPU)
      const size_t bytes = static_cast<size_t>(k.state_numel) * sizeof(float);
      std::vector<cuda::DeviceBuffer*> bufs = {&k.master, &k.m, &k.v};
      if (k.state_numel != k.numel) bufs.push_back(&k.gshard);  // several ranks: the reduced shard stays here
      for (cuda::DeviceBuffer* b : bufs) {
        *b = cuda::DeviceBuffer(bytes, "block " + std::to_string(i) + "'s optimizer states");
        count(static_cast<int64_t>(bytes));
        ZINC_CUDA_CHECK(cudaMemset(b->data(), 0, bytes), "zeroing the GPU optimizer states");
      }
    }
    if (norms_.bytes() == 0) alloc_norms();
  }
  // One double per block, zeroed (a block never noted adds nothing).
  void alloc_norms() {
    norms_ = cuda::DeviceBuffer(blocks_.size() * sizeof(double));
    count(static_cast<int64_t>(norms_.bytes()));
    ZINC_CUDA_CHECK(cudaMemset(norms_.data(), 0, norms_.bytes()), "zeroing the gradient norms");
  }
  // The blocks' sums of squares in norms_, added in block order on the host.
  double sum_norms() { return sum_doubles(norms_, blocks_.size()); }
  // The first n doubles of `d` (after the compute stream's work), added in
  // order on the host.
  static double sum_doubles(const cuda::DeviceBuffer& d, size_t n) {
    std::vector<double> host(n);
    if (n > 0)
      ZINC_CUDA_CHECK(cudaMemcpyAsync(host.data(), d.data(), n * sizeof(double), cudaMemcpyDeviceToHost, kCompute),
                      "copy of the gradient norms");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "synchronize for the gradient norm");
    double s = 0;
    for (double x : host) s += x;
    return s;
  }

  void upload_states(int block, int64_t offset, int64_t count, const float* master, const float* m,
                     const float* v) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    const size_t at = static_cast<size_t>(offset) * sizeof(float), bytes = static_cast<size_t>(count) * sizeof(float);
    if (master) cuda::copy_to_device(k.master.as<char>() + at, master, bytes);
    if (m) cuda::copy_to_device(k.m.as<char>() + at, m, bytes);
    if (v) cuda::copy_to_device(k.v.as<char>() + at, v, bytes);
  }

  void download_states(int block, int64_t offset, int64_t count, float* master, float* m, float* v) override {
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "synchronize before reading the GPU optimizer states");
    Block& k = blocks_[static_cast<size_t>(block)];
    const size_t at = static_cast<size_t>(offset) * sizeof(float), bytes = static_cast<size_t>(count) * sizeof(float);
    if (master) cuda::copy_to_host(master, k.master.as<char>() + at, bytes);
    if (m) cuda::copy_to_host(m, k.m.as<char>() + at, bytes);
    if (v) cuda::copy_to_host(v, k.v.as<char>() + at, bytes);
  }

  double grad_squared_norm() override {
    if (!norm_ranges_.empty()) return ranged_squared_norm();
    for (size_t b = 0; b < blocks_.size(); ++b) {
      const Block& k = blocks_[b];
      if (k.state_numel == 0) continue;  // frozen: no gradients (its norm stays the zero it started as)
      const NormRegion r = norm_region(k);
      kernels::cuda::squared_norm(r.g, r.n, norms_.as<double>() + b, kCompute);
    }
    return sum_norms();
  }

  void set_norm_ranges(std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges) override {
    ZINC_CHECK(ranges.size() == blocks_.size(), "set_norm_ranges: one list per block");
    size_t total = 0;
    for (const auto& r : ranges) total += r.size();
    range_norms_ = cuda::DeviceBuffer(std::max<size_t>(total, 1) * sizeof(double));
    count(static_cast<int64_t>(range_norms_.bytes()));
    norm_ranges_ = std::move(ranges);
  }
  // grad_squared_norm over the ranges set_norm_ranges gave, each within
  // the block's region: a squared_norm per range, added in block and
  // range order on the host.
  double ranged_squared_norm() {
    size_t slots = 0;
    for (size_t b = 0; b < blocks_.size(); ++b) {
      const Block& k = blocks_[b];
      if (k.state_numel == 0) continue;
      const NormRegion r = norm_region(k);
      for (auto [lo, hi] : norm_ranges_[b]) {
        const int64_t a = std::max(lo, r.first), e = std::min(hi, r.first + r.n);
        if (a < e) kernels::cuda::squared_norm(r.g + (a - r.first), e - a, range_norms_.as<double>() + slots++, kCompute);
      }
    }
    return sum_doubles(range_norms_, slots);
  }

  float* state_grads(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    float* g = k.gshard.bytes() > 0 ? k.gshard.as<float>() : k.grads.as<float>();
    ZINC_CHECK(k.state_numel > 0 && g != nullptr, "state_grads of block " + std::to_string(block) +
                                                      " without GPU-resident states or gradients");
    return g;
  }

  void adam_step(int block, const optim::AdamParams& p, int64_t step, float grad_scale, void* host_out) override {
    const int64_t first = blocks_[static_cast<size_t>(block)].state_offset;
    const std::vector<std::pair<int64_t, int64_t>>* skip =
        no_decay_.empty() || p.weight_decay == 0.0 ? nullptr : &no_decay_[static_cast<size_t>(block)];
    update_block(block, host_out, [&](float* master, const void* grad, float* m, float* v, void* out16, int64_t n) {
      // State elements [lo, hi), decayed or not (set_no_decay's ranges
      // pass the decay by).
      auto run = [&](int64_t lo, int64_t hi, bool decay) {
        if (lo >= hi) return;
        optim::AdamParams a = p;
        if (!decay) a.weight_decay = 0.0;
        const size_t es = dtype_bytes(compute_);
        optim::adam_step_cuda(a, step, grad_scale, master + lo, static_cast<const float*>(grad) + lo, DType::kF32, m + lo,
                              v + lo, out16 ? static_cast<char*>(out16) + static_cast<size_t>(lo) * es : nullptr,
                              compute_, hi - lo, kCompute);
      };
      if (!skip) return run(0, n, true);
      int64_t at = 0;
      for (auto [a, b] : *skip) {
        const int64_t lo = std::clamp<int64_t>(a - first, at, n), hi = std::clamp<int64_t>(b - first, lo, n);
        run(at, lo, true);
        run(lo, hi, false);
        at = hi;
      }
      run(at, n, true);
    });
  }
  void set_no_decay(std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges) override {
    ZINC_CHECK(ranges.size() == blocks_.size(), "set_no_decay: one list per block");
    no_decay_ = std::move(ranges);
  }

  void lamb_norms(int block, const optim::LambParams& p, float grad_scale, std::span<const optim::LambSegment> segs,
                  double* sums) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    lamb_.norms(p, grad_scale, k.master.as<float>(), k.gshard.bytes() > 0 ? k.gshard.data() : k.grads.p, DType::kF32,
                k.m.as<float>(), k.v.as<float>(), k.state_numel, segs, sums, kCompute);
  }

  void lamb_step(int block, const optim::LambParams& p, int64_t step, float grad_scale,
                 std::span<const optim::LambSegment> segs, const double* ratios, void* host_out) override {
    update_block(block, host_out, [&](float* master, const void* grad, float* m, float* v, void* out16, int64_t n) {
      lamb_.apply(p, step, grad_scale, master, grad, DType::kF32, m, v, out16, compute_, n, segs, ratios, kCompute);
    });
  }

  // One optimizer step of a block over its GPU states (adam_step's
  // contract): `launch` enqueues the update of (master, grad, m, v) on the
  // compute stream, writing the 16-bit compute values to out16 (null in
  // fp32, where the master is copied); then the new values go where they
  // belong.
  template <class Launch>
  void update_block(int block, void* host_out, Launch&& launch) {
    Block& k = blocks_[static_cast<size_t>(block)];
    const bool half = is_16bit(compute_);
    const bool shard = k.gshard.bytes() > 0;
    const size_t out_bytes = static_cast<size_t>(k.state_numel) * dtype_bytes(compute_);
    if (host_out && half && k.pshard.bytes() == 0 && update_out_.bytes() < out_bytes) {
      count(static_cast<int64_t>(out_bytes) - static_cast<int64_t>(update_out_.bytes()));
      update_out_ = cuda::DeviceBuffer(out_bytes, "the update's 16-bit output");
    }
    // With GPU shards (stage 3, gathers on the GPU) a 16-bit update writes
    // the shard there, then the host's copy comes from it.
    char* out = host_out && k.pshard.bytes() > 0 ? k.pshard.as<char>()
                : host_out                        ? update_out_.as<char>()
                                                  : k.params.as<char>() + static_cast<size_t>(k.state_offset) * dtype_bytes(compute_);
    launch(k.master.as<float>(), shard ? k.gshard.data() : k.grads.p, k.m.as<float>(), k.v.as<float>(),
           half ? static_cast<void*>(out) : nullptr, k.state_numel);
    if (host_out) {  // stage 3: the new compute values go to the host shard (fp32: the master itself)
      if (!half && k.pshard.bytes() > 0)
        ZINC_CUDA_CHECK(cudaMemcpyAsync(k.pshard.data(), k.master.data(), out_bytes, cudaMemcpyDeviceToDevice, kCompute),
                        "copy of the updated fp32 weights to the GPU shard");
      ZINC_CUDA_CHECK(cudaMemcpyAsync(host_out, half ? static_cast<const void*>(out) : k.master.data(), out_bytes,
                                      cudaMemcpyDeviceToHost, kCompute),
                      ("copy of block " + std::to_string(block) + "'s updated parameters to the host").c_str());
      ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "waiting for the updated parameters");
      return;
    }
    if (!half)
      ZINC_CUDA_CHECK(cudaMemcpyAsync(out, k.master.data(), static_cast<size_t>(k.state_numel) * 4,
                                      cudaMemcpyDeviceToDevice, kCompute),
                      "copy of the updated fp32 weights");
    k.produced->record(kCompute);  // gather_params waits for the update
  }

  void note_grad_squares(int block) override {
    const Block& k = blocks_[static_cast<size_t>(block)];
    ZINC_CHECK(k.grads.p != nullptr, "note_grad_squares of block " + std::to_string(block) + " without gradients");
    if (norms_.bytes() == 0) alloc_norms();
    kernels::cuda::squared_norm(k.grads.as<float>(), k.numel, norms_.as<double>() + block, kCompute);
  }
  double noted_grad_squared_norm() override {
    if (norms_.bytes() == 0) alloc_norms();
    return sum_norms();
  }

  void zero_grads() override {
    for (Block& k : blocks_)
      if (k.grads.p && k.state_numel > 0)
        ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.p, 0, k.grads.bytes, kCompute), "zeroing the GPU gradients");
  }

  void gather_params(comm::Communicator& c, int block) override {
    ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice on the reduction thread");
    Block& k = blocks_[static_cast<size_t>(block)];
    comm::wait_cuda_event(c, k.produced->get());
    const size_t es = dtype_bytes(compute_);
    c.all_gather(k.params.as<char>() + static_cast<size_t>(k.state_offset) * es, k.params.p, k.state_numel,
                 compute_);
  }

  void enable_device_reduce(DType wire, int64_t max_shard, bool gather_back) override {
    wire_ = wire;
    gather_back_ = gather_back;
    shard_scratch_ = cuda::DeviceBuffer(static_cast<size_t>(max_shard) * 4, "the reduction's shard");
    count(static_cast<int64_t>(shard_scratch_.bytes()));
    if (gather_back && is_16bit(wire)) {  // the widened shard, all-gathered from here
      gather_scratch_ = cuda::DeviceBuffer(static_cast<size_t>(max_shard) * 4, "the gather's widened shard");
      count(static_cast<int64_t>(gather_scratch_.bytes()));
    }
    shard_staging_ = cuda::PinnedBuffer(static_cast<size_t>(max_shard) * 4);
  }

  void start_device_reduce(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    ZINC_CHECK(k.grads.p != nullptr, "start_device_reduce of block " + std::to_string(block) + " without gradients");
    if (is_16bit(wire_)) {
      if (!k.wire.p) alloc(k.wire, static_cast<size_t>(k.numel) * 2, kCompute, "16-bit wire copy", block);  // transient_grads frees it with them
      kernels::cuda::convert_f32_to_16(k.grads.as<float>(), k.wire.p, k.numel, wire_, kCompute);
    }
    k.produced->record(kCompute);
    k.copy_pending = true;  // the next grads() waits for `copied`, recorded by device_reduce before the step ends
  }

  void device_reduce(comm::Communicator& c, int block, int64_t shard, float* shard_out) override {
    // The comm thread's current device is its own: make it the mirror's.
    ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice on the reduction thread");
    Block& k = blocks_[static_cast<size_t>(block)];
    comm::wait_cuda_event(c, k.produced->get());
    const bool w16 = is_16bit(wire_);
    cudaStream_t s = reduce_copy_.get();
    if (gather_back_) {  // stage 0, GPU-resident states: the full reduced gradient stays in the accumulator
      float* shard_f32 = w16 ? gather_scratch_.as<float>() : shard_scratch_.as<float>();
      c.reduce_scatter(w16 ? k.wire.p : k.grads.p, shard_scratch_.data(), shard, w16 ? wire_ : DType::kF32);
      if (w16) {
        kernels::cuda::convert_16_to_f32(shard_scratch_.data(), shard_f32, shard, wire_, s);
        reduce_copy_.synchronize("widening a reduced gradient shard");
      }
      c.all_gather(shard_f32, k.grads.p, shard, DType::kF32);
      k.norm_offset = static_cast<int64_t>(c.rank()) * shard;
      k.norm_numel = shard;
      k.copied->record(s);
      return;
    }
    if (!shard_out && !w16) {  // GPU-resident states: straight into the shard they update
      c.reduce_scatter(k.grads.p, k.gshard.data(), shard, DType::kF32);
      done_with_grads(k, s);
      k.copied->record(s);
      reduce_copy_.synchronize("zeroing a GPU gradient buffer");
      return;
    }
    c.reduce_scatter(w16 ? k.wire.p : k.grads.p, shard_scratch_.data(), shard, w16 ? wire_ : DType::kF32);
    if (!shard_out) {  // GPU-resident states, 16-bit wire: widened on the GPU
      kernels::cuda::convert_16_to_f32(shard_scratch_.data(), k.gshard.as<float>(), shard, wire_, s);
      done_with_grads(k, s);
      k.copied->record(s);
      reduce_copy_.synchronize("widening a reduced gradient shard");
      return;
    }
    const size_t bytes = static_cast<size_t>(shard) * (w16 ? 2 : 4);
    ZINC_CUDA_CHECK(cudaMemcpyAsync(shard_staging_.data(), shard_scratch_.data(), bytes, cudaMemcpyDeviceToHost, s),
                    "copy of a reduced gradient shard to the host");
    done_with_grads(k, s);
    k.copied->record(s);
    reduce_copy_.synchronize("copy of a reduced gradient shard to the host");
    if (w16)
      convert_16_to_f32(shard_staging_.data(), shard_out, static_cast<size_t>(shard), wire_);
    else
      std::memcpy(shard_out, shard_staging_.data(), bytes);
  }

  void enable_param_shards(const std::vector<int64_t>& shard_numel) override {
    for (size_t b = 0; b < blocks_.size(); ++b) {
      Block& k = blocks_[b];
      k.shard_numel = shard_numel[b];
      k.pshard = cuda::DeviceBuffer(static_cast<size_t>(k.shard_numel) * dtype_bytes(compute_),
                                    "block " + std::to_string(b) + "'s parameter shard");
      count(static_cast<int64_t>(k.pshard.bytes()));
      k.allocated = std::make_unique<cuda::Event>();
    }
  }

  // On the compute stream: the host copy is staged before this returns
  // (pageable memory), and a gather reading the shard waits for the
  // `allocated` event, recorded on the compute stream after this.
  void upload_shard(int block, const void* host) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    ZINC_CHECK(k.pshard.bytes() > 0, "upload_shard without enable_param_shards");
    ZINC_CUDA_CHECK(cudaMemcpyAsync(k.pshard.data(), host, k.pshard.bytes(), cudaMemcpyHostToDevice, kCompute),
                    ("upload of block " + std::to_string(block) + "'s compute shard").c_str());
  }

  void begin_gather(int block) override {
    Block& k = blocks_[static_cast<size_t>(block)];
    if (!k.params.p) alloc(k.params, param_bytes(k), kCompute, "parameters", static_cast<size_t>(block));
    // After the allocation, and after every kernel queued so far: a block
    // kept on the GPU is rewritten only once its last readers are done.
    k.allocated->record(kCompute);
  }

  void gather_block(comm::Communicator& c, int block) override {
    ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice on the gather thread");
    Block& k = blocks_[static_cast<size_t>(block)];
    comm::wait_cuda_event(c, k.allocated->get());
    c.all_gather(k.pshard.data(), k.params.p, k.shard_numel, compute_);  // returns once it has landed
  }

  void enable_host_gathers() override {
    for (Block& k : blocks_) k.allocated = std::make_unique<cuda::Event>();
  }

  void load_block(int block, const void* host) override {
    ZINC_CUDA_CHECK(cudaSetDevice(device_), "cudaSetDevice on the gather thread");
    Block& k = blocks_[static_cast<size_t>(block)];
    k.allocated->wait_on(gather_copy_.get());
    {
      kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kCopy, gather_copy_.get());
      ZINC_CUDA_CHECK(cudaMemcpyAsync(k.params.p, host, param_bytes(k), cudaMemcpyHostToDevice, gather_copy_.get()),
                      ("upload of block " + std::to_string(block) + "'s parameters (stage 3)").c_str());
    }
    gather_copy_.synchronize("upload of a block's parameters (stage 3)");
  }

  void synchronize() override {
    copy_.synchronize("synchronize the gradient copies");
    upload_.synchronize("synchronize the parameter uploads");
    reduce_copy_.synchronize("synchronize the reduced-shard copies");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kCompute), "synchronize the compute stream");
  }
  void read_back(const void* device, void* host, size_t bytes) override {
    synchronize();
    gather_copy_.synchronize("a block's parameters read back");
    cuda::copy_to_host(host, device, bytes);
  }

 private:
  struct Block {
    int64_t numel = 0;
    PoolMem params, grads;  // from the pool; null while transient and absent
    PoolMem wire;           // 16-bit copy for the reduction (start_device_reduce)
    cuda::DeviceBuffer master, m, v;  // GPU-resident states (enable_states)
    cuda::DeviceBuffer gshard;        // GPU-resident states on several ranks: the reduced fp32 shard
    cuda::DeviceBuffer pshard;        // enable_param_shards: the rank's compute shard
    int64_t shard_numel = 0;
    std::unique_ptr<cuda::Event> allocated;  // begin_gather: the gather waits for it
    int64_t state_numel = 0, state_offset = 0;
    int64_t norm_offset = 0, norm_numel = 0;  // gather_back: the rank's shard of the accumulator
    cuda::PinnedBuffer staging;
    std::unique_ptr<cuda::Event> produced, copied, uploaded;
    bool copy_pending = false, upload_pending = false;
  };
  // What grad_squared_norm reads of a block: n gradients from g, which is
  // the block's flat element `first`.
  struct NormRegion {
    const float* g;
    int64_t n, first;
  };
  NormRegion norm_region(const Block& k) const {
    if (k.gshard.bytes() > 0) return {k.gshard.as<float>(), k.state_numel, k.state_offset};
    if (gather_back_) return {k.grads.as<float>() + k.norm_offset, k.norm_numel, k.norm_offset};
    return {k.grads.as<float>(), k.numel, 0};
  }
  // A page-locked buffer a stage 3 upload goes through, and the end of the
  // last copy that read it.
  struct Staging {
    cuda::PinnedBuffer buf;
    cuda::Event free;
    bool used = false;
  };

  static std::string mib(double bytes) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1 << 20));
    return buf;
  }
  size_t param_bytes(const Block& k) const { return static_cast<size_t>(k.numel) * dtype_bytes(compute_); }
  static size_t grad_bytes(const Block& k) { return static_cast<size_t>(k.numel) * sizeof(float); }
  void count(int64_t bytes) {
    const int64_t now = bytes_.fetch_add(bytes) + bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  // What would keep less model state on the GPU, of what this run does not
  // do already (a sweep saw stage 3 told to use stage 2 or 3).
  std::string keep_less() const {
    std::vector<std::string> ways;
    if (!options_.transient_grads) ways.push_back("ZeRO stage 2 or 3 (gradients only in backward)");
    if (!options_.transient_params)
      ways.push_back("stage 3 with offload_param (a block at a time, stage3_max_live_parameters)");
    else
      ways.push_back("a lower stage3_max_live_parameters or stage3_prefetch_bucket_size");
    bool states = false;
    for (const Block& k : blocks_) states = states || k.master.bytes() > 0;
    if (states) ways.push_back("optimizer states offloaded (offload_optimizer.device \"cpu\")");
    std::string text = "Lower the micro-batch, or keep less on the GPU: ";
    for (size_t i = 0; i < ways.size(); ++i) text += (i ? ", " : "") + ways[i];
    return text;
  }
  // `what` and `block` name the buffer in an error: out of GPU memory, the
  // message says what the mirror holds and what would lower it.
  void alloc(PoolMem& m, size_t bytes, cudaStream_t s, const char* what, size_t block) {
    cudaError_t e = cudaMallocFromPoolAsync(&m.p, bytes, pool_, s);
    if (e == cudaErrorMemoryAllocation) {  // frees still queued on other streams may make room: once more after them
      cudaGetLastError();
      ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "waiting for pending frees");
      e = cudaMallocFromPoolAsync(&m.p, bytes, pool_, s);
    }
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it: the engine may report and go on
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      throw Error("GPU " + std::to_string(device_) + " is out of memory for block " + std::to_string(block) + "'s " +
                  what + " (" + mib(bytes) + "; model state on the GPU now " + mib(bytes_.load()) + ", free " +
                  mib(free_b) + " of " + mib(total_b) + "). " + keep_less());
    }
    ZINC_CUDA_CHECK(e, ("cudaMallocFromPoolAsync of " + std::to_string(bytes) + " bytes").c_str());
    m.bytes = bytes;
    count(static_cast<int64_t>(bytes));
  }
  // Freed once `s` reaches this point, which must follow every use.
  void release(PoolMem& m, cudaStream_t s) {
    if (!m.p) return;
    ZINC_CUDA_CHECK(cudaFreeAsync(m.p, s), "cudaFreeAsync");
    bytes_.fetch_sub(static_cast<int64_t>(m.bytes));
    m = PoolMem{};
  }
  // After a boundary's copy or reduction, queued on `s`: the accumulator is
  // zeroed for the next global batch, or (transient_grads) freed with its
  // wire copy.
  void done_with_grads(Block& k, cudaStream_t s) {
    if (options_.transient_grads) {
      release(k.grads, s);
      release(k.wire, s);
    } else {
      ZINC_CUDA_CHECK(cudaMemsetAsync(k.grads.p, 0, k.grads.bytes, s), "zeroing a GPU gradient buffer");
    }
  }

  // Stage 3: the host copy (pageable, and freed by the engine right after)
  // goes through one of two page-locked buffers on the upload stream, so
  // the copy neither waits for the compute stream nor blocks the host on it.
  void upload_transient(int block, const void* host) {
    Block& k = blocks_[static_cast<size_t>(block)];
    const size_t bytes = param_bytes(k);
    Staging& st = staging_[next_staging_];
    next_staging_ ^= 1;
    if (st.buf.bytes() < bytes) {
      if (st.used) st.free.synchronize();
      size_t most = 0;
      for (const Block& o : blocks_) most = std::max(most, param_bytes(o));
      st.buf = cuda::PinnedBuffer(most);
    } else if (st.used) {
      st.free.synchronize();  // the copy that last read this buffer has finished
    }
    std::memcpy(st.buf.data(), host, bytes);
    if (!k.params.p) {
      alloc(k.params, bytes, upload_.get(), "parameters", block);
    } else {  // a block kept on the GPU whose values changed: after the compute stream's reads of the old
      k.produced->record(kCompute);
      k.produced->wait_on(upload_.get());
    }
    {
      kernels::cuda::GpuProfileScope profile_scope(kernels::Op::kCopy, upload_.get());
      ZINC_CUDA_CHECK(cudaMemcpyAsync(k.params.p, st.buf.data(), bytes, cudaMemcpyHostToDevice, upload_.get()),
                      ("upload of block " + std::to_string(block) + "'s parameters").c_str());
    }
    st.free.record(upload_.get());
    st.used = true;
    k.uploaded->record(upload_.get());  // params() makes the compute stream wait for it
    k.upload_pending = true;
  }

  DType compute_;
  MirrorOptions options_;
  cuda::Stream copy_;
  // fence_param_reads: the point on the compute stream the uploads wait for.
  std::unique_ptr<cuda::Event> reads_fence_;
  bool fenced_ = false;
  cuda::Stream upload_;       // stage 3 uploads (upload_transient)
  cuda::Stream reduce_copy_;  // the comm thread's copies (device_reduce)
  cuda::Stream gather_copy_;  // the gather thread's uploads (load_block)
  std::vector<Block> blocks_;
  Staging staging_[2];
  int next_staging_ = 0;
  cuda::DeviceBuffer shard_scratch_, gather_scratch_;
  cuda::DeviceBuffer update_out_;  // stage 3, GPU-resident states: 16-bit new values on their way to the host
  optim::LambCuda lamb_;  // Lamb's scratch, on the compute stream
  cuda::PinnedBuffer shard_staging_;  // one reduced shard on its way to the host (the comm thread's)
  DType wire_ = DType::kF32;
  bool gather_back_ = false;
  int device_ = 0;
  cudaMemPool_t pool_ = nullptr;  // the stream-ordered pool of the parameters, gradients and wire copies
  cuda::DeviceBuffer norms_;  // per block, grad_squared_norm
  std::vector<std::vector<std::pair<int64_t, int64_t>>> norm_ranges_;  // set_norm_ranges; empty: all
  std::vector<std::vector<std::pair<int64_t, int64_t>>> no_decay_;     // set_no_decay; empty: none
  cuda::DeviceBuffer range_norms_;  // one double per range
  std::vector<void*> registered_;
  std::atomic<int64_t> bytes_{0}, peak_{0};  // freed on the comm thread too
};

}  // namespace

std::unique_ptr<DeviceMirror> DeviceMirror::make(const std::vector<int64_t>& padded_numel, DType compute,
                                                 const MirrorOptions& options) {
  if (cuda_status().devices == 0) throw Error("device \"cuda\": no GPU is visible (" + cuda_status().why + ")");
  return std::make_unique<CudaMirror>(padded_numel, compute, options);
}

}  // namespace zinc
