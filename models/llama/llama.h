// The Llama family's entry points (models/llama/family.cpp): for a model
// zinc builds from its own `model` section, for tests that look inside a
// config.json as the family read it, and the Llama-style decoder's pieces
// for the families that share its graph (models/qwen3/).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/family.h"
#include "models/models.h"

namespace zinc::models::llama {

const Family& family();
std::unique_ptr<FamilyConfig> family_config(const LlamaConfig& c);
// The LlamaConfig inside `f`, or nullptr when `f` is not a Llama-style
// decoder's (any family sharing the graph).
const LlamaConfig* settings(const FamilyConfig& f);

// ---- the Llama-style decoder, shared by the families of its graph ----
// The keys every Llama-style config.json has: the sizes, rms_norm_eps, the
// rotary settings (rope_theta / rope_scaling, or transformers 5's
// rope_parameters: default, linear, llama3) and tie_word_embeddings; `c`'s
// head_dim is the default when config.json has none.
void read_decoder(const ConfigDoc& f, LlamaConfig& c);
// One rope settings object (`where` its key, for errors): rope_theta and the
// scaling (rope_type or type: default, linear, llama3, with their fields).
// nested: one of Gemma 3's objects per layer type (rope_parameters.full_attention).
void read_rope_params(const ConfigDoc& f, const nlohmann::json& params, const std::string& where, LlamaConfig& c,
                      bool nested = false);
// Sliding-window layers as the Qwen-style configs state them: with
// use_sliding_window and a sliding_window, the layers layer_types marks
// "sliding_attention", or without layer_types those default_layer(l)
// picks; otherwise none (transformers then applies no window).
void read_window_layers(const ConfigDoc& f, LlamaConfig& c, const std::function<bool(int64_t)>& default_layer);
// Those keys as config.json writes them (no architectures, model_type or
// family keys).
nlohmann::json decoder_json(const LlamaConfig& c);
// The `model` section's keys (transformers' names) and their reader, with
// defaults `c`'s.
const std::vector<std::pair<std::string, std::string>>& decoder_section_keys();
// Those and a mixture of experts' (num_experts, num_experts_per_tok,
// moe_intermediate_size, router_aux_loss_coef), which decoder_from_section
// reads where the family's defaults have experts.
const std::vector<std::pair<std::string, std::string>>& moe_section_keys();
// A family whose files name the decoder's tensors otherwise (GPT-NeoX):
// its own map (FamilyConfig::pieces) and the tensors it ignores; null: the
// decoder's (transformers' Llama names; Phi-3's fused ones with
// fused_in_file).
struct TensorMap {
  HfPieces (*pieces)(const LlamaConfig& c, const Model& model, const std::string& prefix) = nullptr;
  bool (*ignored)(const LlamaConfig& c, const std::string& name) = nullptr;
  // FamilyConfig::adapter_pieces of an adapter parameter (null: the whole tensor).
  std::vector<HfPiece> (*adapter_pieces)(const LlamaConfig& c, const ParamSpec& p, const std::string& name) = nullptr;
};
std::unique_ptr<FamilyConfig> decoder_from_section(config::Reader& r, LlamaConfig c, const Family& family,
                                                   nlohmann::json (*config_json)(const LlamaConfig&),
                                                   TensorMap map = {});
// Where LoRA's target `module` (q_proj, k_proj, v_proj, o_proj, gate_proj,
// up_proj, down_proj; Phi-3's qkv_proj, gate_up_proj; GPT-NeoX's
// query_key_value, dense, dense_h_to_4h, dense_4h_to_h) sits in a layer: its module path as PEFT names it
// ("self_attn.q_proj"), the zinc weight it adapts (q|k|v, gate|up fused),
// the rows of that weight it covers and the weight's rows, and its input
// width. rows == 0: the model has no such module (gate_proj of an ungated MLP).
struct LoraSite {
  std::string path, weight;
  int64_t row = 0, rows = 0, weight_rows = 0, in = 0;
};
LoraSite lora_site(const LlamaConfig& c, const std::string& module);
// The modules LoRA adapts in a layer ("all-linear"), PEFT's names: the
// Llama's seven, or Phi-3's four (its files fuse qkv_proj and gate_up_proj).
std::vector<std::string> lora_modules(const LlamaConfig& c);
// GPT-NeoX (the one Llama-style family with LayerNorm) names its modules
// its own way: query_key_value, dense, dense_h_to_4h, dense_4h_to_h.
bool neox_names(const LlamaConfig& c);
// The embedding's and the untied head's module names, as PEFT's
// modules_to_save names them: embed_tokens and lm_head, GPT-NeoX's
// embed_in and embed_out.
const char* embed_module(const LlamaConfig& c);
const char* head_module(const LlamaConfig& c);

// The registry entry of a Llama-style family: transformers' names for the
// embedding and the positions, the "model." prefix, the decoder's section
// keys, and the family's two readers.
Family decoder_family(std::string name, std::vector<std::string> architectures,
                      std::unique_ptr<FamilyConfig> (*read)(const ConfigDoc& doc, const std::string& architecture),
                      std::unique_ptr<FamilyConfig> (*from_section)(config::Reader& section),
                      const std::vector<std::pair<std::string, std::string>>& section_keys = decoder_section_keys());
// The FamilyConfig of the decoder `c` as `family`, which writes
// config_json(c) on export.
std::unique_ptr<FamilyConfig> decoder_config(const LlamaConfig& c, const Family& family,
                                             nlohmann::json (*config_json)(const LlamaConfig&), TensorMap map = {});

}  // namespace zinc::models::llama
