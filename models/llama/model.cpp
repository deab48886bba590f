// The Llama-family decoder (transformers' LlamaForCausalLM; Mistral and
// Qwen2 are the same graph with other options) over the zinc model
// interface. Shapes in comments: B batch, T sequence, C hidden_size, H heads,
// K kv heads, D head_dim, I intermediate_size, V vocabulary, N = B*T rows,
// A = H*D the attention width, Q = (H + 2K) D the fused q|k|v projection.
//
// One layer, as transformers computes it:
//   h    = x + o_proj(attn(rope(q), rope(k), v))   with q|k|v = qkv_proj(rms_1(x))
//          (with qk_norm, Qwen3's: q and k each RMSNorm'd per head first;
//          SmolLM3's no_rope_layers: no rope in some layers; Granite's
//          multipliers scale the embeddings, each branch, the scores and
//          the logits)
//   out  = h + down_proj(silu(gate) * up)          with gate|up = gate_up_proj(rms_2(h))
// Grouped-query attention runs through the multi-head kernel: the kv heads
// are repeated to H heads (kernels::gqa_expand, transformers' repeat_kv) and
// their gradients summed back (gqa_reduce).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "models/detail/linear.h"
#include "models/detail/lora.h"
#include "models/detail/ops.h"
#include "models/detail/pass_slots.h"
#include "models/detail/sequence_split.h"
#include "models/detail/tensor_part.h"
#include "models/llama/llama.h"
#include "models/models.h"

namespace zinc::models {
namespace {

using detail::Buf;
using detail::f32;
using kernels::CView;

// Where each parameter sits in a layer block (-1: absent, a bias not configured).
struct LayerIdx {
  int ln1 = -1, qkv_w = -1, qkv_b = -1, q_norm = -1, k_norm = -1, o_w = -1, o_b = -1;
  int ln2 = -1, gu_w = -1, gu_b = -1, down_w = -1, down_b = -1;
  int post_att = -1, post_mlp = -1;  // post_norms
  int ln1_b = -1, ln2_b = -1;        // layer_norm: the norms' biases
  int router = -1, experts_gu = -1, experts_down = -1;  // a sparse (mixture-of-experts) layer's MLP
  // LoRA: per target (LoraTarget), A and B's indices in the layer's adapter block.
  int lora_a[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1}, lora_b[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
};

// LoRA's targets in a layer, in the model's order, with PEFT's module names:
// the Llama's q, k, v, gate and up, or Phi-3's fused qkv_proj and
// gate_up_proj (one module each in its files, so one adapter each).
enum LoraTarget {
  kLoraQ, kLoraK, kLoraV, kLoraQkv, kLoraO, kLoraGate, kLoraUp, kLoraGateUp, kLoraDown, kLoraTargets
};
constexpr const char* kLoraModules[kLoraTargets] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj",   "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.gate_up_proj", "mlp.down_proj"};

// What a sparse layer's backward reads of its forward (LlamaLayerActs::moe).
struct MoeActs {
  Buf probs;                // (N,E) router probabilities
  Buf expert, weight;       // (N,k) int32 chosen experts, (N,k) their weights
  Buf token_of_row, row_of_slot;  // (M = N k) int32 grouping (kernels::moe_group), on this Ops
  std::vector<int64_t> offsets;   // (E+1) each expert's first grouped row, on the host (padded: Note [expert row blocks])
  std::vector<int64_t> real_rows;  // (E) each expert's rows before the padding
  std::vector<int32_t> expert_host;  // (N,k) the chosen experts on the host (the aux loss counts them)
  Buf xg, gu, act, y;       // (M,C) gathered input, (M,2Ie), (M,Ie), (M,C) the experts' outputs
  CView xg_in, act_in;      // what the experts' matmuls read
  Buf xg_16, act_16;
  // Expert ranks (Note [expert parallelism] in engine/expert_parallel.cpp):
  // xg is what this rank sends, and its local experts' R rows come in as
  // xe (R,C) with gu (R,2Ie) and act (R,Ie), ordered by local expert
  // (their first rows at local_offsets, El+1), from each source in rank
  // order, each expert's padded to a block (Note [expert row blocks]).
  // perm: row i of xe is row perm[i] of the rows as they arrived (by
  // source; a padding row reads row 0); unperm: where each arrived row is
  // in xe. send_rows / recv_rows: per rank.
  Buf xe, perm, unperm;
  int64_t R = 0, R_in = 0;  // the rows the local experts compute (padded: Note [expert row blocks]), and that came in
  std::vector<int64_t> local_offsets, send_rows, recv_rows;
};

// Activations of one layer that its backward reads (besides its input x_in).
struct LlamaLayerActs {
  Buf ln1, rstd1;   // (N,C), (N)
  Buf qk_pre;       // qk_norm: (N,H*D) q then (N,K*D) k before their norms
  Buf rstd_qk;      // qk_norm: (N*H) then (N*K)
  Buf qkv;          // (N,3A) rotated q, k and v repeated to H heads: attention's input
  Buf att;          // (N,A) attention output before o_proj
  Buf x_mid;        // (N,C) residual stream after attention
  Buf ln2, rstd2;   // (N,C), (N)
  Buf mean1, mean2;  // layer_norm: (N) each
  Buf gate_up;      // (N,2I) (ungated: its first N*I hold up)
  Buf act;          // (N,I) silu(gate) * up (gelu with mlp_gelu)
  Buf o_out, mlp_out;        // post_norms: (N,C) each branch's output before its norm
  Buf rstd_po, rstd_pm;      // post_norms: (N) their norms' statistics
  CView ln1_in, att_in, ln2_in, act_in;  // what the matmuls read (detail::matmul_input)
  Buf ln1_16, att_16, ln2_16, act_16;
  void* ws = nullptr;  // Ops::attention_create
  MoeActs moe;         // sparse layers
  // LoRA: per target, (N, r) U = x A^T at [t * N * r] and what B's matmuls read of it.
  Buf lora_u;
  detail::LoraSaved lora_saved[4];  // per group (Note [LoRA by groups])
};

class Llama final : public Model {
  using StageRange = detail::StageRange;  // the layers a pass computes (pipeline stages)
 public:
  explicit Llama(const LlamaConfig& c) : c_(c) {
    if (auto bad = size_error(c)) throw Error("llama: " + bad->field + ": " + bad->message);
    ops_ = &detail::ops_for(c.device);
    H_ = c.num_attention_heads;
    K_ = c.kv_heads();
    D_ = c.head_size();
    GU_ = (c.mlp_gated ? 2 : 1) * c.intermediate_size;
    I_ = c.intermediate_size;
    Vh_ = Vv_ = c.vocab_size;
    const int64_t C = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, A = H_ * D_, Q = (H_ + 2 * K_) * D_;
    const float sd = c.init_std;
    const bool frozen = c.lora.enabled();  // LoRA: the base is frozen, but for modules_to_save
    specs_.push_back({"embed", {{"embed_tokens.weight", {V, C}, Init::kNormal, sd}}, frozen && !c.lora.saves(llama::embed_module(c))});
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      BlockSpec b{"layers." + std::to_string(l), {}, frozen};
      auto add = [&](ParamSpec p) {
        b.params.push_back(std::move(p));
        return static_cast<int>(b.params.size()) - 1;
      };
      LayerIdx x;
      // Gemma's norms scale by 1 + w: their weights start at 0.
      const Init norm_init = c.norm_offset != 0.0f ? Init::kZeros : Init::kOnes;
      if (c.pre_norms) x.ln1 = add({"input_layernorm.weight", {C}, norm_init});
      if (c.pre_norms && c.layer_norm) x.ln1_b = add({"input_layernorm.bias", {C}, Init::kZeros});
      x.qkv_w = add({"self_attn.qkv_proj.weight", {Q, C}, Init::kNormal, sd, true});
      if (c.qkv_bias) x.qkv_b = add({"self_attn.qkv_proj.bias", {Q}, Init::kZeros});
      if (c.qk_norm) {
        x.q_norm = add({"self_attn.q_norm.weight", {c.qk_norm_full ? H_ * D_ : D_}, norm_init});
        x.k_norm = add({"self_attn.k_norm.weight", {c.qk_norm_full ? K_ * D_ : D_}, norm_init});
      }
      x.o_w = add({"self_attn.o_proj.weight", {C, A}, Init::kNormal, sd, true});
      if (c.o_bias) x.o_b = add({"self_attn.o_proj.bias", {C}, Init::kZeros});
      // The Llama's second norm is named post_attention_layernorm although
      // it comes before the MLP; with post_norms that name is the norm
      // after attention, and the one before the MLP pre_feedforward_layernorm.
      if (c.post_norms) x.post_att = add({"post_attention_layernorm.weight", {C}, norm_init});
      if (c.pre_norms)
        x.ln2 = add({c.post_norms ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight", {C},
                     norm_init});
      if (c.pre_norms && c.layer_norm) x.ln2_b = add({"post_attention_layernorm.bias", {C}, Init::kZeros});
      if (c.post_norms) x.post_mlp = add({"post_feedforward_layernorm.weight", {C}, norm_init});
      const std::string up = c.mlp_gated ? "mlp.gate_up_proj" : "mlp.up_proj";
      if (c.sparse_layer(l)) {
        const int64_t E = c.num_experts, Ie = c.expert_size();
        x.router = add({"mlp.gate.weight", {E, C}, Init::kNormal, sd, true});
        x.experts_gu = add({"mlp.experts.gate_up_proj", {E * 2 * Ie, C}, Init::kNormal, sd, true});
        x.experts_down = add({"mlp.experts.down_proj", {E * C, Ie}, Init::kNormal, sd, true});
      } else {
        x.gu_w = add({up + ".weight", {GU_, C}, Init::kNormal, sd, true});
        if (c.mlp_bias) x.gu_b = add({up + ".bias", {GU_}, Init::kZeros});
        x.down_w = add({"mlp.down_proj.weight", {C, I}, Init::kNormal, sd, true});
        if (c.mlp_bias) x.down_b = add({"mlp.down_proj.bias", {C}, Init::kZeros});
      }
      idx_.push_back(x);
      specs_.push_back(std::move(b));
    }
    BlockSpec fin{"final", {{"norm.weight", {C}, c.norm_offset != 0.0f ? Init::kZeros : Init::kOnes}}, frozen};
    if (c.layer_norm) fin.params.push_back({"norm.bias", {C}, Init::kZeros});
    head_ = static_cast<int>(fin.params.size());
    head_block_ = static_cast<int>(specs_.size());
    const bool own_head = c.lora.saves(llama::head_module(c));  // trained beside the adapters: a block of its own
    if (!c.tie_word_embeddings && !own_head) fin.params.push_back({"lm_head.weight", {V, C}, Init::kNormal, sd, true});
    specs_.push_back(std::move(fin));
    if (own_head) {
      head_ = 0;
      head_block_ = static_cast<int>(specs_.size());
      specs_.push_back({"lm_head", {{"lm_head.weight", {V, C}, Init::kNormal, sd, true}}, false});
    }
    lora_first_ = static_cast<int>(specs_.size());
    if (frozen) add_lora_blocks();
    pass_.acts.resize(c.gradient_checkpointing ? 1 : static_cast<size_t>(c.num_hidden_layers));
    for (LlamaLayerActs& a : pass_.acts) a.ws = ops_->attention_create();
    pass_.x_in.resize(static_cast<size_t>(c.num_hidden_layers));
  }
  ~Llama() override {
    for (LlamaLayerActs& a : pass_.acts) ops_->attention_destroy(a.ws);
    slots_.for_each([&](Pass& p) {
      for (LlamaLayerActs& a : p.acts) ops_->attention_destroy(a.ws);
    });
  }

  // Pipeline stages: each slot holds one in-flight micro-batch's forward
  // (its layers' activations, its tokens and positions, its dropout seed);
  // the selected slot's state is pass_ (models/detail/pass_slots.h).
  bool select_activations(int slot) override {
    slots_.select(slot, pass_, [&] { return ops_->attention_create(); });
    return true;
  }

  std::string name() const override { return c_.name; }
  Device device() const override { return ops_->device(); }
  const std::vector<BlockSpec>& blocks() const override { return whole_.empty() ? specs_ : whole_; }
  std::span<const float> logits() const override {
    if (ops_->device() != Device::kCpu || pass_.B == 0 || !pass_.alloc.head || vocab_split()) return {};
    return {logits_.as<const float>(), static_cast<size_t>(pass_.B * pass_.T * c_.vocab_size)};
  }

  double flops_per_token(int64_t T) const override {
    const double C = static_cast<double>(c_.hidden_size), L = static_cast<double>(c_.num_hidden_layers);
    const double A = static_cast<double>(H_ * D_), Q = static_cast<double>((H_ + 2 * K_) * D_);
    const double I = static_cast<double>(I_);
    // A sparse layer counts its router and the k experts a token runs
    // through (the active parameters), not all E.
    double mlp = 0;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      mlp += c_.sparse_layer(l) ? static_cast<double>(c_.num_experts_per_tok) * 3.0 * C *
                                          static_cast<double>(c_.expert_size()) +
                                      C * static_cast<double>(c_.num_experts)
                                : (c_.mlp_gated ? 3.0 : 2.0) * C * I;
    const double matmul_params = L * (C * Q + A * C) + mlp + static_cast<double>(c_.vocab_size) * C;
    // attention scores and weighted sum: 2 matmuls of 2*T*A flops per token
    // forward, x3 for forward + backward (causal masking not discounted).
    const double attention = L * 3.0 * 2.0 * 2.0 * static_cast<double>(T) * A;
    return 6.0 * matmul_params + attention;
  }

  // The buffers ensure_buffers allocates and the kernel calls of forward and
  // backward by shape (keep in step with both).
  std::optional<ActivationMemory> activation_memory(int64_t B, int64_t T, DType dt) const override {
    return activation_bytes(B, T, dt, StageRange{0, c_.num_hidden_layers, true, true}, 1, tp_size_);
  }
  // A pipeline stage's: its layers' activations, `sets` times (one per
  // micro-batch in flight, select_activations), and the head's buffers on
  // the last stage only.
  std::optional<ActivationMemory> stage_activation_memory(int64_t B, int64_t T, DType dt, const PipelineStage& st,
                                                          int sets, int tensor_parts) const override {
    return activation_bytes(B, T, dt, stage_range(st), sets, tensor_parts);
  }
  // One of `size` sequence ranks': a slice of each row, the attention's
  // workspace over whole rows of its heads, the all-to-alls' buffers.
  std::optional<ActivationMemory> sequence_activation_memory(int64_t B, int64_t T, DType dt, int size,
                                                             int tensor_parts) const override {
    return activation_bytes(B, T, dt, StageRange{0, c_.num_hidden_layers, true, true}, 1, tensor_parts, size);
  }
  // With tensor parts (after use_tensor_part) the part's heads must divide.
  std::string sequence_split_error(int size) const override {
    if (H_ % size != 0)
      return (tp_size_ > 1 ? "a tensor part's " + std::to_string(H_) + " attention heads are"
                           : "num_attention_heads " + std::to_string(H_) + " is") +
             " not a multiple of it: each sequence rank attends with whole heads";
    if (c_.num_experts > 0 && c_.router_aux_loss_coef > 0)
      return "the load-balancing loss of model '" + name() + "' (router_aux_loss_coef " +
             std::to_string(c_.router_aux_loss_coef) + ") is a product of sums over the whole batch, which a "
             "slice of the rows does not see; set router_aux_loss_coef 0 or sequence_parallel_size 1";
    return "";
  }

