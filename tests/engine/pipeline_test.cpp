// Pipeline stages across ranks (run under mpirun -np 2 and -np 4 by CTest):
// a run with P stages and D = world / P replicas must compute the weights
// and losses of the run without stages on D ranks, bit for bit (Note
// [pipeline parallelism] in engine/pipeline.cpp). Each rank runs that
// reference itself over its stage's data-parallel group.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "core/error.h"
#include "data/data.h"
#include "engine/engine.h"
#include "engine/memory_estimate.h"
#include "models/models.h"
#include "tests/comm/mpi_test_main.h"
#include "tests/engine/grid_test_util.h"

namespace zinc {

std::shared_ptr<comm::Communicator> g_world;

namespace {

using json = nlohmann::json;
using testing::error_of;
using testing::trained_state_peak;

struct Spec {
  bool packed = false;  // documents packed in rows (positions restart) with some targets masked
  bool gpt = false;  // GPT-2 (its head is tied) instead of the Llama
  bool one_set = false;  // the model keeps one activation set: the engine computes forwards again
  int stages = 2;
  int zero = 0;
  bool bf16 = false;
  int64_t gas = 4;
  int64_t micro = 2;
  int steps = 4;
  bool lora = false;
  bool checkpointing = false;
  bool tied = false;
  std::string partition = "parameters";
  std::string offload = "none";
  int layers = 3;
};

// The synthetic tokens with each row cut into documents (positions
// restarting where index and position say) and every fifth target masked.
class Packed final : public DataSource {
 public:
  explicit Packed(std::shared_ptr<const DataSource> s) : s_(std::move(s)) {}
  std::string describe() const override { return "packed " + s_->describe(); }
  int64_t vocab_size() const override { return s_->vocab_size(); }
  int64_t seq_len() const override { return s_->seq_len(); }
  int64_t num_samples() const override { return s_->num_samples(); }
  void sample(int64_t index, int32_t* inputs, int32_t* targets) const override {
    s_->sample(index, inputs, targets);
    for (int64_t t = 0; t < seq_len(); ++t)
      if ((index + t) % 5 == 0) targets[t] = kIgnoreTarget;
  }
  bool has_positions() const override { return true; }
  void positions(int64_t index, int32_t* out) const override {
    const int64_t cut = 2 + index % 5;  // the second document starts here
    for (int64_t t = 0; t < seq_len(); ++t) out[t] = static_cast<int32_t>(t < cut ? t : t - cut);
  }

 private:
  std::shared_ptr<const DataSource> s_;
};

// A model with one activation set (Model::select_activations refuses any
// other), around the Llama: the engine's other way, the forward again
// before each backward.
class OneSet final : public Model {
 public:
  explicit OneSet(std::shared_ptr<Model> m) : m_(std::move(m)) {}
  std::string name() const override { return m_->name(); }
  const std::vector<BlockSpec>& blocks() const override { return m_->blocks(); }
  float forward(StepContext& ctx, const Batch& b) override { return m_->forward(ctx, b); }
  void backward(StepContext& ctx, float scale) override { m_->backward(ctx, scale); }
  std::vector<PipelineLayer> pipeline_layers() const override { return m_->pipeline_layers(); }
  int64_t pipeline_width() const override { return m_->pipeline_width(); }
  bool select_activations(int slot) override { return slot == 0; }

