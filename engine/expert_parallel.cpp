// Note [expert parallelism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// expert_parallel.autoep_size = P (DeepSpeed's AutoEP key) shares out the
// E experts of every mixture-of-experts layer over P expert ranks: rank e
// holds experts [e E/P, (e+1) E/P) (Model::expert_part; E must divide by
// P). Everything else (attention, norms, routers, embedding, head) is
// whole on every expert rank.
//   - Unlike tensor parts, expert ranks train on batches of their own: the
//     batch triad's replicas are not divided by P (DeepSpeed's parser does
//     the same), and data_parallel_size() counts every rank.
//   - A sparse layer routes its own tokens as before (the router is
//     whole), groups the (token, slot) rows by expert, and sends each
//     expert rank the rows of its experts: first the counts per expert
//     (StepContext::expert_counts, E/P int32 per pair), then the rows
//     (StepContext::expert_exchange, variable blocks, Communicator::
//     all_to_all_v). The expert rank orders what it got by expert (from
//     each source rank in rank order), runs one GEMM per local expert over
//     all of its rows, and sends the outputs back the same way; the source
//     combines them with the routing weights. Backward sends the outputs'
//     gradients to the experts and the inputs' gradients back: four
//     exchanges of rows per layer and micro-batch, and one of counts. With
//     bf16 compute the two the experts read only as matmul operands (their
//     inputs, their outputs' gradients) travel as bf16: half the bytes,
//     the same bits (the matmul rounds them so anyway).
//   - Capacity: none. Every token reaches its k experts whatever the load
//     (dropless, as transformers' Mixtral and Qwen3-MoE and AutoEP's
//     TorchTitan kernels route); the blocks are as large as the routing
//     makes them, so an expert rank whose experts are popular computes
//     more, and nothing is dropped or padded. A test routes every token to
//     one rank's experts and trains the run without expert ranks.
//   - The gradients: an expert's is complete on its rank (its GEMM saw
//     every token sent to it), and ZeRO reduces it over the ranks that hold
//     the same experts (comm: world / P of them). A dense weight's is this
//     rank's batches' share: after ZeRO's reduction each rank adds the
//     other expert ranks' into its shard (TensorSplit::sum_grads, as a
//     tensor part does for a per-head norm: one all-reduce of the shard
//     over the P ranks, in communication_data_type as ZeRO's reduction
//     travels), so every rank applies the same update and the
//     dense weights stay equal. The norm counts a whole weight once (rank
//     0's) and each rank's experts; the loss sums count every rank.
//   - ZeRO partitions every weight, the dense ones too, over the world / P
//     ranks that hold the same experts (DeepSpeed's AutoEP keeps the
//     experts whole on their rank and partitions the dense weights over
//     the whole world at stage 3: zinc partitions them P times less wide).
// The grid: rank = replica * P + expert rank, the expert ranks of one
// replica adjacent (inside a node, where the exchanges are cheap).
// A run at P expert ranks trains the run at 1 (plain data parallelism at
// the same world size) to float rounding: an expert's GEMMs cover the
// rows of several ranks at once, and the sums over the ranks come in
// another order. Checkpoints hold whole weights (the parts machinery of
// Note [tensor parallelism]): they resume at any autoep_size, and
// --save-pretrained writes one Hugging Face folder.
// Not yet: expert ranks with pipeline stages, tensor parts or sequence
// ranks, the GPU path, the 1-bit optimizers, gradients on NVMe.
#include <chrono>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine_impl.h"

namespace zinc {

std::vector<std::string> describe_expert_parts(const Model& model, const Config& config) {
  const int P = static_cast<int>(config.expert_parallel.size);
  return describe_parts("expert rank", "expert_parallel.autoep_size", P, config.world_size,
                        [&](int e, std::string* why) { return model.expert_part(e, P, why); });
}

void Engine::Impl::check_part(const TensorPart& part, int r, const char* what) const {
  bool same = part.blocks.size() == model->blocks().size() && part.splits.size() == part.blocks.size();
  for (size_t b = 0; same && b < part.blocks.size(); ++b)
    same = part.blocks[b].params.size() == model->blocks()[b].params.size() &&
           part.splits[b].size() == part.blocks[b].params.size();
  if (!same)
    throw Error("model '" + model->name() + "': " + what + " " + std::to_string(r) +
                " does not have the whole model's blocks and parameters");
}

void Engine::Impl::setup_experts() {
  const int P = static_cast<int>(cfg.expert_parallel.size);
  const std::string key = "expert_parallel.autoep_size";
  for (int r = 0; r < P; ++r) {
    std::string why;
    tp_parts.push_back(model->expert_part(r, P, &why));
    if (tp_parts.back().empty()) throw ConfigError(key, why);
    check_part(tp_parts.back(), r, "expert rank");
  }
  tp_size = P;
  tp_rank = world_rank % P;
  expert_parts = true;
  const int replica = world_rank / P;
  model->use_expert_part(tp_rank, P);
  world_comm = comm;
  tp_comm = world_comm->split(replica, tp_rank);
  comm = std::shared_ptr<comm::Communicator>(world_comm->split(tp_rank, replica));
  world = world_all / P;
  rank = replica;
  if (world_rank == 0) {
    std::string line = "expert parallelism: " + std::to_string(P) + " expert ranks x " + std::to_string(world) +
                       (world == 1 ? " replica" : " replicas") + " of each, every rank on its own batches";
    for (const std::string& d : describe_expert_parts(*model, cfg)) line += "; " + d;
    log_info(line);
  }
}

void Engine::Impl::expert_counts(const int32_t* send, int32_t* recv, int64_t per_rank) {
  if (!expert_parts) throw Error("expert_counts: this run has no expert ranks");
  const auto t0 = std::chrono::steady_clock::now();
  tp_comm->all_to_all(send, recv, per_rank, DType::kF32);  // int32 bits as 4-byte words: no arithmetic
  ep_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::Impl::expert_exchange(const float* send, const int64_t* send_rows, float* recv, const int64_t* recv_rows,
                                   int64_t width) {
  if (!expert_parts) throw Error("expert_exchange: this run has no expert ranks");
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> sc(static_cast<size_t>(tp_size)), rc(static_cast<size_t>(tp_size));
  for (int r = 0; r < tp_size; ++r) {
    sc[static_cast<size_t>(r)] = send_rows[r] * width;
    rc[static_cast<size_t>(r)] = recv_rows[r] * width;
  }
  tp_comm->all_to_all_v(send, sc.data(), recv, rc.data(), DType::kF32);
  ep_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace zinc
