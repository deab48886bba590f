// zinc-bench zero-memory and overlap: ZeRO's memory savings and the
// communication overlap, measured under mpirun.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "bench/benches.h"
#include "comm/comm.h"
#include "tools/experiment.h"

namespace zinc::bench {
namespace {

std::shared_ptr<comm::Communicator> world_comm() {
  if (!comm::launched_with_mpi())
    throw Error("this benchmark needs several ranks: run it as `mpirun -np 2 zinc-bench ...`");
  return comm::make_communicator("auto");  // ZINC_COMM_BACKEND=mpi|shm to compare
}

// At stage 3: each block freed after use (reuse distance 0) and gathered
// ahead by a prefetch window of two buckets; small blocks persist.
nlohmann::json gpt_doc(int64_t n_layer, int64_t n_embd, int64_t n_head, int64_t T, int64_t micro, int world,
                       int stage, bool overlap, int64_t bucket) {
  nlohmann::json zero = {{"stage", stage}, {"overlap_comm", overlap}, {"reduce_bucket_size", bucket},
                         {"allgather_bucket_size", bucket}};
  if (stage == 3) {
    zero["stage3_max_reuse_distance"] = 0;
    zero["stage3_prefetch_bucket_size"] = 2 * bucket;
    zero["stage3_param_persistence_threshold"] = 10000;
  }
  (void)world;
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", 1},
          {"gradient_clipping", 1.0},
          {"steps_per_print", 1000000},
          {"bf16", {{"enabled", true}}},
          {"zero_optimization", zero},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"weight_decay", 0.1}}}}},
          {"model", {{"type", "gpt"}, {"n_layer", n_layer}, {"n_head", n_head}, {"n_embd", n_embd}, {"vocab_size", 256}}},
          {"data", {{"type", "synthetic"}, {"vocab_size", 256}, {"seq_len", T}}}};
}

}  // namespace

// Per-rank peak model-state bytes (the engine's own accounting of every
// parameter, gradient and optimizer buffer it allocates) for stages 0, 1, 2
// against the ZeRO formula for zinc's precisions: bf16 compute weights (2 B),
// fp32 gradients (4 B), fp32 master + Adam m, v (12 B) per parameter Psi:
//   stage 0: (2 + 4 + 12) Psi
//   stage 1: (2 + 4) Psi + (12 + 4) Psi / N   (full gradients + reduced shard)
//   stage 2: 2 Psi + (12 + 4) Psi / N
//   stage 3: (2 + 12 + 4) Psi / N
// The engine also holds what the formula leaves out: at stage 2 the full
// gradients of the blocks whose reduction is in flight (at most 2 buckets,
// plus the block backward is computing and the embeddings, which the tied
// head keeps open through backward); at stage 0 one shard of scratch. The
// model is many small blocks so that these stay a few percent of Psi. At
// stage 3 the engine also holds the gathered blocks (the one in use and the
// prefetch window of two buckets) and the persistent small blocks.
int bench_zero_memory(const BenchOptions& o) {
  auto comm = world_comm();
  const int W = comm->size(), rank = comm->rank();
  // Many small blocks, so that the buckets in flight are small next to Psi.
  const int64_t L = 48, C = 256, H = 4, T = 64;
  const int64_t bucket = 400000;  // about half a layer: one layer's reduction in flight
  for (int stage : {0, 1, 2, 3}) {
    tools::Experiment ex = tools::build_experiment(gpt_doc(L, C, H, T, 2, W, stage, true, bucket), W);
    Engine e = Engine::initialize(ex.model, ex.config, comm);
    DataLoader loader(ex.data, 2, 1, W, rank, 1);
    for (int s = 0; s < 2; ++s) e.train_batch(loader);
    double peak = static_cast<double>(e.model_state_peak_bytes());
    comm->all_reduce_max_f64(&peak, 1);
    const double psi = static_cast<double>(e.num_parameters());
    const double formula = stage == 0   ? 18 * psi
                           : stage == 1 ? 6 * psi + 16 * psi / W
                           : stage == 2 ? 2 * psi + 16 * psi / W
                                        : 18 * psi / W;
    const double ratio = peak / formula;
    if (rank == 0) {
      nlohmann::json line = {{"bench", "zero-memory"}, {"case", "stage" + std::to_string(stage) + "/np" + std::to_string(W)},
                             {"figure", peak / (1 << 20)}, {"unit", "MiB"},
                             {"bound", formula / (1 << 20)}, {"ratio", ratio},
                             {"params", e.num_parameters()}, {"world_size", W}};
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "zero-memory stage %d, %d ranks, %.1fM params: peak model state per rank %.1f MiB | ZeRO formula "
                    "%.1f MiB | ratio %.3f",
                    stage, W, psi / 1e6, peak / (1 << 20), formula / (1 << 20), ratio);
      emit(o.json, line, buf);
    }
  }
  return 0;
}

// Exposed communication per step (time the training thread waits on the comm
// streams) with overlap_comm off and on at ZeRO stage 2, and at stage 3
// (overlap on, each block gathered per use, prefetched two buckets ahead),
// the reference GPT.
int bench_overlap(const BenchOptions& o) {
  auto comm = world_comm();
  const int W = comm->size(), rank = comm->rank();
  const int64_t bucket = 2000000;  // about one transformer layer per bucket
  struct Result {
    double step_s, wait_s, busy_s;
  };
  Result res[3];
  for (int ov = 0; ov < 3; ++ov) {
    const int stage = ov == 2 ? 3 : 2;
    tools::Experiment ex = tools::build_experiment(gpt_doc(6, 384, 6, 256, 8 / W, W, stage, ov >= 1, bucket), W);
    Engine e = Engine::initialize(ex.model, ex.config, comm);
    DataLoader loader(ex.data, 8 / W, 1, W, rank, 1);
    e.train_batch(loader);  // warm up
    const double w0 = e.comm_wait_seconds(), b0 = e.comm_busy_seconds(), t0 = now_s();
    for (int s = 0; s < o.steps; ++s) e.train_batch(loader);
    double r[3] = {(now_s() - t0) / o.steps, (e.comm_wait_seconds() - w0) / o.steps,
                   (e.comm_busy_seconds() - b0) / o.steps};
    comm->all_reduce_max_f64(r, 3);
    res[ov] = {r[0], r[1], r[2]};
  }
  if (rank == 0) {
    const char* names[3] = {"overlap_off", "overlap_on", "stage3"};
    for (int ov = 0; ov < 3; ++ov) {
      nlohmann::json line = {{"bench", "overlap"}, {"case", names[ov]},
                             {"figure", res[ov].wait_s}, {"unit", "s exposed comm per step"},
                             {"bound", res[ov].busy_s}, {"ratio", res[ov].wait_s / res[ov].busy_s},
                             {"step_s", res[ov].step_s}, {"exposed_share", res[ov].wait_s / res[ov].step_s},
                             {"world_size", W}, {"backend", comm->backend()}};
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "overlap %-3s (stage %d, %d ranks, %s): step %.3f s | exposed comm %.3f s (%.1f%% of the step) of %.3f s "
                    "of collectives | exposed/total %.2f",
                    ov ? "on" : "off", ov == 2 ? 3 : 2, W, comm->backend().c_str(), res[ov].step_s, res[ov].wait_s, 100 * res[ov].wait_s / res[ov].step_s,
                    res[ov].busy_s, res[ov].wait_s / res[ov].busy_s);
      emit(o.json, line, buf);
    }
  }
  return 0;
}

}  // namespace zinc::bench
