// Expert parallelism across ranks (run under mpirun -np 2 and -np 4 by
// CTest): a run whose mixture-of-experts layers share their experts out
// over P expert ranks must train the weights and losses of the run without
// expert ranks (plain data parallelism over the same ranks) to float
// rounding: each expert's GEMMs cover several ranks' rows at once and the
// dense weights' gradients are summed in another order (Note [expert
// parallelism] in engine/expert_parallel.cpp). The batches are made here:
// packed documents, masked targets, two rows per micro-batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
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

struct Spec {
  int ep = 2;
  int zero = 1;
  bool bf16 = false;
  int64_t gas = 2;
  int64_t micro = 2;
  int64_t T = 8;
  int steps = 20;
  int64_t experts = 4;
  int64_t k = 2;
  double aux = 0;       // router_aux_loss_coef (the load-balancing loss)
  bool qwen3 = false;   // per-head q and k norms (Qwen3-MoE's layer)
  bool checkpointing = false;
  bool lora = false;    // LoRA adapters on q and v (the experts frozen, as PEFT's targets for the MoE families)
  std::string offload = "none";
  // Every token of every layer routed to expert rank 0's experts at the
  // first step (SkewedStart): the other ranks' experts get nothing.
  bool skewed = false;
  // A sabotage that shows the comparison can fail: the exchange drops the
  // last row each expert rank receives (a capacity of one row fewer).
  bool drop_one = false;
  std::string wire;  // communication_data_type ("": the default, fp32)
};

std::shared_ptr<Model> llama(const Spec& s) {
  models::LlamaConfig c;
  c.vocab_size = 13;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.max_position_embeddings = 16;
  c.gradient_checkpointing = s.checkpointing;
  c.num_experts = s.experts;
  c.num_experts_per_tok = s.k;
  c.moe_intermediate_size = 8;
  c.router_aux_loss_coef = s.aux;
  if (s.qwen3) c.qk_norm = true;
  if (s.lora) {
    c.lora.r = 2;
    c.lora.alpha = 4;
    c.lora.targets = {"q_proj", "v_proj"};
  }
  return models::make_llama(c);
}

// Passes every call to the inner model; the test's changes: initial values
// that route every token to the first experts (Spec::skewed), and an
// exchange that loses a row (Spec::drop_one).
class Wrapped final : public Model, StepContext {
 public:
  Wrapped(std::shared_ptr<Model> inner, const Spec& s) : inner_(std::move(inner)), s_(s) {}
  std::string name() const override { return inner_->name(); }
  const std::vector<BlockSpec>& blocks() const override { return inner_->blocks(); }
  TensorPart expert_part(int rank, int size, std::string* why) const override {
    return inner_->expert_part(rank, size, why);
  }
  void use_expert_part(int rank, int size) override { inner_->use_expert_part(rank, size); }
  float forward(StepContext& ctx, const Batch& batch) override {
    ctx_ = &ctx;
    return inner_->forward(*this, batch);
  }
  void backward(StepContext& ctx, float loss_scale) override {
    ctx_ = &ctx;
    inner_->backward(*this, loss_scale);
  }
  // Skewed: every token's embedding positive (so every norm's output is),
  // o_proj and the experts' down_proj zero (so each layer passes the
  // embedding on unchanged at the first step), and the routers' rows for
  // the first half of the experts positive, the rest negative: each token
  // picks its k experts among rank 0's.
  bool initial_values(int block, int param, int64_t first, int64_t count, float* out) const override {
    if (!s_.skewed) return false;
    const ParamSpec& ps = inner_->blocks()[static_cast<size_t>(block)].params[static_cast<size_t>(param)];
    const int64_t cols = ps.shape.ndim > 1 ? ps.shape.dims[1] : 1;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t at = first + i, row = at / cols, col = at % cols;
      if (ps.name == "embed_tokens.weight")
        out[i] = 0.5f + 0.05f * static_cast<float>((row * 7 + col) % 5);
      else if (ps.name == "self_attn.o_proj.weight" || ps.name == "mlp.experts.down_proj")
        out[i] = 0.0f;
      else if (ps.name == "mlp.gate.weight")
        out[i] = row < s_.experts / 2 ? 0.5f - 0.1f * static_cast<float>(row) : -0.5f;
      else
        return false;
    }
    return true;
  }
  DType compute_dtype() const override { return ctx_->compute_dtype(); }
  BlockGrads grads(int block) override { return ctx_->grads(block); }
  void grads_ready(int block) override { ctx_->grads_ready(block); }
  uint64_t dropout_seed() const override { return ctx_->dropout_seed(); }
  void expert_counts(const int32_t* send, int32_t* recv, int64_t per_rank) override {
    ctx_->expert_counts(send, recv, per_rank);
  }
  void expert_exchange(const float* send, const int64_t* send_rows, float* recv, const int64_t* recv_rows,
                       int64_t width) override {
    ctx_->expert_exchange(send, send_rows, recv, recv_rows, width);
    if (!s_.drop_one) return;
    int64_t rows = 0;
    for (int r = 0; r < s_.ep; ++r) rows += recv_rows[r];
    if (rows > 0) std::fill_n(recv + (rows - 1) * width, width, 0.0f);
  }

 private:
  BlockParams acquire_params(int block) override {
    HeldParams h = ctx_->acquire(block);
    const BlockParams p = h.params();
    held_.emplace_back(std::move(h));
    return p;
  }
  void release_params(int block) noexcept override {
    for (auto it = held_.begin(); it != held_.end(); ++it)
      if (it->block() == block) {
        held_.erase(it);
        return;
      }
  }
  std::shared_ptr<Model> inner_;
  Spec s_;
  StepContext* ctx_ = nullptr;
  std::vector<HeldParams> held_;
};

