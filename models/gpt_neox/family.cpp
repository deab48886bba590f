// The GPT-NeoX family (model.type "gpt_neox"): transformers'
// GPTNeoXForCausalLM, Pythia's architecture (Note [model families] in
// models/registry.cpp). Its graph is the Llama-style decoder's
// (models/llama/) with LayerNorm (weights and biases, eps layer_norm_eps)
// for every norm, an ungated MLP of biased projections with exact GELU
// ("gelu"; the tanh forms too), biases on q, k, v and the output with
// attention_bias, partial rotary embeddings (rotary_pct / the rope
// parameters' partial_rotary_factor, 0.25 by default) and, with
// use_parallel_residual (the default), the parallel residual: out = x +
// attn(ln1(x)) + mlp(ln2(x)). No grouped-query attention.
//
// The tensor map (its own): the file's attention.query_key_value holds q, k
// and v interleaved per head (head h's rows [q_h | k_h | v_h], D each),
// where zinc keeps all q rows, then all k, then all v: each head's third is
// a piece of the file tensor (HfPiece::file_row). zinc's self_attn.o_proj,
// mlp.up_proj and mlp.down_proj are the file's attention.dense,
// mlp.dense_h_to_4h and mlp.dense_4h_to_h; the embedding is embed_in, the
// final norm final_layer_norm, and the head embed_out (unprefixed, like
// the Llama's lm_head). LoRA's adapters take the file's module names
// (query_key_value, dense, dense_h_to_4h, dense_4h_to_h), and B of
// query_key_value the weight's row pieces (adapter_pieces).
#include <string>

#include "core/error.h"
#include "models/llama/llama.h"

