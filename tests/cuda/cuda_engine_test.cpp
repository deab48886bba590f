// The GPU path (Note [the GPU path] in engine/engine.cpp) against the CPU
// path: the same GPT, config and data with "device": "cuda" and "cpu".
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "data/data.h"
#include "engine/engine.h"
#include "engine/memory_estimate.h"
#include "kernels/kernels_cuda.h"
#include "models/detail/linear.h"
#include "models/models.h"
#include "optim/optim.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc {
namespace {

// The small models these tests train: vocabulary 37, 2 layers of 64
// across 4 heads (the Llama's over 2 kv heads, its MLP 96), `positions` long.
models::GptConfig small_gpt_config(Device device, int64_t positions = 32) {
  models::GptConfig g;
  g.vocab_size = 37;
  g.block_size = positions;
  g.n_layer = 2;
  g.n_head = 4;
  g.n_embd = 64;
  g.device = device;
  return g;
}
models::LlamaConfig small_llama_config(Device device, int64_t positions = 32) {
  models::LlamaConfig c;
  c.vocab_size = 37;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = positions;
  c.device = device;
  return c;
}

struct TrainRun {
  std::vector<float> losses;
  std::vector<float> weights;  // block 1's master weights at the end
  int64_t gpu_peak = 0;        // Engine::gpu_state_peak_bytes
  ParamGatherStats gathers;   // Engine::param_gather_stats
};

// prefetch_layers > 0 (with offload_param): instead of one block at a
// time, that many layers' parameters prefetched ahead along the trace and
// one more live.
TrainRun train(const std::string& device, const std::string& precision, int stage, int gas, int steps,
               const std::string& offload = "cpu", double clipping = 1.0, const std::string& ckpt_dir = "",
               int resume_at = -1, const std::string& offload_param = "", int prefetch_layers = 0,
               const std::string& optimizer = "AdamW") {
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 8},
                        {"gradient_accumulation_steps", gas},
                        {"gradient_clipping", clipping},
                        {"device", device},
                        {"optimizer", {{"type", optimizer}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
                        {"zero_optimization", {{"stage", stage}, {"offload_optimizer", {{"device", offload}}}}}};
  if (precision == "bf16") cfg["bf16"] = {{"enabled", true}};
  if (precision == "fp16") cfg["fp16"] = {{"enabled", true}};
  if (!offload_param.empty()) {  // stage 3, one block gathered at a time
    cfg["zero_optimization"]["offload_param"] = {{"device", offload_param},
                                                 {"nvme_path", std::filesystem::temp_directory_path().string()}};
    cfg["zero_optimization"]["stage3_max_live_parameters"] = 0;
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    if (prefetch_layers > 0) {
      const int64_t layer = 12 * 64 * 64 + 13 * 64;  // n_embd 64
      cfg["zero_optimization"]["stage3_max_live_parameters"] = (prefetch_layers + 1) * layer;
      cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch_layers * layer;
      cfg["zero_optimization"]["stage3_max_reuse_distance"] = 0;
    }
  }
  const models::GptConfig g = small_gpt_config(device == "cuda" ? Device::kCuda : Device::kCpu);
  std::shared_ptr<Model> model = models::make_gpt(g);
  Engine e = Engine::initialize(model, cfg);
  DataConfig dc;
  dc.vocab_size = 37;
  dc.seq_len = 32;
  dc.determinism = 0.9;
  DataLoader loader(make_data_source(dc), 8, gas, 1, 0, 7);
  TrainRun r;
  for (int s = 0; s < steps; ++s) {
    if (s == resume_at && !ckpt_dir.empty()) {
      // Save, then continue in a new engine (a new model) from the checkpoint.
      e.save_checkpoint(ckpt_dir, "t");
      auto model2 = models::make_gpt(g);
      Engine e2 = Engine::initialize(model2, cfg);
      e2.load_checkpoint(ckpt_dir, "t");
      e = std::move(e2);
      model = model2;
    }
    r.losses.push_back(e.train_batch(loader));
  }
  r.weights = e.full_params(1);
  r.gpu_peak = e.gpu_state_peak_bytes();
  r.gathers = e.param_gather_stats();
  return r;
}

#if defined(ZINC_CUDA_EMU)
// A GPU without room for the activations: the message names them, the
// settings that size them and --estimate, not cudaMalloc's bare error
// (the emulated GPU holds ZINC_EMU_GPU_BYTES).
TEST(CudaEngine, NoRoomForTheActivationsIsNamed) {
  ZINC_REQUIRE_GPU();
  struct Cap {
    Cap() { ::setenv("ZINC_EMU_GPU_BYTES", "12000000", 1); }
    ~Cap() { ::unsetenv("ZINC_EMU_GPU_BYTES"); }
  } cap;
  const nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 256},
                              {"device", "cuda"},
                              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                              {"zero_optimization", {{"stage", 0}}}};
  // The error a step of the small GPT ends with, at micro-batch B.
  auto error_of = [](const nlohmann::json& config, int64_t B) {
    try {
      Engine e = Engine::initialize(models::make_gpt(small_gpt_config(Device::kCuda)), config);
      DataConfig dc;
      dc.vocab_size = 37;
      dc.seq_len = 32;
      DataLoader loader(make_data_source(dc), B, 1, 1, 0, 7);
      e.train_batch(loader);
    } catch (const Error& err) {
      return std::string(err.what());
    }
    return std::string();
  };
  const std::string what = error_of(cfg, 256);
  EXPECT_NE(what.find("the GPU has no room for the model's activations ("), std::string::npos) << what;
  EXPECT_NE(what.find("of 11 MiB free): lower train_micro_batch_size_per_gpu or data.seq_len"), std::string::npos)
      << what;
  // On a GPU of 300 kB every buffer is named and the sizes are not "0 MiB"
  // (a sweep saw "no room for a GPU buffer (0 MiB more; 0 MiB of 0 MiB free)").
  ::setenv("ZINC_EMU_GPU_BYTES", "300000", 1);
  for (int stage : {0, 2, 3}) {
    nlohmann::json small = cfg;
    small["train_micro_batch_size_per_gpu"] = 2;
    small["zero_optimization"] = {{"stage", stage}};
    if (stage > 0) small["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    if (stage == 3) small["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
    const std::string tiny = error_of(small, 2);
    EXPECT_NE(tiny.find("GPU"), std::string::npos) << "stage " << stage << ": " << tiny;
    EXPECT_EQ(tiny.find(" 0 MiB"), std::string::npos) << "stage " << stage << ": " << tiny;
    EXPECT_EQ(tiny.find("a GPU buffer"), std::string::npos) << "stage " << stage << ": " << tiny;
    // What it advises is what this run does not do already.
    EXPECT_EQ(tiny.find("ZeRO stage 2 or 3") == std::string::npos, stage >= 2) << "stage " << stage << ": " << tiny;
    if (stage == 3) EXPECT_EQ(tiny.find("stage 3 with offload_param"), std::string::npos) << tiny;
  }
  // cudaMalloc's own message (gpu_malloc): KiB below a MiB, not "0 MiB".
  ::setenv("ZINC_EMU_GPU_BYTES", "40000", 1);
  {
    std::string tiny;
    try {
      cuda::DeviceBuffer b(100000, "a test's buffer");
    } catch (const Error& err) {
      tiny = err.what();
    }
    EXPECT_NE(tiny.find("no room for a test's buffer (97 KiB more; "), std::string::npos) << tiny;
    EXPECT_NE(tiny.find("KiB of 39 KiB free)"), std::string::npos) << tiny;
  }
}
#endif

