// The GPU path on several ranks (Note [the GPU path] in engine/engine.cpp):
// gradients reduced and parameters gathered over NCCL between the GPUs,
// against the CPU path on the same ranks, at every ZeRO stage, with the
// optimizer states on the GPU and offloaded (ZeRO-Offload). Run under
// mpirun; needs a GPU per rank on the machine, and skips saying so without
// (ZINC_EXPECT_GPU=1 makes that a failure). On machines without a GPU,
// kernel emulation (tests/cuda_emu) runs it with an emulated GPU per rank
// and NCCL over MPI.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/cuda_util.h"
#include "core/device.h"
#include "engine/engine.h"
#include "engine/memory_estimate.h"
#include "models/models.h"
#include "tests/comm/mpi_test_main.h"
#include "tests/engine/checkpoint_util.h"
#include "tests/engine/grid_test_util.h"
#include "tests/engine/sequence_split_util.h"
#include "tests/engine/tiny_models.h"
#include "tests/engine/train_util.h"

namespace zinc {

std::shared_ptr<comm::Communicator> g_world;

namespace {

using testing_train::RunSpec;

// Skips unless every rank of this machine has a GPU of its own.
#define ZINC_REQUIRE_GPU_PER_RANK()                                                                        \
  do {                                                                                                     \
    const int zinc_gpus_ = cuda_status().devices, zinc_local_ = g_world->local_size();                     \
    if (zinc_gpus_ < zinc_local_) {                                                                        \
      const std::string zinc_why_ = std::to_string(zinc_gpus_) + " GPU(s) for " +                          \
                                    std::to_string(zinc_local_) + " ranks on this machine (" +             \
                                    cuda_status().why + "): NCCL needs one GPU per rank";                  \
      const char* zinc_expect_ = std::getenv("ZINC_EXPECT_GPU");                                           \
      if (zinc_expect_ && std::string(zinc_expect_) == "1") FAIL() << "ZINC_EXPECT_GPU=1 but " << zinc_why_; \
      GTEST_SKIP() << zinc_why_;                                                                           \
    }                                                                                                      \
  } while (0)

// The same small GPT and data on the CPU path and on the GPU path, in fp32,
// bf16, and bf16 with a bf16 wire (communication_data_type).
// - GPU against CPU: the GPU's matmuls (cuBLAS) add their products in
//   another order than oneDNN, in every layer, forward and backward, so
//   after 8 steps the weights agree to 1e-3 in fp32 (relative over
//   |w| >= 1e-2, and absolute): ten times the bound for runs that differ only
//   in how ranks' gradients are added (EXPECT_CLOSE_WEIGHTS). Measured
//   under kernel emulation at 2 ranks: 1.1e-4 relative. In 16 bits a sum
//   in another order now and then rounds to a neighbouring bf16 value (on
//   a bf16 wire at every hop of the reduction), and AdamW turns a changed
//   sign of a gradient near zero into a whole step of that weight, so the
//   largest single difference means little: there every loss is within
//   0.05 nats (ZeroPrecision.Bf16ComputeAndBf16WireTrainLikeFp32's bound)
//   and the weights within 3e-2 relative RMS. Measured under kernel
//   emulation at 1, 2 and 4 ranks: losses within 4e-4 nats, weights within
//   1.1e-2 relative RMS (bf16 wire, 4 ranks; 3.3e-3 in bf16 on 2 ranks).
// - GPU stage against GPU stage: the same kernels, only the reductions
//   differ (NCCL's all-reduce at stage 0, reduce-scatter from stage 1), so
//   EXPECT_CLOSE_WEIGHTS holds between stage 0 and the others; from stage 1
//   on the reductions are the same reduce-scatter of each block too, and the
//   weights the same bits: what differs is only the engine's orchestration
//   (which the CPU path's bits checked before kernel emulation).
// GPU-resident states on several ranks need the reductions on the GPU (the
// engine refuses them otherwise), so those runs show that NCCL carried them.
// sqrt(sum (a - b)^2 / sum b^2).
double relative_rms(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

void expect_gpu_trains_like_cpu(const std::string& offload, const std::vector<int>& stages) {
  for (const std::string prec : {"fp32", "bf16", "bf16-wire"}) {
    std::vector<float> first_gpu;
    int first_stage = -1;
    for (int stage : stages) {
      RunSpec r;
      r.make = [] { return testing_models::small_gpt(16, Device::kCpu); };
      r.stage = stage;
      r.bf16 = prec != "fp32";
      if (prec == "bf16-wire") r.wire = "bf16";
      r.overlap = true;
      r.bucket = 3000;
      r.gas = 2;
      r.steps = 8;
      r.offload = offload;
      std::vector<double> cpu_losses, gpu_losses;
      const std::vector<float> cpu = testing_train::train(r, g_world, &cpu_losses);
      r.make = [] { return testing_models::small_gpt(16, Device::kCuda); };
      r.top_extra["device"] = "cuda";
      int64_t gpu_peak = 0;
      r.inspect = [&](Engine& e) { gpu_peak = e.gpu_state_peak_bytes(); };
      const std::vector<float> gpu = testing_train::train(r, g_world, &gpu_losses);
      const testing_train::Diff d = testing_train::diff(gpu, cpu);
      const double rms = relative_rms(gpu, cpu);
      const std::string what = prec + ", offload " + offload + ", stage " + std::to_string(stage);
      if (prec == "fp32") {
        EXPECT_LT(d.rel, 1e-3) << "GPU against CPU, " << what;
        EXPECT_LT(d.abs, 1e-3) << "GPU against CPU, " << what;
      } else {
        EXPECT_LT(rms, 3e-2) << "GPU against CPU, " << what << ": relative RMS";
      }
      ASSERT_EQ(cpu_losses.size(), gpu_losses.size());
      double worst_loss = 0;
      for (size_t i = 0; i < cpu_losses.size(); ++i) {
        worst_loss = std::max(worst_loss, std::fabs(cpu_losses[i] - gpu_losses[i]));
        EXPECT_NEAR(cpu_losses[i], gpu_losses[i], 0.05) << "GPU against CPU, " << what << ", loss at step " << i;
      }
      if (std::getenv("ZINC_TEST_PRINT_DIFFS") && g_world->rank() == 0)
        std::printf("GPU against CPU, %s: %.3g relative, %.3g absolute, %.3g relative RMS, losses %.3g\n",
                    what.c_str(), d.rel, d.abs, rms, worst_loss);
      if (first_gpu.empty()) {
        first_gpu = gpu;
        first_stage = stage;
      } else if (first_stage >= 1) {
        EXPECT_EQ(gpu, first_gpu) << "GPU stage " << stage << " against stage " << first_stage << ", " << what;
      } else {
        EXPECT_CLOSE_WEIGHTS(gpu, first_gpu, "GPU stage " << stage << " against stage " << first_stage << ", " << what);
        if (stage == 1) {  // the stages from 1 on against stage 1, bit for bit
          first_gpu = gpu;
          first_stage = stage;
        }
      }
      EXPECT_GT(gpu_peak, 0) << "the GPU run kept nothing on the GPU (" << what << ")";
    }
  }
}

TEST(CudaEngineRanks, GpuResidentStatesTrainLikeTheCpuAtEveryStage) {
  ZINC_REQUIRE_GPU_PER_RANK();
  expect_gpu_trains_like_cpu("none", {0, 1, 2, 3});
}

// Lamb over GPU-resident states on several ranks: each rank sums its
// shard of the states, and the sums are added over the ranks before the
// trust ratios (LambRule::set_ratios), as ZeRO-Offload's Lamb does on the
// host over the same reduced gradient shards. So the two give the same
// bits at stages 1-3 (without clipping: the norm is taken in another order
// on several ranks, as for AdamW above). A rank that used its own sums
// alone would part from the offloaded run.
TEST(CudaEngineRanks, LambOverGpuResidentStatesEqualsZeroOffloadAtEveryStage) {
  ZINC_REQUIRE_GPU_PER_RANK();
  for (int stage : {1, 2, 3}) {
    RunSpec r;
    r.make = [] { return testing_models::small_gpt(16, Device::kCuda); };
    r.stage = stage;
    r.bf16 = true;
    r.overlap = true;
    r.bucket = 3000;
    r.gas = 2;
    r.steps = 4;
    r.top_extra["device"] = "cuda";
    r.top_extra["gradient_clipping"] = 0.0;
    // Wide clamps, so that a tensor's ratio is its norms' (the default
    // [0.01, 10] clamps most of this small model's, and a clamped ratio
    // would not show a rank's own sums).
    r.optimizer = {{"type", "Lamb"},
                   {"params", {{"lr", 1e-3}, {"weight_decay", 0.1}, {"max_coeff", 1e9}, {"min_coeff", 1e-9}}}};
    r.offload = "cpu";
    std::vector<double> off_losses, gpu_losses;
    const std::vector<float> off = testing_train::train(r, g_world, &off_losses);
    r.offload = "none";
    const std::vector<float> gpu = testing_train::train(r, g_world, &gpu_losses);
    EXPECT_EQ(gpu, off) << "Lamb, GPU-resident against offloaded, stage " << stage;
    EXPECT_EQ(gpu_losses, off_losses) << "stage " << stage;
  }
}

// LoRA on several GPUs: the frozen base (no gradients, no states) beside
// the adapters' blocks, reduced and gathered over NCCL, against the CPU
// path on the same ranks (the losses within the 16-bit tolerance above),
// and GPU-resident states against ZeRO-Offload bit for bit from stage 1 on.
TEST(CudaEngineRanks, LoraTrainsLikeTheCpuAtEveryStage) {
  ZINC_REQUIRE_GPU_PER_RANK();
  auto lora_gpt = [](Device d) {
    models::GptConfig g;
    g.vocab_size = testing_models::kVocab;
    g.block_size = testing_models::kSeq;
    g.n_layer = 2;
    g.n_head = 2;
    g.n_embd = 16;
    g.device = d;
    g.lora.r = 4;
    g.lora.targets = {"c_attn", "c_proj", "c_fc"};
    return models::make_gpt(g);
  };
  for (int stage : {0, 1, 2, 3}) {
    RunSpec r;
    r.stage = stage;
    r.bf16 = true;
    r.overlap = true;
    r.bucket = 3000;
    r.gas = 2;
    r.steps = 6;
    r.top_extra["gradient_clipping"] = 0.0;
    r.offload = stage == 0 ? "none" : "cpu";
    r.make = [&] { return lora_gpt(Device::kCpu); };
    std::vector<double> cpu_losses, off_losses, gpu_losses;
    testing_train::train(r, g_world, &cpu_losses);
    r.make = [&] { return lora_gpt(Device::kCuda); };
    r.top_extra["device"] = "cuda";
    const std::vector<float> off = testing_train::train(r, g_world, &off_losses);
    for (size_t i = 0; i < cpu_losses.size(); ++i)
      EXPECT_NEAR(cpu_losses[i], off_losses[i], 0.05) << "LoRA, GPU against CPU, stage " << stage << ", step " << i;
    EXPECT_LT(off_losses.back(), off_losses.front()) << "LoRA on the GPU, stage " << stage << ": the loss falls";
    if (stage == 0) continue;
    r.offload = "none";
    const std::vector<float> gpu = testing_train::train(r, g_world, &gpu_losses);
    EXPECT_EQ(gpu, off) << "LoRA, GPU-resident against offloaded, stage " << stage;
  }
}

TEST(CudaEngineRanks, ZeroOffloadTrainsLikeTheCpuAtEveryStage) {
  ZINC_REQUIRE_GPU_PER_RANK();
  expect_gpu_trains_like_cpu("cpu", {1, 2, 3});
}

// Note [the gather streamed behind the update] (engine/param_coordinator.cpp)
// with Note [the update behind the forward] (engine/gpu_offload.cpp), on
// several ranks: at stages 1-2 with ZeRO-Offload each bucket of the
// parameter all-gather starts once the CPU update has finished its blocks,
// each block goes up to the GPU from the gather thread as it arrives, and
// the next forward waits for its own blocks only. The same losses and
// weights, bit for bit, as the update and the whole gather run in place
// (ZINC_GPU_UPDATE_BEHIND=0, where the buckets still stream), with a bucket
// per block, a few blocks a bucket and one bucket for the model; and the
// update did run behind.
TEST(CudaEngineRanks, TheUpdateBehindTheForwardKeepsTheBitsOnSeveralRanks) {
  ZINC_REQUIRE_GPU_PER_RANK();
  if (g_world->size() < 2) GTEST_SKIP() << "one rank: CudaEnginePath.TheUpdateBehindTheForwardKeepsTheBits";
  struct Case {
    int stage;
    int64_t bucket;
    bool bf16;
  };
  for (const Case& c : {Case{1, 300, true}, Case{2, 3000, false}, Case{2, 500000000, true}}) {
    RunSpec r;
    r.make = [] { return testing_models::small_gpt(16, Device::kCuda); };
    r.top_extra["device"] = "cuda";
    r.stage = c.stage;
    r.bf16 = c.bf16;
    r.bucket = c.bucket;
    r.gas = c.stage;  // 1 and 2
    r.steps = 5;
    r.offload = "cpu";
    double behind_s = -1;
    r.inspect = [&](Engine& e) { behind_s = e.timings().update_behind_s; };
    std::vector<double> behind_losses, direct_losses;
    unsetenv("ZINC_GPU_UPDATE_BEHIND");
    const std::vector<float> behind = testing_train::train(r, g_world, &behind_losses);
    const double ran_behind = behind_s;
    setenv("ZINC_GPU_UPDATE_BEHIND", "0", 1);
    const std::vector<float> direct = testing_train::train(r, g_world, &direct_losses);
    unsetenv("ZINC_GPU_UPDATE_BEHIND");
    const std::string what = std::string(c.bf16 ? "bf16" : "fp32") + " stage " + std::to_string(c.stage) +
                             ", allgather_bucket_size " + std::to_string(c.bucket);
    EXPECT_EQ(behind_losses, direct_losses) << what << ": losses, behind against in place";
    EXPECT_EQ(behind, direct) << what << ": weights, behind against in place";
    EXPECT_GT(ran_behind, 0) << what << ": the update never ran behind";
    EXPECT_EQ(behind_s, 0) << what << ": ZINC_GPU_UPDATE_BEHIND=0 ran it behind";
  }
}

// Pipeline stages on the GPU path (Note [pipeline stages on the GPU] in
// engine/pipeline.cpp): each stage's activations and their gradients stay
// in GPU memory and go between the stages over NCCL (ncclSend/ncclRecv).
// A Llama (its head untied) at 2 stages x world/2 replicas, 1F1B over 4
// micro-batches, against the same GPU run without stages on each stage's
// replicas: the same micro-batches summed in the same order and the same
// NCCL reductions over the replicas, so the losses and weights are the
// same bits, in fp32 and bf16, with ZeRO 0 and 1 and the states on the GPU
// or offloaded. A tied head is refused with one line.
// lora: adapters (r 4, dropout 0.1) on every module over a frozen base;
// 2: and the head trained beside them (modules_to_save: a block of its own).
std::shared_ptr<Model> gpu_llama(bool tied, int lora = 0) {
  models::LlamaConfig c;
  c.vocab_size = 13;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = tied;
  c.device = Device::kCuda;
  if (lora) {
    c.lora.r = 4;
    c.lora.alpha = 6;
    c.lora.dropout = 0.1;
    c.lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    if (lora == 2) c.lora.modules_to_save = {"lm_head"};
  }
  return models::make_llama(c);
}

struct PipeRun {
  std::vector<float> losses, weights;
  float eval = 0;
  double norm = 0;  // the last step's global gradient norm
};

// A GPU run of gpu_llama on `comm` (null: one rank) with `extra` merged
// into its config (the grid's keys): `steps` global batches of `gas`
// micro-batches of 2 rows over the replicas, then an evaluation.
PipeRun train_gpu_grid(std::shared_ptr<comm::Communicator> comm, int replicas, int64_t gas, int steps, bool bf16,
                       int zero, const std::string& offload, const nlohmann::json& extra, int lora = 0) {
  const int64_t micro = 2;
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", micro},
                        {"gradient_accumulation_steps", gas},
                        {"train_batch_size", micro * gas * replicas},
                        {"gradient_clipping", 0.5},
                        {"device", "cuda"},
                        {"bf16", {{"enabled", bf16}}},
                        {"zero_optimization", {{"stage", zero}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  if (offload != "none") cfg["zero_optimization"]["offload_optimizer"] = {{"device", offload}};
  for (const auto& [k, v] : extra.items()) cfg[k] = v;
  Engine e = Engine::initialize(gpu_llama(false, lora), cfg, comm && comm->size() > 1 ? comm : nullptr);
  DataLoader loader = testing::tiny_loader(e, micro, gas);
  PipeRun r;
  for (int i = 0; i < steps; ++i) r.losses.push_back(e.train_batch(loader));
  r.norm = e.global_grad_norm();
  r.eval = e.evaluate(loader.next());
  r.weights = testing::whole_weights(e);
  return r;
}

PipeRun train_gpu_pipeline(std::shared_ptr<comm::Communicator> comm, bool pipelined, bool bf16, int zero,
                           const std::string& offload) {
  const int ranks = comm ? comm->size() : 1;
  return train_gpu_grid(comm, pipelined ? ranks / 2 : ranks, 4, 4, bf16, zero, offload,
                        pipelined ? nlohmann::json{{"pipeline", {{"stages", 2}}}} : nlohmann::json::object());
}

TEST(CudaEngineRanks, PipelineStagesSendActivationsOverNcclAndTrainTheRunWithoutStages) {
  ZINC_REQUIRE_GPU_PER_RANK();
  if (g_world->size() % 2 != 0) GTEST_SKIP() << "two stages need an even number of ranks";
  const int d = g_world->size() / 2;  // replicas per stage
  std::shared_ptr<comm::Communicator> replicas(g_world->split(g_world->rank() / d, g_world->rank() % d));
  struct Case {
    bool bf16;
    int zero;
    const char* offload;
  };
  for (Case c : {Case{false, 0, "none"}, Case{true, 1, "none"}, Case{true, 1, "cpu"}}) {
    const std::string what = std::string(c.bf16 ? "bf16" : "fp32") + ", ZeRO " + std::to_string(c.zero) +
                             ", offload " + c.offload;
    const PipeRun ref = train_gpu_pipeline(replicas, false, c.bf16, c.zero, c.offload);
    const PipeRun got = train_gpu_pipeline(g_world, true, c.bf16, c.zero, c.offload);
    EXPECT_EQ(got.losses, ref.losses) << what;
    EXPECT_EQ(got.eval, ref.eval) << what;
    ASSERT_EQ(got.weights.size(), ref.weights.size()) << what;
    size_t differ = 0;
    for (size_t i = 0; i < ref.weights.size(); ++i) differ += got.weights[i] != ref.weights[i];
    EXPECT_EQ(differ, 0u) << what << ": weights that differ from the run without stages";
    EXPECT_LT(ref.losses.back(), ref.losses.front()) << what << ": the run learns nothing";
  }
  // A head tied to the embedding would be shared by the first and last stage.
  nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 2},
                        {"gradient_accumulation_steps", 2},
                        {"train_batch_size", 4 * d},
                        {"device", "cuda"},
                        {"pipeline", {{"stages", 2}}},
                        {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}}};
  const std::string err = testing::error_of([&] { Engine::initialize(gpu_llama(true), cfg, g_world); });
  EXPECT_NE(err.find("pipeline.stages"), std::string::npos) << err;
  EXPECT_NE(err.find("does not sum between stages yet"), std::string::npos) << err;
  g_world->barrier();
}

// Tensor parts on the GPU path (Note [tensor parts on the GPU] in
// engine/tensor_parallel.cpp): the partial sums added over NCCL between the
// parts' GPUs, the vocabulary parts' cross-entropy on the GPU, the states
// in RAM (ZeRO-Offload). A Llama at 2 parts x world/2 replicas against the
// GPU run without parts on the replicas: the split products sum in another
// order, so the losses and weights agree to float rounding (the CPU path's
// tolerances, tests/engine/tensor_parallel_test.cpp). The configurations it
// does not run yet are refused with one line.
PipeRun train_gpu_parts(std::shared_ptr<comm::Communicator> comm, int parts, int zero, bool bf16 = false,
                        int lora = 0, const std::string& offload = "cpu", const std::string& optimizer = "AdamW") {
  const int ranks = comm ? comm->size() : 1;
  nlohmann::json extra = nlohmann::json::object();
  if (parts > 1) extra["tensor_parallel"] = {{"autotp_size", parts}};
  if (optimizer != "AdamW") extra["optimizer"] = {{"type", optimizer}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}};
  return train_gpu_grid(comm, ranks / parts, 2, 6, bf16, zero, offload, extra, lora);
}

TEST(CudaEngineRanks, TensorPartsAddTheirPartialSumsOverNcclAndTrainTheRunWithoutParts) {
  ZINC_REQUIRE_GPU_PER_RANK();
  if (g_world->size() % 2 != 0) GTEST_SKIP() << "two parts need an even number of ranks";
  const int d = g_world->size() / 2;  // replicas of each part
  std::shared_ptr<comm::Communicator> replicas(g_world->split(g_world->rank() % 2, g_world->rank() / 2));
  // LoRA: the adapters split with their weights (Note [LoRA over tensor
  // parts] in models/detail/lora.h), o and down's dropout through the
  // whole input's mask columns. With the optimizer states on the GPU
  // (offload "none") the summed gradients are all-reduced on the GPUs and
  // the GPU takes the norm over the ranges each part counts: norms and
  // biases counted on both parts would make it larger.
  // With the head in modules_to_save it is a block of its own, whose
  // vocabulary rows split as the frozen head's (they once split the final
  // norm's weight instead).
  struct Case {
    int zero;
    int lora;  // 0 none, 1 adapters, 2 adapters and the head trained
    const char* offload;
    const char* optimizer;
  };
  for (Case c : {Case{1, 0, "cpu", "AdamW"}, Case{2, 0, "cpu", "AdamW"}, Case{2, 1, "cpu", "AdamW"},
                 Case{0, 0, "none", "AdamW"}, Case{2, 0, "none", "AdamW"}, Case{1, 1, "none", "AdamW"},
                 Case{1, 2, "cpu", "AdamW"}, Case{2, 0, "none", "Lamb"}}) {
    const int zero = c.zero;
    const int lora = c.lora;
    const std::string what = "ZeRO " + std::to_string(zero) + ", " + std::to_string(d) + " replicas" +
                             (lora ? ", LoRA with dropout" : "") + (lora == 2 ? ", lm_head in modules_to_save" : "") +
                             ", offload " + c.offload + ", " + c.optimizer;
    const PipeRun ref = train_gpu_parts(replicas, 1, zero, false, lora, c.offload, c.optimizer);
    const PipeRun got = train_gpu_parts(g_world, 2, zero, false, lora, c.offload, c.optimizer);
    ASSERT_EQ(got.losses.size(), ref.losses.size());
    for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-4) << what << " step " << i;
    EXPECT_NEAR(got.eval, ref.eval, 1e-4) << what;
    // AdamW barely feels a wrong norm (the clip coefficient scales every
    // gradient alike, and Adam divides the scale out): the norm itself.
    EXPECT_NEAR(got.norm, ref.norm, 1e-5 * ref.norm) << what << ": the global gradient norm";
    ASSERT_EQ(got.weights.size(), ref.weights.size()) << what;
    double worst = 0;
    for (size_t i = 0; i < ref.weights.size(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(got.weights[i]) - ref.weights[i]));
    EXPECT_LT(worst, 5e-4) << what << ": the largest weight difference";
    EXPECT_LT(ref.losses.back(), ref.losses.front()) << what << ": the run learns nothing";
  }
  // bf16: the same within bf16's rounding of the partial sums' inputs.
  const PipeRun ref = train_gpu_parts(replicas, 1, 1, true), got = train_gpu_parts(g_world, 2, 1, true);
  for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 2e-2) << "bf16 step " << i;
  // What the GPU path does not run with parts yet: one line each.
  auto refusal = [&](const nlohmann::json& extra) {
    nlohmann::json cfg = {{"train_batch_size", 4 * d},
                          {"train_micro_batch_size_per_gpu", 2},
                          {"device", "cuda"},
                          {"tensor_parallel", {{"autotp_size", 2}}},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}}};
    for (const auto& [k, v] : extra.items()) cfg[k] = v;
    return testing::error_of([&] { Engine::initialize(gpu_llama(false), cfg, g_world); });
  };
  EXPECT_NE(refusal({{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}}}}).find("stages 0-2"),
            std::string::npos);
  EXPECT_NE(refusal({{"zero_optimization", {{"stage", 3}}}}).find("stages 0-2"), std::string::npos);
  g_world->barrier();
}

