// The OLMo 2 family (model.type "olmo2"): transformers' Olmo2ForCausalLM
// (Note [model families] in models/registry.cpp). Its graph is the
// Llama-style decoder's (models/llama/) with the norms moved: none before
// attention and the MLP, an RMSNorm on each branch's output before its
// residual add (post_attention_layernorm, post_feedforward_layernorm), and
// q_norm / k_norm over the whole q and k projections (H*head_dim and
// K*head_dim wide) before the heads are split and rotated. Biases on q, k,
// v and o with attention_bias. The tensor map is the decoder's.
#include <string>

#include "models/llama/llama.h"

namespace zinc::models::olmo2 {

const Family& family();

namespace {

using nlohmann::json;

// transformers' Olmo2Config defaults where zinc's LlamaConfig has others.
LlamaConfig defaults() {
  LlamaConfig c;
  c.pre_norms = false;
  c.post_norms = true;
  c.qk_norm = c.qk_norm_full = true;
  c.rms_norm_eps = 1e-5;
  return c;
}

json olmo2_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["architectures"] = {"Olmo2ForCausalLM"};
  j["model_type"] = "olmo2";
  j["attention_bias"] = c.qkv_bias;
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  llama::read_decoder(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; OLMo 2's MLP is SiLU-gated (silu)");
  c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &olmo2_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &olmo2_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("olmo2", {"Olmo2ForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::olmo2
