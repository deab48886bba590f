// zinc models: the built-in models, written against engine/model.h only.
//
// - GPT: a GPT-2-style decoder. Learned token and position embeddings,
//   pre-LayerNorm blocks (attention then a 4x GELU MLP, each with a residual
//   add), a final LayerNorm, and an output head tied to the token embedding.
//   GPT-2 initialisation: weights N(0, 0.02), the two residual projections of
//   each layer N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weights 1.
//   Blocks: 0 = embeddings {wte (V,C), wpe (block_size,C)}, 1..n_layer = the
//   transformer layers, n_layer+1 = the final LayerNorm. Optionally
//   recomputes each layer's activations in backward (gradient_checkpointing).
// - Llama: transformers' LlamaForCausalLM (also Mistral and Qwen2; see
//   LlamaConfig below). CPU only for now.
// - MLP: a next-token MLP. Position t sees the embeddings of tokens
//   t-context+1..t (zeros before the sequence start), concatenated, then
//   n_layer GELU layers of width `hidden`, then a linear head to V logits.
//   Blocks: 0 = embeddings {wte (V,C)}, 1..n_layer = hidden layers,
//   n_layer+1 = head.
// Models own their activations (sized at the first forward for a (B,T) and
// regrown if the shape changes); one model instance serves one engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/model.h"

namespace zinc::models {

// LoRA adapters (PEFT's LoraConfig): every targeted linear layer y = W x
// gains scale() * B (A x), A of (r, in) and B of (out, r), while every
// weight of the base model is frozen (BlockSpec::frozen). targets holds the
// modules as transformers names them (q_proj, k_proj, ...), in the model's
// order (as given, or {kAllLinear}, until the family resolves them; empty:
// the family's default, PEFT's). r == 0: no adapters.
inline constexpr const char* kAllLinear = "all-linear";  // target_modules: every linear layer but the head
// The largest rank taken (model.lora.r, an adapter's r): a rank past any
// layer's width trains nothing more, and past 2^31 the matmuls' sizes no
// longer fit oneDNN's (a rank of 2^32 once ended the process in the
// memory estimate rather than with an error).
inline constexpr int64_t kMaxLoraRank = int64_t{1} << 20;
// The most layers a model may have: the deepest language models have about
// 130; a million layers held gigabytes just to plan (--estimate built the
// layers' records before any size was refused).
inline constexpr int64_t kMaxLayers = 4096;
// "" when n is within [1, kMaxLayers], else why not.
inline std::string layers_refusal(int64_t n) {
  if (n >= 1 && n <= kMaxLayers) return "";
  return "must be in [1, " + std::to_string(kMaxLayers) + "], got " + std::to_string(n);
}
struct LoraConfig {
  int64_t r = 0;
  double alpha = 8.0;
  bool rslora = false;  // scale alpha / sqrt(r) instead of alpha / r
  // lora_dropout: each target's input dropped with this probability before
  // its A, in training (Note [LoRA dropout] in models/detail/lora.h).
  double dropout = 0.0;
  std::vector<std::string> targets;
  // modules_to_save: whole modules trained beside the adapters (PEFT's
  // names: embed_tokens, lm_head), each in a block of its own, not frozen.
  std::vector<std::string> modules_to_save;
  // zinc's own, not PEFT's (config key model.pack_frozen_weights): keep the
  // frozen base's layer weights packed for the matmuls where the engine
  // holds them in place (ZeRO stages 0-2): two more copies of them for
  // faster products (Note [packed frozen weights] in kernels/matmul.cpp).
  bool pack_base = true;
  bool enabled() const { return r > 0; }
  bool saves(const std::string& m) const {
    return enabled() && std::find(modules_to_save.begin(), modules_to_save.end(), m) != modules_to_save.end();
  }
  bool targets_module(const std::string& m) const {
    for (const std::string& t : targets)
      if (t == m) return true;
    return false;
  }
  float scale() const;
  bool operator==(const LoraConfig&) const = default;
};

struct GptConfig {
  int64_t vocab_size = 256;
  int64_t block_size = 256;  // max sequence length (rows of wpe)
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 128;
  // Activation checkpointing (Hugging Face's name): keep only each layer's
  // input in forward and recompute the layer's activations in its backward.
  // Saves (n_layer - 1) sets of layer activations, about 14 (N,C) fp32
  // buffers plus the attention probabilities (B,H,T,T) per layer, at the
  // cost of about one extra forward of the layers per step. Gradients are
  // bit-identical to the run without it.
  bool gradient_checkpointing = false;
  // Where forward and backward run (zinc-train: the config's "device"). kCuda
  // needs a CUDA build and a GPU; make_gpt throws naming the reason otherwise.
  Device device = Device::kCpu;
  // LoRA on c_attn, c_proj (attention's and the MLP's) and c_fc: adapter
  // blocks "h.L.lora" after ln_f, every other block frozen.
  LoraConfig lora;
};

// rope_scaling of a Llama-family config.json: none ("default"), "linear"
// (positions divided by factor) or "llama3" (Llama 3.1's frequency-band
// rescaling). Others are refused by whoever reads the config.
struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3, kLongrope, kYarn } type = Type::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  int64_t original_max_position_embeddings = 8192;       // llama3, longrope, yarn
  // longrope (Phi-3): each frequency i divided by short_factor[i], or by
  // long_factor[i] where the sequence is longer than
  // original_max_position_embeddings (transformers picks by the batch's
  // length); cos and sin times attention_factor.
  std::vector<double> short_factor, long_factor;
  double attention_factor = 1.0;  // longrope, yarn
  // yarn: frequencies blended between the original (extrapolation) and
  // divided by factor (interpolation) over a ramp between the dims where
  // beta_fast and beta_slow rotations fit the original length (floored and
  // ceiled with truncate); cos and sin times attention_factor.
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
};


