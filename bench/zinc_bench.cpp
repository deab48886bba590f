// zinc-bench: measures a figure and the bound the machine sets for it, in
// the same run, and prints their ratio.
//
//   zinc-bench NAME [--json] [options]
//
// Benchmarks:
//   train-step  model FLOP/s of a bf16 (or --fp32) training step of a
//               reference GPT over oneDNN's matmul rate at the model's shapes.
//   adamw       optimizer updates/s over the bandwidth of an Adam-pattern
//               streaming probe (4 arrays read, 3 written), for fp32 grads,
//               fp32 grads with bf16 copy-out, and bf16 grads with copy-out.
//   collectives (mpirun) the engine's reduce-scatter and all-gather through
//               Communicator + CommStream over raw MPI of the same size.
//   zero-memory (mpirun) per-rank peak model-state memory of stages 0, 1, 2
//               over the ZeRO formula.
//   overlap     (mpirun) exposed communication per step, overlap_comm off/on.
//   nvme        NvmeStore read/write bandwidth over fio (io_uring, O_DIRECT)
//               with the same block size and queue depth in the same folder.
//   offload-step the optimizer step with optimizer states on NVMe over the
//               bytes-over-bandwidth bound (fio, same run).
//   capacity    (root) a GPT with model states twice a cgroup memory cap,
//               trained at stage 3 with everything on NVMe: losses equal to
//               an uncapped stage-0 run; step time over the fio bound.
//   estimate    zinc-train --estimate's RAM per rank over the peak RSS a
//               training run of the same config measures (two GPT sizes,
//               stages 0-3, with and without offload, 2 ranks).
//   activation-checkpointing  peak RSS saved by the GPT's
//               gradient_checkpointing (fresh zinc-train processes) over the
//               saving the estimate predicts, and the step-time overhead over
//               the share of FLOPs the recomputation adds.
//   gpu-train-step (CUDA builds, a GPU) a ZeRO-Offload step of the GPT on
//               the GPU: model FLOP/s over cuBLAS at the model's shapes, and
//               the CPU optimizer step's share (--large, --gas).
//   checkpoint  save and load bandwidth of a 101M-parameter model's
//               checkpoint over fio's write and read on the same disk.
//   gemm        oneDNN's fp32 rate at one training step's matmul shapes
//               (train-step's bound; --model, --wide as there) against
//               Intel MKL's cblas_sgemm on the same shapes, loaded with
//               dlopen (--mkl PATH); --shapes prints the shapes as JSON;
//               --bf16 times bf16 operands (MKL's cblas_gemm_bf16bf16f32).
//   data-open   opening a 512 MiB prepared token file with and without the
//               check of its tokens' CRC-32, over a read of the same bytes.
// --json prints one line per case:
//   {"bench":..,"case":..,"figure":..,"unit":..,"bound":..,"ratio":..,...}
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

#include "bench/benches.h"
#include "tools/cli_errors.h"

namespace {
// A count of at least 1, said in one line (CLI11's PositiveNumber said
// "Value 0 not in range 0.000000 to 1797...", 308 digits).
const CLI::Validator kAtLeastOne(
    [](std::string& v) -> std::string {
      char* end = nullptr;
      errno = 0;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      return !v.empty() && *end == '\0' && errno == 0 && n >= 1 ? std::string()
                                                                 : "must be a whole number >= 1, got '" + v + "'";
    },
    "INT >= 1");
}  // namespace

