// zinc-bench gpu-train-step: a ZeRO-Offload training step of the GPT on the
// GPU ("device": "cuda", bf16, optimizer states in pinned host memory
// updated by the CPU AdamW): model FLOP/s over cuBLAS's rate at the model's
// matmul shapes, timed in the same rounds, and the share of the step spent
// in the optimizer step (gradient norm, CPU AdamW) and in waiting for the
// gradients' device-to-host copies; the parameter uploads are inside
// forward. --large picks a GPT sized to fill an 80 GB GPU's compute rather
// than the reference one. The peer (PyTorch on the same model) is
// bench/torch_gpt_peer.py, run by bench/gpu_compare.sh in the same job.
//
// --stage 3 keeps the parameters in page-locked RAM: at most three layers'
// parameters live on the GPU (stage3_max_live_parameters), the next two
// prefetched along the trace (stage3_prefetch_bucket_size), and the line
// reports the prefetched share of the blocks' gathers (on one rank each
// gather is the block's upload); --resident keeps the optimizer states on the GPU, the step
// without PCIe traffic or the CPU optimizer to set the offload case against.
//
// --ratio R sets offload_optimizer.ratio (Note [a share of the states on
// the GPU] in engine/gpu_offload.cpp): the first blocks' states, up to 1 - R
// of them, live and update on the GPU.
//
// With ZeRO-Offload at stages 1-2 the CPU update runs behind the next
// forward (Note [the update behind the forward] in engine/gpu_offload.cpp):
// optimizer_s is then the norm and the hand-over, and update_behind_s and
// update_wait_s say how long the update ran and how much of it the engine
// waited for (inside forward_s and backward_s). ZINC_GPU_UPDATE_BEHIND=0
// runs it in place, to compare.
//
// --stage 3 also reports the bytes its uploads move a step and the rate
// page-locked memory goes up to the GPU at, measured in the same run: the
// step's floor from the uploads alone.
//
// --profile adds one round with the GPU profile on (Note [the GPU profile]
// in csrc/kernels/gpu_profile.cu), kept out of the figures: per step, the
// GPU's time by kind of kernel call, the main stream's time outside the
// calls (the engine's copies and waits, and the GPU idle waiting for the
// host) and the host's time inside them. It stands in for Nsight Systems,
// which the GPU machines this project is lent do not run.
//
// Ran on an H100 (2026-11-25) and an H200 (2026-11-28): bench/RESULTS.md.
// forward_s and backward_s are host clocks around asynchronous GPU work, so
// the split between them is not the GPU's; step_s and the ratio are.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bench/benches.h"
#include "core/cuda_util.h"
#include "core/parallel.h"
#include "core/device.h"
#include "kernels/gpu_profile.h"
#include "kernels/kernels_cuda.h"
#include "tools/experiment.h"

namespace zinc::bench {

namespace {

// The host-to-device rate from page-locked memory, in bytes a second: the
// median of five copies of `bytes` (stage 3's uploads run at it).
double pinned_upload_rate(size_t bytes) {
  cuda::PinnedBuffer host(bytes);
  cuda::DeviceBuffer dev(bytes);
  std::memset(host.data(), 0, bytes);
  std::vector<double> s;
  for (int i = 0; i < 5; ++i) {
    const double t0 = now_s();
    ZINC_CUDA_CHECK(cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice, nullptr),
                    "gpu-train-step: the upload rate's copy");
    ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "gpu-train-step: the upload rate's copy");
    s.push_back(now_s() - t0);
  }
  return static_cast<double>(bytes) / median(s);
}

