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

LlamaConfig defaults() { return gemma::gemma2_defaults(); }

json gemma2_json(const LlamaConfig& c) {
  json j = gemma::gemma_json(c);
  j["architectures"] = {"Gemma2ForCausalLM"};
  j["model_type"] = "gemma2";
  gemma::write_attention_json(c, j);
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  gemma::read_gemma(f, c, "hidden_activation", "Gemma 2");
  gemma::read_attention(f, c, 2);
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
