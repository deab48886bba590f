// What the config and the memory estimate say about "device": "cuda" where
// a GPU is visible (on a GPU, or under kernel emulation: tests/cuda_emu).
// Skipped without a GPU; tests/engine/config_test.cpp has the CPU side
// ("cuda" refused, saying why).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/config.h"
#include "engine/gpu_offload.h"
#include "engine/memory_estimate.h"
#include "engine/model.h"
#include "engine/partition.h"
#include "models/models.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/engine/config_test_util.h"

namespace zinc {
namespace {

using nlohmann::json;
using testing_config::config_error;
using testing_config::with;

// "cuda" parses to the GPU, with no warning about the device.
TEST(CudaConfig, CudaIsTheGpuWithoutAWarning) {
  ZINC_REQUIRE_GPU();
  const Config c = Config::parse(json{{"train_micro_batch_size_per_gpu", 2}, {"device", "cuda"}});
  EXPECT_EQ(c.device, Device::kCuda);
  for (const std::string& w : c.warnings) EXPECT_EQ(w.find("device"), std::string::npos) << w;
  EXPECT_EQ(Config::parse(with({{"device", "auto"}})).device, Device::kCuda);
}

// DeepSpeed's activation_checkpointing keys about the device: on the GPU
// path they are ignored (the checkpoints stay in GPU memory), not "no
// effect" for the CPU's reasons, which the warnings once gave on any device.
TEST(CudaConfig, ActivationCheckpointingDeviceKeysAreIgnoredOnTheGpu) {
  ZINC_REQUIRE_GPU();
  const Config c = Config::parse(json{{"train_micro_batch_size_per_gpu", 2},
                                      {"device", "cuda"},
                                      {"activation_checkpointing",
                                       {{"cpu_checkpointing", true}, {"synchronize_checkpoint_boundary", true}}}});
  EXPECT_TRUE(testing_config::any_warning_has(c, "activation_checkpointing.cpu_checkpointing: ignored"));
  EXPECT_TRUE(testing_config::any_warning_has(c, "keeps them in GPU memory"));
  EXPECT_TRUE(testing_config::any_warning_has(c, "activation_checkpointing.synchronize_checkpoint_boundary: ignored"));
  for (const std::string& w : c.warnings) EXPECT_EQ(w.find("host RAM already"), std::string::npos) << w;
  for (const std::string& w : c.warnings) EXPECT_EQ(w.find("no device to synchronize"), std::string::npos) << w;
}

// What "device": "cuda" covers is decided from the config alone, once a GPU
// lets "cuda" through the first check.
TEST(CudaConfig, CudaCoversZeroOffloadAndGpuStatesAtEveryStage) {
  ZINC_REQUIRE_GPU();
  auto err = [](const json& j) { return testing_config::error_of_parse([](const json& d) { Config::parse(d); }, j); };
  EXPECT_EQ(Config::parse(with({{"device", "cuda"}})).device, Device::kCuda);  // GPU-resident states, one rank
  EXPECT_EQ(Config::parse(with({{"device", "cuda"}}), 2).device, Device::kCuda);  // ... stage 0 on two ranks
  // Lamb over GPU-resident states too (optim::LambCuda), at every stage.
  for (int stage : {0, 1, 2, 3})
    EXPECT_EQ(Config::parse(with({{"device", "cuda"},
                                  {"optimizer", {{"type", "Lamb"}}},
                                  {"zero_optimization", {{"stage", stage}}}}),
                            2)
                  .device,
              Device::kCuda)
        << "Lamb, stage " << stage;
  testing_config::expect_parts(err(with({{"device", "cuda"}, {"optimizer", {{"type", "OneBitAdam"}}}})),
                               {"optimizer.type", "OneBitAdam", "CPU ranks only"});
  for (const char* where : {"cpu", "nvme"}) {
    const json off = {{"device", where}, {"nvme_path", "/tmp"}};
    EXPECT_EQ(Config::parse(with({{"device", "cuda"}, {"zero_optimization", {{"stage", 3}, {"offload_optimizer", off}}}}))
                  .device,
              Device::kCuda)
        << where;
  }
  EXPECT_EQ(Config::parse(with({{"device", "cuda"}, {"zero_optimization", {{"stage", 3}}}}), 2).device, Device::kCuda);
  EXPECT_EQ(Config::parse(with({{"device", "cuda"},
                                {"zero_optimization", {{"stage", 1}, {"offload_optimizer", {{"device", "cpu"}}}}}}), 2)
                .device,
            Device::kCuda);
}

// "auto" takes the GPU where the GPU path covers the config, and otherwise
// stays on the CPU saying why; an explicit "cuda" is then an error.
TEST(CudaConfig, AutoFallsBackToTheCpuWhereTheGpuPathDoesNotReach) {
  ZINC_REQUIRE_GPU();
  auto parse = [](const json& zero, const char* device) {
    return Config::parse(json{{"train_micro_batch_size_per_gpu", 2}, {"device", device}, {"zero_optimization", zero}});
  };
  EXPECT_EQ(parse({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}, "auto").device, Device::kCuda);
  EXPECT_EQ(parse({{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}}, "auto").device, Device::kCuda);
  EXPECT_EQ(parse({{"stage", 3}}, "auto").device, Device::kCuda);
  auto onebit = [](const char* device) {
    return Config::parse(json{{"train_micro_batch_size_per_gpu", 2},
                              {"device", device},
                              {"optimizer", {{"type", "OneBitAdam"}}},
                              {"zero_optimization", {{"stage", 0}}}});
  };
  const Config c = onebit("auto");  // the 1-bit optimizers: not on the GPU
  EXPECT_EQ(c.device, Device::kCpu);
  EXPECT_TRUE(testing_config::any_warning_has(c, "\"auto\" stays on the CPU"));
  testing_config::expect_parts(testing_config::error_of_parse([&](const json&) { onebit("cuda"); }, json::object()),
                               {"optimizer.type"});
  // The grids the GPU path does not run yet (they refused "auto" too):
  // tensor parts at stage 3, and expert ranks.
  for (const json& grid : {json{{"tensor_parallel", {{"autotp_size", 2}}}, {"zero_optimization", {{"stage", 3}}}},
                           json{{"tensor_parallel", {{"autotp_size", 2}}},
                                {"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}}}},
                           json{{"expert_parallel", {{"enabled", true}, {"autoep_size", 2}}}}}) {
    json cfg = grid;
    cfg["train_micro_batch_size_per_gpu"] = 2;
    cfg["device"] = "auto";
    const Config a = Config::parse(cfg, 2);
    EXPECT_EQ(a.device, Device::kCpu) << grid.dump();
    EXPECT_TRUE(testing_config::any_warning_has(a, "\"auto\" stays on the CPU")) << grid.dump();
    cfg["device"] = "cuda";
    std::string err;
    try {
      Config::parse(cfg, 2);
    } catch (const ConfigError& e) {
      err = e.what();
    }
    EXPECT_NE(err.find(grid.contains("expert_parallel") ? "expert_parallel.autoep_size" : "tensor_parallel.autotp_size"),
              std::string::npos)
        << grid.dump() << ": " << err;
  }
}

// --estimate with "device": "cuda": the activations move to the GPU's part,
// which holds every block's compute parameters and fp32 accumulators (and
// with GPU-resident states master, m and v); the host keeps the staging.
// offload_optimizer.ratio below 1 (Note [a share of the states on the GPU]
// in engine/gpu_offload.cpp): taken on one GPU at stages 1-3 with AdamW;
// the rest refused naming the key and why.
TEST(CudaConfig, PartialOffloadRunsOnOneGpu) {
  ZINC_REQUIRE_GPU();
  auto zero = [](int stage, const char* device, double ratio) {
    return json{{"stage", stage}, {"offload_optimizer", {{"device", device}, {"ratio", ratio}}}};
  };
  for (int stage : {1, 2, 3})
    EXPECT_DOUBLE_EQ(
        Config::parse(with({{"device", "cuda"}, {"zero_optimization", zero(stage, "cpu", 0.3)}})).zero.offload_optimizer.ratio,
        0.3);
  const std::string key = "zero_optimization.offload_optimizer.ratio: ";
  EXPECT_CONFIG_ERROR(with({{"device", "cuda"}, {"zero_optimization", zero(2, "none", 0.3)}}),
                      key + "the offloaded share of the optimizer states, with offload_optimizer.device \"none\"");
  EXPECT_CONFIG_ERROR(with({{"device", "cuda"},
                            {"optimizer", {{"type", "Lamb"}, {"params", {{"lr", 1e-3}}}}},
                            {"zero_optimization", zero(2, "cpu", 0.3)}}),
                      key + "partial offload (ratio < 1) updates its GPU share with the GPU's AdamW",
                      "the optimizer is Lamb");
  try {
    Config::parse(with({{"device", "cuda"}, {"zero_optimization", zero(2, "cpu", 0.3)}}), 2);
    ADD_FAILURE() << "two ranks with ratio 0.3 were taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("runs on one rank (one GPU) in zinc, not yet on 2"), std::string::npos)
        << e.what();
  }
}

TEST(CudaConfig, TheEstimateSplitsRamAndGpu) {
  ZINC_REQUIRE_GPU();
  models::GptConfig g;
  g.vocab_size = 29;
  g.block_size = 16;
  g.n_layer = 2;
  g.n_head = 2;
  g.n_embd = 32;
  auto cpu_model = models::make_gpt(g);
  int64_t padded = 0;
  for (const BlockSpec& b : cpu_model->blocks()) padded += Partition::make(BlockLayout::from_spec(b).numel, 1, 0).padded_numel;
  auto cfg = [&](const char* device, const char* offload, int stage) {
    return Config::parse(json{{"train_micro_batch_size_per_gpu", 4},
                              {"device", device},
                              {"bf16", {{"enabled", true}}},
                              {"zero_optimization", {{"stage", stage}, {"offload_optimizer", {{"device", offload}}}}}});
  };
  const MemoryEstimate cpu = estimate_memory(*cpu_model, cfg("cpu", "cpu", 2), 16);
  const MemoryEstimate off = estimate_memory(*cpu_model, cfg("cuda", "cpu", 2), 16);
  const MemoryEstimate res = estimate_memory(*cpu_model, cfg("cuda", "none", 0), 16);
  EXPECT_TRUE(cpu.gpu.empty());
  auto find = [](const std::vector<MemoryPart>& parts, const std::string& name) -> const MemoryPart* {
    for (const MemoryPart& p : parts)
      if (p.name.find(name) != std::string::npos) return &p;
    return nullptr;
  };
  ASSERT_TRUE(find(cpu.training, "activations"));
  EXPECT_FALSE(find(off.training, "activations"));
  ASSERT_TRUE(find(off.gpu, "activations"));
  EXPECT_EQ(find(off.gpu, "activations")->bytes, find(cpu.training, "activations")->bytes);
  ASSERT_TRUE(find(off.gpu, "parameters"));
  EXPECT_EQ(find(off.gpu, "parameters")->bytes, 2 * padded);
  ASSERT_TRUE(find(off.gpu, "gradient accumulators"));
  EXPECT_EQ(find(off.gpu, "gradient accumulators")->bytes, 4 * padded);
  EXPECT_FALSE(find(off.gpu, "optimizer states"));
  ASSERT_TRUE(find(res.gpu, "optimizer states"));
  EXPECT_EQ(find(res.gpu, "optimizer states")->bytes, 12 * padded);
  ASSERT_TRUE(find(off.training, "gradient staging"));
  EXPECT_EQ(find(off.training, "gradient staging")->bytes, 4 * padded);
  EXPECT_LT(off.ram_bytes(), cpu.ram_bytes());
  // Pipeline stages: the hidden states that cross between them are GPU
  // memory there (they were counted in RAM).
  {
    models::LlamaConfig l;  // an untied head: the GPU path's stages do not share a block
    l.vocab_size = 29;
    l.hidden_size = 32;
    l.intermediate_size = 48;
    l.num_hidden_layers = 2;
    l.num_attention_heads = 2;
    l.num_key_value_heads = 2;
    l.max_position_embeddings = 16;
    const json pc = {{"train_micro_batch_size_per_gpu", 4},
                     {"gradient_accumulation_steps", 4},
                     {"device", "cuda"},
                     {"bf16", {{"enabled", true}}},
                     {"pipeline", {{"stages", 2}}},
                     {"zero_optimization", {{"stage", 1}}}};
    const MemoryEstimate pe = estimate_memory(*models::make_llama(l), Config::parse(pc, 2), 16);
    ASSERT_TRUE(find(pe.gpu, "pipeline transfers")) << "the stages' transfers are GPU memory";
    EXPECT_FALSE(find(pe.training, "pipeline transfers"));
  }
  // A share of the states on the GPU: the prefix of blocks that fits in
  // 1 - ratio of them, 12 B per element.
  Config half = cfg("cuda", "cpu", 2);
  half.zero.offload_optimizer.ratio = 0.5;
  const MemoryEstimate part = estimate_memory(*cpu_model, half, 16);
  std::vector<int64_t> numel;
  for (const BlockSpec& b : cpu_model->blocks())
    numel.push_back(Partition::make(BlockLayout::from_spec(b).numel, 1, 0).padded_numel);
  const std::vector<char> here = gpu_state_blocks(numel, 0.5);
  int64_t share = 0;
  for (size_t b = 0; b < numel.size(); ++b) share += here[b] ? numel[b] : 0;
  ASSERT_GT(share, 0);
  ASSERT_TRUE(find(part.gpu, "optimizer states of the GPU's share (offload_optimizer.ratio 0.5)"));
  EXPECT_EQ(find(part.gpu, "optimizer states of the GPU's share")->bytes, 12 * share);
  ASSERT_TRUE(find(part.training, "gradient staging"));  // the share's gradients never go down
  EXPECT_EQ(find(part.training, "gradient staging")->bytes, 4 * (padded - share));
  EXPECT_GT(part.gpu_bytes(), off.gpu_bytes());
  EXPECT_LT(part.gpu_bytes(), res.gpu_bytes());
}

}  // namespace
}  // namespace zinc