#if defined(ZINC_CUDA_EMU)
extern "C" size_t zinc_emu_device_bytes();
extern "C" size_t zinc_emu_device_peak_bytes();
extern "C" void zinc_emu_reset_device_peak();

// --estimate's GPU parts against the emulated GPU's peak (every cudaMalloc
// live at once, cuBLAS's workspace included), for the GPT and a GQA Llama,
// fp32 (the unfused attention: its T x T buffers) and bf16 (the fused one:
// none), optimizer states on the GPU and in RAM. They agree to the batch's
// small index buffers, which the estimate leaves out: the targets, the
// cross-entropy's row losses and the embedding's token index, under 24
// bytes a token and a few allocations' rounding. The estimate once counted
// the CPU kernels' scratch as a guide (2.3 MB over at T 256 in bf16; T x T
// probabilities the fused GPU attention never makes), left out the rope
// tables, and the GPU held a grow-only buffer's old and new copies at once.
TEST(CudaEngine, TheEstimateIsTheGpusPeak) {
  ZINC_REQUIRE_GPU();
  for (const std::string kind : {"gpt", "llama"})
    for (const std::string prec : {"fp32", "bf16"})
      for (const std::string off : {"none", "cpu"})
        for (int64_t T : {32, 256}) {
          const std::string what = kind + " " + prec + " offload " + off + " T " + std::to_string(T);
          nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 2},
                                {"gradient_accumulation_steps", 2},
                                {"gradient_clipping", 1.0},
                                {"device", "cuda"},
                                {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                                {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", off}}}}}};
          if (prec == "bf16") cfg["bf16"] = {{"enabled", true}};
          std::shared_ptr<Model> model;
          if (kind == "gpt") {
            models::GptConfig g = small_gpt_config(Device::kCuda, T);
            g.n_embd = 128, g.n_head = 2;  // head size 64: the fused attention's in bf16
            model = models::make_gpt(g);
          } else {
            models::LlamaConfig c = small_llama_config(Device::kCuda, T);
            c.hidden_size = 128, c.num_attention_heads = 2, c.num_key_value_heads = 1;
            model = models::make_llama(c);
          }
          int64_t estimated = 0, measured = 0;
          // A thread of its own: the kernels' scratch for the default stream
          // (cuBLAS's workspace among it) is the thread's, made in it and
          // gone when it ends.
          std::thread([&] {
            const size_t before = zinc_emu_device_bytes();
            zinc_emu_reset_device_peak();
            Engine e = Engine::initialize(model, cfg);
            DataConfig dc;
            dc.vocab_size = 37;
            dc.seq_len = T;
            DataLoader loader(make_data_source(dc), 2, 2, 1, 0, 7);
            for (int s = 0; s < 2; ++s) e.train_batch(loader);
            for (const MemoryPart& p : estimate_memory(e.model(), e.config(), T).gpu) estimated += p.bytes;
            measured = static_cast<int64_t>(zinc_emu_device_peak_bytes() - before);
          }).join();
          const int64_t N = 2 * T, uncounted = 24 * N + 4096;
          EXPECT_LE(estimated, measured + uncounted) << what << ": the estimate is over";
          EXPECT_GE(estimated, measured - uncounted) << what << ": the estimate is under";
        }
}
#endif

// fp32: the GPU's matmuls sum in another order than oneDNN's, so the runs
// part by rounding only: every loss within 1e-3 relative after 30 steps.
TEST(CudaEngine, Fp32TrainsLikeTheCpu) {
  ZINC_REQUIRE_GPU();
  for (int stage : {1, 2})
    for (int gas : {1, 2}) {
      const TrainRun cpu = train("cpu", "fp32", stage, gas, 30), gpu = train("cuda", "fp32", stage, gas, 30);
      for (size_t i = 0; i < cpu.losses.size(); ++i)
        EXPECT_NEAR(cpu.losses[i], gpu.losses[i], 1e-3 * std::fabs(cpu.losses[i])) << "step " << i;
      double diff = 0, norm = 0;
      for (size_t i = 0; i < cpu.weights.size(); ++i) {
        diff += (cpu.weights[i] - gpu.weights[i]) * (cpu.weights[i] - gpu.weights[i]);
        norm += cpu.weights[i] * cpu.weights[i];
      }
      EXPECT_LT(std::sqrt(diff / norm), 1e-3) << "stage " << stage << " gas " << gas;
    }
}

// The Llama (GQA 4:2, SwiGLU, RMSNorm, rope with llama3 scaling) on the GPU
// path against the CPU: its kernels' CUDA twins are the CPU's bit for bit,
// so the runs part only by the matmuls' summation order: every loss within
// 1e-3 relative after 20 steps, at stage 2 and at stage 3 with the
// parameters offloaded (one block gathered at a time).
TEST(CudaEngine, LlamaTrainsLikeTheCpu) {
  ZINC_REQUIRE_GPU();
  // variant 1: also Gemma 2 and 3's pieces (the 1 + w norms, scaled
  // embeddings, GeGLU, post-norms, soft-capped scores and logits, a window
  // on every other layer with its own rope); 2: OLMo 2's and Phi-3's (no
  // pre-norms, q/k norms over the whole projection, partial rotary
  // embeddings with longrope); 3: GPT-NeoX's (LayerNorm with biases, an
  // ungated MLP with exact GELU, the parallel residual, partial rotary); 4:
  // a mixture of experts (the router, one GEMM per expert on its grouped
  // rows, the combine, the load-balancing loss; a dense second layer).
  auto run = [](const std::string& device, int stage, int variant = 0, bool bf16 = false) {
    nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                          {"gradient_clipping", 1.0},
                          {"device", device},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
                          {"zero_optimization", {{"stage", stage}, {"offload_optimizer", {{"device", "cpu"}}}}}};
    if (bf16) cfg["bf16"] = {{"enabled", true}};
    if (stage == 3) {
      cfg["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
      cfg["zero_optimization"]["stage3_max_live_parameters"] = 0;
      cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    }
    models::LlamaConfig c = small_llama_config(device == "cuda" ? Device::kCuda : Device::kCpu);
    c.rope_scaling.type = models::RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.original_max_position_embeddings = 16;
    c.qkv_bias = true;
    c.qk_norm = true;  // Qwen3's per-head norms of q and k (copy_columns and RMSNorm over heads)
    c.head_dim = 12;   // decoupled from hidden_size / heads, as Qwen3's
    if (variant == 1) {
      c.norm_offset = 1.0f;
      c.scale_embeddings = true;
      c.mlp_act = models::LlamaConfig::MlpAct::kGeluTanh;
      c.post_norms = true;
      c.attn_logit_softcapping = 2.0;
      c.final_logit_softcapping = 5.0;
      c.query_pre_attn_scalar = 20.0;
      c.sliding_window = 5;
      c.sliding_pattern = 2;
      c.rope_local_theta = 1e4;
      c.rope_theta = 1e6;
    }
    if (variant == 2) {
      c.pre_norms = false;
      c.post_norms = true;
      c.qk_norm_full = true;
      c.partial_rotary_factor = 0.5;
      c.rope_scaling = models::RopeScaling{};
      c.rope_scaling.type = models::RopeScaling::Type::kLongrope;
      c.rope_scaling.short_factor = {1.0, 1.5, 2.0};
      c.rope_scaling.long_factor = {2.0, 5.0, 9.0};
      c.rope_scaling.original_max_position_embeddings = 16;
      c.rope_scaling.attention_factor = 1.2;
    }
    if (variant == 4) {
      c.qkv_bias = false;
      c.num_experts = 4;
      c.num_experts_per_tok = 2;
      c.moe_intermediate_size = 32;
      c.dense_layers = {0, 1};
      c.router_aux_loss_coef = 0.02;
    }
    if (variant == 3) {
      c.qk_norm = false;
      c.head_dim = 0;
      c.num_key_value_heads = 0;
      c.rope_scaling = models::RopeScaling{};
      c.layer_norm = true;
      c.mlp_gated = false;
      c.mlp_act = models::LlamaConfig::MlpAct::kGeluErf;
      c.parallel_residual = true;
      c.qkv_bias = c.o_bias = c.mlp_bias = true;
      c.partial_rotary_factor = 0.25;
    }
    Engine e = Engine::initialize(models::make_llama(c), cfg);
    DataConfig dc;
    dc.vocab_size = 37;
    dc.seq_len = 32;
    dc.determinism = 0.9;
    DataLoader loader(make_data_source(dc), 4, 1, 1, 0, 7);
    std::vector<float> losses;
    for (int s = 0; s < 20; ++s) losses.push_back(e.train_batch(loader));
    return losses;
  };
  for (int stage : {2, 3}) {
    const std::vector<float> cpu = run("cpu", stage), gpu = run("cuda", stage);
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_NEAR(cpu[i], gpu[i], 1e-3 * std::fabs(cpu[i])) << "stage " << stage << " step " << i;
    EXPECT_LT(gpu.back(), gpu.front() - 0.3) << "stage " << stage << ": the loss falls";
  }
  for (int variant : {1, 2, 3, 4}) {
    const std::vector<float> cpu = run("cpu", 2, variant), gpu = run("cuda", 2, variant);
    for (size_t i = 0; i < cpu.size(); ++i)
      EXPECT_NEAR(cpu[i], gpu[i], 1e-3 * std::fabs(cpu[i])) << "variant " << variant << " step " << i;
    // Without pre-norms (and with Gemma's scale of 20^-1/2 on the scores)
    // these tiny models learn slower in 20 steps: the loss must fall.
    EXPECT_LT(gpu.back(), gpu.front()) << "variant " << variant << ": the loss falls";
  }
  // bf16: the fused attention reads the 2 kv heads in place
  // (Ops::attention_reads_kv_heads; no gqa_expand, the projection's
  // gradient written by attention's backward), and Gemma 2's variant with
  // its cap and window; against the CPU in bf16 and the GPU's unfused path,
  // which repeats the heads, within the 16-bit tolerance (0.05 nats).
  // Also GPT-NeoX's LayerNorms and a mixture of experts in bf16: the GPU
  // keeps the fp32 buffers these read (Note [fused 16-bit operands]).
  for (int variant : {0, 1, 3, 4}) {
    const std::vector<float> cpu = run("cpu", 2, variant, true), gpu = run("cuda", 2, variant, true);
    kernels::cuda::set_unfused_attention_for_testing(true);
    const std::vector<float> unfused = run("cuda", 2, variant, true);
    kernels::cuda::set_unfused_attention_for_testing(false);
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_NEAR(cpu[i], gpu[i], 0.05) << "bf16 variant " << variant << " step " << i;
      EXPECT_NEAR(unfused[i], gpu[i], 0.05) << "bf16 variant " << variant << " step " << i;
    }
    EXPECT_LT(gpu.back(), gpu.front()) << "bf16 variant " << variant << ": the loss falls";
  }
}

