// The engine's GPU path (Note [the GPU path] in engine/engine.cpp) on one
// GPU, configuration by configuration: ZeRO-Offload with the optimizer
// states in RAM or on NVMe, GPU-resident states, stage 3 with the
// parameters offloaded, accumulation, checkpoints. Skipped without a GPU;
// kernel emulation (tests/cuda_emu) runs it on every CI machine.
//
// Two kinds of check:
// - GPU against GPU, bit for bit: two configurations that must do the same
//   arithmetic on the same values (stage 2 and stage 3, states in RAM and on
//   NVMe, ZeRO-Offload and GPU-resident states without clipping, a run and
//   its resumed twin). What differs between them is only the engine's
//   orchestration (uploads, drops, gradient hand-over at the boundary, the
//   swapper, checkpoints), so any slip in it shows as a bit.
// - GPU against CPU, within the tolerance of tests/cuda/cuda_engine_test.cpp:
//   the GPU's matmuls and layer kernels sum in another order than the CPU's
//   (oneDNN; under kernel emulation the stand-in cuBLAS sums in k order), so
//   the paths part by rounding only. fp32: every loss within 1e-3 relative
//   and the weights within 1e-3 relative RMS (CudaEngine.Fp32TrainsLikeTheCpu).
//   16-bit: every loss within 0.05 nats (CudaEngine.Bf16AndFp16TrainToTheCpuLoss's
//   bound, here per step) and the weights within 1e-2 relative RMS.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "data/data.h"
#include "engine/engine.h"
#include "engine/gpu_offload.h"
#include "engine/model.h"
#include "engine/partition.h"
#include "models/models.h"
#include "optim/optim.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc {
namespace {

// The GPT of these tests, on `device`.
models::GptConfig small_gpt(Device device, int64_t layers = 2) {
  models::GptConfig g;
  g.vocab_size = 29;
  g.block_size = 16;
  g.n_layer = layers;
  g.n_head = 2;
  g.n_embd = 32;
  g.device = device;
  return g;
}

struct PathRun {
  std::vector<float> losses;
  std::vector<double> norms;
  std::vector<std::vector<float>> weights;  // every block's master weights at the end
  int64_t gpu_peak = 0;                      // Engine::gpu_state_peak_bytes
  std::vector<float> evals;                  // Case::evaluate: the held-out loss after each step
  double behind_s = 0;                       // StepTimings::update_behind_s
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
  double ratio = 1.0;     // offload_optimizer.ratio: below 1, a share of the states on the GPU
  double resume_ratio = -1;  // with resume_at: the resumed engine's ratio (-1: the same)
  bool behind = true;     // the update may run behind the next forward (ZINC_GPU_UPDATE_BEHIND)
  bool evaluate = false;  // an evaluation after each step, and forward/backward/step by hand
  std::string what() const {
    std::string w = device + " " + precision + " stage " + std::to_string(stage) + " gas " + std::to_string(gas) +
                    " states " + offload;
    if (!offload_param.empty()) w += " parameters " + offload_param;
    if (clipping == 0) w += " no clipping";
    if (ratio < 1) w += " ratio " + std::to_string(ratio).substr(0, 4);
    return w;
  }
};

PathRun train(const Case& c) {
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
  if (c.ratio < 1) cfg["zero_optimization"]["offload_optimizer"]["ratio"] = c.ratio;
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
  // Read when an engine's GPU path starts (Note [the update behind the forward]).
  if (c.behind) unsetenv("ZINC_GPU_UPDATE_BEHIND");
  else setenv("ZINC_GPU_UPDATE_BEHIND", "0", 1);
  Engine e = Engine::initialize(model, cfg);
  DataConfig dc;
  dc.vocab_size = 29;
  dc.seq_len = 16;
  dc.determinism = 0.9;
  DataLoader loader(make_data_source(dc), 4, c.gas, 1, 0, 7);
  Batch held_out;
  if (c.evaluate) held_out = DataLoader(make_eval_data_source(dc), 4, 1, 1, 0, 99).next();
  PathRun r;
  for (int s = 0; s < c.steps; ++s) {
    if (s == c.resume_at) {
      e.save_checkpoint(c.ckpt_dir, "t");
      std::shared_ptr<Model> m2 = models::make_gpt(g);
      nlohmann::json cfg2 = cfg;
      if (c.resume_ratio >= 0) cfg2["zero_optimization"]["offload_optimizer"]["ratio"] = c.resume_ratio;
      Engine e2 = Engine::initialize(m2, cfg2);
      e2.load_checkpoint(c.ckpt_dir, "t");
      e = std::move(e2);
      model = m2;
    }
    if (!c.evaluate) {
      r.losses.push_back(e.train_batch(loader));
    } else {
      for (int m = 0; m < c.gas; ++m) {
        r.losses.push_back(e.forward(loader.next()));
        e.backward();
        e.step();
      }
      r.evals.push_back(e.evaluate(held_out));
    }
    r.norms.push_back(e.global_grad_norm());
  }
  for (size_t b = 0; b < model->blocks().size(); ++b) r.weights.push_back(e.full_params(static_cast<int>(b)));
  r.gpu_peak = e.gpu_state_peak_bytes();
  r.behind_s = e.timings().update_behind_s;
  unsetenv("ZINC_GPU_UPDATE_BEHIND");
  return r;
}

Case on_gpu(Case c) {
  c.device = "cuda";
  return c;
}

// The same losses and weights, bit for bit.
void expect_same(const PathRun& a, const PathRun& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t i = 0; i < a.losses.size(); ++i) EXPECT_EQ(a.losses[i], b.losses[i]) << what << " loss at step " << i;
  ASSERT_EQ(a.evals.size(), b.evals.size()) << what;
  for (size_t i = 0; i < a.evals.size(); ++i) EXPECT_EQ(a.evals[i], b.evals[i]) << what << " evaluation " << i;
  ASSERT_EQ(a.weights.size(), b.weights.size()) << what;
  for (size_t k = 0; k < a.weights.size(); ++k) {
    ASSERT_EQ(a.weights[k].size(), b.weights[k].size()) << what << " block " << k;
    EXPECT_EQ(0, std::memcmp(a.weights[k].data(), b.weights[k].data(), a.weights[k].size() * 4))
        << what << " block " << k;
  }
}

