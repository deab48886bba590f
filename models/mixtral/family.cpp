// The Mixtral family (model.type "mixtral"): transformers'
// MixtralForCausalLM (Note [model families] in models/registry.cpp). Its
// graph is the Llama-style decoder's (models/llama/) with every MLP a
// mixture of experts (LlamaConfig::num_experts): num_local_experts SwiGLU
// experts of intermediate_size, each token sent to its num_experts_per_tok
// best by the router (block_sparse_moe.gate) with the chosen probabilities
// renormalised to sum 1; with output_router_logits the training loss adds
// router_aux_loss_coef times the load-balancing loss, as transformers'
// does. Experts run as one GEMM per expert over the tokens it got
// (kernels::moe_group). The tensor map names the experts
// block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down).
#include <string>

#include "models/llama/llama.h"

namespace zinc::models::mixtral {

const Family& family();

namespace {

using nlohmann::json;

// transformers' MixtralConfig defaults where zinc's LlamaConfig has others.
LlamaConfig defaults() {
  LlamaConfig c;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;  // Mixtral always renormalises
  c.expert_names = LlamaConfig::ExpertNames::kMixtral;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 1e6;
  return c;
}

json mixtral_json(const LlamaConfig& c) {
  json j = llama::decoder_json(c);
  j["architectures"] = {"MixtralForCausalLM"};
  j["model_type"] = "mixtral";
  j["num_local_experts"] = c.num_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["output_router_logits"] = c.router_aux_loss_coef > 0;
  j["router_aux_loss_coef"] = c.router_aux_loss_coef > 0 ? c.router_aux_loss_coef : 0.02;
  j["router_jitter_noise"] = 0.0;
  j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  return j;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  LlamaConfig c = defaults();
  llama::read_decoder(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; Mixtral's experts are SiLU-gated (silu)");
  c.num_experts = f.get_int("num_local_experts", c.num_experts);
  c.num_experts_per_tok = f.get_int("num_experts_per_tok", c.num_experts_per_tok);
  if (f.get_number("router_jitter_noise", 0.0) != 0.0)
    f.fail("router_jitter_noise", "must be 0: the noise would make the router's choice, and so a run, irreproducible");
  c.router_aux_loss_coef = f.get_bool("output_router_logits", false) ? f.get_number("router_aux_loss_coef", 0.001) : 0.0;
  c.sliding_window = f.get_int("sliding_window", 0);
  if (c.num_experts < 1) f.fail("num_local_experts", "must be >= 1");
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return llama::decoder_config(c, family(), &mixtral_json);
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return llama::decoder_from_section(r, defaults(), family(), &mixtral_json);
}

}  // namespace

const Family& family() {
  static const Family kFamily = llama::decoder_family("mixtral", {"MixtralForCausalLM"}, &read, &from_section,
                                                      llama::moe_section_keys());
  return kFamily;
}

}  // namespace zinc::models::mixtral