 private:
  // One of `parts` tensor parts' (its heads and MLP share).
  // And of one of `seq` sequence ranks (T: the whole rows').
  std::optional<ActivationMemory> activation_bytes(int64_t B, int64_t T, DType dt, const StageRange& sr, int sets,
                                                   int parts, int seq = 1) const {
    using detail::buffer_bytes;
    // The Ops' count of a matmul input's 16-bit copy (the GPU keeps one in fp16 too).
    const auto matmul_input_bytes = [this](int64_t n, DType d) { return ops_->matmul_input_bytes(n, d); };
    const int64_t N = B * (T / seq), C = c_.hidden_size, L = c_.num_hidden_layers;
    const int64_t H = c_.num_attention_heads / parts, K = c_.kv_heads() / parts;  // the part's
    const int64_t GU = (c_.mlp_gated ? 2 : 1) * c_.intermediate_size / parts;
    const int64_t I = c_.intermediate_size / parts, A = H * D_, Q = (H + 2 * K) * D_;
    kernels::AttentionShape as{B, T, A / seq, H / seq};
    as.softcap = att_softcap();
    ActivationMemory m;
    // The fp32 buffers the Ops leaves unwritten are not allocated (dropped_buffers).
    const int dropped = dropped_buffers(dt, seq, vocab_share(parts) == c_.vocab_size);
    auto unless = [&](int flag, int64_t bytes) { return dropped & flag ? int64_t{0} : bytes; };
    const int64_t acts = unless(kDropLn1, buffer_bytes(N * C)) + buffer_bytes(N * C) +
                         unless(kDropLn2, buffer_bytes(N * C)) + buffer_bytes(N * 3 * A) +
                         unless(kDropAtt, buffer_bytes(N * A)) + buffer_bytes(N * 2 * I) +
                         unless(kDropAct, buffer_bytes(N * I)) + 2 * buffer_bytes(N) +
                         2 * matmul_input_bytes(N * C, dt) + matmul_input_bytes(N * A, dt) +
                         matmul_input_bytes(N * I, dt) + ops_->attention_workspace_bytes(as, dt) +
                         (c_.qk_norm ? buffer_bytes(N * (H + K) * D_) + buffer_bytes(N * (H + K)) : 0) +
                         (c_.post_norms ? 2 * buffer_bytes(N * C) + 2 * buffer_bytes(N) : 0) +
                         (c_.layer_norm ? 2 * buffer_bytes(N) : 0);  // mean1, mean2
    // The layer inputs ensure_buffers allocates (decoder layers lo..hi and
    // the input of the next stage; every layer for the whole model).
    const int64_t layers = sr.hi - sr.lo;
    const int64_t x_ins = sr.embed && sr.head ? L : std::min(sr.hi + 1, L) - sr.lo;
    const int64_t act_sets = sets * (c_.gradient_checkpointing ? (layers > 0 ? 1 : 0) : layers);
    m.saved = sets * x_ins * buffer_bytes(N * C) + act_sets * acts;
    // LoRA's groups at the part's sizes (Note [LoRA over tensor parts]).
    const auto part_groups = lora() ? lora_groups(parts) : decltype(lora_groups_){};
    if (lora()) {
      // Per set: U of every target (lora_u) and what B's products read of
      // each group's; once: the groups' scratch (LoraScratch) and the sink.
      const int64_t r = c_.lora.r;
      int64_t u16 = 0;
      for (const detail::LoraGroup& g : part_groups.front())
        u16 += detail::matmul_input_bytes(N * r * static_cast<int64_t>(g.members.size()), dt);
      m.saved += act_sets * (buffer_bytes(N * kLoraTargets * r) + u16) +
                 detail::LoraScratch::bytes(N, r, detail::lora_all_groups(part_groups), c_.lora.dropout > 0, dt) +
                 buffer_bytes(2 * std::max(C, std::max(H, K) * D_));
    }
    // Once: x_final lnf dlnf dres dsmall, the projection scratch, dbig, dmid,
    // lnf's statistics, logits and dlogits, lnf's 16-bit copy, the tokens.
    m.saved += 4 * buffer_bytes(N * C) + unless(kDropLnf, buffer_bytes(N * C)) + buffer_bytes(N * Q) +
               buffer_bytes(N * std::max(2 * I, 3 * A)) +
               buffer_bytes(N * std::max(A, I)) + buffer_bytes(N) +
               (sr.head ? buffer_bytes(N * vocab_share(parts)) +
                              buffer_bytes(N * vocab_share(parts), dropped & kLogitGrad16 ? 2 : 4)
                        : 0) +
               matmul_input_bytes(N * C, dt) + N * static_cast<int64_t>(sizeof(int32_t));
    // The rope tables: cos and sin of (T, rotary_dim / 2), twice with a
    // local theta (build_rope_tables).
    m.saved += (c_.rope_local_theta > 0 ? 2 : 1) * 2 * buffer_bytes(T * (c_.rotary_dim() / 2));
    if (c_.qk_norm) m.saved += buffer_bytes(2 * N * std::max(H, K) * D_);  // qk_scratch_
    if (seq > 1) m.saved += 2 * buffer_bytes(N * 3 * A);                     // seq_: send and recv
    if (c_.residual_multiplier != 1.0) m.saved += buffer_bytes(N * C);        // branch_
    if (c_.layer_norm) m.saved += buffer_bytes(N);                            // lnf_mean_
    if (c_.parallel_residual) m.saved += buffer_bytes(N * C);                 // dpar_
    const int64_t E = c_.num_experts, Ie = c_.expert_size(), M = N * c_.num_experts_per_tok;
    if (E > 0) {
      // Per set of layer activations (MoeActs): probs, experts, weights,
      // the two grouping maps, xg, gu, act (not with kDropMoeAct), y and
      // the 16-bit copies the experts' matmuls read; once: the router
      // logits and backward's grouped-row scratch. The grouped rows at
      // their padded most (Note [expert row blocks]).
      const int64_t Mg = padded_rows(N);
      const int64_t moe = buffer_bytes(N * E) + 2 * buffer_bytes(M, sizeof(int32_t)) +
                          buffer_bytes(Mg, sizeof(int32_t)) + buffer_bytes(M) + 2 * buffer_bytes(Mg * C) +
                          buffer_bytes(Mg * 2 * Ie) + unless(kDropMoeAct, buffer_bytes(Mg * Ie)) +
                          matmul_input_bytes(Mg * C, dt) +
                          matmul_input_bytes(Mg * Ie, dt);
      m.saved += act_sets * moe + buffer_bytes(N * E) + buffer_bytes(Mg * C) + buffer_bytes(Mg * 2 * Ie) +
                 buffer_bytes(Mg * Ie) + buffer_bytes(M);
    }
    const detail::OperandKind x = detail::matmul_input_kind(dt);
    int64_t dy_copy = 0;
    // The pass's kernel scratch, with the frozen base's layer products packed
    // (packed(): no weight converted per call) or not.
    auto tally = [&](bool packed) {
      kernels::ScratchTally t;
      for (auto [in, out, bias] : {std::tuple<int64_t, int64_t, bool>{C, Q, c_.qkv_bias}, {A, C, c_.o_bias},
                                   {C, GU, c_.mlp_bias}, {I, C, c_.mlp_bias}}) {
        detail::tally_linear_forward(t, x, N, in, out, bias, dt, packed);
        dy_copy = std::max(dy_copy, detail::tally_linear_backward(t, x, N, in, out, true, dt, !lora(),  // LoRA: frozen
                                                                  packed));
      }
      if (E > 0) {
        // An expert's rows are at most N (a token picks an expert once), N
        // padded to its block: its matmuls' scratch there bounds each; the
        // router's at N.
        const int64_t rows = std::min((N + kExpertRows - 1) / kExpertRows * kExpertRows, padded_rows(N));
        for (auto [in, out, r] : {std::tuple<int64_t, int64_t, int64_t>{C, 2 * Ie, rows}, {Ie, C, rows}, {C, E, N}}) {
          detail::tally_linear_forward(t, x, r, in, out, false, dt);
          dy_copy = std::max(dy_copy, detail::tally_linear_backward(t, x, r, in, out, true, dt, !lora()));
        }
      }
      t.attention(as, dt);
      if (lora()) {
        detail::lora_tally(t, N, c_.lora.r, c_.lora.scale(), detail::lora_all_groups(part_groups), dt,
                           c_.lora.dropout > 0);
      }
      if (sr.head) {
        detail::tally_linear_forward(t, x, N, C, vocab_share(parts), false, dt);
        // The head's weight gradient: its block's, or with a tied head the embedding's.
        const size_t hb = c_.tie_word_embeddings ? 0 : static_cast<size_t>(head_block_);
        const int64_t copy =
            detail::tally_linear_backward(t, x, N, C, vocab_share(parts), true, dt, !specs_[hb].frozen);
        if (!(dropped & kLogitGrad16)) dy_copy = std::max(dy_copy, copy);  // else the cross-entropy wrote the operand
      }
      return ops_->kernel_scratch_bytes(t, as, dt);
    };
    const int64_t plain = tally(false);
    m.workspace = plain + dy_copy;
    if (lora() && c_.lora.pack_base) {
      // What packing adds (ActivationMemory::packed): the copies of
      // packed(), q|k|v and o in every layer, gate|up and down in a dense
      // one; less the scratch the packed products no longer need.
      const int64_t attn = detail::packed_linear_bytes(N, C, Q, c_.qkv_bias, dt) +
                           detail::packed_linear_bytes(N, A, C, c_.o_bias, dt);
      const int64_t mlp = detail::packed_linear_bytes(N, C, GU, c_.mlp_bias, dt) +
                          detail::packed_linear_bytes(N, I, C, c_.mlp_bias, dt);
      for (int64_t l = sr.lo; l < sr.hi; ++l) m.packed += attn + (idx_[static_cast<size_t>(l)].router >= 0 ? 0 : mlp);
      m.packed += tally(true) - plain;
    }
    return m;
  }

 public:

  float forward(StepContext& ctx, const Batch& batch) override {
    pass_ctx_ = &ctx;
    pass_.lora_seed = ctx.dropout_seed();  // Note [LoRA dropout]: this forward's, for its backward too
    const int64_t B = batch.B, T = batch.T, C = c_.hidden_size, V = c_.vocab_size;
    // Sequence ranks: this is a slice of rows of sp.T tokens (whole_T_).
    const SequenceSplit& sp = ctx.sequence_split();
    whole_T_ = sp.split() ? sp.T : T;
    if (whole_T_ > c_.max_position_embeddings)
      throw Error("llama: sequence length " + std::to_string(whole_T_) + " exceeds max_position_embeddings " +
                  std::to_string(c_.max_position_embeddings));
    const StageRange sr = stage_range(ctx.pipeline_stage());
    const DType dt = ctx.compute_dtype();
    ensure_buffers(B, T, sr, dropped_buffers(dt, sp.split() ? sp.size : 1, !vocab_split()));
    const int64_t N = B * T;
    pass_.tokens = batch.inputs;  // backward's embedding scatter reads them after the batch is gone
    pass_.tok = ops_->tokens(pass_.tokens, V, "embedding_forward", pass_.tokens_store);
    const int32_t* targets = ops_->targets(batch.targets, V, targets_store_);
    pass_.positions = batch.positions;  // backward reads them too
    pass_.pos = ops_->positions(pass_.positions, pass_.positions_store);
    // The whole rows' positions the attention masks by (a sequence rank's
    // slice: its own are in the whole row, pass_.pos).
    whole_positions_ = sp.split() && sp.positions ? *sp.positions : std::vector<int32_t>{};
    whole_pos_ = sp.split() ? ops_->positions(whole_positions_, whole_pos_store_) : pass_.pos;
    if (c_.rope_scaling.type == RopeScaling::Type::kLongrope) {
      // transformers picks longrope's factors by the batch's largest
      // position + 1 (packed documents can all be shorter than the rows).
      const std::vector<int32_t>& all = sp.split() ? whole_positions_ : pass_.positions;
      const int64_t len = all.empty() ? whole_T_ : *std::max_element(all.begin(), all.end()) + 1;
      const int64_t orig = c_.rope_scaling.original_max_position_embeddings;
      if ((len > orig) != (rope_len_ > orig)) build_rope_tables(whole_T_, len);
    }

    if (sr.embed) {
      HeldParams emb = ctx.acquire(0);
      if (vocab_split()) {  // the part's rows, zero elsewhere, summed over the parts
        ops_->embedding_part_forward(pass_.x_in[0].as<float>(), pass_.tok, emb[0], N, C, vlo_, Vh_);
        tensor_sum(pass_.x_in[0].as<float>(), N * C);
      } else {
        ops_->embedding_forward(pass_.x_in[0].as<float>(), pass_.tok, emb[0], CView{}, B, T, C, V, nullptr);
      }
      if (embed_factor() != 1.0f) ops_->scale(pass_.x_in[0].as<float>(), embed_factor(), N * C);
    } else {  // a later pipeline stage: the previous stage's hidden state
      ops_->copy_columns(hidden(sr.lo), C, ctx.pipeline_stage().input, C, N, C);
    }
    aux_layers_ = 0;
    aux_count_.assign(static_cast<size_t>(c_.num_experts), 0.0);
    aux_prob_.assign(static_cast<size_t>(c_.num_experts), 0.0);
    for (int64_t l = sr.lo; l < sr.hi; ++l) {
      float* x_out = l + 1 < c_.num_hidden_layers ? pass_.x_in[l + 1].as<float>() : x_final_.as<float>();
      HeldParams p = ctx.acquire(static_cast<int>(l + 1));
      HeldParams lp;
      if (lora()) lp = ctx.acquire(lora_block(l));
      layer_forward(p, acts(l), l, pass_.x_in[l].as<float>(), x_out, B, T, dt, lora() ? &lp : nullptr);
    }
    pass_.acts_hold = sr.hi - 1;
    if (!sr.head) {  // the next stage's input
      ops_->copy_columns(ctx.pipeline_stage().output, C, hidden(sr.hi), C, N, C);
      return 0.0f;
    }

    const int fin = final_block();
    HeldParams nf = ctx.acquire(fin);
    if (c_.layer_norm) {
      ops_->layernorm_forward(lnf_.as<float>(), lnf_mean_.as<float>(), lnf_rstd_.as<float>(), x_final_.as<float>(),
                              nf[0], nf[1], N, C, eps());
      lnf_in_ = ops_->matmul_input(lnf_.as<float>(), N * C, dt, lnf_16_);
    } else {  // the head's operand written by the norm where the Ops fuses it (lnf_ then unwritten)
      lnf_in_ = ops_->rmsnorm_forward_input(lnf_.as<float>(), lnf_rstd_.as<float>(), x_final_.as<float>(), nullptr,
                                            nf[0], N, C, eps(), c_.norm_offset, dt, lnf_16_);
    }
    if (c_.tie_word_embeddings) {
      nf.release();
      HeldParams emb = ctx.acquire(0);
      detail::linear_forward(*ops_, logits_.as<float>(), lnf_in_, emb[0], CView{}, N, C, Vv_, dt);
    } else if (head_block_ != fin) {
      nf.release();
      HeldParams head = ctx.acquire(head_block_);
      detail::linear_forward(*ops_, logits_.as<float>(), lnf_in_, head[head_], CView{}, N, C, Vv_, dt);
    } else {
      detail::linear_forward(*ops_, logits_.as<float>(), lnf_in_, nf[head_], CView{}, N, C, Vv_, dt);
    }
    if (c_.logits_scaling != 1.0) ops_->scale(logits_.as<float>(), logits_factor(), N * Vv_);
    if (c_.final_logit_softcapping > 0)
      ops_->softcap_forward(logits_.as<float>(), static_cast<float>(c_.final_logit_softcapping), N * Vv_);
    // Vocabulary parts: each holds Vh_ of the logits' columns (Note
    // [vocabulary parts] in engine/tensor_parallel.cpp).
    // The 16-bit operand alone is written with fp16's loss scale.
    grad16_scale_ = ctx.coming_loss_scale();
    double loss = vocab_split() ? vocab_cross_entropy(targets, N)
                  : pass_.dropped & kLogitGrad16
                      ? ops_->cross_entropy_operand16(logits_.as<float>(), targets, N, V, dlogits_.data(), dt,
                                                      grad16_scale_)
                      : ops_->cross_entropy(logits_.as<float>(), targets, N, V, dlogits_.as<float>(), 1.0f);
    if (c_.router_aux_loss_coef > 0 && aux_layers_ > 0) loss += c_.router_aux_loss_coef * aux_loss(N);
    return static_cast<float>(loss);
  }

  // The load-balancing loss over this forward's sparse layers, as
  // transformers' load_balancing_loss_func: f_e the share of (layer,
  // token, slot) picks that chose e, P_e the mean router probability of e;
  // E sum_e f_e P_e. f carries no gradient; d/d probs(l,t,e) = E f_e / (L N)
  // for every layer and token (kept in aux_f_ for backward).
  double aux_loss(int64_t N) {
    const int64_t E = c_.num_experts;
    const double rows = static_cast<double>(aux_layers_ * N);
    double aux = 0;
    aux_f_.assign(static_cast<size_t>(E), 0.0);
    for (int64_t e = 0; e < E; ++e) {
      aux_f_[static_cast<size_t>(e)] = aux_count_[static_cast<size_t>(e)] / rows;
      aux += aux_f_[static_cast<size_t>(e)] * (aux_prob_[static_cast<size_t>(e)] / rows);
    }
    return static_cast<double>(E) * aux;
  }