// LoRA adapters on the GPU path (models/detail/lora.h over CudaOps; the
// B gradients transposed by kernels::cuda::add_transposed): a Llama and a
// GPT with adapters on every linear layer, the base frozen, against the
// CPU: every loss within 1e-3 relative in fp32 (the matmuls' order), and
// 0.05 nats in bf16 and with adapter dropout. On the GPU, ZeRO-Offload and
// GPU-resident states give the same bits, at stage 2 and at stage 3 with
// the parameters offloaded; the frozen base is the same after training;
// a checkpoint resumes bit for bit.
TEST(CudaEngine, LoraTrainsLikeTheCpu) {
  ZINC_REQUIRE_GPU();
  struct Run {
    std::vector<float> losses;
    std::vector<float> base, adapters;  // block 1's compute weights (frozen), the first adapter block's master
    int64_t estimated = 0, measured = 0;  // the GPU's model state: estimate_memory's and the peak held
  };
  auto run = [](const std::string& device, bool gpt, bool bf16, double dropout, const std::string& offload,
                int stage, int resume_at = -1) {
    nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                          {"gradient_accumulation_steps", 2},
                          {"gradient_clipping", 1.0},
                          {"device", device},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.01}}}}},
                          {"zero_optimization", {{"stage", stage}, {"offload_optimizer", {{"device", offload}}}}}};
    if (bf16) cfg["bf16"] = {{"enabled", true}};
    if (stage == 3) cfg["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
    models::LoraConfig lora;
    lora.r = 4;
    lora.alpha = 8;
    lora.dropout = dropout;
    const Device dev = device == "cuda" ? Device::kCuda : Device::kCpu;
    auto build = [&]() -> std::shared_ptr<Model> {
      if (gpt) {
        models::GptConfig g = small_gpt_config(dev);
        lora.targets = {"c_attn", "c_proj", "c_fc"};
        g.lora = lora;
        return models::make_gpt(g);
      } else {
        models::LlamaConfig c = small_llama_config(dev);
        lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
        c.lora = lora;
        return models::make_llama(c);
      }
    };
    Engine e = Engine::initialize(build(), cfg);
    DataConfig dc;
    dc.vocab_size = 37;
    dc.seq_len = 32;
    dc.determinism = 0.9;
    DataLoader loader(make_data_source(dc), 4, 2, 1, 0, 7);
    Run r;
    for (int s = 0; s < 12; ++s) {
      if (s == resume_at) {  // saved, then on in a new engine (a new model) from the checkpoint
        char tmpl[] = "/tmp/zinc_cuda_lora_ckpt_XXXXXX";
        const std::string dir = mkdtemp(tmpl);
        e.save_checkpoint(dir, "t");
        Engine e2 = Engine::initialize(build(), cfg);
        e2.load_checkpoint(dir, "t");
        e = std::move(e2);
        std::filesystem::remove_all(dir);
      }
      r.losses.push_back(e.train_batch(loader));
    }
    for (const MemoryPart& p : estimate_memory(e.model(), e.config(), 32).gpu)
      if (p.model_state) r.estimated += p.bytes;
    r.measured = e.gpu_state_peak_bytes();
    const std::vector<BlockSpec>& blocks = e.model().blocks();
    for (size_t b = 0; b < blocks.size(); ++b) {
      if (blocks[b].frozen && r.base.empty()) r.base = e.full_params(static_cast<int>(b));
      if (!blocks[b].frozen && b > 0 && r.adapters.empty()) r.adapters = e.full_params(static_cast<int>(b));
    }
    return r;
  };
  for (bool gpt : {false, true})
    for (bool bf16 : {false, true})
      for (double dropout : {0.0, 0.1}) {
        if (!bf16 && dropout > 0) continue;
        const std::string what = std::string(gpt ? "gpt" : "llama") + (bf16 ? " bf16" : " fp32") +
                                 (dropout > 0 ? " dropout" : "");
        const Run cpu = run("cpu", gpt, bf16, dropout, "cpu", 2);
        const Run gpu = run("cuda", gpt, bf16, dropout, "cpu", 2);
        ASSERT_EQ(cpu.losses.size(), gpu.losses.size());
        for (size_t i = 0; i < cpu.losses.size(); ++i) {
          if (bf16)
            EXPECT_NEAR(cpu.losses[i], gpu.losses[i], 0.05) << what << " step " << i;
          else
            EXPECT_NEAR(cpu.losses[i], gpu.losses[i], 1e-3 * std::fabs(cpu.losses[i])) << what << " step " << i;
        }
        EXPECT_LT(gpu.losses.back(), gpu.losses.front() - 0.1) << what << ": the loss falls";
        ASSERT_FALSE(gpu.base.empty()) << what << ": no frozen block";
        ASSERT_FALSE(gpu.adapters.empty()) << what << ": no adapter block";
        EXPECT_EQ(cpu.base, gpu.base) << what << ": the frozen base moved";
        if (dropout > 0 || gpt) continue;
        const Run resident = run("cuda", gpt, bf16, dropout, "none", 2);
        EXPECT_EQ(gpu.adapters, resident.adapters) << what << ": GPU-resident against ZeRO-Offload";
        // The frozen base holds no gradient accumulator on the GPU (with
        // GPU-resident states on one rank the accumulators stay): the
        // estimate is the peak the mirror held.
        EXPECT_EQ(resident.estimated, resident.measured) << what << ": GPU-resident states";
        EXPECT_LE(gpu.measured, gpu.estimated) << what << ": ZeRO-Offload";
        const Run s3 = run("cuda", gpt, bf16, dropout, "cpu", 3);
        EXPECT_EQ(gpu.adapters, s3.adapters) << what << ": stage 3 against stage 2";
        EXPECT_EQ(gpu.losses, s3.losses) << what << ": stage 3 against stage 2";
        const Run s3r = run("cuda", gpt, bf16, dropout, "none", 3);
        EXPECT_EQ(gpu.adapters, s3r.adapters) << what << ": stage 3, GPU-resident states";
        EXPECT_EQ(cpu.base, s3r.base) << what << ": stage 3, GPU-resident states: the frozen base moved";
        // A checkpoint resumes bit for bit (the base comes from the model, the adapters and states from the files).
        const Run resumed = run("cuda", gpt, bf16, dropout, "none", 2, 5);
        EXPECT_EQ(resident.adapters, resumed.adapters) << what << ": resumed";
        EXPECT_EQ(resident.losses, resumed.losses) << what << ": resumed";
        const Run resumed3 = run("cuda", gpt, bf16, dropout, "cpu", 3, 5);
        EXPECT_EQ(s3.adapters, resumed3.adapters) << what << ": stage 3, resumed";
      }
}