// One more round of `steps` steps with the GPU profile on: its figures go
// into line["gpu_profile"] (seconds a step) and the returned text.
std::string profile_round(Engine& engine, DataLoader& loader, int steps, nlohmann::json& line) {
  namespace kc = kernels::cuda;
  ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "gpu-train-step: before the profiled round");
  kc::gpu_profile_reset();
  kc::gpu_profile_enable(true);
  const double t0 = now_s();
  for (int s = 0; s < steps; ++s) engine.train_batch(loader);
  ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "gpu-train-step: the profiled round");
  const double step = (now_s() - t0) / steps;
  kc::gpu_profile_enable(false);
  const kc::GpuProfileTotals t = kc::gpu_profile_read();
  kc::gpu_profile_reset();
  nlohmann::json kinds = nlohmann::json::object();
  std::string by_kind, by_host;
  double host = 0;
  char part[160];
  for (int i = 0; i < kernels::kNumOps; ++i) {
    if (t.calls[i] == 0) continue;
    const char* name = kernels::op_name(static_cast<kernels::Op>(i));
    const double g = t.gpu_s[i] / steps, h = t.host_s[i] / steps;
    kinds[name] = {{"gpu_s", g}, {"host_s", h}, {"calls", static_cast<double>(t.calls[i]) / steps}};
    host += h;
    std::snprintf(part, sizeof part, "%s%s %.1f ms (%.0f%%)", by_kind.empty() ? "" : " | ", name, 1e3 * g,
                  100 * g / step);
    by_kind += part;
  }
  nlohmann::json streams = nlohmann::json::array();
  for (const kc::GpuStreamProfile& sp : t.streams) {
    nlohmann::json on = nlohmann::json::object();  // its calls' GPU time by kind
    for (int i = 0; i < kernels::kNumOps; ++i)
      if (sp.gpu_s[i] > 0) on[kernels::op_name(static_cast<kernels::Op>(i))] = sp.gpu_s[i] / steps;
    streams.push_back({{"events", sp.events},
                       {"span_s", sp.span_s / steps},
                       {"calls_s", sp.scoped_s / steps},
                       {"outside_s", sp.outside_s / steps},
                       {"kinds", on}});
  }
  line["gpu_profile"] = {{"step_s", step}, {"kinds", kinds}, {"streams", streams}, {"host_in_calls_s", host}};
  std::string text = "\n  profile (one more round, " + std::to_string(steps) + (steps == 1 ? " step" : " steps") +
                     ", events around each kernel call";
  std::snprintf(part, sizeof part, "; %.3f s a step profiled):\n    GPU time a step by kind: ", step);
  text += part + by_kind;
  if (!t.streams.empty()) {
    const kc::GpuStreamProfile& main = t.streams.front();
    std::snprintf(part, sizeof part,
                  "\n    main stream: %.1f ms in the calls (%.0f%% of the step), %.1f ms between them (%.0f%%: the "
                  "engine's copies and waits, the GPU idle)",
                  1e3 * main.scoped_s / steps, 100 * main.scoped_s / steps / step, 1e3 * main.outside_s / steps,
                  100 * main.outside_s / steps / step);
    text += part;
    for (size_t k = 1; k < t.streams.size(); ++k) {  // the engine's copy streams: what ran there
      text += "\n    another stream:";
      for (int i = 0; i < kernels::kNumOps; ++i) {
        if (t.streams[k].gpu_s[i] <= 0) continue;
        std::snprintf(part, sizeof part, " %s %.1f ms (%.0f%% of the step)",
                      kernels::op_name(static_cast<kernels::Op>(i)), 1e3 * t.streams[k].gpu_s[i] / steps,
                      100 * t.streams[k].gpu_s[i] / steps / step);
        text += part;
      }
    }
  }
  std::snprintf(part, sizeof part,
                "\n    host time inside the calls (launching them, and waiting where one reads a result back): "
                "%.1f ms a step (%.0f%%)",
                1e3 * host, 100 * host / step);
  return text + part;
}

}  // namespace

