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
#include "kernels/kernels.h"
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
  bool large = false;  // gpu-train-step: a GPT sized for an 80 GB GPU instead of the reference one
  bool tiny = false;   // gpu-train-step: a GPT small enough for kernel emulation (a smoke test; no figure)
  int64_t gas = 4;     // gpu-train-step: micro-batches per step (amortise the CPU optimizer step)
  int stage = 2;       // gpu-train-step: ZeRO stage (3: the parameters in page-locked RAM, one block gathered at a time)
  bool resident = false;  // gpu-train-step: optimizer states on the GPU (the step without PCIe or the CPU optimizer)
  double ratio = 1.0;     // gpu-train-step: offload_optimizer.ratio (below 1: a share of the states on the GPU)
  bool profile = false;   // gpu-train-step: one more round with the GPU profile (kernels/gpu_profile.h)
  std::string model = "gpt";  // train-step: "gpt" (the reference GPT), "llama" (a ~107M Llama, GQA 4:1, seq 512) or "qwen3" (its sizes as a Qwen3)
  bool wide = false;  // train-step --model gpt: the GPT at the llama case's width, depth, vocabulary and sequence
  std::string pretrained;  // capacity: a Hugging Face folder to load and train under the cap instead of the GPT
  int64_t cap_mib = 3072;  // capacity --pretrained: the memory cap
  bool packed = false;  // train-step: also time packed documents with masked prompts, against plain rows
  bool lora = false;    // train-step (Llama-style): also time LoRA (r 16, every linear layer), against the full fine-tune
  std::vector<std::string> lora_targets;  // --lora-targets: LoRA's target_modules (default all-linear)
  bool lora_unpacked = false;  // --lora-unpacked: LoRA with model.pack_frozen_weights false
  bool monitor = false;  // train-step: also time the step with the tensorboard and csv monitors writing
  std::string mkl;      // gemm: libmkl_rt to load (default: the dynamic linker's libmkl_rt.so.3, .so.2, .so)
  bool shapes = false;  // gemm: print the step's matmul shapes as JSON and stop
  bool bf16 = false;    // gemm: bf16 operands (fp32 sums and C) instead of fp32
};

// The matmuls of one training step, by shape: the bounds of train-step
// (oneDNN) and gpu-train-step (cuBLAS) are what the hardware does on exactly
// these, in compute dtype dt.
struct StepMatmuls {
  int64_t N;  // rows: micro-batch x sequence
  zinc::DType dt;
  std::vector<zinc::kernels::MatmulDesc> descs;

  void add(int64_t batch, int64_t M, int64_t Nn, int64_t K, bool ta, bool tb, bool acc, int64_t times) {
    for (int64_t i = 0; i < times; ++i) {
      zinc::kernels::MatmulDesc d;
      d.batch = batch;
      d.M = M;
      d.N = Nn;
      d.K = K;
      d.trans_a = ta;
      d.trans_b = tb;
      d.accumulate = acc;
      d.compute = dt;
      descs.push_back(d);
    }
  }
  // A linear layer y = x W^T, `times` over: forward, dX = dY W, dW += dY^T X.
  void linear(int64_t in, int64_t out, int64_t times) { linear_rows(N, in, out, times); }
  // The same over `rows` rows (an expert's tokens).
  void linear_rows(int64_t rows, int64_t in, int64_t out, int64_t times) {
    add(1, rows, out, in, false, true, false, times);
    add(1, rows, in, out, false, false, false, times);
    add(1, out, in, rows, true, false, true, times);
  }
  // Causal attention over BH (batch x heads) heads of hs, `times` layers:
  // S = Q K^T, O = P V; backward dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q.
  void attention(int64_t BH, int64_t T, int64_t hs, int64_t times) {
    add(BH, T, T, hs, false, true, false, times);
    add(BH, T, hs, T, false, false, false, times);
    add(BH, T, T, hs, false, true, false, times);
    add(BH, T, hs, T, true, false, false, times);
    add(BH, T, hs, T, false, false, false, times);
    add(BH, T, hs, T, true, false, false, times);
  }
};