// Sequence ranks on the GPU path (Note [sequence parallelism] in
// engine/sequence_parallel.cpp): the attention's two all-to-alls go
// between the GPUs over NCCL, after the compute stream's kernels that
// wrote what they send. Each run splits its rows over the world's ranks
// (2 or 4 sequence ranks, one replica) or over 2 (world/2 replicas; at 4
// ranks also 2 sequence ranks x 2 tensor parts), and trains the GPU run
// without the split on the replicas to float rounding,
// the CPU path's tolerances (tests/engine/sequence_parallel_test.cpp):
// the weights' gradients are the slices' summed in another order.
TEST(CudaEngineRanks, SequenceRanksExchangeOverNcclAndTrainTheRunWithoutThem) {
  ZINC_REQUIRE_GPU_PER_RANK();
  using testing_sequence::Spec;
  const int w = g_world->size();
  if (w < 2) GTEST_SKIP() << "sequence ranks need two ranks or more";
  auto gpu = [](Spec s) {
    s.device = Device::kCuda;
    s.steps = 8;
    return s;
  };
  Spec base = gpu(Spec{});
  testing_sequence::expect_same_run(base, "GPU, 2 sequence ranks, GQA, packed documents, masked targets");
  Spec all = base;
  all.sp = w;
  if (w > 2) testing_sequence::expect_same_run(all, "GPU, " + std::to_string(w) + " sequence ranks");
  Spec z3 = base;
  z3.zero = 3;
  testing_sequence::expect_same_run(z3, "GPU, ZeRO-3, states on the GPU");
  z3.offload = "cpu";
  z3.sp = w;
  testing_sequence::expect_same_run(z3, "GPU, ZeRO-3, ZeRO-Offload");
  Spec gpt = base;
  gpt.gpt = true;
  gpt.checkpointing = true;
  gpt.zero = 2;
  testing_sequence::expect_same_run(gpt, "GPU, GPT-2, packed documents, activation checkpointing, ZeRO-2");
  Spec lora = base;
  lora.lora = true;
  lora.zero = 3;
  testing_sequence::expect_same_run(lora, "GPU, LoRA at ZeRO-3");
  Spec bf16 = base;
  bf16.bf16 = true;
  bf16.steps = 4;
  testing_sequence::expect_same_run(bf16, "GPU, bf16");
  // With tensor parts (at 4 ranks): each part's heads split again over the
  // slices, the partial sums over NCCL too (ZeRO-Offload, as parts on the GPU).
  Spec parts = base;
  parts.tp = 2;
  parts.zero = 2;
  parts.offload = "cpu";
  parts.vocab = 16;
  testing_sequence::expect_same_run(parts, "GPU, 2 sequence ranks x 2 tensor parts, ZeRO-Offload");
  // The comparison can fail: slices delivered in the wrong order (copied
  // on the GPU, on the compute stream) give another attention.
  Spec s = base;
  s.steps = 2;
  const testing::GridRun ref = testing_sequence::train(s, testing_sequence::replicas_of(s), false);
  cuda::DeviceBuffer scratch;
  const testing::GridRun bad = testing_sequence::train(s, g_world, true, [&](std::shared_ptr<Model> m) {
    return std::make_shared<testing_sequence::ReversedExchange>(
        m,
        [&](size_t n) {
          scratch.reserve(n * sizeof(float));
          return scratch.as<float>();
        },
        [](float* dst, const float* src, size_t n) {
          ZINC_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, nullptr),
                          "the sabotage's copy");
        });
  });
  double worst = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    worst = std::max(worst, std::fabs(bad.losses[i] - ref.losses[i]) / std::max(1.0, std::fabs(ref.losses[i])));
  EXPECT_GT(worst, 100 * 1e-4) << "a misrouted exchange must show in the losses";
}

