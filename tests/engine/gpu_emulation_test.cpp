// The GPU path's engine logic (Note [the GPU path] in engine/engine.cpp) on
// the CPU, through ZINC_EMULATE_GPU (core/device.h): the GPT's kernels are the
// CPU's, the "GPU" buffers host memory, the copies memcpy. The uploads, the
// gradient hand-over at accumulation boundaries, GPU-resident states and
// their checkpoints then run exactly as on a GPU, and must give the CPU
// path's results bit for bit where the arithmetic is the same. No CUDA code
// runs here (tests/cuda has the GPU's own tests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "data/data.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/partition.h"
#include "models/models.h"

namespace zinc {
namespace {

class GpuEmulation : public ::testing::Test {
 protected:
  void SetUp() override { setenv("ZINC_EMULATE_GPU", "1", 1); }
  void TearDown() override { unsetenv("ZINC_EMULATE_GPU"); }
};

// The GPT of these tests, on `device`.
models::GptConfig small_gpt(Device device = Device::kCpu, int64_t layers = 2, int64_t width = 32) {
  models::GptConfig g;
  g.vocab_size = 29;
  g.block_size = 16;
  g.n_layer = layers;
  g.n_head = 2;
  g.n_embd = width;
  g.device = device;
  return g;
}

struct TrainRun {
  std::vector<float> losses;
  std::vector<double> norms;
  std::vector<std::vector<float>> weights;  // every block's master weights at the end
  int64_t gpu_peak = 0;                      // Engine::gpu_state_peak_bytes
};

struct Case {
  std::string device = "cpu", precision = "fp32", offload = "cpu";
  std::string offload_param;  // "cpu" or "nvme": stage 3 keeps the parameters there (one rank)
  int64_t max_live = -1;      // stage3_max_live_parameters (-1: the default)
  int layers = 2;
  int stage = 1, gas = 1, steps = 8;  // optimizer offload needs stage >= 1
  double clipping = 1.0;
  std::string ckpt_dir;  // with resume_at: save there at that step and continue in a new engine
  int resume_at = -1;
};

TrainRun train(const Case& c) {
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                        {"gradient_accumulation_steps", c.gas},
                        {"gradient_clipping", c.clipping},
                        {"device", c.device},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"weight_decay", 0.01}}}}},
                        {"zero_optimization",
                         {{"stage", c.stage},
                          {"sub_group_size", 4096},
                          {"offload_optimizer",
                           {{"device", c.offload}, {"nvme_path", std::filesystem::temp_directory_path().string()}}}}}};
  if (!c.offload_param.empty())
    cfg["zero_optimization"]["offload_param"] = {{"device", c.offload_param},
                                                 {"nvme_path", std::filesystem::temp_directory_path().string()}};
  if (c.max_live >= 0) {
    cfg["zero_optimization"]["stage3_max_live_parameters"] = c.max_live;
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
  }
  if (c.precision == "bf16") cfg["bf16"] = {{"enabled", true}};
  if (c.precision == "fp16") cfg["fp16"] = {{"enabled", true}};
  const models::GptConfig g = small_gpt(c.device == "cuda" ? Device::kCuda : Device::kCpu, c.layers);
  std::shared_ptr<Model> model = models::make_gpt(g);
  Engine e = Engine::initialize(model, cfg);
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  dc.determinism = 0.9;
  DataLoader loader(make_data_source(dc), 4, c.gas, 1, 0, 7);
  TrainRun r;
  for (int s = 0; s < c.steps; ++s) {
    if (s == c.resume_at) {
      e.save_checkpoint(c.ckpt_dir, "t");
      std::shared_ptr<Model> m2 = models::make_gpt(g);
      Engine e2 = Engine::initialize(m2, cfg);
      e2.load_checkpoint(c.ckpt_dir, "t");
      e = std::move(e2);
      model = m2;
    }
    r.losses.push_back(e.train_batch(loader));
    r.norms.push_back(e.global_grad_norm());
  }
  for (size_t b = 0; b < model->blocks().size(); ++b) r.weights.push_back(e.full_params(static_cast<int>(b)));
  r.gpu_peak = e.gpu_state_peak_bytes();
  return r;
}

void expect_same(const TrainRun& a, const TrainRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << " loss at step " << i;
  ASSERT_EQ(a.weights.size(), b.weights.size()) << what;
  for (size_t k = 0; k < a.weights.size(); ++k)
    EXPECT_EQ(0, std::memcmp(a.weights[k].data(), b.weights[k].data(), a.weights[k].size() * 4))
        << what << " block " << k;
}

