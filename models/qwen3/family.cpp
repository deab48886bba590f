// The Qwen3 family (model.type "qwen3"): transformers' Qwen3ForCausalLM
// (Note [model families] in models/registry.cpp). Its graph is the
// Llama-style decoder's (models/llama/) with qk_norm: an RMSNorm over each
// head of q and of k (weights self_attn.q_norm / k_norm of head_dim) after
// the projections, before the rotary embeddings; head_dim is its own key
// (transformers' default 128, not hidden_size / heads); biases on q, k, v
// and o only with attention_bias. The tensor map is the decoder's: q_norm
// and k_norm keep their names ("model.layers.3.self_attn.q_norm.weight").
#include <string>

#include "models/llama/llama.h"

namespace zinc::models::qwen3 {

const Family& family();

namespace {

using nlohmann::json;

// transformers' Qwen3Config defaults where zinc's LlamaConfig has others.
LlamaConfig defaults() {
  LlamaConfig c;
  c.qk_norm = true;
  c.head_dim = 128;
  return c;
}

json qwen3_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["architectures"] = {"Qwen3ForCausalLM"};
  j["model_type"] = "qwen3";
  j["attention_bias"] = c.qkv_bias;
  j["use_sliding_window"] = false;
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  llama::read_decoder(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; Qwen3's MLP is SiLU-gated (silu)");
  c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
  // Sliding-window layers: by default those from max_window_layers on.
  const int64_t from = f.get_int("max_window_layers", 28);
  llama::read_window_layers(f, c, [&](int64_t l) { return l >= from; });
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &qwen3_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &qwen3_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("qwen3", {"Qwen3ForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::qwen3
