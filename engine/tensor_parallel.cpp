// Note [tensor parallelism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// tensor_parallel.autotp_size = T splits each decoder layer over T ranks,
// the Megatron way (Model::tensor_blocks says how, per parameter, with a
// TensorSplit):
//   - q|k|v and gate|up by rows: part t holds heads [t H/T, (t+1) H/T) of
//     q and the same share of the kv heads (whole kv heads, so GQA needs
//     no copies), and that share of the MLP's inner size. Its attention
//     and activation then run on its own heads and inner columns alone.
//   - o_proj and down_proj by columns: each part's product is a partial
//     sum of the branch's output; one all-reduce over the parts
//     (StepContext::tensor_all_reduce) adds them up before the residual
//     add (and the post-norm where a family has one). Their biases are
//     whole on every part and added by part 0 alone.
//   - in backward, the input gradients of q|k|v and gate|up are partial
//     sums in the same way: one all-reduce each, before the norm's
//     backward. So a layer costs two all-reduces of (B T, C) forward and
//     two backward (one more per recomputed forward with gradient
//     checkpointing).
//   - norms (and the position embedding) stay whole on every part. Every
//     part sees the same hidden state, computes the same gradients of them
//     and applies the same update, so they stay equal without a
//     reduction. Not so a whole parameter that each part applies to its
//     own heads only (Qwen3's per-head q and k norms: TensorSplit::
//     sum_grads): its gradient is summed over the parts at the step.
//     The embedding and the head split by vocabulary (Note [vocabulary
//     parts]), GPT-2's and the Llama families' alike.
// The grid: rank = (stage * D + replica) * T + part, the parts of one
// stage of one replica adjacent (inside a node, where links are fast), as
// Megatron and DeepSpeed number them. ZeRO partitions each part's blocks
// over the D replicas that hold the same part (stages 0-2: DeepSpeed's
// AutoTP training takes those).
// The gradient norm: per block, the squares of the split parameters over
// every part and those of the whole ones once (part 0's), summed over the
// parts in the same collective as the loss sums (whose counts come from
// part 0 alone: the parts see the same batch).
// Initial values (the seed's or a pretrained folder's) are the whole
// model's, each part cutting its own out of each parameter, so a run at T
// parts starts from the same weights as one at 1. Its sums are the same
// sums taken in another order, so its losses and weights agree to float
// rounding, not bit for bit.
// Exports (full_params) gather the parts and put the whole parameter back
// together: one Hugging Face folder from any grid.
// Note [vocabulary parts]
// ~~~~~~~~~~~~~~~~~~~~~~~
// With T tensor parts, part t of GPT-2 or of a Llama-family model holds
// v = ceil(V / T) rows [t v, (t+1) v) of the embedding and of the head (one
// matrix when tied), as Megatron's vocabulary-parallel embedding and
// cross-entropy do. Where T does not divide V (GPT-2's 50257) the last
// part's rows past V are padding, as Megatron pads its vocabulary: every
// part keeps the same shapes (the parts machinery needs equal layouts), the
// padding rows are no token's (the embedding never reads them), the head
// multiplies only the part's real rows (so they get no logits and no
// gradient: they stay zero), and checkpoints and exports hold the real V
// rows only (the split's range ends at V). The whole vocabulary stays on
// every part only where some part would hold padding alone (V < T).
//   - embedding: each part writes its rows for the tokens in its range and
//     zeros for the rest (kernels::embedding_part_forward); one all-reduce
//     of (B T, C) sums them into every part's hidden state. Backward adds
//     the (whole) gradient rows into the part's rows alone: no exchange.
//   - head: each part computes its columns of the logits; the
//     cross-entropy takes three steps with two small all-reduces between
//     them (kernels::cross_entropy_part_*): the rows' maxima (a max over
//     the parts), then each part's sum of exp(x - max) and the target's
//     logit where the target is its own (summed over the parts, in fp64),
//     then the loss, the same on every part, and the part's columns of
//     dlogits. The head's input gradient is a partial sum: one all-reduce
//     of (B T, C) in backward.
// So no rank ever holds (B T, V) logits or the whole (V, C) matrices:
// the head's activations and weights shrink with T, which is where a
// 128k vocabulary spends most of a small model's memory. The sums are the
// one-part run's in another order (float rounding, not bits).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine_impl.h"
#include "optim/optim.h"