// The GPU run against the CPU run of the same case, within the tolerance of
// the file's Note.
void expect_like_cpu(const PathRun& cpu, const PathRun& gpu, const std::string& precision, const std::string& what) {
  const bool wide = precision == "fp32";
  ASSERT_EQ(cpu.losses.size(), gpu.losses.size()) << what;
  double worst_loss = 0;
  for (size_t i = 0; i < cpu.losses.size(); ++i) {
    const double d = std::fabs(cpu.losses[i] - gpu.losses[i]);
    worst_loss = std::max(worst_loss, wide ? d / std::fabs(cpu.losses[i]) : d);
    if (wide)
      EXPECT_NEAR(cpu.losses[i], gpu.losses[i], 1e-3 * std::fabs(cpu.losses[i])) << what << " loss at step " << i;
    else
      EXPECT_NEAR(cpu.losses[i], gpu.losses[i], 0.05) << what << " loss at step " << i;
  }
  ASSERT_EQ(cpu.weights.size(), gpu.weights.size()) << what;
  double diff = 0, norm = 0;
  for (size_t k = 0; k < cpu.weights.size(); ++k) {
    ASSERT_EQ(cpu.weights[k].size(), gpu.weights[k].size()) << what << " block " << k;
    for (size_t i = 0; i < cpu.weights[k].size(); ++i) {
      const double d = cpu.weights[k][i] - gpu.weights[k][i];
      diff += d * d;
      norm += static_cast<double>(cpu.weights[k][i]) * cpu.weights[k][i];
    }
  }
  const double rel = std::sqrt(diff / norm);
  EXPECT_LT(rel, wide ? 1e-3 : 1e-2) << what << ": weights, relative RMS";
  if (std::getenv("ZINC_TEST_PRINT_DIFFS"))
    std::printf("GPU against CPU, %s: losses %.3g (%s), weights %.3g relative RMS\n", what.c_str(), worst_loss,
                wide ? "relative" : "nats", rel);
}

bool cpu_adam_has_fma_path() { return optim::detect_isa() != optim::Isa::kScalar; }

// ZeRO-Offload with the states on NVMe: the swapper streams them under the
// CPU update between the gradients' download and the uploads. The same bits
// as with the states in RAM, and the CPU path's result.
TEST(CudaEnginePath, ZeroOffloadToNvmeEqualsRamAndTrainsLikeTheCpu) {
  ZINC_REQUIRE_GPU();
  for (const char* prec : {"fp32", "bf16"})
    for (int stage : {2, 3}) {
      Case nvme;
      nvme.precision = prec;
      nvme.stage = stage;
      nvme.gas = 2;
      nvme.steps = 4;
      nvme.offload = "nvme";
      if (stage == 3) nvme.offload_param = "nvme";
      Case ram = nvme;
      ram.offload = "cpu";
      if (stage == 3) ram.offload_param = "cpu";
      const PathRun gpu = train(on_gpu(nvme));
      expect_same(gpu, train(on_gpu(ram)), on_gpu(nvme).what() + " against RAM");
      expect_like_cpu(train(nvme), gpu, prec, on_gpu(nvme).what());
    }
}

