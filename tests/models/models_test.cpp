// The built-in models' backward against finite differences of their own
// forward, through a test StepContext that holds fp32 parameters. Per block,
// the directional derivative along a random direction (central differences,
// h = 1e-2 on unit-RMS directions scaled to the block) must match g . d.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "engine/model.h"
#include "models/models.h"

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

}  // namespace
}  // namespace zinc
