// The built-in models' backward against finite differences of their own
// forward, through a test StepContext that holds fp32 parameters. Per block,
// the directional derivative along a random direction (central differences,
// h = 1e-2 on unit-RMS directions scaled to the block) must match g . d.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <memory>
#include <string>
#include <vector>

#include "core/alloc.h"
#include "core/rng.h"
#include "engine/model.h"
#include "models/models.h"
#include "core/device.h"
#include "core/error.h"

namespace zinc {
namespace {

class TestContext final : public StepContext {
 public:
  explicit TestContext(const Model& m, uint64_t seed) {
    for (const BlockSpec& s : m.blocks()) {
      layouts.push_back(BlockLayout::from_spec(s));
      params.emplace_back(static_cast<size_t>(layouts.back().numel), 0.0f);
      grad_bufs.emplace_back(static_cast<size_t>(layouts.back().numel), 0.0f);
    }
    Rng rng(seed);
    // Larger-than-GPT-2 init so every path carries signal in a tiny model.
    for (size_t b = 0; b < params.size(); ++b)
      for (float& x : params[b]) x = static_cast<float>(rng.normal() * 0.3);
    ready.assign(params.size(), 0);
  }
  DType compute_dtype() const override { return DType::kF32; }
  BlockParams acquire_params(int b) override { return {params[b].data(), DType::kF32, &layouts[b]}; }
  void release_params(int) noexcept override {}
  BlockGrads grads(int b) override { return {grad_bufs[b].data(), &layouts[b]}; }
  void grads_ready(int b) override { ready[b] += 1; }

  std::vector<BlockLayout> layouts;
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> grad_bufs;
  std::vector<int> ready;
};

Batch random_batch(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  Rng rng(seed);
  Batch b;
  b.B = B;
  b.T = T;
  for (int64_t i = 0; i < B * T; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.below(V)));
    b.targets.push_back(static_cast<int32_t>(rng.below(V)));
  }
  return b;
}

void check_model_gradients(Model& model, const Batch& batch) {
  TestContext ctx(model, 3);
  model.forward(ctx, batch);
  const float scale = 0.7f;  // backward must honour the loss scale
  model.backward(ctx, scale);
  for (size_t b = 0; b < ctx.ready.size(); ++b) EXPECT_EQ(ctx.ready[b], 1) << "block " << b;

  Rng rng(99);
  for (size_t b = 0; b < ctx.params.size(); ++b) {
    std::vector<float>& p = ctx.params[b];
    std::vector<double> d(p.size());
    double gd = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      d[i] = rng.normal();
      gd += d[i] * ctx.grad_bufs[b][i] / scale;
    }
    const double h = 1e-2;
    std::vector<float> saved = p;
    for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<float>(saved[i] + h * d[i]);
    double lp = model.forward(ctx, batch);
    for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<float>(saved[i] - h * d[i]);
    double lm = model.forward(ctx, batch);
    p = saved;
    double fd = (lp - lm) / (2 * h);
    // fp32 forward: loss rounding ~1e-7 / h plus O(h^2) curvature terms.
    EXPECT_NEAR(gd, fd, 2e-3 + 2e-2 * std::fabs(fd)) << model.name() << " block " << b;
  }
}

TEST(GptBackward, AgreesWithFiniteDifferencesPerBlock) {
  models::GptConfig c;
  c.vocab_size = 11;
  c.block_size = 7;
  c.n_layer = 2;
  c.n_head = 3;
  c.n_embd = 9;
  auto m = models::make_gpt(c);
  check_model_gradients(*m, random_batch(3, 5, 11, 1));  // T < block_size on purpose
}

TEST(LlamaBackward, AgreesWithFiniteDifferencesPerBlock) {
  // GQA 4:2 with head_dim 4 != hidden / heads, every bias, llama3 rope scaling, untied head.
  models::LlamaConfig c;
  c.vocab_size = 11;
  c.hidden_size = 9;
  c.intermediate_size = 7;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.max_position_embeddings = 8;
  c.qkv_bias = c.o_bias = c.mlp_bias = true;
  c.rope_scaling.type = models::RopeScaling::Type::kLlama3;
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 4;
  auto m = models::make_llama(c);
  check_model_gradients(*m, random_batch(2, 6, 11, 3));
  // Tied, no biases, multi-head (kv heads = heads), linear scaling.
  models::LlamaConfig t;
  t.vocab_size = 13;
  t.hidden_size = 8;
  t.intermediate_size = 12;
  t.num_hidden_layers = 1;
  t.num_attention_heads = 2;
  t.max_position_embeddings = 8;
  t.tie_word_embeddings = true;
  t.rope_scaling.type = models::RopeScaling::Type::kLinear;
  t.rope_scaling.factor = 2.0;
  auto tied = models::make_llama(t);
  EXPECT_EQ(tied->blocks().back().params.size(), 1u);  // no lm_head
  check_model_gradients(*tied, random_batch(3, 5, 13, 4));
  // Qwen3's per-head norms of q and k (qk_norm), GQA 4:2, head_dim 6.
  models::LlamaConfig q = c;
  q.qk_norm = true;
  q.head_dim = 6;
  q.qkv_bias = q.o_bias = q.mlp_bias = false;
  auto qwen3 = models::make_llama(q);
  ASSERT_EQ(qwen3->blocks()[1].params[2].name, "self_attn.q_norm.weight");
  check_model_gradients(*qwen3, random_batch(2, 6, 11, 6));
}

