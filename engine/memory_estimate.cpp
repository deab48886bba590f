#include "engine/memory_estimate.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "engine/update_rule.h"
#include "kernels/kernels.h"
#include "engine/device_mirror.h"
#include "engine/engine.h"
#include "engine/gpu_offload.h"
#include "engine/grad_reducer.h"
#include "engine/param_coordinator.h"
#include "engine/partition.h"
#include "engine/shard.h"
#include "offload/swapper.h"

namespace zinc {
namespace {

std::string millions(int64_t n) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fM", static_cast<double>(n) / 1e6);
  return buf;
}

}  // namespace

int64_t MemoryEstimate::sum(const std::vector<MemoryPart>& parts) {
  int64_t n = 0;
  for (const MemoryPart& p : parts) n += p.bytes;
  return n;
}

namespace {
int64_t state_sum(const std::vector<MemoryPart>& parts) {
  int64_t n = 0;
  for (const MemoryPart& p : parts)
    if (p.model_state) n += p.bytes;
  return n;
}
}  // namespace

int64_t MemoryEstimate::training_state_bytes() const { return state_sum(training); }

int64_t MemoryEstimate::model_state_bytes() const { return std::max(state_sum(setup), state_sum(training)); }

int64_t MemoryEstimate::ram_bytes() const { return process_bytes + std::max(sum(setup), sum(training)); }

