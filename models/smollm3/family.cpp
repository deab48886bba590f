// The SmolLM3 family (model.type "smollm3"): transformers'
// SmolLM3ForCausalLM (Note [model families] in models/registry.cpp). Its
// graph is the Llama-style decoder's (models/llama/) with layers that skip
// the rotary embeddings: no_rope_layers holds, per layer, 1 (rotary
// embeddings) or 0 (none); without it every no_rope_layer_interval-th layer
// (default 4) has none. Biases on q, k, v and o with attention_bias, on the
// MLP with mlp_bias; the head tied by default; rope_theta 2e6 by default.
// The tensor map is the decoder's.
#include <string>

#include "models/llama/llama.h"

namespace zinc::models::smollm3 {

const Family& family();

namespace {

using nlohmann::json;

// transformers' SmolLM3Config defaults where zinc's LlamaConfig has others.
LlamaConfig defaults() {
  LlamaConfig c;
  c.no_rope_layer_interval = 4;
  c.rope_theta = 2000000.0;
  c.tie_word_embeddings = true;
  return c;
}

json smollm3_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["architectures"] = {"SmolLM3ForCausalLM"};
  j["model_type"] = "smollm3";
  j["attention_bias"] = c.qkv_bias;
  j["mlp_bias"] = c.mlp_bias;
  std::vector<int> rope;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) rope.push_back(c.uses_rope(l) ? 1 : 0);
  j["no_rope_layers"] = rope;
  j["no_rope_layer_interval"] = c.no_rope_layer_interval;
  j["use_sliding_window"] = false;
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  llama::read_decoder(f, c);
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", true);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; SmolLM3's MLP is SiLU-gated (silu)");
  c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
  c.mlp_bias = f.get_bool("mlp_bias", false);
  c.no_rope_layer_interval = f.get_int("no_rope_layer_interval", 4);
  if (f.has("no_rope_layers")) {
    const json& v = f.at("no_rope_layers");
    if (!v.is_array()) f.fail("no_rope_layers", "expected a list of 0 and 1, got " + v.dump());
    for (const json& x : v) {
      if (!x.is_number_integer()) f.fail("no_rope_layers", "expected a list of 0 and 1, got " + v.dump());
      c.no_rope_layers.push_back(x.get<int>());
    }
  }
  // Sliding-window layers: by default those without rotary embeddings.
  llama::read_window_layers(f, c, [&](int64_t l) { return !c.uses_rope(l); });
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &smollm3_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &smollm3_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("smollm3", {"SmolLM3ForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::smollm3
