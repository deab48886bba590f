// Hugging Face checkpoints against transformers itself: each fixture of
// tests/fixtures/hf (made by make_fixtures.py with the real transformers,
// references in float64) is loaded by zinc, which must reproduce
// transformers' logits (max abs 1e-4), loss (relative 1e-5) and every
// parameter's gradient (relative L2 1e-4), in fp32; through the engine at
// every stage the loaded weights must be the file's and the loss and the
// gradient norm transformers'. Bad folders give one error naming the file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "models/gpt/gpt.h"
#include "models/llama/llama.h"
#include "tools/experiment.h"
#include "tools/hf_model.h"
#include "tools/safetensors.h"
#include "tools/safetensors_read.h"
#include "tests/tools/hf_test_util.h"

namespace zinc::tools {
namespace {

// What a family read from a config.json (the test fails, not crashes, on another family's).
const models::LlamaConfig& llama_of(const HfConfig& c) {
  static const models::LlamaConfig kNone;
  const models::LlamaConfig* l = models::llama::settings(*c.model);
  EXPECT_NE(l, nullptr) << c.architecture << " is not a llama";
  return l ? *l : kNone;
}
const models::GptConfig& gpt_of(const HfConfig& c) {
  static const models::GptConfig kNone;
  const models::GptConfig* g = models::gpt::settings(*c.model);
  EXPECT_NE(g, nullptr) << c.architecture << " is not a gpt";
  return g ? *g : kNone;
}

namespace fs = std::filesystem;

// A zinc parameter (rows, cols) split back into the file's tensors, each in
// the file's layout: name -> values.
std::map<std::string, std::vector<float>> to_hf(const std::vector<HfPiece>& pieces, const float* zinc, int64_t numel) {
  int64_t rows = 0;
  for (const HfPiece& p : pieces) rows += p.rows;
  const int64_t cols = numel / rows;
  std::map<std::string, std::vector<float>> out;
  int64_t r0 = 0;
  for (const HfPiece& p : pieces) {
    // A part of a tensor (file_row >= 0) fills its rows of the whole one.
    const int64_t file_rows = p.file_row < 0 ? p.rows : p.shape.empty() ? 1 : p.shape[0];
    const int64_t at = p.file_row < 0 ? 0 : p.file_row;
    std::vector<float>& v = out[p.name];
    v.resize(static_cast<size_t>(file_rows * cols));
    for (int64_t r = 0; r < p.rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float x = zinc[(r0 + r) * cols + c];
        v[static_cast<size_t>(p.transposed ? c * p.rows + r : (at + r) * cols + c)] = x;
      }
    r0 += p.rows;
  }
  return out;
}

class HfFixture : public testing::TestWithParam<std::string> {};

TEST_P(HfFixture, LogitsLossAndGradientsMatchTransformers) {
  const std::string dir = fixture(GetParam());
  HfConfig cfg = read_hf_config(dir);
  auto model = load_pretrained(cfg);
  Reference ref(dir);
  HostContext ctx(*model);
  const float loss = model->forward(ctx, ref.batch());
  std::vector<float> logits(model->logits().begin(), model->logits().end());
  ASSERT_EQ(logits.size(), ref.logits.size());
  EXPECT_LE(max_abs_diff(logits, ref.logits), 1e-4) << GetParam();
  EXPECT_NEAR(loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << GetParam();
  model->backward(ctx, 1.0f);

  // Every transformers parameter's gradient, from zinc's gradient buffers.
  const std::string prefix = cfg.family->export_prefix;
  auto pieces = hf_pieces(cfg, *model, prefix);
  size_t compared = 0;
  for (size_t b = 0; b < pieces.size(); ++b)
    for (size_t p = 0; p < pieces[b].size(); ++p) {
      auto hf = to_hf(pieces[b][p], ctx.grads_[b].data() + ctx.layouts[b].offsets[p], ctx.layouts[b].numels[p]);
      for (const auto& [name, got] : hf) {
        std::vector<float> want = ref.floats("grad." + name);
        ASSERT_EQ(got.size(), want.size()) << name;
        double num = 0, den = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          num += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
          den += static_cast<double>(want[i]) * want[i];
        }
        EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 1e-4) << GetParam() << " " << name;
        ++compared;
      }
    }
  // As many gradients as transformers' named_parameters.
  size_t grads = 0;
  for (const StoredTensor& t : ref.file.tensors()) grads += t.name.rfind("grad.", 0) == 0;
  EXPECT_EQ(compared, grads) << GetParam();
}

// longrope picks its factors by the batch's largest position + 1, as
// transformers does: Phi-3's fixture (original length 8) with each row two
// packed documents of 6 tokens must give, token for token, the logits of
// the documents run alone (6 <= 8: the short factors), although the rows
// are 12 long.
TEST(HfModel, LongropePicksItsFactorsByTheLargestPosition) {
  const std::string dir = fixture("phi3");
  HfConfig cfg = read_hf_config(dir);
  auto model = load_pretrained(cfg);
  Reference ref(dir);
  HostContext ctx(*model);
  Batch packed = ref.batch();
  packed.positions.resize(packed.inputs.size());
  for (size_t i = 0; i < packed.positions.size(); ++i) packed.positions[i] = static_cast<int32_t>(i % 12 % 6);
  model->forward(ctx, packed);
  const std::vector<float> got(model->logits().begin(), model->logits().end());
  const int64_t V = cfg.model->vocab_size();
  for (int64_t doc = 0; doc < 4; ++doc) {
    Batch alone;
    alone.B = 1;
    alone.T = 6;
    alone.inputs.assign(packed.inputs.begin() + doc * 6, packed.inputs.begin() + doc * 6 + 6);
    alone.targets.assign(packed.targets.begin() + doc * 6, packed.targets.begin() + doc * 6 + 6);
    model->forward(ctx, alone);
    const std::vector<float> want(model->logits().begin(), model->logits().end());
    std::vector<float> part(got.begin() + doc * 6 * V, got.begin() + (doc + 1) * 6 * V);
    EXPECT_LE(max_abs_diff(part, want), 1e-5) << "document " << doc;
  }
}

// Through the engine: the weights a rank holds are the file's (stage 3
// reads only its shard), and the loss and the gradient norm are
// transformers'.
TEST_P(HfFixture, EngineLoadsTheWeightsAtEveryStage) {
  const std::string dir = fixture(GetParam());
  HfConfig cfg = read_hf_config(dir);
  Reference ref(dir);
  // The reference gradient norm over transformers' parameters (a tied
  // embedding counted once, as zinc holds it once).
  const double sq = reference_grad_squares(ref);
  for (int stage : {0, 1, 2, 3}) {
    auto model = load_pretrained(cfg);
    HostContext want(*model);
    nlohmann::json ds = {{"train_batch_size", ref.B},
                         {"train_micro_batch_size_per_gpu", ref.B},
                         {"gradient_clipping", 0.0},
                         {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                         {"zero_optimization", {{"stage", stage}}}};
    if (stage == 3) ds["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
    Engine engine = Engine::initialize(model, ds);
    for (size_t b = 0; b < want.params.size(); ++b) {
      std::vector<float> got = engine.full_params(static_cast<int>(b));
      got.resize(want.params[b].size());
      EXPECT_EQ(std::memcmp(got.data(), want.params[b].data(), got.size() * 4), 0)
          << GetParam() << " stage " << stage << " block " << b;
    }
    const float loss = engine.forward(ref.batch());
    EXPECT_NEAR(loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << GetParam() << " stage " << stage;
    engine.backward();
    engine.step();
    EXPECT_NEAR(engine.global_grad_norm(), std::sqrt(sq), 1e-4 * std::sqrt(sq)) << GetParam() << " stage " << stage;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfFixture, testing::ValuesIn(kFixtures),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(HfModel, Bf16AndFp16WithinTheirTolerances) {
  // 16-bit weights and matmul operands: the loss within bf16's relative
  // precision (2^-8) of a few roundings per layer, fp16's (2^-11) likewise.
  // Every family zinc loads.
  for (const std::string& name : kFixtures) {
    const std::string dir = fixture(name);
    HfConfig cfg = read_hf_config(dir);
    Reference ref(dir);
    for (const char* half : {"bf16", "fp16"}) {
      Engine engine = Engine::initialize(load_pretrained(cfg), nlohmann::json{{"train_batch_size", ref.B},
                                                                              {"train_micro_batch_size_per_gpu", ref.B},
                                                                              {half, {{"enabled", true}}}});
      const float loss = engine.forward(ref.batch());
      const double tol = std::string(half) == "bf16" ? 2e-2 : 3e-3;
      EXPECT_NEAR(loss, ref.loss, tol * std::fabs(ref.loss)) << name << " " << half;
      engine.backward();
      engine.step();
      // fp16's dynamic loss scaling may overflow on its first scale (2^16)
      // and skip the step, as DeepSpeed's does (OLMo 2's post-norms only);
      // then the next, at a lower scale, must be finite.
      for (int retry = 0; retry < 8 && engine.overflow_steps() > retry; ++retry) {
        engine.forward(ref.batch());
        engine.backward();
        engine.step();
      }
      EXPECT_TRUE(std::isfinite(engine.global_grad_norm())) << name << " " << half;
      if (std::string(half) == "bf16") {
        EXPECT_EQ(engine.overflow_steps(), 0) << name;
      }
    }
  }
}

TEST(HfModel, ConfigReadsBothRopeSpellings) {
  HfConfig c = read_hf_config(fixture("llama_gqa"));  // transformers 5: rope_parameters
  EXPECT_EQ(c.family, &models::llama::family());
  EXPECT_EQ(llama_of(c).rope_scaling.type, models::RopeScaling::Type::kLlama3);
  EXPECT_EQ(llama_of(c).rope_scaling.original_max_position_embeddings, 16);
  EXPECT_EQ(llama_of(c).kv_heads(), 2);
  EXPECT_FALSE(llama_of(c).tie_word_embeddings);
  EXPECT_EQ(c.dtype, DType::kF32);
  EXPECT_EQ(read_hf_config(fixture("qwen2_tied")).dtype, DType::kBF16);
  EXPECT_TRUE(llama_of(read_hf_config(fixture("qwen2_tied"))).qkv_bias);
  EXPECT_FALSE(llama_of(read_hf_config(fixture("qwen2_tied"))).o_bias);
  EXPECT_EQ(llama_of(read_hf_config(fixture("llama_bias_hd"))).head_dim, 12);
}

// A copy of a fixture folder in a temp dir, for editing.
class TempFolder {
 public:
  explicit TempFolder(const std::string& from) {
    dir = fs::temp_directory_path() / ("zinc_hf_" + std::to_string(::getpid()) + "_" + std::to_string(n_++));
    fs::remove_all(dir);
    fs::copy(fixture(from), dir, fs::copy_options::recursive);
  }
  ~TempFolder() { fs::remove_all(dir); }
  nlohmann::json config() const {
    std::ifstream in(dir / "config.json");
    return nlohmann::json::parse(in);
  }
  void write_config(const nlohmann::json& j) const { std::ofstream(dir / "config.json") << j.dump(2); }
  fs::path dir;

 private:
  static inline int n_ = 0;
};

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one with " << parts[0];
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

// Which layers slide, as transformers' configs say: Mistral's window in
// every layer; Qwen2 and Qwen3 with use_sliding_window in the layers
// layer_types marks, or from max_window_layers on; SmolLM3 in its layers
// without rotary embeddings; no window without use_sliding_window.
TEST(HfModel, SlidingWindowLayersFollowTransformersRules) {
  auto read = [](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json raw = TempFolder(name).config();
    edit(raw);
    return llama_of(parse_hf_config(raw, name + "/config.json"));
  };
  models::LlamaConfig m = read("mistral_window", [](nlohmann::json&) {});
  EXPECT_EQ(m.sliding_window, 5);
  EXPECT_TRUE(m.window_layers.empty());  // every layer
  for (const std::string name : {"qwen2_tied", "qwen3"}) {
    auto on = [](nlohmann::json& j) {
      j["use_sliding_window"] = true;
      j["sliding_window"] = 4;
      j["max_window_layers"] = 1;
      j.erase("layer_types");
    };
    models::LlamaConfig q = read(name, on);
    EXPECT_EQ(q.sliding_window, 4) << name;
    EXPECT_EQ(q.window_layers, (std::vector<int>{0, 1})) << name;
    q = read(name, [&](nlohmann::json& j) {
      on(j);
      j["layer_types"] = {"sliding_attention", "full_attention"};
    });
    EXPECT_EQ(q.window_layers, (std::vector<int>{1, 0})) << name;
    EXPECT_EQ(q.window(0), 4);
    EXPECT_EQ(q.window(1), 0);
    q = read(name, [&](nlohmann::json& j) {
      on(j);
      j["use_sliding_window"] = false;
    });
    EXPECT_EQ(q.sliding_window, 0) << name;
  }
  models::LlamaConfig s = read("smollm3", [](nlohmann::json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 3;
    j.erase("layer_types");  // no_rope_layers [1, 0]: layer 1 has no rotary embeddings
  });
  EXPECT_EQ(s.window_layers, (std::vector<int>{0, 1}));
}

// transformers' Qwen3-MoE windows every layer with use_sliding_window (it
// reads neither max_window_layers nor layer_types, unlike the dense Qwen3),
// with sliding_window 4096 where the key is missing and none where it is
// null. (zinc followed the dense rule: no layer of a small model slid,
// a loss 5% off transformers'.)
TEST(HfModel, Qwen3MoeSlidesEveryLayerAsTransformersDoes) {
  auto read = [](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json raw = TempFolder("qwen3_moe").config();
    edit(raw);
    return llama_of(parse_hf_config(raw, "qwen3_moe/config.json"));
  };
  const int64_t layers = read([](nlohmann::json&) {}).num_hidden_layers;
  const models::LlamaConfig q = read([](nlohmann::json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 4;
    j["max_window_layers"] = 28;
    j["layer_types"] = nlohmann::json::array();
  });
  EXPECT_EQ(q.sliding_window, 4);
  EXPECT_EQ(q.window_layers, std::vector<int>(static_cast<size_t>(layers), 1));
  EXPECT_EQ(read([](nlohmann::json& j) {
              j["use_sliding_window"] = true;
              j.erase("sliding_window");
            }).sliding_window,
            4096);
  EXPECT_EQ(read([](nlohmann::json& j) {
              j["use_sliding_window"] = true;
              j["sliding_window"] = nullptr;
            }).sliding_window,
            0);
  EXPECT_EQ(read([](nlohmann::json& j) {
              j["use_sliding_window"] = false;
              j["sliding_window"] = 4;
            }).sliding_window,
            0);
}

// original_max_position_embeddings of llama3, yarn and longrope as
// transformers' standardize_rope_params takes it: beside a flat rope object
// it wins over the one inside (Phi-3's configs keep it there); without
// either, max_position_embeddings. (zinc took the inside one: losses 0.3-3%
// off transformers' where the two differed.)
TEST(HfModel, TheTopLevelOriginalMaxPositionsWinsAsInTransformers) {
  auto orig = [](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json raw = TempFolder(name).config();
    edit(raw);
    return llama_of(parse_hf_config(raw, name + "/config.json")).rope_scaling.original_max_position_embeddings;
  };
  for (const std::string name : {"llama_gqa", "llama_yarn", "phi3"}) {
    const int64_t inside = orig(name, [](nlohmann::json& j) { j.erase("original_max_position_embeddings"); });
    EXPECT_EQ(orig(name, [](nlohmann::json& j) { j["original_max_position_embeddings"] = 4; }), 4) << name;
    EXPECT_NE(inside, 4) << name;
    const int64_t max_pos = TempFolder(name).config()["max_position_embeddings"].get<int64_t>();
    EXPECT_EQ(orig(name, [](nlohmann::json& j) {
                j.erase("original_max_position_embeddings");
                j["rope_parameters"].erase("original_max_position_embeddings");
              }),
              max_pos)
        << name;
  }
  expect_error([] {
    nlohmann::json raw = TempFolder("llama_gqa").config();
    raw["original_max_position_embeddings"] = 0;
    parse_hf_config(raw, "x/config.json");
  }, {"x/config.json: original_max_position_embeddings: must be >= 1"});
}

// transformers' Gemma 3 attention never applies attn_logit_softcapping
// (Gemma 2's does), so zinc does not either, and says so once.
TEST(HfModel, Gemma3DoesNotCapItsAttentionScoresAsInTransformers) {
  nlohmann::json raw = TempFolder("gemma3").config();
  raw["attn_logit_softcapping"] = 2.0;
  LogCapture capture(LogLevel::kWarn);
  EXPECT_EQ(llama_of(parse_hf_config(raw, "g/config.json")).attn_logit_softcapping, 0.0);
  ASSERT_EQ(capture.messages().size(), 1u);
  EXPECT_NE(capture.messages()[0].find("g/config.json: attn_logit_softcapping 2.0 is not applied"), std::string::npos)
      << capture.messages()[0];
  nlohmann::json g2 = TempFolder("gemma2").config();
  g2["attn_logit_softcapping"] = 2.0;
  EXPECT_EQ(llama_of(parse_hf_config(g2, "g2/config.json")).attn_logit_softcapping, 2.0);  // Gemma 2 caps
}

// The dropout a config.json sets is not applied (zinc's models have none):
// said once, naming the keys; a head's dropout zinc does not build is not.
TEST(HfModel, TheConfigsDropoutIsSaidToBeUnapplied) {
  nlohmann::json raw = TempFolder("gpt2").config();
  raw["resid_pdrop"] = 0.1;
  raw["attn_pdrop"] = 0.1;
  raw["embd_pdrop"] = 0.0;
  raw["summary_first_dropout"] = 0.1;
  LogCapture capture(LogLevel::kWarn);
  parse_hf_config(raw, "d/config.json");
  ASSERT_EQ(capture.messages().size(), 1u);
  EXPECT_NE(capture.messages()[0].find("d/config.json: dropout is not applied (attn_pdrop 0.1, resid_pdrop 0.1)"),
            std::string::npos)
      << capture.messages()[0];
  raw["resid_pdrop"] = raw["attn_pdrop"] = 0.0;
  LogCapture quiet(LogLevel::kWarn);
  parse_hf_config(raw, "d/config.json");
  EXPECT_TRUE(quiet.messages().empty());
}

// transformers builds a folder's model from model_type, zinc from
// architectures: where they disagree the reader says so, naming both (zinc
// trained such a folder as architectures says without a word).
TEST(HfModel, AModelTypeThatContradictsTheArchitectureIsSaid) {
  nlohmann::json raw = TempFolder("llama_gqa").config();
  for (const char* type : {"gpt2", "mistral"}) {
    raw["model_type"] = type;
    LogCapture capture(LogLevel::kWarn);
    parse_hf_config(raw, "x/config.json");
    const std::vector<std::string> got = capture.messages();
    ASSERT_EQ(got.size(), 1u) << type;
    EXPECT_NE(got[0].find(std::string("x/config.json: model_type \"") + type + "\" is not LlamaForCausalLM's (\"llama\")"),
              std::string::npos)
        << got[0];
  }
  raw["model_type"] = "llama";
  LogCapture capture(LogLevel::kWarn);
  parse_hf_config(raw, "x/config.json");
  EXPECT_TRUE(capture.messages().empty());
}

// The new families' keys, edited as a hostile folder would: one line naming
// the file and the key, never a model built from them.
TEST(HfModel, NewFamiliesKeysAreCheckedNamingTheKey) {
  auto refuse = [](const std::string& name, const std::function<void(nlohmann::json&)>& edit,
                   const std::vector<std::string>& parts) {
    nlohmann::json raw = TempFolder(name).config();
    edit(raw);
    std::vector<std::string> want = {name + "/config.json"};
    want.insert(want.end(), parts.begin(), parts.end());
    expect_error([&] { parse_hf_config(raw, name + "/config.json"); }, want);
  };
  refuse("smollm3", [](nlohmann::json& j) { j["no_rope_layers"] = {1}; }, {"no_rope_layers", "one entry per layer"});
  refuse("smollm3", [](nlohmann::json& j) { j["no_rope_layers"] = {1, 2}; }, {"no_rope_layers", "0 or 1"});
  refuse("smollm3", [](nlohmann::json& j) { j["no_rope_layers"] = "all"; }, {"no_rope_layers", "expected a list"});
  refuse("granite", [](nlohmann::json& j) { j["logits_scaling"] = 0; }, {"logits_scaling", "> 0"});
  refuse("granite", [](nlohmann::json& j) { j["residual_multiplier"] = -1; }, {"residual_multiplier"});
  refuse("granite", [](nlohmann::json& j) { j["attention_multiplier"] = "x"; }, {"attention_multiplier", "a number"});
  refuse("qwen3", [](nlohmann::json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 4;
    j["layer_types"] = {"chunked_attention", "full_attention"};
  }, {"layer_types", "chunked_attention"});
  refuse("qwen3", [](nlohmann::json& j) {
    j["use_sliding_window"] = true;
    j["sliding_window"] = 4;
    j["layer_types"] = {"full_attention"};
  }, {"layer_types", "one entry per layer"});
  refuse("mistral_window", [](nlohmann::json& j) { j["sliding_window"] = -3; }, {"sliding_window"});
  refuse("gemma", [](nlohmann::json& j) { j["hidden_act"] = "relu"; }, {"hidden_act", "relu", "tanh"});
  refuse("gemma2", [](nlohmann::json& j) { j["attn_logit_softcapping"] = 0; }, {"attn_logit_softcapping", "> 0"});
  refuse("gemma2", [](nlohmann::json& j) { j["final_logit_softcapping"] = -30; }, {"final_logit_softcapping"});
  refuse("gemma2", [](nlohmann::json& j) { j["query_pre_attn_scalar"] = 0; }, {"query_pre_attn_scalar", "> 0"});
  refuse("gemma2", [](nlohmann::json& j) { j["layer_types"] = {"sliding_attention"}; }, {"layer_types", "one entry"});
  refuse("gemma3", [](nlohmann::json& j) { j["use_bidirectional_attention"] = true; },
         {"use_bidirectional_attention", "causal"});
  refuse("gemma3", [](nlohmann::json& j) { j["rope_parameters"]["chunked_attention"] = {{"rope_theta", 1.0}}; },
         {"rope_parameters.chunked_attention", "layer type"});
  refuse("gemma3", [](nlohmann::json& j) {
    j["rope_parameters"]["sliding_attention"] = {{"rope_type", "linear"}, {"factor", 2.0}, {"rope_theta", 1e4}};
  }, {"rope_parameters.sliding_attention.rope_type", "full-attention layers only"});
  refuse("phi3", [](nlohmann::json& j) { j["rope_parameters"]["long_factor"] = {1.0, 2.0}; },
         {"short_factor", "rotary_dim / 2 = 3"});
  refuse("phi3", [](nlohmann::json& j) { j["rope_parameters"].erase("short_factor"); },
         {"rope_parameters.short_factor", "missing"});
  refuse("phi3", [](nlohmann::json& j) { j["rope_parameters"]["partial_rotary_factor"] = 0.2; },
         {"partial_rotary_factor", "even"});
  refuse("phi3", [](nlohmann::json& j) { j["rope_parameters"]["partial_rotary_factor"] = 1.5; },
         {"partial_rotary_factor", "(0, 1]"});
  refuse("llama_gqa", [](nlohmann::json& j) { j["rope_parameters"] = {{"rope_type", "dynamic"}, {"factor", 2.0}}; },
         {"rope_type", "inference-time"});
  refuse("olmo2", [](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, {"hidden_act", "SiLU"});
  refuse("llama_yarn", [](nlohmann::json& j) { j["rope_parameters"]["factor"] = -4; }, {"rope_parameters.factor"});
  refuse("mixtral", [](nlohmann::json& j) { j["router_jitter_noise"] = 0.01; }, {"router_jitter_noise", "irreproducible"});
  refuse("mixtral", [](nlohmann::json& j) { j["num_experts_per_tok"] = 5; }, {"num_experts_per_tok", "num_experts 4"});
  refuse("mixtral", [](nlohmann::json& j) { j["num_local_experts"] = 0; }, {"num_local_experts", ">= 1"});
  refuse("qwen3_moe", [](nlohmann::json& j) { j["mlp_only_layers"] = {7}; }, {"mlp_only_layers", "below"});
  refuse("qwen3_moe", [](nlohmann::json& j) { j["decoder_sparse_step"] = 0; }, {"decoder_sparse_step", ">= 1"});
  refuse("llama_yarn", [](nlohmann::json& j) { j["rope_parameters"]["beta_slow"] = 0; },
         {"rope_parameters.beta_fast", "> 0"});
  refuse("gpt_neox", [](nlohmann::json& j) { j["hidden_act"] = "relu"; }, {"hidden_act", "relu", "exact"});
  refuse("gpt_neox", [](nlohmann::json& j) { j["num_key_value_heads"] = 2; }, {"num_key_value_heads", "grouped"});
  refuse("gpt_neox", [](nlohmann::json& j) { j["rope_parameters"]["partial_rotary_factor"] = 0.1; },
         {"partial_rotary_factor", "even"});
}

// The tolerances discriminate: the same weights with llama3's rope scaling
// dropped (positions up to 12, original context 16) move the logits far
// beyond 1e-4.
TEST(HfModel, TheComparisonSeesAWrongRopeScaling) {
  TempFolder t("llama_gqa");
  auto j = t.config();
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  t.write_config(j);
  auto model = load_pretrained(read_hf_config(t.dir.string()));
  Reference ref(fixture("llama_gqa"));
  HostContext ctx(*model);
  model->forward(ctx, ref.batch());
  std::vector<float> logits(model->logits().begin(), model->logits().end());
  EXPECT_GT(max_abs_diff(logits, ref.logits), 1e-3);
}

TEST(HfModel, BadFoldersGiveOneLineNamingTheFile) {
  {
    TempFolder t("llama_gqa");
    auto j = t.config();
    j["architectures"] = {"FalconForCausalLM"};
    t.write_config(j);
    expect_error([&] { read_hf_config(t.dir.string()); },
                 {"config.json: architectures", "\"FalconForCausalLM\" is not supported", "LlamaForCausalLM"});
  }
  {
    TempFolder t("llama_gqa");
    auto j = t.config();
    j["rope_parameters"]["rope_type"] = "ntk-by-parts";
    t.write_config(j);
    expect_error([&] { read_hf_config(t.dir.string()); },
                 {"rope_parameters.rope_type", "\"ntk-by-parts\" is not supported", "yarn"});
  }
  {
    TempFolder t("llama_gqa");
    auto j = t.config();
    j["hidden_act"] = "gelu";
    t.write_config(j);
    expect_error([&] { read_hf_config(t.dir.string()); }, {"config.json: hidden_act", "\"gelu\""});
  }
  {
    TempFolder t("llama_gqa");
    auto j = t.config();
    j["num_key_value_heads"] = 3;
    t.write_config(j);
    expect_error([&] { read_hf_config(t.dir.string()); }, {"config.json: num_key_value_heads", "must divide"});
  }
  {
    // A config that disagrees with the weights: a shape error naming the tensor and the file.
    TempFolder t("llama_gqa");
    auto j = t.config();
    j["intermediate_size"] = 64;
    t.write_config(j);
    expect_error([&] { load_pretrained(read_hf_config(t.dir.string())); },
                 {"model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape [80, 32]", "[64, 32]"});
  }
  {
    // One layer fewer in config.json: the last layer's tensors are left over.
    TempFolder t("llama_gqa");
    auto j = t.config();
    j["num_hidden_layers"] = 1;
    t.write_config(j);
    expect_error([&] { load_pretrained(read_hf_config(t.dir.string())); },
                 {"model.safetensors: tensor model.layers.1.", "unexpected tensor"});
  }
  {
    // Untied in config.json but the file has no lm_head: missing tensor.
    TempFolder t("qwen2_tied");
    auto j = t.config();
    j["tie_word_embeddings"] = false;
    t.write_config(j);
    expect_error([&] { load_pretrained(read_hf_config(t.dir.string())); }, {"tensor lm_head.weight [96, 32] is missing"});
  }
  {
    TempFolder t("gpt2");
    fs::remove(t.dir / "config.json");
    expect_error([&] { read_hf_config(t.dir.string()); }, {"cannot open the model's config.json", "config.json: No such file"});
  }
  {
    TempFolder t("gpt2");
    std::ofstream(t.dir / "config.json") << "{\"architectures\": [";
    expect_error([&] { read_hf_config(t.dir.string()); }, {"config.json: JSON syntax error at line 1"});
  }
}

// zinc-train's model.from_pretrained: the folder's model, sizes agreeing.
// Rewrites a folder's model.safetensors as fp32: `edit` may change any
// tensor's values; `extra` tensors are added.
void rewrite_weights(const fs::path& dir, const std::function<void(const std::string&, std::vector<float>&)>& edit,
                     const std::map<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>& extra = {}) {
  std::vector<SafeTensor> specs;
  std::vector<std::vector<float>> values;
  {
    SafetensorsFolder f(dir.string());
    for (const std::string& n : f.names()) {
      auto [file, t] = f.find(n);
      std::vector<float> v(static_cast<size_t>(t->numel()));
      file->read_f32(*t, 0, t->numel(), v.data());
      edit(n, v);
      specs.push_back({n, DType::kF32, t->shape});
      values.push_back(std::move(v));
    }
  }
  for (const auto& [n, sv] : extra) {
    specs.push_back({n, DType::kF32, sv.first});
    values.push_back(sv.second);
  }
  SafetensorsWriter w((dir / "model.safetensors").string(), specs, {{"format", "pt"}});
  for (const auto& v : values) w.append(v.data(), v.size() * 4);
  w.finish();
}

// Whatever a user's config.json is, one line naming it: a number past the
// double's range, a folder, a FIFO (not waited on), /dev/zero (not read
// without end).
TEST(HfModel, ConfigJsonThatIsNotAConfigIsRefusedNamingIt) {
  {
    TempFolder t("llama_gqa");
    std::string text;
    {
      std::ifstream in(t.dir / "config.json");
      text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    const size_t at = text.find("\"rms_norm_eps\": ") + 16;
    text.replace(at, text.find_first_of(",\n}", at) - at, "1e400");
    std::ofstream(t.dir / "config.json") << text;
    expect_error([&] { read_hf_config(t.dir.string()); }, {"config.json: ", "rms_norm_eps", "1e400 is out of range"});
  }
  {
    TempFolder t("llama_gqa");
    fs::remove(t.dir / "config.json");
    fs::create_directory(t.dir / "config.json");
    expect_error([&] { read_hf_config(t.dir.string()); }, {"config.json", "is a directory, not a regular file"});
  }
  {
    TempFolder t("llama_gqa");
    fs::remove(t.dir / "config.json");
    ASSERT_EQ(::mkfifo((t.dir / "config.json").c_str(), 0644), 0);
    expect_error([&] { read_hf_config(t.dir.string()); }, {"config.json", "is a FIFO, not a regular file"});
    fs::remove(t.dir / "config.json");
    fs::create_symlink("/dev/zero", t.dir / "config.json");
    expect_error([&] { read_hf_config(t.dir.string()); }, {"config.json", "is a character device"});
  }
}

// A NaN or an infinity in a pretrained weight is refused, naming the tensor
// and how many values are bad, before a step would skip on it.
TEST(HfModel, NonFiniteWeightsAreRefusedNamingTheTensor) {
  for (const char* fix : {"llama_gqa", "gpt2"}) {
    TempFolder t(fix);
    const std::string bad = std::string(fix) == "gpt2" ? "transformer.h.0.attn.c_attn.weight"  // transposed on load
                                                       : "model.layers.1.mlp.down_proj.weight";
    rewrite_weights(t.dir, [&](const std::string& n, std::vector<float>& v) {
      if (n != bad) return;
      v[3] = std::nanf("");
      v[7] = INFINITY;
      v[8] = -INFINITY;
    });
    auto model = load_pretrained(read_hf_config(t.dir.string()));
    expect_error([&] { HostContext ctx(*model); },
                 {"model.safetensors: tensor " + bad, "holds 3 non-finite values", "the first at element 3"});
  }
}

// config.json says tie_word_embeddings true, and the file holds its own
// lm_head.weight: transformers 5 keeps such a head when it differs from the
// embedding. zinc's llama does the same (and says so in the config it
// exports); zinc's gpt, whose head is the embedding, refuses the folder.
// The same head as the embedding is a tied model written out, and stays tied.
TEST(HfModel, AHeadTheFileHoldsIsKeptOrRefusedNeverDropped) {
  {
    TempFolder t("llama_bias_hd");  // tied in its config.json
    HfConfig c0 = read_hf_config(t.dir.string());
    ASSERT_TRUE(llama_of(c0).tie_word_embeddings);
    const int64_t V = llama_of(c0).vocab_size, C = llama_of(c0).hidden_size;
    std::vector<float> embed(static_cast<size_t>(V * C));
    rewrite_weights(t.dir, [&](const std::string& n, std::vector<float>& v) {
      if (n == "model.embed_tokens.weight") embed = v;
    });
    // The same values: still tied (nothing to keep apart), and it loads.
    rewrite_weights(t.dir, [](const std::string&, std::vector<float>&) {}, {{"lm_head.weight", {{V, C}, embed}}});
    HfConfig c = read_hf_config(t.dir.string());
    EXPECT_TRUE(llama_of(c).tie_word_embeddings);
    EXPECT_NO_THROW(load_pretrained(c));
  }
  {
    TempFolder t("llama_bias_hd");
    HfConfig c0 = read_hf_config(t.dir.string());
    const int64_t V = llama_of(c0).vocab_size, C = llama_of(c0).hidden_size;
    std::vector<float> head(static_cast<size_t>(V * C));
    for (size_t i = 0; i < head.size(); ++i) head[i] = 0.001f * static_cast<float>(i % 97) - 0.04f;
    rewrite_weights(t.dir, [](const std::string&, std::vector<float>&) {}, {{"lm_head.weight", {{V, C}, head}}});
    HfConfig c = read_hf_config(t.dir.string());
    EXPECT_FALSE(llama_of(c).tie_word_embeddings);
    EXPECT_EQ(c.raw["tie_word_embeddings"], false);
    auto model = load_pretrained(c);
    HostContext ctx(*model);
    bool found = false;
    for (size_t b = 0; b < model->blocks().size(); ++b)
      for (size_t p = 0; p < model->blocks()[b].params.size(); ++p)
        if (model->blocks()[b].params[p].name == "lm_head.weight") {
          found = true;
          EXPECT_EQ(std::memcmp(ctx.params[b].data() + ctx.layouts[b].offsets[p], head.data(), head.size() * 4), 0);
        }
    EXPECT_TRUE(found) << "the file's lm_head.weight was dropped";
    // An export names it.
    bool exported = false;
    for (const auto& block : hf_pieces(c, *model, "model."))
      for (const auto& param : block)
        for (const HfPiece& pc : param) exported |= pc.name == "lm_head.weight";
    EXPECT_TRUE(exported);
  }
  {
    TempFolder t("gpt2");
    HfConfig c0 = read_hf_config(t.dir.string());
    const int64_t V = gpt_of(c0).vocab_size, C = gpt_of(c0).n_embd;
    std::vector<float> head(static_cast<size_t>(V * C), 0.25f);
    rewrite_weights(t.dir, [](const std::string&, std::vector<float>&) {}, {{"lm_head.weight", {{V, C}, head}}});
    expect_error([&] { read_hf_config(t.dir.string()); },
                 {"model.safetensors: tensor lm_head.weight differs from transformer.wte.weight",
                  "tie_word_embeddings true", "refusing rather than dropping it"});
  }
}

TEST(HfModel, ExperimentFromPretrained) {
  auto doc = [](nlohmann::json model, int64_t seq_len = 12) {
    return nlohmann::json{{"train_batch_size", 2},
                          {"model", std::move(model)},
                          {"data", {{"type", "synthetic"}, {"vocab_size", 96}, {"seq_len", seq_len}}},
                          {"run", {{"steps", 1}}}};
  };
  const std::string dir = fixture("llama_gqa");
  Experiment e = build_experiment(doc({{"from_pretrained", dir}, {"num_key_value_heads", 2}}));
  EXPECT_EQ(e.model->name(), "llama");
  EXPECT_EQ(e.model->blocks().size(), 4u);
  // The engine starts from the folder's weights.
  Engine engine = Engine::initialize(e.model, e.config);
  HostContext want(*e.model);
  std::vector<float> got = engine.full_params(0);
  EXPECT_EQ(std::memcmp(got.data(), want.params[0].data(), want.params[0].size() * 4), 0);
  expect_error([&] { build_experiment(doc({{"from_pretrained", dir}, {"num_hidden_layers", 3}})); },
               {"model.num_hidden_layers: 3 disagrees with", "llama_gqa/config.json: num_hidden_layers 2"});
  expect_error([&] { build_experiment(doc({{"from_pretrained", dir}, {"type", "gpt"}})); },
               {"model.type: \"gpt\" disagrees with", "LlamaForCausalLM"});
  expect_error([&] { build_experiment(doc({{"from_pretrained", dir}}, 100)); },
               {"data.seq_len: 100 exceeds the model's max_position_embeddings 64"});
  expect_error([&] { build_experiment(doc({{"from_pretrained", fixture("nope")}})); }, {"nope/config.json: No such file", "(is ", "a Hugging Face model folder?)"});
  // A llama from scratch, by transformers' names.
  Experiment s = build_experiment(doc({{"type", "llama"}, {"hidden_size", 16}, {"intermediate_size", 24},
                                       {"num_hidden_layers", 1}, {"num_attention_heads", 2}}));
  EXPECT_EQ(s.model->name(), "llama");
  expect_error([&] { build_experiment(doc({{"type", "llama"}, {"hidden_size", 15}, {"num_attention_heads", 2}})); },
               {"model.hidden_size: must be divisible by num_attention_heads 2"});
  // A mixture of experts from its section: its keys are checked at their paths.
  auto moe = [](nlohmann::json extra) {
    nlohmann::json m = {{"type", "mixtral"}, {"hidden_size", 16}, {"intermediate_size", 24}, {"num_hidden_layers", 1},
                        {"num_attention_heads", 2}};
    m.update(extra);
    return m;
  };
  // Named by its family in messages and checkpoints (the Llama model computes it).
  EXPECT_EQ(build_experiment(doc(moe({{"num_experts", 3}, {"num_experts_per_tok", 2}}))).model->name(), "mixtral");
  expect_error([&] { build_experiment(doc(moe({{"num_experts", 2}, {"num_experts_per_tok", 3}}))); },
               {"model.num_experts_per_tok", "at most num_experts 2"});
  expect_error([&] { build_experiment(doc(moe({{"num_experts", 0}}))); }, {"model.num_experts"});
  expect_error([&] { build_experiment(doc(moe({{"router_aux_loss_coef", -1}}))); }, {"model.router_aux_loss_coef"});
}

}  // namespace
}  // namespace zinc::tools