json config(const Spec& s, int ranks, bool split) {
  json c = {{"train_micro_batch_size_per_gpu", s.micro},
            {"gradient_accumulation_steps", s.gas},
            {"gradient_clipping", 0.5},  // small: the clip coefficient applies, and needs the norm over every rank
            {"bf16", {{"enabled", s.bf16}}},
            {"zero_optimization", {{"stage", s.zero}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}, {"weight_decay", 0.1}}}}}};
  c["train_batch_size"] = s.micro * s.gas * ranks;  // expert ranks train on batches of their own
  if (!s.wire.empty()) c["communication_data_type"] = s.wire;
  if (split) c["expert_parallel"] = {{"enabled", true}, {"autoep_size", s.ep}, {"preset_model", "mixtral"}};
  if (s.offload != "none")
    c["zero_optimization"]["offload_optimizer"] = {{"device", s.offload}, {"nvme_path", ::testing::TempDir()}};
  return c;
}

// Micro-batch `index` of the run (testing::packed_batch).
Batch make_batch(const Spec& s, int64_t index) { return testing::packed_batch(s.micro, s.T, index, true); }

using Result = testing::GridRun;  // its losses: each micro-batch's, as forward() returned it

struct Ckpt {
  std::string load, save;
};

// Trains s.steps global batches over every rank of g_world; every rank ends
// with every block's whole weights.
Result train(const Spec& s, bool split, const Ckpt& ck = {}) {
  const int ranks = g_world->size();
  Engine e = Engine::initialize(std::make_shared<Wrapped>(llama(s), s), config(s, ranks, split), g_world);
  EXPECT_EQ(e.data_parallel_size(), ranks);
  EXPECT_EQ(e.expert_parallel_size(), split ? s.ep : 1);
  if (!ck.load.empty()) e.load_checkpoint(ck.load, "");
  const int me = e.data_parallel_rank();
  const int64_t done = e.global_steps();
  Result r;
  for (int i = 0; i < s.steps; ++i)
    for (int64_t k = 0; k < s.gas; ++k) {
      r.losses.push_back(e.forward(make_batch(s, ((done + i) * s.gas + k) * ranks + me)));
      e.backward();
      e.step();
    }
  if (!ck.save.empty()) e.save_checkpoint(ck.save, "", json::object());
  r.norm = e.global_grad_norm();
  r.eval = e.evaluate(make_batch(s, 1000 + me));
  r.weights = testing::whole_weights(e);
  return r;
}