  void backward(StepContext& ctx, float loss_scale) override {
    pass_ctx_ = &ctx;
    const int64_t B = pass_.B, T = pass_.T, C = c_.hidden_size, V = c_.vocab_size, N = B * T;
    const int64_t I = I_, A = H_ * D_, Q = (H_ + 2 * K_) * D_;
    const DType dt = ctx.compute_dtype();
    const PipelineStage& st = ctx.pipeline_stage();
    const StageRange sr = stage_range(st);
    HeldParams emb;
    // The embedding's gradient: the first stage's, and a tied head's (the
    // last stage keeps its own copy; the engine sums the two).
    const bool tied_head = sr.head && c_.tie_word_embeddings;
    const BlockGrads gemb = sr.embed || tied_head ? base_grads(ctx, 0) : BlockGrads{};
    float* dx = dres_.as<float>();  // (N,C) gradient of the residual stream
    if (sr.head)
      head_backward(ctx, loss_scale, emb, gemb);
    else  // the next stage's gradient of this stage's output
      ops_->copy_columns(dx, C, st.output_grad, C, N, C);

    float* dbig = dbig_.as<float>();      // (N, max(2I, 3A))
    float* dmid = dmid_.as<float>();      // (N, max(A, I))
    float* dsmall = dsmall_.as<float>();  // (N,C)
    float* dproj = proj_.as<float>();     // (N,Q)
    for (int64_t l = sr.hi - 1; l >= sr.lo; --l) {
      const LayerIdx& x = idx_[static_cast<size_t>(l)];
      LlamaLayerActs& a = acts(l);
      const float* x_in = pass_.x_in[l].as<float>();
      const int blk = static_cast<int>(l + 1);
      HeldParams p = ctx.acquire(blk);
      detail::HeldAdapter adapter = detail::hold_adapter(ctx, lora() ? lora_block(l) : -1);
      const HeldParams* lpp = adapter.get();
      const BlockGrads& lg = adapter.g;
      if (c_.gradient_checkpointing && pass_.acts_hold != l) {
        layer_forward(p, a, l, x_in, nullptr, B, T, dt, lpp);
        pass_.acts_hold = l;
      }
      BlockGrads g = base_grads(ctx, blk);
      // MLP: dx holds d out and becomes d h.
      const float* dy = post_norm_backward(p, g, x.post_mlp, branch_grad(dx, N), a.mlp_out, a.rstd_pm, N);
      if (x.router >= 0) {
        moe_backward(p, g, x, a, dy, dsmall, N, dt, loss_scale);
      } else {
        CView dy_in = ops_->dy_operand(dy, bias_grad(g, x.down_b), N, C, dt, dy16_);
        detail::linear_backward(*ops_, dy16_, dmid, weight_grad(g, x.down_w), nullptr, {}, a.act_in, p[x.down_w], N,
                                I, C, dt, dy_in, g.overwrite(x.down_w), packed(p, l, kGroupDown, true));
        lora_backward(lpp, lg, a, l, kGroupDown, a.act_in, dy_in, dmid, N, dt);  // Note [LoRA after the base]
        act_backward(dbig, dmid, a.gate_up.as<float>(), N);
        dy_in = ops_->dy_operand(dbig, bias_grad(g, x.gu_b), N, GU_, dt, dy16_);
        detail::linear_backward(*ops_, dy16_, dsmall, weight_grad(g, x.gu_w), nullptr, {}, a.ln2_in, p[x.gu_w], N, C,
                                GU_, dt, dy_in, g.overwrite(x.gu_w), packed(p, l, kGroupGateUp, true));
        lora_backward(lpp, lg, a, l, kGroupGateUp, a.ln2_in, dy_in, dsmall, N, dt);  // Note [LoRA after the base]
        tensor_sum(dsmall, N * C);  // each part's share of d ln2
      }
      // With the parallel residual the MLP's norm read x_in: its gradient
      // joins d x after the attention branch has read d h.
      float* dnorm2 = c_.parallel_residual ? dpar_.as<float>() : dx;
      if (c_.parallel_residual) ops_->zero(dnorm2, N * C);
      pre_norm_backward(p, g, x.ln2, x.ln2_b, dnorm2, dsmall, c_.parallel_residual ? x_in : a.x_mid.as<float>(),
                        a.mean2, a.rstd2, N);
      // Attention: dx holds d h and becomes d x.
      dy = post_norm_backward(p, g, x.post_att, branch_grad(dx, N), a.o_out, a.rstd_po, N);
      CView dy_in = ops_->dy_operand(dy, bias_grad(g, x.o_b), N, C, dt, dy16_);
      detail::linear_backward(*ops_, dy16_, dmid, weight_grad(g, x.o_w), nullptr, {}, a.att_in, p[x.o_w], N, A, C, dt,
                              dy_in, g.overwrite(x.o_w), packed(p, l, kGroupO, true));
      lora_backward(lpp, lg, a, l, kGroupO, a.att_in, dy_in, dmid, N, dt);  // Note [LoRA after the base]
      if (sequence_split()) {
        seq_.to_heads(*ops_, ctx, dmid, dmid, B, 1, seq_heads_w());
        ops_->attention_backward(a.ws, dbig, dmid, a.qkv.as<float>(), attention_shape(l), dt);
        seq_.to_tokens(*ops_, ctx, dbig, dbig, B, 3, seq_heads_w());
      } else if (gqa_in_place(dt)) {  // dq | dk | dv straight into the projection's gradient
        ops_->attention_backward(a.ws, dproj, dmid, a.qkv.as<float>(), attention_shape(l, true), dt);
      } else {
        ops_->attention_backward(a.ws, dbig, dmid, a.qkv.as<float>(), attention_shape(l), dt);
      }
      if (sequence_split() || !gqa_in_place(dt)) ops_->gqa_reduce(dproj, dbig, N, H_, K_, D_);
      if (c_.uses_rope(l))
        ops_->rope(dproj, rope_cos(l), rope_sin(l), rope_shape(B, T), true);
      if (c_.qk_norm) qk_norm_backward(p, g, a, dproj, N);
      dy_in = ops_->dy_operand(dproj, bias_grad(g, x.qkv_b), N, Q, dt, dy16_);
      // Note [no input gradient under a frozen embedding]
      const bool input_grad = l > sr.lo || needs_input_grad(sr);
      float* dln1 = input_grad ? dsmall : nullptr;
      detail::linear_backward(*ops_, dy16_, dln1, weight_grad(g, x.qkv_w), nullptr, {}, a.ln1_in, p[x.qkv_w], N, C,
                              Q, dt, dy_in, g.overwrite(x.qkv_w), packed(p, l, kGroupQkv, true));
      lora_backward(lpp, lg, a, l, kGroupQkv, a.ln1_in, dy_in, dln1, N, dt);  // Note [LoRA after the base]
      if (input_grad) {
        tensor_sum(dsmall, N * C);  // each part's share of d ln1
        pre_norm_backward(p, g, x.ln1, x.ln1_b, dx, dsmall, x_in, a.mean1, a.rstd1, N);
        if (c_.parallel_residual) ops_->add(dx, dx, dpar_.as<float>(), N * C);
      }
      p.release();
      base_grads_ready(ctx, blk);
      if (lora()) {
        adapter.p.release();
        ctx.grads_ready(lora_block(l));
      }
    }
    if (!sr.embed) {  // the previous stage's gradient of its output
      ops_->copy_columns(st.input_grad, C, dx, C, N, C);
      if (tied_head) {
        emb.release();
        base_grads_ready(ctx, 0);
      }
      return;
    }
    if (needs_input_grad(sr)) {  // a frozen embedding has nothing to learn from dx
      if (embed_factor() != 1.0f) ops_->scale(dx, embed_factor(), N * C);
      if (vocab_split())
        ops_->embedding_part_backward(gemb[0], dx, pass_.tok, N, C, vlo_, Vh_);
      else
        ops_->embedding_backward(gemb[0], nullptr, dx, pass_.tok, B, T, C, V, nullptr);
    }
    emb.release();
    base_grads_ready(ctx, 0);
  }

  // The head's backward (the last pipeline stage's, or the whole model's):
  // from the loss through the head and the final norm into dres_. A tied
  // head holds the embedding (emb) and sums into its gradient (gemb).
  void head_backward(StepContext& ctx, float loss_scale, HeldParams& emb, const BlockGrads& gemb) {
    const int64_t B = pass_.B, T = pass_.T, C = c_.hidden_size, N = B * T;
    const DType dt = ctx.compute_dtype();
    // The gradient is fp32 (dy), or its 16-bit operand alone (dy_op, kLogitGrad16).
    const bool grad16 = pass_.dropped & kLogitGrad16;
    if (grad16 && loss_scale != grad16_scale_)
      throw Error("llama: backward's loss scale " + std::to_string(loss_scale) + " is not the " +
                  std::to_string(grad16_scale_) + " the forward wrote the 16-bit logit gradient with");
    const CView dy = grad16 ? CView{} : f32(dlogits_.as<float>());
    const CView dy_op = grad16 ? CView{dlogits_.data(), dt} : CView{};
    if (!grad16 && loss_scale != 1.0f) ops_->scale(dlogits_.as<float>(), loss_scale, N * Vv_);
    if (c_.final_logit_softcapping > 0)
      ops_->softcap_backward(dlogits_.as<float>(), logits_.as<float>(), static_cast<float>(c_.final_logit_softcapping),
                             N * Vv_);
    if (c_.logits_scaling != 1.0) ops_->scale(dlogits_.as<float>(), logits_factor(), N * Vv_);

    const int fin = final_block();
    HeldParams nf = ctx.acquire(fin);
    BlockGrads gnf = base_grads(ctx, fin);
    // Head: dlnf = dlogits W; dW += dlogits^T lnf (W = lm_head, or the tied embedding).
    if (c_.tie_word_embeddings) {
      emb = ctx.acquire(0);
      detail::linear_backward(*ops_, dy16_, dlnf_.as<float>(), weight_grad(gemb, 0), nullptr, dy, lnf_in_, emb[0], N,
                              C, Vv_, dt, dy_op);
    } else if (head_block_ != fin) {  // LoRA's modules_to_save: the head trains
      HeldParams head = ctx.acquire(head_block_);
      BlockGrads ghead = ctx.grads(head_block_);
      detail::linear_backward(*ops_, dy16_, dlnf_.as<float>(), ghead[head_], nullptr, dy, lnf_in_, head[head_], N, C,
                              Vv_, dt, dy_op, ghead.overwrite(head_));
      head.release();
      ctx.grads_ready(head_block_);
    } else {
      detail::linear_backward(*ops_, dy16_, dlnf_.as<float>(), weight_grad(gnf, head_), nullptr, dy, lnf_in_,
                              nf[head_], N, C, Vv_, dt, dy_op, gnf.overwrite(head_));
    }
    if (vocab_split()) tensor_sum(dlnf_.as<float>(), N * C);  // each vocabulary part's share of d lnf
    float* dx = dres_.as<float>();
    ops_->zero(dx, N * C);
    if (c_.layer_norm)
      ops_->layernorm_backward(dx, norm_grad(gnf, 0), norm_grad(gnf, 1), dlnf_.as<float>(), x_final_.as<float>(),
                               nf[0], lnf_mean_.as<float>(), lnf_rstd_.as<float>(), N, C);
    else
      ops_->rmsnorm_backward(dx, norm_grad(gnf, 0), dlnf_.as<float>(), x_final_.as<float>(), nf[0],
                             lnf_rstd_.as<float>(), N, C, c_.norm_offset);
    nf.release();
    base_grads_ready(ctx, fin);
  }

  // Pipeline layers: the embedding, each decoder layer with its adapters'
  // block, the final norm with the head (and a tied head's embedding, which
  // the engine keeps from being split from the embedding layer).
  std::vector<PipelineLayer> pipeline_layers() const override {
    // The load-balancing loss sums over every sparse layer into the loss.
    if (c_.router_aux_loss_coef > 0 && c_.num_experts > 0) return {};
    std::vector<int> head{final_block()};
    if (head_block_ != final_block()) head.push_back(head_block_);
    if (c_.tie_word_embeddings) head.push_back(0);
    return detail::decoder_pipeline_layers(specs_, c_.num_hidden_layers, lora() ? lora_first_ : -1, std::move(head));
  }
  std::string pipeline_split_error() const override {
    if (c_.router_aux_loss_coef > 0 && c_.num_experts > 0) {
      char coef[32];
      std::snprintf(coef, sizeof coef, "%g", c_.router_aux_loss_coef);
      return std::string("its load-balancing loss (router_aux_loss_coef ") + coef +
             ") sums over every mixture-of-experts layer into the loss, which no stage holds whole; with "
             "router_aux_loss_coef 0 it splits";
    }
    return {};
  }
  int64_t pipeline_width() const override { return c_.hidden_size; }

  // Tensor parts (Note [tensor parallelism] in engine/tensor_parallel.cpp):
  // the Megatron split. q|k|v and gate|up by rows (whole heads, whole kv
  // heads; the MLP's inner size), o_proj and down_proj by columns; norms,
  // their biases, o and down's biases, the embedding and the head whole.
  TensorPart tensor_part(int rank, int size, std::string* why) const override {
    auto no = [&](const std::string& m) {
      if (why) *why = "model '" + name() + "' does not split into " + std::to_string(size) + " tensor parts: " + m;
      return TensorPart{};
    };
    if (size < 1 || rank < 0 || rank >= size) return no("no part " + std::to_string(rank));
    const int64_t H = c_.num_attention_heads, K = c_.kv_heads(), D = D_, I = c_.intermediate_size;
    const int64_t GU = (c_.mlp_gated ? 2 : 1) * I;
    if (c_.num_experts > 0) return no("the mixture-of-experts layers split by experts (expert parallelism), not built yet");
    if (c_.qk_norm && c_.qk_norm_full) return no("OLMo 2's q and k norms run over every head at once");
    if (H % size != 0) return no("num_attention_heads " + std::to_string(H) + " is not a multiple of it");
    if (K % size != 0) return no("num_key_value_heads " + std::to_string(K) + " is not a multiple of it (each part keeps whole kv heads)");
    if (I % size != 0) return no("intermediate_size " + std::to_string(I) + " is not a multiple of it");
    const int64_t h = H / size, k = K / size, i = I / size;
    const TensorSplit qkv{TensorSplit::kRows,
                          {{rank * h * D, h * D}, {H * D + rank * k * D, k * D}, {(H + K) * D + rank * k * D, k * D}}};
    const TensorSplit gu = c_.mlp_gated ? TensorSplit{TensorSplit::kRows, {{rank * i, i}, {I + rank * i, i}}}
                                        : TensorSplit{TensorSplit::kRows, {{rank * i, i}}};
    using detail::part_span;
    // The vocabulary (the embedding's and the head's rows) splits into
    // parts of ceil(V / T) rows, the last padded.
    const int64_t V = c_.vocab_size, v = vocab_share(size);
    TensorPart out = detail::whole_tensor_part(  // the whole model's blocks, cut below
        blocks(), "heads " + part_span(rank * h, h, H) + ", kv heads " + part_span(rank * k, k, K) + ", MLP " +
                      part_span(rank * i, i, I) +
                      (v < V ? ", vocabulary " + part_span(rank * v, std::min(v, V - rank * v), V)
                             : std::string(", vocabulary whole")));
    if (v < V) {  // the last part's rows past V are padding (Note [vocabulary parts])
      const TensorSplit vocab{TensorSplit::kRows, {{rank * v, std::min(v, V - rank * v)}}};
      out.splits[0][0] = vocab;
      out.blocks[0].params[0].shape.dims[0] = v;
      if (!c_.tie_word_embeddings) {  // the head: in the final block, or its own (LoRA's modules_to_save)
        const size_t hb = static_cast<size_t>(head_block_);
        out.splits[hb][static_cast<size_t>(head_)] = vocab;
        out.blocks[hb].params[static_cast<size_t>(head_)].shape.dims[0] = v;
      }
    }
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      const LayerIdx& x = idx_[static_cast<size_t>(l)];
      std::vector<ParamSpec>& ps = out.blocks[static_cast<size_t>(l + 1)].params;
      std::vector<TensorSplit>& sp = out.splits[static_cast<size_t>(l + 1)];
      auto rows = [&](int at, const TensorSplit& split, int64_t n) {
        if (at < 0) return;
        sp[static_cast<size_t>(at)] = split;
        ps[static_cast<size_t>(at)].shape.dims[0] = n;
      };
      auto cols = [&](int at, int64_t first, int64_t n) {
        sp[static_cast<size_t>(at)] = TensorSplit{TensorSplit::kColumns, {{first, n}}};
        ps[static_cast<size_t>(at)].shape.dims[1] = n;
      };
      rows(x.qkv_w, qkv, (h + 2 * k) * D);
      rows(x.qkv_b, qkv, (h + 2 * k) * D);
      cols(x.o_w, rank * h * D, h * D);
      rows(x.gu_w, gu, GU / size);
      rows(x.gu_b, gu, GU / size);
      cols(x.down_w, rank * i, i);
      // Qwen3's per-head norms see only the part's heads.
      for (int at : {x.q_norm, x.k_norm})
        if (at >= 0) sp[static_cast<size_t>(at)].sum_grads = true;
      if (lora()) split_adapters(out, l, qkv, gu, rank, size);
    }
    return out;
  }
  // Layer l's adapters in part `rank` of `size` (Note [LoRA over tensor
  // parts] in models/detail/lora.h): a row-split weight's B by its rows
  // (the weight's split, `qkv` or `gu`, within the target's rows), its A
  // whole with summed gradients; a column-split weight's A by its columns,
  // its B whole with summed gradients.
  void split_adapters(TensorPart& out, int64_t l, const TensorSplit& qkv, const TensorSplit& gu, int rank,
                      int size) const {
    const LayerIdx& x = idx_[static_cast<size_t>(l)];
    const size_t blk = static_cast<size_t>(lora_block(l));
    std::vector<ParamSpec>& ps = out.blocks[blk].params;
    std::vector<TensorSplit>& sp = out.splits[blk];
    for (int t = 0; t < kLoraTargets; ++t) {
      if (x.lora_a[t] < 0) continue;
      const size_t a = static_cast<size_t>(x.lora_a[t]), b = static_cast<size_t>(x.lora_b[t]);
      const LoraSite whole = lora_site(t, 1);
      if (lora_columns_split(t)) {
        const int64_t in = whole.in / size;
        sp[a] = TensorSplit{TensorSplit::kColumns, {{rank * in, in}}};
        ps[a].shape.dims[1] = in;
        sp[b].sum_grads = true;
        continue;
      }
      // The weight's rows of this part that fall in the target's, from the target's first row.
      TensorSplit rows{TensorSplit::kRows, {}};
      int64_t n = 0;
      for (const auto& [first, count] : (t >= kLoraGate ? gu : qkv).ranges) {
        const int64_t lo = std::max(first, whole.col), hi = std::min(first + count, whole.col + whole.out);
        if (lo >= hi) continue;
        rows.ranges.emplace_back(lo - whole.col, hi - lo);
        n += hi - lo;
      }
      ZINC_CHECK(n * size == whole.out, "an adapter's rows split evenly over the tensor parts");
      sp[b] = rows;
      ps[b].shape.dims[0] = n;
      sp[a].sum_grads = true;
    }
  }
  void use_tensor_part(int rank, int size) override {
    if (size == 1) return;
    if (!whole_.empty()) throw Error("model '" + name() + "' already computes one tensor part");
    std::string why;
    TensorPart part = tensor_part(rank, size, &why);
    if (part.empty()) throw Error(why);
    whole_ = std::move(specs_);
    specs_ = std::move(part.blocks);
    H_ /= size;
    K_ /= size;
    I_ /= size;
    GU_ /= size;
    Vh_ = vocab_share(size);
    // A vocabulary too small to split (a part would hold padding only) is
    // whole on every part: each holds rows 0 .. V, not rank * V on.
    vlo_ = Vh_ < c_.vocab_size ? rank * Vh_ : 0;
    Vv_ = std::min(Vh_, c_.vocab_size - vlo_);
    tp_rank_ = rank;
    tp_size_ = size;  // the first forward makes its buffers at the part's sizes
    if (lora()) lora_groups_ = lora_groups(size);
  }

