// zinc-bench estimate: how close zinc-train --estimate comes to what a run
// really takes.
//
// For two GPT sizes and eight configs (stages 0-3; stage 2 with the
// optimizer states page-locked and on NVMe; stage 3 with parameters and
// optimizer states page-locked, and both on NVMe) at 2 ranks, it runs
// `mpirun -np 2 zinc-train CONFIG --estimate --json` and then the same
// config for 3 training steps, and reports the estimated RAM per rank over
// the largest peak RSS of the ranks (getrusage). The aim: within 10%.
// Folder for NVMe: ZINC_BENCH_NVME_PATH (default /tmp).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/benches.h"

namespace zinc::bench {
namespace {


std::string quote(const std::string& s) { return "'" + s + "'"; }

}  // namespace

int bench_estimate(const BenchOptions& o) {
  const char* env = std::getenv("ZINC_BENCH_NVME_PATH");
  const std::string folder = env && *env ? env : "/tmp";
  const std::string zinc_train = zinc_train_path();
  const std::string launcher = std::string(ZINC_MPIEXEC) + (::geteuid() == 0 ? " --allow-run-as-root" : "") +
                               " --oversubscribe -np 2 ";
  char tmpl[] = "/tmp/zinc-estimate-XXXXXX";
  if (!::mkdtemp(tmpl)) throw Error("estimate bench: mkdtemp failed");
  const std::string config = std::string(tmpl) + "/config.json";
  struct Size {
    const char* name;
    int64_t L, C;
  };
  struct Case {
    const char* name;
    nlohmann::json zero;
  };
  const nlohmann::json nvme = {{"device", "nvme"}, {"nvme_path", folder}};
  const nlohmann::json cpu = {{"device", "cpu"}};
  const std::vector<Case> cases = {
      {"stage0", {{"stage", 0}}},
      {"stage1", {{"stage", 1}}},
      {"stage2", {{"stage", 2}}},
      {"stage2/opt-cpu", {{"stage", 2}, {"offload_optimizer", cpu}}},
      {"stage2/opt-nvme", {{"stage", 2}, {"offload_optimizer", nvme}, {"sub_group_size", 4000000}}},
      {"stage3", {{"stage", 3}}},
      {"stage3/param-cpu+opt-cpu", {{"stage", 3}, {"offload_param", cpu}, {"offload_optimizer", cpu}}},
      {"stage3/param-nvme+opt-nvme",
       {{"stage", 3}, {"offload_param", nvme}, {"offload_optimizer", nvme}, {"sub_group_size", 4000000}}},
  };
  int worst = 0;
  double worst_off = 0;
  for (const Size& sz : {Size{"gpt6x384", 6, 384}, Size{"gpt12x640", 12, 640}}) {
    for (const Case& c : cases) {
      nlohmann::json doc = {
          {"train_batch_size", 8},
          {"gradient_clipping", 1.0},
          {"bf16", {{"enabled", !o.fp32}}},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}}}}},
          {"zero_optimization", c.zero},
          {"model", {{"type", "gpt"}, {"n_layer", sz.L}, {"n_head", 8}, {"n_embd", sz.C}}},
          {"data", {{"type", "synthetic"}, {"vocab_size", 256}, {"seq_len", 128}}},
          {"run", {{"eval_interval", 0}}},
          {"aio", {{"block_size", 1048576}, {"queue_depth", 8}}}};
      std::FILE* f = std::fopen(config.c_str(), "w");
      if (!f) throw Error("estimate bench: cannot write " + config);
      std::fprintf(f, "%s\n", doc.dump(2).c_str());
      std::fclose(f);
      const std::string base = "OMP_NUM_THREADS=1 " + launcher + quote(zinc_train) + " " + quote(config);
      const nlohmann::json est = last_json_event(base + " --estimate --json 2>/dev/null", "estimate", "estimate");
      const nlohmann::json run = last_json_event(base + " --steps 3 --json 2>/dev/null", "summary", "estimate");
      const double ram = est["ram_bytes"].get<double>();
      const double rss = run["peak_rss_bytes"].get<double>();
      const double ratio = ram / rss;
      if (std::fabs(ratio - 1) > worst_off) worst_off = std::fabs(ratio - 1);
      if (std::fabs(ratio - 1) > 0.10) worst = 1;
      nlohmann::json line = {{"bench", "estimate"},
                             {"case", std::string(sz.name) + "/" + c.name},
                             {"figure", ram},
                             {"unit", "bytes per rank (estimated RAM)"},
                             {"bound", rss},
                             {"ratio", ratio},
                             {"parameters", est["parameters"]},
                             {"model_state_bytes", est["model_state_bytes"]},
                             {"disk_bytes", est["disk_bytes"]},
                             {"process_bytes", est["breakdown"]["process"]},
                             {"world_size", 2}};
      char buf[512];
      std::snprintf(buf, sizeof buf,
                    "estimate %-36s %.1fM params | estimated RAM %7.1f MiB per rank | measured peak RSS %7.1f MiB "
                    "| ratio %.3f | disk %.1f MiB",
                    (std::string(sz.name) + "/" + c.name).c_str(), est["parameters"].get<double>() / 1e6,
                    ram / (1 << 20), rss / (1 << 20), ratio, est["disk_bytes"].get<double>() / (1 << 20));
      emit(o.json, line, buf);
    }
  }
  std::remove(config.c_str());
  ::rmdir(tmpl);
  std::printf("worst: %.1f%% off%s\n", 100 * worst_off, worst ? " (beyond 10%)" : "");
  return worst;
}

}  // namespace zinc::bench