// transformers' LlamaForCausalLM (also Mistral and Qwen2), with its
// config.json names: RMSNorm, rotary embeddings, grouped-query attention, a
// SiLU-gated MLP. One block per layer as for the GPT: 0 = the token
// embedding, 1..n = the layers, n+1 = the final norm (and the untied head).
// q, k and v are one fused projection ((heads + 2 kv heads) * head_dim rows,
// in that order) and gate and up another (2 * intermediate rows): Hugging
// Face's separate tensors are row ranges of them.
struct LlamaConfig {
  // The model's name in messages and checkpoints (Model::name): its
  // family's (mistral, mixtral, qwen3_moe, ...), which all build this model.
  std::string name = "llama";
  int64_t vocab_size = 256;
  int64_t hidden_size = 128;
  int64_t intermediate_size = 344;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 0;  // 0: num_attention_heads
  int64_t head_dim = 0;             // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 256;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool qkv_bias = false;  // biases on q, k, v (Llama's attention_bias; Qwen2 always)
  bool o_bias = false;    // a bias on the output projection (Llama's attention_bias)
  bool mlp_bias = false;
  // Qwen3: RMSNorm over each head of q and of k (weights q_norm and k_norm of
  // head_dim, eps rms_norm_eps) after the projection, before the rotary
  // embeddings.
  bool qk_norm = false;
  // OLMo 2: the q and k norms over each token's whole projection (weights of
  // H*head_dim and K*head_dim) instead of each head.
  bool qk_norm_full = false;
  // Phi-3, GPT-NeoX: only the first int(head_dim * partial_rotary_factor)
  // values of each head rotate.
  double partial_rotary_factor = 1.0;
  // The tensor map's, not the graph's: Phi-3's files keep q|k|v
  // (self_attn.qkv_proj) and gate|up (mlp.gate_up_proj) fused as zinc does.
  bool fused_in_file = false;
  // SmolLM3: layers without rotary embeddings. no_rope_layers holds, per
  // layer, 1 (rotary embeddings) or 0 (none), as transformers names it;
  // empty, every no_rope_layer_interval-th layer has none (0: every layer
  // has them).
  std::vector<int> no_rope_layers;
  int64_t no_rope_layer_interval = 0;
  // Granite's scalings: the embeddings times embedding_multiplier, each
  // residual branch's output times residual_multiplier, attention scores
  // times attention_multiplier (0: 1/sqrt(head_dim)), the logits divided by
  // logits_scaling. 1 (and 0) leave the Llama as it is.
  double embedding_multiplier = 1.0, residual_multiplier = 1.0, attention_multiplier = 0.0, logits_scaling = 1.0;
  bool tie_word_embeddings = false;
  // Gemma: every RMSNorm scales by norm_offset + w (1: transformers'
  // GemmaRMSNorm, whose weights start at 0), the embeddings are times
  // sqrt(hidden_size) (scale_embeddings), and the MLP's gate is GELU in its
  // tanh form (GeGLU) instead of SiLU.
  float norm_offset = 0.0f;
  bool scale_embeddings = false;
  // The MLP: gated (gate|up, act(gate) * up: SwiGLU, Gemma's GeGLU) or not
  // (GPT-NeoX: up_proj of intermediate_size rows, act(up)), and its
  // activation: SiLU (gated only), GELU's tanh form, or exact GELU (erf;
  // ungated only).
  enum class MlpAct { kSilu, kGeluTanh, kGeluErf } mlp_act = MlpAct::kSilu;
  bool mlp_gated = true;
  // GPT-NeoX: LayerNorm with a bias (eps rms_norm_eps) for every norm instead
  // of RMSNorm, and the parallel residual (out = x + attn(ln1(x)) +
  // mlp(ln2(x))).
  bool layer_norm = false;
  bool parallel_residual = false;
  // Mixture of experts (Mixtral, Qwen3-MoE): in the sparse layers the MLP
  // is num_experts SwiGLU experts of moe_intermediate_size (0:
  // intermediate_size) behind a router (mlp.gate, num_experts x hidden)
  // that sends each token to its num_experts_per_tok best experts, weighted
  // by their router probabilities (renormalised to sum 1 with
  // norm_topk_prob). dense_layers marks, per layer, 1 where the MLP stays
  // dense (empty: none). router_aux_loss_coef times the load-balancing loss
  // joins the training loss (0: not; transformers adds it with
  // output_router_logits). The files name the experts Mixtral's way
  // (block_sparse_moe.experts.E.w1/w3/w2) or Qwen's
  // (mlp.experts.E.gate_proj/up_proj/down_proj).
  int64_t num_experts = 0, num_experts_per_tok = 2, moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  std::vector<int> dense_layers;
  double router_aux_loss_coef = 0.0;
  enum class ExpertNames { kQwen, kMixtral } expert_names = ExpertNames::kQwen;
  // Where the layer's norms sit: pre_norms before attention and the MLP
  // (the Llama's), post_norms on each branch's output before its residual
  // add (Gemma 2 and 3 have both, OLMo 2 only the latter).
  bool pre_norms = true;
  bool post_norms = false;
  // Gemma 2's soft-capping of the attention scores and of the final logits:
  // x becomes cap tanh(x / cap) (0: none).
  double attn_logit_softcapping = 0.0, final_logit_softcapping = 0.0;
  // Gemma 2 and 3: the scores scale by query_pre_attn_scalar^-1/2 (0: not
  // set; attention_multiplier, else head_dim^-1/2).
  double query_pre_attn_scalar = 0.0;
  // Gemma 3: the rope base of the sliding-window layers (window_layers 1),
  // which take no rope scaling (0: the same rope in every layer).
  double rope_local_theta = 0.0;
  // Sliding-window attention (Mistral, Qwen2's use_sliding_window): query t
  // sees the sliding_window keys up to t (0: none), in the layers
  // window_layers marks 1 (transformers' layer_types "sliding_attention";
  // empty: every layer).
  int64_t sliding_window = 0;
  std::vector<int> window_layers;
  // Without window_layers, every layer but each sliding_pattern-th is a
  // sliding-window layer (Gemma 2: 2, Gemma 3: 6; 0: every layer).
  int64_t sliding_pattern = 0;
  bool gradient_checkpointing = false;
  Device device = Device::kCpu;
  float init_std = 0.02f;  // transformers' initializer_range
  // LoRA (lora.enabled()): adapter blocks after the final block, one per
  // layer ("layers.L.lora", with PEFT's tensor names), and every other
  // block frozen.
  LoraConfig lora;

