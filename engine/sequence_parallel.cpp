// Note [sequence parallelism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// sequence_parallel_size = S is DeepSpeed-Ulysses: the S ranks of a
// replica take the same micro-batches, and each computes a slice of every
// row, tokens [s T/S, (s+1) T/S) of rows of T tokens, through every layer.
// Everything but attention is per token, so a slice is computed alone.
// Attention needs the whole row: before it, one all-to-all over the S
// ranks (StepContext::sequence_all_to_all) turns the split by tokens into
// a split by heads (rank s gets every token of heads [s H/S, (s+1) H/S) of
// q, k and v), the attention kernel runs on whole rows of its heads, and a
// second all-to-all turns its output back into the split by tokens. In
// backward the same two exchanges run in reverse. A layer costs two
// all-to-alls of (B T/S, 3 H d) and (B T/S, H d) forward, the same
// backward; the weights' gradients are the sum of the slices' (ZeRO's
// reduction, below).
//   - The engine slices the batch (Engine::Impl::sequence_slice): the
//     model gets its tokens and targets, their positions in the whole row
//     (Batch::positions always set, so rotary tables and learned positions
//     see the true index), and through StepContext::sequence_split the
//     whole rows' length and packed-document positions, which the
//     attention kernel masks by.
//   - The ranks of one replica must be given the same micro-batch: a
//     digest of it is compared over them before each forward (one small
//     all-reduce), and ranks that differ stop with one line naming them
//     rather than train on a mixed row.
//   - The grid: rank = (replica * S + s) * T + part with T tensor parts
//     (Note [tensor parallelism]; T = 1 without), a replica's slices and
//     their parts adjacent (inside a node). Each part's heads split again
//     over the slices. ZeRO partitions over the ranks that hold the same
//     part (the replicas times their sequence ranks, as DeepSpeed's
//     sequence-data-parallel group), so stage 3 spreads the weights over S
//     times more ranks. The loss normaliser (Note [the loss normaliser] in
//     engine.cpp) counts each slice as a micro-batch of B T/S positions on
//     its own rank: the mean over S equal slices is the row's mean, and
//     masked targets are counted where they fall, so the sums are those of
//     the run without the split, taken in another order.
//   - forward() and evaluate() return the micro-batch's loss over its whole
//     rows (the slices' losses weighted by their targets, summed over the
//     S ranks), not the slice's.
// With pipeline stages each stage's ranks slice every micro-batch and the
// stages pass on the slices' hidden states (rank s's slice to rank s's on
// the next stage); each micro-batch in flight keeps its whole rows'
// positions for its passes (Engine::Impl::train_pipeline).
// On the GPU path the exchanges' buffers are in GPU memory and go over
// NCCL (sp_device_comm, DevicePath::device_communicator), after the
// compute stream's kernels that wrote them.
// Not built: the 1-bit optimizers (each rank's gradient is one slice's,
// not the replica's). Dropout draws each slice's masks from the rank's own
// stream, so with dropout a run at S ranks is not the run at 1.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "engine/engine_impl.h"

namespace zinc {

std::vector<std::string> describe_sequence_ranks(const Model& model, const Config& config, int64_t seq_len) {
  const int S = static_cast<int>(config.sequence_parallel_size), T = static_cast<int>(config.tensor_parallel.size);
  // With tensor parts each part's heads divide over the slices: the whole
  // model's heads over S x T.
  const std::string why = model.sequence_split_error(S * T);
  if (!why.empty()) throw ConfigError("sequence_parallel_size", why);
  if (seq_len % S != 0)
    throw ConfigError("sequence_parallel_size", "the rows' " + std::to_string(seq_len) +
                                                    " tokens are not a multiple of " + std::to_string(S) +
                                                    " (each sequence rank takes an equal slice of every row)");
  std::vector<std::string> out;
  const int64_t t = seq_len / S;
  for (int s = 0; s < S; ++s) {
    std::string ranks;
    int n = 0;
    for (int r = 0; r < config.world_size; ++r)
      if ((r / T) % S == s) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r), ++n;
    out.push_back("slice " + std::to_string(s) + " (" + (n == 1 ? "rank " : "ranks ") + ranks + "): tokens " +
                  std::to_string(s * t) + "-" + std::to_string((s + 1) * t - 1) + " of each row of " +
                  std::to_string(seq_len) + "; in attention, whole rows of share " + std::to_string(s) + " of " +
                  std::to_string(S) + " of the heads");
  }
  return out;
}

