// The Gemma 3 family (model.type "gemma3"): transformers' Gemma3ForCausalLM,
// the text model (config.json model_type "gemma3_text"; the multimodal
// Gemma3ForConditionalGeneration is not read). Note [model families] in
// models/registry.cpp. Gemma 2 (models/gemma2/) without its soft-capping
// by default (both caps are read when set), plus q_norm and k_norm (Gemma
// norms, 1 + w, over each head before the rotary embeddings), and a rope of
// its own for the sliding-window layers: transformers 5 writes
// rope_parameters keyed by layer type ({"full_attention": {...},
// "sliding_attention": {...}}); older configs have rope_theta and
// rope_scaling for the full layers and rope_local_base_freq for the
// sliding ones, which take no scaling. Layers default to five sliding to
// one full (sliding_window_pattern 6). The tensor map is the decoder's.
#include "core/log.h"
#include "models/gemma/gemma.h"

namespace zinc::models::gemma3 {

const Family& family();

namespace {

using nlohmann::json;

// transformers' Gemma3TextConfig defaults.
LlamaConfig defaults() {
  LlamaConfig c = gemma::gemma2_defaults();
  c.qk_norm = true;
  c.attn_logit_softcapping = c.final_logit_softcapping = 0.0;
  c.sliding_pattern = 6;
  c.rope_theta = 1000000.0;
  c.rope_local_theta = 10000.0;
  return c;
}

json rope_json(double theta, const RopeScaling& s) {
  json j = {{"rope_type", "default"}, {"rope_theta", theta}};
  if (s.type == RopeScaling::Type::kLinear) j = {{"rope_type", "linear"}, {"factor", s.factor}, {"rope_theta", theta}};
  if (s.type == RopeScaling::Type::kLlama3)
    j = {{"rope_type", "llama3"},
         {"factor", s.factor},
         {"low_freq_factor", s.low_freq_factor},
         {"high_freq_factor", s.high_freq_factor},
         {"original_max_position_embeddings", s.original_max_position_embeddings},
         {"rope_theta", theta}};
  return j;
}

json gemma3_json(const LlamaConfig& c) {
  json j = gemma::gemma_json(c);
  j["architectures"] = {"Gemma3ForCausalLM"};
  j["model_type"] = "gemma3_text";
  gemma::write_attention_json(c, j);
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"full_attention", rope_json(c.rope_theta, c.rope_scaling)},
                          {"sliding_attention", rope_json(c.rope_local_theta, RopeScaling{})}};
  return j;
}

// The rope of each layer type (see the top of the file).
void read_rope(const ConfigDoc& f, LlamaConfig& c) {
  const bool keyed = f.has("rope_parameters") && f.at("rope_parameters").is_object() &&
                     (f.at("rope_parameters").contains("full_attention") ||
                      f.at("rope_parameters").contains("sliding_attention"));
  if (!keyed) {
    // read_decoder has read rope_theta and rope_scaling (or a flat
    // rope_parameters): the full layers'.
    c.rope_local_theta = f.get_number("rope_local_base_freq", c.rope_local_theta);
    return;
  }
  const json& params = f.at("rope_parameters");
  for (auto it = params.begin(); it != params.end(); ++it)
    if (it.key() != "full_attention" && it.key() != "sliding_attention")
      f.fail("rope_parameters." + it.key(), "unknown layer type (full_attention or sliding_attention)");
  c.rope_theta = defaults().rope_theta;
  c.rope_scaling = RopeScaling{};
  if (params.contains("full_attention")) llama::read_rope_params(f, params["full_attention"], "rope_parameters.full_attention", c, true);
  if (params.contains("sliding_attention")) {
    LlamaConfig local = c;
    local.rope_theta = c.rope_local_theta;
    llama::read_rope_params(f, params["sliding_attention"], "rope_parameters.sliding_attention", local, true);
    if (local.rope_scaling.type != RopeScaling::Type::kNone)
      f.fail("rope_parameters.sliding_attention.rope_type",
             "zinc implements rope scaling in Gemma 3's full-attention layers only (default here)");
    c.rope_local_theta = local.rope_theta;
  }
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  gemma::read_gemma(f, c, "hidden_activation", "Gemma 3");
  if (f.get_bool("use_bidirectional_attention", false))
    f.fail("use_bidirectional_attention", "true is not supported: zinc trains causal language models");
  read_rope(f, c);
  gemma::read_attention(f, c, f.get_int("sliding_window_pattern", f.get_int("_sliding_window_pattern", 6)));
  // transformers' Gemma 3 attention keeps attn_logit_softcapping but never
  // applies it (Gemma 2's does): so neither does zinc, and says so.
  if (c.attn_logit_softcapping > 0) {
    log_warn(f.path() + ": attn_logit_softcapping " + f.at("attn_logit_softcapping").dump() +
             " is not applied: transformers' Gemma 3 attention does not cap its scores, and zinc computes what it "
             "computes");
    c.attn_logit_softcapping = 0.0;
  }
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &gemma3_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &gemma3_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("gemma3", {"Gemma3ForCausalLM"}, &read, &from_section);
  return kFamily;
}

}  // namespace zinc::models::gemma3
