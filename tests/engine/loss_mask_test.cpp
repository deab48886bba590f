// Masked targets and packed documents through the engine, on one rank
// (issue 31). The normaliser across ranks and micro-batches is in
// engine_multirank_test.cpp.
//
// Tolerances: a masked run and the run it is compared with compute the same
// sums over different matrix shapes (T differs), so oneDNN adds in another
// order; the losses agree to ~1e-7 relative and are checked to 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/data.h"
#include "engine/engine.h"
#include "models/models.h"
#include "tests/engine/train_util.h"

namespace zinc {
namespace {

constexpr int64_t kV = 17;

std::shared_ptr<Model> make(const std::string& kind) {
  if (kind == "gpt") {
    models::GptConfig g;
    g.vocab_size = kV;
    g.block_size = 16;
    g.n_layer = 2;
    g.n_head = 2;
    g.n_embd = 12;
    return models::make_gpt(g);
  }
  if (kind == "llama") {  // GQA 4:2 with q/k/v biases
    models::LlamaConfig c;
    c.vocab_size = kV;
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 16;
    c.qkv_bias = true;
    return models::make_llama(c);
  }
  models::MlpConfig m;
  m.vocab_size = kV;
  m.context = 3;
  m.n_embd = 6;
  m.hidden = 20;
  m.n_layer = 2;
  return models::make_mlp(m);
}

// AdamW with eps 1 and no weight decay: the first update is lr g / (|g| + 1),
// monotone and close to linear in each gradient, so two runs' first updates
// compare their gradients (Adam's usual eps would map any rounding noise on a
// zero gradient to a full step of lr).
nlohmann::json config(int stage, int64_t micro = 1) {
  return {{"train_micro_batch_size_per_gpu", micro},
          {"gradient_accumulation_steps", 1},
          {"zero_optimization", {{"stage", stage}}},
          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}, {"eps", 1.0}, {"weight_decay", 0.0}}}}}};
}

struct StepResult {
  double loss = 0, norm = 0;
  std::vector<float> update;  // weights after - before
};

StepResult one_step(const std::string& kind, int stage, const Batch& batch) {
  Engine e = Engine::initialize(make(kind), config(stage, batch.B));
  const std::vector<float> w0 = testing_train::all_weights(e);
  StepResult r;
  r.loss = e.forward(batch);
  e.backward();
  e.step();
  r.norm = e.global_grad_norm();
  std::vector<float> w1 = testing_train::all_weights(e);
  r.update.resize(w0.size());
  for (size_t i = 0; i < w0.size(); ++i) r.update[i] = w1[i] - w0[i];
  return r;
}

// max |a - b| over max |b|.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(double(a[i]) - b[i]));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return m > 0 ? d / m : d;
}

Batch random_batch(int64_t B, int64_t T, uint64_t seed) {
  Rng rng(seed);
  Batch b;
  b.B = B;
  b.T = T;
  for (int64_t i = 0; i < B * T; ++i) {
    b.inputs.push_back(static_cast<int32_t>(rng.below(kV)));
    b.targets.push_back(static_cast<int32_t>(rng.below(kV)));
  }
  return b;
}

// The first T' positions of every row.
Batch cut(const Batch& b, int64_t T2) {
  Batch c;
  c.B = b.B;
  c.T = T2;
  for (int64_t r = 0; r < b.B; ++r)
    for (int64_t t = 0; t < T2; ++t) {
      c.inputs.push_back(b.inputs[static_cast<size_t>(r * b.T + t)]);
      c.targets.push_back(b.targets[static_cast<size_t>(r * b.T + t)]);
    }
  return c;
}

