// zinc-bench, private: the benchmarks and what they share. Each benchmark
// prints a figure, the bound the machine sets measured in the same run, and
// their ratio; --json prints one line per case.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/cpu.h"
#include "core/error.h"
#include "tools/experiment.h"

namespace zinc::bench {

struct BenchOptions {
  bool json = false;
  int rounds = 7;      // alternating measurement rounds; medians are reported
  int steps = 3;       // train-step: training steps per round
  bool fp32 = false;   // train-step: fp32 instead of bf16
  bool fp16 = false;   // train-step: fp16 with loss scaling instead of bf16
  int threads = 0;     // adamw: OpenMP threads (0 = default)
  std::string isa;     // adamw: force an optimizer path ("" = the dispatcher's choice)
  int64_t numel = int64_t{1} << 27;  // adamw: parameters (128M)
};

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Prints one result. Every result carries the CPU it ran on and the code
// paths zinc chose (tools::kernel_paths): a figure means little without them.
inline void emit(bool json, const nlohmann::json& line, const std::string& human) {
  static const std::string cpu = zinc::cpu_model_and_flags();
  static const std::string paths = zinc::tools::kernel_paths();
  if (json) {
    nlohmann::json l = line;
    l["cpu"] = cpu;
    l["paths"] = paths;
    std::printf("%s\n", l.dump().c_str());
  } else {
    static bool header_done = false;
    if (!header_done) std::printf("machine: %s\n%s\n", cpu.c_str(), paths.c_str());
    header_done = true;
    std::printf("%s\n", human.c_str());
  }
  std::fflush(stdout);
}

// fio (io_uring, O_DIRECT, 1 MiB blocks or `block`, queue depth 8) on `file` of
// `bytes`: bytes per second. require_fio throws a clear error without fio.
void require_fio();
double fio_bw(const std::string& file, int64_t bytes, bool write, const std::string& block = "1M");

// zinc-train beside this zinc-bench (build tree); throws if it is missing.
std::string zinc_train_path();
// The last JSON line of `command`'s stdout whose "event" is `event` (zinc-train
// --json runs); throws zinc::Error naming `bench` and the command when the
// command fails or prints no such line.
nlohmann::json last_json_event(const std::string& command, const std::string& event, const std::string& bench);

int bench_train_step(const BenchOptions& o);
int bench_adamw(const BenchOptions& o);
int bench_collectives(const BenchOptions& o);   // under mpirun
int bench_zero_memory(const BenchOptions& o);   // under mpirun
int bench_overlap(const BenchOptions& o);       // under mpirun
int bench_nvme(const BenchOptions& o);
int bench_offload_step(const BenchOptions& o);
int bench_capacity(const BenchOptions& o);      // root: a cgroup memory cap
int bench_estimate(const BenchOptions& o);      // runs mpirun itself
int bench_activation_checkpointing(const BenchOptions& o);  // runs zinc-train itself
int bench_checkpoint(const BenchOptions& o);

}  // namespace zinc::bench