void Engine::Impl::setup_sequence(int replica) {
  sp_size = static_cast<int>(cfg.sequence_parallel_size);
  const std::string why = model->sequence_split_error(sp_size);
  if (!why.empty()) throw ConfigError("sequence_parallel_size", why);
  sp_rank = replica % sp_size;
  // The same part of the other slices of this replica on this stage (grid
  // rank = ((stage * D + replica) * sp_size + sp_rank) * tp_size + tp_rank,
  // `replica` here counting the slices: replica * sp_size + sp_rank).
  const int replicas = world_all / (stages * sp_size * tp_size);
  sp_comm = world_comm->split((stage * replicas + replica / sp_size) * tp_size + tp_rank, sp_rank);
  if (world_rank == 0) {
    log_info("sequence parallelism: " + std::to_string(sp_size) + " sequence ranks per replica (each takes 1/" +
             std::to_string(sp_size) + " of the replica's rows)" +
             (tp_size > 1 ? " x " + std::to_string(tp_size) + " tensor parts" : std::string()) +
             (stages > 1 ? " x " + std::to_string(stages) + " pipeline stages" : std::string()) + " x " +
             std::to_string(replicas) + " data-parallel " + (replicas == 1 ? "replica" : "replicas") +
             "; ZeRO partitions over the " + std::to_string(replicas * sp_size) + " ranks" +
             (tp_size > 1 || stages > 1 ? " of each part and stage" : std::string()));
  }
}

Batch Engine::Impl::sequence_slice(const Batch& whole) {
  const int64_t S = sp_size, B = whole.B, T = whole.T;
  // The ranks of a replica agree on the micro-batch before any exchange,
  // and a rank whose batch is malformed tells the others (who would wait
  // for it in the first exchange otherwise): every rank stops together.
  std::string bad;
  try {
    check_batch(whole);
  } catch (const std::exception& e) {
    bad = e.what();
  }
  std::string bytes;
  auto add = [&](const void* p, size_t n) { bytes.append(static_cast<const char*>(p), n); };
  add(&whole.B, sizeof whole.B);
  add(&whole.T, sizeof whole.T);
  add(whole.inputs.data(), whole.inputs.size() * sizeof(int32_t));
  add(whole.targets.data(), whole.targets.size() * sizeof(int32_t));
  add(whole.positions.data(), whole.positions.size() * sizeof(int32_t));
  const uint64_t h = std::strtoull(ckpt::xxh3_hex(bytes.data(), bytes.size()).c_str(), nullptr, 16);
  const double hi = static_cast<double>(h >> 32), lo = static_cast<double>(h & 0xffffffffu);
  double v[5] = {hi, lo, -hi, -lo, bad.empty() ? 0.0 : 1.0};
  sp_comm->all_reduce_max_f64(v, 5);
  const std::string ranks = "the sequence ranks of replica " + std::to_string(rank / sp_size) + " (ranks " +
                            std::to_string(world_rank - sp_rank) + "-" +
                            std::to_string(world_rank - sp_rank + sp_size - 1) + ")";
  if (!bad.empty()) throw Error(bad);
  if (v[4] > 0)
    throw Error("batch: another of " + ranks + " was given a malformed micro-batch (its error names what); nothing "
                "was computed");
  if (v[0] != -v[2] || v[1] != -v[3])
    throw Error("batch: " + ranks + " were given different micro-batches; each takes a slice of the same rows, so "
                "give every rank of a replica the same batch (a DataLoader over Engine::data_parallel_size() and "
                "data_parallel_rank() does)");
  if (T % S != 0)
    throw Error("batch: sequence length T=" + std::to_string(T) + " is not a multiple of sequence_parallel_size " +
                std::to_string(S) + " (each sequence rank takes T / " + std::to_string(S) + " tokens of every row)");
  const int64_t t = T / S, first = sp_rank * t;
  Batch part;
  part.B = B;
  part.T = t;
  part.inputs.resize(static_cast<size_t>(B * t));
  part.targets.resize(part.inputs.size());
  part.positions.resize(part.inputs.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < t; ++i) {
      const size_t from = static_cast<size_t>(b * T + first + i), to = static_cast<size_t>(b * t + i);
      part.inputs[to] = whole.inputs[from];
      part.targets[to] = whole.targets[from];
      part.positions[to] = whole.positions.empty() ? static_cast<int32_t>(first + i) : whole.positions[from];
    }
  sp_positions = whole.positions;
  sp_pass = SequenceSplit{sp_size, sp_rank, T, sp_positions.empty() ? nullptr : &sp_positions};
  return part;
}

float Engine::Impl::sequence_loss(float loss, int64_t targets) {
  // The slice's mean over its targets times their count: the sum of the
  // slice's losses, summed with the counts over the replica's ranks.
  double v[2] = {targets > 0 ? static_cast<double>(loss) * static_cast<double>(targets) : 0.0,
                 static_cast<double>(targets)};
  sp_comm->all_reduce_f64(v, 2);
  return v[1] > 0 ? static_cast<float>(v[0] / v[1]) : std::numeric_limits<float>::quiet_NaN();
}

void Engine::Impl::sequence_all_to_all(const float* send, float* recv, int64_t per_rank) {
  if (!sp_comm) return;
  const auto t0 = std::chrono::steady_clock::now();
  if (sp_device_comm) {
    device->before_device_transfer();
    sp_device_comm->all_to_all(send, recv, per_rank, DType::kF32);
  } else {
    sp_comm->all_to_all(send, recv, per_rank, DType::kF32);
  }
  sp_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace zinc