// Masking the targets of the last positions of every row gives the loss,
// the gradient norm and the update of the run in which those positions are
// not there at all: a causal model's earlier positions never see them, and
// the mean is over the same targets.
TEST(LossMask, MaskedTargetsEqualTheRunWithThosePositionsCutAway) {
  for (const std::string kind : {"gpt", "llama", "mlp"})
    for (int stage : {0, 3}) {
      const std::string what = kind + " stage " + std::to_string(stage);
      Batch full = random_batch(3, 11, 5);
      const int64_t keep = 7;
      Batch masked = full;
      for (int64_t r = 0; r < full.B; ++r)
        for (int64_t t = keep; t < full.T; ++t) masked.targets[static_cast<size_t>(r * full.T + t)] = kIgnoreTarget;
      const StepResult a = one_step(kind, stage, masked), b = one_step(kind, stage, cut(full, keep));
      EXPECT_NEAR(a.loss, b.loss, 1e-5 * b.loss) << what;
      EXPECT_NEAR(a.norm, b.norm, 1e-5 * b.norm) << what;
      EXPECT_GT(b.norm, 0) << what;
      EXPECT_LT(rel_diff(a.update, b.update), 1e-4) << what;
      // And the masked positions did count for nothing: unmasked, the
      // update differs (the loss barely does at initialisation, near log V).
      const StepResult u = one_step(kind, stage, full);
      EXPECT_GT(rel_diff(u.update, b.update), 1e-2) << what;
    }
}

// A micro-batch without targets adds zero loss and zero gradient (no NaN)
// to the step: accumulated with one that has targets, the step equals that
// one alone. forward() says it has no loss (NaN, as PyTorch's mean cross
// entropy over no target), not 0, which would read as a perfect one.
TEST(LossMask, AMicroBatchWithoutTargetsAddsNothing) {
  Batch with = random_batch(2, 9, 7), none = random_batch(2, 9, 8);
  std::fill(none.targets.begin(), none.targets.end(), kIgnoreTarget);
  nlohmann::json cfg = config(2, 2);
  cfg["gradient_accumulation_steps"] = 2;
  Engine e = Engine::initialize(make("gpt"), cfg);
  EXPECT_TRUE(std::isnan(e.forward(none)));
  e.backward();
  e.step();
  const float l = e.forward(with);
  e.backward();
  e.step();
  const double norm = e.global_grad_norm();
  EXPECT_TRUE(std::isfinite(norm));
  // The same micro-batch alone, gas 1 (the normaliser: its own targets).
  Engine ref = Engine::initialize(make("gpt"), config(2, 2));
  const float lr = ref.forward(with);
  ref.backward();
  ref.step();
  EXPECT_EQ(l, lr);
  EXPECT_NEAR(norm, ref.global_grad_norm(), 1e-6 * norm);
  EXPECT_LT(rel_diff(testing_train::all_weights(e), testing_train::all_weights(ref)), 1e-6);
}

// A global batch whose every target is masked skips its update (nothing to
// learn from; a 0/0 mean would be NaN) and says so; the weights stay.
TEST(LossMask, AGlobalBatchWithoutTargetsSkipsItsUpdate) {
  Batch none = random_batch(2, 9, 8);
  std::fill(none.targets.begin(), none.targets.end(), kIgnoreTarget);
  Engine e = Engine::initialize(make("llama"), config(0, 2));
  const std::vector<float> w0 = testing_train::all_weights(e);
  EXPECT_TRUE(std::isnan(e.forward(none)));
  e.backward();
  e.step();
  EXPECT_EQ(testing_train::all_weights(e), w0);
  EXPECT_EQ(e.skipped_steps(), 1);
}

TEST(LossMask, ATargetBelowZeroOtherThanTheIgnoreIndexIsAnError) {
  Batch b = random_batch(1, 5, 3);
  b.targets[2] = -1;
  Engine e = Engine::initialize(make("gpt"), config(0));
  try {
    e.forward(b);
    FAIL() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("target -1 at row 2"), std::string::npos) << err.what();
  }
}

// ---- packed documents --------------------------------------------------------------

// Documents of the given lengths, random tokens; a document's last target
// is masked (nothing follows it).
struct Docs {
  std::vector<std::vector<int32_t>> tokens;
};
Docs random_docs(const std::vector<int64_t>& lengths, uint64_t seed) {
  Rng rng(seed);
  Docs d;
  for (int64_t L : lengths) {
    d.tokens.emplace_back();
    for (int64_t i = 0; i < L; ++i) d.tokens.back().push_back(static_cast<int32_t>(rng.below(kV)));
  }
  return d;
}