TEST(LlamaBackward, CheckpointedLayersGiveTheSameGradients) {
  models::LlamaConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 10;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.max_position_embeddings = 8;
  for (bool qk_norm : {false, true}) {  // the llama, and Qwen3's per-head norms
    c.qk_norm = qk_norm;
    c.gradient_checkpointing = false;
    auto plain = models::make_llama(c);
    c.gradient_checkpointing = true;
    auto ckpt = models::make_llama(c);
    Batch batch = random_batch(2, 7, 11, 5);
    TestContext a(*plain, 7), b(*ckpt, 7);
    EXPECT_EQ(plain->forward(a, batch), ckpt->forward(b, batch));
    plain->backward(a, 1.0f);
    ckpt->backward(b, 1.0f);
    for (size_t k = 0; k < a.grad_bufs.size(); ++k)
      EXPECT_EQ(std::memcmp(a.grad_bufs[k].data(), b.grad_bufs[k].data(), a.grad_bufs[k].size() * 4), 0)
          << "block " << k << " qk_norm " << qk_norm;
  }
}

TEST(LlamaConfig, SizeRulesNameTheField) {
  models::LlamaConfig c;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 3;
  ASSERT_TRUE(models::size_error(c));
  EXPECT_EQ(models::size_error(c)->field, "num_key_value_heads");
  c.num_key_value_heads = 2;
  c.hidden_size = 10;
  EXPECT_EQ(models::size_error(c)->field, "hidden_size");
  c.head_dim = 5;
  EXPECT_EQ(models::size_error(c)->field, "head_dim");
  c.head_dim = 6;
  EXPECT_FALSE(models::size_error(c));
  EXPECT_THROW(models::make_llama([] {
                 models::LlamaConfig d;
                 d.num_attention_heads = 0;
                 return d;
               }()),
               Error);
}

TEST(MlpBackward, AgreesWithFiniteDifferencesPerBlock) {
  models::MlpConfig c;
  c.vocab_size = 11;
  c.context = 3;
  c.n_embd = 5;
  c.hidden = 13;
  c.n_layer = 2;
  auto m = models::make_mlp(c);
  check_model_gradients(*m, random_batch(2, 6, 11, 2));
}

// Packed documents (Batch::positions): a token's context window stops at its
// document's start, so another earlier document changes neither the later
// one's loss nor any gradient (the earlier document's targets masked).
// The window once read across the boundary.
TEST(MlpForward, PackedDocumentsDoNotSeeEachOther) {
  models::MlpConfig c;
  c.vocab_size = 11;
  c.context = 4;
  c.n_embd = 5;
  c.hidden = 13;
  c.n_layer = 2;
  auto m = models::make_mlp(c);
  Batch a = random_batch(1, 8, 11, 3);
  a.positions = {0, 1, 2, 0, 1, 2, 3, 4};  // documents [0, 3) and [3, 8)
  for (int t = 0; t < 3; ++t) a.targets[static_cast<size_t>(t)] = -100;
  Batch b = a;
  for (int t = 0; t < 3; ++t) b.inputs[static_cast<size_t>(t)] = (a.inputs[static_cast<size_t>(t)] + 5) % 11;
  TestContext ca(*m, 3), cb(*m, 3);
  const float la = m->forward(ca, a);
  m->backward(ca, 1.0f);
  const float lb = m->forward(cb, b);
  m->backward(cb, 1.0f);
  EXPECT_EQ(la, lb);
  for (size_t k = 0; k < ca.grad_bufs.size(); ++k)
    EXPECT_EQ(ca.grad_bufs[k], cb.grad_bufs[k]) << "block " << k;
  Batch whole = a;  // one document: the window reads the earlier tokens
  whole.positions.clear();
  Batch whole_b = b;
  whole_b.positions.clear();
  TestContext cw(*m, 3), cwb(*m, 3);
  EXPECT_NE(m->forward(cw, whole), m->forward(cwb, whole_b));
}