// Activation checkpointing (gradient_checkpointing) on the GPU path: each
// layer's activations recomputed in backward from its input by the same
// kernels, so the checkpointed run is the plain GPU run bit for bit
// (weights and losses; the last block's, LoRA's adapters where there are
// some), in fp32 and bf16, for the GPT, a Llama and a Llama with LoRA
// dropout; and its estimate keeps less activation memory.
TEST(CudaEngine, ActivationCheckpointingKeepsTheBits) {
  ZINC_REQUIRE_GPU();
  for (const std::string kind : {"gpt", "llama", "llama lora dropout"})
    for (bool bf16 : {false, true}) {
      const bool gpt = kind == "gpt";
      auto run = [&](bool checkpointed) {
        nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                              {"gradient_accumulation_steps", 2},
                              {"gradient_clipping", 1.0},
                              {"device", "cuda"},
                              {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}}}}},
                              {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}};
        if (bf16) cfg["bf16"] = {{"enabled", true}};
        std::shared_ptr<Model> model;
        if (gpt) {
          models::GptConfig g = small_gpt_config(Device::kCuda);
          g.gradient_checkpointing = checkpointed;
          model = models::make_gpt(g);
        } else {
          models::LlamaConfig c = small_llama_config(Device::kCuda);
          c.gradient_checkpointing = checkpointed;
          if (kind == "llama lora dropout") {  // the adapters' dropout masks drawn again in the recompute
            c.lora.r = 4;
            c.lora.dropout = 0.1;
            c.lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
          }
          model = models::make_llama(c);
        }
        const int64_t saved = model->activation_memory(4, 32, bf16 ? DType::kBF16 : DType::kF32)->saved;
        Engine e = Engine::initialize(model, cfg);
        DataConfig dc;
        dc.vocab_size = 37;
        dc.seq_len = 32;
        dc.determinism = 0.9;
        DataLoader loader(make_data_source(dc), 4, 2, 1, 0, 7);
        std::vector<float> losses;
        for (int s = 0; s < 6; ++s) losses.push_back(e.train_batch(loader));
        return std::make_tuple(losses, e.full_params(static_cast<int>(e.model().blocks().size()) - 1), saved);
      };
      const std::string what = kind + (bf16 ? " bf16" : " fp32");
      const auto [plain_losses, plain_w, plain_saved] = run(false);
      const auto [ck_losses, ck_w, ck_saved] = run(true);
      EXPECT_EQ(plain_losses, ck_losses) << what;
      EXPECT_EQ(0, std::memcmp(plain_w.data(), ck_w.data(), plain_w.size() * 4)) << what;
      EXPECT_LT(ck_saved, plain_saved) << what;
    }
}