  // Expert ranks (Note [expert parallelism] in engine/expert_parallel.cpp):
  // rank r holds experts [r E/P, (r+1) E/P) of every sparse layer (rows of
  // the stacked gate_up_proj and down_proj); everything else is whole, its
  // gradient summed over the ranks (they train on batches of their own).
  TensorPart expert_part(int rank, int size, std::string* why) const override {
    auto no = [&](const std::string& m) {
      if (why)
        *why = "model '" + name() + "' does not share its experts over " + std::to_string(size) + " expert ranks: " + m;
      return TensorPart{};
    };
    if (size < 1 || rank < 0 || rank >= size) return no("no expert rank " + std::to_string(rank));
    const int64_t E = c_.num_experts, C = c_.hidden_size, Ie = c_.expert_size();
    if (E == 0) return no("it has no mixture-of-experts layers (num_experts 0)");
    if (E % size != 0) return no("num_experts " + std::to_string(E) + " is not a multiple of it");
    if (tp_size_ > 1) return no("it computes a tensor part");
    const int64_t El = E / size;
    int64_t sparse = 0;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) sparse += c_.sparse_layer(l) ? 1 : 0;
    TensorPart out = detail::whole_tensor_part(
        blocks(), "experts " + detail::part_span(rank * El, El, E) + " of each of " + std::to_string(sparse) +
                      (sparse == 1 ? " sparse layer" : " sparse layers"));
    for (std::vector<TensorSplit>& b : out.splits)
      for (TensorSplit& sp : b) sp.sum_grads = true;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      const LayerIdx& x = idx_[static_cast<size_t>(l)];
      if (x.experts_gu < 0) continue;
      std::vector<ParamSpec>& ps = out.blocks[static_cast<size_t>(l + 1)].params;
      std::vector<TensorSplit>& sp = out.splits[static_cast<size_t>(l + 1)];
      for (auto [at, rows] : {std::pair{x.experts_gu, 2 * Ie}, std::pair{x.experts_down, C}}) {
        sp[static_cast<size_t>(at)] = TensorSplit{TensorSplit::kRows, {{rank * El * rows, El * rows}}};
        ps[static_cast<size_t>(at)].shape.dims[0] = El * rows;
      }
    }
    return out;
  }
  void use_expert_part(int rank, int size) override {
    if (size == 1) return;
    if (!whole_.empty()) throw Error("model '" + name() + "' already computes a part");
    std::string why;
    TensorPart part = expert_part(rank, size, &why);
    if (part.empty()) throw Error(why);
    whole_ = std::move(specs_);
    specs_ = std::move(part.blocks);
    ep_rank_ = rank;
    ep_size_ = size;
  }

 private:
  StageRange stage_range(const PipelineStage& st) const { return StageRange::of(st, c_.num_hidden_layers); }
  // The hidden state entering decoder layer l (x_final_ past the last).
  float* hidden(int64_t l) { return l < c_.num_hidden_layers ? pass_.x_in[static_cast<size_t>(l)].as<float>() : x_final_.as<float>(); }
  int final_block() const { return static_cast<int>(c_.num_hidden_layers + 1); }
  // Vocabulary parts (Note [vocabulary parts] in engine/tensor_parallel.cpp):
  // the vocabulary rows each of `parts` parts holds (all where they do not divide).
  int64_t vocab_share(int parts) const { return detail::vocab_share(c_.vocab_size, parts); }
  bool vocab_split() const { return Vh_ < c_.vocab_size; }
  // cross_entropy over the parts' columns of the logits (kernels.h), into dlogits_.
  double vocab_cross_entropy(const int32_t* targets, int64_t N) {
    std::vector<double> maxes(static_cast<size_t>(N)), sums(static_cast<size_t>(2 * N));
    ops_->cross_entropy_part_max(logits_.as<float>(), N, Vv_, maxes.data());
    pass_ctx_->tensor_all_reduce_max_f64(maxes.data(), N);
    ops_->cross_entropy_part_sums(logits_.as<float>(), targets, N, Vv_, vlo_, maxes.data(), sums.data(),
                                  dlogits_.as<float>());
    pass_ctx_->tensor_all_reduce_f64(sums.data(), 2 * N);
    return ops_->cross_entropy_part_finish(targets, N, Vv_, vlo_, maxes.data(), sums.data(), dlogits_.as<float>(),
                                           1.0f);
  }
  // A partial sum summed over the tensor parts (none: nothing to do).
  void tensor_sum(float* x, int64_t n) {
    if (tp_size_ > 1) pass_ctx_->tensor_all_reduce(x, n);
  }
  float eps() const { return static_cast<float>(c_.rms_norm_eps); }
  LlamaLayerActs& acts(int64_t l) { return pass_.acts[c_.gradient_checkpointing ? 0 : static_cast<size_t>(l)]; }
  static CView bias(const HeldParams& p, int i) { return i < 0 ? CView{} : p[i]; }
  // Granite's scalings (LlamaConfig): 0 leaves attention's own 1/sqrt(D).
  // Gemma 2 and 3: query_pre_attn_scalar^-1/2, formed in double as
  // transformers does.
  float att_scale() const {
    if (c_.query_pre_attn_scalar > 0) return static_cast<float>(1.0 / std::sqrt(c_.query_pre_attn_scalar));
    return static_cast<float>(c_.attention_multiplier);
  }
  float att_softcap() const { return static_cast<float>(c_.attn_logit_softcapping); }
  // With sequence ranks: whole rows of this rank's heads (Note [sequence
  // parallelism] in engine/sequence_parallel.cpp).
  // kv_in_place: a.qkv holds the projection's q | k | v rows with K_ kv
  // heads (gqa_in_place).
  kernels::AttentionShape attention_shape(int64_t l, bool kv_in_place = false) const {
    const bool split = sequence_split();
    const int64_t S = split ? pass_ctx_->sequence_split().size : 1;
    kernels::AttentionShape s{pass_.B, split ? whole_T_ : pass_.T, H_ * D_ / S, H_ / S, split ? whole_pos_ : pass_.pos,
                              c_.window(l), att_scale()};
    s.softcap = att_softcap();
    if (kv_in_place) s.kv_heads = K_;
    return s;
  }
  // Whether attention reads the projection's kv heads in place (the GPU's
  // fused attention); sequence ranks move whole repeated rows between ranks.
  bool gqa_in_place(DType dt) const { return !sequence_split() && ops_->attention_reads_kv_heads(D_, dt); }
  bool sequence_split() const { return pass_ctx_ && pass_ctx_->sequence_split().split(); }
  // The columns of one sequence rank's heads in each of q, k, v.
  int64_t seq_heads_w() const { return H_ / pass_ctx_->sequence_split().size * D_; }
  // The embeddings' factor: Granite's embedding_multiplier, Gemma's
  // sqrt(hidden_size) (transformers rounds it to the model's dtype first).
  float embed_factor() const {
    const double e = c_.embedding_multiplier;
    if (!c_.scale_embeddings) return static_cast<float>(e);
    return static_cast<float>(e * static_cast<double>(static_cast<float>(std::sqrt(static_cast<double>(c_.hidden_size)))));
  }
  // The rope tables of layer l: Gemma 3's sliding-window layers have their own.
  // q and k are adjacent in the projection's row: one call rotates H + K
  // heads, by positions in tables of the whole rows.
  kernels::RopeShape rope_shape(int64_t B, int64_t T) const {
    kernels::RopeShape s{B, T, (H_ + 2 * K_) * D_, 0, H_ + K_, D_, pass_.pos, c_.rotary_dim()};
    s.table_rows = rope_T_;
    return s;
  }
  bool local_rope(int64_t l) const { return c_.rope_local_theta > 0 && c_.sliding_layer(l); }
  const float* rope_cos(int64_t l) const { return (local_rope(l) ? rope_local_cos_ : rope_cos_).as<float>(); }
  const float* rope_sin(int64_t l) const { return (local_rope(l) ? rope_local_sin_ : rope_sin_).as<float>(); }
  // Backward of a pre-norm (the norm before a branch, weight index w; -1:
  // none, OLMo 2): dx += d of the norm's input, from d of its output dnorm.
  // With layer_norm, a LayerNorm with the bias at index b.
  void pre_norm_backward(const HeldParams& p, const BlockGrads& g, int w, int b, float* dx, const float* dnorm,
                         const float* x, const Buf& mean, const Buf& rstd, int64_t N) {
    const int64_t C = c_.hidden_size;
    if (w < 0) {
      ops_->add(dx, dx, dnorm, N * C);
    } else if (c_.layer_norm) {
      ops_->layernorm_backward(dx, norm_grad(g, w), norm_grad(g, b), dnorm, x, p[w], mean.as<float>(),
                               rstd.as<float>(), N, C);
    } else {
      ops_->rmsnorm_backward(dx, norm_grad(g, w), dnorm, x, p[w], rstd.as<float>(), N, C, c_.norm_offset);
    }
  }
  // The MLP's activation of gate_up (N, GU_) into out (N, I), and its backward.
  void act_forward(float* out, const float* gate_up, int64_t N) {
    const int64_t I = I_;
    using Act = LlamaConfig::MlpAct;
    if (!c_.mlp_gated) {
      if (c_.mlp_act == Act::kGeluErf)
        ops_->gelu_erf_forward(out, gate_up, N * I);
      else
        ops_->gelu_forward(out, gate_up, N * I);
    } else if (c_.mlp_act == Act::kGeluTanh) {
      ops_->geglu_forward(out, gate_up, N, I);
    } else {
      ops_->swiglu_forward(out, gate_up, N, I);
    }
  }
  void act_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N) {
    const int64_t I = I_;
    using Act = LlamaConfig::MlpAct;
    if (!c_.mlp_gated) {
      if (c_.mlp_act == Act::kGeluErf)
        ops_->gelu_erf_backward(dgate_up, gate_up, dout, N * I);
      else
        ops_->gelu_backward(dgate_up, gate_up, dout, N * I);
    } else if (c_.mlp_act == Act::kGeluTanh) {
      ops_->geglu_backward(dgate_up, dout, gate_up, N, I);
    } else {
      ops_->swiglu_backward(dgate_up, dout, gate_up, N, I);
    }
  }
  // Backward of a post-norm (weight index w on a branch's output `out`; -1:
  // none): the gradient of `out` from that of the normed branch, in dsmall_
  // (or dbranch itself without the norm).
  const float* post_norm_backward(const HeldParams& p, const BlockGrads& g, int w, const float* dbranch,
                                  const Buf& out, const Buf& rstd, int64_t N) {
    if (w < 0) return dbranch;
    const int64_t C = c_.hidden_size;
    float* d = dsmall_.as<float>();
    ops_->zero(d, N * C);
    ops_->rmsnorm_backward(d, norm_grad(g, w), dbranch, out.as<float>(), p[w], rstd.as<float>(), N, C,
                           c_.norm_offset);
    return d;
  }
  float residual_factor() const { return static_cast<float>(c_.residual_multiplier); }
  float logits_factor() const { return static_cast<float>(1.0 / c_.logits_scaling); }
  // The gradient of a residual branch's output: dx itself, or with
  // residual_multiplier a scaled copy (dx stays the residual stream's).
  const float* branch_grad(const float* dx, int64_t N) {
    if (c_.residual_multiplier == 1.0) return dx;
    const int64_t C = c_.hidden_size;
    float* d = branch_.as<float>();
    ops_->copy_columns(d, C, dx, C, N, C);
    ops_->scale(d, residual_factor(), N * C);
    return d;
  }
  // The gradient of a base weight (or bias) at index i: null where absent
  // or frozen (LoRA: linear_backward then skips its weight-gradient matmul).
  float* bias_grad(const BlockGrads& g, int i) const { return i < 0 || lora() ? nullptr : g[i]; }
  float* weight_grad(const BlockGrads& g, int i) const { return bias_grad(g, i); }
  // A norm's weight gradient: the norm kernels always sum one, so a frozen
  // norm's goes to a sink nobody reads.
  // (A LayerNorm's weight and bias sit at adjacent indices: each its half.)
  float* norm_grad(const BlockGrads& g, int i) {
    if (i < 0) return nullptr;
    return lora() ? sink_.as<float>() + (i & 1) * sink_half_ : g[i];
  }
  // Note [no input gradient under a frozen embedding]
  // The first layer's input gradient feeds the embedding's gradient alone
  // (or the previous pipeline stage's). Where the embedding is frozen (LoRA
  // without embed_tokens in modules_to_save) nothing reads it, so the first
  // layer's backward stops at its q|k|v adapters' gradients: no input
  // gradient product of q|k|v (base or adapters), no ln1 backward (whose
  // weight is frozen too). As autograd does for an input that needs no
  // gradient; the norms' frozen weight gradients go to the sink anyway.
  bool needs_input_grad(const StageRange& sr) const { return !sr.embed || !specs_[0].frozen; }
  // A base block's gradients (none where frozen) and their report.
  BlockGrads base_grads(StepContext& ctx, int blk) {
    return specs_[static_cast<size_t>(blk)].frozen ? BlockGrads{} : ctx.grads(blk);
  }
  void base_grads_ready(StepContext& ctx, int blk) {
    if (!specs_[static_cast<size_t>(blk)].frozen) ctx.grads_ready(blk);
  }

  // ---- LoRA (LoraConfig) ------------------------------------------------------
  bool lora() const { return c_.lora.enabled(); }
  detail::LoraDropout lora_drop(int64_t l, int64_t g) const {
    kernels::DropoutColumns cols;  // a column-split weight's input: the part's columns of the whole's mask
    if (tp_size_ > 1 && (g == kGroupO || g == kGroupDown)) {
      const int64_t in = lora_groups_[static_cast<size_t>(l)][static_cast<size_t>(g)].in;
      cols = {in, in * tp_size_, in * tp_rank_};
    }
    return detail::LoraDropout::of(c_.lora.dropout, pass_.lora_seed, l, g, cols);
  }
  int lora_block(int64_t l) const { return lora_first_ + static_cast<int>(l); }
  // Where target t sits: its input and output widths, and its output's
  // first column in the projection it adapts, whose rows are `width` wide
  // (q, k and v in the fused q|k|v, gate and up in gate|up).
  struct LoraSite {
    int64_t in = 0, out = 0, col = 0, width = 0;
  };
  // Target t's module as PEFT names it in this family ("" where the family
  // has none: GPT-NeoX names its four modules its own way).
  std::string lora_module(int t) const {
    if (llama::neox_names(c_)) {
      static constexpr const char* kNeox[kLoraTargets] = {"", "", "", "query_key_value", "dense", "", "dense_h_to_4h",
                                                          "", "dense_4h_to_h"};
      return kNeox[t];
    }
    const std::string m = kLoraModules[t];
    return m.substr(m.find('.') + 1);
  }
  // On one of `parts` tensor parts (Note [LoRA over tensor parts]): a
  // row-split weight's rows, or a column-split one's input, over `parts`.
  LoraSite lora_site(int t, int parts) const {
    // The weight's sizes by zinc's own name (valid for every family); no
    // rows where the family has no such module.
    const std::string m = kLoraModules[t];
    const llama::LoraSite s = llama::lora_site(c_, m.substr(m.find('.') + 1));
    const LoraSite whole{s.in, lora_module(t).empty() ? 0 : s.rows, s.row, s.weight_rows};
    if (lora_columns_split(t)) return {whole.in / parts, whole.out, whole.col, whole.width};
    return {whole.in, whole.out / parts, whole.col / parts, whole.width / parts};
  }
  LoraSite lora_site(int t) const { return lora_site(t, tp_size_); }
  // Whether target t's weight splits by columns over tensor parts (o_proj,
  // down_proj), not by rows.
  static bool lora_columns_split(int t) { return t == kLoraO || t == kLoraDown; }
  // One adapter block per layer, after the final block, with PEFT's tensor
  // names and initialisation: A Kaiming-uniform (a = sqrt(5): U(+-1/sqrt(in))),
  // B zeros.
  void add_lora_blocks() {
    const int64_t r = c_.lora.r;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
      BlockSpec b{"layers." + std::to_string(l) + ".lora", {}};
      LayerIdx& x = idx_[static_cast<size_t>(l)];
      for (int t = 0; t < kLoraTargets; ++t) {
        const std::string module = lora_module(t);
        if (module.empty() || !c_.lora.targets_module(module)) continue;
        const LoraSite site = lora_site(t);
        if (site.out == 0) continue;  // no such module (gate_proj of an ungated MLP)
        const std::string m = llama::lora_site(c_, module).path;  // PEFT's path ("self_attn.q_proj")
        x.lora_a[t] = static_cast<int>(b.params.size());
        b.params.push_back({m + ".lora_A.weight", {r, site.in}, Init::kUniform,
                            static_cast<float>(1.0 / std::sqrt(static_cast<double>(site.in)))});
        x.lora_b[t] = static_cast<int>(b.params.size());
        b.params.push_back({m + ".lora_B.weight", {site.out, r}, Init::kZeros});
      }
      specs_.push_back(std::move(b));
    }
    lora_groups_ = lora_groups(1);
  }
  // Every layer's groups on one of `parts` tensor parts.
  std::vector<std::array<detail::LoraGroup, 4>> lora_groups(int parts) const {
    std::vector<std::array<detail::LoraGroup, 4>> out(static_cast<size_t>(c_.num_hidden_layers));
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      for (int g = 0; g < kLoraGroupCount; ++g) out[static_cast<size_t>(l)][static_cast<size_t>(g)] = lora_group(l, g, parts);
    return out;
  }
  // LoRA's groups (Note [LoRA by groups] in models/detail/lora.h): q|k|v,
  // o, gate|up, down, each with its first target's index (U's columns in
  // LlamaLayerActs::lora_u start there).
  enum { kGroupQkv, kGroupO, kGroupGateUp, kGroupDown, kLoraGroupCount };
  static constexpr int kGroupFirst[kLoraGroupCount] = {kLoraQ, kLoraO, kLoraGate, kLoraDown};
  static constexpr int kGroupCount[kLoraGroupCount] = {4, 1, 3, 1};
  // Layer l's group g: its adapted targets with their rows.
  detail::LoraGroup lora_group(int64_t l, int g, int parts) const {
    const LayerIdx& ix = idx_[static_cast<size_t>(l)];
    detail::LoraGroup out;
    for (int t = kGroupFirst[g]; t < kGroupFirst[g] + kGroupCount[g]; ++t) {
      const LoraSite site = lora_site(t, parts);
      out.in = site.in;
      out.width = site.width;
      if (ix.lora_a[t] >= 0) out.members.push_back({ix.lora_a[t], ix.lora_b[t], site.col, site.out});
    }
    return out;
  }
  // Where layer l's weight of group g (qkv, o, gate|up, down) stays packed
  // for its forward (grad false) or its input gradient (grad true): the
  // frozen base under LoRA, held in place by the engine (Note [packed
  // frozen weights] in kernels/matmul.cpp). Empty otherwise.
  detail::PackedSlot packed(const HeldParams& p, int64_t l, int g, bool grad) {
    return packed_.at(p.params().generation, c_.lora.pack_base, c_.num_hidden_layers, kLoraGroupCount, l, g, grad);
  }
  bool lora_forward(const HeldParams* lp, LlamaLayerActs& a, int64_t l, int g, CView x, float* dst, int64_t N,
                    DType dt) {
    if (!lp) return false;
    float* u = a.lora_u.as<float>() + kGroupFirst[g] * N * c_.lora.r;
    return detail::lora_forward(*ops_, lora_scratch_, *lp, lora_groups_[static_cast<size_t>(l)][g], c_.lora.r,
                                c_.lora.scale(), x, dst, N, dt, u, a.lora_saved[g], lora_drop(l, g));
  }
  bool lora_backward(const HeldParams* lp, const BlockGrads& lg, LlamaLayerActs& a, int64_t l, int g, CView x,
                     CView dy_in, float* dx, int64_t N, DType dt) {
    if (!lp) return false;
    return detail::lora_backward(*ops_, lora_scratch_, *lp, lg, lora_groups_[static_cast<size_t>(l)][g], c_.lora.r,
                                 c_.lora.scale(), x, a.lora_saved[g], dy_in, dx, N, dt, lora_drop(l, g));
  }

  // One layer's forward from x_in into `a` and, unless x_out is null, its
  // output. Deterministic (the checkpointed backward relies on it).
  void layer_forward(const HeldParams& p, LlamaLayerActs& a, int64_t l, const float* x_in, float* x_out, int64_t B,
                     int64_t T, DType dt, const HeldParams* lp = nullptr) {
    const int64_t C = c_.hidden_size, N = B * T, I = I_, A = H_ * D_, Q = (H_ + 2 * K_) * D_;
    const LayerIdx& x = idx_[static_cast<size_t>(l)];
    // RMSNorm writes the projections' 16-bit operand itself where the Ops
    // fuses it (Ops::rmsnorm_forward_input; a.ln1 is then left unwritten).
    if (fused_norm(x.ln1)) {
      a.ln1_in = ops_->rmsnorm_forward_input(a.ln1.as<float>(), a.rstd1.as<float>(), const_cast<float*>(x_in), nullptr,
                                             p[x.ln1], N, C, eps(), c_.norm_offset, dt, a.ln1_16);
    } else {
      pre_norm_forward(p, x.ln1, x.ln1_b, a.ln1, a.mean1, a.rstd1, x_in, N);
      a.ln1_in = ops_->matmul_input(a.ln1.as<float>(), N * C, dt, a.ln1_16);
    }
    // Grouped-query heads read in place: the projection is attention's
    // input, kept in a.qkv for backward (no repeated copy, Note [fused
    // attention] in csrc/kernels/flash_attention.cu).
    const bool in_place = gqa_in_place(dt);
    float* proj = in_place ? a.qkv.as<float>() : proj_.as<float>();
    detail::linear_forward(*ops_, proj, a.ln1_in, p[x.qkv_w], bias(p, x.qkv_b), N, C, Q, dt,
                           packed(p, l, kGroupQkv, false));
    lora_forward(lp, a, l, kGroupQkv, a.ln1_in, proj, N, dt);  // Note [LoRA after the base]
    if (c_.qk_norm) qk_norm_forward(p, a, proj, N);
    // q and k are adjacent in the row: one call rotates H + K heads.
    if (c_.uses_rope(l))
      ops_->rope(proj, rope_cos(l), rope_sin(l), rope_shape(B, T), false);
    if (!in_place) ops_->gqa_expand(a.qkv.as<float>(), proj, N, H_, K_, D_);
    if (sequence_split()) {
      // Ulysses: whole rows of this rank's heads in, and the output back
      // to this rank's tokens (a.qkv keeps the whole rows for backward).
      seq_.to_heads(*ops_, *pass_ctx_, a.qkv.as<float>(), a.qkv.as<float>(), B, 3, seq_heads_w());
      ops_->attention_forward(a.ws, a.att.as<float>(), a.qkv.as<float>(), attention_shape(l), dt);
      seq_.to_tokens(*ops_, *pass_ctx_, a.att.as<float>(), a.att.as<float>(), B, 1, seq_heads_w());
      a.att_in = ops_->matmul_input(a.att.as<float>(), N * A, dt, a.att_16);
    } else {
      a.att_in = ops_->attention_forward_input(a.ws, a.att.as<float>(), a.qkv.as<float>(),
                                               attention_shape(l, in_place), dt, a.att_16);
    }
    float* x_mid = a.x_mid.as<float>();
    branch_forward(p, x.o_w, x.o_b, x.post_att, a.att_in, A, a.o_out, a.rstd_po, x_mid, N, dt,
                   [&](float* y) { return lora_forward(lp, a, l, kGroupO, a.att_in, y, N, dt); },
                   packed(p, l, kGroupO, false));
    // GPT-NeoX's parallel residual: the MLP reads the norm of x_in itself;
    // otherwise the residual and the norm after it in one pass on the GPU.
    // A sparse layer's experts gather rows of a.ln2 itself (moe_forward).
    const bool fuse_ln2 = x.router < 0 && fused_norm(x.ln2);
    if (c_.parallel_residual || x.ln2 < 0) {
      ops_->add(x_mid, x_mid, x_in, N * C);
      if (fuse_ln2)
        a.ln2_in = ops_->rmsnorm_forward_input(a.ln2.as<float>(), a.rstd2.as<float>(),
                                               const_cast<float*>(c_.parallel_residual ? x_in : x_mid), nullptr,
                                               p[x.ln2], N, C, eps(), c_.norm_offset, dt, a.ln2_16);
      else
        pre_norm_forward(p, x.ln2, x.ln2_b, a.ln2, a.mean2, a.rstd2, c_.parallel_residual ? x_in : x_mid, N);
    } else if (fuse_ln2) {
      a.ln2_in = ops_->rmsnorm_forward_input(a.ln2.as<float>(), a.rstd2.as<float>(), x_mid, x_in, p[x.ln2], N, C,
                                             eps(), c_.norm_offset, dt, a.ln2_16);
    } else {
      add_pre_norm_forward(p, x.ln2, x.ln2_b, a.ln2, a.mean2, a.rstd2, x_mid, x_in, N);
    }
    if (!fuse_ln2) a.ln2_in = ops_->matmul_input(a.ln2.as<float>(), N * C, dt, a.ln2_16);
    if (x.router >= 0) {
      // A sparse layer: the experts' combined output is the branch's (into
      // scratch when recomputing for backward).
      float* out = x_out ? x_out : dsmall_.as<float>();
      moe_forward(p, x, a, out, N, dt, x_out != nullptr);
      if (c_.residual_multiplier != 1.0) ops_->scale(out, residual_factor(), N * C);
      if (x_out) ops_->add(x_out, x_out, x_mid, N * C);
      return;
    }
    detail::linear_forward(*ops_, a.gate_up.as<float>(), a.ln2_in, p[x.gu_w], bias(p, x.gu_b), N, C, GU_, dt,
                           packed(p, l, kGroupGateUp, false));
    lora_forward(lp, a, l, kGroupGateUp, a.ln2_in, a.gate_up.as<float>(), N, dt);
    if (c_.mlp_gated) {  // SwiGLU or GeGLU writes the down projection's operand (Ops::gated_forward_input)
      a.act_in = ops_->gated_forward_input(a.act.as<float>(), a.gate_up.as<float>(), N, I,
                                           c_.mlp_act == LlamaConfig::MlpAct::kGeluTanh, dt, a.act_16);
    } else {
      act_forward(a.act.as<float>(), a.gate_up.as<float>(), N);
      a.act_in = ops_->matmul_input(a.act.as<float>(), N * I, dt, a.act_16);
    }
    auto down_lora = [&](float* y) { return lora_forward(lp, a, l, kGroupDown, a.act_in, y, N, dt); };
    if (!x_out) {
      // A recomputation for backward: the output is not needed, but a
      // post-norm's input and statistics are (its output goes to scratch),
      // and so is the down projection's LoRA U, which B's gradient reads
      // (its product goes to scratch too).
      if (x.post_mlp >= 0)
        branch_forward(p, x.down_w, x.down_b, x.post_mlp, a.act_in, I, a.mlp_out, a.rstd_pm, dsmall_.as<float>(), N,
                       dt, down_lora, packed(p, l, kGroupDown, false));
      else
        down_lora(dsmall_.as<float>());
      return;
    }
    branch_forward(p, x.down_w, x.down_b, x.post_mlp, a.act_in, I, a.mlp_out, a.rstd_pm, x_out, N, dt, down_lora,
                   packed(p, l, kGroupDown, false));
    ops_->add(x_out, x_out, x_mid, N * C);
  }

  // A view `elems` elements into v (a row range of a matmul operand or of
  // an expert's slice of the stacked weights).
  static CView at(CView v, int64_t elems) {
    return CView{static_cast<const char*>(v.data) + elems * static_cast<int64_t>(dtype_bytes(v.dtype)), v.dtype,
                 v.bf16_exact};
  }

  // The experts' SwiGLU over R grouped rows xin (R,C), the rows of
  // (local) expert e from offsets[e], into y (R,C); m.gu and m.act hold R
  // rows. Expert e's weights are the e-th of this rank's.
  void experts_forward(const HeldParams& p, const LayerIdx& x, MoeActs& m, float* xin, int64_t R,
                       const std::vector<int64_t>& offsets, float* y, DType dt) {
    const int64_t C = c_.hidden_size, Ie = c_.expert_size(), E = static_cast<int64_t>(offsets.size()) - 1;
    m.xg_in = ops_->matmul_input(xin, R * C, dt, m.xg_16);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[static_cast<size_t>(e)], rows = offsets[static_cast<size_t>(e + 1)] - r0;
      if (rows == 0) continue;
      detail::linear_forward(*ops_, m.gu.as<float>() + r0 * 2 * Ie, at(m.xg_in, r0 * C),
                             at(p[x.experts_gu], e * 2 * Ie * C), CView{}, rows, C, 2 * Ie, dt);
    }
    // The experts' down projections' operand, written by SwiGLU where the Ops fuses it.
    m.act_in = ops_->gated_forward_input(m.act.as<float>(), m.gu.as<float>(), R, Ie, false, dt, m.act_16);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[static_cast<size_t>(e)], rows = offsets[static_cast<size_t>(e + 1)] - r0;
      if (rows == 0) continue;
      detail::linear_forward(*ops_, y + r0 * C, at(m.act_in, r0 * Ie), at(p[x.experts_down], e * C * Ie), CView{},
                             rows, Ie, C, dt);
    }
  }
  // Its backward from dy (R,C), overwritten with the rows' input gradient;
  // the experts' weight gradients (none where frozen: LoRA) accumulate.
  void experts_backward(const HeldParams& p, const BlockGrads& g, const LayerIdx& x, MoeActs& m, float* dy, int64_t R,
                        const std::vector<int64_t>& offsets, DType dt) {
    const int64_t C = c_.hidden_size, Ie = c_.expert_size(), E = static_cast<int64_t>(offsets.size()) - 1;
    float* dgu = moe_dgu_.as<float>();    // (R,2Ie)
    float* dact = moe_dact_.as<float>();  // (R,Ie)
    float* g_down = weight_grad(g, x.experts_down);
    float* g_gu = weight_grad(g, x.experts_gu);
    // Written by the first backward of a window (Note [gradients written,
    // not zeroed] in engine/model.h): an expert without rows writes zeros.
    const bool new_down = g_down && g.overwrite(x.experts_down), new_gu = g_gu && g.overwrite(x.experts_gu);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[static_cast<size_t>(e)], rows = offsets[static_cast<size_t>(e + 1)] - r0;
      if (rows == 0) {
        if (new_down) ops_->zero(g_down + e * C * Ie, C * Ie);
        if (new_gu) ops_->zero(g_gu + e * 2 * Ie * C, 2 * Ie * C);
        continue;
      }
      detail::linear_backward(*ops_, dy16_, dact + r0 * Ie, g_down ? g_down + e * C * Ie : nullptr, nullptr,
                              f32(dy + r0 * C), at(m.act_in, r0 * Ie), at(p[x.experts_down], e * C * Ie), rows, Ie,
                              C, dt, {}, new_down);
    }
    ops_->swiglu_backward(dgu, dact, m.gu.as<float>(), R, Ie);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[static_cast<size_t>(e)], rows = offsets[static_cast<size_t>(e + 1)] - r0;
      if (rows == 0) continue;
      detail::linear_backward(*ops_, dy16_, dy + r0 * C, g_gu ? g_gu + e * 2 * Ie * C : nullptr, nullptr,
                              f32(dgu + r0 * 2 * Ie), at(m.xg_in, r0 * C), at(p[x.experts_gu], e * 2 * Ie * C), rows,
                              C, 2 * Ie, dt, {}, new_gu);
    }
  }

  // Note [expert row blocks]
  // ~~~~~~~~~~~~~~~~~~~~~~~~
  // oneDNN makes a primitive per exact GEMM shape (Note [matmul primitive
  // cache] in kernels/matmul.cpp: ~0.5 ms of JIT each, kept for the
  // process), and an expert's row count changes with every routing: with
  // one GEMM shape per row count, a Mixtral step made hundreds of new
  // primitives a step for its first many steps (0.25 s of a 0.86 s step at
  // the bench's sizes), and the cache grew towards N shapes per GEMM. So
  // each expert's rows are padded to a multiple of kExpertRows: at most
  // N / kExpertRows + 1 shapes per GEMM, for (kExpertRows - 1) / 2 rows
  // more per expert on average. The padding rows read token 0 (finite
  // values; their outputs are never combined) and their output gradient is
  // zeroed, so they add exactly nothing to the experts' weight gradients
  // and the real rows' values are the unpadded GEMMs' (the same dot
  // products; oneDNN may block the sums differently for another M).
  static constexpr int64_t kExpertRows = 16;
  // The most grouped rows a micro-batch of N tokens can have, padded.
  int64_t padded_rows(int64_t N) const {
    return N * c_.num_experts_per_tok + c_.num_experts * (kExpertRows - 1);
  }
  // Moves the grouping of moe_group (m.offsets, token_of_row, row_of_slot)
  // to padded blocks; m.real_rows keeps each expert's real count. Returns
  // the padded row count.
  int64_t pad_groups(MoeActs& m, std::vector<int32_t>& token_of_row, std::vector<int32_t>& row_of_slot) const {
    const size_t E = static_cast<size_t>(c_.num_experts);
    std::vector<int64_t> padded(E + 1, 0);
    m.real_rows.resize(E);
    for (size_t e = 0; e < E; ++e) {
      const int64_t rows = m.offsets[e + 1] - m.offsets[e];
      m.real_rows[e] = rows;
      padded[e + 1] = padded[e] + (rows + kExpertRows - 1) / kExpertRows * kExpertRows;
    }
    std::vector<int32_t> rows_to(token_of_row.size()), tor(static_cast<size_t>(padded[E]), 0);
    for (size_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < m.real_rows[e]; ++i) {
        const size_t from = static_cast<size_t>(m.offsets[e] + i), to = static_cast<size_t>(padded[e] + i);
        tor[to] = token_of_row[from];
        rows_to[from] = static_cast<int32_t>(to);
      }
    for (int32_t& r : row_of_slot) r = rows_to[static_cast<size_t>(r)];
    token_of_row = std::move(tor);
    m.offsets = std::move(padded);
    return m.offsets[E];
  }

  // Expert ranks (Note [expert parallelism] in engine/expert_parallel.cpp).
  bool expert_split() const { return ep_size_ > 1; }
  int64_t local_experts() const { return c_.num_experts / ep_size_; }
  void grow(Buf& b, int64_t floats) {
    if (b.bytes() < static_cast<size_t>(floats) * sizeof(float)) b = ops_->alloc_f32(static_cast<size_t>(floats));
  }
  // Sends m.xg's rows (grouped by expert at m.offsets) to their experts'
  // ranks; this rank's experts' rows arrive into m.xe, by local expert.
  void expert_dispatch(MoeActs& m, DType dt) {
    const int P = ep_size_;
    const int64_t El = local_experts(), C = c_.hidden_size;
    const size_t n = static_cast<size_t>(P * El);
    std::vector<int32_t> sent(n), got(n);  // rows per (rank, local expert)
    for (size_t i = 0; i < n; ++i) sent[i] = static_cast<int32_t>(m.offsets[i + 1] - m.offsets[i]);
    pass_ctx_->expert_counts(sent.data(), got.data(), El);
    m.send_rows.assign(static_cast<size_t>(P), 0);
    m.recv_rows.assign(static_cast<size_t>(P), 0);
    for (int r = 0; r < P; ++r)
      for (int64_t e = 0; e < El; ++e) {
        m.send_rows[static_cast<size_t>(r)] += sent[static_cast<size_t>(r * El + e)];
        m.recv_rows[static_cast<size_t>(r)] += got[static_cast<size_t>(r * El + e)];
      }
    // Where each (source, expert) block starts as the rows arrive (by source).
    std::vector<int64_t> start(n);
    int64_t R = 0;
    for (int r = 0; r < P; ++r)
      for (int64_t e = 0; e < El; ++e) {
        start[static_cast<size_t>(r * El + e)] = R;
        R += got[static_cast<size_t>(r * El + e)];
      }
    // By local expert, each expert's rows padded to a block (Note [expert
    // row blocks]): padding rows read the first row that arrived (their
    // outputs go nowhere, their output gradient is zeroed).
    m.R_in = R;
    m.local_offsets.assign(static_cast<size_t>(El + 1), 0);
    m.real_rows.assign(static_cast<size_t>(El), 0);
    for (int64_t e = 0; e < El; ++e) {
      for (int r = 0; r < P; ++r) m.real_rows[static_cast<size_t>(e)] += got[static_cast<size_t>(r * El + e)];
      m.local_offsets[static_cast<size_t>(e + 1)] =
          m.local_offsets[static_cast<size_t>(e)] +
          (m.real_rows[static_cast<size_t>(e)] + kExpertRows - 1) / kExpertRows * kExpertRows;
    }
    m.R = m.local_offsets[static_cast<size_t>(El)];
    std::vector<int32_t> perm(static_cast<size_t>(m.R), 0), unperm(static_cast<size_t>(R));
    for (int64_t e = 0; e < El; ++e) {
      int64_t i = m.local_offsets[static_cast<size_t>(e)];
      for (int r = 0; r < P; ++r)
        for (int64_t j = 0; j < got[static_cast<size_t>(r * El + e)]; ++j, ++i) {
          perm[static_cast<size_t>(i)] = static_cast<int32_t>(start[static_cast<size_t>(r * El + e)] + j);
          unperm[static_cast<size_t>(perm[static_cast<size_t>(i)])] = static_cast<int32_t>(i);
        }
    }
    ops_->copy_in_i32(m.perm, perm.data(), m.R);
    ops_->copy_in_i32(m.unperm, unperm.data(), R);
    grow(ep_recv_, std::max<int64_t>(R, 1) * C);
    grow(m.xe, m.R * C);
    exchange_rows(m.xg.as<float>(), m.send_rows.data(), ep_recv_.as<float>(), m.recv_rows.data(), dt, true);
    ops_->moe_gather(m.xe.as<float>(), ep_recv_.as<float>(), m.perm.as<int32_t>(), m.R, C);
  }
  // Sends rows of C fp32 values (send_rows[r] to rank r, recv_rows[r] from
  // it). `operand`: the receiver reads them only as bf16 matmul operands
  // (the experts' inputs, their outputs' gradients), so with bf16 compute
  // they travel as bf16, half the bytes, the same values: rounding them
  // before the wire or at the matmul gives the same bits. The rest (the
  // experts' fp32 outputs and input gradients) travel as they are.
  void exchange_rows(const float* send, const int64_t* send_rows, float* recv, const int64_t* recv_rows, DType dt,
                     bool operand) {
    const int64_t C = c_.hidden_size;
    if (!operand || dt != DType::kBF16 || C % 2 != 0) {
      pass_ctx_->expert_exchange(send, send_rows, recv, recv_rows, C);
      return;
    }
    int64_t out = 0, in = 0;
    for (int r = 0; r < ep_size_; ++r) {
      out += send_rows[r];
      in += recv_rows[r];
    }
    wire_out_.resize(static_cast<size_t>(out * C / 2));
    wire_in_.resize(static_cast<size_t>(in * C / 2));
    convert_f32_to_bf16(send, reinterpret_cast<bf16*>(wire_out_.data()), static_cast<size_t>(out * C));
    pass_ctx_->expert_exchange(reinterpret_cast<const float*>(wire_out_.data()), send_rows,
                               reinterpret_cast<float*>(wire_in_.data()), recv_rows, C / 2);
    convert_bf16_to_f32(reinterpret_cast<const bf16*>(wire_in_.data()), recv, static_cast<size_t>(in * C));
  }
  // Zeroes the padding rows of x (rows at m.local_offsets, of width C).
  void zero_padding(const MoeActs& m, float* x) {
    const int64_t C = c_.hidden_size;
    for (size_t e = 0; e + 1 < m.local_offsets.size(); ++e) {
      const int64_t real = m.local_offsets[e] + m.real_rows[e], pad = m.local_offsets[e + 1] - real;
      if (pad > 0) ops_->zero(x + real * C, pad * C);
    }
  }
  // Sends the experts' outputs ye (R,C, by local expert) back to their
  // tokens' ranks: y (M,C) gets them in the order m.xg sent its rows.
  void expert_return(MoeActs& m, const float* ye, float* y) {
    const int64_t C = c_.hidden_size;
    ops_->moe_gather(ep_recv_.as<float>(), ye, m.unperm.as<int32_t>(), m.R_in, C);
    exchange_rows(ep_recv_.as<float>(), m.recv_rows.data(), y, m.send_rows.data(), DType::kF32, false);
  }

  // A sparse layer's MLP (Note [expert routing order] in kernels/moe.cpp):
  // router logits from ln2, the top k experts of each token, the (token,
  // slot) pairs grouped by expert on the host, each expert's SwiGLU on its
  // own rows (one GEMM per expert per micro-batch, not per token), and the
  // weighted combine into out.
  void moe_forward(const HeldParams& p, const LayerIdx& x, LlamaLayerActs& a, float* out, int64_t N, DType dt,
                   bool count) {
    const int64_t C = c_.hidden_size, E = c_.num_experts, k = c_.num_experts_per_tok, Ie = c_.expert_size();
    const int64_t M = N * k;
    MoeActs& m = a.moe;
    float* logits = moe_logits_.as<float>();
    detail::linear_forward(*ops_, logits, a.ln2_in, p[x.router], CView{}, N, C, E, dt);
    ops_->moe_route(logits, N, E, k, c_.norm_topk_prob, m.probs.as<float>(), m.expert.as<int32_t>(),
                    m.weight.as<float>());
    m.expert_host.resize(static_cast<size_t>(M));
    ops_->copy_out_i32(m.expert_host.data(), m.expert.as<int32_t>(), M);
    m.offsets.assign(static_cast<size_t>(E + 1), 0);
    std::vector<int32_t> token_of_row(static_cast<size_t>(M)), row_of_slot(static_cast<size_t>(M));
    kernels::moe_group(m.expert_host.data(), N, k, E, m.offsets.data(), token_of_row.data(), row_of_slot.data());
    // The grouped rows: each expert's padded to a block (with expert ranks
    // the rows travel as they are, and the experts' rank pads them).
    const int64_t Mg = expert_split() ? M : pad_groups(m, token_of_row, row_of_slot);
    ops_->copy_in_i32(m.token_of_row, token_of_row.data(), Mg);
    ops_->copy_in_i32(m.row_of_slot, row_of_slot.data(), M);
    ops_->moe_gather(m.xg.as<float>(), a.ln2.as<float>(), m.token_of_row.as<int32_t>(), Mg, C);
    if (expert_split()) {
      // To the experts' ranks, through this rank's experts, and back.
      expert_dispatch(m, dt);
      grow(m.gu, m.R * 2 * Ie);
      grow(m.act, m.R * Ie);
      grow(ep_ye_, m.R * C);
      experts_forward(p, x, m, m.xe.as<float>(), m.R, m.local_offsets, ep_ye_.as<float>(), dt);
      expert_return(m, ep_ye_.as<float>(), m.y.as<float>());
    } else {
      experts_forward(p, x, m, m.xg.as<float>(), Mg, m.offsets, m.y.as<float>(), dt);
    }
    ops_->moe_combine(out, m.y.as<float>(), m.weight.as<float>(), m.row_of_slot.as<int32_t>(), N, k, C);
    if (count && c_.router_aux_loss_coef > 0) {
      // The aux loss's sums (in a forward, not in a recomputation): picks per
      // expert, and each expert's probabilities over the tokens in token order.
      for (int32_t e : m.expert_host) aux_count_[static_cast<size_t>(e)] += 1.0;
      std::vector<float> probs(static_cast<size_t>(N * E));
      ops_->copy_out(probs.data(), m.probs.as<float>(), N * E);
      for (int64_t t = 0; t < N; ++t)
        for (int64_t e = 0; e < E; ++e) aux_prob_[static_cast<size_t>(e)] += probs[static_cast<size_t>(t * E + e)];
      ++aux_layers_;
    }
  }

  // Its backward from dy (N,C), the gradient of the combined output, to
  // dln2 (N,C, written): the experts' GEMMs on their rows, the gather's
  // and the router's paths summed, the aux loss's gradient (aux_dprobs_)
  // on the router probabilities.
  void moe_backward(const HeldParams& p, const BlockGrads& g, const LayerIdx& x, LlamaLayerActs& a, const float* dy,
                    float* dln2, int64_t N, DType dt, float loss_scale) {
    const int64_t C = c_.hidden_size, E = c_.num_experts, k = c_.num_experts_per_tok, Ie = c_.expert_size();
    MoeActs& m = a.moe;
    float* dyg = moe_dy_.as<float>();         // (M,C) d of each grouped row's expert output, then d xg
    float* dweight = moe_dweight_.as<float>();  // (N,k)
    ops_->moe_combine_backward(dyg, dweight, dy, m.y.as<float>(), m.weight.as<float>(), m.row_of_slot.as<int32_t>(), N,
                               k, C);
    if (expert_split()) {
      // The outputs' gradients to the experts' ranks, their inputs' back.
      grow(ep_ye_, m.R * C);
      exchange_rows(dyg, m.send_rows.data(), ep_recv_.as<float>(), m.recv_rows.data(), dt, true);
      ops_->moe_gather(ep_ye_.as<float>(), ep_recv_.as<float>(), m.perm.as<int32_t>(), m.R, C);
      zero_padding(m, ep_ye_.as<float>());
      grow(moe_dgu_, m.R * 2 * Ie);
      grow(moe_dact_, m.R * Ie);
      experts_backward(p, g, x, m, ep_ye_.as<float>(), m.R, m.local_offsets, dt);
      ops_->moe_gather(ep_recv_.as<float>(), ep_ye_.as<float>(), m.unperm.as<int32_t>(), m.R_in, C);
      exchange_rows(ep_recv_.as<float>(), m.recv_rows.data(), dyg, m.send_rows.data(), dt, false);
    } else {
      // The padding rows' gradient is zero: they add nothing to the
      // experts' weight gradients (Note [expert row blocks]).
      for (int64_t e = 0; e < E; ++e) {
        const int64_t real = m.offsets[static_cast<size_t>(e)] + m.real_rows[static_cast<size_t>(e)];
        const int64_t pad = m.offsets[static_cast<size_t>(e + 1)] - real;
        if (pad > 0) ops_->zero(dyg + real * C, pad * C);
      }
      experts_backward(p, g, x, m, dyg, m.offsets[static_cast<size_t>(E)], m.offsets, dt);
    }
    ops_->zero(dln2, N * C);
    ops_->moe_gather_backward(dln2, dyg, m.row_of_slot.as<int32_t>(), N, k, C);
    float* dlogits = moe_logits_.as<float>();
    if (c_.router_aux_loss_coef > 0 && !aux_f_.empty()) {
      // d (coef aux) / d probs(t, e), the same for every token and sparse layer.
      std::vector<float> dprobs(static_cast<size_t>(E));
      const double rows = static_cast<double>(aux_layers_ * N);
      for (int64_t e = 0; e < E; ++e)
        dprobs[static_cast<size_t>(e)] = static_cast<float>(static_cast<double>(loss_scale) * c_.router_aux_loss_coef *
                                                            static_cast<double>(E) * aux_f_[static_cast<size_t>(e)] / rows);
      ops_->copy_in(aux_dprobs_, dprobs.data(), E);
    }
    ops_->moe_route_backward(m.probs.as<float>(), m.expert.as<int32_t>(), m.weight.as<float>(), dweight,
                             c_.router_aux_loss_coef > 0 ? aux_dprobs_.as<float>() : nullptr, N, E, k,
                             c_.norm_topk_prob, dlogits);
    float* drouter = moe_dy_.as<float>();  // (N,C) of it, free again: the router's input gradient
    detail::linear_backward(*ops_, dy16_, drouter, weight_grad(g, x.router), nullptr, f32(dlogits), a.ln2_in,
                            p[x.router], N, C, E, dt, {}, g.overwrite(x.router));
    ops_->add(dln2, dln2, drouter, N * C);
  }

  // A branch's last projection (weight w, bias b, from `in` of `in_w`
  // columns) into out, with Granite's residual_multiplier and, with a
  // post-norm (index post >= 0), the norm: the projection then goes to
  // `raw` and its norm (statistics in rstd) to out.
  // `adapt(y)` adds the adapters' part to the projection y after the
  // base's product wrote it (LoRA: Note [LoRA after the base] in
  // models/detail/lora.h). pk: the weight packed (packed()).
  template <class Adapt>
  void branch_forward(const HeldParams& p, int w, int b, int post, CView in, int64_t in_w, Buf& raw, Buf& rstd,
                      float* out, int64_t N, DType dt, Adapt&& adapt, detail::PackedSlot pk = {}) {
    const int64_t C = c_.hidden_size;
    // Tensor parts: each holds some of the input's columns (heads, the
    // MLP's inner size), so its product is a partial sum; the parts add
    // them up here, the bias (kept whole on each) counted on part 0 only.
    const CView bv = tp_rank_ == 0 ? bias(p, b) : CView{};
    float* y = post < 0 ? out : raw.as<float>();
    detail::linear_forward(*ops_, y, in, p[w], bv, N, in_w, C, dt, pk);
    adapt(y);  // Note [LoRA after the base]
    tensor_sum(y, N * C);
    if (post >= 0) ops_->rmsnorm_forward(out, rstd.as<float>(), raw.as<float>(), p[post], N, C, eps(), c_.norm_offset);
    if (c_.residual_multiplier != 1.0) ops_->scale(out, residual_factor(), N * C);
  }
  // A branch's input: the norm of x (index w), or without a pre-norm
  // (OLMo 2) x itself, copied (a 16-bit matmul input may be rounded in place).
  // With layer_norm, a LayerNorm with the bias at index b.
  // Whether norm w runs as Ops::rmsnorm_forward_input: an RMSNorm there is.
  bool fused_norm(int w) const { return w >= 0 && !c_.layer_norm; }
  void pre_norm_forward(const HeldParams& p, int w, int b, Buf& out, Buf& mean, Buf& rstd, const float* x,
                        int64_t N) {
    const int64_t C = c_.hidden_size;
    if (w < 0)
      ops_->copy_columns(out.as<float>(), C, x, C, N, C);
    else if (c_.layer_norm)
      ops_->layernorm_forward(out.as<float>(), mean.as<float>(), rstd.as<float>(), x, p[w], p[b], N, C, eps());
    else
      ops_->rmsnorm_forward(out.as<float>(), rstd.as<float>(), x, p[w], N, C, eps(), c_.norm_offset);
  }
  // x += residual, then the norm w (>= 0) of x: one pass on the GPU
  // (Ops::add_rmsnorm_forward, add_layernorm_forward).
  void add_pre_norm_forward(const HeldParams& p, int w, int b, Buf& out, Buf& mean, Buf& rstd, float* x,
                            const float* residual, int64_t N) {
    const int64_t C = c_.hidden_size;
    if (c_.layer_norm)
      ops_->add_layernorm_forward(out.as<float>(), mean.as<float>(), rstd.as<float>(), x, residual, p[w], p[b], N, C,
                                  eps());
    else
      ops_->add_rmsnorm_forward(out.as<float>(), rstd.as<float>(), x, residual, p[w], N, C, eps(), c_.norm_offset);
  }

  // Qwen3's per-head norms of q and k, in place in the projection's q and k
  // columns: each head of D values is a row of an RMSNorm over N*H (or N*K)
  // rows, run on contiguous copies (kept for backward).
  // The rows and width of a q or k norm over `heads` heads of N tokens:
  // each head a row (Qwen3's), or each token's whole projection (OLMo 2's
  // qk_norm_full).
  std::pair<int64_t, int64_t> qk_norm_rows(int64_t heads, int64_t N) const {
    return c_.qk_norm_full ? std::pair{N, heads * D_} : std::pair{N * heads, D_};
  }
  void qk_norm_forward(const HeldParams& p, LlamaLayerActs& a, float* proj, int64_t N) {
    const int64_t Q = (H_ + 2 * K_) * D_;
    float* q_pre = a.qk_pre.as<float>();
    float* k_pre = q_pre + N * H_ * D_;
    float* out = qk_scratch_.as<float>();
    float* rstd = a.rstd_qk.as<float>();
    ops_->copy_columns(q_pre, H_ * D_, proj, Q, N, H_ * D_);
    ops_->copy_columns(k_pre, K_ * D_, proj + H_ * D_, Q, N, K_ * D_);
    const auto [qr, qw] = qk_norm_rows(H_, N);
    const auto [kr, kw] = qk_norm_rows(K_, N);
    ops_->rmsnorm_forward(out, rstd, q_pre, p[idx_[0].q_norm], qr, qw, eps(), c_.norm_offset);
    ops_->copy_columns(proj, Q, out, H_ * D_, N, H_ * D_);
    ops_->rmsnorm_forward(out, rstd + N * H_, k_pre, p[idx_[0].k_norm], kr, kw, eps(), c_.norm_offset);
    ops_->copy_columns(proj + H_ * D_, Q, out, K_ * D_, N, K_ * D_);
  }
  // dproj's q and k columns hold the gradient of the normed heads; they
  // become that of the heads before the norms.
  void qk_norm_backward(const HeldParams& p, const BlockGrads& g, LlamaLayerActs& a, float* dproj, int64_t N) {
    const int64_t Q = (H_ + 2 * K_) * D_, most = N * std::max(H_, K_) * D_;
    const float* q_pre = a.qk_pre.as<float>();
    const float* rstd = a.rstd_qk.as<float>();
    float* dout = qk_scratch_.as<float>();
    float* dx = dout + most;
    // q_norm and k_norm sit at the same index in every layer (before the MLP's parameters).
    for (auto [col, heads, pre, r, w] : {std::tuple{int64_t{0}, H_, q_pre, rstd, idx_[0].q_norm},
                                         std::tuple{H_ * D_, K_, q_pre + N * H_ * D_, rstd + N * H_, idx_[0].k_norm}}) {
      ops_->copy_columns(dout, heads * D_, dproj + col, Q, N, heads * D_);
      ops_->zero(dx, N * heads * D_);
      const auto [rows, width] = qk_norm_rows(heads, N);
      ops_->rmsnorm_backward(dx, norm_grad(g, w), dout, pre, p[w], r, rows, width, c_.norm_offset);
      ops_->copy_columns(dproj + col, Q, dx, heads * D_, N, heads * D_);
    }
  }

  // The (T, D/2) cos and sin of the rope angles t * inv_freq[i], each angle
  // rounded to fp32 as transformers forms it (fp32 product of fp32 values).
  // len: the length longrope picks its factors by (rope_len_).
  void build_rope_tables(int64_t T, int64_t len) {
    rope_len_ = len;
    rope_T_ = T;
    build_rope_table(T, rope_inv_freq(c_, len), rope_table_scale(c_), rope_cos_, rope_sin_);
    if (c_.rope_local_theta > 0) {
      LlamaConfig local = c_;
      local.rope_theta = c_.rope_local_theta;
      local.rope_scaling = RopeScaling{};
      build_rope_table(T, rope_inv_freq(local, T), 1.0f, rope_local_cos_, rope_local_sin_);
    }
  }
  // cos and sin times `scale` (longrope's attention factor) in fp32, as
  // transformers scales its tables.
  void build_rope_table(int64_t T, const std::vector<float>& inv, float scale, Buf& cos_out, Buf& sin_out) {
    const int64_t h = c_.rotary_dim() / 2;
    std::vector<float> cs(static_cast<size_t>(T * h)), sn(cs.size());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < h; ++i) {
        const float angle = static_cast<float>(t) * inv[static_cast<size_t>(i)];
        cs[static_cast<size_t>(t * h + i)] = static_cast<float>(std::cos(static_cast<double>(angle)));
        sn[static_cast<size_t>(t * h + i)] = static_cast<float>(std::sin(static_cast<double>(angle)));
        if (scale != 1.0f) {
          cs[static_cast<size_t>(t * h + i)] *= scale;
          sn[static_cast<size_t>(t * h + i)] *= scale;
        }
      }
    ops_->copy_in(cos_out, cs.data(), T * h);
    ops_->copy_in(sin_out, sn.data(), T * h);
  }

  // A pipeline stage holds the activations of its own layers only.
  // The fp32 buffers a forward leaves unwritten where the Ops writes the
  // 16-bit operands only (Ops::fuses_every_operand16): ln_1 and ln_2 where
  // they are RMSNorms before the branches (a sparse layer's experts read
  // ln_2's rows), the gated activation, attention's output (sequence ranks
  // exchange it in fp32) and the final RMSNorm. ensure_buffers allocates
  // none of them, and activation_bytes counts none. And kLogitGrad16: the
  // logit gradient is the head's 16-bit backward operand only
  // (Ops::cross_entropy_operand16; in fp16 written with the loss scale
  // backward will be given, StepContext::coming_loss_scale), over the
  // whole vocabulary (whole_vocab), without a final soft cap or logit
  // scaling (whose backward passes read the fp32 gradient).
  // kDropMoeAct: the experts' SwiGLU output (their down projections read
  // its 16-bit operand; expert ranks grow it back where they need it).
  enum : int {
    kDropLn1 = 1,
    kDropLn2 = 2,
    kDropAct = 4,
    kDropAtt = 8,
    kDropLnf = 16,
    kLogitGrad16 = 32,
    kDropMoeAct = 64
  };
  float grad16_scale_ = 1.0f;  // the loss scale the forward wrote the 16-bit logit gradient with
  int dropped_buffers(DType dt, int seq, bool whole_vocab) const {
    if (!ops_->fuses_every_operand16(dt)) return 0;
    int d = 0;
    if (whole_vocab && c_.final_logit_softcapping <= 0 && c_.logits_scaling == 1.0)
      d |= kLogitGrad16;
    if (c_.pre_norms && !c_.layer_norm) d |= kDropLn1;
    if (c_.pre_norms && !c_.layer_norm && c_.num_experts == 0) d |= kDropLn2;
    if (c_.mlp_gated) d |= kDropAct;
    if (c_.num_experts > 0) d |= kDropMoeAct;
    if (seq == 1) d |= kDropAtt;
    if (!c_.layer_norm) d |= kDropLnf;
    return d;
  }

  void ensure_buffers(int64_t B, int64_t T, const StageRange& sr, int dropped) {
    // The rope tables cover the whole rows (a sequence rank's slice holds
    // positions past its own length).
    if (whole_T_ != rope_T_) build_rope_tables(whole_T_, whole_T_);
    if (B == pass_.B && T == pass_.T && sr == pass_.alloc && dropped == pass_.dropped) return;
    auto f32_unless = [&](int flag, size_t n) { return dropped & flag ? Buf{} : ops_->alloc_f32(n); };
    const size_t N = static_cast<size_t>(B * T), C = static_cast<size_t>(c_.hidden_size);
    const size_t I = static_cast<size_t>(I_);
    const size_t A = static_cast<size_t>(H_ * D_), Q = static_cast<size_t>((H_ + 2 * K_) * D_);
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      pass_.x_in[static_cast<size_t>(l)] = l >= sr.lo && l <= sr.hi ? ops_->alloc_f32(N * C) : Buf{};
    for (size_t i = 0; i < pass_.acts.size(); ++i) {
      LlamaLayerActs& a = pass_.acts[i];
      const bool used = c_.gradient_checkpointing ? sr.hi > sr.lo
                                                  : static_cast<int64_t>(i) >= sr.lo && static_cast<int64_t>(i) < sr.hi;
      if (!used) {
        void* ws = a.ws;
        a = LlamaLayerActs{};
        a.ws = ws;
        continue;
      }
      a.ln1 = f32_unless(kDropLn1, N * C);
      a.rstd1 = ops_->alloc_f32(N);
      a.qkv = ops_->alloc_f32(N * 3 * A);
      if (c_.qk_norm) {
        a.qk_pre = ops_->alloc_f32(N * static_cast<size_t>((H_ + K_) * D_));
        a.rstd_qk = ops_->alloc_f32(N * static_cast<size_t>(H_ + K_));
      }
      a.att = f32_unless(kDropAtt, N * A);
      a.x_mid = ops_->alloc_f32(N * C);
      a.ln2 = f32_unless(kDropLn2, N * C);
      a.rstd2 = ops_->alloc_f32(N);
      if (c_.layer_norm) {
        a.mean1 = ops_->alloc_f32(N);
        a.mean2 = ops_->alloc_f32(N);
      }
      a.gate_up = ops_->alloc_f32(N * 2 * I);
      a.act = f32_unless(kDropAct, N * I);
      if (c_.post_norms) {
        a.o_out = ops_->alloc_f32(N * C);
        a.mlp_out = ops_->alloc_f32(N * C);
        a.rstd_po = ops_->alloc_f32(N);
        a.rstd_pm = ops_->alloc_f32(N);
      }
    }
    x_final_ = ops_->alloc_f32(N * C);
    lnf_ = f32_unless(kDropLnf, N * C);
    lnf_rstd_ = ops_->alloc_f32(N);
    if (c_.layer_norm) lnf_mean_ = ops_->alloc_f32(N);
    if (c_.parallel_residual) dpar_ = ops_->alloc_f32(N * C);
    if (c_.num_experts > 0) {
      const size_t E = static_cast<size_t>(c_.num_experts), k = static_cast<size_t>(c_.num_experts_per_tok);
      const size_t Ie = static_cast<size_t>(c_.expert_size()), M = N * k;
      const size_t Mg = static_cast<size_t>(padded_rows(static_cast<int64_t>(N)));  // Note [expert row blocks]
      for (LlamaLayerActs& a : pass_.acts) {
        if (a.x_mid.bytes() == 0) continue;  // another pipeline stage's layer
        MoeActs& m = a.moe;
        m.probs = ops_->alloc_f32(N * E);
        m.expert = ops_->alloc(M * sizeof(int32_t));
        m.weight = ops_->alloc_f32(M);
        m.xg = ops_->alloc_f32(Mg * C);
        m.gu = ops_->alloc_f32(Mg * 2 * Ie);
        m.act = dropped & kDropMoeAct ? Buf{} : ops_->alloc_f32(Mg * Ie);
        m.y = ops_->alloc_f32(Mg * C);
      }
      moe_logits_ = ops_->alloc_f32(N * E);
      moe_dy_ = ops_->alloc_f32(Mg * C);
      moe_dgu_ = ops_->alloc_f32(Mg * 2 * Ie);
      moe_dact_ = ops_->alloc_f32(Mg * Ie);
      moe_dweight_ = ops_->alloc_f32(M);
    }
    logits_ = sr.head ? ops_->alloc_f32(N * static_cast<size_t>(Vh_)) : Buf{};
    dlogits_ = !sr.head                    ? Buf{}
               : dropped & kLogitGrad16 ? ops_->alloc(N * static_cast<size_t>(Vh_) * 2)
                                        : ops_->alloc_f32(N * static_cast<size_t>(Vh_));
    dlnf_ = ops_->alloc_f32(N * C);
    dres_ = ops_->alloc_f32(N * C);
    dsmall_ = ops_->alloc_f32(N * C);
    proj_ = ops_->alloc_f32(N * Q);
    dbig_ = ops_->alloc_f32(N * std::max(2 * I, 3 * A));
    dmid_ = ops_->alloc_f32(N * std::max(A, I));
    if (c_.qk_norm) qk_scratch_ = ops_->alloc_f32(2 * N * static_cast<size_t>(std::max(H_, K_) * D_));
    if (c_.residual_multiplier != 1.0) branch_ = ops_->alloc_f32(N * C);
    if (lora()) {
      const size_t r = static_cast<size_t>(c_.lora.r);
      for (LlamaLayerActs& a : pass_.acts)
        if (a.x_mid.bytes() > 0) a.lora_u = ops_->alloc_f32(N * kLoraTargets * r);  // not another stage's layer
      lora_scratch_.ensure(*ops_, static_cast<int64_t>(N), c_.lora.r, detail::lora_all_groups(lora_groups_),
                           c_.lora.dropout > 0);
      sink_half_ = std::max<int64_t>(c_.hidden_size, std::max(H_, K_) * D_);
      sink_ = ops_->alloc_f32(2 * static_cast<size_t>(sink_half_));
    }
    pass_.B = B;
    pass_.T = T;
    pass_.alloc = sr;
    pass_.dropped = dropped;
  }


  LlamaConfig c_;
  detail::Ops* ops_ = nullptr;
  int64_t H_ = 0, K_ = 0, D_ = 0;
  int64_t GU_ = 0;  // the MLP's first projection's rows: 2I gated, I not
  int64_t I_ = 0;   // the MLP's inner size (this tensor part's)
  // The vocabulary rows this part holds (all: V, 0), and of them those
  // that are real (the last part's past V are padding).
  int64_t Vh_ = 0, vlo_ = 0, Vv_ = 0;
  // Tensor parallelism (use_tensor_part): this rank's part, the whole
  // model's blocks (blocks() describes them; specs_ are the part's), and
  // the context of the pass under way (its tensor_all_reduce).
  int tp_rank_ = 0, tp_size_ = 1;
  std::vector<BlockSpec> whole_;
  StepContext* pass_ctx_ = nullptr;
  int head_ = 1;    // the untied head's index in its block
  int head_block_ = 0;  // the untied head's block: the final block, or its own (modules_to_save)
  int lora_first_ = 0;  // the first adapter block
  std::vector<LayerIdx> idx_;  // per layer (a sparse layer's MLP differs; the rest is the same in every layer)
  std::vector<BlockSpec> specs_;
  Buf targets_store_;
  // What the forward leaves for its backward (the selected activation set) and
  // the other sets of a pipeline stage's micro-batches in flight.
  using Pass = detail::PassState<LlamaLayerActs, StageRange>;
  Pass pass_;
  detail::PassSlots<Pass> slots_;
  Buf rope_cos_, rope_sin_;              // (T, D/2)
  int64_t rope_len_ = -1;                // the length the tables' longrope factors were picked by
  int64_t rope_T_ = -1;                  // the tables' rows
  // Sequence ranks (Note [sequence parallelism] in engine/sequence_parallel.cpp):
  // the whole rows' length and positions of the forward under way, and
  // the all-to-alls' buffers.
  int64_t whole_T_ = 0;
  std::vector<int32_t> whole_positions_;
  Buf whole_pos_store_;
  const int32_t* whole_pos_ = nullptr;
  detail::SequenceExchange seq_;
  Buf rope_local_cos_, rope_local_sin_;  // rope_local_theta: the sliding-window layers' tables
  Buf x_final_, lnf_, lnf_rstd_, logits_, dlogits_;
  Buf lnf_mean_;  // layer_norm: (N)
  Buf dpar_;      // parallel_residual: (N,C) the MLP norm's input gradient
  // Mixture of experts: the router logits (N,E) (and their gradient),
  // backward's scratch for the grouped rows (M = N k), the aux loss's
  // gradient on the probabilities (E), and the aux loss's sums.
  Buf moe_logits_, moe_dy_, moe_dgu_, moe_dact_, moe_dweight_, aux_dprobs_;
  // Expert ranks (use_expert_part): this rank's share of each sparse
  // layer's experts, and the exchanges' staging (grown to the most rows
  // this rank's experts got): rows as they arrive, the experts' outputs.
  int ep_rank_ = 0, ep_size_ = 1;
  Buf ep_recv_, ep_ye_;
  std::vector<uint32_t> wire_out_, wire_in_;  // bf16 rows on the wire, two to a word (exchange_rows)
  std::vector<double> aux_count_, aux_prob_, aux_f_;
  int64_t aux_layers_ = 0;
  Buf dlnf_, dres_, dsmall_, proj_, dbig_, dmid_;
  Buf qk_scratch_;  // qk_norm: two (N, max(H,K)*D) scratch halves
  Buf branch_;      // residual_multiplier: (N,C) a branch's scaled gradient
  Buf dy16_;
  // LoRA: each layer's groups and their shared scratch (models/detail/lora.h);
  // the frozen norms' weight gradients (two halves).
  std::vector<std::array<detail::LoraGroup, 4>> lora_groups_;
  detail::LoraScratch lora_scratch_;
  // Note [packed frozen weights] (kernels/matmul.cpp): each layer's four
  // weights packed for their forward and their input gradient (slot
  // packed_slot), where the frozen base stays in place.
  detail::PackedSlots packed_;
  Buf sink_;
  int64_t sink_half_ = 0;
  CView lnf_in_;
  Buf lnf_16_;
};

}  // namespace

