// zinc-train: runs the experiment a config describes.
//
//   zinc-train CONFIG.json [--steps N] [--set json.path=value ...] [--json]
//   mpirun -np 4 zinc-train CONFIG.json ...      (four data-parallel ranks)
//   zinc-train CONFIG.json --resume [DIR]      (continue from DIR/latest;
//                                     DIR defaults to run.checkpoint_dir)
//   zinc-train CONFIG.json --estimate [--ranks N] [--json]
//                                     (RAM and disk per rank; trains nothing)
//   zinc-train CONFIG.json --check [--ranks N] [--json]
//                                     (every key, its value and its source,
//                                     the warnings, and whether the run would
//                                     start: exit 0, or 1 with the refusal)
//
// Under an MPI launcher every rank trains on its part of each global batch;
// rank 0 prints. A rank that fails prints its error and ends the whole job.
//
// Human output: a progress line every steps_per_print steps and a summary.
// The run loop itself (cadences, checkpoints, a stop at a step boundary) is
// tools/run_loop.h's, shared with the Python module's zinc.train.
// --json: one JSON object per line on stdout (step events, then a summary).
// Any error ends the run with one line on stderr and exit code 1 (2 for a
// command-line usage error).
#include <algorithm>
#include <atomic>
#include <csignal>
#include <pthread.h>
#include <thread>
#include <ctime>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <tuple>
#include <nlohmann/json.hpp>

#include "core/cpu.h"
#include "comm/comm.h"
#include "core/error.h"
#include "core/exit_cleanup.h"
#include "core/files.h"
#include "core/log.h"
#include "engine/memory_estimate.h"
#include "engine/rank_agreement.h"
#include "models/family.h"
#include "tools/cli_errors.h"
#include "tools/output_folder.h"
#include "tools/config_check.h"
#include "tools/experiment.h"
#include "tools/peft_adapter.h"
#include "tools/resources.h"
#include "tools/run_loop.h"
#include "tools/safetensors.h"
#include "tools/train_events.h"
#include "tools/train_reports.h"

namespace {

// CPU seconds the calling thread has run.
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// A loss scale as the step line shows it: a whole number (65536), or in %g
// where it is not one (0.5, 1e-08).
std::string scale_text(double s) {
  char buf[32];
  if (s >= 1 && s < 1e15 && s == std::floor(s))
    std::snprintf(buf, sizeof buf, "%.0f", s);
  else
    std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  long total = std::lround(s);
  char buf[32];
  if (total >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", total / 3600, total / 60 % 60, total % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", total / 60, total % 60);
  return buf;
}

// FNV-1a (64-bit) over the bits of every parameter's full fp32 master
// weights, in block and parameter order: a digest that changes with any bit
// of any weight, and with nothing else (not the flat layout's alignment
// gaps, nor the padding the world size adds). A collective at ZeRO stages 1
// and 2 (Engine::full_params): every rank calls it.
std::string weights_digest(zinc::Engine& engine) {
  uint64_t h = 1469598103934665603ull;
  const std::vector<zinc::BlockSpec>& specs = engine.model().blocks();
  for (size_t b = 0; b < specs.size(); ++b) {
    const std::vector<float> w = engine.full_params(static_cast<int>(b));
    const zinc::BlockLayout layout = zinc::BlockLayout::from_spec(specs[b]);
    for (size_t p = 0; p < layout.offsets.size(); ++p) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(w.data() + layout.offsets[p]);
      for (size_t i = 0; i < static_cast<size_t>(layout.numels[p]) * sizeof(float); ++i) {
        h ^= bytes[i];
        h *= 1099511628211ull;
      }
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// The engine's full fp32 weights as one safetensors file, tensors named as
// zinc-export names them. A collective (Engine::full_params); rank 0 writes.
void save_weights(zinc::Engine& engine, int rank, const std::string& path) {
  const std::vector<zinc::BlockSpec>& specs = engine.model().blocks();
  std::vector<zinc::tools::SafeTensor> tensors;
  for (const zinc::BlockSpec& b : specs)
    for (const zinc::ParamSpec& p : b.params)
      tensors.push_back({b.name + "." + p.name, zinc::DType::kF32,
                         std::vector<int64_t>(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim)});
  std::unique_ptr<zinc::tools::SafetensorsWriter> w;
  if (rank == 0)
    w = std::make_unique<zinc::tools::SafetensorsWriter>(
        path, tensors, std::map<std::string, std::string>{{"format", "pt"}, {"zinc_model", engine.model().name()}});
  for (size_t b = 0; b < specs.size(); ++b) {
    const std::vector<float> flat = engine.full_params(static_cast<int>(b));
    if (!w) continue;
    const zinc::BlockLayout layout = zinc::BlockLayout::from_spec(specs[b]);
    for (size_t p = 0; p < specs[b].params.size(); ++p)
      w->append(flat.data() + layout.offsets[p], static_cast<size_t>(layout.numels[p]) * 4);
  }
  if (w) {
    w->finish();
    zinc::tools::drop_sharded_set(path);  // an earlier sharded export of this name, which the file replaces
  }
}

// --save-pretrained and its options.
struct SavePretrained {
  std::string dir;
  bool merge = false;       // --merge: LoRA adapters merged into the weights
  std::string adapter_dir;  // --save-adapter: the LoRA adapters in PEFT's format
  std::optional<zinc::DType> dtype;
  int64_t max_shard_bytes = zinc::tools::kDefaultMaxShardBytes;
};

// What the exports at the run's end write (rank 0), for the start's room
// check: --save-weights the fp32 master weights, --save-pretrained the
// model without its LoRA adapters (merged) in its dtype, --save-adapter the
// adapters in fp32. (A run that trained every step and then found no room
// for its export lost the weights where it saved no checkpoint.)
std::vector<zinc::tools::ExportOnDisk> export_sizes(const zinc::tools::Experiment& ex, const std::string& weights_out,
                                                    const SavePretrained& sp) {
  int64_t all = 0, adapters = 0;
  for (const zinc::BlockSpec& b : ex.model->blocks())
    for (const zinc::ParamSpec& p : b.params) (zinc::models::is_adapter_block(b.name) ? adapters : all) += p.shape.numel();
  std::vector<zinc::tools::ExportOnDisk> out;
  if (!weights_out.empty()) out.push_back({"--save-weights", weights_out, 4 * (all + adapters)});
  if (!sp.dir.empty()) {
    const zinc::DType dt = sp.dtype ? *sp.dtype : ex.hf && ex.hf->dtype ? *ex.hf->dtype : zinc::DType::kBF16;
    out.push_back({"--save-pretrained", sp.dir, static_cast<int64_t>(zinc::dtype_bytes(dt)) * all});
  }
  if (!sp.adapter_dir.empty()) out.push_back({"--save-adapter", sp.adapter_dir, 4 * adapters});
  return out;
}

// The engine's final weights in the Hugging Face layout (export_hf). A
// collective (Engine::full_params); rank 0 writes.
void save_pretrained(const zinc::tools::Experiment& ex, zinc::Engine& engine, int rank, const SavePretrained& sp,
                     const std::vector<std::string>& inputs, bool json) {
  if (!ex.hf) throw zinc::Error("--save-pretrained: model \"" + ex.model->name() + "\" has no Hugging Face architecture");
  zinc::tools::HfExportOptions o;
  o.out_dir = sp.dir;
  o.dtype = sp.dtype;
  o.max_shard_bytes = sp.max_shard_bytes;
  o.copy_from = ex.experiment.model.from_pretrained;
  o.rank = rank;
  o.inputs = inputs;
  o.what = "--save-pretrained";
  o.merge_adapters = sp.merge;
  const zinc::tools::HfExportResult r = zinc::tools::export_hf(
      *ex.hf, engine.model(), zinc::tools::export_reader(engine.model(), [&](int b) { return engine.full_params(b); }), o,
      [&](const std::string& line) {
        if (!json) std::printf("save-pretrained: %s\n", line.c_str());
      });
  if (rank == 0 && !json)
    std::printf("save-pretrained: %s: %s, %lld tensors, %.1f MiB of %s in %zu file%s%s\n", sp.dir.c_str(),
                ex.hf->architecture.c_str(), static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / (1 << 20),
                std::string(zinc::dtype_name(r.dtype)).c_str(), r.files.size(), r.files.size() == 1 ? "" : "s",
                r.copied.empty() ? "" : (", " + std::to_string(r.copied.size()) + " tokenizer/generation files copied").c_str());
}

// The engine's final LoRA adapters as a PEFT adapter folder
// (export_peft_adapter). A collective (Engine::full_params); rank 0 writes.
void save_adapter(const zinc::tools::Experiment& ex, zinc::Engine& engine, int rank, const SavePretrained& sp,
                  const std::vector<std::string>& inputs, bool json) {
  zinc::tools::PeftExportOptions o;
  o.out_dir = sp.adapter_dir;
  o.rank = rank;
  o.inputs = inputs;
  o.base_model = ex.experiment.model.from_pretrained;
  const zinc::tools::PeftExportResult r = zinc::tools::export_peft_adapter(
      *ex.hf, engine.model(), [&](int b) { return engine.full_params(b); }, o);
  if (rank == 0 && !json)
    std::printf("save-adapter: %s: %lld LoRA tensors, %.2f MiB of fp32 (PEFT's adapter_config.json and %s)\n",
                sp.adapter_dir.c_str(), static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / (1 << 20),
                zinc::tools::kAdapterWeightsFile);
}

// SIGTERM / SIGINT, from the first instruction to the last: while training,
// stop at the next step boundary with a checkpoint, and a second one ends
// the process at once; before training starts (parsing, --check,
// --estimate, initialisation, a resume load, an open that blocks) and after
// it ends, there is nothing to save and the first one ends the process at
// once. Either way the NVMe scratch folders go first (core/exit_cleanup.h).
// The signals are blocked in every thread (main blocks them before any
// thread exists, and threads inherit the mask) and taken by one thread that
// waits for them: a handler that ran on a compute thread would push its frame
// over whatever oneDNN's JIT kernels keep below their stack pointer, and did
// corrupt the heap (1 run in 6 died in the next matmul).
std::atomic<int> g_stop_signal{0};
std::atomic<bool> g_training{false};  // between the first step and the last save
std::atomic<bool> g_exporting{false};  // in the exports at the end (--save-weights, ...)
std::atomic<bool> g_exports_only_copy{false};  // ... of a run that saved no checkpoint
std::atomic<bool> g_under_mpi{false};  // the job's launcher also signals a rank when another one failed

void start_signal_thread() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  // A closed terminal (an SSH session that dropped) stops the run as
  // SIGTERM does, with a checkpoint; its default ended it at once, the
  // steps since the last save lost (nohup still ignores it).
  sigaddset(&set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) != 0) continue;
      const bool again = g_stop_signal.exchange(sig) != 0;
      if (!again && g_exporting.load()) {
        std::fprintf(stderr, "zinc-train: signal %d: %s (again to stop now)\n", sig,
                     g_exports_only_copy.load()
                         ? "stopping after the exports, the only copy of this run's weights (it saved no checkpoint)"
                         : "stopping after the export under way (each is written whole; those after it are not "
                           "written)");
        continue;
      }
      if (again || !g_training.load()) {
        std::fprintf(stderr, "zinc-train: signal %d: stopping now%s\n", sig,
                     again ? "" : " (not training: nothing to save)");
        zinc::remove_exit_folders();
        std::_Exit(128 + sig);
      }
      std::fprintf(stderr, "zinc-train: signal %d: stopping after this step with a checkpoint%s (again to stop now)\n",
                   sig,
                   g_under_mpi.load() ? ", if every rank reaches it (mpirun also sends this when another rank "
                                        "failed, with its error above, or was killed, by the OOM killer say, with none: "
                                        "then there is no checkpoint)"
                                      : "");
    }
  }).detach();
}

