// The Phi-3 family (model.type "phi3"): transformers' Phi3ForCausalLM
// (Note [model families] in models/registry.cpp). Its graph is the
// Llama-style decoder's (models/llama/) with partial rotary embeddings
// (partial_rotary_factor: only the first head_dim * factor values of each
// head rotate) and longrope (RopeScaling::kLongrope: per-frequency
// factors, long ones past original_max_position_embeddings, and cos/sin
// times an attention factor), a sliding_window on every layer when set.
// The tensor map differs from the decoder's: Phi-3's files keep
// self_attn.qkv_proj (rows q, k, v) and mlp.gate_up_proj (rows gate, up)
// fused, exactly as zinc does, so each parameter is one tensor of its own
// name.
#include <string>

#include "models/llama/llama.h"

namespace zinc::models::phi3 {

const Family& family();

namespace {

using nlohmann::json;

// transformers' Phi3Config defaults where zinc's LlamaConfig has others.
LlamaConfig defaults() {
  LlamaConfig c;
  c.fused_in_file = true;
  c.rms_norm_eps = 1e-5;
  return c;
}

json phi3_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["architectures"] = {"Phi3ForCausalLM"};
  j["model_type"] = "phi3";
  j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  if (c.rope_scaling.type == RopeScaling::Type::kLongrope)
    j["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  llama::read_decoder(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; Phi-3's MLP is SiLU-gated (silu)");
  c.sliding_window = f.get_int("sliding_window", 0);  // every layer, as transformers' Phi3Attention
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &phi3_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &phi3_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("phi3", {"Phi3ForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::phi3
