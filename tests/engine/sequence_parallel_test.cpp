// Sequence parallelism across ranks (run under mpirun -np 2 and -np 4 by
// CTest): a run whose rows are split over S sequence ranks (with D = world
// / S replicas) must train the weights and losses of the run without the
// split on D ranks, to float rounding: the weights' gradients are the
// slices' summed in another order (Note [sequence parallelism] in
// engine/sequence_parallel.cpp). Each rank runs that reference itself over
// the ranks of its own slice index. The batches are made here: packed
// documents, masked targets, two rows per micro-batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
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
  int sp = 2;
  int tp = 1;           // tensor parts of each sequence rank's layers
  int64_t vocab = 13;
  int zero = 1;
  bool bf16 = false;
  int64_t gas = 2;
  int64_t micro = 2;
  int64_t T = 8;
  int steps = 20;
  double lr = 1e-2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  bool packed = true;   // documents packed into the rows (Batch::positions), some targets masked
  bool gemma2 = false;  // post-norms, soft-capping, a sliding window, GeGLU
  bool neox = false;    // LayerNorm with biases, parallel residual, partial rotary
  bool qwen3 = false;   // per-head q and k norms
  bool olmo2 = false;   // norms after the branches, q and k norms over the whole projection
  bool moe = false;     // mixture-of-experts MLPs (no load-balancing loss)
  bool lora = false;    // LoRA adapters on q, v and down, the base frozen
  bool gpt = false;     // GPT-2 (learned positions, LayerNorm, fused c_attn with biases, a tied head)
  bool checkpointing = false;
  bool tied = false;
  std::string offload = "none";
  // A sabotage that shows the comparison can fail: the exchange hands each
  // rank the other ranks' slices in reverse order.
  bool reversed_exchange = false;
};

std::shared_ptr<Model> llama(const Spec& s) {
  if (s.gpt) {
    models::GptConfig g;
    g.vocab_size = 13;
    g.block_size = 16;
    g.n_layer = 3;
    g.n_head = s.heads;
    g.n_embd = 16;
    g.gradient_checkpointing = s.checkpointing;
    return models::make_gpt(g);
  }
  models::LlamaConfig c;
  c.vocab_size = s.vocab;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = s.heads;
  c.num_key_value_heads = s.kv_heads;
  c.head_dim = 4;
  c.max_position_embeddings = 16;
  c.qkv_bias = true;
  c.tie_word_embeddings = s.tied;
  c.gradient_checkpointing = s.checkpointing;
  if (s.gemma2) {
    c.o_bias = c.mlp_bias = true;
    c.post_norms = true;
    c.attn_logit_softcapping = 5.0;
    c.final_logit_softcapping = 3.0;
    c.sliding_window = 3;
    c.mlp_act = models::LlamaConfig::MlpAct::kGeluTanh;
  }
  if (s.neox) {
    c.layer_norm = true;
    c.parallel_residual = true;
    c.partial_rotary_factor = 0.5;
    c.mlp_gated = false;
    c.mlp_act = models::LlamaConfig::MlpAct::kGeluErf;
  }
  if (s.qwen3) c.qk_norm = true;
  if (s.olmo2) {
    c.qk_norm = c.qk_norm_full = true;
    c.pre_norms = false;
    c.post_norms = true;
  }
  if (s.moe) {
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 8;
  }
  if (s.lora) {
    c.lora.r = 2;
    c.lora.alpha = 4;
    c.lora.targets = {"q_proj", "v_proj", "down_proj"};
  }
  return models::make_llama(c);
}

