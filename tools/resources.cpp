#include "tools/resources.h"

#include <sys/resource.h>

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include <cmath>

#include "core/device.h"
#include "core/log.h"
#include "engine/memory_estimate.h"

namespace zinc::tools {
namespace {

// A size in the unit that shows it (a 600 KB checkpoint on a 3 MB disk read
// "0.00 GiB ... 0.00 GiB free").
std::string gib(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= double(1 << 30) || b == 0)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  else if (b >= double(1 << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  else
    std::snprintf(buf, sizeof buf, "%.0f KiB", std::ceil(b / 1024));
  return buf;
}

// The first line of a small file, or "".
std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

int64_t parse_bytes(const std::string& s) {
  if (s.empty() || s == "max") return -1;
  try {
    return static_cast<int64_t>(std::stoll(s));
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

int64_t Room::ram() const {
  int64_t out = -1;
  for (const int64_t v : {mem_available, cgroup_room, address_room})
    if (v >= 0 && (out < 0 || v < out)) out = v;
  return out;
}

std::string Room::where() const {
  const int64_t r = ram();
  if (r >= 0 && r == cgroup_room) return "cgroup " + cgroup_where;
  if (r >= 0 && r == address_room) return address_where;
  return "MemAvailable " + gib(mem_available);
}

Room memory_room() {
  Room r;
  std::ifstream mi("/proc/meminfo");
  for (std::string line; std::getline(mi, line);)
    if (line.rfind("MemAvailable:", 0) == 0) r.mem_available = parse_bytes(line.substr(13)) * 1024;
  // cgroup v2: "0::/path"; the limit that binds is the tightest over the
  // ancestors. v1: the memory controller's own line.
  std::ifstream cg("/proc/self/cgroup");
  for (std::string line; std::getline(cg, line);) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::filesystem::path p = line.substr(b + 1);
    const bool v2 = line.rfind("0::", 0) == 0;
    if (!v2 && controllers.find("memory") == std::string::npos) continue;
    // v2 alone at /sys/fs/cgroup; beside v1 (hybrid) at /sys/fs/cgroup/unified.
    const std::string root = !v2 ? "/sys/fs/cgroup/memory"
                             : std::filesystem::exists("/sys/fs/cgroup/cgroup.controllers") ? "/sys/fs/cgroup"
                                                                                            : "/sys/fs/cgroup/unified";
    for (;;) {
      const std::string dir = root + (p.string() == "/" ? "" : p.string());
      const int64_t limit = parse_bytes(first_line(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes")));
      const int64_t used = parse_bytes(first_line(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes")));
      if (limit > 0 && limit < (int64_t{1} << 60) && used >= 0) {
        const int64_t room = std::max<int64_t>(0, limit - used);
        if (r.cgroup_room < 0 || room < r.cgroup_room) {
          r.cgroup_room = room;
          r.cgroup_where = dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes") + " = " + gib(limit) + ", " +
                           gib(used) + " in use";
        }
      }
      if (p.string() == "/" || p.empty() || !p.has_parent_path() || p.parent_path() == p) break;
      p = p.parent_path();
    }
  }
  // The address-space limit, against the address space this process maps
  // now (VmSize counts reserved but untouched memory too, which the limit
  // counts as well).
  struct rlimit as {};
  if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("VmSize:", 0) == 0) {
        const int64_t used = parse_bytes(line.substr(7)) * 1024;
        const int64_t limit = static_cast<int64_t>(std::min<rlim_t>(as.rlim_cur, rlim_t{1} << 62));
        if (used >= 0) {
          r.address_room = std::max<int64_t>(0, limit - used);
          r.address_where = "RLIMIT_AS (ulimit -v) " + gib(limit) + ", " + gib(used) + " of address space mapped";
        }
      }
  }
  return r;
}

namespace {
// `path`, or its nearest existing folder, stat'ed by `probe` (statvfs or
// stat into `st`); false when no folder up to the root exists.
template <class Stat, class Probe>
bool stat_nearest(const std::string& path, Stat& st, Probe probe) {
  std::filesystem::path p = std::filesystem::absolute(path);
  for (;;) {
    if (probe(p.c_str(), &st) == 0) return true;
    if (!p.has_parent_path() || p.parent_path() == p) return false;
    p = p.parent_path();
  }
}
}  // namespace

int64_t free_disk_bytes(const std::string& path) {
  struct statvfs st;
  if (!stat_nearest(path, st, ::statvfs)) return -1;
  // No blocks at all: a pseudo file system (proc, sys), size unknown.
  return st.f_blocks == 0 ? -1 : static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

// Whether the file system holding `path` (or its nearest existing folder)
// is mounted read-only: such a disk reports no room, which is not the
// reason to give.
bool read_only_disk(const std::string& path) {
  struct statvfs st;
  return stat_nearest(path, st, ::statvfs) && (st.f_flag & ST_RDONLY) != 0;
}

// The device of the file system holding `path` (or its nearest existing
// folder); 0 when none is found.
dev_t disk_device(const std::string& path) {
  struct stat st;
  return stat_nearest(path, st, [](const char* p, struct stat* s) { return ::stat(p, s); }) ? st.st_dev : 0;
}

// How many complete checkpoints (global_step<N> folders with their
// metadata) `dir` holds; 0 when it does not exist.
int64_t complete_checkpoints(const std::string& dir) {
  namespace fs = std::filesystem;
  int64_t n = 0;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code ec2;
    if (name.size() > 11 && name.compare(0, 11, "global_step") == 0 &&
        name.find_first_not_of("0123456789", 11) == std::string::npos && e.is_directory(ec2) &&
        fs::exists(e.path() / "metadata.json", ec2))
      ++n;
  }
  return n;
}

namespace {
// The estimates create oneDNN primitives to learn their scratch sizes, and
// oneDNN crashes (SIGSEGV in primitive creation) where its allocations fail
// instead of saying so: under an address-space limit that leaves almost no
// room, the check that should refuse a run segfaulted. Below this room no
// estimate is made: the refusal says so at once.
constexpr int64_t kEstimateAddressBytes = int64_t{64} << 20;
std::string too_little_address_room(const Room& room) {
  if (room.address_room < 0 || room.address_room >= kEstimateAddressBytes) return "";
  return "the address-space limit leaves this process " + gib(room.address_room) + " (" + room.address_where +
         "), too little to estimate the run in, let alone run it: raise ulimit -v";
}
}  // namespace

std::string batch_room_refusal(const Model& model, DType compute, int64_t B, int64_t T, int64_t held_B,
                               int64_t held_T) {
  if (B <= held_B && T <= held_T) return "";
  if (std::string why = too_little_address_room(memory_room()); !why.empty()) return why;
  auto bytes = [&](int64_t b, int64_t t) -> int64_t {
    if (b <= 0 || t <= 0) return 0;
    const std::optional<ActivationMemory> a = model.activation_memory(b, t, compute);
    return a ? a->saved + a->workspace : -1;
  };
  const int64_t need = bytes(B, T), held = bytes(held_B, held_T);
  if (need < 0 || held < 0 || need <= held) return "";
  const Room room = memory_room();
  if (room.ram() < 0 || need - held <= room.ram()) return "";
  return "a batch of " + std::to_string(B) + " x " + std::to_string(T) + " tokens needs about " + gib(need) +
         " of activations (" + gib(need - held) + " more than the engine holds), but the process may take " +
         gib(room.ram()) + " (" + room.where() + "): pass smaller batches";
}

std::vector<std::string> resource_refusals(const Experiment& ex, int local_ranks, int local_rank,
                                           const std::vector<ExportOnDisk>& exports) {
  std::vector<std::string> out;
  const Config& cfg = ex.config;
  if (std::string why = too_little_address_room(memory_room()); !why.empty()) return {"RAM: " + why};
  MemoryEstimate e = estimate_memory(*ex.model, cfg, ex.data->seq_len());
  const int64_t rss = current_rss_bytes();
  e.process_bytes = rss;
  const std::string ranks = local_ranks == 1 ? "this rank" : std::to_string(local_ranks) + " ranks on this host";
  const Room room = memory_room();
  // What the run will still allocate (the process so far is in use
  // already): the host's ranks together against the host's room
  // (MemAvailable, the cgroup), and this rank alone against its own
  // address-space limit (one per process).
  const int64_t per_rank = std::max<int64_t>(0, e.ram_bytes() - rss);
  Room host = room, own;
  host.address_room = -1;
  own.address_room = room.address_room;
  own.address_where = room.address_where;
  const bool host_short = host.ram() >= 0 && per_rank * local_ranks > host.ram();
  const bool own_short = own.address_room >= 0 && per_rank > own.address_room;
  // A LoRA base kept packed (Note [packed frozen weights] in
  // csrc/kernels/matmul.cpp) is the first thing to give up.
  int64_t packed = 0;
  for (const MemoryPart& p : e.training)
    if (p.name == "packed frozen weights") packed += p.bytes;
  if (host_short || own_short) {
    const Room& limit = host_short ? host : own;
    const int64_t more = host_short ? per_rank * local_ranks : per_rank;
    out.push_back("RAM: " + (host_short ? ranks : std::string("this rank")) + " will need " + gib(more) +
                  " more (--estimate: " + gib(e.ram_bytes()) + " per rank, " + gib(rss) +
                  " of it in use), but the process may take " + gib(limit.ram()) + " (" + limit.where() +
                  "); lower the model, micro-batch or stage's memory (" +
                  (packed > 0 ? "model.pack_frozen_weights false saves " + gib(packed) + " per rank, " : "") +
                  "offload_optimizer, offload_param, gradient checkpointing), or pass --ignore-resources");
  }
  // GPU memory ("device": "cuda"): --estimate's GPU parts against the
  // GPU's free memory, for every rank of this host on that GPU (ranks share
  // one where there are fewer GPUs than ranks). The CUDA context and the
  // cuBLAS workspaces of streams other than the compute stream come on top
  // of the estimate: it is a lower bound.
  if (cfg.device == Device::kCuda && e.gpu_bytes() > 0) {
    const auto [free_b, total_b] = cuda_memory(local_rank);
    const int devices = std::max(1, cuda_status().devices);
    const int64_t sharing = (local_ranks + devices - 1) / devices;
    const int64_t need = e.gpu_bytes() * sharing;
    if (free_b >= 0 && need > free_b)
      out.push_back("GPU: " + (sharing > 1 ? std::to_string(sharing) + " ranks on one GPU" : std::string("this rank")) +
                    " will need " + gib(need) + " of GPU memory (--estimate: " + gib(e.gpu_bytes()) +
                    " per rank, before the CUDA context), but the GPU has " + gib(free_b) +
                    " free of " + gib(total_b) +
                    "; lower the model or micro-batch, offload the optimizer states or parameters, turn on gradient "
                    "checkpointing, or pass --ignore-resources");
  }
  // Disk, per file system (folders on one disk share its room): the NVMe
  // files of the two offloads, and the checkpoints that will be on disk at
  // once (each rank's fp32 master, m and v of the blocks it trains; at stage
  // 0 every rank saves the whole model). A save writes its tag before the
  // oldest goes, so run.keep_last N keeps up to N + 1 for a moment; with
  // keep_last 0 (every one kept) the check asks for the next two, and says
  // so when the run's later saves will not fit.
  struct OnDisk {
    dev_t dev = 0;
    std::vector<std::pair<std::string, std::string>> folders;  // the JSON paths naming a folder, the folder
    int64_t offload = 0, checkpoints = 0, exports = 0;
    std::string export_flags;  // "--save-pretrained" or "--save-weights and --save-pretrained"
    std::string keys() const {  // "a.nvme_path, b.nvme_path /x, run.checkpoint_dir /y"
      std::string out;
      for (const auto& [k, f] : folders) out += (out.empty() ? "" : ", ") + k + " " + f;
      return out;
    }
  };
  std::vector<OnDisk> disks;  // in the order first named
  auto disk_of = [&](const std::string& path, const std::string& key) -> OnDisk& {
    const dev_t dev = disk_device(path);
    OnDisk* d = nullptr;
    for (OnDisk& x : disks)
      if (x.dev == dev && dev != 0) d = &x;
    if (!d) d = &disks.emplace_back(OnDisk{dev, {}, 0, 0, 0, {}});
    auto same = std::find_if(d->folders.begin(), d->folders.end(), [&](const auto& kf) { return kf.second == path; });
    if (same != d->folders.end())
      same->first += ", " + key;
    else
      d->folders.emplace_back(key, path);
    return *d;
  };
  int64_t opt_disk = 0, param_disk = 0;
  for (const MemoryPart& p : e.disk) (p.name.rfind("parameter shards", 0) == 0 ? param_disk : opt_disk) += p.bytes;
  for (const auto& [o, key, bytes] : {std::tuple{&cfg.zero.offload_optimizer, "zero_optimization.offload_optimizer.nvme_path", opt_disk},
                                      std::tuple{&cfg.zero.offload_param, "zero_optimization.offload_param.nvme_path", param_disk}})
    if (o->device == OffloadDevice::kNvme && bytes > 0) disk_of(o->nvme_path, key).offload += bytes * local_ranks;
  const RunConfig& run = ex.experiment.run;
  int64_t one_checkpoint = 0, saves = 0, at_once = 0;
  if (run.checkpoint_interval > 0) {
    int64_t params = 0;
    for (const BlockSpec& b : ex.model->blocks())
      if (!b.frozen)  // a LoRA base is not saved
        for (const ParamSpec& p : b.params) params += p.shape.numel();
    const int64_t copies = cfg.zero.stage == 0 ? cfg.world_size : 1;
    one_checkpoint = 12 * params * copies;  // fp32 master, Adam m and v
    saves = run.steps / run.checkpoint_interval + (run.steps % run.checkpoint_interval != 0 ? 1 : 0);
    // Checkpoints already there take room the free space has left out:
    // with keep_last N the folder grows to N + 1 during a save, from what
    // is there now (a resume's earlier tags), by one at least.
    const int64_t there = complete_checkpoints(run.checkpoint_dir);
    // With every one kept, the saves still to come (a resume's earlier
    // ones among those there), the next two asked for.
    at_once = run.keep_last > 0 ? std::max<int64_t>(1, std::min(run.keep_last + 1, there + saves) - there)
                                : std::max<int64_t>(1, std::min<int64_t>(saves - there, 2));
    saves = std::max<int64_t>(1, run.keep_last > 0 ? saves : saves - there);
    disk_of(run.checkpoint_dir, "run.checkpoint_dir").checkpoints = one_checkpoint * at_once;
  }
  // (An export's folder may not exist yet: the nearest existing one's file
  // system is asked, as for every folder here.)
  for (const ExportOnDisk& x : exports) {
    OnDisk& d = disk_of(x.path, x.flag);
    d.exports += x.bytes;
    d.export_flags += (d.export_flags.empty() ? "" : " and ") + x.flag;
  }
  for (const OnDisk& d : disks) {
    std::string what;
    if (d.offload > 0) what = gib(d.offload) + " of optimizer and parameter files from " + ranks;
    if (d.checkpoints > 0)
      what += (what.empty() ? "" : " and ") + gib(d.checkpoints) + " for " +
              (at_once == 1 ? "one more checkpoint" : std::to_string(at_once) + " more checkpoints at once") + " (12 B per trained parameter" +
              (cfg.zero.stage == 0 && cfg.world_size > 1 ? ", on each of the " + std::to_string(cfg.world_size) + " ranks at stage 0" : std::string()) +
              (at_once > 1 ? (run.keep_last > 0 ? "; a save writes its tag before the oldest of run.keep_last " + std::to_string(run.keep_last) + " goes"
                                                : "; run.keep_last 0 keeps every one")
                           : std::string()) + ")";
    if (d.exports > 0)
      what += (what.empty() ? "" : " and ") + gib(d.exports) + " for " + d.export_flags + " at its end";
    const std::string& path = d.folders.front().second;
    const int64_t need = d.offload + d.checkpoints + d.exports, free = free_disk_bytes(path);
    if (read_only_disk(path))
      out.push_back("disk: " + d.keys() + ": its file system is mounted read-only, and the run will write " + what +
                    " there; choose a writable folder");
    else if (free >= 0 && need > free)
      out.push_back("disk: " + d.keys() + ": the run will write " + what + " on one file system, which has " + gib(free) +
                    " free; use a larger disk" + (d.checkpoints > 0 && run.keep_last != 1 ? ", a smaller run.keep_last" : "") +
                    " or pass --ignore-resources");
    else if (free >= 0 && d.checkpoints > 0 && run.keep_last == 0 && saves > at_once &&
             d.offload + one_checkpoint * saves > free)
      log_warn_rank0("disk: run.checkpoint_dir " + run.checkpoint_dir + " has room for " +
                     std::to_string(std::max<int64_t>(0, (free - d.offload) / std::max<int64_t>(1, one_checkpoint))) +
                     " of the " + std::to_string(saves) + " checkpoints this run saves (" + gib(one_checkpoint) +
                     " each, run.keep_last 0 keeps every one): a later save will fail; set run.keep_last");
  }
  return out;
}

}  // namespace zinc::tools
