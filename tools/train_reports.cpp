// zinc-train's --estimate and --check reports (train_reports.h).
#include "tools/train_reports.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/log.h"
#include "engine/memory_estimate.h"
#include "tools/config_check.h"
#include "tools/experiment.h"
#include "tools/resources.h"
#include "tools/train_events.h"

namespace zinc::tools {
namespace {

std::string format_bytes(int64_t b) {
  char buf[32];
  const double x = static_cast<double>(b);
  if (b >= (int64_t{1} << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", x / (1 << 30));
  else if (b >= (1 << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", x / (1 << 20));
  else if (b >= (1 << 10)) std::snprintf(buf, sizeof buf, "%.1f KiB", x / (1 << 10));
  else std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  return buf;
}

nlohmann::json parts_json(const std::vector<zinc::MemoryPart>& parts) {
  nlohmann::json a = nlohmann::json::array();
  for (const zinc::MemoryPart& p : parts) a.push_back({{"name", p.name}, {"bytes", p.bytes}, {"note", p.note}});
  return a;
}

void print_parts(const std::vector<zinc::MemoryPart>& parts) {
  for (const zinc::MemoryPart& p : parts)
    std::printf("    %-46s %11s   %s\n", p.name.c_str(), format_bytes(p.bytes).c_str(), p.note.c_str());
}

// The config's stage with another stage's keys: offload_param only at stage
// 3, offload_optimizer from stage 1 (as the config rules allow).
zinc::Config at_stage(zinc::Config c, int stage) {
  c.zero.stage = stage;
  if (stage < 3) c.zero.offload_param.device = zinc::OffloadDevice::kNone;
  if (stage < 1) c.zero.offload_optimizer.device = zinc::OffloadDevice::kNone;
  return c;
}

std::string offload_words(const zinc::Config& c) {
  std::string s = std::string("offload_optimizer ") + zinc::offload_device_name(c.zero.offload_optimizer.device);
  if (c.zero.stage == 3) s += std::string(", offload_param ") + zinc::offload_device_name(c.zero.offload_param.device);
  return s;
}

}  // namespace

// --estimate: what one rank will need, from the engine's plan and the
// model's activations, plus this process as it stands (code, libraries,
// the data source, MPI when launched under it).
int print_estimate(comm::Communicator& comm, int world, const nlohmann::json& doc, const std::string& config_path,
                   bool json) {
  const bool quiet = comm.rank() != 0;
  zinc::tools::Experiment ex = zinc::tools::build_experiment(doc, world);
  // Under mpirun: the engine's second communicator (the gather stream's)
  // now, so that its buffers are in the process measured below.
  if (comm.size() > 1) comm.twin();
  const zinc::Config& cfg = ex.config;
  const int64_t T = ex.data->seq_len();
  zinc::MemoryEstimate e = zinc::estimate_memory(*ex.model, cfg, T);
  std::vector<std::pair<int, zinc::MemoryEstimate>> others;
  for (int st = 0; st <= 3; ++st)
    if (st != cfg.zero.stage && !(st == 3 && cfg.device == zinc::Device::kCuda &&
                                  cfg.zero.offload_optimizer.device == zinc::OffloadDevice::kNone) &&  // not on the GPU
        !(cfg.pipelined() && st > 1) &&  // pipeline stages take ZeRO 0 and 1 only
        !(cfg.tensor_split() && st > 2))  // tensor parts 0 to 2
      others.emplace_back(st, zinc::estimate_memory(*ex.model, at_stage(cfg, st), T));
  // Measured after the estimates: their matmul primitives (oneDNN's code)
  // are part of the process from here on, as they will be in training.
  const int64_t process = zinc::tools::current_rss_bytes();
  e.process_bytes = process;
  for (auto& [st, o] : others) o.process_bytes = process;
  if (quiet) return 0;
  int64_t params = 0, trained = 0;
  for (const zinc::BlockSpec& b : ex.model->blocks())
    for (const zinc::ParamSpec& p : b.params) {
      params += p.shape.numel();
      if (!b.frozen) trained += p.shape.numel();
    }
  if (json) {
    nlohmann::json out = {{"event", "estimate"},
                          {"ram_bytes", e.ram_bytes()},
                          {"disk_bytes", e.disk_bytes()},
                          {"gpu_bytes", e.gpu_bytes()},
                          {"world_size", world},
                          {"zero_stage", cfg.zero.stage},
                          {"pipeline_stages", e.pipeline_stages},
                          {"pipeline_stage", e.pipeline_stage},
                          {"tensor_parts", e.tensor_parts},
                          {"parameters", params},
                          {"trained_parameters", trained},
                          {"gradient_checkpointing", ex.experiment.model.gradient_checkpointing},
                          {"model_state_bytes", e.model_state_bytes()},
                          {"activations_known", !e.activations_unknown},
                          {"breakdown",
                           {{"process", process},
                            {"setup", parts_json(e.setup)},
                            {"training", parts_json(e.training)},
                            {"disk", parts_json(e.disk)},
                            {"gpu", parts_json(e.gpu)}}}};
    nlohmann::json st = nlohmann::json::array();
    for (const auto& [s, o] : others)
      st.push_back({{"zero_stage", s}, {"ram_bytes", o.ram_bytes()}, {"disk_bytes", o.disk_bytes()}});
    out["other_stages"] = st;
    std::printf("%s\n", json_line(out).c_str());
    return 0;
  }
  std::printf("zinc-train: %s | model %s%s, %.2fM parameters, %s | micro-batch %lld x %lld tokens | %d rank%s\n",
              config_path.c_str(), ex.model->name().c_str(),
              ex.experiment.model.gradient_checkpointing ? " (gradient checkpointing)" : "",
              static_cast<double>(params) / 1e6,
              std::string(zinc::dtype_name(cfg.compute_dtype())).c_str(), static_cast<long long>(cfg.train_micro_batch_size_per_gpu),
              static_cast<long long>(T), world, world == 1 ? "" : "s");
  std::printf("memory per rank at ZeRO stage %d (%s), estimated without training:\n", cfg.zero.stage,
              offload_words(cfg).c_str());
  if (e.pipeline_stage >= 0)
    std::printf("  (a rank of pipeline stage %d of %d, the stage that needs the most: its own layers, %d "
                "micro-batches' activations)\n",
                e.pipeline_stage, e.pipeline_stages,
                e.pipeline_stage + 1 == e.pipeline_stages
                    ? 1
                    : static_cast<int>(std::min<int64_t>(e.pipeline_stages - e.pipeline_stage,
                                                         cfg.gradient_accumulation_steps)));
  if (e.tensor_parts > 1)
    std::printf("  (a rank holding one of %d tensor parts: its share of each layer's weights, states and "
                "activations; the embedding, head and norms whole)\n",
                e.tensor_parts);
  std::printf("  while the engine starts: %s\n", format_bytes(zinc::MemoryEstimate::sum(e.setup)).c_str());
  print_parts(e.setup);
  std::printf("  at the peak of a training step: %s\n", format_bytes(zinc::MemoryEstimate::sum(e.training)).c_str());
  print_parts(e.training);
  if (e.activations_unknown) std::printf("    (model %s does not say what its activations take)\n",
                                         ex.model->name().c_str());
  std::printf("  the process itself (code, libraries, data%s; measured now): %s\n",
              comm.size() > 1 ? ", MPI" : world > 1 ? "; not MPI: run under mpirun to count it" : "",
              format_bytes(process).c_str());
  if (!e.gpu.empty()) {
    std::printf("  on the GPU: %s\n", format_bytes(e.gpu_bytes()).c_str());
    print_parts(e.gpu);
  }
  std::printf("RAM per rank: %s | disk per rank: %s%s\n", format_bytes(e.ram_bytes()).c_str(),
              format_bytes(e.disk_bytes()).c_str(),
              e.gpu.empty() ? "" : (" | GPU per rank: " + format_bytes(e.gpu_bytes()) + " and the CUDA context").c_str());
  for (const zinc::MemoryPart& p : e.disk)
    std::printf("    %-46s %11s   %s\n", p.name.c_str(), format_bytes(p.bytes).c_str(), p.note.c_str());
  std::printf("other ZeRO stages, same model and batch:\n");
  for (const auto& [st, o] : others)
    std::printf("  stage %d (%s): RAM %s, disk %s\n", st, offload_words(at_stage(cfg, st)).c_str(),
                format_bytes(o.ram_bytes()).c_str(), format_bytes(o.disk_bytes()).c_str());
  return 0;
}

// --check: the report of tools/config_check.h, printed on rank 0 (every rank
// checks: a folder may be missing on one node only).
int print_check(comm::Communicator& comm, int world, const std::string& config_path,
                const std::vector<std::string>& overrides, bool json, bool ignore_resources, bool steps_given) {
  // The report lists the warnings; logging them as well would say each twice.
  const zinc::LogLevel level = zinc::log_level();
  zinc::set_log_level(zinc::LogLevel::kError);
  zinc::tools::CheckReport rep = zinc::tools::check_config(config_path, overrides, world);
  if (steps_given)  // --steps reaches the config as an override; it was not a --set
    for (zinc::tools::ConfigEntry& e : rep.entries)
      if (e.path == "run.steps") e.source = "--steps";
  // Room for the run on this host (tools/resources.h): as the run checks it.
  if (rep.ok && !ignore_resources) {
    const int local = comm.size() > 1 ? comm.local_size() : world;
    const zinc::tools::Experiment ex =
        zinc::tools::build_experiment(zinc::tools::load_document(config_path, overrides), world);
    try {
      for (std::string& r : zinc::tools::resource_refusals(ex, local, comm.size() > 1 ? comm.local_rank() : 0)) rep.refusals.push_back(std::move(r));
    } catch (const zinc::ConfigError& e) {  // sizes the estimate's kernels cannot take
      rep.refusals.push_back(e.what());
    }
    rep.ok = rep.refusals.empty();
  }
  zinc::set_log_level(level);
  int ok = rep.ok ? 1 : 0;
  if (comm.size() > 1) {
    double v = rep.ok ? 0 : 1;
    comm.all_reduce_max_f64(&v, 1);
    ok = v == 0 ? 1 : 0;
  }
  if (comm.rank() != 0) return ok ? 0 : 1;
  if (json) {
    nlohmann::json out = rep.to_json();
    if (rep.ok && !ok) out["ok"] = false, out["refusals"].push_back("another rank refused the config (its error is on its stderr)");
    std::printf("%s\n", json_line(out).c_str());
    return ok ? 0 : 1;
  }
  std::printf("zinc-train --check: %s at %d rank%s\n", config_path.c_str(), world, world == 1 ? "" : "s");
  if (rep.ok) {
    std::printf("resolved config (key = value [source]):\n");
    for (const zinc::tools::ConfigEntry& e : rep.entries)
      std::printf("  %s = %s [%s%s%s]\n", e.path.c_str(), e.value.dump().c_str(), e.source.c_str(),
                  e.from.empty() ? "" : ": ", e.from.c_str());
    if (!rep.unused.empty()) {
      std::printf("given but not used by zinc:\n");
      for (const zinc::tools::ConfigEntry& e : rep.unused)
        std::printf("  %s = %s [%s]\n", e.path.c_str(), e.value.dump().c_str(), e.source.c_str());
    }
  }
  if (!rep.pipeline.empty()) {
    std::printf("pipeline stages (1F1B; docs/pipeline.md):\n");
    for (const std::string& line : rep.pipeline) std::printf("  %s\n", line.c_str());
  }
  if (!rep.tensor_parts.empty()) {
    std::printf("tensor parts (each layer split by heads and MLP columns; docs/parallelism.md):\n");
    for (const std::string& line : rep.tensor_parts) std::printf("  %s\n", line.c_str());
  }
  if (!rep.expert_ranks.empty()) {
    std::printf("expert ranks (each mixture-of-experts layer's experts shared out, tokens exchanged; "
                "docs/parallelism.md):\n");
    for (const std::string& line : rep.expert_ranks) std::printf("  %s\n", line.c_str());
  }
  if (!rep.sequence_ranks.empty()) {
    std::printf("sequence ranks (each row split by tokens, attention by heads; docs/parallelism.md):\n");
    for (const std::string& line : rep.sequence_ranks) std::printf("  %s\n", line.c_str());
  }
  std::printf("warnings: %zu\n", rep.warnings.size());
  for (const std::string& w : rep.warnings) std::printf("  %s\n", w.c_str());
  if (!rep.ok) {
    for (const std::string& r : rep.refusals) std::printf("refused: %s\n", r.c_str());
    return 1;
  }
  if (!ok) {
    std::printf("refused: another rank refused the config (its error is on its stderr)\n");
    return 1;
  }
  std::printf("ok: the run would start\n");
  return 0;
}

}  // namespace zinc::tools