// Stage 3 on the GPU path, where the parameters are gathered on the GPU
// from shards kept there: a load writes the host shards, which go up again
// before the next gather. States on the host (ZeRO-Offload) and on the GPU.
TEST(CudaEngineRanks, Stage3ResumesBitExact) {
  ZINC_REQUIRE_GPU_PER_RANK();
  const std::string dir = ::testing::TempDir() + "zinc-cuda-ckpt-mr-gpu3-np" + std::to_string(g_world->size());
  for (const char* offload : {"cpu", "none"}) {
    g_world->barrier();
    if (g_world->rank() == 0) std::filesystem::remove_all(dir);
    g_world->barrier();
    RunSpec r;
    r.stage = 3;
    r.bf16 = true;
    r.offload = offload;
    r.top_extra["device"] = "cuda";
    r.make = [] { return testing_models::small_gpt(16, Device::kCuda); };
    testing_train::expect_bit_exact_resume(r, g_world, dir, 3, std::string("GPU, stage 3, offload ") + offload);
  }
  g_world->barrier();
  if (g_world->rank() == 0) std::filesystem::remove_all(dir);
}

// Note [a failed NCCL collective] (comm/nccl_communicator.cpp), on the
// engine: when the peers of a step's NCCL reduction never come (every rank's
// under the kernel emulation's ZINC_EMU_NCCL_STALL, as when a peer died),
// the step fails at comm.timeout_seconds (the engine's host communicator's)
// with the rank and the collective; a wait for the whole GPU after it, and
// the engine's teardown, end instead of waiting forever for the abandoned
// kernel (the emulation ends the process where one would wait). With the
// reductions overlapped and not.
TEST(CudaEngineRanks, AStepWhoseNcclPeersNeverComeFailsAtTheLimitAndTheEngineTearsDown) {
  ZINC_REQUIRE_GPU_PER_RANK();
  if (!std::getenv("ZINC_EMU_GPUS")) GTEST_SKIP() << "needs the kernel emulation (ZINC_EMU_NCCL_STALL)";
  if (g_world->size() < 2) GTEST_SKIP() << "one rank reduces nothing over NCCL";
  std::shared_ptr<comm::Communicator> host = comm::make_communicator("mpi", 1.5);
  for (bool overlap : {false, true}) {
    RunSpec r;
    r.stage = 2;
    r.bf16 = true;
    r.overlap = overlap;
    r.top_extra["device"] = "cuda";
    std::string error;
    double took = 0;
    {
      Engine e = Engine::initialize(testing_models::small_gpt(16, Device::kCuda), testing_train::make_config(r), host);
      DataConfig dc;
      dc.vocab_size = 13;
      dc.seq_len = 9;
      DataLoader loader(std::shared_ptr<const DataSource>(make_data_source(dc)), r.global_batch / host->size(), 1,
                        host->size(), host->rank(), 7);
      e.train_batch(loader);  // the peers come
      setenv("ZINC_EMU_NCCL_STALL", "1", 1);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        e.train_batch(loader);
      } catch (const std::exception& ex) {
        error = ex.what();
      }
      took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      unsetenv("ZINC_EMU_NCCL_STALL");
      // A program that caught the error and goes on while the engine lives
      // (a Python script that saves what it can) may wait for the whole GPU.
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }  // the engine's teardown: frees its GPU memory
    const std::string what = overlap ? "overlapped" : "not overlapped";
    EXPECT_NE(error.find("[rank " + std::to_string(host->rank()) + "] nccl "), std::string::npos)
        << what << ": " << error;
    EXPECT_NE(error.find("no completion after 1.5 s, past comm.timeout_seconds"), std::string::npos)
        << what << ": " << error;
    EXPECT_GE(took, 1.5) << what;
    EXPECT_LT(took, 60.0) << what;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    host->barrier();
  }
}

