// The Gemma families' shared pieces (models/gemma/family.cpp): Gemma 1, 2
// and 3 are the Llama-style decoder (models/llama/) with Gemma's norm
// (scales by 1 + w), embeddings times sqrt(hidden_size) and a GELU-gated
// MLP; Gemma 2 and 3 add norms after each branch and their attention
// options (models/gemma2/, models/gemma3/).
#pragma once

#include <string>

#include "models/llama/llama.h"

namespace zinc::models::gemma {

// transformers' GemmaConfig defaults where zinc's LlamaConfig has others,
// and what makes a Gemma (norm_offset 1, scaled embeddings, GeGLU).
LlamaConfig defaults();
// The decoder's keys, attention_bias, and the MLP's activation under
// `act_key` (Gemma 1: hidden_act; 2 and 3: hidden_activation), which must
// be GELU's tanh form; `name` names the family in errors.
void read_gemma(const ConfigDoc& f, LlamaConfig& c, const std::string& act_key, const std::string& name);
// The keys every Gemma config.json has (the decoder's, attention_bias,
// both activation keys).
nlohmann::json gemma_json(const LlamaConfig& c);
// Sliding-window layers from layer_types, or without it every layer but
// each `pattern`-th (transformers' default; Gemma 2: 2, Gemma 3: 6).
void read_layer_types(const ConfigDoc& f, LlamaConfig& c, int64_t pattern);
// transformers' Gemma2Config defaults: Gemma's with the post-norms, the
// scores scaled by 256^-1/2 and soft-capped at 50, the logits at 30, a
// window of 4096 on every other layer (Gemma 3 starts from these).
LlamaConfig gemma2_defaults();
// Gemma 2 and 3's attention keys: query_pre_attn_scalar, both soft-caps
// (absent: c's default; null: none; else a number > 0), sliding_window and
// the sliding layers (read_layer_types with `pattern`).
void read_attention(const ConfigDoc& f, LlamaConfig& c, int64_t pattern);
// Gemma 2 and 3's attention keys as config.json writes them into j:
// query_pre_attn_scalar (an integer where it is whole: transformers'
// config class refuses a float), both soft-caps (null: none),
// sliding_window and layer_types.
void write_attention_json(const LlamaConfig& c, nlohmann::json& j);

}  // namespace zinc::models::gemma