namespace zinc {
namespace {

int64_t row_width(const ParamSpec& whole) {
  return whole.shape.ndim <= 1 ? 1 : whole.shape.numel() / whole.shape.dims[0];
}

// Copies part `p` (local values) to or from the whole parameter `w`:
// to_whole writes w from p, else p from w.
void move_part(const ParamSpec& part, const TensorSplit& sp, const ParamSpec& whole, float* p, float* w,
               bool to_whole) {
  auto copy = [&](float* local, float* all, int64_t n) {
    if (to_whole)
      std::memcpy(all, local, static_cast<size_t>(n) * sizeof(float));
    else
      std::memcpy(local, all, static_cast<size_t>(n) * sizeof(float));
  };
  switch (sp.kind) {
    case TensorSplit::kWhole:
      copy(p, w, whole.shape.numel());
      return;
    case TensorSplit::kRows: {
      const int64_t cols = row_width(whole);
      int64_t at = 0;
      for (const auto& [first, count] : sp.ranges) {
        copy(p + at * cols, w + first * cols, count * cols);
        at += count;
      }
      return;
    }
    case TensorSplit::kColumns: {
      const int64_t rows = whole.shape.dims[0], cols = row_width(whole);
      int64_t at = 0;
      for (const auto& [first, count] : sp.ranges) {
        for (int64_t r = 0; r < rows; ++r) copy(p + r * (part.shape.numel() / rows) + at, w + r * cols + first, count);
        at += count;
      }
      return;
    }
  }
}

}  // namespace

std::vector<std::string> describe_parts(const std::string& label, const char* key, int count, int world,
                                        const std::function<TensorPart(int, std::string*)>& part_of) {
  std::vector<std::string> out;
  for (int t = 0; t < count; ++t) {
    std::string why;
    const TensorPart part = part_of(t, &why);
    if (part.empty()) throw ConfigError(key, why);
    std::string ranks;
    int n = 0;
    for (int r = t; r < world; r += count, ++n) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    out.push_back(label + " " + std::to_string(t) + " (" + (n == 1 ? "rank " : "ranks ") + ranks + "): " + part.what);
  }
  return out;
}

std::vector<std::string> describe_tensor_parts(const Model& model, const Config& config) {
  const int T = static_cast<int>(config.tensor_parallel.size);
  return describe_parts("tensor part", "tensor_parallel.autotp_size", T, config.world_size,
                        [&](int t, std::string* why) { return model.tensor_part(t, T, why); });
}

void Engine::Impl::setup_grid() {
  stages = static_cast<int>(cfg.pipeline.stages);
  tp_size = static_cast<int>(cfg.tensor_parallel.size);
  const int replicas = world_all / (stages * tp_size);
  tp_rank = world_rank % tp_size;
  const int group = world_rank / tp_size;  // stage * replicas + replica
  stage = group / replicas;
  const int replica = group % replicas;
  if (tensor_split()) {
    for (int r = 0; r < tp_size; ++r) {
      std::string why;
      tp_parts.push_back(model->tensor_part(r, tp_size, &why));
      if (tp_parts.back().empty()) throw ConfigError("tensor_parallel.autotp_size", why);
      check_part(tp_parts.back(), r, "tensor part");
    }
    model->use_tensor_part(tp_rank, tp_size);
  }
  // The groups (collective over every rank, in this order on each).
  world_comm = comm;
  if (tensor_split()) tp_comm = world_comm->split(group, tp_rank);
  if (pipelined()) pipe_comm = world_comm->split(replica * tp_size + tp_rank, stage);
  comm = std::shared_ptr<comm::Communicator>(world_comm->split(stage * tp_size + tp_rank, replica));
  world = replicas;
  rank = replica;
  if (pipelined()) setup_pipeline();
  if (cfg.sequence_split()) setup_sequence(replica);
  if (tensor_split() && world_rank == 0) {
    std::string line = "tensor parallelism: " + std::to_string(tp_size) + " parts";
    if (pipelined()) line += " x " + std::to_string(stages) + " pipeline stages";
    const int d = replicas / sp_size;  // the sequence ranks of a replica hold the same parts
    if (sequence_ranks()) line += " x " + std::to_string(sp_size) + " sequence ranks";
    line += " x " + std::to_string(d) + " data-parallel " + (d == 1 ? "replica" : "replicas");
    for (const std::string& d : describe_tensor_parts(*model, cfg)) line += "; " + d;
    log_info(line);
  }
}

// Note [tensor parts on the GPU]
// On the GPU path the model's partial sums (o_proj's and down_proj's
// outputs, the input gradients of q|k|v and gate|up, the vocabulary parts'
// embedding rows) are in GPU memory: they are added over the parts' GPUs
// over NCCL (a communicator over tp_comm's ranks, DevicePath::
// device_communicator), after the compute stream's kernels that wrote them
// (DevicePath::before_device_transfer); the cross-entropy's row maxima and
// sums are host doubles and go over tp_comm. With the optimizer states in
// RAM (ZeRO-Offload, stages 1-2) the gradients every part sums are summed
// and the norm taken on the host, as on the CPU path. With them on the GPU
// (stages 0-2) the gradient the update reads is on the GPU
// (DevicePath::update_grads: the accumulator, or the reduced shard with
// replicas): its summed parameters are all-reduced there over NCCL, and the
// GPU takes the norm over the ranges this part counts (part_norm_ranges:
// a parameter every part holds whole on part 0 only, block_squares' rule).
// Not yet: ZeRO-3 and pipeline stages with parts on the GPU.
void Engine::Impl::tensor_all_reduce(float* data, int64_t n) {
  if (!tp_comm) return;
  const auto t0 = std::chrono::steady_clock::now();
  if (tp_device_comm) {
    device->before_device_transfer();
    tp_device_comm->all_reduce(data, data, n, DType::kF32);
  } else {
    tp_comm->all_reduce(data, data, n, DType::kF32);
  }
  tp_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::Impl::tensor_all_reduce_f64(double* data, int64_t n) {
  if (!tp_comm) return;
  const auto t0 = std::chrono::steady_clock::now();
  tp_comm->all_reduce_f64(data, n);
  tp_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::Impl::tensor_all_reduce_max_f64(double* data, int64_t n) {
  if (!tp_comm) return;
  const auto t0 = std::chrono::steady_clock::now();
  tp_comm->all_reduce_max_f64(data, n);
  tp_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const TensorSplit& Engine::Impl::split_of(size_t b, size_t p, int part) const {
  static const TensorSplit whole;
  return tp_parts.empty() ? whole : tp_parts[static_cast<size_t>(part)].splits[b][p];
}

void Engine::Impl::sum_part_gradients() {
  if (!tensor_split()) return;
  bool device_synced = false;
  for (size_t b = 0; b < blocks.size(); ++b) {
    BlockShard& s = blocks[b];
    if (s.frozen) continue;
    // GPU-resident states: the gradient the update reads is in GPU memory,
    // summed over the parts' GPUs (after the kernels that wrote it).
    float* dev = device->update_grads(static_cast<int>(b));
    if (dev && !device_synced) {
      device->before_device_transfer();
      device_synced = true;
    }
    comm::Communicator& over = dev ? *tp_device_comm : *tp_comm;
    float* g = dev ? dev : plan.optimizer_spans_block ? s.grad.as<float>() : reducer->reduced_shard(s);
    const int64_t own = plan.optimizer_spans_block ? 0 : s.part.own_offset();
    const int64_t end = own + (plan.optimizer_spans_block ? s.part.padded_numel : s.part.shard_numel);
    // Runs of adjacent summed parameters go as one all-reduce (with expert
    // ranks every dense weight is summed: a block or two per call).
    // Expert ranks' sums are data parallelism's (each rank's own batches):
    // they travel in communication_data_type, as ZeRO's reduction does,
    // rounded to it and back (host memory only: expert ranks do not run on
    // the GPU). A tensor part's sum is of partial products of one batch and
    // stays fp32.
    const DType wire = expert_parts && !dev ? cfg.wire_dtype() : DType::kF32;
    int64_t run_lo = 0, run_hi = 0;
    auto flush = [&] {
      // Every part's shard has the same bounds (the same layout), so each calls alike.
      if (run_lo < run_hi) {
        float* at = g + (run_lo - own);
        const int64_t n = run_hi - run_lo;
        if (is_16bit(wire)) {
          if (ep_wire.size() < static_cast<size_t>(n)) ep_wire.resize(static_cast<size_t>(n));
          convert_f32_to_16(at, ep_wire.data(), static_cast<size_t>(n), wire);
          over.all_reduce(ep_wire.data(), ep_wire.data(), n, wire);
          convert_16_to_f32(ep_wire.data(), at, static_cast<size_t>(n), wire);
        } else {
          over.all_reduce(at, at, n, DType::kF32);
        }
      }
      run_lo = run_hi = 0;
    };
    for (size_t p = 0; p < s.layout.offsets.size(); ++p) {
      if (!split_of(b, p, tp_rank).sum_grads) {  // the same on every part, in this order
        flush();
        continue;
      }
      const int64_t lo = std::max(own, s.layout.offsets[p]), hi = std::min(end, s.layout.offsets[p] + s.layout.numels[p]);
      if (lo >= hi) continue;
      if (run_lo < run_hi && lo > run_hi) flush();  // padding between them: not adjacent
      if (run_lo == run_hi) run_lo = lo;
      run_hi = hi;
    }
    flush();
  }
}

// Per block, the flat ranges whose squares count in this part's norm
// (block_squares' rule, for a device that takes the norm itself): every
// parameter but those every part holds whole, which count on part 0;
// adjacent ones as one range.
std::vector<std::vector<std::pair<int64_t, int64_t>>> Engine::Impl::part_norm_ranges() const {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> out(blocks.size());
  for (size_t b = 0; b < blocks.size(); ++b) {
    const BlockLayout& l = blocks[b].layout;
    for (size_t p = 0; p < specs()[b].params.size(); ++p) {
      if (split_of(b, p, tp_rank).kind == TensorSplit::kWhole && tp_rank != 0) continue;
      const int64_t lo = l.offsets[p], hi = lo + l.numels[p];
      if (!out[b].empty() && out[b].back().second == lo)
        out[b].back().second = hi;
      else
        out[b].emplace_back(lo, hi);
    }
  }
  return out;
}

// Lamb's per-tensor sums (w^2, u^2 pairs): a split parameter's are its
// parts' added up; one every part holds whole (with its gradient summed or
// the same on every part) counts on part 0 only, as block_squares does.
void Engine::Impl::sum_tensor_parts(std::vector<double>& sums, const std::vector<int>& first_tensor) {
  for (size_t b = 0; b < blocks.size() && tp_rank != 0; ++b)
    for (size_t p = 0; p < specs()[b].params.size(); ++p)
      if (split_of(b, p, tp_rank).kind == TensorSplit::kWhole) {
        const size_t k = static_cast<size_t>(first_tensor[b]) + p;
        sums[2 * k] = sums[2 * k + 1] = 0.0;
      }
  tensor_all_reduce_f64(sums.data(), static_cast<int64_t>(sums.size()));
}

double Engine::Impl::block_squares(size_t b) {
  BlockShard& s = blocks[b];
  if (!tensor_split()) return reducer->squared_norm(s);
  const float* g = reducer->reduced_shard(s);
  const int64_t own = s.part.own_offset(), end = own + s.part.shard_numel;
  double sum = 0.0;
  for (size_t p = 0; p < specs()[b].params.size(); ++p) {
    if (split_of(b, p, tp_rank).kind == TensorSplit::kWhole && tp_rank != 0) continue;  // counted on part 0
    const int64_t lo = std::max(own, s.layout.offsets[p]), hi = std::min(end, s.layout.offsets[p] + s.layout.numels[p]);
    if (lo < hi) sum += optim::grad_squared_norm(g + (lo - own), DType::kF32, hi - lo);
  }
  return sum;
}

std::vector<float> Engine::Impl::whole_from_parts(int block, const std::vector<float>& part) {
  const BlockLayout& pl = blocks[static_cast<size_t>(block)].layout;  // the same on every part
  const int64_t n = pl.numel;
  ZINC_CHECK(static_cast<int64_t>(part.size()) >= n, "whole_from_parts: a part shorter than its layout");
  std::vector<float> all(static_cast<size_t>(n * tp_size));
  tp_comm->all_gather(part.data(), all.data(), n, DType::kF32);
  const BlockSpec& whole = model->blocks()[static_cast<size_t>(block)];
  const BlockLayout wl = BlockLayout::from_spec(whole);
  std::vector<float> out(static_cast<size_t>(wl.numel), 0.0f);
  for (int r = 0; r < tp_size; ++r) {
    const BlockSpec& ps = tp_parts[static_cast<size_t>(r)].blocks[static_cast<size_t>(block)];
    for (size_t p = 0; p < whole.params.size(); ++p) {
      const TensorSplit& sp = split_of(static_cast<size_t>(block), p, r);
      if (sp.kind == TensorSplit::kWhole && r != 0) continue;
      move_part(ps.params[p], sp, whole.params[p], all.data() + r * n + pl.offsets[p], out.data() + wl.offsets[p],
                true);
    }
  }
  return out;
}

void Engine::Impl::cut_part(int b, int p, const float* whole, float* out) const {
  const ParamSpec& ps = specs()[static_cast<size_t>(b)].params[static_cast<size_t>(p)];
  const ParamSpec& ws = model->blocks()[static_cast<size_t>(b)].params[static_cast<size_t>(p)];
  move_part(ps, split_of(static_cast<size_t>(b), static_cast<size_t>(p), tp_rank), ws, out, const_cast<float*>(whole),
            false);
}

}  // namespace zinc