// ZeRO-Offload through the GPU path's engine logic equals the CPU path: the
// gradients come back at the boundary, the CPU update runs, every block goes
// up again. With the states on NVMe the swapper streams them under the update.
TEST_F(GpuEmulation, ZeroOffloadToNvmeEqualsTheCpuPathBitForBit) {
  for (const char* prec : {"fp32", "bf16"})
    for (int stage : {2, 3}) {
      Case cpu;
      cpu.precision = prec;
      cpu.stage = stage;
      cpu.gas = 2;
      cpu.steps = 4;
      cpu.offload = "nvme";
      if (stage == 3) cpu.offload_param = "nvme";
      Case gpu = cpu;
      gpu.device = "cuda";
      expect_same(train(cpu), train(gpu), std::string(prec) + " stage " + std::to_string(stage) + " on NVMe");
    }
}

TEST_F(GpuEmulation, ZeroOffloadEqualsTheCpuPathBitForBit) {
  for (const char* prec : {"fp32", "bf16", "fp16"})
    for (int stage : {1, 2})
      for (int gas : {1, 3}) {
        Case cpu;
        cpu.precision = prec;
        cpu.stage = stage;
        cpu.gas = gas;
        Case gpu = cpu;
        gpu.device = "cuda";
        expect_same(train(cpu), train(gpu),
                    std::string(prec) + " stage " + std::to_string(stage) + " gas " + std::to_string(gas));
      }
}

// Stage 3 on one rank with the parameters offloaded (to page-locked RAM or
// NVMe): each block is read into RAM, uploaded at its acquire and dropped
// from the "GPU" when the coordinator frees it. ZeRO-Offload copies the
// gradients out at the boundary and frees them there; GPU-resident states
// update on the "GPU" and send each new compute shard down to the host,
// where the coordinator gathers it (without clipping, whose norm the GPU
// sums in another order: the CPU path's bits). Same weights as the CPU
// path, and with stage3_max_live_parameters holding about one block the
// GPU holds far less than the whole model's parameters and accumulators.
TEST_F(GpuEmulation, Stage3EqualsTheCpuPathBitForBit) {
  for (const char* states : {"cpu", "none"})
    for (const char* where : {"cpu", "nvme"})
      for (const char* prec : {"fp32", "bf16"})
        for (int gas : {1, 2}) {
          Case cpu;
          cpu.precision = prec;
          cpu.stage = 3;
          cpu.gas = gas;
          cpu.steps = 5;
          cpu.offload = states;
          cpu.clipping = std::string(states) == "none" ? 0.0 : 1.0;
          cpu.offload_param = where;
          cpu.max_live = 1;  // one block at a time
          cpu.layers = 6;
          Case gpu = cpu;
          gpu.device = "cuda";
          const TrainRun a = train(cpu), b = train(gpu);
          const std::string what =
              std::string("states ") + states + ", parameters " + where + " " + prec + " gas " + std::to_string(gas);
          expect_same(a, b, what);
          EXPECT_EQ(a.gpu_peak, 0) << what;
          int64_t padded = 0, largest = 0;
          for (const BlockSpec& spec : models::make_gpt(small_gpt(Device::kCpu, cpu.layers))->blocks()) {
            const int64_t n = Partition::make(BlockLayout::from_spec(spec).numel, 1, 0).padded_numel;
            padded += n;
            largest = std::max(largest, n);
          }
          const int64_t es = std::string(prec) == "bf16" ? 2 : 4;
          // Parameters: about one block (plus the one being uploaded while
          // the last is read). Gradients: with one micro-batch per step and
          // states on the host only the blocks between backward and their
          // copy; otherwise all of them (no-sync keeps them, as on the host;
          // GPU-resident states read them in the step). States: 12 B each.
          const bool resident = std::string(states) == "none";
          const int64_t params_most = 2 * es * largest;
          const int64_t grads_most = gas == 1 && !resident ? 2 * 4 * largest : 4 * padded;
          const int64_t states_bytes = resident ? 12 * padded : 0;
          EXPECT_LE(b.gpu_peak, params_most + grads_most + states_bytes) << what;
          EXPECT_LT(b.gpu_peak, (es + 4) * padded + states_bytes) << what << ": the whole model's parameters and gradients";
        }
}