// Human progress (rank 0): a line per step event, with the ETA and, with
// wall_clock_breakdown, the time so far in each phase; a line per held-out
// loss and per checkpoint. With --json the events themselves, one per line.
void print_event(const nlohmann::json& ev, const zinc::tools::RunLoop& loop, const zinc::Engine& engine,
                 const zinc::Config& cfg, bool json) {
  if (json) {
    std::printf("%s\n", zinc::tools::json_line(ev).c_str());
    zinc::tools::stdout_lost("zinc-train");  // flushes; says so once where it failed
    return;
  }
  const std::string& kind = ev.at("event").get_ref<const std::string&>();
  const auto step = ev.at("step").get<long long>();
  if (kind == "step") {
    const double elapsed = ev.at("elapsed_s").get<double>();
    const double eta = ev.at("eta_s").get<double>();  // Note [training time] in run_loop.cpp
    std::string scale;
    if (ev.contains("loss_scale"))  // fp16
      // After this step's update (an overflow halved it): the next step's.
      scale = " | next loss scale " + scale_text(ev.at("loss_scale").get<double>()) + ", " +
              std::to_string(ev.at("skipped_steps").get<long long>()) + " skipped";
    // NaN (an fp16 overflow step's norm) as "nan", not printf's "-nan".
    auto shown = [&](const char* key) {
      const double v = ev.at(key).is_number() ? ev.at(key).get<double>() : NAN;
      return std::isnan(v) ? std::fabs(v) : v;
    };
    std::printf("step %lld/%lld | loss %.4f | lr %.3e | grad norm %.3f%s | %.0f tok/s | %s elapsed | ETA %s\n", step,
                static_cast<long long>(loop.steps()), shown("loss"), ev.at("lr").get<double>(), shown("grad_norm"),
                scale.c_str(), ev.at("tokens_per_s").get<double>(),
                format_duration(elapsed).c_str(), format_duration(eta).c_str());
    if (cfg.wall_clock_breakdown) {
      zinc::StepTimings t = engine.timings();
      std::printf("  time so far: forward %.2fs | backward %.2fs | optimizer step %.2fs", t.forward_s, t.backward_s,
                  t.step_s);
      if (t.update_behind_s > 0)  // Note [the update behind the forward]: its waits are inside forward and backward
        std::printf(" | CPU update behind the forward %.2fs, waited for %.2fs", t.update_behind_s, t.update_wait_s);
      std::printf("\n");
    }
  } else if (kind == "eval") {
    std::printf("eval at step %lld | held-out loss %.4f\n", step, ev.at("loss").get<double>());
  } else if (kind == "checkpoint") {
    std::printf("checkpoint at step %lld: %s (%.2f s)\n", step, ev.at("path").get_ref<const std::string&>().c_str(),
                ev.at("seconds").get<double>());
  }
  zinc::tools::stdout_lost("zinc-train");
}

