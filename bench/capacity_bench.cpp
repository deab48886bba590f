// zinc-bench capacity: a model larger than the memory it is given.
//
// A GPT whose model states (bf16 parameters 2 B, fp32 gradients 4 B, fp32
// master weights and Adam m, v 12 B per parameter: 18 B) are twice a memory
// cap trains at ZeRO stage 3 with its parameters and optimizer states on
// NVMe, as one zinc-train process inside a cgroup whose memory limit is the
// cap (the bench creates the group, moves the child into it and removes it).
// The same model and data train uncapped at stage 0 with everything in RAM;
// the losses and the final weights' digest must be the same bit for bit.
// The capped run's step time is compared with the disk bound measured in the
// same run: the bytes one step reads and writes on NVMe over fio's io_uring
// read and write rates on the same folder.
//
// --pretrained DIR: a Hugging Face folder instead (model.from_pretrained,
// e.g. the 500M Llama of tests/fixtures/hf/make_fixtures.py --big), under a
// cap of --cap-mib (default 3072): the load alone (--steps 0) and 2 steps
// run capped, the 2 steps again uncapped (the losses and weights must be the
// same); each run's peak RSS and the group's peak, and the load time against
// the disk's bound from fio in the same run (the folder's safetensors read,
// the optimizer states and parameter shards written).
//
// --pretrained DIR --lora: the same with LoRA adapters (r 16 on every
// linear layer; the base frozen, its bf16 shards on NVMe) and activation
// checkpointing, 3 steps, and the
// peak RSS per base parameter (make_fixtures.py --big --big-size 1.5b
// makes the 1.5B Llama of LoRA's capacity case).
//
// Needs root and a writable memory controller (cgroup v1 memory, or v2 with
// memory enabled in the root's subtree); otherwise it says so and skips.
// Folder: ZINC_BENCH_NVME_PATH (default /tmp).
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench/benches.h"

namespace zinc::bench {
namespace {

bool write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.flush();
  return static_cast<bool>(f);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A memory cgroup with a limit: v1 (memory.limit_in_bytes) or v2
// (memory.max). Removed by the destructor (after its processes ended).
class MemoryCap {
 public:
  explicit MemoryCap(int64_t bytes, const std::string& suffix = "") {
    const std::string name = "zinc-capacity-" + std::to_string(::getpid()) + suffix;
    const std::string v1 = "/sys/fs/cgroup/memory";
    if (::access((v1 + "/memory.limit_in_bytes").c_str(), F_OK) == 0) {
      dir_ = v1 + "/" + name;
      limit_file_ = "memory.limit_in_bytes";
      peak_file_ = "memory.max_usage_in_bytes";
    } else {
      dir_ = "/sys/fs/cgroup/" + name;
      limit_file_ = "memory.max";
      peak_file_ = "memory.peak";
    }
    if (::mkdir(dir_.c_str(), 0755) != 0) {
      why_ = "cannot create " + dir_ + ": " + std::strerror(errno);
      dir_.clear();
      return;
    }
    if (!write_text(dir_ + "/" + limit_file_, std::to_string(bytes))) {
      why_ = "cannot set " + dir_ + "/" + limit_file_;
      return;
    }
    ok_ = true;
  }
  ~MemoryCap() {
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  MemoryCap(const MemoryCap&) = delete;
  MemoryCap& operator=(const MemoryCap&) = delete;

  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  std::string procs() const { return dir_ + "/cgroup.procs"; }
  // The group's peak memory use (bytes), or -1 where the kernel does not keep it.
  int64_t peak() const {
    const std::string t = read_text(dir_ + "/" + peak_file_);
    return t.empty() ? -1 : std::atoll(t.c_str());
  }

 private:
  std::string dir_, limit_file_, peak_file_, why_;
  bool ok_ = false;
};

struct Run {
  std::vector<double> losses, elapsed;
  std::string digest;
  double nvme_read = 0, nvme_write = 0;  // bytes per step
  int64_t peak_rss = 0;
  int64_t child_max_rss = 0;  // the process's peak RSS from wait4 (also when it trains no step)
  double wall_s = 0;          // fork to exit
};

// zinc-train CONFIG --json, in a child that first joins `cap` (if given);
// its JSON lines go to `out`.
Run train(const std::string& zinc_train, const std::string& config, int steps, const std::string& out,
          const MemoryCap* cap) {
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) throw Error("capacity bench: fork failed");
  if (pid == 0) {
    if (cap && !write_text(cap->procs(), "0")) {
      std::fprintf(stderr, "capacity bench: cannot join %s\n", cap->procs().c_str());
      ::_exit(3);
    }
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) ::_exit(4);
    ::dup2(fd, 1);
    const std::string s = std::to_string(steps);
    ::execl(zinc_train.c_str(), zinc_train.c_str(), config.c_str(), "--json", "--weights-digest", "--steps",
            s.c_str(), "--set", "steps_per_print=1", static_cast<char*>(nullptr));
    ::_exit(5);
  }
  int status = 0;
  struct rusage ru {};
  ::wait4(pid, &status, 0, &ru);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw Error("capacity bench: zinc-train " + config + (cap ? " (capped)" : "") +
                " failed (status " + std::to_string(status) + "); its output is in " + out);
  Run r;
  r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.child_max_rss = static_cast<int64_t>(ru.ru_maxrss) * 1024;
  std::ifstream f(out);
  for (std::string line; std::getline(f, line);) {
    if (line.empty() || line[0] != '{') continue;
    const nlohmann::json e = nlohmann::json::parse(line);
    if (e["event"] == "step") {
      r.losses.push_back(e["loss"].get<double>());
      r.elapsed.push_back(e["elapsed_s"].get<double>());
    } else if (e["event"] == "summary") {
      r.digest = e.value("weights_digest", "");
      r.nvme_read = e.value("nvme_read_bytes_per_step", 0.0);
      r.nvme_write = e.value("nvme_write_bytes_per_step", 0.0);
      r.peak_rss = e.value("peak_rss_bytes", int64_t{0});
    }
  }
  return r;
}

}  // namespace