// GPU-resident states: the gradients stay on the "GPU", the norm is summed
// there (kernels::squared_norm's order), the update writes the compute
// parameters in place. Without clipping the norm does not enter the update:
// the CPU path's bits. With clipping: the CPU path's result up to the norm's
// summation order.
TEST_F(GpuEmulation, GpuResidentStatesEqualTheCpuPath) {
  for (const char* prec : {"fp32", "bf16"})
    for (int gas : {1, 2}) {
      Case cpu;
      cpu.precision = prec;
      cpu.gas = gas;
      cpu.offload = "none";
      cpu.clipping = 0.0;
      Case gpu = cpu;
      gpu.device = "cuda";
      expect_same(train(cpu), train(gpu), std::string(prec) + " gas " + std::to_string(gas) + " no clipping");
      cpu.clipping = gpu.clipping = 0.05;  // clips every step
      const TrainRun a = train(cpu), b = train(gpu);
      for (size_t i = 0; i < a.norms.size(); ++i) EXPECT_NEAR(a.norms[i], b.norms[i], 1e-9 * a.norms[i]);
      for (size_t k = 0; k < a.weights.size(); ++k)
        for (size_t i = 0; i < a.weights[k].size(); ++i)
          ASSERT_NEAR(a.weights[k][i], b.weights[k][i], 1e-6 + 1e-5 * std::fabs(a.weights[k][i]));
    }
}

// A checkpoint of GPU-resident states, and of the ZeRO-Offload path, resumes
// bit for bit (the host copy is refreshed before the save and the states go
// back up after the load).
TEST_F(GpuEmulation, CheckpointsResumeBitForBit) {
  const std::string dir = (std::filesystem::temp_directory_path() / "zinc_gpu_emulation_ckpt").string();
  for (int stage : {1, 3})
    for (const char* offload : {"none", "cpu"}) {
      std::filesystem::remove_all(dir);
      Case straight;
      straight.device = "cuda";
      straight.precision = "bf16";
      straight.offload = offload;
      straight.stage = stage;
      if (stage == 3) straight.offload_param = "cpu";
      straight.steps = 10;
      Case resumed = straight;
      resumed.ckpt_dir = dir;
      resumed.resume_at = 5;
      expect_same(train(straight), train(resumed),
                  std::string("resume, stage ") + std::to_string(stage) + ", offload " + offload);
    }
  std::filesystem::remove_all(dir);
}

TEST_F(GpuEmulation, TheConfigSaysItIsEmulated) {
  const Config c = Config::parse(nlohmann::json{{"train_micro_batch_size_per_gpu", 2}, {"device", "cuda"}});
  EXPECT_EQ(c.device, Device::kCuda);
  bool said = false;
  for (const std::string& w : c.warnings) said |= w.find("emulated on the CPU") != std::string::npos;
  EXPECT_TRUE(said);
}

// "auto" takes the GPU where the GPU path covers the config, and otherwise
// stays on the CPU saying why; an explicit "cuda" is then an error.
TEST_F(GpuEmulation, AutoFallsBackToTheCpuWhereTheGpuPathDoesNotReach) {
  auto parse = [](const nlohmann::json& zero, const char* device) {
    return Config::parse(nlohmann::json{{"train_micro_batch_size_per_gpu", 2}, {"device", device}, {"zero_optimization", zero}});
  };
  EXPECT_EQ(parse({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}, "auto").device, Device::kCuda);
  EXPECT_EQ(parse({{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}}, "auto").device, Device::kCuda);
  EXPECT_EQ(parse({{"stage", 3}}, "auto").device, Device::kCuda);
  auto lamb = [](const char* device) {
    return Config::parse(nlohmann::json{{"train_micro_batch_size_per_gpu", 2},
                                        {"device", device},
                                        {"optimizer", {{"type", "Lamb"}}},
                                        {"zero_optimization", {{"stage", 1}}}});
  };
  const Config c = lamb("auto");  // Lamb over GPU-resident states: not on the GPU
  EXPECT_EQ(c.device, Device::kCpu);
  bool said = false;
  for (const std::string& w : c.warnings) said |= w.find("\"auto\" stays on the CPU") != std::string::npos;
  EXPECT_TRUE(said);
  try {
    lamb("cuda");
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.type"), std::string::npos) << e.what();
  }
}

