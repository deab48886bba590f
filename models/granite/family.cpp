// The Granite family (model.type "granite"): transformers'
// GraniteForCausalLM (Note [model families] in models/registry.cpp). Its
// graph is the Llama-style decoder's (models/llama/) with four scalings:
// the embeddings times embedding_multiplier, each residual branch's output
// times residual_multiplier, the attention scores times
// attention_multiplier (instead of 1/sqrt(head_dim)), and the logits
// divided by logits_scaling. Biases on q, k, v and o with attention_bias, on
// the MLP with mlp_bias. The tensor map is the decoder's.
#include <string>

#include "models/llama/llama.h"

namespace zinc::models::granite {

const Family& family();

namespace {

using nlohmann::json;

// transformers' GraniteConfig defaults (every multiplier 1: a Llama).
LlamaConfig defaults() {
  LlamaConfig c;
  c.attention_multiplier = 1.0;
  return c;
}

json granite_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["architectures"] = {"GraniteForCausalLM"};
  j["model_type"] = "granite";
  j["attention_bias"] = c.qkv_bias;
  j["mlp_bias"] = c.mlp_bias;
  j["embedding_multiplier"] = c.embedding_multiplier;
  j["residual_multiplier"] = c.residual_multiplier;
  j["attention_multiplier"] = c.attention_multiplier;
  j["logits_scaling"] = c.logits_scaling;
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  llama::read_decoder(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; Granite's MLP is SiLU-gated (silu)");
  c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
  c.mlp_bias = f.get_bool("mlp_bias", false);
  c.embedding_multiplier = f.get_number("embedding_multiplier", 1.0);
  c.residual_multiplier = f.get_number("residual_multiplier", 1.0);
  c.attention_multiplier = f.get_number("attention_multiplier", 1.0);
  c.logits_scaling = f.get_number("logits_scaling", 1.0);
  if (!(c.attention_multiplier > 0)) f.fail("attention_multiplier", "must be > 0");
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &granite_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &granite_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("granite", {"GraniteForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::granite