// Where the GPU's kernels write the 16-bit matmul operands themselves
// (Ops::fuses_every_operand16) the models allocate none of the fp32
// buffers those kernels leave unwritten, and count none: the Llama's ln_1,
// ln_2, gated activation, attention output and final norm, the GPT's
// attention output. The estimate of the GPU model is the CPU model's less
// exactly those buffers (fp32 keeps them all); and the runs above train
// without them.
TEST(CudaEngine, TheGpuKeepsNoFp32CopyOfItsSixteenBitOperands) {
  ZINC_REQUIRE_GPU();
  using models::detail::buffer_bytes;
  const int64_t B = 4, T = 32, N = B * T;
  models::LlamaConfig c = small_llama_config(Device::kCpu);
  c.num_hidden_layers = 3;
  auto llama = [&](Device d) {
    c.device = d;
    return models::make_llama(c);
  };
  const int64_t A = 64, C = 64, I = 96, L = 3;
  // What the CPU model's bf16 estimate holds beyond the GPU model's.
  auto gap = [&](auto make) -> int64_t {
    const auto cpu = make(Device::kCpu)->activation_memory(B, T, DType::kBF16);
    const auto gpu = make(Device::kCuda)->activation_memory(B, T, DType::kBF16);
    if (!cpu || !gpu) {
      ADD_FAILURE() << "no activation estimate";
      return -1;
    }
    return cpu->saved - gpu->saved;
  };
  // Attention's workspaces differ too: the CPU keeps the probabilities, the fused GPU kernels lse and the output.
  auto ws_delta = [&](int64_t width, int64_t heads) {
    const kernels::AttentionShape as{B, T, width, heads};
    return kernels::attention_workspace_bytes(as) - kernels::cuda::attention_workspace_bytes(as, DType::kBF16);
  };
  // And the logit gradient, its 16-bit operand alone on the GPU (Ops::cross_entropy_operand16).
  auto logit_grad_delta = [&](int64_t V) { return buffer_bytes(N * V) - buffer_bytes(N * V, 2); };
  // And each matmul input's 16-bit copy: the CPU's scratch rounding, and
  // none where it has no bf16 products; the GPU's always (Ops::matmul_input_bytes).
  auto op_delta = [&](int64_t n) {
    return kernels::ScratchTally::operand16_bytes(n, /*in_place=*/true, DType::kBF16) - buffer_bytes(n, 2);
  };
  const int64_t llama_ops = L * (2 * op_delta(N * C) + op_delta(N * A) + op_delta(N * I)) + op_delta(N * C);
  EXPECT_EQ(gap(llama), L * (2 * buffer_bytes(N * C) + buffer_bytes(N * A) + buffer_bytes(N * I) + ws_delta(A, 4)) +
                            buffer_bytes(N * C) + logit_grad_delta(37) + llama_ops);
  EXPECT_EQ(llama(Device::kCuda)->activation_memory(B, T, DType::kF32)->saved,
            llama(Device::kCpu)->activation_memory(B, T, DType::kF32)->saved);
  // A mixture of experts keeps ln_2 (its experts gather rows of it), and on
  // the GPU not the experts' SwiGLU output (their grouped rows, padded to
  // 16-row blocks: Note [expert row blocks]).
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 32;
  const int64_t Mg = N * 2 + 4 * 15;
  EXPECT_EQ(gap(llama), L * (buffer_bytes(N * C) + buffer_bytes(N * A) + buffer_bytes(N * I) + ws_delta(A, 4) +
                             buffer_bytes(Mg * 32) + op_delta(Mg * C) + op_delta(Mg * 32)) +
                            buffer_bytes(N * C) + logit_grad_delta(37) + llama_ops);
  models::GptConfig g;
  g.vocab_size = 29;
  g.block_size = 32;
  g.n_layer = 2;
  g.n_head = 2;
  g.n_embd = 32;
  auto gpt = [&](Device d) {
    g.device = d;
    return models::make_gpt(g);
  };
  // The CPU fuses ln_1, ln_2, GELU and the final norm where it multiplies bf16 natively, the GPU always.
  const int64_t Cg = 32, F = 4 * Cg;
  const int64_t cpu_fused = kernels::bf16_operands_native() ? 0 : 2 * (2 * buffer_bytes(N * Cg) + buffer_bytes(N * F)) +
                                                                      buffer_bytes(N * Cg);
  const int64_t gpt_ops = 2 * (3 * op_delta(N * Cg) + op_delta(N * F)) + op_delta(N * Cg);
  EXPECT_EQ(gap(gpt), cpu_fused + 2 * (buffer_bytes(N * Cg) + ws_delta(Cg, 2)) + logit_grad_delta(29) + gpt_ops);
  // fp16 keeps what bf16 keeps on the GPU: every matmul input's 16-bit
  // copy, and no fp32 logit gradient (written with the loss scale,
  // StepContext::coming_loss_scale).
  EXPECT_EQ(gpt(Device::kCuda)->activation_memory(B, T, DType::kF16)->saved,
            gpt(Device::kCuda)->activation_memory(B, T, DType::kBF16)->saved);
  EXPECT_EQ(llama(Device::kCuda)->activation_memory(B, T, DType::kF16)->saved,
            llama(Device::kCuda)->activation_memory(B, T, DType::kBF16)->saved);
}

