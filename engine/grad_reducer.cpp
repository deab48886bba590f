#include "engine/grad_reducer.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "optim/optim.h"

namespace zinc {

namespace {
// Zeroes a block's gradient buffer (padded elements) in part: with `marked`
// its overwritten parameters only, else everything else (the unmarked
// parameters, the layout's gaps and the padding). Note [gradients written,
// not zeroed] in engine/model.h.
void zero_grad_ranges(float* g, const BlockLayout& l, int64_t padded, bool marked) {
  int64_t at = 0;  // first element not yet passed
  for (size_t p = 0; p < l.offsets.size(); ++p) {
    if (!l.overwrite[p]) continue;
    const int64_t b = l.offsets[p], e = b + l.numels[p];
    if (marked) std::memset(g + b, 0, static_cast<size_t>(e - b) * 4);
    else if (b > at) std::memset(g + at, 0, static_cast<size_t>(b - at) * 4);
    at = e;
  }
  if (!marked && padded > at) std::memset(g + at, 0, static_cast<size_t>(padded - at) * 4);
}
}  // namespace

GradReducer::GradReducer(const StagePlan& plan, std::vector<BlockShard>& blocks, comm::CommStream* stream,
                         StateMemory& memory, const Options& options)
    : plan_(plan), blocks_(blocks), stream_(stream), memory_(memory), options_(options) {
  if (plan_.world > 1 && !stream_) throw Error("GradReducer: several ranks need a comm stream");
  ZINC_CHECK(options_.bucket_numel > 0, "GradReducer: no bucket size (the engine sets reduce_bucket_size)");
  if (plan_.grads_on_nvme) {
    ZINC_CHECK(stream_ != nullptr && options_.spill != nullptr && !options_.device_reduce && options_.host_grads,
               "GradReducer: gradients on NVMe need a stream and a spill, on the host");
  }
  if (plan_.world == 1) options_.wire = DType::kF32;
  int64_t max_padded = 0, max_shard = 0;
  for (BlockShard& s : blocks_) {
    s.grad_fresh = options_.model_grads;
    const size_t padded = static_cast<size_t>(s.part.padded_numel);
    if (s.frozen) {  // no gradient at all
      s.grad_state = GradState::kFreed;
      continue;
    }
    if (options_.device_reduce || !options_.host_grads) {
      s.grad_state = GradState::kAccumulating;  // the full gradient lives on the GPU only
    } else if (plan_.grad_always_allocated) {
      s.grad = memory_.alloc(padded * 4);
      s.grad_state = GradState::kAccumulating;
    } else {
      s.grad_state = GradState::kFreed;  // allocated when backward first asks (grads())
    }
    if (plan_.grad_shard_buffer) s.grad_shard = memory_.alloc(static_cast<size_t>(s.part.shard_numel) * 4);
    max_padded = std::max(max_padded, s.part.padded_numel);
    max_shard = std::max(max_shard, s.part.shard_numel);
  }
  if ((plan_.gather_reduced_grads || (plan_.grads_on_nvme && plan_.world > 1)) && !options_.device_reduce)
    scratch_shard_ = memory_.alloc(static_cast<size_t>(max_shard) * 4);
  if (is_16bit(options_.wire) && !options_.device_reduce)
    scratch_wire_ = memory_.alloc(static_cast<size_t>(max_padded + max_shard) * 2);
}

void GradReducer::begin_backward(bool boundary) {
  boundary_ = boundary;
  for (BlockShard& s : blocks_) s.grads_reported = false;
}

float* GradReducer::grads(int block) {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  ZINC_CHECK(!s.frozen, "GradReducer::grads: a frozen block has no gradients");
  if (s.grad_state == GradState::kFreed) {
    s.reduction.wait();
    s.grad = memory_.alloc(static_cast<size_t>(s.part.padded_numel) * 4, /*zero=*/false);
    clear_for_window(s);
    s.grad_state = GradState::kAccumulating;
  }
  return s.grad.as<float>();
}

void GradReducer::clear_for_window(BlockShard& s) {
  if (options_.model_grads)
    zero_grad_ranges(s.grad.as<float>(), s.layout, s.part.padded_numel, false);
  else
    std::memset(s.grad.data(), 0, s.grad.bytes());
  s.grad_fresh = options_.model_grads;
}

bool GradReducer::take_fresh(int block) {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  const bool fresh = s.grad_fresh;
  s.grad_fresh = false;
  return fresh;
}

void GradReducer::settle_fresh(BlockShard& s) {
  if (!s.grad_fresh || s.frozen || s.grad.empty()) return;
  zero_grad_ranges(s.grad.as<float>(), s.layout, s.part.padded_numel, true);
  s.grad_fresh = false;
}

void GradReducer::ready(int block) {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  // Reported without a product into it: its gradient is zeros, as a buffer.
  if (!s.frozen && s.grad_state == GradState::kFreed && options_.host_grads && !options_.device_reduce) grads(block);
  settle_fresh(s);
  if (!boundary_) return;  // no-sync: accumulate locally
  bucket_.push_back(block);
  bucket_numel_ += blocks_[static_cast<size_t>(block)].part.padded_numel;
  // One rank with the gradients on NVMe has no collective to batch: each
  // block is written as soon as it is ready.
  if (bucket_numel_ >= options_.bucket_numel || (plan_.world == 1 && plan_.grads_on_nvme)) flush_bucket();
  reap();
}

void GradReducer::end_backward() {
  for (BlockShard& s : blocks_) settle_fresh(s);  // blocks this backward never touched
  if (boundary_) flush_bucket();
  boundary_ = false;
}

// A full bucket goes to the comm stream. With overlap_comm backward goes on
// meanwhile; without it backward waits here, as DeepSpeed's non-overlapped
// reduction does (and stage 2 still frees as it goes).
void GradReducer::flush_bucket() {
  if (bucket_.empty()) return;
  submit(bucket_);
  if (stream_ && (!options_.overlap || inflight_.size() > kMaxInflight)) {
    const size_t keep = options_.overlap ? kMaxInflight : 0;
    while (inflight_.size() > keep) {
      inflight_.front().wait();
      inflight_.pop_front();
    }
  }
  reap();
  bucket_.clear();
  bucket_numel_ = 0;
}

void GradReducer::submit(const std::vector<int>& ids) {
  std::vector<BlockShard*> bs;
  for (int id : ids) bs.push_back(&blocks_[static_cast<size_t>(id)]);
  if (plan_.world == 1 && !plan_.grads_on_nvme) {  // one rank: the gradient already is the sum
    for (BlockShard* s : bs) s->grad_state = GradState::kReduced;
    return;
  }
  const bool gather = plan_.gather_reduced_grads;
  if (options_.device_reduce) {
    std::vector<std::pair<int, float*>> jobs;
    for (int id : ids) jobs.emplace_back(id, blocks_[static_cast<size_t>(id)].grad_shard.as<float>());  // null at stage 0
    auto reduce = options_.device_reduce;
    comm::CommHandle h = stream_->submit([jobs, reduce](comm::Communicator& c) {
      for (const auto& [id, out] : jobs) reduce(c, id, out);
    });
    for (BlockShard* s : bs) {
      s->reduction = h;
      s->grad_state = GradState::kReducing;
    }
    inflight_.push_back(h);
    buckets_submitted_ += 1;
    return;
  }
  float* shard_scratch = scratch_shard_.empty() ? nullptr : scratch_shard_.as<float>();
  uint16_t* wire = scratch_wire_.empty() ? nullptr : scratch_wire_.as<uint16_t>();
  const DType wt = options_.wire;
  // Gradients on NVMe: the reduced shard goes to the scratch (on one rank it
  // is the full gradient itself), its squares are summed, and it is stored.
  std::function<void(int, const float*)> spill = plan_.grads_on_nvme ? options_.spill : nullptr;
  const bool reduce = plan_.world > 1;
  comm::CommHandle h = stream_->submit([bs, ids, gather, shard_scratch, wire, wt, spill, reduce](comm::Communicator& c) {
    for (size_t k = 0; k < bs.size(); ++k) {
      BlockShard* s = bs[k];
      const int64_t padded = s->part.padded_numel, shard = s->part.shard_numel;
      float* shard_out = gather || (spill && reduce) ? shard_scratch : spill ? s->grad.as<float>() : s->grad_shard.as<float>();
      if (!reduce) {
        // one rank: nothing to reduce
      } else if (wire) {
        uint16_t* shard16 = wire + padded;
        convert_f32_to_16(s->grad.as<float>(), wire, static_cast<size_t>(padded), wt);
        c.reduce_scatter(wire, shard16, shard, wt);
        convert_16_to_f32(shard16, shard_out, static_cast<size_t>(shard), wt);
      } else {
        c.reduce_scatter(s->grad.data(), shard_out, shard, DType::kF32);
      }
      if (gather) c.all_gather(shard_out, s->grad.data(), shard, DType::kF32);
      if (spill) {
        s->grad_squares = optim::grad_squared_norm(shard_out, DType::kF32, shard);
        spill(ids[k], shard_out);
      }
    }
  });
  for (BlockShard* s : bs) {
    s->reduction = h;
    s->grad_state = GradState::kReducing;
  }
  inflight_.push_back(h);
  buckets_submitted_ += 1;
}

// Stage 2: free the full gradient of every block whose reduction finished.
void GradReducer::reap() {
  if (plan_.grad_always_allocated) return;
  for (BlockShard& s : blocks_)
    if (s.grad_state == GradState::kReducing && s.reduction.done()) {
      s.reduction.wait();  // rethrows a failure
      s.reduction = comm::CommHandle();
      memory_.free(s.grad);
      s.grad_state = GradState::kFreed;
    }
}

void GradReducer::wait_all() {
  if (stream_) stream_->synchronize();
  inflight_.clear();
  for (BlockShard& s : blocks_)
    if (s.grad_state == GradState::kReducing) {
      s.grad_state = GradState::kReduced;
      if (plan_.grads_on_nvme) memory_.free(s.grad);  // stored: the optimizer reads it from NVMe
    }
}

float* GradReducer::reduced_shard(BlockShard& s) {
  ZINC_CHECK(!plan_.grads_on_nvme, "GradReducer::reduced_shard: the reduced gradients are on NVMe");
  return plan_.grad_shard_buffer ? s.grad_shard.as<float>() : s.grad.as<float>() + s.part.own_offset();
}

double GradReducer::squared_norm(BlockShard& s) {
  if (plan_.grads_on_nvme) return s.grad_squares;
  return optim::grad_squared_norm(reduced_shard(s), DType::kF32, s.part.shard_numel);
}

void GradReducer::reset_after_step() {
  for (BlockShard& s : blocks_) {
    s.reduction = comm::CommHandle();
    if (s.frozen) continue;
    if (!plan_.grad_always_allocated && !options_.device_reduce && options_.host_grads) {
      memory_.free(s.grad);
      s.grad_state = GradState::kFreed;
    } else {
      if (!s.grad.empty()) clear_for_window(s);
      s.grad_state = GradState::kAccumulating;
    }
  }
}

}  // namespace zinc