// The memory estimate (zinc-train --estimate) against the GPU path: the
// model state it puts on the GPU (its gpu parts that are model state)
// against what the engine held there at its peak
// (Engine::gpu_state_peak_bytes), at every stage, with the optimizer states
// on the GPU and offloaded, in fp32, bf16 and bf16 with a bf16 wire. At
// stages 0-1 every GPU buffer lives for the whole run: the estimate is the
// peak exactly. From stage 2 the gradient buffers (and their 16-bit wire
// copies) live from backward until their reduction ends on the
// communication thread, so the peak depends on how far the reductions lag:
// the estimate, which counts the most that can be alive, bounds it.
TEST(CudaEngineRanks, GpuMemoryEstimateIsTheMeasuredPeak) {
  ZINC_REQUIRE_GPU_PER_RANK();
  for (const std::string prec : {"fp32", "bf16", "bf16-wire"})
  for (const std::string offload : {"none", "cpu"})
    for (int stage : {0, 1, 2, 3}) {
      if (stage == 0 && offload != "none") continue;
      RunSpec r;
      r.bf16 = prec != "fp32";
      if (prec == "bf16-wire") r.wire = "bf16";
      r.make = [] { return testing_models::small_gpt(16, Device::kCuda); };
      r.top_extra["device"] = "cuda";
      r.stage = stage;
      r.overlap = true;
      r.bucket = 3000;
      r.gas = 2;
      r.steps = 3;  // stage 3 follows its trace from the second step
      r.offload = offload;
      int64_t estimated = 0, measured = 0;
      r.inspect = [&](Engine& e) {
        for (const MemoryPart& p : estimate_memory(e.model(), e.config(), 9).gpu)
          if (p.model_state) estimated += p.bytes;
        measured = e.gpu_state_peak_bytes();
      };
      testing_train::train(r, g_world);
      EXPECT_GT(measured, 0);
      if (stage <= 1)
        EXPECT_EQ(estimated, measured) << prec << " offload " << offload << " stage " << stage;
      else
        EXPECT_LE(measured, estimated) << prec << " offload " << offload << " stage " << stage;
    }
}

}  // namespace
}  // namespace zinc

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  zinc::g_world = zinc::comm::make_communicator("mpi");
  const int rc = zinc::comm::testing::run_all_tests_on_every_rank(*zinc::g_world);
  zinc::g_world.reset();  // the last communicator: finalises MPI
  return rc;
}