// The human header: the "auto" values resolved, the model, the batch, the
// kernels.
void print_header(const zinc::tools::Experiment& ex, const zinc::Engine& engine, const zinc::comm::Communicator& comm,
                  const std::string& config_path) {
  const zinc::Config& cfg = ex.config;
  const std::optional<double> floor = ex.data->loss_floor();
  for (const zinc::tools::AutoValue& a : ex.auto_values)
    std::printf("config: %s = %s (\"auto\": %s)\n", a.path.c_str(), a.value.dump().c_str(), a.source.c_str());
  // LoRA: the adapters' share beside the whole.
  char trained[96] = "";
  if (engine.num_trained_parameters() != engine.num_parameters())
    std::snprintf(trained, sizeof trained, " (%.2fM trained: LoRA adapters, the base frozen)",
                  static_cast<double>(engine.num_trained_parameters()) / 1e6);
  std::printf("zinc-train: %s | model %s%s%s, %.2fM parameters%s, %s%s | data %s%s\n", config_path.c_str(),
              ex.model->name().c_str(), ex.experiment.model.gradient_checkpointing ? " (gradient checkpointing)" : "",
              ex.experiment.model_given ? "" : " (the default: the config has no model section)",
              static_cast<double>(engine.num_parameters()) / 1e6, trained,
              std::string(zinc::dtype_name(cfg.compute_dtype())).c_str(),
              cfg.device == zinc::Device::kCuda
                  ? (cfg.zero.offload_optimizer.device == zinc::OffloadDevice::kNone ? " on the GPU"
                                                                                     : " on the GPU (ZeRO-Offload)")
                  : "",
              ex.data->describe().c_str(),
              ex.experiment.data_given ? "" : " (the default: the config has no data section)");
  if (cfg.model_parallel_size() > 1 || cfg.expert_split()) {
    std::string grid;  // "2 pipeline stages x 2 tensor parts x 1 replica"
    if (cfg.pipelined()) grid += std::to_string(cfg.pipeline.stages) + " pipeline stages x ";
    if (cfg.tensor_split()) grid += std::to_string(cfg.tensor_parallel.size) + " tensor parts x ";
    if (cfg.sequence_split()) grid += std::to_string(cfg.sequence_parallel_size) + " sequence ranks x ";
    if (cfg.expert_split()) {  // every rank a replica of the batch: "2 expert ranks x 2 expert replicas"
      const int64_t d = cfg.data_parallel_size() / cfg.expert_parallel.size;
      grid += std::to_string(cfg.expert_parallel.size) + " expert ranks x " + std::to_string(d) +
              (d == 1 ? " expert replica" : " expert replicas");
    } else {
      grid += std::to_string(cfg.data_parallel_size()) + (cfg.data_parallel_size() == 1 ? " replica" : " replicas");
    }
    std::printf("batch %lld = micro %lld x accumulation %lld x replicas %d | %s = %d ranks (%s) | ZeRO stage %d%s | "
                "%lld steps",
                static_cast<long long>(cfg.train_batch_size),
                static_cast<long long>(cfg.train_micro_batch_size_per_gpu),
                static_cast<long long>(cfg.gradient_accumulation_steps), cfg.data_parallel_size(), grid.c_str(),
                comm.size(), comm.backend().c_str(), cfg.zero.stage, cfg.zero.overlap_comm ? " (overlap_comm)" : "",
                static_cast<long long>(ex.experiment.run.steps));
  }
  else
    std::printf("batch %lld = micro %lld x accumulation %lld x ranks %d (%s) | ZeRO stage %d%s | %lld steps",
                static_cast<long long>(cfg.train_batch_size),
                static_cast<long long>(cfg.train_micro_batch_size_per_gpu),
                static_cast<long long>(cfg.gradient_accumulation_steps), comm.size(), comm.backend().c_str(),
                cfg.zero.stage, cfg.zero.overlap_comm ? " (overlap_comm)" : "",
                static_cast<long long>(ex.experiment.run.steps));
  if (cfg.optimizer.type == zinc::OptimizerType::kZeroOneAdam)
    std::printf(" | ZeroOneAdam: the variance updated at growing intervals (1 bit between them) until step %lld, "
                "then local steps synchronised at 1 bit over %s",
                static_cast<long long>(cfg.optimizer.onebit.var_freeze_step), comm.backend().c_str());
  if (cfg.optimizer.type == zinc::OptimizerType::kOneBitAdam || cfg.optimizer.type == zinc::OptimizerType::kOneBitLamb)
    std::printf(" | %s: %s for %lld steps, then the momentum at 1 bit per element over %s%s",
                zinc::optimizer_type_name(cfg.optimizer.type),
                cfg.optimizer.type == zinc::OptimizerType::kOneBitLamb ? "Lamb" : "Adam",
                static_cast<long long>(cfg.optimizer.onebit.freeze_step), comm.backend().c_str(),
                comm.size() == 1 ? " (one rank: nothing to compress, the variance frozen)"
                                 : (" (comm_backend_name \"" + cfg.optimizer.onebit.comm_backend_name +
                                    "\" maps to it)").c_str());
  if (floor) std::printf(" | loss floor %.4f nats", *floor);
  std::printf("\n%s\n", zinc::tools::kernel_paths().c_str());
  std::fflush(stdout);
}