// Masked targets and packed documents (issue 31) on the GPU path against
// the CPU: a GPT (wpe indexed and dwpe scattered by document position) and
// the Llama above (rope by document position), fp32, gas 2 so that the
// normaliser is the count of targets over the global batch; the Llama also
// at stage 3 with the parameters offloaded. Each micro-batch of the
// synthetic source is cut into documents (packed_positions: lengths 1 to
// 33, other cuts in each row) with the target that crosses into the next
// document and each document's first two targets (a "prompt") masked;
// every fourth step's second micro-batch has no target at all (zero loss,
// zero gradient, no NaN) and every third step's first has no positions.
// The kernels are the CPU's bit for bit but the matmuls: the tolerance of
// the unmasked runs, every micro-batch's loss within 1e-3 relative, and the
// end weights within 1e-3 (rms, relative).
TEST(CudaEngine, MaskedTargetsAndPackedDocumentsTrainLikeTheCpu) {
  ZINC_REQUIRE_GPU();
  auto mask_and_pack = [](Batch b, bool packed, bool none) {
    if (packed) b.positions = cuda::testing::packed_positions(b.B, b.T);
    for (int64_t r = 0; r < b.B * b.T; ++r) {
      const int64_t t = r % b.T;
      const bool crosses = packed && t + 1 < b.T && b.positions[static_cast<size_t>(r + 1)] == 0;
      const int64_t p = packed ? b.positions[static_cast<size_t>(r)] : t;
      if (none || crosses || p < 2) b.targets[static_cast<size_t>(r)] = kIgnoreTarget;
    }
    return b;
  };
  struct Run {
    std::vector<float> losses, weights;
  };
  auto run = [&](const std::string& kind, const std::string& device, int stage) {
    nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                          {"gradient_accumulation_steps", 2},
                          {"gradient_clipping", 1.0},
                          {"device", device},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
                          {"zero_optimization", {{"stage", stage}, {"offload_optimizer", {{"device", "cpu"}}}}}};
    if (stage == 3) {
      cfg["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
      cfg["zero_optimization"]["stage3_max_live_parameters"] = 0;
      cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    }
    const Device dev = device == "cuda" ? Device::kCuda : Device::kCpu;
    std::shared_ptr<Model> model;
    if (kind == "gpt") {
      model = models::make_gpt(small_gpt_config(dev, 48));
    } else {
      models::LlamaConfig c = small_llama_config(dev, 48);
      c.rope_scaling.type = models::RopeScaling::Type::kLlama3;
      c.rope_scaling.factor = 8.0;
      c.rope_scaling.original_max_position_embeddings = 16;
      c.qkv_bias = true;
      model = models::make_llama(c);
    }
    Engine e = Engine::initialize(model, cfg);
    DataConfig dc;
    dc.vocab_size = 37;
    dc.seq_len = 47;  // odd, and longer than the longest document
    dc.determinism = 0.9;
    DataLoader loader(make_data_source(dc), 4, 2, 1, 0, 7);
    Run r;
    for (int s = 0; s < 16; ++s)
      for (int m = 0; m < 2; ++m) {
        const Batch b = mask_and_pack(loader.next(), !(m == 0 && s % 3 == 2), m == 1 && s % 4 == 3);
        r.losses.push_back(e.forward(b));
        e.backward();
        e.step();
      }
    r.weights = e.full_params(1);
    return r;
  };
  for (const auto& [kind, stage] : {std::pair<std::string, int>{"gpt", 2}, {"llama", 2}, {"llama", 3}}) {
    const std::string what = kind + " stage " + std::to_string(stage);
    const Run cpu = run(kind, "cpu", stage), gpu = run(kind, "cuda", stage);
    ASSERT_EQ(cpu.losses.size(), gpu.losses.size());
    for (size_t i = 0; i < cpu.losses.size(); ++i) {
      if (i % 8 == 7) {  // no targets, no loss (NaN, never 0), on both paths
        EXPECT_TRUE(std::isnan(gpu.losses[i]) && std::isnan(cpu.losses[i])) << what << " micro-batch " << i;
        continue;
      }
      ASSERT_TRUE(std::isfinite(gpu.losses[i])) << what << " micro-batch " << i;
      EXPECT_NEAR(cpu.losses[i], gpu.losses[i], 1e-3 * std::fabs(cpu.losses[i])) << what << " micro-batch " << i;
    }
    double diff = 0, norm = 0;
    for (size_t i = 0; i < cpu.weights.size(); ++i) {
      diff += (cpu.weights[i] - gpu.weights[i]) * (cpu.weights[i] - gpu.weights[i]);
      norm += cpu.weights[i] * cpu.weights[i];
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-3) << what;
    const float first = (gpu.losses[0] + gpu.losses[1] + gpu.losses[2]) / 3;
    const float last = (gpu.losses[28] + gpu.losses[29] + gpu.losses[30]) / 3;
    EXPECT_LT(last, first - 0.1) << what << ": the loss falls";
  }
}