namespace {

// One rank's estimate; with pipeline stages (pp), a rank of stage `stage`:
// its own blocks only, its layers' activation sets, and the hidden states
// that cross to its neighbours.
MemoryEstimate estimate_rank(const Model& model, const Config& c, int64_t seq_len, const PipelinePlan* pp,
                             int stage, const std::vector<BlockSpec>& specs) {
  MemoryEstimate e;
  const int world = c.zero_group_size();  // the ranks ZeRO partitions over
  const ZeroConfig& z = c.zero;
  const bool param_offload = z.offload_param.device != OffloadDevice::kNone;
  const StagePlan plan = StagePlan::make(z.stage, world, param_offload, c.gradients_on_nvme());
  const GpuPlan gpu_plan = GpuPlan::make(c, world);  // used where "device" is "cuda"
  const DType dtype = c.compute_dtype();
  const int64_t es = static_cast<int64_t>(dtype_bytes(dtype));
  e.stage = z.stage;
  e.world = world;

  // The blocks as the engine lays them out (Engine::Impl::allocate_and_init).
  std::vector<BlockLayout> layouts;
  std::vector<Partition> parts;
  std::vector<int64_t> spans;
  int64_t padded_all = 0, shard_all = 0, span_all = 0, max_padded = 0, max_shard = 0;
  // The trained blocks' (BlockSpec::frozen ones have no gradients) and the
  // frozen blocks' elements.
  int64_t g_padded_all = 0, g_shard_all = 0, g_max_padded = 0, g_max_shard = 0, frozen_padded = 0;
  int64_t pinned_states = 0, pinned_shards = 0;  // page-locked buffers' footprints, one per block
  for (size_t b = 0; b < specs.size(); ++b) {
    const BlockSpec& spec = specs[b];
    if (pp && !pp->holds(static_cast<int>(b), stage)) {  // another stage's: nothing of it here
      layouts.push_back(BlockLayout{});
      parts.push_back(Partition::make(0, world, 0));
      spans.push_back(0);
      continue;
    }
    try {
      layouts.push_back(BlockLayout::from_spec(spec));
    } catch (const Error& err) {
      throw ConfigError("model", std::string("its sizes make a block no count holds (") + err.what() +
                                     "); lower the model's widths");
    }
    parts.push_back(Partition::make(layouts.back().numel, world, 0));
    const Partition& p = parts.back();
    spans.push_back(spec.frozen ? 0 : plan.optimizer_numel(p));
    if (spec.frozen) {
      frozen_padded += p.padded_numel;
    } else {
      g_padded_all += p.padded_numel;
      g_shard_all += p.shard_numel;
      g_max_padded = std::max(g_max_padded, p.padded_numel);
      g_max_shard = std::max(g_max_shard, p.shard_numel);
    }
    pinned_states += static_cast<int64_t>(offload::PinnedBuffer::footprint(static_cast<size_t>(12 * spans.back())));
    pinned_shards += static_cast<int64_t>(offload::PinnedBuffer::footprint(static_cast<size_t>(p.shard_numel * es)));
    padded_all += p.padded_numel;
    shard_all += p.shard_numel;
    span_all += spans.back();
    max_padded = std::max(max_padded, p.padded_numel);
    max_shard = std::max(max_shard, p.shard_numel);
  }
  const std::string dname(dtype_name(dtype));

  // ---- optimizer states: master, m, v ----
  MemoryPart opt{"optimizer states (fp32 master, Adam m, v)", 12 * span_all,
                 "12 B x " + millions(span_all) + (plan.optimizer_spans_block ? " elements (every block)" :
                                                                                 " elements (this rank's shards)")};
  switch (z.offload_optimizer.device) {
    case OffloadDevice::kNone: break;
    case OffloadDevice::kCpu:
      opt.name += ", page-locked";
      opt.bytes = pinned_states;
      opt.note += ", one buffer per block (2 MiB-aligned from 2 MiB)";
      break;
    case OffloadDevice::kNvme: {
      offload::SwapperOptions so;
      so.buffer_count = z.offload_optimizer.buffer_count;
      so.sub_group_size = z.sub_group_numel();
      so.gradients = plan.grads_on_nvme;
      const offload::OptimizerSwapper::Plan sp = offload::OptimizerSwapper::plan(so, spans);
      opt = {"optimizer swap buffers", sp.buffer_bytes,
             std::to_string(sp.buffer_count) + (so.gradients ? " x 16 B x " : " x 12 B x ") + millions(sp.max_count) +
                 " elements (the largest sub-group, sub_group_size" + (so.gradients ? "; states and gradient)" : ")")};
      e.disk.push_back({"optimizer states (" + z.offload_optimizer.nvme_path + ")", sp.file_bytes,
                        std::to_string(sp.groups.size()) + " sub-groups of master, m, v"});
      if (so.gradients)
        e.disk.push_back({"gradients (" + z.offload_optimizer.nvme_path + ")", sp.grad_file_bytes,
                          "4 B x " + millions(span_all) + " elements: the reduced fp32 gradients (ZeRO-3)"});
      break;
    }
  }

  // ---- compute parameters ----
  std::vector<MemoryPart> setup_params, train_params;
  // The compute parameters present in full at once (the GPU holds the same:
  // DeviceMirror's transient parameters at stage 3).
  int64_t full_params = padded_all;
  std::string full_params_why = millions(padded_all) + " elements";
  int64_t update_bytes = 0;  // ZeRO-3 with parameters on NVMe: a new shard in RAM during the step
  if (!plan.params_sharded) {
    if (plan.compute_copy(dtype))
      train_params.push_back({std::string("parameters (") + dname + " compute copy)", es * padded_all,
                              std::to_string(es) + " B x " + millions(padded_all) + " elements"});
    else if (frozen_padded > 0)  // the master weights compute, but frozen blocks have none
      train_params.push_back({std::string("frozen parameters (") + dname + ")", es * frozen_padded,
                              std::to_string(es) + " B x " + millions(frozen_padded) + " elements"});
  } else {
    const std::vector<bool> keep = ParamCoordinator::persistent_blocks(layouts, z);
    int64_t max_np_update = 0;
    int64_t persist_padded = 0, persist_shard = 0, np_shard = 0, np_padded = 0, np_file = 0, np_read = 0, max_np_read = 0,
            max_np_padded = 0;
    for (size_t b = 0; b < parts.size(); ++b) {
      if (keep[b]) {
        persist_padded += parts[b].padded_numel;
        persist_shard += parts[b].shard_numel;
      } else {
        np_padded += parts[b].padded_numel;
        np_shard += parts[b].shard_numel;
        const int64_t f = ParamCoordinator::nvme_shard_bytes(parts[b], dtype);
        np_file += f;
        const int64_t fp = static_cast<int64_t>(offload::PinnedBuffer::footprint(static_cast<size_t>(f)));
        np_read += fp;
        max_np_read = std::max(max_np_read, fp);
        if (!specs[b].frozen) max_np_update = std::max(max_np_update, fp);  // a frozen block is never updated
        max_np_padded = std::max(max_np_padded, parts[b].padded_numel);
      }
    }
    const bool nvme = z.offload_param.device == OffloadDevice::kNvme;
    const std::string shard_name = std::string("parameter shards (") + dname +
                                   (z.offload_param.device == OffloadDevice::kCpu ? ", page-locked)" : ")");
    // Each block's shard is built in turn (ParamCoordinator::set_initial_shard):
    // kept in RAM, or with NVMe written out through one staging buffer.
    const bool pinned = z.offload_param.device == OffloadDevice::kCpu;
    const int64_t setup_ram_shard = nvme ? persist_shard : shard_all;
    if (setup_ram_shard > 0)
      setup_params.push_back({shard_name, pinned ? pinned_shards : es * setup_ram_shard,
                              std::to_string(es) + " B x " + millions(setup_ram_shard) + " elements" +
                                  (nvme ? " (persistent blocks)" : "")});
    if (nvme && max_np_read > 0)
      setup_params.push_back({"parameter write staging (page-locked)", max_np_read,
                              "the largest shard on NVMe, on its way to disk"});
    if (persist_padded > 0)
      setup_params.push_back({"persistent blocks, gathered", es * persist_padded,
                              millions(persist_padded) + " elements (stage3_param_persistence_threshold)"});
    const int64_t ram_shard = nvme ? persist_shard : shard_all;
    if (ram_shard > 0)
      train_params.push_back({shard_name, pinned ? pinned_shards : es * ram_shard,
                              std::to_string(es) + " B x " + millions(ram_shard) + " elements" +
                                  (nvme ? " (persistent blocks)" : "")});
    if (nvme && np_file > 0)
      e.disk.push_back({"parameter shards (" + z.offload_param.nvme_path + ")", np_file,
                        "the non-persistent blocks' " + std::string(dname) + " shards, 4 KiB-aligned"});
    // Gathered at once (ParamCoordinator): with a reuse distance that spans
    // the whole trace every block stays gathered once the trace is known;
    // otherwise the prefetch window and the held blocks (the built-in models
    // hold at most two), never more than max_live plus one block.
    int64_t gathered = np_padded;
    std::string why = "every block: stage3_max_reuse_distance covers the whole pass";
    if (z.stage3_max_reuse_distance < padded_all) {
      gathered = std::min({np_padded, z.stage3_prefetch_bucket_size + 2 * max_np_padded,
                           std::max<int64_t>(0, z.stage3_max_live_parameters - persist_padded) + max_np_padded});
      why = "at most the prefetch window and two held blocks, within stage3_max_live_parameters plus one block";
    }
    // On the GPU the gathers land in GPU memory (the engine's device
    // gathers on several ranks, its uploads from the shards on one), not in RAM.
    if (!(c.device == Device::kCuda && (gpu_plan.device_gathers || gpu_plan.upload_gathers)))
      train_params.push_back({std::string("gathered blocks (") + dname + ")", es * (persist_padded + gathered),
                              millions(persist_padded + gathered) + " elements: " + why});
    full_params = persist_padded + gathered;
    full_params_why = millions(full_params) + " elements, the gathered blocks";
    if (nvme && np_padded > 0) {
      // One read buffer per gathered block on NVMe; during the step also one
      // block's new shard on its way back (update_bytes, added below).
      const int64_t reads = static_cast<int64_t>(static_cast<__int128>(np_read) * gathered / np_padded);
      train_params.push_back({"parameter read buffers", reads, "a shard per gathered block"});
      update_bytes = max_np_update;
    }
  }

  // ---- gradients (GradReducer) ----
  // On the GPU with several ranks the full gradients are reduced there
  // (Note [the GPU path]): the host holds only the reduced shards.
  const bool gpu_reduce = c.device == Device::kCuda && world > 1;
  // GPU-resident states on one rank: no gradient reaches the host.
  const bool gpu_only_grads = c.device == Device::kCuda && !gpu_plan.host_grads;
  std::vector<MemoryPart> grads;
  // Full gradients that exist only in backward (stage 2 and up on several
  // ranks on the host; from stage 2 on the GPU): the elements at most.
  int64_t transient_full = g_padded_all;
  std::string transient_why = "every block: gradient_accumulation_steps > 1 keeps them (no-sync)";
  if (c.gradient_accumulation_steps == 1) {
    const int64_t in_flight = z.overlap_comm ? static_cast<int64_t>(GradReducer::kMaxInflight) + 1 : 1;
    // One rank with the gradients on NVMe writes each block as it is ready
    // (GradReducer::ready): a bucket of one block.
    const int64_t bucket = world == 1 && plan.grads_on_nvme ? 1 : z.reduce_bucket_numel();
    transient_full = std::min(g_padded_all, in_flight * (bucket + g_max_padded) + g_max_padded);
    transient_why = transient_full == g_padded_all ? "every block: reduce_bucket_size holds the whole model"
                    : bucket == 1 ? "the blocks on their way to NVMe and the block being computed"
                                  : "the buckets in flight (reduce_bucket_size) and the block being computed";
  }
  if (gpu_reduce || gpu_only_grads) {
    // nothing full on the host
  } else if (plan.grad_always_allocated) {
    grads.push_back({"gradients (fp32, full)", 4 * g_padded_all, "4 B x " + millions(g_padded_all) + " elements"});
  } else {
    grads.push_back({"gradients (fp32, full, in backward)", 4 * transient_full,
                     millions(transient_full) + " elements: " + transient_why});
  }
  if (update_bytes > 0 && !grads.empty()) {
    // The step's peak is the backward's without the full gradients where
    // they are gone by then (stage >= 2 with several ranks and no overlap:
    // the last bucket is waited for and freed before backward returns; with
    // the gradients on NVMe the step's wait frees the last stored ones),
    // plus the update buffer.
    const int64_t full = grads.front().bytes;
    const bool freed = !plan.grad_always_allocated && (!z.overlap_comm || plan.grads_on_nvme);
    const int64_t extra = freed ? std::max<int64_t>(0, update_bytes - full) : update_bytes;
    if (extra > 0)
      grads.push_back({"parameter update buffer (in the step)", extra, "one block's new shard, written back to NVMe"});
  }
  if (plan.grad_shard_buffer)
    grads.push_back({"gradient shards (fp32, reduced)", 4 * g_shard_all, "4 B x " + millions(g_shard_all) + " elements"});
  if (plan.gather_reduced_grads || (plan.grads_on_nvme && world > 1))
    grads.push_back({"reduction scratch", 4 * g_max_shard,
                     plan.grads_on_nvme ? "the largest shard, fp32, on its way to NVMe" : "the largest shard, fp32"});
  if (is_16bit(c.wire_dtype()) && world > 1 && !gpu_reduce) {
    const std::string w(dtype_name(c.wire_dtype()));
    grads.push_back({w + " wire buffer", 2 * (g_max_padded + g_max_shard), "the largest block and shard, " + w});
  }

  // What the update rule keeps beyond master, m and v (update_rule.h).
  for (MemoryPart& p : update_rule_memory(c, layouts, span_all, world)) grads.push_back(std::move(p));

  // ---- the two phases ----
  e.setup.push_back(opt);
  for (MemoryPart& p : setup_params) e.setup.push_back(p);
  if (!plan.params_sharded) e.setup.insert(e.setup.end(), train_params.begin(), train_params.end());
  // Every rank builds a block's full fp32 initial weights, one at a time.
  e.setup.push_back({"initial weights (fp32, one block at a time)", 4 * max_padded, "the largest block", false});
  e.training.push_back(opt);
  e.training.insert(e.training.end(), train_params.begin(), train_params.end());
  e.training.insert(e.training.end(), grads.begin(), grads.end());
  const bool on_gpu = c.device == Device::kCuda;
  std::vector<MemoryPart>& acts_at = on_gpu ? e.gpu : e.training;
  const int64_t B = c.train_micro_batch_size_per_gpu;
  const int tparts = static_cast<int>(c.tensor_parallel.size);
  // A tensor part's activations: its heads' and MLP share's (its all-reduces
  // run in place on the pass's (N, C) buffers: nothing of their own).
  // Sequence ranks: each holds 1/S of every row's tokens (the model's
  // memory for that split says what its attention's exchange adds).
  const int64_t sranks = c.sequence_parallel_size;
  // The activations count the kernels' scratch, which asks each kernel for
  // its shapes: a size no kernel takes (a matmul past oneDNN's 2^31) is
  // named with the keys that made it, not as the kernel's bare sizes.
  auto sized = [&](auto&& activations) -> std::optional<ActivationMemory> {
    try {
      return activations();
    } catch (const ConfigError&) {
      throw;
    } catch (const Error& e) {
      const bool rows = B * seq_len > std::numeric_limits<int32_t>::max();
      if (rows)
        throw ConfigError("data.seq_len", std::to_string(seq_len) + " tokens by train_micro_batch_size_per_gpu " +
                                              std::to_string(B) + " make " + std::to_string(B * seq_len) +
                                              " rows for the model's products, which no kernel takes (" + e.what() +
                                              "); lower data.seq_len or the micro-batch");
      // The attention's T x T products past a kernel's 32-bit sizes: the
      // sequence, not the model's widths (which were once blamed).
      if (seq_len > 46340)  // 46341^2 > 2^31
        throw ConfigError("data.seq_len", std::to_string(seq_len) + " tokens make the attention's " +
                                              std::to_string(seq_len) + " x " + std::to_string(seq_len) +
                                              " products, which no kernel takes (" + e.what() +
                                              "); lower data.seq_len");
      throw ConfigError("model", "its sizes, at data.seq_len " + std::to_string(seq_len) +
                                     " and train_micro_batch_size_per_gpu " + std::to_string(B) +
                                     ", make products no kernel takes (" + e.what() + "); lower the model's widths");
    }
  };
  std::optional<ActivationMemory> act = sized([&] {
    return sranks > 1   ? model.sequence_activation_memory(B, seq_len, dtype, static_cast<int>(sranks), tparts)
           : tparts > 1 ? model.stage_activation_memory(B, seq_len, dtype, PipelineStage{}, 1, tparts)
                        : model.activation_memory(B, seq_len, dtype);
  });
  e.tensor_parts = tparts;
  if (pp) {
    // Stage s keeps min(P - s, M) micro-batches' activations (one on the
    // last stage); the inputs of those in flight (after the first stage),
    // and the output, its gradient and the input's gradient crossing.
    const int P = static_cast<int>(c.pipeline.stages);
    const bool last = stage == P - 1, first = stage == 0;
    const int sets = last ? 1 : static_cast<int>(std::min<int64_t>(P - stage, c.gradient_accumulation_steps));
    const PipelineStage st{pp->bounds[static_cast<size_t>(stage)], last ? -1 : pp->bounds[static_cast<size_t>(stage) + 1]};
    act = sized([&] { return model.stage_activation_memory(B, seq_len, dtype, st, sets, tparts); });
    const int64_t hidden = 4 * B * seq_len * model.pipeline_width();
    const int64_t buffers = (first ? 0 : sets) + (last ? 0 : 2) + (first ? 0 : 1);
    // On the GPU they are GPU memory (Note [pipeline stages on the GPU]).
    acts_at.push_back({"pipeline transfers (fp32)", buffers * hidden,
                          std::to_string(buffers) + " hidden states of the micro-batch: inputs in flight, the "
                                                    "output and its gradient, the input's gradient",
                          false});
  }
  if (act) {
    acts_at.push_back({"activations", act->saved,
                       "micro-batch " + std::to_string(c.train_micro_batch_size_per_gpu) + " x " +
                           std::to_string(seq_len) + " tokens, kept for backward" +
                           (on_gpu ? " (the GPU kernels' buffers: with 16-bit compute the fused attention keeps row statistics, not T x T probabilities)" : ""),
                       false});
    acts_at.push_back({"kernel scratch", act->workspace,
                       on_gpu ? "the unfused attention's buffers (none with the fused attention), a gradient's "
                                "16-bit copy"
                              : "converted operands, attention buffers, oneDNN",
                       false});
    if (on_gpu)  // (a --check once passed a GPU 32 MiB short of it)
      acts_at.push_back({"cuBLAS workspace", kernels::kCudaMatmulWorkspaceBytes,
                         "the compute stream's matmul workspace (32 MiB on Hopper and later, 4 MiB before)", false});
    // BlockParams::generation: frozen blocks stay in place outside stage 3.
    if (act->packed > 0 && !plan.params_sharded && !on_gpu)
      acts_at.push_back({"packed frozen weights", act->packed,
                         "the frozen base's layer weights in oneDNN's layout, for their forward and input-gradient "
                         "products (model.pack_frozen_weights: false saves them)",
                         false});
  } else {
    e.activations_unknown = true;
  }
  // offload_optimizer.ratio below 1: the elements whose states live on the
  // GPU (gpu_state_blocks' prefix of blocks; on one rank a span is the block).
  int64_t share = 0;
  if (on_gpu && z.offload_optimizer.device != OffloadDevice::kNone && z.offload_optimizer.ratio < 1.0) {
    const std::vector<char> here = gpu_state_blocks(spans, z.offload_optimizer.ratio);
    for (size_t b = 0; b < spans.size(); ++b)
      if (here[b]) share += spans[b];
  }
  if (on_gpu) {
    // The DeviceMirror: the compute parameters (at stage 3 the gathered
    // blocks only) and fp32 accumulators (from stage 2 only in backward),
    // and with offload_optimizer "none" master, m and v (the host keeps its
    // copy for checkpoints); the gradients' page-locked staging on the host.
    // (As the engine's MirrorOptions: GPU-resident states on one rank keep them.)
    const bool transient = gpu_plan.mirror.transient_grads;
    const int64_t gpu_grads = transient ? transient_full : g_padded_all;  // none for frozen blocks
    const std::string gpu_grads_why =
        transient ? millions(gpu_grads) + " elements, in backward: " + transient_why
                  : "4 B x " + millions(g_padded_all) + " elements";
    e.gpu.insert(e.gpu.begin(), {{std::string("parameters (") + dname + ")", es * full_params, full_params_why},
                                 {"gradient accumulators (fp32)", 4 * gpu_grads, gpu_grads_why}});
    if (z.offload_optimizer.device == OffloadDevice::kNone) {
      // The rank's span (the padded blocks on one rank or at stage 0, its
      // shards on several).
      e.gpu.insert(e.gpu.begin() + 2, {"optimizer states (fp32 master, Adam m, v)", 12 * span_all,
                                       "12 B x " + millions(span_all) + " elements"});
      if (world > 1 && !plan.optimizer_spans_block)
        e.gpu.insert(e.gpu.begin() + 3, {"reduced gradient shards (fp32)", 4 * span_all,
                                         "4 B x " + millions(span_all) + " elements"});
      if (plan.params_sharded && is_16bit(dtype) && !gpu_plan.device_gathers)
        e.gpu.push_back({"update output", es * max_shard, "the largest shard's new compute values, on their way to RAM"});
      const int64_t nblocks = static_cast<int64_t>(layouts.size());
      e.gpu.push_back({"gradient norms (fp64)", 8 * nblocks,
                       "one per block (" + std::to_string(nblocks) + "), for clipping"});
      if (c.tensor_split()) {  // DeviceMirror::set_norm_ranges: a run of the parameters a part counts, at most one each
        int64_t nparams = 0;
        for (const BlockLayout& l : layouts) nparams += static_cast<int64_t>(l.offsets.size());
        e.gpu.push_back({"tensor parts' gradient norms (fp64)", 8 * nparams,
                         "at most one per parameter (" + std::to_string(nparams) + "): the ranges this part counts"});
      }
    } else if (z.offload_optimizer.ratio < 1.0) {
      // Note [a share of the states on the GPU] in gpu_offload.cpp: the
      // share's blocks keep master, m and v here (the host keeps its copy),
      // and their accumulators from one step to the next.
      char r[32];
      std::snprintf(r, sizeof r, "%g", z.offload_optimizer.ratio);
      e.gpu.insert(e.gpu.begin() + 2,
                   {std::string("optimizer states of the GPU's share (offload_optimizer.ratio ") + r + ")", 12 * share,
                    "12 B x " + millions(share) + " elements: the first blocks' fp32 master, Adam m, v"});
      if (transient)
        e.gpu.push_back({"the share's gradient accumulators, kept between steps", 4 * share,
                         "4 B x " + millions(share) + " elements"});
    }
    if (z.offload_optimizer.device != OffloadDevice::kNone && world == 1) {  // Note [the norm on the GPU]
      const int64_t nblocks = static_cast<int64_t>(layouts.size());
      e.gpu.push_back({"gradient norms (fp64)", 8 * nblocks,
                       "one per block (" + std::to_string(nblocks) + "), for clipping"});
    }
    if (world > 1) {  // the reduction on the GPU (DeviceMirror::enable_device_reduce)
      const bool gather_back = plan.optimizer_spans_block && is_16bit(c.wire_dtype());
      e.gpu.push_back({"reduction scratch", (gather_back ? 8 : 4) * max_shard,
                       gather_back ? "the largest shard, twice (wire and widened)" : "the largest shard, fp32"});
      if (is_16bit(c.wire_dtype()))
        e.gpu.push_back({std::string(dtype_name(c.wire_dtype())) + " wire copies", 2 * gpu_grads,
                         "2 B per gradient element"});
    }
    if (gpu_plan.device_gathers)
      e.gpu.insert(e.gpu.begin() + 1, {std::string("parameter shards (") + dname + ")", es * shard_all,
                                       std::to_string(es) + " B x " + millions(shard_all) +
                                           " elements: the rank's, which the gathers read"});
    else if (plan.params_sharded && !gpu_plan.upload_gathers)
      e.training.push_back({"parameter upload staging (page-locked)", 2 * es * max_padded,
                            "two of the largest block, on their way to the GPU", false});
    if (world > 1)
      e.training.push_back({"reduced-shard staging (page-locked)", 4 * max_shard,
                            "the largest shard on its way back from the GPU", false});
    else if (z.offload_optimizer.device != OffloadDevice::kNone)
      e.training.push_back({"gradient staging (fp32, page-locked)", 4 * (padded_all - share),
                            "4 B x " + millions(padded_all - share) + " elements: the copies back from the GPU" +
                                (share > 0 ? std::string(" (not the GPU's share of the states)") : ""),
                            false});
  }
  return e;
}

}  // namespace