// Note [the update behind the forward] (engine/gpu_offload.cpp): the CPU
// update runs on a thread of its own while the next forward goes on, each
// block's forward waiting for that block's update. The same bits as the
// update run in place, whatever comes next: a forward (gas 1 and 2), an
// evaluation, a checkpoint and the resumed engine, the states on NVMe, fp16's
// skipped steps, full_params at the end; and the update did run behind.
TEST(CudaEnginePath, TheUpdateBehindTheForwardKeepsTheBits) {
  ZINC_REQUIRE_GPU();
  const std::string dir = (std::filesystem::temp_directory_path() / "zinc_behind_ckpt").string();
  std::vector<Case> cases;
  for (const char* prec : {"fp32", "bf16", "fp16"})
    for (int stage : {1, 2}) {
      Case c;
      c.precision = prec;
      c.stage = stage;
      c.gas = stage;  // 1 and 2
      c.steps = 5;
      c.layers = 3;
      cases.push_back(c);
    }
  Case eval;
  eval.precision = "bf16";
  eval.stage = 2;
  eval.evaluate = true;
  eval.steps = 4;
  cases.push_back(eval);
  Case nvme = eval;
  nvme.evaluate = false;
  nvme.offload = "nvme";
  nvme.gas = 2;
  cases.push_back(nvme);
  Case resumed;
  resumed.precision = "bf16";
  resumed.stage = 2;
  resumed.steps = 6;
  resumed.resume_at = 3;
  resumed.ckpt_dir = dir;
  cases.push_back(resumed);
  for (const Case& c : cases) {
    Case in_place = c;
    in_place.behind = false;
    const PathRun behind = train(on_gpu(c));
    std::filesystem::remove_all(dir);
    const PathRun direct = train(on_gpu(in_place));
    std::filesystem::remove_all(dir);
    const std::string what = on_gpu(c).what() + (c.evaluate ? " with evaluations" : "") +
                             (c.resume_at >= 0 ? " resumed" : "");
    expect_same(behind, direct, what + ", behind against in place");
    EXPECT_GT(behind.behind_s, 0) << what << ": the update never ran behind";
    EXPECT_EQ(direct.behind_s, 0) << what << ": ZINC_GPU_UPDATE_BEHIND=0 ran it behind";
  }
}

// Note [a share of the states on the GPU] (engine/gpu_offload.cpp):
// offload_optimizer.ratio 0.5 keeps the first blocks' states on the GPU:
// the weights of ratio 1 and of the states wholly on the GPU, bit for bit,
// clipped or not; and the GPU holds the share's states (more GPU memory
// than ratio 1, less than all).
// A checkpoint of it resumes bit for bit, also at other ratios (the
// checkpoint does not depend on where the states lived).
TEST(CudaEnginePath, AShareOfTheStatesOnTheGpuKeepsTheBits) {
  ZINC_REQUIRE_GPU();
  if (!cpu_adam_has_fma_path()) GTEST_SKIP() << "the CPU AdamW has no FMA path here";
  for (const char* prec : {"fp32", "bf16"})
    for (int stage : {1, 2}) {
      Case c;
      c.precision = prec;
      c.stage = stage;
      c.gas = stage;
      c.layers = 4;
      c.steps = 5;
      for (double clipping : {0.0, 0.05}) {
        c.clipping = clipping;
        Case half = c, none = c;
        half.ratio = 0.5;
        none.offload = "none";
        const PathRun h = train(on_gpu(half)), off = train(on_gpu(c)), res = train(on_gpu(none));
        const std::string what = on_gpu(half).what();
        EXPECT_GT(h.gpu_peak, off.gpu_peak) << what << ": the share's states are not on the GPU";
        EXPECT_LT(h.gpu_peak, res.gpu_peak) << what << ": more than the share on the GPU";
        expect_same(h, off, what + " against ratio 1");
        expect_same(h, res, what + " against the states on the GPU");
      }
    }
  // Stage 3 (parameters in page-locked RAM or on NVMe): the GPU's update
  // writes its blocks' host shards, which the gathers upload; the bits of
  // ratio 1 and of stage 2 at ratio 0.5.
  for (const char* param : {"cpu", "nvme"}) {
    Case c;
    c.precision = "bf16";
    c.stage = 3;
    c.offload_param = param;
    c.layers = 4;
    c.steps = 4;
    c.gas = 2;
    Case half = c, two = c;
    half.ratio = 0.5;
    two.ratio = 0.5;
    two.stage = 2;
    two.offload_param.clear();
    const PathRun h = train(on_gpu(half));
    expect_same(h, train(on_gpu(c)), on_gpu(half).what() + " against ratio 1");
    expect_same(h, train(on_gpu(two)), on_gpu(half).what() + " against stage 2");
  }
  char tmpl[] = "/tmp/zinc_cuda_ratio_ckpt_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  Case straight;
  straight.precision = "bf16";
  straight.stage = 2;
  straight.ratio = 0.5;
  straight.steps = 6;
  Case resumed = straight;
  resumed.ckpt_dir = dir;
  resumed.resume_at = 3;
  const PathRun whole = train(on_gpu(straight));
  expect_same(whole, train(on_gpu(resumed)), "resume, " + on_gpu(straight).what());
  // Where the states lived is not in the checkpoint: it resumes at another
  // ratio.
  for (double other : {1.0, 0.2}) {
    std::filesystem::remove_all(dir);
    resumed.resume_ratio = other;
    expect_same(whole, train(on_gpu(resumed)),
                "resume at ratio " + std::to_string(other).substr(0, 4) + ", " + on_gpu(straight).what());
  }
  std::filesystem::remove_all(dir);
}