// The built-in GPT: every linear layer, the tied head, attention's batched products.
inline std::vector<zinc::kernels::MatmulDesc> gpt_matmul_descs(int64_t B, int64_t T, int64_t C, int64_t H, int64_t L,
                                                                int64_t V, zinc::DType dt) {
  StepMatmuls m{B * T, dt, {}};
  m.linear(C, 3 * C, L);
  m.linear(C, C, L);
  m.linear(C, 4 * C, L);
  m.linear(4 * C, C, L);
  m.linear(C, V, 1);
  m.attention(B * H, T, C / H, L);
  return m.descs;
}

// The built-in llama (models/llama/model.cpp): the fused q|k|v projection of
// (H + 2K) D rows, the output projection from H D, the fused gate|up
// projection of 2I rows and the down projection, the head, and attention
// over H heads of D (the kv heads repeated).
// A mixture of experts' sizes (E = 0: a dense MLP).
struct MoeSizes {
  int64_t E = 0, k = 0, Ie = 0;
};
inline std::vector<zinc::kernels::MatmulDesc> llama_matmul_descs(int64_t B, int64_t T, int64_t C, int64_t H, int64_t K,
                                                                  int64_t D, int64_t I, int64_t L, int64_t V,
                                                                  zinc::DType dt, MoeSizes moe = {}) {
  StepMatmuls m{B * T, dt, {}};
  m.linear(C, (H + 2 * K) * D, L);
  m.linear(H * D, C, L);
  if (moe.E > 0) {
    // Each expert's GEMMs over its share of the N k (token, slot) rows (a
    // balanced router: N k / E each), and the router.
    const int64_t rows = B * T * moe.k / moe.E;
    m.linear_rows(rows, C, 2 * moe.Ie, L * moe.E);
    m.linear_rows(rows, moe.Ie, C, L * moe.E);
    m.linear(C, moe.E, L);
  } else {
    m.linear(C, 2 * I, L);
    m.linear(I, C, L);
  }
  m.linear(C, V, 1);
  m.attention(B * H, T, D, L);
  return m.descs;
}

// The sizes train-step and gemm run: the reference GPT (6 x 384, seq 256,
// micro-batch 8), or a Llama of about 100M parameters (8 x 1024, 16 heads
// over 4 kv heads, MLP 2816, seq 512, vocabulary 8192; untied head), or
// (--wide) the GPT at the Llama's width, depth, vocabulary and sequence.
struct StepSizes {
  bool llama, wide;  // llama: a Llama-style decoder (the llama family or one sharing its graph)
  int64_t B, T, C, H, L, V, KV, I, D;
  std::string family;  // model.type
  MoeSizes moe;        // mixtral, qwen3_moe: 8 experts of I/4, 2 per token (about 100M parameters in all)
  const char* name() const { return llama ? family.c_str() : wide ? "gpt-wide" : "gpt"; }
  std::vector<zinc::kernels::MatmulDesc> matmuls(zinc::DType dt) const {
    return llama ? llama_matmul_descs(B, T, C, H, KV, D, I, L, V, dt, moe) : gpt_matmul_descs(B, T, C, H, L, V, dt);
  }
};
inline StepSizes step_sizes(const BenchOptions& o) {
  const bool llama = o.model != "gpt", wide = !llama && o.wide, big = llama || wide;
  const int64_t C = big ? 1024 : 384, H = big ? 16 : 6;
  StepSizes s{llama, wide, big ? 2 : 8, big ? 512 : 256, C, H, big ? 8 : 6, big ? 8192 : 256, 4, 2816, C / H,
              llama ? o.model : std::string("gpt"), MoeSizes{}};
  if (o.model == "mixtral" || o.model == "qwen3_moe") s.moe = {8, 2, s.I / 4};
  if (o.model == "gpt_neox") s.KV = s.H;  // no grouped-query attention
  return s;
}

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

// A benchmark this machine cannot run: one line, JSON with --json (a plain
// text line broke a reader of --json's lines); returns 0.
inline int skipped(bool json, const std::string& bench, const std::string& why) {
  if (json)
    std::printf("%s\n", nlohmann::json({{"bench", bench}, {"skipped", why}}).dump().c_str());
  else
    std::printf("%s: skipped: %s\n", bench.c_str(), why.c_str());
  std::fflush(stdout);
  return 0;
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
int bench_gpu_train_step(const BenchOptions& o);  // CUDA builds; skips without a GPU
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
int bench_gemm(const BenchOptions& o);  // oneDNN against MKL (dlopen) at the step's shapes
int bench_data_open(const BenchOptions& o);  // opening a prepared token file, with and without its CRC check

}  // namespace zinc::bench
