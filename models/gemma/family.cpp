// The Gemma family (model.type "gemma"): transformers' GemmaForCausalLM
// (Note [model families] in models/registry.cpp). Its graph is the
// Llama-style decoder's (models/llama/) with Gemma's three changes: every
// RMSNorm scales by 1 + w (formed in fp32; the weights start at 0), the
// embeddings are times sqrt(hidden_size), and the MLP is GELU-gated (the
// tanh form: gelu_pytorch_tanh; transformers reads the legacy "gelu" of
// the official configs as that too). The head is tied by default. The
// tensor map is the decoder's.
#include "models/gemma/gemma.h"

#include <cmath>

namespace zinc::models::gemma {

const Family& family();

using nlohmann::json;

LlamaConfig defaults() {
  LlamaConfig c;
  c.norm_offset = 1.0f;
  c.scale_embeddings = true;
  c.mlp_act = LlamaConfig::MlpAct::kGeluTanh;
  c.head_dim = 256;
  c.tie_word_embeddings = true;
  return c;
}

void read_gemma(const ConfigDoc& f, LlamaConfig& c, const std::string& act_key, const std::string& name) {
  llama::read_decoder(f, c);
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", true);
  std::string act = f.get_string(act_key, "gelu_pytorch_tanh");
  if (act_key == "hidden_act" && act == "gelu") act = "gelu_pytorch_tanh";  // transformers' GemmaConfig does the same
  if (act != "gelu_pytorch_tanh" && act != "gelu_new")
    f.fail(act_key, "\"" + act + "\" is not supported; " + name + "'s MLP is GELU-gated, GELU in its tanh form "
                    "(gelu_pytorch_tanh)");
  c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
}

json gemma_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["hidden_act"] = "gelu_pytorch_tanh";
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["attention_bias"] = c.qkv_bias;
  return j;
}

void read_layer_types(const ConfigDoc& f, LlamaConfig& c, int64_t pattern) {
  c.sliding_window = f.get_int("sliding_window", c.sliding_window);
  c.window_layers.clear();
  if (!f.has("layer_types")) {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.window_layers.push_back((l + 1) % pattern != 0 ? 1 : 0);
    return;
  }
  const json& types = f.at("layer_types");
  if (!types.is_array()) f.fail("layer_types", "expected a list, got " + types.dump());
  for (const json& t : types) {
    if (t != "sliding_attention" && t != "full_attention")
      f.fail("layer_types", t.dump() + " is not supported (sliding_attention or full_attention)");
    c.window_layers.push_back(t == "sliding_attention" ? 1 : 0);
  }
}

void write_attention_json(const LlamaConfig& c, json& j) {
  const double q = c.query_pre_attn_scalar;
  j["query_pre_attn_scalar"] = q == std::floor(q) && std::fabs(q) < 1e15 ? json(static_cast<int64_t>(q)) : json(q);
  j["attn_logit_softcapping"] = c.attn_logit_softcapping > 0 ? json(c.attn_logit_softcapping) : json(nullptr);
  j["final_logit_softcapping"] = c.final_logit_softcapping > 0 ? json(c.final_logit_softcapping) : json(nullptr);
  j["sliding_window"] = c.sliding_window;
  json types = json::array();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    types.push_back(c.sliding_layer(l) ? "sliding_attention" : "full_attention");
  j["layer_types"] = types;
}

LlamaConfig gemma2_defaults() {
  LlamaConfig c = defaults();
  c.post_norms = true;
  c.query_pre_attn_scalar = 256;
  c.attn_logit_softcapping = 50.0;
  c.final_logit_softcapping = 30.0;
  c.sliding_window = 4096;
  c.sliding_pattern = 2;
  return c;
}

void read_attention(const ConfigDoc& f, LlamaConfig& c, int64_t pattern) {
  c.query_pre_attn_scalar = f.get_number("query_pre_attn_scalar", c.query_pre_attn_scalar);
  if (!(c.query_pre_attn_scalar > 0)) f.fail("query_pre_attn_scalar", "must be > 0");
  for (auto [key, cap] : {std::pair<const char*, double*>{"attn_logit_softcapping", &c.attn_logit_softcapping},
                          {"final_logit_softcapping", &c.final_logit_softcapping}}) {
    if (f.is_null(key)) {
      *cap = 0.0;
    } else if (f.has(key)) {
      *cap = f.get_number(key, 0.0);
      if (!(*cap > 0)) f.fail(key, "must be > 0 (or null: none), got " + f.at(key).dump());
    }
  }
  read_layer_types(f, c, pattern);
}

namespace {

json gemma1_json(const LlamaConfig& c) {
  json j = gemma_json(c);
  j["architectures"] = {"GemmaForCausalLM"};
  j["model_type"] = "gemma";
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  read_gemma(f, c, "hidden_act", "Gemma");
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &gemma1_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &gemma1_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("gemma", {"GemmaForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::gemma