std::string zinc_train_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error("zinc-bench: cannot read /proc/self/exe");
  std::string p(buf, static_cast<size_t>(n));
  p = p.substr(0, p.rfind('/')) + "/../tools/zinc-train";
  if (::access(p.c_str(), X_OK) != 0) throw Error("zinc-bench: " + p + " not found (build the zinc-train target)");
  return p;
}

nlohmann::json last_json_event(const std::string& command, const std::string& event, const std::string& bench) {
  std::FILE* p = ::popen(command.c_str(), "r");
  if (!p) throw Error(bench + " bench: cannot run " + command);
  nlohmann::json found;
  char line[1 << 16];
  while (std::fgets(line, sizeof line, p)) {
    if (line[0] != '{') continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("event", "") == event) found = j;
  }
  const int rc = ::pclose(p);
  if (rc != 0 || found.is_null())
    throw Error(bench + " bench: `" + command + "` failed (status " + std::to_string(rc) + ")");
  return found;
}

namespace {

double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

// A pretrained folder under a cap (see the top of the file).
int bench_capacity_pretrained(const BenchOptions& o) {
  namespace fs = std::filesystem;
  const char* env = std::getenv("ZINC_BENCH_NVME_PATH");
  const std::string folder = env && *env ? env : "/tmp";
  const std::string zinc_train = zinc_train_path();
  require_fio();
  if (!fs::is_directory(o.pretrained)) throw Error("capacity bench: --pretrained " + o.pretrained + " is not a folder");
  int64_t weight_bytes = 0;  // what the load reads
  for (const auto& e : fs::directory_iterator(o.pretrained))
    if (e.path().extension() == ".safetensors") weight_bytes += static_cast<int64_t>(e.file_size());
  const int64_t cap_bytes = o.cap_mib << 20;
  const int steps = o.lora ? 3 : 2;
  char tmpl[] = "/tmp/zinc-capacity-XXXXXX";
  if (!::mkdtemp(tmpl)) throw Error("capacity bench: mkdtemp failed");
  const std::string work = tmpl;
  const nlohmann::json cfg = {
      {"train_micro_batch_size_per_gpu", 1},
      {"gradient_accumulation_steps", 1},
      {"gradient_clipping", 1.0},
      {"bf16", {{"enabled", true}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}}}}},
      {"model", {{"from_pretrained", o.pretrained}}},
      {"data", {{"type", "synthetic"}, {"vocab_size", 8192}, {"seq_len", 128}}},
      {"run", {{"eval_interval", 0}}},
      {"aio", {{"block_size", 1048576}, {"queue_depth", 8}}},
      {"zero_optimization",
       {{"stage", 3},
        {"overlap_comm", true},
        {"stage3_max_reuse_distance", 0},
        {"sub_group_size", 5000000},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", folder}, {"buffer_count", 4}}},
        {"offload_param", {{"device", "nvme"}, {"nvme_path", folder}}}}}};
  nlohmann::json doc = cfg;
  if (o.lora) {
    // As LoRA recipes run: the layers recomputed in backward (the
    // activations of a 1.5B model outweigh its gathered blocks).
    doc["model"]["lora"] = {{"r", 16}, {"lora_alpha", 32}, {"target_modules", "all-linear"}};
    doc["model"]["gradient_checkpointing"] = true;
  }
  const std::string config = work + "/pretrained.json";
  write_text(config, doc.dump(2));
  // What the load writes: the estimate's NVMe files (optimizer states and
  // parameter shards; the gradients file is only preallocated).
  const nlohmann::json est =
      last_json_event(zinc_train + " " + config + " --estimate --json 2>/dev/null", "estimate", "capacity");
  int64_t load_writes = 0;
  for (const auto& part : est["breakdown"]["disk"])
    if (part.value("name", "").rfind("gradients", 0) != 0) load_writes += part.value("bytes", int64_t{0});

  MemoryCap load_cap(cap_bytes, "-load");
  if (!load_cap.ok()) return skipped(o.json, "capacity", "the memory controller is not writable here (" + load_cap.why() + ")");
  const Run load = train(zinc_train, config, 0, work + "/load.out", &load_cap);
  const int64_t load_group_peak = load_cap.peak();
  MemoryCap train_cap(cap_bytes, "-train");
  const Run capped = train(zinc_train, config, steps, work + "/capped.out", &train_cap);
  const int64_t train_group_peak = train_cap.peak();
  const Run full = train(zinc_train, config, steps, work + "/full.out", nullptr);
  const std::string fio_file = folder + "/zinc-capacity-fio.dat";
  const double fio_w = fio_bw(fio_file, int64_t{1} << 30, true);
  const double fio_r = fio_bw(fio_file, int64_t{1} << 30, false);
  ::unlink(fio_file.c_str());
  const bool same = capped.losses == full.losses && capped.digest == full.digest && !capped.digest.empty() &&
                    static_cast<int>(capped.losses.size()) == steps;
  const double read_bound = static_cast<double>(weight_bytes) / fio_r;
  const double load_bound = read_bound + static_cast<double>(load_writes) / fio_w;
  nlohmann::json line = {{"bench", "capacity"},
                         {"case", o.lora ? "pretrained-lora/stage3-nvme" : "pretrained/stage3-nvme"},
                         {"figure", load.wall_s},
                         {"unit", "s to load"},
                         {"bound", load_bound},
                         {"ratio", load.wall_s / load_bound},
                         {"pretrained", o.pretrained},
                         {"parameters", est.value("parameters", int64_t{0})},
                         {"cap_bytes", cap_bytes},
                         {"load_peak_rss_bytes", load.child_max_rss},
                         {"load_cgroup_peak_bytes", load_group_peak},
                         {"train_peak_rss_bytes", capped.child_max_rss},
                         {"train_cgroup_peak_bytes", train_group_peak},
                         {"uncapped_peak_rss_bytes", full.child_max_rss},
                         {"weights_read_bytes", weight_bytes},
                         {"load_nvme_write_bytes", load_writes},
                         {"load_read_bound_s", read_bound},
                         {"fio_read_Bps", fio_r},
                         {"fio_write_Bps", fio_w},
                         {"train_wall_s", capped.wall_s},
                         {"losses", capped.losses},
                         {"uncapped_losses", full.losses},
                         {"losses_equal_uncapped", same},
                         {"digest", capped.digest}};
  // LoRA's figure is per parameter of the frozen base (the adapters not counted).
  const double params = static_cast<double>(est.value("parameters", int64_t{0}) -
                                            (o.lora ? est.value("trained_parameters", int64_t{0}) : 0));
  if (o.lora && params > 0) line["train_peak_rss_bytes_per_parameter"] = static_cast<double>(capped.child_max_rss) / params;
  char buf[1400];
  std::snprintf(buf, sizeof buf,
                "capacity: %s, %.1fM parameters, cap %.0f MiB, stage 3 on NVMe | load: peak RSS %.0f MiB (group %.0f "
                "MiB), %.1f s against a disk bound of %.1f s (%.0f MiB read at %.2f GB/s = %.1f s, %.0f MiB written at "
                "%.2f GB/s), ratio %.2f | %d steps capped: peak RSS %.0f MiB (group %.0f MiB), %.1f s, losses %s the "
                "uncapped run's (peak RSS %.0f MiB)",
                o.pretrained.c_str(), static_cast<double>(est.value("parameters", int64_t{0})) / 1e6, mib(cap_bytes),
                mib(load.child_max_rss), mib(load_group_peak), load.wall_s, load_bound, mib(weight_bytes), fio_r / 1e9,
                read_bound, mib(load_writes), fio_w / 1e9, load.wall_s / load_bound, steps, mib(capped.child_max_rss),
                mib(train_group_peak), capped.wall_s, same ? "bit-identical to" : "DIFFERENT FROM",
                mib(full.child_max_rss));
  std::string text = buf;
  if (o.lora && params > 0) {
    char part[200];
    std::snprintf(part, sizeof part, " | LoRA r 16 on every linear layer: peak RSS %.2f B per base parameter",
                  static_cast<double>(capped.child_max_rss) / params);
    text += part;
  }
  emit(o.json, line, text);
  for (const char* f : {"/pretrained.json", "/load.out", "/capped.out", "/full.out"}) std::remove((work + f).c_str());
  ::rmdir(work.c_str());
  return same ? 0 : 1;
}

}  // namespace