 private:
  std::shared_ptr<Model> m_;
};

std::shared_ptr<Model> llama(const Spec& s) {
  if (s.gpt) {
    models::GptConfig g;
    g.vocab_size = 13;
    g.block_size = 16;
    g.n_layer = s.layers;
    g.n_head = 2;
    g.n_embd = 12;
    g.gradient_checkpointing = s.checkpointing;
    if (s.lora) {
      g.lora.r = 4;
      g.lora.alpha = 8;
      g.lora.targets = {"c_attn", "c_fc"};
      g.lora.dropout = 0.25;
    }
    return models::make_gpt(g);
  }
  models::LlamaConfig c;
  c.vocab_size = 13;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = s.layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 16;
  c.qkv_bias = true;
  c.tie_word_embeddings = s.tied;
  c.gradient_checkpointing = s.checkpointing;
  if (s.lora) {
    c.lora.r = 4;
    c.lora.alpha = 8;
    c.lora.targets = {"q_proj", "v_proj", "down_proj"};
    c.lora.dropout = 0.25;  // the masks must follow the micro-batch, not the stage
  }
  if (s.one_set) return std::make_shared<OneSet>(models::make_llama(c));
  return models::make_llama(c);
}

json config(const Spec& s, int replicas, bool pipelined) {
  json c = {{"train_micro_batch_size_per_gpu", s.micro},
            {"gradient_accumulation_steps", s.gas},
            {"gradient_clipping", 0.5},  // small: the clip coefficient applies and must agree to the bit
            {"bf16", {{"enabled", s.bf16}}},
            {"zero_optimization", {{"stage", s.zero}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  c["train_batch_size"] = s.micro * s.gas * replicas;
  if (pipelined) c["pipeline"] = {{"stages", s.stages}, {"partition", s.partition}};
  if (s.offload != "none")
    c["zero_optimization"]["offload_optimizer"] = {{"device", s.offload}, {"nvme_path", ::testing::TempDir()}};
  return c;
}

struct Result : testing::GridRun {
  int64_t recomputed = 0;
};

// Checkpoints in a run: `load` before the first step (the loader moved on
// to where the saved run was), `save` after `save_after` steps.
struct Ckpt {
  std::string load, save;
  int save_after = 0;
};

// Trains s.steps global batches; every rank ends with every block's weights.
Result train(const Spec& s, std::shared_ptr<comm::Communicator> comm, bool pipelined, const Ckpt& ck = {}) {
  const int ranks = comm ? comm->size() : 1;
  const int replicas = pipelined ? ranks / s.stages : ranks;
  Engine e = Engine::initialize(llama(s), config(s, replicas, pipelined), ranks > 1 ? comm : nullptr);
  auto src = testing::tiny_source();
  if (s.packed) src = std::make_shared<Packed>(src);
  DataLoader loader(src, s.micro, s.gas, e.data_parallel_size(), e.data_parallel_rank(), 7);
  if (!ck.load.empty()) {
    e.load_checkpoint(ck.load, "");
    loader.set_position(e.global_steps() * e.config().train_batch_size);
  }
  Result r;
  for (int i = 0; i < s.steps; ++i) {
    if (!ck.save.empty() && i == ck.save_after) e.save_checkpoint(ck.save, "", json::object());
    r.losses.push_back(e.train_batch(loader));
  }
  r.norm = e.global_grad_norm();
  r.recomputed = e.pipeline_recomputed_forwards();
  r.eval = e.evaluate(loader.next());
  r.weights = testing::whole_weights(e);
  return r;
}

// The stage's data-parallel group: the reference run's ranks.
std::shared_ptr<comm::Communicator> replicas_of(int stages) {
  const int d = g_world->size() / stages;
  return std::shared_ptr<comm::Communicator>(g_world->split(g_world->rank() / d, g_world->rank() % d));
}

void expect_same_run(const Spec& s, const std::string& what) {
  if (g_world->size() % s.stages != 0) return;  // 4 stages at 2 ranks
  const Result ref = train(s, replicas_of(s.stages), false);
  const Result got = train(s, g_world, true);
  ASSERT_EQ(got.weights.size(), ref.weights.size()) << what;
  if (s.tied || (s.gpt && !s.lora)) {  // a GPT's head is tied (with LoRA its embedding is frozen)
    // Note [tied blocks across stages]: the embedding's and the head's
    // parts of its gradient are summed in another order; fp32 rounding.
    for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5) << what;
    EXPECT_NEAR(got.norm, ref.norm, 1e-5 * ref.norm) << what;
    double worst = 0;
    for (size_t i = 0; i < ref.weights.size(); ++i)
      worst = std::max(worst, std::fabs(static_cast<double>(got.weights[i]) - ref.weights[i]));
    EXPECT_LT(worst, 1e-5) << what << ": the largest weight difference";
    EXPECT_GT(worst, 0.0) << what << ": bit for bit: the tied sum's order is the same after all? then say so";
    return;
  }
  EXPECT_EQ(got.losses, ref.losses) << what;
  EXPECT_EQ(got.norm, ref.norm) << what;
  EXPECT_EQ(got.eval, ref.eval) << what;
  size_t differ = 0;
  for (size_t i = 0; i < ref.weights.size(); ++i) differ += got.weights[i] != ref.weights[i];
  EXPECT_EQ(differ, 0u) << what << ": weights that differ from the run without stages";
  // A stage keeps its in-flight micro-batches' activations (one set each)
  // and computes no forward twice, unless the model keeps one set.
  if (!s.one_set) {
    EXPECT_EQ(got.recomputed, 0) << what;
  }
  if (s.one_set && s.gas > 1 && g_world->rank() < g_world->size() / s.stages) {
    EXPECT_GT(got.recomputed, 0) << what;
  }
}

TEST(Pipeline, StagesTrainTheRunWithoutStagesBitForBit) {
  for (int stages : {2, 4})
    for (bool bf16 : {false, true}) {
      Spec s;
      s.stages = stages;
      s.bf16 = bf16;
      expect_same_run(s, std::to_string(stages) + " stages, " + (bf16 ? "bf16" : "fp32"));
    }
}

TEST(Pipeline, AModelWithOneActivationSetComputesForwardsAgain) {
  for (int stages : {2, 4}) {
    Spec s;
    s.stages = stages;
    s.one_set = true;
    expect_same_run(s, std::to_string(stages) + " stages, one activation set");
  }
}

// A head tied to the embedding: the first and last stages each keep it and
// sum their gradients (Note [tied blocks across stages]).
TEST(Pipeline, ATiedHeadIsKeptOnBothEndsAndTrainsTheSameWeights) {
  for (int stages : {2, 4})
    for (int zero : {0, 1}) {
      Spec s;
      s.stages = stages;
      s.zero = zero;
      s.tied = true;
      expect_same_run(s, "tied head, " + std::to_string(stages) + " stages, ZeRO " + std::to_string(zero));
    }
}

// GPT-2: its head is tied to the embedding (kept on both ends), and with
// LoRA its frozen embedding needs no sum at all.
TEST(Pipeline, GptStagesTrainTheSameWeights) {
  for (int stages : {2, 4})
    for (bool lora : {false, true})
      for (bool ck : {false, true}) {
        Spec s;
        s.gpt = true;
        s.stages = stages;
        s.lora = lora;
        s.checkpointing = ck;
        expect_same_run(s, "GPT, " + std::to_string(stages) + " stages" + (lora ? ", LoRA" : "") +
                               (ck ? ", gradient checkpointing" : ""));
      }
}

// Packed documents (the positions every stage's attention and rotary
// tables read) and masked targets (the normaliser counts the targets of
// every micro-batch; the loss comes from the last stage).
TEST(Pipeline, PackedDocumentsAndMaskedTargets) {
  for (bool gpt : {false, true}) {
    Spec s;
    s.packed = true;
    s.gpt = gpt;
    s.lora = gpt;  // a GPT bit for bit: its tied head frozen
    expect_same_run(s, gpt ? "GPT with LoRA, packed and masked" : "Llama, packed and masked");
  }
}

TEST(Pipeline, FewerMicroBatchesThanStagesAndOneMicroBatch) {
  for (int64_t gas : {1, 3}) {
    Spec s;
    s.stages = g_world->size();
    s.gas = gas;
    expect_same_run(s, "gas " + std::to_string(gas));
  }
}

TEST(Pipeline, ZeroOneAndOffloadedOptimizerStates) {
  Spec s;
  s.zero = 1;
  expect_same_run(s, "ZeRO-1");
  s.offload = "cpu";
  expect_same_run(s, "ZeRO-1, optimizer states in pinned RAM");
}

TEST(Pipeline, LoraWithDropoutAndGradientCheckpointing) {
  Spec s;
  s.lora = true;
  expect_same_run(s, "LoRA with dropout");
  s.lora = false;
  s.checkpointing = true;
  expect_same_run(s, "gradient checkpointing");
}

TEST(Pipeline, EveryPartitionMethodTrainsTheSameWeights) {
  for (const char* p : {"uniform", "type:decoderlayer", "best"}) {
    Spec s;
    s.stages = 2;
    s.layers = 4;
    s.partition = p;
    expect_same_run(s, p);
  }
}

// A checkpoint saved with stages resumes without them and the reverse, bit
// for bit: each stage writes its own blocks' spans, and a load reads any
// block from whichever ranks wrote it.
TEST(Pipeline, CheckpointsResumeWithAndWithoutStagesBitForBit) {
  for (int stages : {2, 4}) {
    if (g_world->size() % stages != 0) continue;
    Spec s;
    s.stages = stages;
    s.zero = 1;
    const std::string dir = ::testing::TempDir() + "zinc_pipe_ckpt_" + std::to_string(stages);
    const std::string group_dir = dir + "_group" + std::to_string(g_world->rank() / (g_world->size() / stages));
    std::error_code ec;  // the ranks of a group race to remove and make its folder: any one does it
    if (g_world->rank() == 0) std::filesystem::remove_all(dir, ec);
    std::filesystem::remove_all(group_dir, ec);
    g_world->barrier();
    std::filesystem::create_directories(dir, ec);
    std::filesystem::create_directories(group_dir, ec);
    g_world->barrier();
    // With stages: 2 steps, save, 2 more. Without: load, the same 2 more.
    Spec run = s;
    const Result with = train(run, g_world, true, {"", dir, 2});
    run.steps = 2;
    const Result resumed = train(run, replicas_of(stages), false, {dir, "", 0});
    EXPECT_EQ(resumed.weights, with.weights) << stages << " stages saved, resumed without";
    EXPECT_EQ(resumed.losses, std::vector<double>(with.losses.begin() + 2, with.losses.end()));
    // Without stages (each group its own folder): save after 2 steps; with
    // stages: load group 0's and go on.
    const Result without = train(s, replicas_of(stages), false, {"", group_dir, 2});
    g_world->barrier();
    const Result back = train(run, g_world, true, {dir + "_group0", "", 0});
    EXPECT_EQ(back.weights, without.weights) << "saved without stages, resumed with " << stages;
    g_world->barrier();
    std::filesystem::remove_all(group_dir, ec);
    if (g_world->rank() == 0) std::filesystem::remove_all(dir, ec);
  }
}

// --estimate and the resource check size the stage that needs the most:
// its model state is what the engine of that stage holds at its peak, and
// no rank holds more.
TEST(Pipeline, TheEstimateIsTheLargestStagesModelState) {
  for (int stages : {2, 4}) {
    if (g_world->size() % stages != 0) continue;
    for (int zero : {0, 1}) {
      Spec s;
      s.stages = stages;
      s.zero = zero;
      s.steps = 1;
      const int d = g_world->size() / stages;
      const json cj = config(s, d, true);
      Engine e = Engine::initialize(llama(s), cj, g_world);
      const double peak = trained_state_peak(e, *g_world, s.micro, s.gas);
      const MemoryEstimate est = estimate_memory(*llama(s), Config::parse(cj, g_world->size()), 9);
      EXPECT_EQ(est.pipeline_stages, stages);
      EXPECT_EQ(static_cast<double>(est.model_state_bytes()), peak) << stages << " stages, ZeRO " << zero;
      // A stage holds less than the whole model's states.
      Spec whole = s;
      const MemoryEstimate one = estimate_memory(*llama(whole), Config::parse(config(s, d, false), d), 9);
      EXPECT_LT(est.model_state_bytes(), one.model_state_bytes());
    }
  }
}

// A tied head's block is saved once (by the first stage): a checkpoint of
// a tied model with stages resumes with stages bit for bit, and without
// them to fp32 rounding (Note [tied blocks across stages]).
TEST(Pipeline, ATiedHeadsCheckpointResumes) {
  if (g_world->size() % 2 != 0) return;
  Spec s;
  s.stages = 2;
  s.tied = true;
  const std::string dir = ::testing::TempDir() + "zinc_pipe_tied_ckpt";
  std::error_code ec;
  if (g_world->rank() == 0) std::filesystem::remove_all(dir, ec);
  g_world->barrier();
  std::filesystem::create_directories(dir, ec);
  g_world->barrier();
  const Result with = train(s, g_world, true, {"", dir, 2});
  Spec rest = s;
  rest.steps = 2;
  const Result again = train(rest, g_world, true, {dir, "", 0});
  EXPECT_EQ(again.weights, with.weights) << "resumed with the same stages";
  const Result without = train(rest, replicas_of(2), false, {dir, "", 0});
  ASSERT_EQ(without.weights.size(), with.weights.size());
  for (size_t i = 0; i < with.weights.size(); ++i) ASSERT_NEAR(without.weights[i], with.weights[i], 1e-5) << i;
  g_world->barrier();
  if (g_world->rank() == 0) std::filesystem::remove_all(dir, ec);
}

TEST(Pipeline, RefusesWhatItCannotRunWithOneLine) {
  Spec s;
  s.stages = 2;
  if (g_world->size() % 2 != 0) GTEST_SKIP();
  const int d = g_world->size() / 2;
  s.zero = 2;
  EXPECT_NE(error_of([&] { Engine::initialize(llama(s), config(s, d, true), g_world); })
                .find("zero_optimization.stage"),
            std::string::npos);
  s.zero = 0;
  models::MlpConfig mc;
  mc.vocab_size = 13;
  EXPECT_NE(error_of([&] { Engine::initialize(models::make_mlp(mc), config(s, d, true), g_world); })
                .find("does not split into pipeline stages"),
            std::string::npos);
  // A mixture of experts with a load-balancing loss: refused with the
  // reason and the way out, under its family's name.
  models::LlamaConfig moe;
  moe.name = "mixtral";
  moe.vocab_size = 13;
  moe.hidden_size = 16;
  moe.intermediate_size = 24;
  moe.num_hidden_layers = 2;
  moe.num_experts = 4;
  moe.num_experts_per_tok = 2;
  moe.moe_intermediate_size = 8;
  moe.router_aux_loss_coef = 0.01;
  const std::string moe_err = error_of([&] { Engine::initialize(models::make_llama(moe), config(s, d, true), g_world); });
  EXPECT_NE(moe_err.find("model 'mixtral' does not split into pipeline stages"), std::string::npos) << moe_err;
  EXPECT_NE(moe_err.find("with router_aux_loss_coef 0 it splits"), std::string::npos) << moe_err;
  s.layers = 1;  // 3 layers (embedding, one decoder layer, head) for 4 stages
  if (g_world->size() == 4) {
    s.stages = 4;
    EXPECT_NE(error_of([&] { Engine::initialize(llama(s), config(s, 1, true), g_world); }).find("at least one"),
              std::string::npos);
  }
  s.stages = 2;
  s.layers = 3;
  s.partition = "type:nothing";
  EXPECT_NE(error_of([&] { Engine::initialize(llama(s), config(s, d, true), g_world); }).find("pipeline.partition"),
            std::string::npos);
  s.partition = "parameters";
  Engine e = Engine::initialize(llama(s), config(s, d, true), g_world);
  Batch b;
  b.B = 1;
  b.T = 2;
  b.inputs = {1, 2};
  b.targets = {2, 3};
  EXPECT_NE(error_of([&] { e.forward(b); }).find("train_batch"), std::string::npos);
  EXPECT_NE(error_of([&] { e.backward(); }).find("train_batch"), std::string::npos);
}

TEST(PipelineConfig, StagesMustDivideTheWorldAndTheBatchFitsTheReplicas) {
  json c = {{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 4}, {"pipeline", {{"stages", 3}}}};
  EXPECT_NE(error_of([&] { Config::parse(c, 4); }).find("pipeline.stages"), std::string::npos);
  c["pipeline"]["stages"] = 2;
  const Config p = Config::parse(c, 4);
  EXPECT_EQ(p.data_parallel_size(), 2);
  EXPECT_EQ(p.train_batch_size, 2 * 4 * 2);
  c["pipeline"]["stages"] = "auto";
  EXPECT_FALSE(Config::parse(c, 4).pipelined());
  c["pipeline"] = {{"stages", 2}, {"partition", "layers"}};
  EXPECT_NE(error_of([&] { Config::parse(c, 4); }).find("pipeline.partition"), std::string::npos);
  // Hostile values: each one line naming the key.
  for (const json& bad : {json{{"stages", 0}}, json{{"stages", "two"}}, json{{"stages", 1e12}}, json{{"stages", -2}},
                          json{{"stages", 2}, {"partition", "type:["}}, json{{"stages", 2}, {"partition", 3}},
                          json{{"stages", 2}, {"partitoin", "uniform"}}}) {
    c["pipeline"] = bad;
    const std::string e = error_of([&] { Config::parse(c, 4); });
    EXPECT_NE(e.find("pipeline."), std::string::npos) << bad.dump() << ": " << e;
  }
}

}  // namespace
}  // namespace zinc

int main(int argc, char** argv) {
  return zinc::comm::testing::main_over_backend(argc, argv, zinc::g_world);
}