int run(std::shared_ptr<zinc::comm::Communicator> comm, const nlohmann::json& doc, const std::string& config_path,
        bool ignore_resources,
        bool json, bool digest, const std::optional<std::string>& resume, const std::string& weights_out,
        const SavePretrained& pretrained) {
  const int world = comm->size(), rank = comm->rank();
  zinc::tools::Experiment ex = zinc::tools::build_experiment(doc, world);
  const zinc::Config& cfg = ex.config;
  const zinc::tools::RunConfig& run = ex.experiment.run;
  zinc::tools::agree_on_inputs(ex, *comm);  // the same data and weights under the config's paths
  if (!pretrained.dir.empty() && !ex.hf)  // refused before training, not after it
    throw zinc::Error("--save-pretrained: model \"" + ex.model->name() + "\" has no Hugging Face architecture "
                      "(the gpt and the llama have)");
  // LoRA's exports, refused before training, not after it.
  const bool adapters = ex.hf && ex.hf->model->lora().enabled();
  if (!pretrained.dir.empty() && adapters && !pretrained.merge)
    throw zinc::Error("--save-pretrained: the model has LoRA adapters: add --merge to write them merged into the "
                      "weights (PEFT's merge_and_unload), or write the adapters alone with --save-adapter");
  if (pretrained.merge && (!adapters || pretrained.dir.empty()))
    throw zinc::Error(!adapters ? "--merge: the model has no LoRA adapters to merge (model.lora or model.adapter)"
                                : "--merge needs --save-pretrained (the folder it writes the merged model to)");
  if (!pretrained.adapter_dir.empty() && !adapters)
    throw zinc::Error("--save-adapter: the model has no LoRA adapters (model.lora or model.adapter makes them)");
  // One folder holding the merged model and an adapter_config.json reads,
  // for transformers with PEFT, as the base plus the adapter: merged twice.
  if (!pretrained.dir.empty() && !pretrained.adapter_dir.empty()) {
    std::error_code ec1, ec2;
    auto folder = [](std::filesystem::path p) {  // "out/" names the folder "out" does
      while (p.has_relative_path() && p.filename().empty()) p = p.parent_path();
      return p;
    };
    const auto a = folder(std::filesystem::weakly_canonical(pretrained.dir, ec1)),
               b = folder(std::filesystem::weakly_canonical(pretrained.adapter_dir, ec2));
    if (zinc::same_file(pretrained.dir, pretrained.adapter_dir) || (!ec1 && !ec2 && a == b))
      throw zinc::Error("--save-adapter " + pretrained.adapter_dir + " is the folder --save-pretrained writes: a "
                        "merged model beside an adapter_config.json loads as the base plus the adapter (merged "
                        "twice); give each its own folder");
    // One inside the other: the outer export refused the inner folder (an
    // export keeps files, not folders) only after training.
    auto inside = [&](const std::filesystem::path& in, const std::filesystem::path& out) {
      if (ec1 || ec2) return false;
      const auto rel = in.lexically_relative(out);
      return !rel.empty() && *rel.begin() != "..";
    };
    if (inside(b, a) || inside(a, b)) {
      const std::string which = inside(b, a) ? "--save-adapter " + pretrained.adapter_dir +
                                                   " lies inside the folder --save-pretrained writes, " + pretrained.dir
                                             : "--save-pretrained " + pretrained.dir +
                                                   " lies inside the folder --save-adapter writes, " +
                                                   pretrained.adapter_dir;
      throw zinc::Error(which + ": an export replaces its folder as a whole and keeps files, not folders; give "
                                "each a folder of its own beside the other");
    }
  }
  if (!ignore_resources)  // refused in a second, not by the OOM killer or a full disk hours in
    zinc::tools::check_room(ex, *comm, export_sizes(ex, weights_out, pretrained));
  // The checkpoint folder is ours for the whole run (a stop signal saves
  // into it even without checkpoint_interval): checked before any work.
  const std::unique_ptr<zinc::ckpt::DirLock> folder_lock = zinc::tools::hold_checkpoint_dir(run, *comm);
  // What the run reads: no export may write over it (docs/files.md).
  std::vector<std::string> inputs = zinc::tools::run_inputs(ex, config_path);
  if (resume && !resume->empty()) inputs.push_back(*resume);
  // --save-weights replaces one file: never one the run reads, nor one in
  // the pretrained model's folder.
  for (const std::string& in : inputs) {
    const bool is = zinc::same_file(weights_out, in);
    if (!weights_out.empty() && !in.empty() &&
        (is || (in == ex.experiment.model.from_pretrained && zinc::is_within(weights_out, in))))
      throw zinc::Error("--save-weights " + weights_out + (is ? " is " : " is inside ") + in +
                        ", which this run reads: write the weights elsewhere");
    const std::filesystem::path parent = std::filesystem::path(weights_out).parent_path();
    if (const std::string why = zinc::tools::protected_by(parent.empty() ? "." : parent.string(), in);
        !weights_out.empty() && !why.empty())
      throw zinc::Error("--save-weights " + weights_out + " lies inside " + why +
                        ", which this run reads: a save there would be replaced or removed; write the weights "
                        "elsewhere");
  }
  // Nor a file of another set beside it (Note [another set's files] in tools/safetensors.cpp).
  if (!weights_out.empty())
    zinc::tools::check_apart_from_other_sets(weights_out, {std::filesystem::path(weights_out).filename().string()},
                                             "--save-weights");
  // --save-weights' file set, locked for the run as zinc-export locks it (a
  // second writer of NAME would mix its files with ours): rank 0 writes it.
  const std::unique_ptr<zinc::ckpt::DirLock> weights_lock =
      weights_out.empty() || rank != 0 ? nullptr
                                       : zinc::tools::lock_output_folder(weights_out, "--save-weights", "export file",
                                                                         zinc::ckpt::LockUse::kRun);
  // --save-pretrained's folder is held from the start too, checked against
  // the inputs (above all the pretrained model's folder, which an export
  // there would replace) and locked (a second run writing it at its end
  // would mix its files with this run's): refused now, not after training.
  const std::unique_ptr<zinc::ckpt::DirLock> pretrained_lock =
      pretrained.dir.empty() ? nullptr
                             : zinc::tools::hold_output_folder(pretrained.dir, "--save-pretrained", inputs, *comm);
  // The tokenizer files the export will copy: readable, now.
  if (!pretrained.dir.empty()) zinc::tools::check_side_files(ex.experiment.model.from_pretrained, "--save-pretrained");
  const std::unique_ptr<zinc::ckpt::DirLock> adapter_lock =
      pretrained.adapter_dir.empty()
          ? nullptr
          : zinc::tools::hold_output_folder(pretrained.adapter_dir, "--save-adapter", inputs, *comm);
  if (std::string latest; rank == 0 && !resume && std::getline(std::ifstream(run.checkpoint_dir + "/latest"), latest))
    zinc::log_warn("run.checkpoint_dir " + run.checkpoint_dir + " holds an earlier run's checkpoints (latest: " +
                   latest + ") and this run starts afresh: its saves replace tags of the same name (--resume "
                   "continues from the folder instead)");
  // A tag this run saves that holds what zinc did not write (a DeepSpeed
  // global_step1000, a user's file) would be replaced by the save: refused
  // now (ckpt::check_replaceable_tag), not at that save after training.
  // `latest` is a file every save replaces, a stop signal's too (so with
  // no checkpoint_interval as well): a folder of that name failed the first
  // save, after training, and a file of the user's was replaced.
  zinc::ckpt::check_replaceable_latest(run.checkpoint_dir);
  if (run.checkpoint_interval > 0) {
    std::error_code ec;
    // A resumed run saves only past the step its latest tag names.
    int64_t from = 0;
    if (std::string tag; resume && std::getline(std::ifstream((resume->empty() ? run.checkpoint_dir : *resume) +
                                                              "/latest"),
                                                tag))
      from = std::max<int64_t>(0, zinc::ckpt::tag_step(tag));
    for (const auto& e : std::filesystem::directory_iterator(run.checkpoint_dir, ec)) {
      const std::string name = e.path().filename().string();
      const int64_t n = zinc::ckpt::tag_step(name);
      if (n > from && n <= run.steps && (n % run.checkpoint_interval == 0 || n == run.steps))
        zinc::ckpt::check_replaceable_tag(run.checkpoint_dir, name);
    }
  }
  // Sequence ranks: rows that do not divide are refused before anything starts.
  if (cfg.sequence_split()) zinc::describe_sequence_ranks(*ex.model, cfg, ex.data->seq_len());
  zinc::Engine engine = zinc::Engine::initialize(ex.model, cfg, world > 1 ? comm : nullptr);
  // Bytes the NVMe stores moved to set up (the initial states): not a step's.
  const int64_t init_read = engine.offload_bytes_read(), init_written = engine.offload_bytes_written();
  // The replica's part of each global batch: every pipeline stage of a
  // replica reads the same micro-batches.
  zinc::DataLoader loader(ex.data, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps,
                          engine.data_parallel_size(), engine.data_parallel_rank(), run.seed);
  if (rank != 0) json = false;
  const bool quiet = rank != 0;
  // The run loop (tools/run_loop.h): rank 0 prints its events as they come;
  // a stop signal stops it at the next step boundary with a checkpoint.
  zinc::tools::RunLoop::Hooks hooks;
  const zinc::tools::RunLoop* loop_ptr = nullptr;
  hooks.on_event = [&](const nlohmann::json& ev) {
    if (!quiet) print_event(ev, *loop_ptr, engine, cfg, json);
  };
  hooks.stop_requested = [] { return g_stop_signal.load(); };
  zinc::tools::RunLoop loop(engine, loader, ex, comm.get(), std::move(hooks));
  loop_ptr = &loop;
  if (resume) {
    const std::string dir = resume->empty() ? run.checkpoint_dir : *resume;
    const nlohmann::json ev = loop.resume(dir);
    if (!quiet) {
      if (json)
        std::printf("%s\n", zinc::tools::json_line(ev).c_str());
      else
        std::printf("resumed from %s at step %lld\n", dir.c_str(), ev.at("step").get<long long>());
    }
  }
  // A resumed run asked for fewer steps than its checkpoint has is a
  // mistake, said as one; asked for exactly those (a restart of a finished
  // job), it trains nothing and says so (--steps 0 loads only).
  if (run.steps > 0 && loop.first_step() - 1 > run.steps)
    throw zinc::Error("run.steps " + std::to_string(run.steps) + " (or --steps): the checkpoint is at step " +
                      std::to_string(loop.first_step() - 1) + ", past it; ask for more steps to train on, or "
                      "--steps 0 to load it only");
  const int64_t skipped_before = engine.skipped_steps(), overflow_before = engine.overflow_steps();
  const std::vector<nlohmann::json> start = loop.start();
  if (json && !quiet)
    for (const nlohmann::json& ev : start) std::printf("%s\n", zinc::tools::json_line(ev).c_str());
  if (!json && !quiet) print_header(ex, engine, *comm, config_path);

  const double cpu0 = thread_cpu_seconds();
  const double pipe_wait0 = engine.pipeline_wait_seconds();
  const double tensor_wait0 = engine.tensor_wait_seconds();
  const double seq_wait0 = engine.sequence_wait_seconds();
  const double ep_wait0 = engine.expert_wait_seconds();
  const double pipe_bubble =
      cfg.pipelined() ? static_cast<double>(cfg.pipeline.stages - 1) /
                            static_cast<double>(cfg.pipeline.stages - 1 + cfg.gradient_accumulation_steps)
                      : 0.0;
  g_training = true;
  while (loop.step()) {
    if (loop.stopped_by() != 0 && rank == 0)
      std::fprintf(stderr, "zinc-train: stopped by signal %d after step %lld; resume with --resume\n",
                   loop.stopped_by(), static_cast<long long>(loop.done_steps()));
  }
  // From here a signal ends the process at once, but in the exports (below).
  g_exports_only_copy = run.checkpoint_interval <= 0;
  g_exporting = !weights_out.empty() || !pretrained.dir.empty() || !pretrained.adapter_dir.empty();
  g_training = false;
  int stopped_by = loop.stopped_by();
  if (stopped_by == 0) stopped_by = g_stop_signal.load();  // one that came during the last save
  nlohmann::json sum = loop.summary();
  const int64_t done_steps = loop.done_steps();
  const int64_t trained = done_steps - loop.first_step() + 1;
  const double per_step = static_cast<double>(std::max<int64_t>(trained, 1));  // steps this process trained
  const double elapsed = sum.at("elapsed_s").get<double>();
  const double tps = sum.at("tokens_per_s").get<double>();
  const double loss = loop.loss(), eval_loss = loop.eval_loss();
  const std::optional<double> floor = ex.data->loss_floor();
  // Per-rank peak RSS and the exposed communication share, from every rank.
  std::vector<double> rss(static_cast<size_t>(world), 0.0);
  rss[static_cast<size_t>(rank)] = static_cast<double>(zinc::tools::peak_rss_bytes());
  // Two views of what communication costs the compute thread (this one):
  // [0] the time it sat blocked on the communication stream; [1] the time it
  // did not run at all: blocked, or runnable while the core ran something
  // else, such as a communication thread polling beside it (1 - its CPU time
  // over the wall time). A backend that polls moves its waiting from [0]
  // into [1]; docs/zero.md, "How ranks talk".
  // Each clamped to [0, 1]: over a run of no steps (a resume at its last
  // step) the clocks' granularity made the second -0.42.
  auto share = [&](double s) { return elapsed > 0 && std::isfinite(s) ? std::clamp(s / elapsed, 0.0, 1.0) : 0.0; };
  double shares[2] = {share(engine.comm_wait_seconds()), 1.0 - share(thread_cpu_seconds() - cpu0)};
  // Pipeline stages: each rank's share of the time in transfers to and from
  // its neighbouring stages (the 1F1B bubble and the wire).
  std::vector<double> pipe_wait(static_cast<size_t>(world), 0.0);
  pipe_wait[static_cast<size_t>(rank)] = (engine.pipeline_wait_seconds() - pipe_wait0) / elapsed;
  // Tensor parts: each rank's share of the time in the parts' all-reduces.
  std::vector<double> tensor_wait(static_cast<size_t>(world), 0.0);
  tensor_wait[static_cast<size_t>(rank)] = (engine.tensor_wait_seconds() - tensor_wait0) / elapsed;
  // Sequence ranks: each rank's share of the time in the attention's all-to-alls.
  std::vector<double> seq_wait(static_cast<size_t>(world), 0.0);
  seq_wait[static_cast<size_t>(rank)] = (engine.sequence_wait_seconds() - seq_wait0) / elapsed;
  // Expert ranks: each rank's share of the time in the experts' exchanges.
  std::vector<double> ep_wait(static_cast<size_t>(world), 0.0);
  ep_wait[static_cast<size_t>(rank)] = (engine.expert_wait_seconds() - ep_wait0) / elapsed;
  if (world > 1) {
    comm->all_reduce_f64(ep_wait.data(), world);
    comm->all_reduce_f64(pipe_wait.data(), world);
    comm->all_reduce_f64(tensor_wait.data(), world);
    comm->all_reduce_f64(seq_wait.data(), world);
    comm->all_reduce_f64(rss.data(), world);
    comm->all_reduce_max_f64(shares, 2);
  }
  const double wait_share = shares[0], off_cpu_share = shares[1];
  // NVMe traffic (this rank's; every rank moves the same amount) per step:
  // the optimizer swapper's, over the time spent in optimizer steps; with
  // ZeRO-3 parameter offload also the parameter shards', over the whole
  // training time (they are read during forward and backward).
  const bool nvme_opt = cfg.zero.offload_optimizer.device == zinc::OffloadDevice::kNvme;
  const bool nvme_param = cfg.zero.stage == 3 && cfg.zero.offload_param.device == zinc::OffloadDevice::kNvme;
  const bool nvme = nvme_opt || nvme_param;
  const double nvme_read = static_cast<double>(engine.offload_bytes_read() - init_read) / per_step;
  const double nvme_written =
      static_cast<double>(engine.offload_bytes_written() - init_written) / per_step;
  const zinc::StepTimings tm = engine.timings();
  const double nvme_time = nvme_param ? tm.forward_s + tm.backward_s + tm.step_s : tm.step_s;
  const double nvme_gbs = nvme ? (nvme_read + nvme_written) * per_step / nvme_time / 1e9 : 0;
  // A run whose every step was skipped trained nothing: it must not look
  // like one that did (exit 0, a "final loss"), nor export weights as if
  // trained (an export would replace an earlier one with the start's
  // weights). Not for a stop signal (its exit code says what happened).
  // When every skip was an fp16 overflow while the dynamic loss scale came
  // down to its level (a short run's normal start) it is a warning, unless
  // an export was asked for: that exits 1 writing none (it once wrote the
  // untrained weights).
  const int64_t skipped = engine.skipped_steps() - skipped_before;
  const int64_t overflows = engine.overflow_steps() - overflow_before;
  if (trained > 0 && skipped == trained && stopped_by == 0) {
    if (overflows < skipped)
      throw zinc::Error("none of the " + std::to_string(trained) + " steps of this run updated the weights: each "
                        "was skipped (non-finite gradients, or a global batch whose every target is masked: the "
                        "warnings above say which); the weights are as they were at the start, and no export was "
                        "written");
    // A static scale never comes down: more steps overflow too.
    if (cfg.fp16.loss_scale != 0)
      throw zinc::Error("none of the " + std::to_string(trained) + " steps of this run updated the weights: each "
                        "overflowed in fp16 at the static fp16.loss_scale " + scale_text(cfg.fp16.loss_scale) +
                        ", which never comes down; lower it, or set 0 for a dynamic scale. The weights are as "
                        "they were at the start, and no export was written");
    const std::string what = "none of the " + std::to_string(trained) + " steps of this run updated the weights: each "
                             "overflowed in fp16 while the dynamic loss scale came down to its level (normal in a "
                             "run's first steps: run more steps, or start lower with fp16.initial_scale_power)";
    if (!weights_out.empty() || !pretrained.dir.empty() || !pretrained.adapter_dir.empty())
      throw zinc::Error(what + "; the weights are as they were at the start, and no export was written");
    if (rank == 0) zinc::log_warn(what);
  }
  const std::string digest_hex = digest ? weights_digest(engine) : std::string();
  // A run stopped by a signal has not finished: its weights would replace
  // what the export folder holds (an earlier, finished export) with a
  // model of fewer steps. Its checkpoint keeps them; --resume finishes the
  // run and exports then.
  const bool unfinished = stopped_by != 0 && done_steps < run.steps;
  if ((!weights_out.empty() || !pretrained.dir.empty()) && unfinished && rank == 0)
    zinc::log_warn("stopped before run.steps: --save-pretrained and --save-weights are not written (an unfinished "
                   "run's weights would replace the export); --resume finishes the run and writes them");
  // A signal in the exports lets the one under way finish (each replaces
  // its output whole) and skips the rest, every rank alike (they are
  // collective); it ended the process at once, saying "nothing to save".
  // A run that saved no checkpoint writes them all: they are its only copy
  // of the weights (g_exports_only_copy).
  auto stop_exports = [&]() {
    double s = g_stop_signal.load();
    if (world > 1) comm->all_reduce_max_f64(&s, 1);
    if (s != 0 && stopped_by == 0) stopped_by = static_cast<int>(s);
    return s != 0 && !g_exports_only_copy.load();
  };
  std::vector<std::string> skipped_exports;
  auto export_step = [&](bool wanted, const char* flag, const std::function<void()>& write) {
    if (!wanted || unfinished) return;
    if (stop_exports())
      skipped_exports.push_back(flag);
    else
      write();
  };
  export_step(!weights_out.empty(), "--save-weights", [&] { save_weights(engine, rank, weights_out); });
  export_step(!pretrained.dir.empty(), "--save-pretrained",
              [&] { save_pretrained(ex, engine, rank, pretrained, inputs, json); });
  export_step(!pretrained.adapter_dir.empty(), "--save-adapter",
              [&] { save_adapter(ex, engine, rank, pretrained, inputs, json); });
  stop_exports();       // a signal in the last export: its exit code below
  g_exporting = false;  // from here a signal ends the process at once
  if (!skipped_exports.empty() && rank == 0) {
    std::string list;
    for (const std::string& f : skipped_exports) list += (list.empty() ? "" : ", ") + f;
    std::fprintf(stderr, "zinc-train: stopped by signal %d in the exports: %s not written (the run's weights are in "
                         "its last checkpoint; zinc-export writes them from there)\n", stopped_by, list.c_str());
  }
  // ZeRO-3's gathers (this rank's; every rank makes the same ones).
  const zinc::ParamGatherStats zs = engine.param_gather_stats();
  const bool zero3 = zs.gathers > 0;
  const int exit_code = stopped_by ? 128 + stopped_by : 0;  // as a shell reports a signal
  if (quiet) return exit_code;
  const double rss_max = *std::max_element(rss.begin(), rss.end());
  if (json) {
    // The loop's summary and what only the whole process can say.
    if (stopped_by != 0) sum["stopped_by"] = stopped_by;  // also one that came during the last save
    sum["peak_rss_bytes"] = static_cast<int64_t>(rss_max);
    sum["peak_rss_bytes_per_rank"] = rss;
    sum["comm_backend"] = comm->backend();
    sum["comm_wait_share"] = wait_share;
    sum["compute_off_cpu_share"] = off_cpu_share;
    sum["kernel_paths"] = zinc::tools::kernel_paths();
    if (digest) sum["weights_digest"] = digest_hex;
    if (zero3) {
      sum["zero3"] = {{"gathers", zs.gathers},           {"prefetched", zs.prefetched},
                      {"waited", zs.waited},             {"peak_live_elements", zs.peak_live_numel},
                      {"trace_length", zs.trace_length}, {"departures", zs.departures}};
    }
    if (cfg.device == zinc::Device::kCuda) sum["gpu_state_peak_bytes"] = engine.gpu_state_peak_bytes();
    if (cfg.pipelined()) {
      sum["pipeline"] = {{"stages", cfg.pipeline.stages},
                         {"wait_share_per_rank", pipe_wait},
                         {"bubble_formula", pipe_bubble},
                         {"recomputed_forwards", engine.pipeline_recomputed_forwards()}};
    }
    if (cfg.tensor_split())
      sum["tensor_parallel"] = {{"parts", cfg.tensor_parallel.size}, {"wait_share_per_rank", tensor_wait}};
    if (cfg.sequence_split())
      sum["sequence_parallel"] = {{"ranks", cfg.sequence_parallel_size}, {"wait_share_per_rank", seq_wait}};
    if (cfg.expert_split())
      sum["expert_parallel"] = {{"ranks", cfg.expert_parallel.size}, {"wait_share_per_rank", ep_wait}};
    if (nvme) {
      sum["nvme_read_bytes_per_step"] = nvme_read;
      sum["nvme_write_bytes_per_step"] = nvme_written;
      sum["nvme_GBps"] = nvme_gbs;
    }
    std::printf("%s\n", zinc::tools::json_line(sum).c_str());
  } else if (trained <= 0) {
    // --steps 0, or a resume at run.steps: a load (and a save); no loss,
    // throughput or gathers to report.
    if (done_steps == 0)
      std::printf("done: 0 steps (the model loaded; nothing trained) | peak RSS %.0f MiB\n", rss_max / (1 << 20));
    else
      std::printf("done: nothing left to train (the checkpoint is at step %lld, run.steps %lld) | peak RSS %.0f "
                  "MiB\n", static_cast<long long>(done_steps), static_cast<long long>(run.steps), rss_max / (1 << 20));
    // The weights loaded: a script comparing a resumed run's digest gets it here too.
    if (digest) std::printf("weights digest (FNV-1a of the fp32 master weights): %s\n", digest_hex.c_str());
  } else {
    std::printf("done: %lld steps in %s | final loss %.4f", static_cast<long long>(done_steps),
                format_duration(elapsed).c_str(), loss);
    if (floor) std::printf(" (floor %.4f, gap %+.4f)", *floor, loss - *floor);
    if (ex.eval_data && loop.eval_step() == 0) {
      std::printf(" | no held-out loss yet");  // stopped before its first evaluation
    } else if (ex.eval_data) {
      std::printf(" | held-out loss %.4f", eval_loss);
      if (loop.eval_step() != done_steps)  // a stopped run's last evaluation, not at its end
        std::printf(" (at step %lld)", static_cast<long long>(loop.eval_step()));
    }
    std::printf(" | %.0f tok/s", tps);
    if (world == 1) {
      std::printf(" | peak RSS %.0f MiB", rss_max / (1 << 20));
    } else {
      std::printf(" | %d ranks, peak RSS per rank", world);
      for (double r : rss) std::printf(" %.0f", r / (1 << 20));
      std::printf(" MiB | waiting for communication %.1f%% of the time, not running %.1f%%", 100 * wait_share,
                  100 * off_cpu_share);
    }
    if (cfg.pipelined()) {
      std::printf(" | pipeline: waiting for the neighbouring stages");
      for (double w : pipe_wait) std::printf(" %.1f%%", 100 * w);
      std::printf(" of the time per rank (the 1F1B bubble (P-1)/(P-1+M) is %.1f%%)", 100 * pipe_bubble);
    }
    if (cfg.tensor_split()) {
      std::printf(" | tensor parts: in their all-reduces");
      for (double w : tensor_wait) std::printf(" %.1f%%", 100 * w);
      std::printf(" of the time per rank");
    }
    if (cfg.sequence_split()) {
      std::printf(" | sequence ranks: in the attention's all-to-alls");
      for (double w : seq_wait) std::printf(" %.1f%%", 100 * w);
      std::printf(" of the time per rank");
    }
    if (cfg.expert_split()) {
      std::printf(" | expert ranks: in the experts' exchanges");
      for (double w : ep_wait) std::printf(" %.1f%%", 100 * w);
      std::printf(" of the time per rank");
    }
    if (cfg.device == zinc::Device::kCuda)
      std::printf(" | GPU model state peak %.1f MiB (this rank)",
                  static_cast<double>(engine.gpu_state_peak_bytes()) / (1 << 20));
    if (engine.skipped_steps() > 0)
      std::printf(" | %lld steps skipped (%s)", static_cast<long long>(engine.skipped_steps()),
                  cfg.fp16.enabled ? "fp16 overflow" : "non-finite gradients");
    std::printf("\n");
    if (digest) std::printf("weights digest (FNV-1a of the fp32 master weights): %s\n", digest_hex.c_str());
    if (zero3)
      std::printf("ZeRO-3: %.1f block gathers per step, %.0f%% of them prefetched, %lld acquires waited for "
                  "their gather, at most %.2fM elements gathered at once%s\n",
                  static_cast<double>(zs.gathers) / per_step,
                  100.0 * static_cast<double>(zs.prefetched) / static_cast<double>(zs.gathers),
                  static_cast<long long>(zs.waited), static_cast<double>(zs.peak_live_numel) / 1e6,
                  zs.departures > 0 ? (", " + std::to_string(zs.departures) + " passes left the recorded order").c_str()
                                    : "");
    if (nvme)
      std::printf("%s on NVMe: %.1f MiB read and %.1f MiB written per step per rank, %.2f GB/s during %s\n",
                  nvme_opt && nvme_param ? "optimizer states and parameters"
                  : nvme_opt             ? "optimizer states"
                                         : "parameters",
                  nvme_read / (1 << 20), nvme_written / (1 << 20), nvme_gbs,
                  nvme_param ? "training" : "optimizer steps");
  }
  return exit_code;
}

}  // namespace

