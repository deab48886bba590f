#include "engine/param_coordinator.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"

namespace zinc {
namespace {

// O_DIRECT transfers are whole 4 KiB pages.
int64_t round_up_4k(int64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

}  // namespace

// Note [ZeRO-3 parameter coordination]
// -------------------------------------
// At stage 3 a rank keeps its shard of each block's compute parameters
// (BlockShard::compute_shard, written by the optimizer). A block is in full
// (`compute`) only while gathered; its state is a value (ParamState):
//   kSharded --start_gather--> kGathering --wait--> kGathered --free--> kSharded
//
// Trace. The acquires of a training pass (one micro-step's forward and
// backward) are the same every pass for a model whose control flow does not
// change. The first pass records them (kRecording): each acquire gathers on
// demand, and every rank checks with one small collective that all ranks
// acquire the same block at the same position, so ranks that take
// different paths fail at once with an error naming the position and the
// blocks, on every rank, instead of issuing mismatched collectives (a hang).
// end_pass() checks the end the same way (a rank with extra acquires) and the
// pass becomes the trace (kFollowing). The check costs one all-reduce of two
// doubles per acquire, and only in recording passes.
//
// Prefetch. While following, each acquire submits the gathers of the blocks
// the trace needs next, walking forward from the acquire's position until
// stage3_prefetch_bucket_size elements are in flight ahead or gathering one
// more block would put more than stage3_max_live_parameters elements in
// full on this rank. An acquire waits only if its block's gather has not
// finished. Prefetch stops at the end of the trace: the next pass's first
// blocks are prefetched when it begins (or right after the optimizer step),
// never before an update that would make them stale.
//
// Release. A block goes back to kSharded when the model releases it, unless
// it persists (its elements <= stage3_param_persistence_threshold, while the
// persistent blocks so far, in block order, stay within
// stage3_model_persistence_threshold: gathered at the start and after each
// step, kept for the whole run) or the trace uses it again within
// stage3_max_reuse_distance elements of other blocks' acquires (counted
// cyclically: the next pass's first acquires follow this pass's last). An
// acquire that must gather while the live elements would pass
// stage3_max_live_parameters first frees kept, unheld blocks (lowest block
// number first), so the live elements never exceed the limit by more than
// the block being acquired (and the blocks the model holds at once).
//
// Departure. A following pass whose acquire differs from the trace (or that
// ends early) warns once per run, not once per pass, waits for the gathers in
// flight, frees the unheld prefetched blocks, and records again from there:
// the pass so far matched the checked trace, so every rank has the same
// prefix. Every rank decides the same way from the same state, so the ranks
// submit the same gathers in the same order. (A departure on one rank only,
// a model bug, can leave the ranks in different collectives; the shm
// backend's timeout names the peer.)
//
// The optimizer writes compute_shard, so before_update() waits for every
// gather in flight, and after the update gather_after_step() gathers the
// persistent blocks again, frees the rest, and prefetches the trace's start.
//
// Parameter offload to NVMe (offload_param "nvme"): the shards of the blocks
// that do not persist live in one file of an NvmeStore, not in RAM. A gather
// of such a block first reads its shard into a page-locked buffer, on the
// gather stream's thread, so a prefetch reads from disk ahead of use as it
// gathers ahead; the buffer goes when the block is freed. The optimizer
// writes the new shard into a buffer of its own (shard_to_update), which
// finish_update() writes back on the same stream as soon as the optimizer
// is done with the block, in block order: the
// stream is FIFO, so every later read of the shard sees the new bytes. RAM
// then holds the persistent blocks and what the live-element bound allows.
// The weights are the all-gather of the same shards that stage 2 gathers
// after its update, so stages 2 and 3 give bit-identical results.

ParamCoordinator::ParamCoordinator(const StagePlan& plan, std::vector<BlockShard>& blocks, DType compute,
                                   comm::CommStream* gather, StateMemory& memory, const ZeroConfig& zero,
                                   std::unique_ptr<offload::NvmeStore> nvme, bool pin)
    : nvme_(std::move(nvme)),
      pin_(pin),
      plan_(plan),
      blocks_(blocks),
      compute_(compute),
      gather_(gather),
      memory_(&memory),
      zero_(zero),
      last_pos_(blocks.size(), 0) {
  if (!plan_.params_sharded) return;
  ZINC_CHECK(gather_ != nullptr, "stage 3 with several ranks needs the gather stream");
  std::vector<BlockLayout> layouts;
  for (const BlockShard& s : blocks_) layouts.push_back(s.layout);
  const std::vector<bool> keep = persistent_blocks(layouts, zero_);
  for (size_t b = 0; b < blocks_.size(); ++b) {
    blocks_[b].param_state = ParamState::kSharded;
    blocks_[b].persistent = keep[b];
  }
  if (nvme_) lay_out_nvme_file();
}

void ParamCoordinator::set_initial_shard(int block, const float* own) {
  ZINC_CHECK(plan_.params_sharded && !started_, "ParamCoordinator::set_initial_shard: stage 3, before start()");
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  const size_t n = static_cast<size_t>(s.part.shard_numel);
  if (s.nvme_offset >= 0) {
    convert_f32_to_16(own, staging_.data(), n, compute_);
    nvme_->write(nvme_file_, s.nvme_offset, staging_.data(), nvme_shard_bytes(s.part, compute_)).wait();
    return;
  }
  const size_t bytes = n * dtype_bytes(compute_);
  if (zero_.offload_param.device == OffloadDevice::kCpu) {
    s.compute_shard_pinned = offload::PinnedBuffer(bytes, zero_.offload_param.pin_memory);
    memory_->add(static_cast<int64_t>(s.compute_shard_pinned.footprint()));
  } else {
    s.compute_shard = memory_->alloc(bytes);
  }
  convert_f32_to_16(own, s.own_compute(), n, compute_);
}

void ParamCoordinator::start() {
  if (!plan_.params_sharded) return;
  ZINC_CHECK(!started_, "ParamCoordinator::start: twice");
  for (BlockShard& s : blocks_) {
    ZINC_CHECK(s.nvme_offset >= 0 || s.own_compute() != nullptr, "stage 3: every initial shard is set before start()");
    if (s.persistent) start_gather(s, /*prefetch=*/false);
  }
  started_ = true;
  if (staging_.data()) {
    memory_->add(-static_cast<int64_t>(staging_.footprint()));
    staging_ = offload::PinnedBuffer();
  }
}

std::vector<bool> ParamCoordinator::persistent_blocks(const std::vector<BlockLayout>& layouts,
                                                      const ZeroConfig& zero) {
  std::vector<bool> keep;
  int64_t persisting = 0;  // elements of the persistent blocks so far, in block order
  for (const BlockLayout& l : layouts) {
    const int64_t n = l.param_numel();  // as DeepSpeed counts: the parameters' own elements
    const bool k = n <= zero.stage3_param_persistence_threshold &&
                   n <= zero.stage3_model_persistence_threshold - persisting;
    if (k) persisting += n;
    keep.push_back(k);
  }
  return keep;
}

int64_t ParamCoordinator::nvme_shard_bytes(const Partition& part, DType compute) {
  return round_up_4k(part.shard_numel * static_cast<int64_t>(dtype_bytes(compute)));
}

// Every non-persistent block's shard in one file, at 4 KiB-aligned offsets
// (O_DIRECT); set_initial_shard writes them through the staging buffer.
void ParamCoordinator::lay_out_nvme_file() {
  int64_t bytes = 0, largest = 0;
  for (BlockShard& s : blocks_) {
    if (s.persistent) continue;
    s.nvme_offset = bytes;
    bytes += nvme_shard_bytes(s.part, compute_);
    largest = std::max(largest, nvme_shard_bytes(s.part, compute_));
  }
  if (bytes == 0) return;
  nvme_file_ = nvme_->create("compute_params", bytes);
  staging_ = offload::PinnedBuffer(static_cast<size_t>(largest), pin_);
  memory_->add(static_cast<int64_t>(staging_.footprint()));
}

ParamCoordinator::~ParamCoordinator() = default;

ParamCoordinator::ParamCoordinator(std::vector<BlockShard>& blocks, DType compute)
    : blocks_(blocks), compute_(compute), last_pos_(blocks.size(), 0) {}

// ---- acquire and release ------------------------------------------------------

BlockParams ParamCoordinator::acquire(int block) {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  if (plan_.params_sharded && pass_ == Pass::kTrain) {
    const size_t pos = current_.size();
    if (mode_ == Mode::kFollowing && (pos >= trace_.size() || trace_[pos] != block)) {
      stats_.departures += 1;
      if (!warned_departure_) {
        warned_departure_ = true;
        log_warn("ZeRO-3: a training pass acquired block " + std::to_string(block) + " at position " +
                 std::to_string(pos) + " where the recorded order has " +
                 (pos < trace_.size() ? "block " + std::to_string(trace_[pos]) : std::string("no more acquires")) +
                 "; prefetching stops, the gathers in flight finish, and the order is recorded again "
                 "(printed once per run)");
      }
      drain_prefetches();
      mode_ = Mode::kRecording;
    }
    if (mode_ == Mode::kRecording) check_agreement(block, pos);
    current_.push_back(block);
    last_pos_[static_cast<size_t>(block)] = pos;
  }
  if (plan_.params_sharded) {
    if (s.param_state == ParamState::kSharded) {
      // On demand: make room first, so that the live elements pass the limit
      // by at most this block.
      for (size_t b = 0; b < blocks_.size() && stats_.live_numel + s.part.padded_numel > zero_.stage3_max_live_parameters;
           ++b) {
        BlockShard& k = blocks_[b];
        if (k.param_state == ParamState::kGathered && k.held == 0 && !k.persistent) free_gathered(k);
      }
      start_gather(s, /*prefetch=*/false);
    }
    if (s.param_state == ParamState::kGathering) {
      if (!s.gather.done()) stats_.waited += 1;
      wait_gather(s);
    }
  }
  ZINC_CHECK(s.param_state == ParamState::kGathered, "an acquired block is gathered");
  s.held += 1;
  if (plan_.params_sharded && pass_ == Pass::kTrain && mode_ == Mode::kFollowing) prefetch_from(current_.size());
  // At stage 0 in fp32 the master weights are the compute weights.
  const void* base = s.compute.empty() ? static_cast<const void*>(s.master_compute) : s.compute.data();
  return BlockParams{base, compute_, &s.layout};
}

void ParamCoordinator::release(int block) noexcept {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  ZINC_CHECK(s.held > 0, "release of block " + std::to_string(block) + ", which is not held");
  s.held -= 1;
  if (plan_.params_sharded && s.held == 0 && !keep_after_release(block)) free_gathered(s);
}

bool ParamCoordinator::keep_after_release(int block) const {
  const BlockShard& s = blocks_[static_cast<size_t>(block)];
  if (s.persistent) return true;
  if (pass_ != Pass::kTrain || mode_ != Mode::kFollowing) return false;
  const size_t pos = last_pos_[static_cast<size_t>(block)];
  return pos < reuse_at_.size() && reuse_at_[pos] <= zero_.stage3_max_reuse_distance;
}

int ParamCoordinator::first_held() const {
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (blocks_[b].held > 0) return static_cast<int>(b);
  return -1;
}

// ---- passes and the trace -------------------------------------------------------

void ParamCoordinator::begin_pass(Pass pass) {
  // The last step's write-backs: a failed one is an error here, before any
  // pass could read a stale shard (the stream already runs them before any
  // later read).
  for (comm::CommHandle& h : pending_writes_) h.wait();
  pending_writes_.clear();
  pass_ = pass;
  current_.clear();
  if (plan_.params_sharded && pass == Pass::kTrain && mode_ == Mode::kFollowing) prefetch_from(0);
}

void ParamCoordinator::end_pass() {
  if (plan_.params_sharded && pass_ == Pass::kTrain) {
    if (mode_ == Mode::kFollowing && current_.size() != trace_.size()) {
      // Ended before the trace did: record this shorter pass instead.
      stats_.departures += 1;
      if (!warned_departure_) {
        warned_departure_ = true;
        log_warn("ZeRO-3: a training pass ended after " + std::to_string(current_.size()) + " acquires where the "
                 "recorded order has " + std::to_string(trace_.size()) + "; the order is recorded again "
                 "(printed once per run)");
      }
      drain_prefetches();
      mode_ = Mode::kRecording;
    }
    if (mode_ == Mode::kRecording) {
      check_agreement(static_cast<int>(blocks_.size()), current_.size());  // the end: a rank with more acquires
      finish_trace();
    }
  }
  pass_ = Pass::kNone;
}

// Every rank must acquire `value` (a block, or blocks_.size() for the end of
// the pass) at position `pos`: one all-reduce of (value, -value) for the
// maximum gives the largest and the smallest value over the ranks.
void ParamCoordinator::check_agreement(int value, size_t pos) {
  if (!gather_) return;
  double v[2] = {static_cast<double>(value), -static_cast<double>(value)};
  gather_->submit([&v](comm::Communicator& c) { c.all_reduce_max_f64(v, 2); }).wait();
  const int hi = static_cast<int>(v[0]), lo = static_cast<int>(-v[1]);
  if (hi == lo) return;
  const int end = static_cast<int>(blocks_.size());
  auto what = [end](int x) { return x == end ? std::string("the end of the pass") : "block " + std::to_string(x); };
  throw Error("ZeRO-3: the ranks' parameter acquires part at position " + std::to_string(pos) +
              " of the training pass (forward and backward): " + what(lo) + " on one rank, " + what(hi) +
              " on another; every rank must acquire the same blocks in the same order (does the model's control "
              "flow depend on the rank or its data?)");
}

void ParamCoordinator::finish_trace() {
  trace_ = current_;
  mode_ = Mode::kFollowing;
  stats_.trace_length = static_cast<int64_t>(trace_.size());
  // reuse_at_[p]: elements of the other acquires between p and the next use
  // of the same block, cyclically (the next pass repeats the trace).
  const size_t n = trace_.size();
  reuse_at_.assign(n, 0);
  for (size_t p = 0; p < n; ++p) {
    int64_t between = 0;
    for (size_t k = 1; k < n; ++k) {
      const int b = trace_[(p + k) % n];
      if (b == trace_[p]) break;
      between += blocks_[static_cast<size_t>(b)].part.padded_numel;
    }
    reuse_at_[p] = between;
  }
}

// ---- gathers ------------------------------------------------------------------------

void ParamCoordinator::use_device_gather(DeviceGather g) {
  ZINC_CHECK(plan_.params_sharded && !nvme_, "device gathers: stage 3 with the shards in RAM");
  for (BlockShard& s : blocks_) ZINC_CHECK(s.held == 0, "device gathers: no block is held");
  std::vector<bool> regather;
  for (BlockShard& s : blocks_) {
    regather.push_back(s.param_state != ParamState::kSharded);
    free_gathered(s);
  }
  device_ = std::move(g);
  if (!device_.stream) device_.stream = gather_;  // one rank: the uploads run on the coordinator's stream
  ZINC_CHECK(device_.stream, "device gathers: a stream to run them on");
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (regather[b]) {
      stats_.gathers -= 1;  // the same gather, on the device now
      stats_.gathered_numel -= blocks_[b].part.padded_numel;
      start_gather(blocks_[b], /*prefetch=*/false);
    }
}

// The buffers first (an allocation that fails leaves the block sharded),
// then the state, then the submission.
void ParamCoordinator::start_gather(BlockShard& s, bool prefetch) {
  const size_t es = dtype_bytes(compute_);
  BlockShard* sp = &s;
  const DType dt = compute_;
  if (device_.stream) {
    const int block = static_cast<int>(&s - blocks_.data());
    device_.begin(block);
    s.param_state = ParamState::kGathering;
    auto gather = device_.gather;
    s.gather = device_.stream->submit([gather, block](comm::Communicator& c) { gather(c, block); });
  } else if (s.nvme_offset >= 0) {
    s.compute = memory_->alloc(static_cast<size_t>(s.part.padded_numel) * es);
    s.param_state = ParamState::kGathering;
    // The read runs on the gather stream's thread, before the gather that
    // needs it and after any write-back of this shard submitted earlier.
    const int64_t n = nvme_shard_bytes(s.part, compute_);
    s.nvme_read = offload::PinnedBuffer(static_cast<size_t>(n), pin_);
    memory_->add(static_cast<int64_t>(s.nvme_read.footprint()));
    offload::NvmeStore* store = nvme_.get();
    const int file = nvme_file_;
    s.gather = gather_->submit([sp, dt, store, file, n](comm::Communicator& c) {
      store->read(file, sp->nvme_offset, sp->nvme_read.data(), n).wait();
      c.all_gather(sp->nvme_read.data(), sp->compute.data(), sp->part.shard_numel, dt);
    });
  } else {
    s.compute = memory_->alloc(static_cast<size_t>(s.part.padded_numel) * es);
    s.param_state = ParamState::kGathering;
    s.gather = gather_->submit([sp, dt](comm::Communicator& c) {
      c.all_gather(sp->own_compute(), sp->compute.data(), sp->part.shard_numel, dt);
    });
  }
  stats_.gathers += 1;
  stats_.gathered_numel += s.part.padded_numel;
  if (prefetch) stats_.prefetched += 1;
  stats_.live_numel += s.part.padded_numel;
  stats_.peak_live_numel = std::max(stats_.peak_live_numel, stats_.live_numel);
}

void ParamCoordinator::wait_gather(BlockShard& s) {
  s.gather.wait();
  s.gather = comm::CommHandle();
  s.param_state = ParamState::kGathered;
}

void ParamCoordinator::free_gathered(BlockShard& s) {
  if (s.param_state == ParamState::kSharded) return;
  if (s.param_state == ParamState::kGathering) wait_gather(s);  // the stream still writes it
  if (device_.stream) device_.end(static_cast<int>(&s - blocks_.data()));
  memory_->free(s.compute);
  if (s.nvme_read.data()) {
    memory_->add(-static_cast<int64_t>(s.nvme_read.footprint()));
    s.nvme_read = offload::PinnedBuffer();
  }
  s.param_state = ParamState::kSharded;
  stats_.live_numel -= s.part.padded_numel;
}

void ParamCoordinator::prefetch_from(size_t pos) {
  int64_t ahead = 0;
  for (size_t q = pos; q < trace_.size(); ++q) {
    BlockShard& s = blocks_[static_cast<size_t>(trace_[q])];
    const int64_t n = s.part.padded_numel;
    if (s.param_state == ParamState::kGathering) ahead += n;
    if (s.param_state != ParamState::kSharded) continue;
    if (ahead + n > zero_.stage3_prefetch_bucket_size || stats_.live_numel + n > zero_.stage3_max_live_parameters) break;
    start_gather(s, /*prefetch=*/true);
    ahead += n;
  }
}

// Every gather in flight finishes; the unheld, non-persistent blocks it
// brought are freed (their positions in the trace no longer hold).
void ParamCoordinator::drain_prefetches() {
  for (BlockShard& s : blocks_) {
    if (s.param_state == ParamState::kGathering) wait_gather(s);
    if (s.param_state == ParamState::kGathered && s.held == 0 && !s.persistent) free_gathered(s);
  }
}

void ParamCoordinator::before_update() {
  streamed_ = nullptr;  // an update that failed before its gather streams no more
  if (!plan_.params_sharded) return;
  for (BlockShard& s : blocks_)
    if (s.param_state == ParamState::kGathering) wait_gather(s);
}

char* ParamCoordinator::shard_to_update(int block) {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  if (s.nvme_offset < 0) return s.own_compute();
  if (!s.nvme_update) {
    const int64_t n = nvme_shard_bytes(s.part, compute_);
    s.nvme_update = std::make_shared<offload::PinnedBuffer>(static_cast<size_t>(n), pin_);
    memory_->add(static_cast<int64_t>(s.nvme_update->footprint()));
  }
  return s.nvme_update->as<char>();
}

void ParamCoordinator::finish_update(int block) {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  if (streamed_) {
    stream_updated_[static_cast<size_t>(block)] = 1;
    submit_streamed_buckets(/*all=*/false);
  }
  if (!s.nvme_update) return;
  std::shared_ptr<offload::PinnedBuffer> buf = std::move(s.nvme_update);
  offload::NvmeStore* store = nvme_.get();
  const int file = nvme_file_;
  const int64_t offset = s.nvme_offset;
  memory_->add(-static_cast<int64_t>(buf->footprint()));
  pending_writes_.push_back(gather_->submit([buf, store, file, offset](comm::Communicator&) {
    store->write(file, offset, buf->data(), static_cast<int64_t>(buf->bytes())).wait();
  }));
}

void ParamCoordinator::gather_after_step() {
  if (plan_.gather_params_after_step && streamed_) {
    submit_streamed_buckets(/*all=*/true);
    streamed_ = nullptr;
    gather_->synchronize();
    return;
  }
  if (plan_.gather_params_after_step) return gather_all_stages_1_2();
  if (!plan_.params_sharded) return;
  for (size_t b = 0; b < blocks_.size(); ++b) finish_update(static_cast<int>(b));  // any left
  for (BlockShard& s : blocks_) {
    ZINC_CHECK(s.held == 0, "no block is held at the optimizer step");
    if (s.param_state == ParamState::kSharded) continue;
    if (s.frozen && s.persistent) continue;  // not updated: the gathered block still holds it
    free_gathered(s);
    if (s.persistent) start_gather(s, /*prefetch=*/false);
  }
  if (mode_ == Mode::kFollowing) prefetch_from(0);
}

// Note [the gather streamed behind the update]
// At stages 1-2 on several ranks the update writes each rank's shard of
// every block, and the all-gather after it brings the other ranks' shards,
// in buckets of allgather_bucket_size elements (block order, frozen blocks
// left out: every rank holds them whole). A bucket depends only on its own
// blocks' updates, and the update visits the blocks in order, so where the
// device path asks (stream_next_gather: the GPU path, whose uploads and next
// forward wait for the gather) a bucket goes to the gather stream as soon
// as the update has finished its last block: the gather of the first
// buckets runs while the CPU updates the rest, and each block's upload can
// start as it arrives. Every rank submits the same buckets in the same
// order (a bucket only after the ones before it), whenever its own update
// gets there; what a rank's update passes by (a block without a span
// here) is submitted at gather_after_step, as before. The bytes gathered
// are the same, so the weights are too. The update rule must run no
// collective of its own (UpdateRule::may_run_behind), and the CPU path
// keeps the gather after the update: there the two would share the same
// cores and memory bandwidth.
std::vector<std::vector<BlockShard*>> ParamCoordinator::gather_buckets_1_2() {
  std::vector<std::vector<BlockShard*>> buckets(1);
  int64_t numel = 0;
  for (BlockShard& s : blocks_) {
    if (s.frozen) continue;  // not updated: every rank still holds it whole
    buckets.back().push_back(&s);
    numel += s.part.padded_numel;
    if (numel >= zero_.allgather_bucket_size) {
      buckets.emplace_back();
      numel = 0;
    }
  }
  if (buckets.back().empty()) buckets.pop_back();
  return buckets;
}

void ParamCoordinator::submit_gather_bucket(const std::vector<BlockShard*>& bucket) {
  ZINC_CHECK(gather_ != nullptr, "gather_after_step needs the gather stream (several ranks)");
  gather_->submit([bucket, dt = compute_, gathered = streamed_, blocks = blocks_.data()](comm::Communicator& c) {
    const size_t es = dtype_bytes(dt);
    for (BlockShard* s : bucket) {
      char* base = s->compute.as<char>();
      c.all_gather(base + static_cast<size_t>(s->part.own_offset()) * es, base, s->part.shard_numel, dt);
    }
    // After the whole bucket, so that a failure here leaves no peer
    // waiting in a collective this rank skipped.
    if (gathered)
      for (BlockShard* s : bucket) gathered(static_cast<int>(s - blocks));
  });
}

void ParamCoordinator::gather_all_stages_1_2() {
  for (const std::vector<BlockShard*>& bucket : gather_buckets_1_2()) submit_gather_bucket(bucket);
  gather_->synchronize();
}

void ParamCoordinator::stream_next_gather(std::function<void(int)> gathered) {
  if (!plan_.gather_params_after_step || !gathered) return;
  if (stream_buckets_.empty()) stream_buckets_ = gather_buckets_1_2();
  streamed_ = std::move(gathered);
  stream_updated_.assign(blocks_.size(), 0);
  stream_next_ = 0;
}

void ParamCoordinator::submit_streamed_buckets(bool all) {
  for (; stream_next_ < stream_buckets_.size(); ++stream_next_) {
    const std::vector<BlockShard*>& bucket = stream_buckets_[stream_next_];
    if (!all && !std::all_of(bucket.begin(), bucket.end(), [&](const BlockShard* s) {
          return stream_updated_[static_cast<size_t>(s - blocks_.data())] != 0;
        }))
      return;
    submit_gather_bucket(bucket);
  }
}

}  // namespace zinc