// Which blocks keep their states on the GPU: the longest prefix within the
// share, frozen blocks passed over.
TEST(CudaEnginePath, TheGpuShareIsThePrefixThatFits) {
  EXPECT_EQ(gpu_state_blocks({10, 10, 10, 10}, 1.0), (std::vector<char>{0, 0, 0, 0}));
  EXPECT_EQ(gpu_state_blocks({10, 10, 10, 10}, 0.5), (std::vector<char>{1, 1, 0, 0}));
  EXPECT_EQ(gpu_state_blocks({10, 10, 10, 10}, 0.51), (std::vector<char>{1, 0, 0, 0}));
  EXPECT_EQ(gpu_state_blocks({10, 10, 10, 10}, 0.01), (std::vector<char>{1, 1, 1, 0}));
  EXPECT_EQ(gpu_state_blocks({30, 5, 5}, 0.5), (std::vector<char>{0, 0, 0}));  // the first does not fit: a prefix
  EXPECT_EQ(gpu_state_blocks({10, 0, 10, 20}, 0.5), (std::vector<char>{1, 0, 1, 0}));  // frozen: no states
}

// ZeRO-Offload (stages 1 and 2): the gradients come back at the boundary,
// the CPU update runs, every block goes up again. Stage 2 frees the GPU's
// gradient accumulators at each boundary, stage 1 zeroes them: the same bits.
TEST(CudaEnginePath, ZeroOffloadStagesAgreeBitForBitAndTrainLikeTheCpu) {
  ZINC_REQUIRE_GPU();
  for (const char* prec : {"fp32", "bf16", "fp16"})
    for (int gas : {1, 3}) {
      Case c;
      c.precision = prec;
      c.gas = gas;
      std::vector<PathRun> gpu;
      for (int stage : {1, 2}) {
        c.stage = stage;
        gpu.push_back(train(on_gpu(c)));
        expect_like_cpu(train(c), gpu.back(), prec, on_gpu(c).what());
      }
      expect_same(gpu[0], gpu[1], on_gpu(c).what() + " against stage 1");
    }
}