  int64_t kv_heads() const { return num_key_value_heads > 0 ? num_key_value_heads : num_attention_heads; }
  // A layer transformers' layer_types marks "sliding_attention".
  bool sliding_layer(int64_t layer) const {
    if (!window_layers.empty()) return window_layers[static_cast<size_t>(layer)] != 0;
    if (sliding_pattern > 0) return (layer + 1) % sliding_pattern != 0;
    return sliding_window > 0;
  }
  int64_t window(int64_t layer) const { return sliding_window > 0 && sliding_layer(layer) ? sliding_window : 0; }
  bool uses_rope(int64_t layer) const {
    if (!no_rope_layers.empty()) return no_rope_layers[static_cast<size_t>(layer)] != 0;
    return no_rope_layer_interval <= 0 || (layer + 1) % no_rope_layer_interval != 0;
  }
  int64_t head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  bool sparse_layer(int64_t layer) const {
    return num_experts > 0 && (dense_layers.empty() || dense_layers[static_cast<size_t>(layer)] == 0);
  }
  int64_t expert_size() const { return moe_intermediate_size > 0 ? moe_intermediate_size : intermediate_size; }
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_size()) * partial_rotary_factor); }
};

// The rope inverse frequencies (rotary_dim() / 2 floats) of a config for
// sequences of T tokens, computed in fp32 as transformers computes them,
// rope_scaling included (longrope's factors depend on T).
std::vector<float> rope_inv_freq(const LlamaConfig& cfg, int64_t T);
// What the cos and sin tables are multiplied by (longrope's attention_factor; 1).
float rope_table_scale(const LlamaConfig& cfg);

struct MlpConfig {
  int64_t vocab_size = 256;
  int64_t context = 4;
  int64_t n_embd = 32;
  int64_t hidden = 256;
  int64_t n_layer = 2;
};

// A size rule a model config breaks: the field, named as in the struct (and
// in zinc-train's `model` section), and what is wrong with it, e.g.
// {"n_embd", "must be divisible by n_head 3, got 100"}.
struct SizeError {
  std::string field;
  std::string message;
};

// The first size rule `cfg` breaks, or nothing: the one place the models'
// size rules live. make_gpt / make_mlp throw it; zinc-train reports it at
// the JSON path of the field.
std::optional<SizeError> size_error(const GptConfig& cfg);
std::optional<SizeError> size_error(const MlpConfig& cfg);
std::optional<SizeError> size_error(const LlamaConfig& cfg);

// Throw zinc::Error("gpt: FIELD: MESSAGE") (or "mlp: ...") for the first
// rule size_error() finds broken.
std::shared_ptr<Model> make_gpt(const GptConfig& cfg);
std::shared_ptr<Model> make_mlp(const MlpConfig& cfg);
std::shared_ptr<Model> make_llama(const LlamaConfig& cfg);

}  // namespace zinc::models