namespace {
int train_main(int argc, char** argv) {
  // A write past the file-size limit (ulimit -f) fails with EFBIG, which the
  // writers report naming the file; SIGXFSZ's default ended the process
  // without a word in the middle of a save.
  std::signal(SIGXFSZ, SIG_IGN);
  start_signal_thread();  // before any other thread (OpenMP, MPI, comm streams) starts
  CLI::App app{"zinc-train: train a built-in model from a DeepSpeed-style JSON config"};
  std::string config_path;
  std::vector<std::string> sets;
  int64_t steps = -1;  // -1: run.steps
  bool json = false;
  // --steps and --ranks take a positive integer; anything else ends the run
  // with one line saying so (CLI11's PositiveNumber printed "Value 0 not in
  // range 0.000000 to 1.797...e308") and exit code 2, as zinc-train's other
  // usage errors do.
  const auto integer_in = [](const char* name, int64_t min, int64_t max, auto& out) {
    return [name, min, max, &out](const std::string& s) {
      int64_t v = 0;
      bool ok = !s.empty() && s.size() <= 18;  // 18 digits cannot overflow
      for (char c : s) {
        ok = ok && c >= '0' && c <= '9';
        if (ok) v = v * 10 + (c - '0');
      }
      if (!ok || v < min || v > max) {
        throw CLI::ValidationError(std::string(name) + (min > 0 ? " must be a positive integer" : " must be an integer >= 0") +
                                       (max < 999999999999999999 ? " up to " + std::to_string(max) : "") +
                                       ", got " + s,
                                   2);
      }
      out = static_cast<std::remove_reference_t<decltype(out)>>(v);
    };
  };
  app.add_option("config", config_path, "experiment config (JSON)")->required();
  app.add_option_function<std::string>("--steps", integer_in("--steps", 0, 999999999999999999, steps),
                                        "optimizer steps (overrides run.steps; 0 loads, saves what is asked and exits)")
      ->type_name("INT");
  app.add_option("--set", sets, "override a config value: json.path=value (value parsed as JSON, "
                                "a bare word as a string); repeatable");
  app.add_flag("--json", json, "print one JSON object per line instead of human progress");
  bool check_only = false;
  app.add_flag("--check", check_only,
               "validate without training: print every key with its value and source, the warnings, and whether "
               "the run would start (exit 0) or is refused (exit 1)");
  bool estimate_only = false;
  int ranks = 0;
  app.add_flag("--estimate", estimate_only,
               "print the RAM and disk each rank will need (this stage and the others) and exit without training");
  app.add_option_function<std::string>(
         "--ranks", integer_in("--ranks", 1, 2147483647, ranks),
         "with --estimate or --check outside an MPI launcher: the number of ranks to plan for")
      ->type_name("INT");
  std::optional<std::string> resume;
  app.add_option("--resume", resume,
                 "continue from a checkpoint folder's latest tag (no value: run.checkpoint_dir)")
      ->expected(0, 1);
  bool digest = false;
  app.add_flag("--weights-digest", digest,
               "end with a digest of the final fp32 weights (to compare runs bit for bit)");
  std::string weights_out;
  app.add_option("--save-weights", weights_out,
                 "end by writing the final weights as fp32 to this .safetensors file (as zinc-export names them; "
                 "trained weights from their fp32 masters, a frozen base held in bf16 as those bf16 values)");
  SavePretrained pretrained;
  std::string save_dtype, max_shard = zinc::tools::kDefaultMaxShardSize;
  app.add_option("--save-pretrained", pretrained.dir,
                 "end by writing the model in the Hugging Face layout to this folder (config.json, safetensors, "
                 "and the tokenizer files of model.from_pretrained's folder): transformers' from_pretrained reads it");
  app.add_option("--save-dtype", save_dtype, "dtype of --save-pretrained's weights (default: the source folder's "
                                             "torch_dtype, else bf16)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_flag("--merge", pretrained.merge,
               "--save-pretrained of a model with LoRA adapters: merge them into the weights it writes (PEFT's "
               "merge_and_unload)");
  app.add_option("--save-adapter", pretrained.adapter_dir,
                 "end by writing the LoRA adapters to this folder in PEFT's format (adapter_config.json, "
                 "adapter_model.safetensors): peft.PeftModel.from_pretrained reads it onto the base model");
  app.add_option("--max-shard-size", max_shard, "--save-pretrained: largest safetensors file before sharding "
                                                "(bytes, or with a unit: KB, MB, GB, KiB, MiB, GiB)");
  bool ignore_resources = false;
  app.add_flag("--ignore-resources", ignore_resources,
               "start even when --estimate's RAM exceeds what this host grants (cgroup limit, MemAvailable) or the "
               "NVMe or checkpoint files exceed their disk's free space");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return zinc::tools::usage_error(app, e, "zinc-train");
  }
  std::shared_ptr<zinc::comm::Communicator> comm;
  try {
    std::vector<std::string> overrides = sets;
    if (steps >= 0) overrides.push_back("run.steps=" + std::to_string(steps));
    zinc::cpu_isa();  // an unknown ONEDNN_MAX_CPU_ISA ends the run here with one line
    nlohmann::json doc;
    try {
      doc = zinc::tools::load_document(config_path, overrides);
    } catch (const zinc::Error&) {
      if (!check_only) throw;  // --check reports it as its refusal
    }
    if (zinc::comm::launched_with_mpi()) {
      // The backend is needed before the config can be parsed (the batch
      // triad depends on the world size): the comm section alone, strictly.
      const zinc::tools::CommConfig cc = zinc::tools::ExperimentConfig::parse_comm(doc);
      const std::string backend = zinc::tools::comm_backend_name(cc.backend);
      const double timeout = cc.timeout_seconds;
      comm = zinc::comm::make_communicator(backend, timeout);
      g_under_mpi = comm->size() > 1;
    } else {
      comm = zinc::comm::make_single_communicator();
    }
    zinc::set_log_rank(comm->rank());
    if (comm->rank() != 0 && zinc::log_level() < zinc::LogLevel::kWarn) zinc::set_log_level(zinc::LogLevel::kWarn);
    // Every rank must be given the same command line and config: an option
    // on one rank only (--resume, --save-weights, --ignore-resources)
    // sent the ranks into different collectives, which ended in a timeout
    // naming no cause or in a raw MPI error, and configs that differ train
    // diverging replicas. (--json is rank 0's printing alone.)
    if (comm->size() > 1) {
      const nlohmann::json given = {
          {"options",
           {{"--steps", steps}, {"--check", check_only}, {"--estimate", estimate_only}, {"--ranks", ranks},
            {"--resume", resume ? nlohmann::json(resume->empty() ? "(no value: run.checkpoint_dir)" : *resume) : nlohmann::json()}, {"--weights-digest", digest},
            {"--save-weights", weights_out}, {"--save-pretrained", pretrained.dir}, {"--save-dtype", save_dtype},
            {"--merge", pretrained.merge}, {"--save-adapter", pretrained.adapter_dir}, {"--max-shard-size", max_shard},
            {"--ignore-resources", ignore_resources}}},
          {"config", doc}};
      if (const std::optional<zinc::RankDifference> d = zinc::rank_difference(*comm, given)) {
        if (d->path.rfind("options.", 0) == 0) {
          auto said = [&](const std::string& v) {
            return v == "nothing" || v == "null" || v == "false" || v == "\"\"" || v == "-1" || v == "0"
                       ? std::string("not given")
                       : v == "true" ? std::string("given") : v;
          };
          throw zinc::Error(d->path.substr(8) + ": the ranks were given different command lines: rank " +
                            std::to_string(d->other) + " " + said(d->at_other) + ", rank 0 " + said(d->at_root) +
                            " (every rank must run the same zinc-train options; nothing was trained)");
        }
        const std::string path = d->path.rfind("config.", 0) == 0 ? d->path.substr(7) : d->path;
        throw zinc::ConfigError(path, "the ranks were given different configs: rank " + std::to_string(d->other) +
                                          " has " + d->at_other + ", rank 0 has " + d->at_root +
                                          " (every rank must train the same config and model; nothing was trained)");
      }
    }
    if (!weights_out.empty()) {  // checked before training, not after it
      const std::filesystem::path wp(weights_out);
      if (wp.extension() != ".safetensors" ||
          !std::filesystem::is_directory(wp.parent_path().empty() ? "." : wp.parent_path())) {
        std::fprintf(stderr, "zinc-train: --save-weights %s: must be a .safetensors file in an existing folder\n",
                     weights_out.c_str());
        return 2;
      }
    }
    // "" (an unset shell variable) would write nothing, with exit 0.
    for (const auto& [flag, value, what] : {std::tuple<const char*, const std::string*, const char*>{
                                                "--save-pretrained", &pretrained.dir, "folder"},
                                            {"--save-adapter", &pretrained.adapter_dir, "folder"},
                                            {"--save-weights", &weights_out, "file"}})
      if (app.count(flag) > 0 && value->empty()) {
        std::fprintf(stderr, "zinc-train: %s: an empty path names no %s\n", flag, what);
        return 2;
      }
    if (!save_dtype.empty() && pretrained.dir.empty()) {
      std::fprintf(stderr, "zinc-train: --save-dtype needs --save-pretrained\n");
      return 2;
    }
    if (app.count("--max-shard-size") > 0 && pretrained.dir.empty()) {  // it did nothing, without a word
      std::fprintf(stderr, "zinc-train: --max-shard-size needs --save-pretrained (--save-weights and --save-adapter "
                           "write one file)\n");
      return 2;
    }
    if (!save_dtype.empty())
      pretrained.dtype = save_dtype == "fp32" ? zinc::DType::kF32 : save_dtype == "bf16" ? zinc::DType::kBF16 : zinc::DType::kF16;
    pretrained.max_shard_bytes = zinc::tools::parse_size(max_shard, "--max-shard-size");
    if (!pretrained.dir.empty() && std::filesystem::exists(pretrained.dir) &&
        !std::filesystem::is_directory(pretrained.dir)) {  // checked before training, not after it
      std::fprintf(stderr, "zinc-train: --save-pretrained %s: exists and is not a folder\n", pretrained.dir.c_str());
      return 2;
    }
    if (ranks > 0 && !estimate_only && !check_only) {
      std::fprintf(stderr,
                   "zinc-train: --ranks needs --estimate or --check (mpirun decides the ranks of a training run)\n");
      return 2;
    }
    if (estimate_only && check_only) {
      std::fprintf(stderr, "zinc-train: --estimate and --check are separate runs; give one\n");
      return 2;
    }
    if (estimate_only || check_only) {
      if (ranks > 0 && comm->size() > 1 && ranks != comm->size()) {
        std::fprintf(stderr, "zinc-train: --ranks %d differs from the %d ranks mpirun started\n", ranks,
                     comm->size());
        return 2;
      }
      const int world = comm->size() > 1 ? comm->size() : std::max(1, ranks);
      if (check_only) return zinc::tools::print_check(*comm, world, config_path, overrides, json, ignore_resources,
                                                               steps >= 0);
      return zinc::tools::print_estimate(*comm, world, doc, config_path, json);
    }
    return run(comm, doc, config_path, ignore_resources, json, digest, resume, weights_out, pretrained);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    zinc::remove_exit_folders();  // MPI_Abort skips destructors
    // An allocation that failed (past the start's room check, or with
    // --ignore-resources) says what it means rather than "std::bad_alloc".
    const std::string what = dynamic_cast<const std::bad_alloc*>(&e)
                                 ? "out of memory: an allocation failed (" + std::string(e.what()) +
                                       "); `zinc-train CONFIG --estimate` says what this config needs per rank"
                                 : e.what();
    if (comm && comm->size() > 1) comm->abort(1, what);  // ends every rank
    std::fprintf(stderr, "zinc-train: error: %s\n", what.c_str());
    return 1;
  }
}
}  // namespace

int main(int argc, char** argv) {
  zinc::tools::standard_streams();
  return zinc::tools::output_checked(train_main(argc, argv), "zinc-train");
}