int bench_gpu_train_step(const BenchOptions& o) {
  const CudaStatus& st = cuda_status();
  if (st.devices == 0) return skipped(o.json, "gpu-train-step", st.summary());
  if (o.model != "gpt" && o.model != "llama")
    throw Error("gpu-train-step: --model is gpt or llama, not '" + o.model + "'");
  const bool llama = o.model == "llama";
  int64_t B = 8, T = 256, C = 384, H = 6, L = 6, V = 256;
  // --model llama: TinyLlama 1.1B's shape (22 layers of 2048, 32 heads over
  // 4 kv heads of 64, SwiGLU 5632, 32000 tokens, untied head) at seq 1024.
  int64_t K = H, D = C / H, I = 4 * C;
  if (llama) {
    B = 8, T = 1024, C = 2048, H = 32, L = 22, V = 32000;
    K = 4, D = 64, I = 5632;
    if (o.tiny) B = 2, T = 16, C = 32, H = 4, L = 2, V = 64, K = 2, D = 8, I = 48;
  }
  if (o.tiny && !llama) {  // kernel emulation's smoke test of this code (docs/gpu.md)
    B = 2;
    T = 16;
    C = 32;
    H = 2;
    L = 2;
    V = 64;
  } else if (o.large && !llama) {
    B = 8;
    T = 1024;
    C = 1024;
    H = 16;
    L = 24;
    V = 50304;
  }
  const int64_t gas = o.gas;
  nlohmann::json doc = {
      {"train_micro_batch_size_per_gpu", B},
      {"gradient_accumulation_steps", gas},
      {"gradient_clipping", 1.0},
      {"steps_per_print", 1000000},
      {"device", "cuda"},
      {"bf16", {{"enabled", true}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"weight_decay", 0.1}}}}},
      {"zero_optimization",
       {{"stage", o.stage}, {"offload_optimizer", {{"device", o.resident ? "none" : "cpu"}, {"pin_memory", true}}}}},
      {"model", llama ? nlohmann::json{{"type", "llama"},
                                       {"hidden_size", C},
                                       {"intermediate_size", I},
                                       {"num_hidden_layers", L},
                                       {"num_attention_heads", H},
                                       {"num_key_value_heads", K},
                                       {"head_dim", D},
                                       {"vocab_size", V},
                                       {"max_position_embeddings", T},
                                       {"tie_word_embeddings", false}}
                      : nlohmann::json{{"type", "gpt"},
                                       {"n_layer", L},
                                       {"n_head", H},
                                       {"n_embd", C},
                                       {"vocab_size", V},
                                       {"block_size", T}}},
      // The synthetic source's table is V*V, so it stops at 8192 tokens; the
      // model's larger vocabulary still costs its full FLOPs (the tokens only
      // pick rows of the embedding).
      {"data", {{"type", "synthetic"}, {"vocab_size", std::min<int64_t>(V, 8192)}, {"seq_len", T}}},
  };
  if (o.ratio < 1.0 && !o.resident) doc["zero_optimization"]["offload_optimizer"]["ratio"] = o.ratio;
  if (o.stage == 3) {  // three layers live on the GPU at most, two prefetched ahead
    const int64_t layer = llama ? C * (H + 2 * K) * D + H * D * C + 3 * C * I + 2 * C : 12 * C * C + 13 * C;
    doc["zero_optimization"]["offload_param"] = {{"device", "cpu"}, {"pin_memory", true}};
    doc["zero_optimization"]["stage3_max_live_parameters"] = 3 * layer;
    doc["zero_optimization"]["stage3_prefetch_bucket_size"] = 2 * layer;
    doc["zero_optimization"]["stage3_max_reuse_distance"] = 0;
    doc["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  }
  char ratio_text[48] = "";
  if (o.ratio < 1.0 && !o.resident) std::snprintf(ratio_text, sizeof ratio_text, " (offload ratio %g)", o.ratio);
  const std::string what = std::string(o.resident ? "GPU-resident states" : "ZeRO-Offload") + ratio_text +
                           ", stage " + std::to_string(o.stage);
  tools::Experiment ex = tools::build_experiment(doc, 1);
  Engine engine = Engine::initialize(ex.model, ex.config);
  DataLoader loader(ex.data, B, gas, 1, 0, 1);
  // --lora: the same model with LoRA adapters (r 16, every linear layer,
  // the base frozen) beside it, timed in the same rounds: LoRA step / full step.
  std::optional<Engine> engine_lora;
  std::optional<DataLoader> loader_lora;
  if (o.lora) {
    nlohmann::json doc_lora = doc;
    doc_lora["model"]["lora"] = {{"r", 16}, {"lora_alpha", 32}, {"target_modules", "all-linear"}};
    if (!o.lora_targets.empty()) doc_lora["model"]["lora"]["target_modules"] = o.lora_targets;
    tools::Experiment exl = tools::build_experiment(doc_lora, 1);
    engine_lora.emplace(Engine::initialize(exl.model, exl.config));
    loader_lora.emplace(exl.data, B, gas, 1, 0, 1);
  }

  // cuBLAS at the model's shapes, bf16 operands, fp32 accumulation.
  std::vector<kernels::MatmulDesc> descs = llama ? llama_matmul_descs(B, T, C, H, K, D, I, L, V, DType::kBF16)
                                                 : gpt_matmul_descs(B, T, C, H, L, V, DType::kBF16);
  size_t max_a = 0, max_b = 0, max_c = 0;
  double mm_flops = 0;
  for (const kernels::MatmulDesc& d : descs) {
    max_a = std::max<size_t>(max_a, static_cast<size_t>(d.batch * d.M * d.K));
    max_b = std::max<size_t>(max_b, static_cast<size_t>(d.batch * d.K * d.N));
    max_c = std::max<size_t>(max_c, static_cast<size_t>(d.batch * d.M * d.N));
    mm_flops += 2.0 * static_cast<double>(d.batch * d.M * d.N * d.K);
  }
  cuda::DeviceBuffer a(max_a * 2), b(max_b * 2), c(max_c * 4);
  ZINC_CUDA_CHECK(cudaMemset(a.data(), 0, a.bytes()), "bench operands");
  ZINC_CUDA_CHECK(cudaMemset(b.data(), 0, b.bytes()), "bench operands");
  auto run_matmuls = [&] {
    for (const kernels::MatmulDesc& d : descs)
      kernels::cuda::matmul(d, {a.data(), DType::kBF16}, {b.data(), DType::kBF16}, c.as<float>(), nullptr);
    ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "bench matmuls");
  };

  run_matmuls();
  engine.train_batch(loader);
  engine.train_batch(loader);
  if (engine_lora) {
    engine_lora->train_batch(*loader_lora);
    engine_lora->train_batch(*loader_lora);
  }
  std::vector<double> step_s, mm_s, fwd_s, bwd_s, opt_s, behind_s, wait_s, gathered, lora_s;
  for (int r = 0; r < o.rounds; ++r) {
    double t0 = now_s();
    run_matmuls();
    mm_s.push_back(now_s() - t0);
    StepTimings before = engine.timings();
    const int64_t numel_before = engine.param_gather_stats().gathered_numel;
    t0 = now_s();
    for (int s = 0; s < o.steps; ++s) engine.train_batch(loader);
    step_s.push_back((now_s() - t0) / o.steps);
    StepTimings after = engine.timings();
    gathered.push_back(static_cast<double>(engine.param_gather_stats().gathered_numel - numel_before) / o.steps);
    fwd_s.push_back((after.forward_s - before.forward_s) / o.steps);
    bwd_s.push_back((after.backward_s - before.backward_s) / o.steps);
    opt_s.push_back((after.step_s - before.step_s) / o.steps);
    behind_s.push_back((after.update_behind_s - before.update_behind_s) / o.steps);
    wait_s.push_back((after.update_wait_s - before.update_wait_s) / o.steps);
    if (engine_lora) {
      t0 = now_s();
      for (int s = 0; s < o.steps; ++s) engine_lora->train_batch(*loader_lora);
      lora_s.push_back((now_s() - t0) / o.steps);
    }
  }
  const double t_step = median(step_s), t_mm = median(mm_s);
  const double tokens = static_cast<double>(B * T * gas);
  const double tokens_per_s = tokens / t_step;
  const double model_flops = ex.model->flops_per_token(T) * tokens_per_s;
  const double bound = mm_flops / t_mm;  // one micro-batch's matmuls
  int dev = 0;
  cudaDeviceProp prop{};
  ZINC_CUDA_CHECK(cudaGetDevice(&dev), "cudaGetDevice");
  ZINC_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  nlohmann::json line = {{"bench", "gpu-train-step"},
                         {"case", llama ? (o.tiny ? "llama-tiny" : "llama-1.1b")
                                        : o.tiny ? "tiny" : o.large ? "large" : "reference"},
                         {"gpu", prop.name},
                         {"figure", model_flops / 1e12},
                         {"unit", "TFLOP/s"},
                         {"bound", bound / 1e12},
                         {"ratio", model_flops / bound},
                         {"tokens_per_s", tokens_per_s},
                         {"step_s", t_step},
                         {"forward_s", median(fwd_s)},
                         {"backward_s", median(bwd_s)},
                         {"optimizer_s", median(opt_s)},
                         {"optimizer_share", median(opt_s) / t_step},
                         {"gradient_accumulation_steps", gas},
                         {"zero_stage", o.stage},
                         {"optimizer_states", o.resident ? "gpu" : "cpu"},
                         {"offload_ratio", o.resident ? 0.0 : o.ratio},
                         {"update_behind_s", median(behind_s)},
                         {"update_wait_s", median(wait_s)},
                         {"gpu_state_peak_bytes", engine.gpu_state_peak_bytes()},
                         {"params", engine.num_parameters()},
                         {"omp_threads", num_threads()}};
  // The engine's switches this run set (the bundle's variants; bench/gpu_summary.py
  // sets a line with any of them apart from the plain cases).
  nlohmann::json env = nlohmann::json::object();
  for (const char* k : {"ZINC_GPU_UPDATE_BEHIND", "ZINC_CUDA_MATMUL_BIAS", "ZINC_CUDA_ATTENTION"})
    if (const char* v = std::getenv(k)) env[k] = v;
  line["env"] = env;
  const ParamGatherStats gs = engine.param_gather_stats();
  const double prefetched = gs.gathers > 0 ? static_cast<double>(gs.prefetched) / gs.gathers : 0.0;
  const double waited = gs.gathers > 0 ? static_cast<double>(gs.waited) / gs.gathers : 0.0;
  // Stage 3's uploads against the rate page-locked memory goes up at: the
  // step's floor from them alone (they overlap the compute at best).
  double upload_bytes = 0, upload_rate = 0;
  if (o.stage == 3) {
    upload_bytes = median(gathered) * static_cast<double>(dtype_bytes(DType::kBF16));
    upload_rate = pinned_upload_rate(o.tiny ? size_t{1} << 20 : size_t{256} << 20);
    line["prefetched_share"] = prefetched;
    line["waited_share"] = waited;
    line["upload_bytes_per_step"] = upload_bytes;
    line["h2d_bytes_per_s"] = upload_rate;
    line["upload_floor_s"] = upload_bytes / upload_rate;
  }
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "gpu-train-step (%s: %s, %s L=%lld C=%lld H=%lld T=%lld B=%lld V=%lld, %lld micro-batches, %s)\n"
                "  figure: %.1f TFLOP/s model FLOPs (%.0f tokens/s, %.3f s/step)\n"
                "  bound:  %.1f TFLOP/s cuBLAS bf16 at the model's shapes\n"
                "  ratio:  %.3f\n"
                "  step:   forward %.3f s | backward (with the gradient copies) %.3f s | optimizer step %.3f s "
                "(%.0f%% of the step) | GPU model state peak %.2f GiB",
                line["case"].get<std::string>().c_str(), prop.name, llama ? "Llama" : "GPT", (long long)L, (long long)C, (long long)H, (long long)T,
                (long long)B, (long long)V, (long long)gas, what.c_str(), model_flops / 1e12, tokens_per_s, t_step, bound / 1e12,
                model_flops / bound, median(fwd_s), median(bwd_s), median(opt_s), 100 * median(opt_s) / t_step,
                static_cast<double>(engine.gpu_state_peak_bytes()) / (1 << 30));
  std::string text = buf;
  if (median(behind_s) > 0) {
    std::snprintf(buf, sizeof buf,
                  "\n  the CPU update behind the next forward: %.3f s a step, of which the engine waited %.3f s "
                  "(%.0f%% hidden)",
                  median(behind_s), median(wait_s), 100 * (1 - median(wait_s) / median(behind_s)));
    text += buf;
  }
  if (o.stage == 3) {
    std::snprintf(buf, sizeof buf, "\n  stage 3: %.0f%% of the blocks' uploads prefetched, %.0f%% of the acquires waited",
                  100 * prefetched, 100 * waited);
    text += buf;
    std::snprintf(buf, sizeof buf,
                  "\n  stage 3: %.2f GB uploaded a step; at the measured %.1f GB/s from page-locked memory that is "
                  "%.3f s, %.0f%% of the step (its floor from the uploads alone)",
                  upload_bytes / 1e9, upload_rate / 1e9, upload_bytes / upload_rate,
                  100 * upload_bytes / upload_rate / t_step);
    text += buf;
  }
  if (engine_lora) {
    const double t_lora = median(lora_s);
    line["lora"] = {{"step_s", t_lora},
                    {"tokens_per_s", tokens / t_lora},
                    {"vs_full_step", t_lora / t_step},
                    {"trained_params", engine_lora->num_trained_parameters()},
                    {"gpu_state_peak_bytes", engine_lora->gpu_state_peak_bytes()}};
    std::snprintf(buf, sizeof buf,
                  "\n  LoRA (r 16, %s, the base frozen; the same rounds): %.3f s a step, %.2fx the full step "
                  "(%.0f tokens/s) | GPU model state peak %.2f GiB",
                  o.lora_targets.empty() ? "every linear layer" : "the given targets", t_lora, t_lora / t_step,
                  tokens / t_lora, static_cast<double>(engine_lora->gpu_state_peak_bytes()) / (1 << 30));
    text += buf;
  }
  if (o.profile) text += profile_round(engine, loader, o.steps, line);
  emit(o.json, line, text);
  return 0;
}

}  // namespace zinc::bench