// A model whose exchange is sabotaged (Spec::reversed_exchange): every call
// goes to the inner model, with a context that passes everything through
// but permutes what the all-to-all delivers.
class ReversedExchange final : public Model, StepContext {
 public:
  explicit ReversedExchange(std::shared_ptr<Model> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  const std::vector<BlockSpec>& blocks() const override { return inner_->blocks(); }
  std::string sequence_split_error(int size) const override { return inner_->sequence_split_error(size); }
  float forward(StepContext& ctx, const Batch& batch) override {
    ctx_ = &ctx;
    return inner_->forward(*this, batch);
  }
  void backward(StepContext& ctx, float loss_scale) override {
    ctx_ = &ctx;
    inner_->backward(*this, loss_scale);
  }
  DType compute_dtype() const override { return ctx_->compute_dtype(); }
  BlockGrads grads(int block) override { return ctx_->grads(block); }
  void grads_ready(int block) override { ctx_->grads_ready(block); }
  uint64_t dropout_seed() const override { return ctx_->dropout_seed(); }
  const SequenceSplit& sequence_split() const override { return ctx_->sequence_split(); }
  void sequence_all_to_all(const float* send, float* recv, int64_t per_rank) override {
    const int S = ctx_->sequence_split().size;
    std::vector<float> got(static_cast<size_t>(S * per_rank));
    ctx_->sequence_all_to_all(send, got.data(), per_rank);
    for (int r = 0; r < S; ++r)
      std::copy_n(got.data() + (S - 1 - r) * per_rank, per_rank, recv + r * per_rank);
  }

 private:
  BlockParams acquire_params(int block) override {
    HeldParams h = ctx_->acquire(block);
    const BlockParams p = h.params();
    held_[block] = std::move(h);
    return p;
  }
  void release_params(int block) noexcept override { held_.erase(block); }
  std::shared_ptr<Model> inner_;
  StepContext* ctx_ = nullptr;
  std::map<int, HeldParams> held_;
};

json config(const Spec& s, int replicas, bool split) {
  json c = {{"train_micro_batch_size_per_gpu", s.micro},
            {"gradient_accumulation_steps", s.gas},
            {"gradient_clipping", 0.5},  // small: the clip coefficient applies, and needs the norm over every rank
            {"bf16", {{"enabled", s.bf16}}},
            {"zero_optimization", {{"stage", s.zero}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", s.lr}, {"weight_decay", 0.1}}}}}};
  c["train_batch_size"] = s.micro * s.gas * replicas;
  if (split) c["sequence_parallel_size"] = s.sp;
  if (split && s.tp > 1) c["tensor_parallel"] = {{"autotp_size", s.tp}};
  if (s.offload != "none")
    c["zero_optimization"]["offload_optimizer"] = {{"device", s.offload}, {"nvme_path", ::testing::TempDir()}};
  return c;
}

// Micro-batch `index` of the run (testing::packed_batch).
Batch make_batch(const Spec& s, int64_t index) { return testing::packed_batch(s.micro, s.T, index, s.packed); }

using Result = testing::GridRun;  // its losses: each micro-batch's, as forward() returned it
using testing::worst_difference;

// Trains s.steps global batches as replica `replica` of `replicas`; every
// rank ends with every block's whole weights.
Result train(const Spec& s, std::shared_ptr<comm::Communicator> comm, bool split) {
  const int ranks = comm ? comm->size() : 1;
  const int replicas = split ? ranks / (s.sp * s.tp) : ranks;
  std::shared_ptr<Model> m = llama(s);
  if (s.reversed_exchange) m = std::make_shared<ReversedExchange>(m);
  Engine e = Engine::initialize(m, config(s, replicas, split), ranks > 1 ? comm : nullptr);
  EXPECT_EQ(e.data_parallel_size(), replicas);
  const int replica = e.data_parallel_rank();
  Result r;
  for (int i = 0; i < s.steps; ++i)
    for (int64_t k = 0; k < s.gas; ++k) {
      r.losses.push_back(e.forward(make_batch(s, (i * s.gas + k) * replicas + replica)));
      e.backward();
      e.step();
    }
  r.norm = e.global_grad_norm();
  r.eval = e.evaluate(make_batch(s, 1000 + replica));
  r.weights = testing::whole_weights(e);
  return r;
}

// The reference's ranks: one per replica, those of this rank's slice and
// part (grid rank = (replica * sp + slice) * tp + part).
std::shared_ptr<comm::Communicator> replicas_of(const Spec& s) {
  const int per = s.sp * s.tp;
  return std::shared_ptr<comm::Communicator>(g_world->split(g_world->rank() % per, g_world->rank() / per));
}

// Tolerances as the tensor parts' (tests/engine/tensor_parallel_test.cpp):
// fp32 sums in another order over 20 AdamW steps at lr 1e-2, where a
// rounding in a near-zero gradient moves a weight by up to ~1e-4; bf16
// rounds each slice's matmul rows where one rank rounds them all: looser.
void expect_same_run(const Spec& s, const std::string& what) {
  if (g_world->size() % (s.sp * s.tp) != 0) return;  // 4 sequence ranks at 2 ranks
  const Result ref = train(s, replicas_of(s), false);
  const Result got = train(s, g_world, true);
  Spec start = s;
  start.steps = 0;
  testing::expect_close_runs(got, ref, train(start, g_world, true).weights, s.bf16 ? 2e-2 : 1e-4,
                             s.bf16 ? 5e-2 : 5e-4, what);
}

TEST(SequenceParallel, SlicesTrainTheRunWithoutThem) {
  expect_same_run(Spec{}, "2 sequence ranks, GQA, packed documents, masked targets");
  Spec four;
  four.sp = 4;
  expect_same_run(four, "4 sequence ranks, 2 tokens of each row apiece");
  Spec plain;
  plain.packed = false;
  plain.kv_heads = 4;
  expect_same_run(plain, "rows of one sequence each, no masked targets");
}

TEST(SequenceParallel, ComposesWithZeroThreeAndOffloadedStates) {
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

TEST(SequenceParallel, FamiliesBf16AndGradientCheckpointing) {
  Spec g;
  g.gemma2 = true;
  expect_same_run(g, "Gemma 2's layer with a sliding window of 3");
  Spec n;
  n.neox = true;
  expect_same_run(n, "GPT-NeoX's layer");
  Spec q;
  q.qwen3 = true;
  q.tied = true;
  q.checkpointing = true;
  expect_same_run(q, "Qwen3's layer, tied head, gradient checkpointing");
  // OLMo 2's layer (no norm before the branches) at lr 1e-2 turns chaotic
  // near step 14: the two runs agree to 0-1 ulp in the loss until then,
  // and the difference then grows ~3x a step (1e-6 to 2e-3 in 7 steps).
  // At lr 1e-3 it trains without that phase.
  Spec o;
  o.olmo2 = true;
  o.lr = 1e-3;
  expect_same_run(o, "OLMo 2's layer");
  Spec m;
  m.moe = true;
  expect_same_run(m, "mixture-of-experts MLPs");
  Spec l;
  l.lora = true;
  l.zero = 3;
  expect_same_run(l, "LoRA at ZeRO-3");
  Spec g2;
  g2.gpt = true;
  expect_same_run(g2, "GPT-2, packed documents (learned positions)");
  g2.zero = 3;
  g2.checkpointing = true;
  g2.packed = false;
  expect_same_run(g2, "GPT-2 at ZeRO-3 with gradient checkpointing");
  Spec b;
  b.bf16 = true;
  b.steps = 6;
  expect_same_run(b, "bf16");
}

// Sequence ranks whose layers are split into tensor parts (at 4 ranks):
// each part's heads split again over the slices, the vocabulary by parts.
TEST(SequenceParallel, ComposesWithTensorParts) {
  Spec s;
  s.tp = 2;
  s.zero = 2;
  s.vocab = 16;
  expect_same_run(s, "2 sequence ranks x 2 tensor parts, vocabulary parts, ZeRO-2");
  s.zero = 3;
  expect_same_run(s, "2 sequence ranks x 2 tensor parts, vocabulary parts, ZeRO-3");
  s.zero = 2;
  s.gpt = true;
  s.zero = 1;
  s.heads = 4;
  expect_same_run(s, "GPT-2, 2 sequence ranks x 2 tensor parts");
}

// Sequence ranks on each of 2 pipeline stages (at 4 ranks: 2 stages x 2
// slices x 1 replica): the 1F1B schedule carries each slice's hidden state
// to the same slice on the next stage, and the run trains the one-rank run
// without stages or slices to float rounding. Through train_batch (a
// DataLoader over rows of 8 tokens), as pipelined runs train.
TEST(SequenceParallel, ComposesWithPipelineStages) {
  if (g_world->size() != 4) return;
  for (bool checkpointing : {false, true}) {
    Spec s;
    s.gas = 4;
    s.checkpointing = checkpointing;
    auto run = [&](bool split, int steps) {
      json c = config(s, 1, split);
      if (split) c["pipeline"] = {{"stages", 2}};
      std::shared_ptr<comm::Communicator> alone;  // the reference: each rank runs it on its own
      Engine e = Engine::initialize(llama(s), c, split ? g_world : alone);
      DataConfig dc;
      dc.vocab_size = 13;
      dc.seq_len = 8;
      std::shared_ptr<const DataSource> src(make_data_source(dc));
      DataLoader loader(src, s.micro, s.gas, e.data_parallel_size(), e.data_parallel_rank(), 7);
      Result r;
      for (int i = 0; i < steps; ++i) r.losses.push_back(e.train_batch(loader));
      r.norm = e.global_grad_norm();
      r.eval = e.evaluate(loader.next());
      r.weights = testing::whole_weights(e);
      return r;
    };
    const Result ref = run(false, s.steps);
    const Result got = run(true, s.steps);
    testing::expect_close_runs(got, ref, run(true, 0).weights, 1e-4, 5e-4,
                               std::string("2 stages x 2 sequence ranks") + (checkpointing ? ", checkpointing" : ""));
  }
}

// The comparison above can fail: slices delivered in the wrong order give
// another attention, and the losses part from the reference's at once.
TEST(SequenceParallel, AMisroutedExchangeIsCaught) {
  Spec s;
  s.steps = 2;
  const Result ref = train(s, replicas_of(s), false);
  s.reversed_exchange = true;
  const Result bad = train(s, g_world, true);
  double worst = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    worst = std::max(worst, std::fabs(bad.losses[i] - ref.losses[i]) / std::max(1.0, std::fabs(ref.losses[i])));
  EXPECT_GT(worst, 100 * 1e-4) << "a misrouted exchange must show in the losses";
}

TEST(SequenceParallel, RefusesWhatItCannotSplitWithOneLine) {
  const int w = g_world->size();
  Spec s;
  s.sp = w;
  // Heads that do not divide over the sequence ranks.
  Spec odd = s;
  odd.heads = w == 2 ? 1 : 2;
  odd.kv_heads = 1;
  std::string e = error_of([&] { Engine::initialize(llama(odd), config(odd, 1, true), g_world); });
  EXPECT_NE(e.find("sequence_parallel_size"), std::string::npos) << e;
  EXPECT_NE(e.find("num_attention_heads"), std::string::npos) << e;
  // A row length that does not divide: one line, and nothing trained.
  Engine eng = Engine::initialize(llama(s), config(s, 1, true), g_world);
  Spec nine = s;
  nine.T = 9;
  e = error_of([&] { eng.forward(make_batch(nine, 0)); });
  EXPECT_NE(e.find("T=9"), std::string::npos) << e;
  EXPECT_NE(e.find("sequence_parallel_size"), std::string::npos) << e;
  // Ranks of one replica given different rows: every rank stops, naming them.
  e = error_of([&] { eng.forward(make_batch(s, g_world->rank())); });
  EXPECT_NE(e.find("different micro-batches"), std::string::npos) << e;
  // Different row lengths (one rank's would slice, another's not): the
  // same, with no rank left waiting in an exchange.
  Spec mine = s;
  mine.T = g_world->rank() == 0 ? 9 : 8;
  e = error_of([&] { eng.forward(make_batch(mine, 0)); });
  EXPECT_NE(e.find("different micro-batches"), std::string::npos) << e;
  // One rank's batch malformed: it names what, the others that it was.
  Batch broken = make_batch(s, 0);
  if (g_world->rank() == 1) broken.targets.pop_back();
  e = error_of([&] { eng.evaluate(broken); });
  EXPECT_NE(e.find(g_world->rank() == 1 ? "expected B*T inputs and targets" : "malformed micro-batch"),
            std::string::npos)
      << e;
  // The engine goes on after both refusals.
  EXPECT_TRUE(std::isfinite(eng.forward(make_batch(s, 0))));
  eng.backward();
  eng.step();
  // GPT-2's heads must divide too.
  models::GptConfig g;
  g.vocab_size = 13;
  g.block_size = 16;
  g.n_layer = 2;
  g.n_head = w == 2 ? 3 : 2;
  g.n_embd = 12;
  e = error_of([&] { Engine::initialize(models::make_gpt(g), config(s, 1, true), g_world); });
  EXPECT_NE(e.find("sequence_parallel_size"), std::string::npos) << e;
  EXPECT_NE(e.find("n_head " + std::to_string(g.n_head) + " is not a multiple"), std::string::npos) << e;
}

TEST(SequenceParallel, TheEstimateIsOneSlicesActivationsAndTheRanksModelState) {
  const int w = g_world->size();
  for (int zero : {1, 3}) {
    Spec s;
    s.sp = w;
    s.zero = zero;
    s.T = 16;
    const json cj = config(s, 1, true);
    Engine e = Engine::initialize(llama(s), cj, g_world);
    for (int64_t k = 0; k < s.gas; ++k) {
      e.forward(make_batch(s, k));
      e.backward();
      e.step();
    }
    double peak = static_cast<double>(e.model_state_peak_bytes());
    g_world->all_reduce_max_f64(&peak, 1);
    const MemoryEstimate est = estimate_memory(*llama(s), Config::parse(cj, w), s.T);
    const std::string what = "ZeRO " + std::to_string(zero);
    EXPECT_EQ(est.world, w) << what << ": ZeRO partitions over every sequence rank";
    EXPECT_EQ(static_cast<double>(est.model_state_bytes()), peak) << what;
    const MemoryEstimate one = estimate_memory(*llama(s), Config::parse(config(s, 1, false), 1), s.T);
    auto activations = [](const MemoryEstimate& m) {
      int64_t n = 0;
      for (const MemoryPart& p : m.training) n += p.model_state ? 0 : p.bytes;
      return n;
    };
    EXPECT_GT(activations(one), 0) << what;
    EXPECT_LT(activations(est), activations(one)) << what;
  }
}

TEST(SequenceParallelConfig, RanksMustDivideTheWorldAndTheBatchFitsTheReplicas) {
  json c = {{"train_micro_batch_size_per_gpu", 2}, {"sequence_parallel_size", 2}};
  Config got = Config::parse(c, 4);
  EXPECT_EQ(got.data_parallel_size(), 2);
  EXPECT_EQ(got.zero_group_size(), 4);
  EXPECT_EQ(got.train_batch_size, 4);
  std::string e = error_of([&] { Config::parse(json{{"train_micro_batch_size_per_gpu", 2},
                                                    {"sequence_parallel_size", 3}}, 4); });
  EXPECT_NE(e.find("sequence_parallel_size"), std::string::npos) << e;
  EXPECT_NE(e.find("multiple of 3"), std::string::npos) << e;
  for (json bad : {json(0), json("two"), json(1.5)}) {
    e = error_of([&] { Config::parse(json{{"train_micro_batch_size_per_gpu", 2}, {"sequence_parallel_size", bad}}, 2); });
    EXPECT_NE(e.find("sequence_parallel_size"), std::string::npos) << e;
  }
  // With pipeline stages: stages x sequence ranks per replica.
  json p = c;
  p["pipeline"] = {{"stages", 2}};
  got = Config::parse(p, 8);
  EXPECT_EQ(got.data_parallel_size(), 2);
  EXPECT_EQ(got.zero_group_size(), 4);  // the ranks of one stage
  e = error_of([&] { Config::parse(p, 2); });
  EXPECT_NE(e.find("sequence_parallel_size"), std::string::npos) << e;
  EXPECT_NE(e.find("multiple of 4"), std::string::npos) << e;
  // With tensor parts: parts x sequence ranks per replica.
  json t = c;
  t["tensor_parallel"] = {{"autotp_size", 2}};
  got = Config::parse(t, 8);
  EXPECT_EQ(got.data_parallel_size(), 2);
  EXPECT_EQ(got.zero_group_size(), 4);  // the ranks that hold the same part
  EXPECT_EQ(got.train_batch_size, 4);
  e = error_of([&] { Config::parse(t, 2); });
  EXPECT_NE(e.find("sequence_parallel_size"), std::string::npos) << e;
  EXPECT_NE(e.find("multiple of 4"), std::string::npos) << e;
  json o = c;
  o["optimizer"] = {{"type", "OneBitAdam"}, {"params", {{"lr", 1e-3}}}};
  e = error_of([&] { Config::parse(o, 4); });
  EXPECT_NE(e.find("optimizer.type"), std::string::npos) << e;
  // The serialized config keeps it (checkpoints and --check show it).
  EXPECT_EQ(to_json(got).value("sequence_parallel_size", 0), 2);
}

}  // namespace
}  // namespace zinc

int main(int argc, char** argv) {
  return zinc::comm::testing::main_over_backend(argc, argv, zinc::g_world);
}