TEST_F(GpuEmulation, ModelAndConfigMustAgreeOnTheDevice) {
  models::GptConfig g;
  g.device = Device::kCuda;
  try {
    Engine::initialize(models::make_gpt(g), nlohmann::json{{"train_micro_batch_size_per_gpu", 2}});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("device"), std::string::npos) << m;
    EXPECT_NE(m.find("computes on cuda"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace zinc

#include "engine/memory_estimate.h"
#include "engine/partition.h"

namespace zinc {
namespace {
// --estimate with "device": "cuda": the activations move to the GPU's part,
// which holds every block's compute parameters and fp32 accumulators (and
// with GPU-resident states master, m and v); the host keeps the staging.
TEST_F(GpuEmulation, TheEstimateSplitsRamAndGpu) {
  auto cpu_model = models::make_gpt(small_gpt());
  int64_t padded = 0;
  for (const BlockSpec& b : cpu_model->blocks()) padded += Partition::make(BlockLayout::from_spec(b).numel, 1, 0).padded_numel;
  auto cfg = [&](const char* device, const char* offload, int stage) {
    return Config::parse(nlohmann::json{{"train_micro_batch_size_per_gpu", 4},
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
  EXPECT_EQ(find(off.gpu, "parameters")->bytes, 2 * padded);
  EXPECT_EQ(find(off.gpu, "gradient accumulators")->bytes, 4 * padded);
  EXPECT_FALSE(find(off.gpu, "optimizer states"));
  EXPECT_EQ(find(res.gpu, "optimizer states")->bytes, 12 * padded);
  EXPECT_EQ(find(off.training, "gradient staging")->bytes, 4 * padded);
  EXPECT_LT(off.ram_bytes(), cpu.ram_bytes());
}
}  // namespace
}  // namespace zinc

namespace zinc {
namespace {
// Checkpoint edges found reviewing the GPU path; they hold on every path.
// A checkpoint saved right after an overflow-skipped fp16 step (its gradient
// norm is not finite, saved as null) loads.
TEST(CheckpointEdges, SavedAfterAnOverflowSkippedStepLoads) {
  const std::string dir = (std::filesystem::temp_directory_path() / "zinc_ckpt_overflow").string();
  std::filesystem::remove_all(dir);
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 4},
                        {"fp16", {{"enabled", true}, {"initial_scale_power", 40}, {"hysteresis", 1}}}};
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  Engine e = Engine::initialize(models::make_gpt(g), cfg);
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  DataLoader loader(make_data_source(dc), 4, 1, 1, 0, 7);
  e.train_batch(loader);
  ASSERT_EQ(e.skipped_steps(), 1);
  ASSERT_FALSE(std::isfinite(e.global_grad_norm()));
  e.save_checkpoint(dir, "t");
  Engine e2 = Engine::initialize(models::make_gpt(g), cfg);
  e2.load_checkpoint(dir, "t");
  EXPECT_EQ(e2.skipped_steps(), 1);
  EXPECT_TRUE(std::isnan(e2.global_grad_norm()));
  EXPECT_EQ(e2.loss_scale(), e.loss_scale());
  std::filesystem::remove_all(dir);
}

// After a boundary backward whose step() has not run, saving or loading a
// checkpoint is refused (its gradients and losses belong to that step).
TEST(CheckpointEdges, RefusedBetweenABoundaryBackwardAndItsStep) {
  const std::string dir = (std::filesystem::temp_directory_path() / "zinc_ckpt_pending").string();
  std::filesystem::remove_all(dir);
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  Engine e = Engine::initialize(models::make_gpt(g), nlohmann::json{{"train_micro_batch_size_per_gpu", 4}});
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  DataLoader loader(make_data_source(dc), 4, 1, 1, 0, 7);
  e.train_batch(loader);
  e.save_checkpoint(dir, "ok");  // between global batches: fine
  e.forward(loader.next());
  e.backward();
  for (auto* call : {+[](Engine& en, const std::string& d) { en.save_checkpoint(d, "t"); },
                     +[](Engine& en, const std::string& d) { en.load_checkpoint(d, "ok"); }}) {
    try {
      call(e, dir);
      ADD_FAILURE() << "expected an error";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find("after step()"), std::string::npos) << err.what();
    }
  }
  e.step();
  e.load_checkpoint(dir, "ok");  // and fine again after the step
  std::filesystem::remove_all(dir);
}

// The next micro-batch after a boundary backward needs that step() first
// (its reductions may be in flight, its losses belong to it); inside an
// accumulation, step() is optional and does nothing.
TEST(EngineStepOrder, AMicroBatchAfterABoundaryBackwardNeedsItsStep) {
  const models::GptConfig g = small_gpt(Device::kCpu, 1, 16);
  Engine e = Engine::initialize(models::make_gpt(g),
                                nlohmann::json{{"train_micro_batch_size_per_gpu", 4}, {"gradient_accumulation_steps", 2}});
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  DataLoader loader(make_data_source(dc), 4, 2, 1, 0, 7);
  e.forward(loader.next());
  e.backward();  // inside the accumulation: no step needed
  e.forward(loader.next());
  e.backward();  // the boundary
  try {
    e.forward(loader.next());
    ADD_FAILURE() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("has not been stepped"), std::string::npos) << err.what();
  }
  e.step();
  EXPECT_EQ(e.global_steps(), 1);
  e.forward(loader.next());
  e.backward();
  e.step();  // inside the accumulation: nothing
  EXPECT_EQ(e.global_steps(), 1);
}
}  // namespace
}  // namespace zinc