TEST(Gpt, BlocksAreEmbeddingsLayersAndFinalNormWithGpt2Init) {
  models::GptConfig c;
  c.n_layer = 3;
  c.n_embd = 16;
  c.n_head = 4;
  c.vocab_size = 50;
  c.block_size = 32;
  auto m = models::make_gpt(c);
  const auto& blocks = m->blocks();
  ASSERT_EQ(blocks.size(), 5u);
  EXPECT_EQ(blocks[0].params[0].shape, (Shape{50, 16}));
  EXPECT_EQ(blocks[0].params[1].shape, (Shape{32, 16}));
  EXPECT_EQ(blocks[4].params.size(), 2u);  // final LayerNorm
  // Residual projections scaled by 1/sqrt(2 n_layer).
  for (const ParamSpec& p : blocks[1].params) {
    if (p.name == "attn.c_proj.weight" || p.name == "mlp.c_proj.weight") {
      EXPECT_NEAR(p.init_std, 0.02 / std::sqrt(6.0), 1e-7) << p.name;
    } else if (p.init == Init::kNormal) {
      EXPECT_FLOAT_EQ(p.init_std, 0.02f) << p.name;
    }
  }
  EXPECT_THROW(models::make_gpt({50, 32, 3, 5, 16}), Error);  // 16 % 5 != 0
}

// One place for the size rules: size_error names the field (zinc-train
// reports it at model.FIELD) and make_gpt / make_mlp throw the same rule.
TEST(ModelSizes, SizeErrorNamesTheFieldAndMakeThrowsIt) {
  models::GptConfig g;
  EXPECT_FALSE(models::size_error(g).has_value());
  g.n_embd = 100;
  g.n_head = 3;
  auto bad = models::size_error(g);
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->field, "n_embd");
  EXPECT_EQ(bad->message, "must be divisible by n_head 3, got 100");
  try {
    models::make_gpt(g);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "gpt: n_embd: must be divisible by n_head 3, got 100");
  }
  g = {};
  g.vocab_size = 1;
  EXPECT_EQ(models::size_error(g)->field, "vocab_size");
  g = {};
  g.block_size = 0;
  EXPECT_EQ(models::size_error(g)->message, "must be >= 1, got 0");

  models::MlpConfig m;
  EXPECT_FALSE(models::size_error(m).has_value());
  m.hidden = 0;
  EXPECT_EQ(models::size_error(m)->field, "hidden");
  EXPECT_THROW(models::make_mlp(m), Error);
}

TEST(Gpt, TokenOutsideTheVocabularyIsAnError) {
  models::GptConfig c;
  c.vocab_size = 5;
  c.block_size = 4;
  c.n_layer = 1;
  c.n_head = 1;
  c.n_embd = 4;
  auto m = models::make_gpt(c);
  TestContext ctx(*m, 1);
  Batch b = random_batch(1, 4, 5, 3);
  b.inputs[2] = 9;
  EXPECT_THROW(m->forward(ctx, b), Error);
}


// Note [activation checkpointing] (models/gpt/model.cpp): recomputing each layer in
// backward gives the same loss, the same acquire order (ZeRO-3 prefetches
// along it) and bit-identical gradients, in fp32 and in bf16 with either
// bf16 operand path (native bf16, or rounded and multiplied in fp32), over
// two micro-batches of different shapes accumulating into the same buffers.
class RecordingContext final : public StepContext {
 public:
  RecordingContext(const Model& m, DType dt) : dt_(dt) {
    Rng rng(5);
    for (const BlockSpec& s : m.blocks()) {
      layouts.push_back(BlockLayout::from_spec(s));
      const size_t n = static_cast<size_t>(layouts.back().numel);
      std::vector<float> p(n);
      for (float& x : p) x = static_cast<float>(rng.normal() * 0.3);
      f32.push_back(p);
      std::vector<bf16> q(n);
      for (size_t i = 0; i < n; ++i) q[i] = float_to_bf16(p[i]);
      b16.push_back(q);
      grad_bufs.emplace_back(n, 0.0f);
    }
  }
  DType compute_dtype() const override { return dt_; }
  BlockParams acquire_params(int b) override {
    order.push_back(b);
    const void* base = dt_ == DType::kF32 ? static_cast<const void*>(f32[b].data()) : b16[b].data();
    return {base, dt_, &layouts[b]};
  }
  void release_params(int) noexcept override {}
  BlockGrads grads(int b) override { return {grad_bufs[b].data(), &layouts[b]}; }
  void grads_ready(int) override {}

  DType dt_;
  std::vector<BlockLayout> layouts;
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<bf16>> b16;
  std::vector<std::vector<float>> grad_bufs;
  std::vector<int> order;
};

