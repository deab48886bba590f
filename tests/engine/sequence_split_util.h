// Sequence-parallel runs for the tests of the CPU path
// (sequence_parallel_test) and the GPU path (cuda_engine_multirank_test):
// a run whose rows are split over S sequence ranks (with D = world / S
// replicas) against the run without the split on D ranks (Note [sequence
// parallelism] in engine/sequence_parallel.cpp). Each rank runs that
// reference itself over the ranks of its own slice index. The batches are
// made here: packed documents, masked targets, two rows per micro-batch.
// The including test defines zinc::g_world.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "core/device.h"
#include "engine/engine.h"
#include "models/models.h"
#include "tests/engine/grid_test_util.h"

namespace zinc {

extern std::shared_ptr<comm::Communicator> g_world;

namespace testing_sequence {

using json = nlohmann::json;

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
  Device device = Device::kCpu;  // kCuda: the GPU path
};

inline std::shared_ptr<Model> llama(const Spec& s) {
  if (s.gpt) {
    models::GptConfig g;
    g.vocab_size = 13;
    g.block_size = 16;
    g.n_layer = 3;
    g.n_head = s.heads;
    g.n_embd = 16;
    g.gradient_checkpointing = s.checkpointing;
    g.device = s.device;
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
  c.device = s.device;
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

// A sabotage that shows the comparison can fail: a model whose exchange
// hands each rank the other ranks' slices in reverse order. Every call goes
// to the inner model, with a context that passes everything through but
// permutes what the all-to-all delivers, through `scratch` (room for n
// floats where the exchange's buffers live) and `copy` (n floats there).
class ReversedExchange final : public Model, StepContext {
 public:
  ReversedExchange(std::shared_ptr<Model> inner, std::function<float*(size_t)> scratch,
                   std::function<void(float*, const float*, size_t)> copy)
      : inner_(std::move(inner)), scratch_(std::move(scratch)), copy_(std::move(copy)) {}
  std::string name() const override { return inner_->name(); }
  Device device() const override { return inner_->device(); }
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
    float* got = scratch_(static_cast<size_t>(S * per_rank));
    ctx_->sequence_all_to_all(send, got, per_rank);
    for (int r = 0; r < S; ++r) copy_(recv + r * per_rank, got + (S - 1 - r) * per_rank, static_cast<size_t>(per_rank));
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
  std::function<float*(size_t)> scratch_;
  std::function<void(float*, const float*, size_t)> copy_;
  StepContext* ctx_ = nullptr;
  std::map<int, HeldParams> held_;
};

inline json run_config(const Spec& s, int replicas, bool split) {
  json c = {{"train_micro_batch_size_per_gpu", s.micro},
            {"gradient_accumulation_steps", s.gas},
            {"gradient_clipping", 0.5},  // small: the clip coefficient applies, and needs the norm over every rank
            {"bf16", {{"enabled", s.bf16}}},
            {"zero_optimization", {{"stage", s.zero}}},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", s.lr}, {"weight_decay", 0.1}}}}}};
  c["train_batch_size"] = s.micro * s.gas * replicas;
  if (s.device == Device::kCuda) c["device"] = "cuda";
  if (split) c["sequence_parallel_size"] = s.sp;
  if (split && s.tp > 1) c["tensor_parallel"] = {{"autotp_size", s.tp}};
  if (s.offload != "none")
    c["zero_optimization"]["offload_optimizer"] = {{"device", s.offload}, {"nvme_path", ::testing::TempDir()}};
  return c;
}

// Micro-batch `index` of the run (testing::packed_batch).
inline Batch make_batch(const Spec& s, int64_t index) { return testing::packed_batch(s.micro, s.T, index, s.packed); }

using Result = testing::GridRun;  // its losses: each micro-batch's, as forward() returned it
using testing::worst_difference;

// Wraps the model of a run (a sabotage).
using Wrap = std::function<std::shared_ptr<Model>(std::shared_ptr<Model>)>;

// Trains s.steps global batches as replica `replica` of `replicas`; every
// rank ends with every block's whole weights.
inline Result train(const Spec& s, std::shared_ptr<comm::Communicator> comm, bool split, const Wrap& wrap = {}) {
  const int ranks = comm ? comm->size() : 1;
  const int replicas = split ? ranks / (s.sp * s.tp) : ranks;
  std::shared_ptr<Model> m = llama(s);
  if (wrap) m = wrap(m);
  Engine e = Engine::initialize(m, run_config(s, replicas, split), ranks > 1 ? comm : nullptr);
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
inline std::shared_ptr<comm::Communicator> replicas_of(const Spec& s) {
  const int per = s.sp * s.tp;
  return std::shared_ptr<comm::Communicator>(g_world->split(g_world->rank() % per, g_world->rank() / per));
}

// Tolerances as the tensor parts' (tests/engine/tensor_parallel_test.cpp):
// fp32 sums in another order over 20 AdamW steps at lr 1e-2, where a
// rounding in a near-zero gradient moves a weight by up to ~1e-4; bf16
// rounds each slice's matmul rows where one rank rounds them all: looser.
inline void expect_same_run(const Spec& s, const std::string& what) {
  if (g_world->size() % (s.sp * s.tp) != 0) return;  // 4 sequence ranks at 2 ranks
  const Result ref = train(s, replicas_of(s), false);
  const Result got = train(s, g_world, true);
  Spec start = s;
  start.steps = 0;
  testing::expect_close_runs(got, ref, train(start, g_world, true).weights, s.bf16 ? 2e-2 : 1e-4,
                             s.bf16 ? 5e-2 : 5e-4, what);
}

}  // namespace testing_sequence
}  // namespace zinc