// bf16: the same tolerance as the CPU's bf16 against fp32 (the mean of the
// last 10 losses within 0.05 nats), and the loss falls.
TEST(CudaEngine, Bf16AndFp16TrainToTheCpuLoss) {
  ZINC_REQUIRE_GPU();
  for (const char* prec : {"bf16", "fp16"}) {
    const TrainRun cpu = train("cpu", prec, 1, 1, 100), gpu = train("cuda", prec, 1, 1, 100);
    double tc = 0, tg = 0;
    for (size_t i = 90; i < 100; ++i) {
      tc += cpu.losses[i] / 10;
      tg += gpu.losses[i] / 10;
    }
    EXPECT_NEAR(tc, tg, 0.05) << prec;
    EXPECT_LT(tg, gpu.losses[0] - 0.5) << prec;
  }
}

// ZeRO-Offload (master, m, v on the host, the CPU AdamW) and GPU-resident
// states (adam_step_cuda) do the same arithmetic in the same roundings
// (optim/detail/adam_update.h) on the same gradients: without clipping (whose
// coefficient depends on the norm, summed in another order on each side)
// the weights are the same bits after 20 steps.
TEST(CudaEngine, ZeroOffloadEqualsGpuResidentAdamWBitForBit) {
  ZINC_REQUIRE_GPU();
  if (optim::detect_isa() == optim::Isa::kScalar) GTEST_SKIP() << "the CPU AdamW has no FMA path here";
  for (const char* prec : {"fp32", "bf16"})
    for (int gas : {1, 2}) {
      const TrainRun off = train("cuda", prec, 1, gas, 20, "cpu", 0.0);
      const TrainRun gpu = train("cuda", prec, 1, gas, 20, "none", 0.0);
      ASSERT_EQ(off.weights.size(), gpu.weights.size());
      EXPECT_EQ(0, std::memcmp(off.weights.data(), gpu.weights.data(), off.weights.size() * 4))
          << prec << " gas " << gas;
      for (size_t i = 0; i < off.losses.size(); ++i) EXPECT_EQ(off.losses[i], gpu.losses[i]) << "step " << i;
      // With clipping too: both take the norm on the GPU in the same order
      // (Note [the norm on the GPU] in engine/gpu_offload.cpp).
      const TrainRun offc = train("cuda", prec, 1, gas, 20, "cpu", 1.0);
      const TrainRun gpuc = train("cuda", prec, 1, gas, 20, "none", 1.0);
      ASSERT_EQ(offc.weights.size(), gpuc.weights.size());
      EXPECT_EQ(0, std::memcmp(offc.weights.data(), gpuc.weights.data(), offc.weights.size() * 4))
          << prec << " gas " << gas << ", clipped";
    }
}

// The Hugging Face Trainer's AdamW (OptimizerConfig::decay_vectors false:
// no weight decay on biases and norm weights) over GPU-resident states,
// each block's update in runs of decayed and undecayed elements, equals it
// over ZeRO-Offload's host states bit for bit, and differs from the AdamW
// that decays everything.
TEST(CudaEngine, TheTrainersAdamWOnTheGpuDecaysAsOnTheHost) {
  ZINC_REQUIRE_GPU();
  if (optim::detect_isa() == optim::Isa::kScalar) GTEST_SKIP() << "the CPU AdamW has no FMA path here";
  auto run = [](const char* offload, bool decay_vectors) {
    nlohmann::json j = {{"train_micro_batch_size_per_gpu", 8},
                        {"device", "cuda"},
                        {"bf16", {{"enabled", true}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.5}}}}},
                        {"zero_optimization", {{"stage", 1}, {"offload_optimizer", {{"device", offload}}}}}};
    Config c = Config::parse(j);
    c.optimizer.decay_vectors = decay_vectors;
    Engine e = Engine::initialize(models::make_gpt(small_gpt_config(Device::kCuda)), c);
    DataConfig dc;
    dc.vocab_size = 37;
    dc.seq_len = 32;
    DataLoader loader(make_data_source(dc), 8, 1, 1, 0, 7);
    for (int s = 0; s < 4; ++s) e.train_batch(loader);
    std::vector<float> w;
    for (size_t b = 0; b < e.model().blocks().size(); ++b) {
      const std::vector<float> x = e.full_params(static_cast<int>(b));
      w.insert(w.end(), x.begin(), x.end());
    }
    return w;
  };
  const std::vector<float> host = run("cpu", false), gpu = run("none", false), all = run("none", true);
  ASSERT_EQ(host.size(), gpu.size());
  EXPECT_EQ(0, std::memcmp(host.data(), gpu.data(), host.size() * 4));
  EXPECT_NE(0, std::memcmp(all.data(), gpu.data(), gpu.size() * 4));
}