TEST(GptCheckpointing, LossAcquireOrderAndGradientsAreBitIdentical) {
  models::GptConfig c;
  c.vocab_size = 37;
  c.block_size = 16;
  c.n_layer = 3;
  c.n_head = 2;
  c.n_embd = 24;
  struct Case {
    DType dt;
    kernels::MatmulBf16Path path;
    const char* what;
  };
  for (const Case& k : {Case{DType::kF32, kernels::MatmulBf16Path::kAuto, "fp32"},
                        Case{DType::kBF16, kernels::MatmulBf16Path::kAuto, "bf16"},
                        Case{DType::kBF16, kernels::MatmulBf16Path::kViaF32, "bf16 via fp32"}}) {
    kernels::set_matmul_bf16_path_for_testing(k.path);
    std::vector<float> losses[2];
    std::vector<std::vector<float>> grads[2];
    std::vector<int> order[2];
    for (int ck = 0; ck < 2; ++ck) {
      models::GptConfig cc = c;
      cc.gradient_checkpointing = ck == 1;
      auto m = models::make_gpt(cc);
      RecordingContext ctx(*m, k.dt);
      // Two shapes (the buffers regrow), a forward-only pass in between
      // (evaluation), and backward twice into the same gradient buffers.
      for (auto [B, T, seed] : {std::tuple<int64_t, int64_t, uint64_t>{3, 16, 1}, {2, 11, 2}}) {
        losses[ck].push_back(m->forward(ctx, random_batch(B + 1, T, 37, seed + 10)));
        losses[ck].push_back(m->forward(ctx, random_batch(B, T, 37, seed)));
        m->backward(ctx, 0.5f);
      }
      grads[ck] = ctx.grad_bufs;
      order[ck] = ctx.order;
    }
    EXPECT_EQ(losses[0], losses[1]) << k.what;
    EXPECT_EQ(order[0], order[1]) << k.what;
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (size_t b = 0; b < grads[0].size(); ++b) {
      ASSERT_EQ(grads[0][b].size(), grads[1][b].size());
      EXPECT_EQ(0, std::memcmp(grads[0][b].data(), grads[1][b].data(), grads[0][b].size() * sizeof(float)))
          << k.what << ": block " << b << " differs";
      double norm = 0;
      for (float g : grads[1][b]) norm += double(g) * g;
      EXPECT_GT(norm, 0) << k.what << ": block " << b;  // every block received a gradient
    }
  }
  kernels::set_matmul_bf16_path_for_testing(kernels::MatmulBf16Path::kAuto);
}

// The checkpointed layout holds one set of layer activations instead of
// n_layer: the model's own accounting says so, and the finite-difference
// check passes through the recomputing backward.
TEST(GptCheckpointing, HoldsOneSetOfLayerActivationsAndAgreesWithFiniteDifferences) {
  models::GptConfig c;
  c.vocab_size = 11;
  c.block_size = 7;
  c.n_layer = 3;
  c.n_head = 3;
  c.n_embd = 9;
  auto plain = models::make_gpt(c);
  c.gradient_checkpointing = true;
  auto ck = models::make_gpt(c);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const ActivationMemory a = *plain->activation_memory(4, 7, dt), b = *ck->activation_memory(4, 7, dt);
    EXPECT_LT(b.saved, a.saved);
    EXPECT_EQ(b.workspace, a.workspace);  // the same kernel calls by shape
    // n_layer sets against one, and each set is the same size: the
    // difference is (n_layer - 1) sets, the same as between 3 and 1 layers.
    models::GptConfig one = c;
    one.n_layer = 1;
    one.gradient_checkpointing = false;
    models::GptConfig three = one;
    three.n_layer = 3;
    const int64_t per_layer_plain = (*models::make_gpt(three)->activation_memory(4, 7, dt)).saved -
                                    (*models::make_gpt(one)->activation_memory(4, 7, dt)).saved;
    EXPECT_GT(per_layer_plain, 0);
    const int64_t x_in = 2 * static_cast<int64_t>(round_up(4 * 7 * 9 * sizeof(float), kSimdAlign));
    EXPECT_EQ(a.saved - b.saved, per_layer_plain - x_in);
  }
  check_model_gradients(*ck, random_batch(3, 5, 11, 1));
}

}  // namespace
}  // namespace zinc

// A GPT on the GPU without one (or without a CUDA build) is refused at
// construction with the reason; with a GPU it reports the device.
TEST(GptDevice, CudaNeedsAGpu) {
  zinc::models::GptConfig g;
  g.device = zinc::Device::kCuda;
  if (zinc::cuda_status().devices > 0) {
    EXPECT_EQ(zinc::models::make_gpt(g)->device(), zinc::Device::kCuda);
    return;
  }
  try {
    zinc::models::make_gpt(g);
    FAIL() << "expected an error";
  } catch (const zinc::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("device \"cuda\""), std::string::npos) << m;
    EXPECT_NE(m.find(zinc::cuda_status().built ? "no GPU is visible" : "built without CUDA"), std::string::npos) << m;
  }
  g.device = zinc::Device::kCpu;
  EXPECT_EQ(zinc::models::make_gpt(g)->device(), zinc::Device::kCpu);
}
