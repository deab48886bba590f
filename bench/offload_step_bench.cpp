// zinc-bench offload-step: the optimizer step with its states on NVMe
// against the bytes-over-bandwidth bound of the disk, measured with fio in
// the same folder in the same run.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <unistd.h>

#include "bench/benches.h"
#include "tools/experiment.h"

namespace zinc::bench {

int bench_offload_step(const BenchOptions& o) {
  require_fio();
  const char* env = std::getenv("ZINC_BENCH_NVME_PATH");
  const std::string dir = env && *env ? env : ".";
  // A GPT whose optimizer state (12 bytes per parameter) is far larger than
  // what a step computes: a tiny batch, 38M parameters, 450 MB each way.
  nlohmann::json doc = {
      {"train_micro_batch_size_per_gpu", 1},
      {"gradient_accumulation_steps", 1},
      {"bf16", {{"enabled", true}}},
      {"zero_optimization",
       {{"stage", 2},
        {"sub_group_size", 4000000},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", dir}, {"buffer_count", 4}, {"pin_memory", true}}}}},
      {"aio", {{"block_size", 1 << 20}, {"queue_depth", 8}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}, {"weight_decay", 0.1}}}}},
      {"model", {{"type", "gpt"}, {"n_layer", 12}, {"n_head", 8}, {"n_embd", 512}, {"vocab_size", 256}}},
      {"data", {{"type", "synthetic"}, {"vocab_size", 256}, {"seq_len", 64}}}};
  tools::Experiment ex = tools::build_experiment(doc, 1);
  Engine e = Engine::initialize(ex.model, ex.config);
  DataLoader loader(ex.data, 1, 1, 1, 0, 1);
  e.train_batch(loader);  // warm up
  const int64_t r0 = e.offload_bytes_read(), w0 = e.offload_bytes_written();
  e.train_batch(loader);
  const int64_t read_bytes = e.offload_bytes_read() - r0, write_bytes = e.offload_bytes_written() - w0;
  const std::string fio_file = dir + "/zinc-offload-step-fio.dat";
  std::vector<double> step_s, bound_s, fio_r, fio_w;
  for (int r = 0; r < o.rounds; ++r) {
    const double fw = fio_bw(fio_file, write_bytes, true);
    const double fr = fio_bw(fio_file, read_bytes, false);
    fio_w.push_back(fw);
    fio_r.push_back(fr);
    bound_s.push_back(static_cast<double>(read_bytes) / fr + static_cast<double>(write_bytes) / fw);
    const double s0 = e.timings().step_s;
    e.train_batch(loader);
    step_s.push_back(e.timings().step_s - s0);
  }
  ::unlink(fio_file.c_str());
  const double t = median(step_s), bound = median(bound_s);
  nlohmann::json line = {{"bench", "offload-step"},
                         {"case", "nvme/" + std::to_string(e.num_parameters() / 1000000) + "M"},
                         {"figure", t},
                         {"unit", "s per optimizer step"},
                         {"bound", bound},
                         {"ratio", bound / t},
                         {"read_bytes", read_bytes},
                         {"write_bytes", write_bytes},
                         {"fio_read_GBps", median(fio_r) / 1e9},
                         {"fio_write_GBps", median(fio_w) / 1e9},
                         {"params", e.num_parameters()}};
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "offload-step (%.1fM params, states on NVMe in %s): optimizer step %.3f s | bound %.3f s = %.0f MB "
                "read at %.2f GB/s + %.0f MB written at %.2f GB/s (fio, same run) | ratio bound/step %.3f",
                static_cast<double>(e.num_parameters()) / 1e6, dir.c_str(), t, bound, read_bytes / 1e6,
                median(fio_r) / 1e9, write_bytes / 1e6, median(fio_w) / 1e9, bound / t);
  emit(o.json, line, buf);
  return 0;
}

}  // namespace zinc::bench