namespace llama {
bool neox_names(const LlamaConfig& c) { return c.layer_norm; }
const char* embed_module(const LlamaConfig& c) { return neox_names(c) ? "embed_in" : "embed_tokens"; }
const char* head_module(const LlamaConfig& c) { return neox_names(c) ? "embed_out" : "lm_head"; }

std::vector<std::string> lora_modules(const LlamaConfig& c) {
  if (c.fused_in_file) return {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  if (neox_names(c)) return {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"};
  // The mixtures of experts: the attention's (PEFT reaches the experts and
  // the router through target_parameters, which zinc does not implement).
  if (c.num_experts > 0) return {"q_proj", "k_proj", "v_proj", "o_proj"};
  return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
}

LoraSite lora_site(const LlamaConfig& c, const std::string& module) {
  const int64_t C = c.hidden_size, I = c.intermediate_size, H = c.num_attention_heads, K = c.kv_heads();
  const int64_t D = c.head_size(), A = H * D, Q = (H + 2 * K) * D, GU = (c.mlp_gated ? 2 : 1) * I;
  const std::string qkv = "self_attn.qkv_proj.weight";
  const std::string gu = c.mlp_gated ? "mlp.gate_up_proj.weight" : "mlp.up_proj.weight";
  if (module == "qkv_proj") return {"self_attn.qkv_proj", qkv, 0, Q, Q, C};
  if (module == "gate_up_proj") return {"mlp.gate_up_proj", gu, 0, c.mlp_gated ? GU : 0, GU, C};
  if (module == "q_proj") return {"self_attn.q_proj", qkv, 0, H * D, Q, C};
  if (module == "k_proj") return {"self_attn.k_proj", qkv, H * D, K * D, Q, C};
  if (module == "v_proj") return {"self_attn.v_proj", qkv, (H + K) * D, K * D, Q, C};
  if (module == "o_proj") return {"self_attn.o_proj", "self_attn.o_proj.weight", 0, C, C, A};
  if (module == "gate_proj") return {"mlp.gate_proj", gu, 0, c.mlp_gated ? I : 0, GU, C};
  if (module == "up_proj") return {"mlp.up_proj", gu, c.mlp_gated ? I : 0, I, GU, C};
  if (module == "down_proj") return {"mlp.down_proj", "mlp.down_proj.weight", 0, C, C, I};
  // GPT-NeoX's names (its file's module paths) for the same weights.
  if (module == "query_key_value") return {"attention.query_key_value", qkv, 0, Q, Q, C};
  if (module == "dense") return {"attention.dense", "self_attn.o_proj.weight", 0, C, C, A};
  if (module == "dense_h_to_4h") return {"mlp.dense_h_to_4h", gu, 0, GU, GU, C};
  if (module == "dense_4h_to_h") return {"mlp.dense_4h_to_h", "mlp.down_proj.weight", 0, C, C, I};
  return {};
}
}  // namespace llama

float LoraConfig::scale() const {
  const double rr = static_cast<double>(r);
  return static_cast<float>(rslora ? alpha / std::sqrt(rr) : alpha / rr);
}

float rope_table_scale(const LlamaConfig& c) {
  const RopeScaling::Type t = c.rope_scaling.type;
  return t == RopeScaling::Type::kLongrope || t == RopeScaling::Type::kYarn
             ? static_cast<float>(c.rope_scaling.attention_factor)
             : 1.0f;
}

std::vector<float> rope_inv_freq(const LlamaConfig& c, int64_t T) {
  const int64_t D = c.rotary_dim(), h = D / 2;
  std::vector<float> inv(static_cast<size_t>(h));
  const float base = static_cast<float>(c.rope_theta);
  for (int64_t i = 0; i < h; ++i) {
    // transformers: 1 / base ** (arange(0, D, 2).float() / D), in fp32.
    const float e = static_cast<float>(2 * i) / static_cast<float>(D);
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(base, e);
  }
  const RopeScaling& s = c.rope_scaling;
  const float factor = static_cast<float>(s.factor);
  if (s.type == RopeScaling::Type::kYarn) {
    // transformers' _compute_yarn_parameters: the correction range in
    // double, the ramp and the blend in fp32.
    const double dim = static_cast<double>(D), b = c.rope_theta;
    const double orig = static_cast<double>(s.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return dim * std::log(orig / (rotations * 2.0 * M_PI)) / (2.0 * std::log(b));
    };
    double lo = correction_dim(s.beta_fast), hi = correction_dim(s.beta_slow);
    if (s.truncate) {
      lo = std::floor(lo);
      hi = std::ceil(hi);
    }
    lo = std::max(lo, 0.0);
    hi = std::min(hi, dim - 1.0);
    if (lo == hi) hi += 0.001;  // transformers' guard against a zero-width ramp
    const float lo_f = static_cast<float>(lo), span = static_cast<float>(hi - lo);
    for (int64_t i = 0; i < h; ++i) {
      const float e = static_cast<float>(2 * i) / static_cast<float>(D);
      const float pos = std::pow(base, e);
      const float extrapolation = 1.0f / pos, interpolation = 1.0f / (factor * pos);
      const float ramp = std::min(std::max((static_cast<float>(i) - lo_f) / span, 0.0f), 1.0f);
      const float keep = 1.0f - ramp;  // the extrapolation's share
      inv[static_cast<size_t>(i)] = interpolation * (1.0f - keep) + extrapolation * keep;
    }
  } else if (s.type == RopeScaling::Type::kLongrope) {
    // transformers: 1 / (ext * base ** (arange(0, D, 2).float() / D)), ext
    // the fp32 factors: long past original_max_position_embeddings.
    const std::vector<double>& ext = T > s.original_max_position_embeddings ? s.long_factor : s.short_factor;
    for (int64_t i = 0; i < h; ++i) {
      const float e = static_cast<float>(2 * i) / static_cast<float>(D);
      inv[static_cast<size_t>(i)] = 1.0f / (static_cast<float>(ext[static_cast<size_t>(i)]) * std::pow(base, e));
    }
  } else if (s.type == RopeScaling::Type::kLinear) {
    for (float& f : inv) f = f / factor;
  } else if (s.type == RopeScaling::Type::kLlama3) {
    // Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the
    // band between interpolated smoothly.
    const float old_len = static_cast<float>(s.original_max_position_embeddings);
    const float lo = static_cast<float>(s.low_freq_factor), hi = static_cast<float>(s.high_freq_factor);
    const float low_freq_wavelen = old_len / lo, high_freq_wavelen = old_len / hi;
    for (float& f : inv) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      float g = wavelen > low_freq_wavelen ? f / factor : f;
      const float smooth = (old_len / wavelen - lo) / (hi - lo);
      const float smoothed = (1.0f - smooth) * g / factor + smooth * g;
      const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      f = medium ? smoothed : g;
    }
  }
  return inv;
}

std::optional<SizeError> size_error(const LlamaConfig& c) {
  if (c.vocab_size < 2) return SizeError{"vocab_size", "must be >= 2, got " + std::to_string(c.vocab_size)};
  for (auto [field, v] : {std::pair<const char*, int64_t>{"hidden_size", c.hidden_size},
                          {"intermediate_size", c.intermediate_size},
                          {"num_hidden_layers", c.num_hidden_layers},
                          {"num_attention_heads", c.num_attention_heads},
                          {"max_position_embeddings", c.max_position_embeddings}}) {
    if (v < 1) return SizeError{field, "must be >= 1, got " + std::to_string(v)};
  }
  if (const std::string why = layers_refusal(c.num_hidden_layers); !why.empty()) return SizeError{"num_hidden_layers", why};
  if (c.num_key_value_heads < 0)
    return SizeError{"num_key_value_heads", "must be >= 1, got " + std::to_string(c.num_key_value_heads)};
  if (c.num_attention_heads % c.kv_heads() != 0) {
    return SizeError{"num_key_value_heads", "must divide num_attention_heads " + std::to_string(c.num_attention_heads) +
                                                ", got " + std::to_string(c.kv_heads())};
  }
  if (c.head_dim < 0) return SizeError{"head_dim", "must be >= 1, got " + std::to_string(c.head_dim)};
  if (c.head_dim == 0 && c.hidden_size % c.num_attention_heads != 0) {
    return SizeError{"hidden_size", "must be divisible by num_attention_heads " +
                                        std::to_string(c.num_attention_heads) + " (or head_dim given), got " +
                                        std::to_string(c.hidden_size)};
  }
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1))
    return SizeError{"partial_rotary_factor", "must be in (0, 1]"};
  if (c.rotary_dim() % 2 != 0 || c.rotary_dim() <= 0)
    return SizeError{c.partial_rotary_factor == 1 ? "head_dim" : "partial_rotary_factor",
                     "the rotated dims (head_dim " + std::to_string(c.head_size()) + " times partial_rotary_factor) "
                     "must be even and > 0, got " + std::to_string(c.rotary_dim())};
  if (c.rope_scaling.type == RopeScaling::Type::kLongrope) {
    const size_t h = static_cast<size_t>(c.rotary_dim() / 2);
    if (c.rope_scaling.short_factor.size() != h || c.rope_scaling.long_factor.size() != h)
      return SizeError{"rope_scaling.short_factor",
                       "longrope's short_factor and long_factor must hold rotary_dim / 2 = " + std::to_string(h) +
                           " values each, got " + std::to_string(c.rope_scaling.short_factor.size()) + " and " +
                           std::to_string(c.rope_scaling.long_factor.size())};
    for (const std::vector<double>* v : {&c.rope_scaling.short_factor, &c.rope_scaling.long_factor})
      for (double x : *v)
        if (!(x > 0) || !std::isfinite(x)) return SizeError{"rope_scaling.long_factor", "factors must be finite and > 0"};
    if (c.rope_scaling.original_max_position_embeddings < 1)
      return SizeError{"rope_scaling.original_max_position_embeddings", "must be >= 1"};
  }
  if (!(c.rms_norm_eps > 0)) return SizeError{"rms_norm_eps", "must be > 0"};
  if (!(c.rope_theta > 0)) return SizeError{"rope_theta", "must be > 0"};
  if (!c.no_rope_layers.empty()) {
    if (static_cast<int64_t>(c.no_rope_layers.size()) != c.num_hidden_layers)
      return SizeError{"no_rope_layers", "must hold one entry per layer (" + std::to_string(c.num_hidden_layers) +
                                             "), got " + std::to_string(c.no_rope_layers.size())};
    for (int v : c.no_rope_layers)
      if (v != 0 && v != 1) return SizeError{"no_rope_layers", "entries must be 0 or 1, got " + std::to_string(v)};
  }
  for (auto [field, v] : {std::pair<const char*, double>{"embedding_multiplier", c.embedding_multiplier},
                          {"residual_multiplier", c.residual_multiplier},
                          {"logits_scaling", c.logits_scaling}})
    if (!(v > 0) || !std::isfinite(v)) return SizeError{field, "must be a finite number > 0"};
  if (!(c.attention_multiplier >= 0) || !std::isfinite(c.attention_multiplier))
    return SizeError{"attention_multiplier", "must be a finite number > 0 (or 0: 1/sqrt(head_dim))"};
  if (c.sliding_window < 0)
    return SizeError{"sliding_window", "must be >= 1 (or 0: none), got " + std::to_string(c.sliding_window)};
  if (!c.window_layers.empty() && static_cast<int64_t>(c.window_layers.size()) != c.num_hidden_layers)
    return SizeError{"layer_types", "must hold one entry per layer (" + std::to_string(c.num_hidden_layers) +
                                        "), got " + std::to_string(c.window_layers.size())};
  if (c.no_rope_layer_interval < 0)
    return SizeError{"no_rope_layer_interval", "must be >= 0, got " + std::to_string(c.no_rope_layer_interval)};
  using Act = LlamaConfig::MlpAct;
  if (c.mlp_gated && c.mlp_act == Act::kGeluErf)
    return SizeError{"hidden_act", "exact GELU (gelu) is implemented for an ungated MLP only"};
  if (!c.mlp_gated && c.mlp_act == Act::kSilu)
    return SizeError{"hidden_act", "an ungated MLP takes GELU (gelu, or its tanh form), not SiLU"};
  if (c.layer_norm && (c.post_norms || c.qk_norm || c.norm_offset != 0.0f || !c.pre_norms))
    return SizeError{"layer_norm", "LayerNorm is implemented as the pre-norms alone (GPT-NeoX's)"};
  if (c.num_experts < 0) return SizeError{"num_experts", "must be >= 0, got " + std::to_string(c.num_experts)};
  if (c.lora.r < 0) return SizeError{"lora.r", "must be >= 1, got " + std::to_string(c.lora.r)};
  if (c.lora.enabled()) {
    const std::vector<std::string> modules = llama::lora_modules(c);
    std::string names;
    for (const std::string& m : modules) names += (names.empty() ? "" : ", ") + m;
    if (c.lora.targets.empty())
      return SizeError{"lora.target_modules", "names no module to adapt (PEFT has no default for this family: "
                                              "name them (" + names + "), or \"all-linear\")"};
    for (const std::string& t : c.lora.targets)
      if (std::find(modules.begin(), modules.end(), t) == modules.end())
        return SizeError{"lora.target_modules", "\"" + t + "\" is not a linear layer of this model (" + names + ")"};
    const std::string embed = llama::embed_module(c), head = llama::head_module(c);
    for (const std::string& m : c.lora.modules_to_save) {
      if (m != embed && m != head)
        return SizeError{"lora.modules_to_save", "\"" + m + "\": zinc trains " + embed + " and " + head +
                                                 " beside the adapters, as this family names them (not other "
                                                 "modules yet)"};
      if (c.tie_word_embeddings)
        return SizeError{"lora.modules_to_save", "\"" + m + "\" on a model whose head is its embedding "
                                                 "(tie_word_embeddings): PEFT unties them; not implemented"};
    }
  }
  if (c.num_experts > 0) {
    if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts)
      return SizeError{"num_experts_per_tok", "must be in [1, num_experts " + std::to_string(c.num_experts) + "], got " +
                                                  std::to_string(c.num_experts_per_tok)};
    if (c.moe_intermediate_size < 0)
      return SizeError{"moe_intermediate_size", "must be >= 1 (or 0: intermediate_size)"};
    if (!c.dense_layers.empty() && static_cast<int64_t>(c.dense_layers.size()) != c.num_hidden_layers)
      return SizeError{"mlp_only_layers", "must mark layers below num_hidden_layers " +
                                              std::to_string(c.num_hidden_layers)};
    if (c.mlp_bias || !c.mlp_gated || c.mlp_act != LlamaConfig::MlpAct::kSilu || c.post_norms || c.parallel_residual)
      return SizeError{"num_experts", "experts are implemented as SwiGLU without biases, with pre-norms only"};
    if (!(c.router_aux_loss_coef >= 0) || !std::isfinite(c.router_aux_loss_coef))
      return SizeError{"router_aux_loss_coef", "must be a finite number >= 0"};
  }
  if (c.rope_scaling.type != RopeScaling::Type::kNone && !(c.rope_scaling.factor > 0))
    return SizeError{"rope_scaling.factor", "must be > 0"};
  if (c.rope_scaling.type == RopeScaling::Type::kLlama3 &&
      !(c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor))
    return SizeError{"rope_scaling.high_freq_factor", "must be above low_freq_factor"};
  return std::nullopt;
}

std::shared_ptr<Model> make_llama(const LlamaConfig& cfg) { return std::make_shared<Llama>(cfg); }

}  // namespace zinc::models