int main(int argc, char** argv) {
  zinc::tools::standard_streams();
  CLI::App app{"zinc-bench: a figure, the machine's bound for it, and their ratio"};
  zinc::bench::BenchOptions o;
  std::string name;
  app.add_option("name", name, "benchmark: train-step | gpu-train-step | adamw | collectives | zero-memory | overlap | nvme | offload-step | capacity | estimate | checkpoint | activation-checkpointing | gemm | data-open")->required();
  app.add_flag("--json", o.json, "one JSON line per case");
  app.add_option("--rounds", o.rounds, "alternating measurement rounds; the median is reported")
      ->check(kAtLeastOne);
  app.add_option("--steps", o.steps, "train-step, activation-checkpointing: training steps per round")->check(kAtLeastOne);
  app.add_flag("--fp32", o.fp32, "train-step, estimate, activation-checkpointing: fp32 instead of bf16");
  app.add_option("--model", o.model,
                 "train-step: gpt (the reference GPT), llama (a ~100M Llama, GQA 4:1, seq 512), or another "
                 "Llama-style family at the same sizes with its own defaults: qwen3 (per-head q/k norms), gemma, "
                 "gemma2 (post-norms, soft-caps), gemma3, smollm3, granite, olmo2, phi3, gpt_neox, and the "
                 "mixtures of experts mixtral and qwen3_moe (8 experts of 704, 2 per token; the bound counts the "
                 "active experts' GEMMs at a balanced router's rows); gpu-train-step: gpt, or llama (TinyLlama "
                 "1.1B's shape, seq 1024)")
      ->check(CLI::IsMember({"gpt", "llama", "qwen3", "gemma", "gemma2", "gemma3", "smollm3", "granite", "olmo2",
                            "phi3", "gpt_neox", "mixtral", "qwen3_moe"}));
  app.add_flag("--wide", o.wide, "train-step --model gpt: the GPT at the llama case's width, depth, vocabulary and sequence");
  app.add_flag("--lora", o.lora,
               "train-step (a Llama-style --model) and gpu-train-step: also time the same model with LoRA adapters (r "
               "16, alpha 32, every linear layer; the base frozen) in the same rounds; reports LoRA step / full step. "
               "capacity --pretrained: "
               "train LoRA adapters on the folder (3 steps) and report the peak RSS per base parameter");
  app.add_option("--lora-targets", o.lora_targets,
                 "train-step, gpu-train-step --lora: LoRA's target_modules instead of every linear layer (e.g. q_proj alone: what "
                 "the frozen base costs with one adapter)")
      ->delimiter(',');
  app.add_flag("--lora-unpacked", o.lora_unpacked,
               "train-step --lora: the LoRA model with model.pack_frozen_weights false (the frozen base copied "
               "into oneDNN's layout by every product, as before it was kept packed)");
  app.add_flag("--packed", o.packed,
               "train-step: also time the same step on packed documents (Batch::positions) with a third of each "
               "document's targets masked, in the same rounds; reports packed / plain");
  app.add_flag("--monitor", o.monitor,
               "train-step: also time the same engine's steps with the tensorboard and csv_monitor monitors writing "
               "zinc-train's scalars after each (files in a temporary folder), in the same rounds; reports "
               "monitored / plain");
  app.add_flag("--fp16", o.fp16, "train-step: fp16 with dynamic loss scaling instead of bf16 (timed against fp32)");
  app.add_option("--threads", o.threads, "adamw: threads (default: OMP_NUM_THREADS or all cores)")
      ->check(kAtLeastOne);
  app.add_option("--isa", o.isa, "adamw: force scalar | avx2 | avx512 | avx512_bf16");
  app.add_flag("--large", o.large, "gpu-train-step: a GPT sized for an 80 GB GPU");
  app.add_flag("--tiny", o.tiny,
               "gpu-train-step: a tiny GPT, for running the benchmark's code under kernel emulation (tests/cuda_emu); "
               "its figures mean nothing");
  app.add_option("--gas", o.gas, "gpu-train-step: micro-batches per step")->check(kAtLeastOne);
  app.add_option("--stage", o.stage, "gpu-train-step: ZeRO stage 1-3 (3: parameters in page-locked RAM)")
      ->check(CLI::Range(1, 3));
  app.add_flag("--resident", o.resident,
               "gpu-train-step: optimizer states on the GPU instead of ZeRO-Offload (the step without PCIe and the "
               "CPU optimizer, to compare)");
  app.add_option("--ratio", o.ratio,
                 "gpu-train-step: zero_optimization.offload_optimizer.ratio, the offloaded share of the optimizer "
                 "states (below 1: the first blocks' states on the GPU)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            const double r = std::strtod(v.c_str(), nullptr);
            return r > 0 && r <= 1 ? std::string() : "--ratio " + v + ": must be in (0, 1]";
          },
          "FLOAT in (0, 1]"));
  app.add_flag("--profile", o.profile,
               "gpu-train-step: one more round with the GPU profile on (CUDA events around each kernel call, kept "
               "out of the figures): the GPU's time a step by kind of kernel, the time between calls, the host's");
  app.add_option("--pretrained", o.pretrained,
                 "capacity: load this Hugging Face folder (model.from_pretrained) at stage 3 on NVMe under --cap-mib "
                 "and train 2 steps, instead of the GPT");
  app.add_option("--cap-mib", o.cap_mib, "capacity --pretrained: the memory cap in MiB (default 3072)")
      ->check(kAtLeastOne);
  app.add_option("--mkl", o.mkl,
                 "gemm: the libmkl_rt to load (default: libmkl_rt.so.3, .so.2 or .so on the dynamic linker's path)");
  app.add_flag("--shapes", o.shapes, "gemm: print the step's matmul shapes as one JSON line and stop");
  app.add_flag("--bf16", o.bf16,
               "gemm: bf16 operands with fp32 sums and C (zinc's bf16 matmuls; MKL's cblas_gemm_bf16bf16f32) instead of fp32");
  app.add_option("--numel", o.numel, "adamw: parameters (default 2^27 = 134M)")->check(kAtLeastOne);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return zinc::tools::usage_error(app, e, "zinc-bench");  // exit 2, as zinc-train's and zinc-export's
  }
  try {
    if (name == "train-step") return zinc::bench::bench_train_step(o);
    if (name == "gpu-train-step") {
      // Flags that would be dropped without a word: refused, naming them.
      const char* clash = o.resident && o.ratio < 1.0 ? "--ratio is the offloaded share of the states and --resident "
                                                        "keeps them all on the GPU: give one"
                          : o.tiny && o.large ? "--tiny and --large are two model sizes: give one"
                          : o.fp16 || o.packed || o.monitor
                              ? "--fp16, --packed and --monitor are train-step's (gpu-train-step times bf16 on plain rows)"
                              : nullptr;
      if (clash) {
        std::fprintf(stderr, "zinc-bench: gpu-train-step: %s\n", clash);
        return 2;
      }
#if defined(ZINC_BENCH_CUDA)
      return zinc::bench::bench_gpu_train_step(o);
#else
      return zinc::bench::skipped(o.json, "gpu-train-step", "zinc-bench was built without CUDA");
#endif
    }
    if (name == "adamw") return zinc::bench::bench_adamw(o);
    if (name == "collectives") return zinc::bench::bench_collectives(o);
    if (name == "zero-memory") return zinc::bench::bench_zero_memory(o);
    if (name == "overlap") return zinc::bench::bench_overlap(o);
    if (name == "nvme") return zinc::bench::bench_nvme(o);
    if (name == "offload-step") return zinc::bench::bench_offload_step(o);
    if (name == "capacity") return zinc::bench::bench_capacity(o);
    if (name == "checkpoint") return zinc::bench::bench_checkpoint(o);
    if (name == "estimate") return zinc::bench::bench_estimate(o);
    if (name == "activation-checkpointing") return zinc::bench::bench_activation_checkpointing(o);
    if (name == "gemm") return zinc::bench::bench_gemm(o);
    if (name == "data-open") return zinc::bench::bench_data_open(o);
    std::fprintf(stderr, "zinc-bench: unknown benchmark '%s' (available: train-step, gpu-train-step, adamw, collectives, zero-memory, overlap, nvme, offload-step, capacity, estimate, checkpoint, activation-checkpointing, gemm, data-open)\n", name.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zinc-bench: error: %s\n", e.what());
    return 1;
  }
}