// Lamb over GPU-resident states (optim::LambCuda) against Lamb over
// ZeRO-Offload's host states, the GPU computing the same gradients: the
// same weights and losses, bit for bit, at stage 1 in fp32 and bf16,
// clipped or not, and at stage 3 (the parameters in page-locked RAM) in
// bf16, clipped. Each
// tensor's trust ratio comes from sums in another order on each side,
// rounded to the same float (optim_cuda.h). Lamb's weights are not AdamW's,
// so the rule did run, and a checkpoint resumes bit for bit. (Several
// ranks: cuda_engine_multirank_test.)
TEST(CudaEngine, LambOverGpuResidentStatesEqualsZeroOffloadBitForBit) {
  ZINC_REQUIRE_GPU();
  if (optim::detect_isa() == optim::Isa::kScalar) GTEST_SKIP() << "the CPU Lamb has no FMA path here";
  for (int stage : {1, 3})
    for (const char* prec : {"fp32", "bf16"})
      for (double clip : {0.0, 1.0}) {
        if (stage == 3 && (prec == std::string("fp32") || clip == 0.0)) continue;
        const std::string what = std::string(prec) + ", stage " + std::to_string(stage) + ", clip " +
                                 std::to_string(clip);
        const std::string param = stage == 3 ? "cpu" : "";
        const TrainRun off = train("cuda", prec, stage, 2, 6, "cpu", clip, "", -1, param, 0, "Lamb");
        const TrainRun gpu = train("cuda", prec, stage, 2, 6, "none", clip, "", -1, param, 0, "Lamb");
        ASSERT_EQ(off.weights.size(), gpu.weights.size()) << what;
        EXPECT_EQ(0, std::memcmp(off.weights.data(), gpu.weights.data(), off.weights.size() * 4)) << what;
        ASSERT_EQ(off.losses.size(), gpu.losses.size());
        for (size_t i = 0; i < off.losses.size(); ++i) EXPECT_EQ(off.losses[i], gpu.losses[i]) << what << ", step " << i;
        EXPECT_LT(gpu.losses.back(), gpu.losses.front()) << what << ": Lamb did not train";
        if (stage == 1 && clip == 0.0) {
          const TrainRun adamw = train("cuda", prec, stage, 2, 6, "none", clip, "", -1, param, 0, "AdamW");
          EXPECT_NE(0, std::memcmp(adamw.weights.data(), gpu.weights.data(), gpu.weights.size() * 4)) << what;
        }
        if (stage == 1 && prec == std::string("bf16") && clip == 1.0) {
          // Saved after 3 steps and resumed in a new engine: the same bits.
          char tmpl[] = "/tmp/zinc_cuda_lamb_ckpt_XXXXXX";
          const std::string dir = mkdtemp(tmpl);
          const TrainRun resumed = train("cuda", prec, stage, 2, 6, "none", clip, dir, 3, param, 0, "Lamb");
          EXPECT_EQ(0, std::memcmp(resumed.weights.data(), gpu.weights.data(), gpu.weights.size() * 4))
              << what << ", resumed";
          std::filesystem::remove_all(dir);
        }
      }
}

// Stage 3 on the GPU (the parameters in page-locked RAM or on NVMe, one
// block gathered at a time, uploaded at its acquire and freed at its
// release) runs the same kernels on the same values as stage 2: the same
// bits, with less GPU memory held.
TEST(CudaEngine, Stage3EqualsStage2BitForBitWithLessGpuMemory) {
  ZINC_REQUIRE_GPU();
  std::map<std::string, TrainRun> stage2;  // by precision and gas: the same for both places
  for (const char* where : {"cpu", "nvme"})
    for (const char* prec : {"fp32", "bf16"})
      for (int gas : {1, 2}) {
        const std::string key = std::string(prec) + " " + std::to_string(gas);
        if (!stage2.count(key)) stage2.emplace(key, train("cuda", prec, 2, gas, 10));
        const TrainRun& s2 = stage2.at(key);
        const TrainRun s3 = train("cuda", prec, 3, gas, 10, "cpu", 1.0, "", -1, where);
        const std::string what = std::string(where) + " " + prec + " gas " + std::to_string(gas);
        ASSERT_EQ(s2.weights.size(), s3.weights.size());
        EXPECT_EQ(0, std::memcmp(s2.weights.data(), s3.weights.data(), s2.weights.size() * 4)) << what;
        for (size_t i = 0; i < s2.losses.size(); ++i) EXPECT_EQ(s2.losses[i], s3.losses[i]) << what << " step " << i;
        EXPECT_LT(s3.gpu_peak, s2.gpu_peak) << what;
        // With room for a layer ahead the blocks come up before their
        // acquires (on one rank with the shards in RAM each gather is the
        // block's upload, on the coordinator's stream): the same bits.
        const TrainRun pre = train("cuda", prec, 3, gas, 10, "cpu", 1.0, "", -1, where, 1);
        EXPECT_EQ(0, std::memcmp(s2.weights.data(), pre.weights.data(), s2.weights.size() * 4)) << what << " prefetch";
        EXPECT_GT(pre.gathers.prefetched, pre.gathers.gathers / 4) << what << " prefetch";
        EXPECT_LT(pre.gpu_peak, s2.gpu_peak) << what << " prefetch";
        if (optim::detect_isa() == optim::Isa::kScalar) continue;  // the CPU AdamW has no FMA path here
        // GPU-resident states at stage 3 (the new shards sent down to the
        // host) against ZeRO-Offload at stage 3, without clipping.
        const TrainRun off = train("cuda", prec, 3, gas, 10, "cpu", 0.0, "", -1, where);
        const TrainRun res = train("cuda", prec, 3, gas, 10, "none", 0.0, "", -1, where);
        EXPECT_EQ(0, std::memcmp(off.weights.data(), res.weights.data(), off.weights.size() * 4)) << what;
      }
}

// A checkpoint of GPU-resident states resumes bit for bit.
TEST(CudaEngine, GpuResidentStatesResumeBitForBit) {
  ZINC_REQUIRE_GPU();
  char tmpl[] = "/tmp/zinc_cuda_ckpt_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const TrainRun straight = train("cuda", "bf16", 1, 1, 12, "none");
  const TrainRun resumed = train("cuda", "bf16", 1, 1, 12, "none", 1.0, dir, 6);
  EXPECT_EQ(0, std::memcmp(straight.weights.data(), resumed.weights.data(), straight.weights.size() * 4));
  std::filesystem::remove_all(dir);
}

// A model on one device and a config naming the other is refused, naming
// "device" and the model's device.
TEST(CudaEngine, ModelAndConfigMustAgreeOnTheDevice) {
  ZINC_REQUIRE_GPU();
  models::GptConfig g;
  g.device = Device::kCuda;
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 2}};
  try {
    Engine::initialize(models::make_gpt(g), cfg);
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("device"), std::string::npos) << m;
    EXPECT_NE(m.find("computes on cuda"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace zinc