namespace zinc::models::gpt_neox {

const Family& family();

namespace {

using nlohmann::json;

// transformers' GPTNeoXConfig defaults where zinc's LlamaConfig has others.
LlamaConfig defaults() {
  LlamaConfig c;
  c.layer_norm = true;
  c.mlp_gated = false;
  c.mlp_act = LlamaConfig::MlpAct::kGeluErf;
  c.parallel_residual = true;
  c.qkv_bias = c.o_bias = c.mlp_bias = true;
  c.partial_rotary_factor = 0.25;
  c.rms_norm_eps = 1e-5;  // layer_norm_eps
  return c;
}

// zinc's name for a layer parameter -> the file's.
std::string file_name(const std::string& zinc) {
  for (auto [from, to] : {std::pair<const char*, const char*>{"self_attn.o_proj.", "attention.dense."},
                          {"mlp.up_proj.", "mlp.dense_h_to_4h."},
                          {"mlp.down_proj.", "mlp.dense_4h_to_h."}})
    if (zinc.rfind(from, 0) == 0) return to + zinc.substr(std::string(from).size());
  return zinc;  // input_layernorm.*, post_attention_layernorm.*
}

HfPieces pieces(const LlamaConfig& c, const Model& model, const std::string& prefix) {
  const int64_t D = c.head_size(), H = c.num_attention_heads;
  if (c.kv_heads() != H) throw Error("gpt_neox: grouped-query attention has no GPT-NeoX layout");
  HfPieces out;
  for (const BlockSpec& b : model.blocks()) {
    std::vector<std::vector<HfPiece>> block;
    for (const ParamSpec& p : b.params) {
      const std::vector<int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
      const int64_t rows = shape.empty() ? 1 : shape[0];
      if (b.name == "embed") {
        block.push_back({{prefix + "embed_in.weight", shape, rows}});
      } else if (p.name == "lm_head.weight") {  // in the final block, or its own (LoRA's modules_to_save)
        block.push_back({{"embed_out.weight", shape, rows}});
      } else if (b.name == "final") {
        block.push_back({{prefix + "final_layer_norm." + p.name.substr(p.name.find('.') + 1), shape, rows}});
      } else if (p.name.rfind("self_attn.qkv_proj.", 0) == 0) {
        // zinc's rows: q of every head, then k, then v; the file's: per
        // head, its q, k and v.
        const std::string name = prefix + b.name + ".attention.query_key_value." + p.name.substr(19);
        std::vector<HfPiece> parts;
        for (int64_t part = 0; part < 3; ++part)
          for (int64_t h = 0; h < H; ++h) parts.push_back({name, shape, D, false, h * 3 * D + part * D});
        block.push_back(std::move(parts));
      } else {
        block.push_back({{prefix + b.name + "." + file_name(p.name), shape, rows}});
      }
    }
    out.push_back(std::move(block));
  }
  return out;
}

// LoRA's B on query_key_value: its rows are the weight's, so the file
// holds them interleaved per head as it holds the weight's (pieces above);
// every other adapter tensor is whole.
std::vector<HfPiece> adapter_pieces(const LlamaConfig& c, const ParamSpec& p, const std::string& name) {
  const std::vector<int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
  if (p.name != "attention.query_key_value.lora_B.weight") return {{name, shape, shape.empty() ? 1 : shape[0]}};
  const int64_t D = c.head_size(), H = c.num_attention_heads;
  std::vector<HfPiece> parts;
  for (int64_t part = 0; part < 3; ++part)
    for (int64_t h = 0; h < H; ++h) parts.push_back({name, shape, D, false, h * 3 * D + part * D});
  return parts;
}

// A tied head in the file, and the buffers older checkpoints hold (the
// causal mask, the rotary inverse frequencies).
bool ignored(const LlamaConfig& c, const std::string& name) {
  if (name == "embed_out.weight") return c.tie_word_embeddings;
  for (const std::string suffix : {".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq"})
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return true;
  return false;
}

constexpr llama::TensorMap kMap{&pieces, &ignored, &adapter_pieces};

json neox_json(const LlamaConfig& c) {
  return {{"architectures", {"GPTNeoXForCausalLM"}},
          {"model_type", "gpt_neox"},
          {"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"max_position_embeddings", c.max_position_embeddings},
          {"layer_norm_eps", c.rms_norm_eps},
          {"rope_parameters",
           {{"rope_type", "default"}, {"rope_theta", c.rope_theta}, {"partial_rotary_factor", c.partial_rotary_factor}}},
          {"hidden_act", c.mlp_act == LlamaConfig::MlpAct::kGeluErf ? "gelu" : "gelu_new"},
          {"use_parallel_residual", c.parallel_residual},
          {"attention_bias", c.qkv_bias},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"initializer_range", c.init_std},
          {"pad_token_id", nullptr}};
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  // Pythia's own names; transformers 5's rope_parameters win where both are set.
  c.partial_rotary_factor = f.get_number("rotary_pct", c.partial_rotary_factor);
  c.rope_theta = f.get_number("rotary_emb_base", c.rope_theta);
  c.rms_norm_eps = f.get_number("layer_norm_eps", c.rms_norm_eps);
  llama::read_decoder(f, c);
  if (f.has("num_key_value_heads") && f.get_int("num_key_value_heads") != c.num_attention_heads)
    f.fail("num_key_value_heads", "GPT-NeoX has no grouped-query attention: must equal num_attention_heads");
  const std::string act = f.get_string("hidden_act", "gelu");
  if (act == "gelu")
    c.mlp_act = LlamaConfig::MlpAct::kGeluErf;
  else if (act == "gelu_new" || act == "gelu_pytorch_tanh" || act == "gelu_fast")
    c.mlp_act = LlamaConfig::MlpAct::kGeluTanh;
  else
    f.fail("hidden_act", "\"" + act + "\" is not supported; GPT-NeoX's MLP takes gelu (exact) or its tanh form "
                         "(gelu_new, gelu_pytorch_tanh, gelu_fast)");
  c.parallel_residual = f.get_bool("use_parallel_residual", true);
  c.qkv_bias = c.o_bias = f.get_bool("attention_bias", true);
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &neox_json, kMap);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  auto out = llama::decoder_from_section(r, defaults(), family(), &neox_json, kMap);
  const LlamaConfig& c = *llama::settings(*out);
  if (c.kv_heads() != c.num_attention_heads)
    throw ConfigError("model.num_key_value_heads", "GPT-NeoX has no grouped-query attention: must equal "
                                                   "num_attention_heads " + std::to_string(c.num_attention_heads) +
                                                   " (or be left out), got " + std::to_string(c.kv_heads()));
  return out;
}

}  // namespace

const Family& family() {
  static const Family kFamily{"gpt_neox",
                              {"GPTNeoXForCausalLM"},
                              "embed_in.weight",
                              "gpt_neox.",
                              "max_position_embeddings",
                              "hidden_size",
                              &read,
                              llama::decoder_section_keys(),
                              &from_section};
  return kFamily;
}

}  // namespace zinc::models::gpt_neox