// Stage 3 on one rank with the parameters offloaded (to page-locked RAM or
// NVMe) and stage3_max_live_parameters holding about one block: each block
// is read into RAM, uploaded at its acquire and dropped from the GPU when
// the coordinator frees it. ZeRO-Offload copies the gradients out at the
// boundary and frees them there; GPU-resident states update on the GPU and
// send each new compute shard down to the host, where the coordinator
// gathers it (without clipping, whose norm the GPU sums in another order).
// The same bits as stage 2 (every block on the GPU throughout), the CPU
// path's result, and the GPU holds far less than the whole model's
// parameters and accumulators.
TEST(CudaEnginePath, Stage3EqualsStage2BitForBitAndHoldsAboutOneBlock) {
  ZINC_REQUIRE_GPU();
  for (const char* states : {"cpu", "none"})
    for (const char* prec : {"fp32", "bf16"})
      for (int gas : {1, 2}) {
        Case c;
        c.precision = prec;
        c.gas = gas;
        c.steps = 5;
        c.offload = states;
        c.clipping = std::string(states) == "none" ? 0.0 : 1.0;
        c.layers = 6;
        c.stage = 2;
        const PathRun s2 = train(on_gpu(c));
        for (const char* where : {"cpu", "nvme"}) {
          c.stage = 3;
          c.offload_param = where;
          c.max_live = 1;  // one block at a time
          const std::string what = on_gpu(c).what();
          const PathRun cpu = train(c), gpu = train(on_gpu(c));
          expect_same(s2, gpu, what + " against stage 2");
          expect_like_cpu(cpu, gpu, prec, what);
          EXPECT_EQ(cpu.gpu_peak, 0) << what;
          int64_t padded = 0, largest = 0;
          for (const BlockSpec& spec : models::make_gpt(small_gpt(Device::kCpu, c.layers))->blocks()) {
            const int64_t n = Partition::make(BlockLayout::from_spec(spec).numel, 1, 0).padded_numel;
            padded += n;
            largest = std::max(largest, n);
          }
          const int64_t es = std::string(prec) == "bf16" ? 2 : 4;
          // Parameters: about one block (plus the one being uploaded while
          // the last is read). Gradients: with one micro-batch per step and
          // states on the host only the blocks between backward and their
          // copy; otherwise all of them (no-sync keeps them, as on the host;
          // GPU-resident states read them in the step). States: 12 B each,
          // with the CUDA mirror's two small buffers beside them: a norm
          // (8 B) per block and, in 16 bits, one block's new compute values
          // on their way to the host shard.
          const bool resident = std::string(states) == "none";
          const int64_t params_most = 2 * es * largest;
          const int64_t grads_most = gas == 1 && !resident ? 2 * 4 * largest : 4 * padded;
          const int64_t blocks = static_cast<int64_t>(s2.weights.size());
          const int64_t states_bytes = resident ? 12 * padded + 8 * blocks + (es == 2 ? es * largest : 0) : 0;
          EXPECT_GT(gpu.gpu_peak, 0) << what;
          EXPECT_LE(gpu.gpu_peak, params_most + grads_most + states_bytes) << what;
          EXPECT_LT(gpu.gpu_peak, (es + 4) * padded + states_bytes)
              << what << ": the whole model's parameters and gradients";
          EXPECT_LT(gpu.gpu_peak, s2.gpu_peak) << what;
        }
      }
}

// GPU-resident states: the gradients stay on the GPU, the norm is summed
// there, the update (adam_step_cuda) writes the compute parameters in
// place: ZeRO-Offload's bits (the CPU AdamW, the same arithmetic in the same
// roundings: optim/detail/adam_update.h), clipped or not, since
// ZeRO-Offload on one rank takes the same norm on the GPU (Note [the norm
// on the GPU] in engine/gpu_offload.cpp). Both train like the CPU path.
TEST(CudaEnginePath, GpuResidentStatesEqualZeroOffloadAndTrainLikeTheCpu) {
  ZINC_REQUIRE_GPU();
  for (const char* prec : {"fp32", "bf16"})
    for (int gas : {1, 2}) {
      Case c;
      c.precision = prec;
      c.gas = gas;
      c.offload = "none";
      for (double clipping : {0.0, 0.05}) {  // 0.05 clips every step
        c.clipping = clipping;
        Case off = c;
        off.offload = "cpu";
        const PathRun res = train(on_gpu(c)), host = train(on_gpu(off));
        const std::string what = on_gpu(c).what();
        expect_like_cpu(train(c), res, prec, what);
        if (!cpu_adam_has_fma_path()) continue;  // the CPU AdamW rounds otherwise
        // Clipped too: both norms are the GPU's (Note [the norm on the GPU]).
        expect_same(host, res, what + " against ZeRO-Offload");
        for (size_t i = 0; i < res.norms.size(); ++i) EXPECT_EQ(res.norms[i], host.norms[i]) << what << " norm " << i;
      }
    }
}

// A checkpoint of GPU-resident states, and of the ZeRO-Offload path, at
// stages 1 and 3 resumes bit for bit (the host copy is refreshed before the
// save and the states go back up after the load).
TEST(CudaEnginePath, CheckpointsResumeBitForBit) {
  ZINC_REQUIRE_GPU();
  char tmpl[] = "/tmp/zinc_cuda_path_ckpt_XXXXXX";
  const std::string dir = mkdtemp(tmpl);
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
      expect_same(train(straight), train(resumed), "resume, " + straight.what());
    }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace zinc