// One row holding every document, with only document `only`'s targets (all
// of them when only < 0).
Batch packed(const Docs& d, int only) {
  Batch b;
  b.B = 1;
  for (size_t k = 0; k < d.tokens.size(); ++k) {
    const std::vector<int32_t>& x = d.tokens[k];
    for (size_t i = 0; i < x.size(); ++i) {
      b.inputs.push_back(x[i]);
      const bool counted = only < 0 || static_cast<int>(k) == only;
      b.targets.push_back(i + 1 < x.size() && counted ? x[i + 1] : kIgnoreTarget);
      b.positions.push_back(static_cast<int32_t>(i));
    }
  }
  b.T = static_cast<int64_t>(b.inputs.size());
  return b;
}
Batch alone(const Docs& d, int k) {
  Batch b;
  b.B = 1;
  const std::vector<int32_t>& x = d.tokens[static_cast<size_t>(k)];
  for (size_t i = 0; i < x.size(); ++i) {
    b.inputs.push_back(x[i]);
    b.targets.push_back(i + 1 < x.size() ? x[i + 1] : kIgnoreTarget);
  }
  b.T = static_cast<int64_t>(b.inputs.size());
  return b;
}

// Packed documents give each document the loss and the gradient it has
// alone: attention stays inside the document and positions restart.
TEST(PackedDocuments, EachDocumentHasTheLossAndGradientItHasAlone) {
  const Docs d = random_docs({6, 4, 5}, 11);
  for (const std::string kind : {"gpt", "llama"})
    for (int stage : {0, 3})
      for (int k = 0; k < 3; ++k) {
        const std::string what = kind + " stage " + std::to_string(stage) + " document " + std::to_string(k);
        const StepResult p = one_step(kind, stage, packed(d, k)), a = one_step(kind, stage, alone(d, k));
        EXPECT_NEAR(p.loss, a.loss, 1e-5 * a.loss) << what;
        EXPECT_NEAR(p.norm, a.norm, 1e-5 * a.norm) << what;
        EXPECT_LT(rel_diff(p.update, a.update), 1e-4) << what;
      }
  // Without positions the later documents attend to the earlier ones and
  // sit at other positions: their losses differ (the test can fail).
  for (const std::string kind : {"gpt", "llama"}) {
    Batch flat = packed(d, 2);
    flat.positions.clear();
    EXPECT_GT(std::fabs(one_step(kind, 0, flat).loss - one_step(kind, 0, alone(d, 2)).loss), 1e-4) << kind;
  }
}

// All documents at once: the loss is the mean over every document's targets.
TEST(PackedDocuments, TheLossOfAPackedRowIsTheMeanOverItsDocumentsTargets) {
  const Docs d = random_docs({5, 7, 3}, 12);
  double sum = 0, n = 0;
  for (int k = 0; k < 3; ++k) {
    const double len = static_cast<double>(d.tokens[static_cast<size_t>(k)].size()) - 1;
    sum += one_step("llama", 0, alone(d, k)).loss * len;
    n += len;
  }
  EXPECT_NEAR(one_step("llama", 0, packed(d, -1)).loss, sum / n, 1e-5 * sum / n);
}

TEST(PackedDocuments, PositionsThatAreNotDocumentsAreRefusedNamingTheToken) {
  Engine e = Engine::initialize(make("gpt"), config(0, 2));
  Batch b = random_batch(2, 6, 4);
  auto message = [&](std::vector<int32_t> pos) -> std::string {
    b.positions = std::move(pos);
    try {
      e.evaluate(b);
    } catch (const Error& err) {
      return err.what();
    }
    return "";
  };
  EXPECT_NE(message({0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 3, 4}).find("row 1, token 4 has position 3"), std::string::npos);
  EXPECT_NE(message({1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5}).find("row 0, token 0 has position 1"), std::string::npos);
  EXPECT_NE(message({0, 1, 2}).find("expected none or B*T = 12, got 3"), std::string::npos);
  EXPECT_EQ(message({0, 1, 2, 0, 1, 2, 0, 0, 0, 1, 2, 3}), "");
}

}  // namespace
}  // namespace zinc