// Tolerances as the tensor parts' (tests/engine/tensor_parallel_test.cpp):
// fp32 sums in another order over 20 AdamW steps at lr 1e-2; bf16 rounds
// each rank's matmul rows where another grouping rounds them: looser.
void expect_same_run(const Spec& s, const std::string& what) {
  if (g_world->size() % s.ep != 0) return;  // 4 expert ranks at 2 ranks
  const Result ref = train(s, false);
  const Result got = train(s, true);
  Spec start = s;
  start.steps = 0;
  testing::expect_close_runs(got, ref, train(start, true).weights, s.bf16 ? 2e-2 : 1e-4, s.bf16 ? 5e-2 : 5e-4,
                             what);
}

TEST(ExpertParallel, ExpertRanksTrainTheDataParallelRun) {
  expect_same_run(Spec{}, "2 expert ranks, 2 of 4 experts per token, ZeRO-1");
  Spec all;
  all.ep = g_world->size();
  all.experts = 8;
  expect_same_run(all, "one expert rank per rank, 8 experts");
  Spec one;
  one.k = 1;
  expect_same_run(one, "one expert per token");
}

// The dense weights' sums over the expert ranks are data parallelism's
// (each rank's own batches): they travel in communication_data_type as
// ZeRO's reduction does. With every rank an expert rank ZeRO reduces over
// one rank, so these sums are the only ones on the wire: an fp16 wire
// must change the run (it once went fp32 whatever the config said).
TEST(ExpertParallel, DenseSumsTravelInCommunicationDataType) {
  Spec s;
  s.ep = g_world->size();
  s.experts = 8;
  s.steps = 6;
  s.wire = "fp16";
  if (g_world->size() % s.ep != 0) return;
  // The data-parallel run at fp16 rounds every gradient on the wire, this
  // one the dense weights' only (an expert's is whole on its rank): the
  // losses agree to the rounding; the weights not (Adam turns a gradient
  // that fp16 flushes to zero into steps of a whole lr).
  const Result ref = train(s, false), half = train(s, true);
  ASSERT_EQ(half.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(half.losses[i], ref.losses[i], 2e-2 * ref.losses[i]) << i;
  Spec f = s;
  f.wire = "fp32";
  const Result full = train(f, true);
  EXPECT_NE(half.losses, full.losses) << "an fp16 wire rounds the dense weights' sums: the run must differ from fp32's";
  EXPECT_NE(half.weights, full.weights);
}

TEST(ExpertParallel, ComposesWithEveryZeroStageAndOffloadedStates) {
  for (int zero : {0, 2, 3}) {
    Spec s;
    s.zero = zero;
    expect_same_run(s, "ZeRO-" + std::to_string(zero));
  }
  Spec off;
  off.zero = 3;
  off.offload = "cpu";
  expect_same_run(off, "ZeRO-3 with the optimizer states offloaded");
}

TEST(ExpertParallel, LoadBalancingLossQkNormsCheckpointingLoraAndBf16) {
  Spec a;
  a.aux = 0.02;
  expect_same_run(a, "with the load-balancing loss (each rank's own tokens)");
  Spec q;
  q.qwen3 = true;
  q.checkpointing = true;
  expect_same_run(q, "Qwen3-MoE's layer with gradient checkpointing");
  Spec l;
  l.lora = true;
  l.zero = 3;
  expect_same_run(l, "LoRA on the attention at ZeRO-3, the experts frozen");
  Spec b;
  b.bf16 = true;
  b.steps = 6;
  expect_same_run(b, "bf16");
}

// No capacity: at the first step every token goes to rank 0's experts and
// none to the others', and the run still trains the data-parallel one.
TEST(ExpertParallel, NoTokenIsDroppedWhenEveryTokenPicksOneRanksExperts) {
  Spec s;
  s.skewed = true;
  s.steps = 8;
  expect_same_run(s, "every token to expert rank 0 at the start");
}

// The comparison above can fail: an exchange that loses one row of each
// expert rank's (one token's expert dropped, a capacity one row short)
// parts from the reference by far more than its tolerances.
TEST(ExpertParallel, ADroppedTokenIsCaught) {
  Spec s;
  const Result ref = train(s, false);
  s.drop_one = true;
  const Result bad = train(s, true);
  double worst = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    worst = std::max(worst, std::fabs(bad.losses[i] - ref.losses[i]) / std::max(1.0, std::fabs(ref.losses[i])));
  const double weights = testing::worst_difference(bad.weights, ref.weights);
  std::printf("a dropped row: losses apart by %.2e relative, weights by %.2e\n", worst, weights);
  EXPECT_GT(worst, 10 * 1e-4) << "a dropped token must show in the losses";
  EXPECT_GT(weights, 10 * 5e-4) << "and in the weights";
}

std::string shared_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/zinc_ep_ckpt_" + name + "_np" + std::to_string(g_world->size());
  if (g_world->rank() == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  g_world->barrier();
  return dir;
}

// Checkpoints hold whole blocks: saved by expert ranks, they load into the
// run without them, and the reverse, bit for bit; at the same grid a
// resumed run goes on as if never stopped.
TEST(ExpertParallel, CheckpointsResumeAtAnyNumberOfExpertRanks) {
  for (int zero : {1, 3}) {
    Spec s;
    s.zero = zero;
    const std::string what = "ZeRO-" + std::to_string(zero);
    Spec three = s, none = s, six = s;
    three.steps = 3;
    none.steps = 0;
    six.steps = 6;
    const std::string ep_dir = shared_dir("ep"), plain_dir = shared_dir("plain");
    const Result saved_ep = train(three, true, {"", ep_dir});
    const Result saved_plain = train(three, false, {"", plain_dir});
    EXPECT_EQ(train(none, false, {ep_dir, ""}).weights, saved_ep.weights) << what << ": loaded without expert ranks";
    EXPECT_EQ(train(none, true, {plain_dir, ""}).weights, saved_plain.weights) << what << ": loaded by expert ranks";
    const Result resumed = train(three, true, {ep_dir, ""});
    const Result straight = train(six, true);
    EXPECT_EQ(resumed.weights, straight.weights) << what << ": resumed at the same grid";
    EXPECT_EQ(resumed.losses, std::vector<double>(straight.losses.begin() + 6, straight.losses.end())) << what;
    g_world->barrier();
    if (g_world->rank() == 0) {
      std::filesystem::remove_all(ep_dir);
      std::filesystem::remove_all(plain_dir);
    }
  }
}

TEST(ExpertParallel, TheEstimateIsOneExpertRanksModelState) {
  for (int zero : {1, 3}) {
    Spec s;
    s.zero = zero;
    const json cj = config(s, g_world->size(), true);
    Engine e = Engine::initialize(llama(s), cj, g_world);
    for (int64_t k = 0; k < s.gas; ++k) {
      e.forward(make_batch(s, k * g_world->size() + e.data_parallel_rank()));
      e.backward();
      e.step();
    }
    double peak = static_cast<double>(e.model_state_peak_bytes());
    g_world->all_reduce_max_f64(&peak, 1);
    const MemoryEstimate est = estimate_memory(*llama(s), Config::parse(cj, g_world->size()), s.T);
    EXPECT_EQ(est.world, g_world->size() / s.ep) << "ZeRO partitions over the ranks that hold the same experts";
    EXPECT_EQ(static_cast<double>(est.model_state_bytes()), peak) << "ZeRO-" << zero;
  }
}

TEST(ExpertParallel, RefusesWhatItCannotShareOutWithOneLine) {
  Spec s;
  s.experts = 3;
  s.k = 1;
  std::string e = error_of([&] { Engine::initialize(llama(s), config(s, g_world->size(), true), g_world); });
  EXPECT_NE(e.find("expert_parallel.autoep_size"), std::string::npos) << e;
  EXPECT_NE(e.find("num_experts 3 is not a multiple"), std::string::npos) << e;
  Spec dense;
  dense.experts = 0;
  e = error_of([&] { Engine::initialize(llama(dense), config(dense, g_world->size(), true), g_world); });
  EXPECT_NE(e.find("no mixture-of-experts layers"), std::string::npos) << e;
  models::GptConfig g;
  g.vocab_size = 13;
  g.block_size = 16;
  g.n_layer = 2;
  g.n_head = 2;
  g.n_embd = 8;
  e = error_of([&] { Engine::initialize(models::make_gpt(g), config(Spec{}, g_world->size(), true), g_world); });
  EXPECT_NE(e.find("expert_parallel.autoep_size"), std::string::npos) << e;
}

TEST(ExpertParallelConfig, ExpertRanksDivideTheWorldAndKeepTheReplicas) {
  const json c = {{"train_micro_batch_size_per_gpu", 2},
                  {"expert_parallel", {{"enabled", true}, {"autoep_size", 2}, {"preset_model", "mixtral"}}}};
  Config got = Config::parse(c, 4);
  EXPECT_EQ(got.expert_parallel.size, 2);
  EXPECT_EQ(got.data_parallel_size(), 4);  // every rank its own batches
  EXPECT_EQ(got.zero_group_size(), 2);     // the ranks that hold the same experts
  EXPECT_EQ(got.train_batch_size, 8);
  EXPECT_EQ(to_json(got)["expert_parallel"].value("autoep_size", 0), 2);
  std::string e = error_of([&] { Config::parse(c, 3); });
  EXPECT_NE(e.find("expert_parallel.autoep_size"), std::string::npos) << e;
  EXPECT_NE(e.find("multiple of 2"), std::string::npos) << e;
  // Off: the size is ignored with a warning, and the run is data parallel.
  json off = c;
  off["expert_parallel"]["enabled"] = false;
  got = Config::parse(off, 3);
  EXPECT_EQ(got.expert_parallel.size, 1);
  EXPECT_FALSE(got.warnings.empty());
  // Routing that is not the model's own: refused, naming the key.
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{
           {"load_balance_coeff", 1e-3}, {"top_k", 1}, {"score_func", "sigmoid"}, {"route_scale", 2.0},
           {"num_expert_groups", 2}}) {
    json bad = c;
    bad["expert_parallel"][key] = value;
    e = error_of([&] { Config::parse(bad, 2); });
    EXPECT_NE(e.find("expert_parallel." + key), std::string::npos) << key << ": " << e;
  }
  // What finds a torch model's layers: ignored with a warning.
  json hint = c;
  hint["expert_parallel"]["use_grouped_mm"] = false;
  EXPECT_FALSE(Config::parse(hint, 2).warnings.empty());
  // Not composed yet: one line each.
  for (const json& with : {json{{"tensor_parallel", {{"autotp_size", 2}}}}, json{{"sequence_parallel_size", 2}},
                           json{{"pipeline", {{"stages", 2}}}}}) {
    json both = c;
    both.update(with);
    e = error_of([&] { Config::parse(both, 4); });
    EXPECT_NE(e.find("expert_parallel.autoep_size"), std::string::npos) << with.dump() << ": " << e;
  }
  json onebit = c;
  onebit["optimizer"] = {{"type", "OneBitAdam"}, {"params", {{"lr", 1e-3}}}};
  e = error_of([&] { Config::parse(onebit, 2); });
  EXPECT_NE(e.find("optimizer.type"), std::string::npos) << e;
}

}  // namespace
}  // namespace zinc

int main(int argc, char** argv) {
  return zinc::comm::testing::main_over_backend(argc, argv, zinc::g_world);
}