MemoryEstimate estimate_memory(const Model& model, const Config& c, int64_t seq_len) {
  // Tensor parts: one part's blocks (every part's are the same size).
  std::vector<BlockSpec> specs = model.blocks();
  if (c.tensor_split()) {
    std::string why;
    TensorPart part = model.tensor_part(0, static_cast<int>(c.tensor_parallel.size), &why);
    if (part.empty()) throw ConfigError("tensor_parallel.autotp_size", why);
    specs = std::move(part.blocks);
  }
  if (c.expert_split()) {  // one expert rank's share of the experts (activations: balanced routing's)
    std::string why;
    TensorPart part = model.expert_part(0, static_cast<int>(c.expert_parallel.size), &why);
    if (part.empty()) throw ConfigError("expert_parallel.autoep_size", why);
    specs = std::move(part.blocks);
  }
  if (!c.pipelined()) return estimate_rank(model, c, seq_len, nullptr, 0, specs);
  // The stage that needs the most stands for all (a machine holds ranks of
  // every stage when the grid is on one machine; the largest is the bound):
  // of RAM, or on the GPU path of GPU memory, the scarcer (the first stage,
  // with the embedding, was once passed over for a later one's RAM).
  const PipelinePlan pp = plan_pipeline(model, c);
  MemoryEstimate best;
  auto need = [&](const MemoryEstimate& e) {
    return c.device == Device::kCuda ? std::pair{e.gpu_bytes(), e.ram_bytes()} : std::pair{e.ram_bytes(), int64_t{0}};
  };
  for (int s = 0; s < static_cast<int>(c.pipeline.stages); ++s) {
    MemoryEstimate e = estimate_rank(model, c, seq_len, &pp, s, specs);
    e.pipeline_stage = s;
    if (s == 0 || need(e) > need(best)) best = std::move(e);
  }
  best.pipeline_stages = static_cast<int>(c.pipeline.stages);
  return best;
}

}  // namespace zinc
