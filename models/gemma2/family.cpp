// The Gemma 2 family (model.type "gemma2"): transformers' Gemma2ForCausalLM
// (Note [model families] in models/registry.cpp). Gemma (models/gemma/)
// plus: four norms per layer (input_layernorm before attention,
// post_attention_layernorm on its output before the residual add,
// pre_feedforward_layernorm and post_feedforward_layernorm around the MLP);
// attention scores scaled by query_pre_attn_scalar^-1/2 and soft-capped
// (attn_logit_softcapping), the final logits soft-capped
// (final_logit_softcapping); sliding-window attention in the layers
// layer_types marks (by default every other layer from the first). The
// tensor map is the decoder's.
#include "models/gemma/gemma.h"

namespace zinc::models::gemma2 {

const Family& family();

namespace {

using nlohmann::json;

// transformers' Gemma2Config defaults.
LlamaConfig defaults() {
  LlamaConfig c = gemma::defaults();
  c.post_norms = true;
  c.query_pre_attn_scalar = 256;
  c.attn_logit_softcapping = 50.0;
  c.final_logit_softcapping = 30.0;
  c.sliding_window = 4096;
  c.sliding_pattern = 2;
  return c;
}

json gemma2_json(const LlamaConfig& c) {
  json j = gemma::gemma_json(c);
  j["architectures"] = {"Gemma2ForCausalLM"};
  j["model_type"] = "gemma2";
  gemma::write_attention_json(c, j);
  return j;
}

// A soft-cap: a number > 0, or null (none).
double read_softcap(const ConfigDoc& f, const char* key, double dflt) {
  if (f.is_null(key)) return 0.0;
  const double v = f.get_number(key, dflt);
  if (!(v > 0)) f.fail(key, "must be > 0 (or null: none), got " + f.at(key).dump());
  return v;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  gemma::read_gemma(f, c, "hidden_activation", "Gemma 2");
  c.query_pre_attn_scalar = f.get_number("query_pre_attn_scalar", c.query_pre_attn_scalar);
  if (!(c.query_pre_attn_scalar > 0)) f.fail("query_pre_attn_scalar", "must be > 0");
  c.attn_logit_softcapping = read_softcap(f, "attn_logit_softcapping", c.attn_logit_softcapping);
  c.final_logit_softcapping = read_softcap(f, "final_logit_softcapping", c.final_logit_softcapping);
  gemma::read_layer_types(f, c, 2);
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &gemma2_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &gemma2_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("gemma2", {"Gemma2ForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::gemma2