int bench_capacity(const BenchOptions& o) {
  if (!o.pretrained.empty()) return bench_capacity_pretrained(o);
  const char* env = std::getenv("ZINC_BENCH_NVME_PATH");
  const std::string folder = env && *env ? env : "/tmp";
  const std::string zinc_train = zinc_train_path();
  require_fio();
  // GPT 16 x 768, vocabulary 256, T 64: 113.6M parameters, model states
  // 18 B each = 2.04 GB; the cap is half of that. What the capped run keeps
  // in RAM: the fp32 gradients (4 B per parameter: one rank holds them
  // whole), the gathered blocks and their read buffers (at most two layers
  // each), the swapper's sub-group buffers and the process itself.
  const int64_t L = 16, C = 768, H = 12, V = 256, T = 64;
  const double psi = static_cast<double>(L * 12 * C * C + L * 13 * C + V * C + T * C + 2 * C);
  const int64_t states = static_cast<int64_t>(18 * psi);
  const int64_t cap_bytes = states / 2;
  const int steps = std::max(3, o.steps);
  char tmpl[] = "/tmp/zinc-capacity-XXXXXX";
  if (!::mkdtemp(tmpl)) throw Error("capacity bench: mkdtemp failed");
  const std::string work = tmpl;
  nlohmann::json base = {
      {"train_micro_batch_size_per_gpu", 2},
      {"gradient_accumulation_steps", 1},
      {"gradient_clipping", 1.0},
      {"bf16", {{"enabled", true}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"weight_decay", 0.1}}}}},
      {"model", {{"type", "gpt"}, {"n_layer", L}, {"n_head", H}, {"n_embd", C}, {"vocab_size", V}}},
      {"data", {{"type", "synthetic"}, {"vocab_size", V}, {"seq_len", T}}},
      {"run", {{"eval_interval", 0}}},
      {"aio", {{"block_size", 1048576}, {"queue_depth", 8}}}};
  nlohmann::json ref = base;
  ref["zero_optimization"] = {{"stage", 0}};
  nlohmann::json off = base;
  const int64_t layer = 12 * C * C;
  off["zero_optimization"] = {
      {"stage", 3},
      {"overlap_comm", true},
      {"stage3_max_reuse_distance", 0},
      {"stage3_prefetch_bucket_size", layer},
      {"stage3_max_live_parameters", 2 * layer},
      {"sub_group_size", 1000000},
      {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", folder}, {"buffer_count", 4}}},
      {"offload_param", {{"device", "nvme"}, {"nvme_path", folder}}}};
  write_text(work + "/ref.json", ref.dump(2));
  write_text(work + "/offload.json", off.dump(2));

  MemoryCap cap(cap_bytes);
  if (!cap.ok()) return skipped(o.json, "capacity", "the memory controller is not writable here (" + cap.why() + ")");
  const Run capped = train(zinc_train, work + "/offload.json", steps, work + "/offload.out", &cap);
  const int64_t cap_peak = cap.peak();
  const Run full = train(zinc_train, work + "/ref.json", steps, work + "/ref.out", nullptr);
  const std::string fio_file = folder + "/zinc-capacity-fio.dat";
  const double fio_w = fio_bw(fio_file, int64_t{1} << 30, true);
  const double fio_r = fio_bw(fio_file, int64_t{1} << 30, false);
  ::unlink(fio_file.c_str());

  const bool same = capped.losses == full.losses && capped.digest == full.digest && !capped.digest.empty();
  // Step time: the steps after the first (its reads start cold), median.
  std::vector<double> dt;
  for (size_t i = 1; i < capped.elapsed.size(); ++i) dt.push_back(capped.elapsed[i] - capped.elapsed[i - 1]);
  const double step_s = dt.empty() ? capped.elapsed.back() : median(dt);
  const double bound_s = capped.nvme_read / fio_r + capped.nvme_write / fio_w;
  const double ratio = step_s / bound_s;
  const double tokens_per_s = 2.0 * static_cast<double>(T) / step_s;
  nlohmann::json line = {{"bench", "capacity"},
                         {"case", "gpt16x768/stage3-nvme"},
                         {"figure", step_s},
                         {"unit", "s per step"},
                         {"bound", bound_s},
                         {"ratio", ratio},
                         {"params", psi},
                         {"model_state_bytes", states},
                         {"cap_bytes", cap_bytes},
                         {"cgroup_peak_bytes", cap_peak},
                         {"peak_rss_bytes", capped.peak_rss},
                         {"nvme_read_bytes_per_step", capped.nvme_read},
                         {"nvme_write_bytes_per_step", capped.nvme_write},
                         {"fio_read_Bps", fio_r},
                         {"fio_write_Bps", fio_w},
                         {"tokens_per_s", tokens_per_s},
                         {"losses", capped.losses},
                         {"losses_equal_uncapped_stage0", same},
                         {"digest", capped.digest},
                         {"uncapped_digest", full.digest}};
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "capacity: GPT %.1fM params, model states %.0f MiB, under a cap of %.0f MiB (cgroup peak %.0f MiB, "
                "peak RSS %.0f MiB) at stage 3 with parameters and optimizer states on NVMe: %d steps, losses and "
                "weights %s the uncapped stage-0 run | step %.2f s | disk bound %.2f s (%.0f MiB read at %.2f GB/s, "
                "%.0f MiB written at %.2f GB/s) | ratio %.2f | %.0f tok/s",
                psi / 1e6, static_cast<double>(states) / (1 << 20), static_cast<double>(cap_bytes) / (1 << 20),
                static_cast<double>(cap_peak) / (1 << 20), static_cast<double>(capped.peak_rss) / (1 << 20), steps,
                same ? "bit-identical to" : "DIFFERENT FROM", step_s, bound_s, capped.nvme_read / (1 << 20),
                fio_r / 1e9, capped.nvme_write / (1 << 20), fio_w / 1e9, ratio, tokens_per_s);
  emit(o.json, line, buf);
  std::remove((work + "/ref.json").c_str());
  std::remove((work + "/offload.json").c_str());
  std::remove((work + "/ref.out").c_str());
  std::remove((work + "/offload.out").c_str());
  ::rmdir(work.c_str());
  return same ? 0 : 1;
}

}  // namespace zinc::bench
