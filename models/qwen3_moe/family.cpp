// The Qwen3-MoE family (model.type "qwen3_moe"): transformers'
// Qwen3MoeForCausalLM (Note [model families] in models/registry.cpp).
// Qwen3 (models/qwen3/: per-head q/k norms, head_dim its own key) whose
// MLPs are mixtures of experts (LlamaConfig::num_experts): num_experts (the
// configs of transformers 5 also say num_local_experts) SwiGLU experts of
// moe_intermediate_size, num_experts_per_tok per token, the chosen
// probabilities renormalised with norm_topk_prob; a layer keeps a dense MLP
// of intermediate_size where mlp_only_layers lists it or (l + 1) is not a
// multiple of decoder_sparse_step. With output_router_logits the training
// loss adds router_aux_loss_coef times the load-balancing loss. The tensor
// map names the router mlp.gate and the experts mlp.experts.E.gate_proj,
// up_proj, down_proj.
#include <string>

#include "models/llama/llama.h"

namespace zinc::models::qwen3_moe {

const Family& family();

namespace {

using nlohmann::json;

// transformers' Qwen3MoeConfig defaults where zinc's LlamaConfig has others.
LlamaConfig defaults() {
  LlamaConfig c;
  c.qk_norm = true;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 768;
  c.norm_topk_prob = false;
  c.expert_names = LlamaConfig::ExpertNames::kQwen;
  return c;
}

json qwen3_moe_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = "qwen3_moe";
  j["attention_bias"] = c.qkv_bias;
  j["num_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.expert_size();
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["decoder_sparse_step"] = 1;
  json dense = json::array();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (!c.sparse_layer(l)) dense.push_back(l);
  j["mlp_only_layers"] = dense;
  j["output_router_logits"] = c.router_aux_loss_coef > 0;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef > 0 ? c.router_aux_loss_coef : 0.001;
  j["use_sliding_window"] = false;
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  llama::read_decoder(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; Qwen3-MoE's experts are SiLU-gated (silu)");
  c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
  const char* experts_key = f.has("num_experts") ? "num_experts" : "num_local_experts";
  c.num_experts = f.get_int(experts_key, c.num_experts);
  if (c.num_experts < 1) f.fail(experts_key, "must be >= 1");
  c.num_experts_per_tok = f.get_int("num_experts_per_tok", c.num_experts_per_tok);
  c.moe_intermediate_size = f.get_int("moe_intermediate_size", c.moe_intermediate_size);
  c.norm_topk_prob = f.get_bool("norm_topk_prob", c.norm_topk_prob);
  const int64_t step = f.get_int("decoder_sparse_step", 1);
  if (step < 1) f.fail("decoder_sparse_step", "must be >= 1");
  c.dense_layers.assign(static_cast<size_t>(c.num_hidden_layers), 0);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.dense_layers[static_cast<size_t>(l)] = (l + 1) % step != 0;
  if (f.has("mlp_only_layers")) {
    const json& v = f.at("mlp_only_layers");
    if (!v.is_array()) f.fail("mlp_only_layers", "expected a list of layer indices, got " + v.dump());
    for (const json& x : v) {
      if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= c.num_hidden_layers)
        f.fail("mlp_only_layers", "expected layer indices below num_hidden_layers " +
                                      std::to_string(c.num_hidden_layers) + ", got " + x.dump());
      c.dense_layers[static_cast<size_t>(x.get<int64_t>())] = 1;
    }
  }
  c.router_aux_loss_coef = f.get_bool("output_router_logits", false) ? f.get_number("router_aux_loss_coef", 0.001) : 0.0;
  // transformers' Qwen3-MoE windows every layer where use_sliding_window
  // holds (sliding_window defaults to 4096 there; null: no window): unlike
  // the dense Qwen2 and Qwen3 it reads neither max_window_layers nor
  // layer_types.
  if (f.get_bool("use_sliding_window", false) && !f.is_null("sliding_window")) {
    c.sliding_window = f.get_int("sliding_window", 4096);
    if (c.sliding_window < 1) f.fail("sliding_window", "must be >= 1, got " + std::to_string(c.sliding_window));
    c.window_layers.assign(static_cast<size_t>(c.num_hidden_layers), 1);
  }
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &qwen3_moe_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &qwen3_moe_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("qwen3_moe", {"Qwen3MoeForCausalLM"}, &read, &from_section,
                                                      llama::moe_section_keys());
  return kFamily;
}

}  // namespace zinc::models::qwen3_moe
