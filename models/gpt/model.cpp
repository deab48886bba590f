// GPT-2-style decoder over the zinc model interface. Shapes in comments:
// B batch, T sequence, C n_embd, H heads, V vocabulary, N = B*T rows.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "core/alloc.h"
#include "core/error.h"
#include "models/detail/linear.h"
#include "models/detail/lora.h"
#include "models/detail/ops.h"
#include "models/detail/pass_slots.h"
#include "models/detail/sequence_split.h"
#include "models/detail/tensor_part.h"
#include "models/models.h"

namespace zinc::models {
namespace {

using detail::Buf;
using detail::f32;
using kernels::CView;

// Parameter indices inside a transformer-layer block (order of the spec).
enum LayerParam {
  kLn1W, kLn1B, kQkvW, kQkvB, kAttnProjW, kAttnProjB,
  kLn2W, kLn2B, kFcW, kFcB, kMlpProjW, kMlpProjB,
};
enum EmbedParam { kWte, kWpe };
// LoRA's targets in a layer (one group each, Note [LoRA by groups]): PEFT's
// module paths, the zinc weight each adapts, and its module name.
enum GptLoraTarget { kGptAttn, kGptAttnProj, kGptFc, kGptMlpProj, kGptLoraTargets };
constexpr const char* kGptLoraPaths[kGptLoraTargets] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
constexpr const char* kGptLoraModules[kGptLoraTargets] = {"c_attn", "c_proj", "c_fc", "c_proj"};
enum NormParam { kLnfW, kLnfB };

// Note [activation checkpointing]
// With GptConfig::gradient_checkpointing, forward keeps only each layer's
// input (the residual stream x_in, (N,C) per layer) and runs every layer into
// one shared set of layer activations (LayerActs, attention workspace
// included). Backward, for layer l, acquires its parameters as it always
// does, recomputes the layer's forward from x_in[l] into the shared set with
// the same kernels, the same parameters (at ZeRO-3 gathered again, the same
// bits) and the same bf16 operand conversions (detail::matmul_input), then
// runs the unchanged backward. Every kernel is deterministic for fixed shapes
// and thread count, so the recomputed activations, and with them the
// gradients, are bit-identical to the run that kept them. Two savings on the
// recomputation: the layer's last matmul (the MLP projection, a third of its
// matmul FLOPs) is skipped, since backward never reads the layer's output,
// and the last layer is not recomputed at all, since the shared set still
// holds it from forward. Memory: L x (N,C) inputs plus one set instead of L
// sets (activation_memory); time: about one extra forward of the layers.
// HF's gradient_checkpointing does the same per decoder layer through
// torch.utils.checkpoint.

// Activations of one layer that its backward reads (besides its input, the
// residual stream x_in, which Gpt keeps per layer in either mode).
struct LayerActs {
  Buf ln1;       // (N,C)
  Buf ln1_mean;  // (N)
  Buf ln1_rstd;  // (N)
  Buf qkv;       // (N,3C)
  Buf att;       // (N,C) attention output before its projection
  Buf x_mid;     // (N,C) residual stream after attention
  Buf ln2;       // (N,C)
  Buf ln2_mean;  // (N)
  Buf ln2_rstd;  // (N)
  Buf fc;        // (N,4C) before GELU
  Buf gelu;      // (N,4C)
  // What the matmuls read of ln1, att, ln2 and gelu (detail::matmul_input:
  // with bf16 compute converted once in forward, read again by the
  // weight-gradient matmuls in backward) and the bf16 copies behind them.
  CView ln1_in, att_in, ln2_in, gelu_in;
  Buf ln1_16, att_16, ln2_16, gelu_16;
  void* ws = nullptr;  // Ops::attention_create
  // LoRA: U of each target at [t * N * r] (N, r), and what B's products read of it.
  Buf lora_u;
  detail::LoraSaved lora_saved[kGptLoraTargets];
};

class Gpt final : public Model {
  using StageRange = detail::StageRange;  // the layers a pass computes (pipeline stages)

 public:
  explicit Gpt(const GptConfig& c) : c_(c), ops_(&detail::ops_for(c.device)) {
    if (auto bad = size_error(c)) throw Error("gpt: " + bad->field + ": " + bad->message);
    const int64_t C = c.n_embd, V = c.vocab_size;
    A_ = C;
    Hh_ = c.n_head;
    Vh_ = Vv_ = c.vocab_size;
    F_ = 4 * C;
    const float resid_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.n_layer));
    const bool frozen = c.lora.enabled();  // LoRA: the base is frozen
    specs_.push_back({"embed", {{"wte", {V, C}}, {"wpe", {c.block_size, C}}}, frozen});
    for (int64_t l = 0; l < c.n_layer; ++l) {
      specs_.push_back({"h." + std::to_string(l),
                        {
                            {"ln_1.weight", {C}, Init::kOnes},
                            {"ln_1.bias", {C}, Init::kZeros},
                            {"attn.c_attn.weight", {3 * C, C}, Init::kNormal, 0.02f, true},
                            {"attn.c_attn.bias", {3 * C}, Init::kZeros},
                            {"attn.c_proj.weight", {C, C}, Init::kNormal, resid_std, true},
                            {"attn.c_proj.bias", {C}, Init::kZeros},
                            {"ln_2.weight", {C}, Init::kOnes},
                            {"ln_2.bias", {C}, Init::kZeros},
                            {"mlp.c_fc.weight", {4 * C, C}, Init::kNormal, 0.02f, true},
                            {"mlp.c_fc.bias", {4 * C}, Init::kZeros},
                            {"mlp.c_proj.weight", {C, 4 * C}, Init::kNormal, resid_std, true},
                            {"mlp.c_proj.bias", {C}, Init::kZeros},
                        },
                        frozen});
    }
    specs_.push_back({"ln_f", {{"weight", {C}, Init::kOnes}, {"bias", {C}, Init::kZeros}}, frozen});
    if (frozen) add_lora_blocks();
    // Note [activation checkpointing]: one shared set of layer activations
    // instead of one per layer.
    pass_.acts.resize(c.gradient_checkpointing ? 1 : static_cast<size_t>(c.n_layer));
    for (LayerActs& a : pass_.acts) a.ws = ops_->attention_create();
    pass_.x_in.resize(static_cast<size_t>(c.n_layer));
  }
  ~Gpt() override {
    for (LayerActs& a : pass_.acts) ops_->attention_destroy(a.ws);
    slots_.for_each([&](Pass& p) {
      for (LayerActs& a : p.acts) ops_->attention_destroy(a.ws);
    });
  }

  // Pipeline layers: the embedding, each layer with its adapters' block,
  // and the final norm with the head, which is tied to the embedding (the
  // engine keeps that block on both ends, Note [tied blocks across stages]).
  std::vector<PipelineLayer> pipeline_layers() const override {
    return detail::decoder_pipeline_layers(specs_, c_.n_layer, lora() ? lora_block(0) : -1,
                                           {static_cast<int>(c_.n_layer + 1), 0});
  }
  int64_t pipeline_width() const override { return c_.n_embd; }

  // Pipeline stages: one slot per in-flight micro-batch's forward; the
  // selected slot's state is pass_ (models/detail/pass_slots.h).
  bool select_activations(int slot) override {
    slots_.select(slot, pass_, [&] { return ops_->attention_create(); });
    return true;
  }

  std::string name() const override { return "gpt"; }
  Device device() const override { return ops_->device(); }
  const std::vector<BlockSpec>& blocks() const override { return whole_.empty() ? specs_ : whole_; }

  // Tensor parts (Note [tensor parallelism] in engine/tensor_parallel.cpp):
  // c_attn's q, k and v rows of the part's heads and c_fc's rows of its
  // share of the MLP by rows; both c_proj by columns; their biases, the
  // norms and the (tied) embedding whole.
  TensorPart tensor_part(int rank, int size, std::string* why) const override {
    auto no = [&](const std::string& m) {
      if (why) *why = "model 'gpt' does not split into " + std::to_string(size) + " tensor parts: " + m;
      return TensorPart{};
    };
    if (size < 1 || rank < 0 || rank >= size) return no("no part " + std::to_string(rank));
    if (c_.n_head % size != 0) return no("n_head " + std::to_string(c_.n_head) + " is not a multiple of it");
    const int64_t C = c_.n_embd, a = C / size, f = 4 * C / size;
    const int64_t h = c_.n_head / size;
    using detail::part_span;
    // The vocabulary (wte's rows, the tied head's) in parts of ceil(V / T)
    // rows, the last padded (Note [vocabulary parts]).
    const int64_t V = c_.vocab_size, v = detail::vocab_share(V, size), real = std::min(v, V - rank * v);
    TensorPart out = detail::whole_tensor_part(
        blocks(), "heads " + part_span(rank * h, h, c_.n_head) + ", MLP " + part_span(rank * f, f, 4 * C) +
                      (v < V ? ", vocabulary " + part_span(rank * v, real, V) : std::string(", vocabulary whole")));
    if (v < V) {
      out.splits[0][kWte] = TensorSplit{TensorSplit::kRows, {{rank * v, real}}};
      out.blocks[0].params[kWte].shape.dims[0] = v;
    }
    const TensorSplit qkv{TensorSplit::kRows, {{rank * a, a}, {C + rank * a, a}, {2 * C + rank * a, a}}};
    const TensorSplit fc{TensorSplit::kRows, {{rank * f, f}}};
    for (int64_t l = 0; l < c_.n_layer; ++l) {
      std::vector<ParamSpec>& ps = out.blocks[static_cast<size_t>(l + 1)].params;
      std::vector<TensorSplit>& sp = out.splits[static_cast<size_t>(l + 1)];
      sp[kQkvW] = sp[kQkvB] = qkv;
      ps[kQkvW].shape.dims[0] = ps[kQkvB].shape.dims[0] = 3 * a;
      sp[kAttnProjW] = TensorSplit{TensorSplit::kColumns, {{rank * a, a}}};
      ps[kAttnProjW].shape.dims[1] = a;
      sp[kFcW] = sp[kFcB] = fc;
      ps[kFcW].shape.dims[0] = ps[kFcB].shape.dims[0] = f;
      sp[kMlpProjW] = TensorSplit{TensorSplit::kColumns, {{rank * f, f}}};
      ps[kMlpProjW].shape.dims[1] = f;
      if (!lora()) continue;
      // The adapters (Note [LoRA over tensor parts] in models/detail/lora.h):
      // c_attn's and c_fc's B by their weight's rows, A whole; both
      // c_proj's A by their weight's columns, B whole; the whole ones'
      // gradients summed over the parts.
      const size_t blk = static_cast<size_t>(lora_block(l));
      std::vector<ParamSpec>& lps = out.blocks[blk].params;
      std::vector<TensorSplit>& lsp = out.splits[blk];
      for (const detail::LoraMember& m : lora_groups_[static_cast<size_t>(l)][kGptAttn].members) {
        lsp[static_cast<size_t>(m.b)] = qkv;
        lps[static_cast<size_t>(m.b)].shape.dims[0] = 3 * a;
        lsp[static_cast<size_t>(m.a)].sum_grads = true;
      }
      for (const detail::LoraMember& m : lora_groups_[static_cast<size_t>(l)][kGptFc].members) {
        lsp[static_cast<size_t>(m.b)] = fc;
        lps[static_cast<size_t>(m.b)].shape.dims[0] = f;
        lsp[static_cast<size_t>(m.a)].sum_grads = true;
      }
      for (auto [t, in] : {std::pair<int, int64_t>{kGptAttnProj, a}, {kGptMlpProj, f}})
        for (const detail::LoraMember& m : lora_groups_[static_cast<size_t>(l)][static_cast<size_t>(t)].members) {
          lsp[static_cast<size_t>(m.a)] = TensorSplit{TensorSplit::kColumns, {{rank * in, in}}};
          lps[static_cast<size_t>(m.a)].shape.dims[1] = in;
          lsp[static_cast<size_t>(m.b)].sum_grads = true;
        }
    }
    return out;
  }
  void use_tensor_part(int rank, int size) override {
    if (size == 1) return;
    if (!whole_.empty()) throw Error("model 'gpt' already computes one tensor part");
    std::string why;
    TensorPart part = tensor_part(rank, size, &why);
    if (part.empty()) throw Error(why);
    whole_ = std::move(specs_);
    specs_ = std::move(part.blocks);
    A_ /= size;
    Hh_ /= size;
    F_ /= size;
    Vh_ = detail::vocab_share(c_.vocab_size, size);
    // A vocabulary too small to split (a part would hold padding only) is
    // whole on every part: each holds rows 0 .. V, not rank * V on.
    vlo_ = Vh_ < c_.vocab_size ? rank * Vh_ : 0;
    Vv_ = std::min(Vh_, c_.vocab_size - vlo_);
    tp_rank_ = rank;
    tp_size_ = size;  // the first forward makes its buffers at the part's sizes
    if (lora()) lora_groups_ = lora_groups(size);
  }
  std::span<const float> logits() const override {
    if (ops_->device() != Device::kCpu || pass_.B == 0 || !pass_.alloc.head || vocab_split()) return {};
    return {logits_.as<const float>(), static_cast<size_t>(pass_.B * pass_.T * c_.vocab_size)};
  }

  double flops_per_token(int64_t T) const override {
    const double C = static_cast<double>(c_.n_embd), L = static_cast<double>(c_.n_layer);
    const double A = static_cast<double>(A_), F = static_cast<double>(F_);  // a tensor part's
    const double matmul_params = L * (4.0 * C * A + 2.0 * C * F) + static_cast<double>(c_.vocab_size) * C;
    // attention scores and weighted sum: 2 matmuls of 2*T*A flops per token
    // forward, x3 for forward + backward (causal masking not discounted).
    const double attention = L * 3.0 * 2.0 * 2.0 * static_cast<double>(T) * A;
    return 6.0 * matmul_params + attention;
  }

  // The buffers ensure_buffers and forward allocate, and the kernel calls of
  // forward and backward by shape (keep in step with both).
  std::optional<ActivationMemory> activation_memory(int64_t B, int64_t T, DType dt) const override {
    return activation_bytes(B, T, dt, StageRange{0, c_.n_layer, true, true}, 1, tp_size_);
  }
  std::optional<ActivationMemory> stage_activation_memory(int64_t B, int64_t T, DType dt, const PipelineStage& st,
                                                          int sets, int tensor_parts) const override {
    return activation_bytes(B, T, dt, stage_range(st), sets, tensor_parts);
  }
  // One of `size` sequence ranks' (Note [sequence parallelism] in
  // engine/sequence_parallel.cpp): a slice of each row, the attention's
  // workspace over whole rows of its heads, the exchanges' buffers.
  std::optional<ActivationMemory> sequence_activation_memory(int64_t B, int64_t T, DType dt, int size,
                                                             int tensor_parts) const override {
    return activation_bytes(B, T, dt, StageRange{0, c_.n_layer, true, true}, 1, tensor_parts, size);
  }
  // With tensor parts (after use_tensor_part) the part's heads must divide.
  std::string sequence_split_error(int size) const override {
    if (Hh_ % size != 0)
      return (tp_size_ > 1 ? "a tensor part's " + std::to_string(Hh_) + " heads are"
                           : "n_head " + std::to_string(Hh_) + " is") +
             " not a multiple of it: each sequence rank attends with whole heads";
    return "";
  }

 private:
  // A stage's (the whole model's: every layer, one set): its layers'
  // inputs and activations `sets` times, the head's buffers on the last.
  // One of `parts` tensor parts' (its heads and MLP share).
  // And of one of `seq` sequence ranks (T: the whole rows').
  std::optional<ActivationMemory> activation_bytes(int64_t B, int64_t T, DType dt, const StageRange& sr, int sets,
                                                   int parts, int seq = 1) const {
    using detail::buffer_bytes;
    // The Ops' count of a matmul input's 16-bit copy (the GPU keeps one in fp16 too).
    const auto matmul_input_bytes = [this](int64_t n, DType d) { return ops_->matmul_input_bytes(n, d); };
    const int64_t N = B * (T / seq), C = c_.n_embd, V = c_.vocab_size, L = c_.n_layer;
    const int64_t A = C / parts, F = 4 * C / parts;  // a tensor part's widths
    const kernels::AttentionShape as{B, T, A / seq, c_.n_head / parts / seq};
    ActivationMemory m;
    // Per layer: its input x_in. Per set of layer activations (one per layer,
    // or one shared with gradient_checkpointing): ln1 att x_mid ln2, qkv,
    // fc gelu, the four norm statistics, the bf16 copies of the matmul
    // inputs, the probabilities.
    // Where the Ops fuses the bf16 operands (Ops::fuses_operand16) ln1, ln2,
    // gelu and lnf have no fp32 buffers.
    const bool fused = ops_->fuses_operand16(dt);
    // The logit gradient as its 16-bit operand alone (logit_grad16, here
    // for `parts`): no fp32 gradient and no copy of it.
    const bool grad16 = ops_->fuses_every_operand16(dt) && detail::vocab_share(V, parts) == V;
    // Attention's fp32 output neither where the Ops writes its operand only
    // (Ops::fuses_every_operand16, without sequence ranks).
    const int64_t att = ops_->fuses_every_operand16(dt) && seq == 1 ? 0 : buffer_bytes(N * A);
    const int64_t acts = (fused ? 1 : 3) * buffer_bytes(N * C) + att + buffer_bytes(N * 3 * A) +
                         (fused ? 1 : 2) * buffer_bytes(N * F) + 4 * buffer_bytes(N) +
                         2 * matmul_input_bytes(N * C, dt) + matmul_input_bytes(N * A, dt) +
                         matmul_input_bytes(N * F, dt) +
                         ops_->attention_workspace_bytes(as, dt);
    const int64_t layers = sr.hi - sr.lo;
    const int64_t x_ins = sr.embed && sr.head ? L : std::min(sr.hi + 1, L) - sr.lo;
    const int64_t act_sets = sets * (c_.gradient_checkpointing ? (layers > 0 ? 1 : 0) : layers);
    // Once: x_final lnf (not when fused) dlnf dres dsmall, dbig, lnf's statistics, logits and
    // dlogits (fp32, or 16-bit with grad16), lnf's bf16 copy, the input tokens.
    m.saved = sets * x_ins * buffer_bytes(N * C) + act_sets * acts;
    if (lora()) {
      // Per set: U of every target and B's operands of it; once: the
      // groups' scratch (LoraScratch, one-member groups) and the sink.
      const int64_t r = c_.lora.r;
      m.saved += act_sets * (buffer_bytes(N * kGptLoraTargets * r) + kGptLoraTargets * detail::matmul_input_bytes(N * r, dt)) +
                 detail::LoraScratch::bytes(N, r, detail::lora_all_groups(lora_groups(parts)), c_.lora.dropout > 0, dt) +
                 buffer_bytes(2 * C);
    }
    m.saved += (fused ? 4 : 5) * buffer_bytes(N * C) + buffer_bytes(N * F) + 2 * buffer_bytes(N) +
               (sr.head ? buffer_bytes(N * detail::vocab_share(V, parts)) +
                              buffer_bytes(N * detail::vocab_share(V, parts), grad16 ? 2 : 4)
                        : 0) +
               matmul_input_bytes(N * C, dt) +
               N * static_cast<int64_t>(sizeof(int32_t));
    // Sequence ranks: the exchanges' send and receive buffers, and the
    // position embeddings' rows (wpe_rows_).
    if (seq > 1) m.saved += 2 * buffer_bytes(N * 3 * A) + buffer_bytes(N * C);
    else if (detail::vocab_share(V, parts) < V) m.saved += buffer_bytes(N * C);  // vocabulary parts' wpe_rows_
    const detail::OperandKind x = detail::matmul_input_kind(dt);
    int64_t dy_copy = 0;
    // The pass's kernel scratch, with the frozen base's layer products packed
    // (packed(): no weight converted per call) or not.
    auto tally = [&](bool packed) {
      kernels::ScratchTally t;
      for (auto [in, out] : {std::pair<int64_t, int64_t>{C, 3 * A}, {A, C}, {C, F}, {F, C}}) {
        detail::tally_linear_forward(t, x, N, in, out, true, dt, packed);
        dy_copy = std::max(dy_copy, detail::tally_linear_backward(t, x, N, in, out, true, dt, !lora(),  // LoRA: frozen
                                                                  packed));
      }
      t.attention(as, dt);
      if (lora()) {
        detail::lora_tally(t, N, c_.lora.r, c_.lora.scale(), detail::lora_all_groups(lora_groups(parts)), dt,
                           c_.lora.dropout > 0);
      }
      if (sr.head) {
        const int64_t v = detail::vocab_share(V, parts);  // a vocabulary part's columns
        detail::tally_linear_forward(t, x, N, C, v, false, dt);
        const int64_t copy = detail::tally_linear_backward(t, x, N, C, v, true, dt, !specs_[0].frozen);
        if (!grad16) dy_copy = std::max(dy_copy, copy);  // else the cross-entropy wrote the operand
      }
      return ops_->kernel_scratch_bytes(t, as, dt);
    };
    const int64_t plain = tally(false);
    m.workspace = plain + dy_copy;
    if (lora() && c_.lora.pack_base) {
      // What packing adds (ActivationMemory::packed): the copies of
      // packed(), every layer's four weights; less the scratch the packed
      // products no longer need.
      for (auto [in, out] : {std::pair<int64_t, int64_t>{C, 3 * A}, {A, C}, {C, F}, {F, C}})
        m.packed += (sr.hi - sr.lo) * detail::packed_linear_bytes(N, in, out, true, dt);
      m.packed += tally(true) - plain;
    }
    return m;
  }

 public:

  float forward(StepContext& ctx, const Batch& batch) override {
    pass_ctx_ = &ctx;
    pass_.lora_seed = ctx.dropout_seed();  // Note [LoRA dropout]: this forward's, for its backward too
    const int64_t B = batch.B, T = batch.T, C = c_.n_embd, V = c_.vocab_size;
    // Sequence ranks: this is a slice of rows of sp.T tokens (whole_T_).
    const SequenceSplit& sp = ctx.sequence_split();
    whole_T_ = sp.split() ? sp.T : T;
    if (whole_T_ > c_.block_size)
      throw Error("gpt: sequence length " + std::to_string(whole_T_) + " exceeds block_size " +
                  std::to_string(c_.block_size));
    const DType dt = ctx.compute_dtype();
    const StageRange sr = stage_range(ctx.pipeline_stage());
    ensure_buffers(B, T, ops_->fuses_operand16(dt), ops_->fuses_every_operand16(dt) && !sp.split(), logit_grad16(dt),
                   sr);
    const int64_t N = B * T;
    pass_.tokens = batch.inputs;
    pass_.tok = ops_->tokens(pass_.tokens, V, "embedding_forward", pass_.tokens_store);
    const int32_t* targets = ops_->targets(batch.targets, V, targets_store_);
    pass_.positions = batch.positions;  // backward reads them too
    pass_.pos = ops_->positions(pass_.positions, pass_.positions_store);
    whole_positions_ = sp.split() && sp.positions ? *sp.positions : std::vector<int32_t>{};
    whole_pos_ = sp.split() ? ops_->positions(whole_positions_, whole_pos_store_) : nullptr;

    if (sr.embed) {
      HeldParams emb = ctx.acquire(0);
      if (sequence_split() || vocab_split()) {
        // A slice's positions run past its own T, and a vocabulary part
        // sums its rows over the parts first: wpe is looked up as an
        // embedding of the positions (block_size rows) and added.
        if (pass_.positions.empty()) {  // rows of one sequence each: 0..T-1
          pass_.pos_rows.resize(static_cast<size_t>(N));
          for (int64_t i = 0; i < N; ++i) pass_.pos_rows[static_cast<size_t>(i)] = static_cast<int32_t>(i % T);
        }
        pass_.pos_tok = ops_->tokens(pass_.positions.empty() ? pass_.pos_rows : pass_.positions, c_.block_size,
                                     "embedding_forward", pass_.pos_tok_store);
        ensure_wpe_rows(B * T);
        if (vocab_split()) {  // the part's rows, zero elsewhere, summed over the parts
          ops_->embedding_part_forward(pass_.x_in[0].as<float>(), pass_.tok, emb[kWte], N, C, vlo_, Vh_);
          tensor_sum(pass_.x_in[0].as<float>(), N * C);
        } else {
          ops_->embedding_forward(pass_.x_in[0].as<float>(), pass_.tok, emb[kWte], CView{}, B, T, C, V, nullptr);
        }
        ops_->embedding_forward(wpe_rows_.as<float>(), pass_.pos_tok, emb[kWpe], CView{}, B, T, C, c_.block_size,
                                nullptr);
        ops_->add(pass_.x_in[0].as<float>(), pass_.x_in[0].as<float>(), wpe_rows_.as<float>(), B * T * C);
      } else {
        ops_->embedding_forward(pass_.x_in[0].as<float>(), pass_.tok, emb[kWte], emb[kWpe], B, T, C, V, pass_.pos);
      }
      emb.release();
    } else {  // a later pipeline stage: the previous stage's hidden state
      ops_->copy_columns(hidden(sr.lo), C, ctx.pipeline_stage().input, C, N, C);
    }

    for (int64_t l = sr.lo; l < sr.hi; ++l) {
      float* x_out = l + 1 < c_.n_layer ? pass_.x_in[l + 1].as<float>() : x_final_.as<float>();
      HeldParams p = ctx.acquire(static_cast<int>(l + 1));
      HeldParams lp;
      if (lora()) lp = ctx.acquire(lora_block(l));
      layer_forward(p, acts(l), l, pass_.x_in[l].as<float>(), x_out, B, T, dt, lora() ? &lp : nullptr);
      p.release();
    }
    pass_.acts_hold = sr.hi - 1;  // the shared set (if any) holds the last layer's
    if (!sr.head) {  // the next stage's input
      ops_->copy_columns(ctx.pipeline_stage().output, C, hidden(sr.hi), C, N, C);
      return 0.0f;
    }

    const int norm_block = static_cast<int>(c_.n_layer + 1);
    HeldParams nf = ctx.acquire(norm_block);
    lnf_in_ = ops_->layernorm_forward_input(lnf_.as<float>(), lnf_mean_.as<float>(), lnf_rstd_.as<float>(),
                                            x_final_.as<float>(), nf[kLnfW], nf[kLnfB], N, C, dt, lnf_16_);
    nf.release();

    // Tied head: logits = lnf wte^T. The fused cross-entropy writes the
    // gradient of the mean loss straight away; backward scales it.
    // Vocabulary parts: the part's real rows' columns, then the three-step
    // cross-entropy over the parts (Note [vocabulary parts]).
    HeldParams head = ctx.acquire(0);
    detail::linear_forward(*ops_, logits_.as<float>(), lnf_in_, head[kWte], CView{}, N, C, Vv_, dt);
    head.release();
    double loss;
    if (vocab_split()) {
      std::vector<double> maxes(static_cast<size_t>(N)), sums(static_cast<size_t>(2 * N));
      ops_->cross_entropy_part_max(logits_.as<float>(), N, Vv_, maxes.data());
      ctx.tensor_all_reduce_max_f64(maxes.data(), N);
      ops_->cross_entropy_part_sums(logits_.as<float>(), targets, N, Vv_, vlo_, maxes.data(), sums.data(),
                                    dlogits_.as<float>());
      ctx.tensor_all_reduce_f64(sums.data(), 2 * N);
      loss = ops_->cross_entropy_part_finish(targets, N, Vv_, vlo_, maxes.data(), sums.data(), dlogits_.as<float>(),
                                             1.0f);
    } else if (logit_grad16(dt)) {  // the head's backward operand only, with fp16's loss scale
      grad16_scale_ = ctx.coming_loss_scale();
      loss = ops_->cross_entropy_operand16(logits_.as<float>(), targets, N, V, dlogits_.data(), dt, grad16_scale_);
    } else {
      loss = ops_->cross_entropy(logits_.as<float>(), targets, N, V, dlogits_.as<float>(), 1.0f);
    }
    return static_cast<float>(loss);
  }

  void backward(StepContext& ctx, float loss_scale) override {
    pass_ctx_ = &ctx;
    const int64_t B = pass_.B, T = pass_.T, C = c_.n_embd, V = c_.vocab_size, N = B * T, A = A_, F = F_;
    const DType dt = ctx.compute_dtype();
    const PipelineStage& st = ctx.pipeline_stage();
    const StageRange sr = stage_range(st);
    // The embedding's block: the first stage's, and the tied head's (the
    // last stage keeps its own copy with stages; the engine sums the two).
    HeldParams emb;
    BlockGrads gemb = sr.embed || sr.head ? base_grads(ctx, 0) : BlockGrads{};
    float* dx = dres_.as<float>();  // (N,C) gradient of the residual stream
    if (sr.head) {
      // Head (tied to wte): dlnf = dlogits wte; dwte += dlogits^T lnf. The
      // gradient is fp32, or its 16-bit operand alone (logit_grad16), which
      // the forward wrote with the loss scale.
      const bool grad16 = logit_grad16(dt);
      if (grad16 && loss_scale != grad16_scale_)
        throw Error("gpt: backward's loss scale " + std::to_string(loss_scale) + " is not the " +
                    std::to_string(grad16_scale_) + " the forward wrote the 16-bit logit gradient with");
      if (!grad16 && loss_scale != 1.0f) ops_->scale(dlogits_.as<float>(), loss_scale, N * Vv_);
      emb = ctx.acquire(0);
      detail::linear_backward(*ops_, dy16_, dlnf_.as<float>(), weight_grad(gemb, kWte), nullptr,
                              grad16 ? CView{} : f32(dlogits_.as<float>()), lnf_in_, emb[kWte], N, C, Vv_, dt,
                              grad16 ? CView{dlogits_.data(), dt} : CView{});
      if (vocab_split()) tensor_sum(dlnf_.as<float>(), N * C);  // each vocabulary part's share of d lnf

      const int norm_block = static_cast<int>(c_.n_layer + 1);
      HeldParams nf = ctx.acquire(norm_block);
      BlockGrads gnf = base_grads(ctx, norm_block);
      ops_->zero(dx, N * C);
      ops_->layernorm_backward(dx, norm_grad(gnf, kLnfW), norm_grad(gnf, kLnfB), dlnf_.as<float>(),
                               x_final_.as<float>(), nf[kLnfW], lnf_mean_.as<float>(), lnf_rstd_.as<float>(), N, C);
      nf.release();
      base_grads_ready(ctx, norm_block);
    } else {  // the next stage's gradient of this stage's output
      ops_->copy_columns(dx, C, st.output_grad, C, N, C);
    }

    float* dbig = dbig_.as<float>();   // (N,F) scratch (F = 4C, a tensor part's share)
    float* dsmall = dsmall_.as<float>();  // (N,C) scratch
    for (int64_t l = sr.hi - 1; l >= sr.lo; --l) {
      LayerActs& a = acts(l);
      const float* x_in = pass_.x_in[l].as<float>();
      const int blk = static_cast<int>(l + 1);
      HeldParams p = ctx.acquire(blk);
      detail::HeldAdapter adapter = detail::hold_adapter(ctx, lora() ? lora_block(l) : -1);
      const HeldParams* lpp = adapter.get();
      const BlockGrads& lg = adapter.g;
      if (c_.gradient_checkpointing && pass_.acts_hold != l) {
        // Recompute the layer's activations from its saved input with the
        // same kernels on the same values (Note [activation checkpointing]);
        // its output, the next layer's input, is not needed again.
        layer_forward(p, a, l, x_in, nullptr, B, T, dt, lpp);
        pass_.acts_hold = l;
      }
      BlockGrads g = base_grads(ctx, blk);
      // MLP: x_out = x_mid + proj(gelu(fc(ln2(x_mid)))). dx holds d x_out and
      // becomes d x_mid by accumulating the branch's gradient. With LoRA the
      // base's input gradient is written first and the adapters' add theirs.
      CView dy_in = ops_->dy_operand(dx, bias_grad(g, kMlpProjB), N, C, dt, dy16_);
      detail::linear_backward(*ops_, dy16_, dbig, weight_grad(g, kMlpProjW), nullptr, {}, a.gelu_in, p[kMlpProjW], N,
                              F, C, dt, dy_in, g.overwrite(kMlpProjW), packed(p, l, kGptMlpProj, true));
      lora_backward(lpp, lg, a, l, kGptMlpProj, a.gelu_in, dy_in, dbig, N, dt);  // Note [LoRA after the base]
      const CView dfc =
          ops_->gelu_backward_operand(dbig, bias_grad(g, kFcB), a.fc.as<float>(), dbig, N, F, dt, dy16_);
      detail::linear_backward(*ops_, dy16_, dsmall, weight_grad(g, kFcW), nullptr, {}, a.ln2_in, p[kFcW], N, C,
                              F, dt, dfc, g.overwrite(kFcW), packed(p, l, kGptFc, true));
      lora_backward(lpp, lg, a, l, kGptFc, a.ln2_in, dfc, dsmall, N, dt);  // Note [LoRA after the base]
      tensor_sum(dsmall, N * C);  // each part's share of d ln2
      ops_->layernorm_backward(dx, norm_grad(g, kLn2W), norm_grad(g, kLn2B), dsmall, a.x_mid.as<float>(), p[kLn2W],
                               a.ln2_mean.as<float>(), a.ln2_rstd.as<float>(), N, C);
      // Attention: x_mid = x_in + proj(attn(qkv(ln1(x_in)))).
      dy_in = ops_->dy_operand(dx, bias_grad(g, kAttnProjB), N, C, dt, dy16_);
      detail::linear_backward(*ops_, dy16_, dsmall, weight_grad(g, kAttnProjW), nullptr, {}, a.att_in,
                              p[kAttnProjW], N, A, C, dt, dy_in, g.overwrite(kAttnProjW),
                              packed(p, l, kGptAttnProj, true));
      lora_backward(lpp, lg, a, l, kGptAttnProj, a.att_in, dy_in, dsmall, N, dt);  // Note [LoRA after the base]
      if (sequence_split()) {
        seq_.to_heads(*ops_, ctx, dsmall, dsmall, B, 1, A / seq_size());
        ops_->attention_backward(a.ws, dbig, dsmall, a.qkv.as<float>(), attention_shape(), dt);
        seq_.to_tokens(*ops_, ctx, dbig, dbig, B, 3, A / seq_size());
      } else {
        ops_->attention_backward(a.ws, dbig, dsmall, a.qkv.as<float>(), {B, T, A, Hh_, pass_.pos}, dt);
      }
      dy_in = ops_->dy_operand(dbig, bias_grad(g, kQkvB), N, 3 * A, dt, dy16_);
      // The first layer's input gradient feeds the embedding's alone: none
      // where it is frozen (Note [no input gradient under a frozen embedding]
      // in models/llama/model.cpp).
      const bool input_grad = l > sr.lo || !sr.embed || !specs_[0].frozen;
      float* dln1 = input_grad ? dsmall : nullptr;
      detail::linear_backward(*ops_, dy16_, dln1, weight_grad(g, kQkvW), nullptr, {}, a.ln1_in, p[kQkvW], N, C,
                              3 * A, dt, dy_in, g.overwrite(kQkvW), packed(p, l, kGptAttn, true));
      lora_backward(lpp, lg, a, l, kGptAttn, a.ln1_in, dy_in, dln1, N, dt);  // Note [LoRA after the base]
      if (input_grad) {
        tensor_sum(dsmall, N * C);  // each part's share of d ln1
        ops_->layernorm_backward(dx, norm_grad(g, kLn1W), norm_grad(g, kLn1B), dsmall, x_in, p[kLn1W],
                                 a.ln1_mean.as<float>(), a.ln1_rstd.as<float>(), N, C);
      }
      p.release();
      base_grads_ready(ctx, blk);
      if (lora()) {
        adapter.p.release();
        ctx.grads_ready(lora_block(l));
      }
    }

    if (sr.embed && !lora()) {
      if (sequence_split() || vocab_split()) {
        if (vocab_split())
          ops_->embedding_part_backward(gemb[kWte], dx, pass_.tok, N, C, vlo_, Vh_);
        else
          ops_->embedding_backward(gemb[kWte], nullptr, dx, pass_.tok, B, T, C, V, nullptr);
        ops_->embedding_backward(gemb[kWpe], nullptr, dx, pass_.pos_tok, B, T, C, c_.block_size, nullptr);
      } else {
        ops_->embedding_backward(gemb[kWte], gemb[kWpe], dx, pass_.tok, B, T, C, V, pass_.pos);
      }
    }
    if (!sr.embed) ops_->copy_columns(st.input_grad, C, dx, C, N, C);  // the previous stage's
    emb.release();
    if (sr.embed || sr.head) base_grads_ready(ctx, 0);  // the embedding's, or the tied head's copy
  }

 private:
  StageRange stage_range(const PipelineStage& st) const { return StageRange::of(st, c_.n_layer); }
  // The residual stream entering layer l (x_final_ past the last).
  float* hidden(int64_t l) { return l < c_.n_layer ? pass_.x_in[static_cast<size_t>(l)].as<float>() : x_final_.as<float>(); }

  // A partial sum summed over the tensor parts (none: nothing to do).
  void tensor_sum(float* x, int64_t n) {
    if (tp_size_ > 1) pass_ctx_->tensor_all_reduce(x, n);
  }

  // The activations layer l's backward reads: its own set, or the shared one.
  LayerActs& acts(int64_t l) { return pass_.acts[c_.gradient_checkpointing ? 0 : static_cast<size_t>(l)]; }

  // One transformer layer's forward from x_in into `a`, and, unless x_out is
  // null, its output: x_out = x_mid + proj(gelu(fc(ln2(x_mid)))) with x_mid
  // = x_in + proj(attn(qkv(ln1(x_in)))). Deterministic: the same parameters
  // and x_in give the same bits in `a` (the checkpointed backward relies on it).
  // lp: layer l's adapter block (LoRA), or null.
  void layer_forward(const HeldParams& p, LayerActs& a, int64_t l, const float* x_in, float* x_out, int64_t B,
                     int64_t T, DType dt, const HeldParams* lp = nullptr) {
    const int64_t C = c_.n_embd, N = B * T, A = A_, F = F_;
    // Tensor parts: c_proj's products are partial sums, added up over the
    // parts (their biases, whole on each, counted on part 0).
    const bool bias_here = tp_rank_ == 0;
    a.ln1_in = ops_->layernorm_forward_input(a.ln1.as<float>(), a.ln1_mean.as<float>(), a.ln1_rstd.as<float>(),
                                             x_in, p[kLn1W], p[kLn1B], N, C, dt, a.ln1_16);
    // With LoRA each projection writes its output and the adapters add
    // theirs (Note [LoRA after the base] in models/detail/lora.h).
    detail::linear_forward(*ops_, a.qkv.as<float>(), a.ln1_in, p[kQkvW], p[kQkvB], N, C, 3 * A, dt,
                           packed(p, l, kGptAttn, false));
    lora_forward(lp, a, l, kGptAttn, a.ln1_in, a.qkv.as<float>(), N, dt);
    if (sequence_split()) {
      // Ulysses: whole rows of this rank's heads in, the output back to
      // this rank's tokens (a.qkv keeps the whole rows for backward).
      seq_.to_heads(*ops_, *pass_ctx_, a.qkv.as<float>(), a.qkv.as<float>(), B, 3, A / seq_size());
      ops_->attention_forward(a.ws, a.att.as<float>(), a.qkv.as<float>(), attention_shape(), dt);
      seq_.to_tokens(*ops_, *pass_ctx_, a.att.as<float>(), a.att.as<float>(), B, 1, A / seq_size());
      a.att_in = ops_->matmul_input(a.att.as<float>(), N * A, dt, a.att_16);
    } else {
      a.att_in = ops_->attention_forward_input(a.ws, a.att.as<float>(), a.qkv.as<float>(), {B, T, A, Hh_, pass_.pos},
                                               dt, a.att_16);
    }
    detail::linear_forward(*ops_, a.x_mid.as<float>(), a.att_in, p[kAttnProjW], bias_here ? p[kAttnProjB] : CView{}, N,
                           A, C, dt, packed(p, l, kGptAttnProj, false));
    lora_forward(lp, a, l, kGptAttnProj, a.att_in, a.x_mid.as<float>(), N, dt);
    tensor_sum(a.x_mid.as<float>(), N * C);
    // The residual and ln_2 in one pass on the GPU (Ops::add_layernorm_forward_input).
    a.ln2_in = ops_->add_layernorm_forward_input(a.ln2.as<float>(), a.ln2_mean.as<float>(), a.ln2_rstd.as<float>(),
                                                 a.x_mid.as<float>(), x_in, p[kLn2W], p[kLn2B], N, C, dt, a.ln2_16);
    detail::linear_forward(*ops_, a.fc.as<float>(), a.ln2_in, p[kFcW], p[kFcB], N, C, F, dt,
                           packed(p, l, kGptFc, false));
    lora_forward(lp, a, l, kGptFc, a.ln2_in, a.fc.as<float>(), N, dt);
    a.gelu_in = ops_->gelu_forward_input(a.gelu.as<float>(), a.fc.as<float>(), N * F, dt, a.gelu_16);
    if (!x_out) {
      // A recomputation for backward: the output is not needed, but the MLP
      // projection's LoRA U is (B's gradient reads it); its product goes to
      // scratch (dsmall_, free until the layer's backward writes it).
      lora_forward(lp, a, l, kGptMlpProj, a.gelu_in, dsmall_.as<float>(), N, dt);
      return;
    }
    detail::linear_forward(*ops_, x_out, a.gelu_in, p[kMlpProjW], bias_here ? p[kMlpProjB] : CView{}, N, F, C, dt,
                           packed(p, l, kGptMlpProj, false));
    lora_forward(lp, a, l, kGptMlpProj, a.gelu_in, x_out, N, dt);
    tensor_sum(x_out, N * C);
    ops_->add(x_out, x_out, a.x_mid.as<float>(), N * C);
  }

  // ---- LoRA (LoraConfig; models/detail/lora.h) -----------------------------------
  bool lora() const { return c_.lora.enabled(); }
  detail::LoraDropout lora_drop(int64_t l, int64_t g) const {
    kernels::DropoutColumns cols;  // c_proj's input on a tensor part: its columns of the whole's mask
    if (tp_size_ > 1 && (g == kGptAttnProj || g == kGptMlpProj)) {
      const int64_t in = lora_groups_[static_cast<size_t>(l)][static_cast<size_t>(g)].in;
      cols = {in, in * tp_size_, in * tp_rank_};
    }
    return detail::LoraDropout::of(c_.lora.dropout, pass_.lora_seed, l, g, cols);
  }
  int lora_block(int64_t l) const { return static_cast<int>(c_.n_layer + 2 + l); }
  // A base weight's (or bias's) gradient: null when frozen (linear_backward
  // then skips its weight-gradient matmul); a norm's goes to a sink.
  float* bias_grad(const BlockGrads& g, int i) const { return lora() ? nullptr : g[i]; }
  float* weight_grad(const BlockGrads& g, int i) const { return bias_grad(g, i); }
  float* norm_grad(const BlockGrads& g, int i) { return lora() ? sink_.as<float>() + (i & 1) * c_.n_embd : g[i]; }
  BlockGrads base_grads(StepContext& ctx, int blk) { return lora() ? BlockGrads{} : ctx.grads(blk); }
  void base_grads_ready(StepContext& ctx, int blk) {
    if (!lora()) ctx.grads_ready(blk);
  }
  // Target t's input width and output rows: its whole weight's, or on one
  // of `parts` tensor parts the part's (Note [LoRA over tensor parts]).
  std::pair<int64_t, int64_t> lora_shape(int t, int parts = 1) const {
    const int64_t C = c_.n_embd;
    switch (t) {
      case kGptAttn: return {C, 3 * C / parts};
      case kGptAttnProj: return {C / parts, C};
      case kGptFc: return {C, 4 * C / parts};
      default: return {4 * C / parts, C};
    }
  }
  // One adapter block per layer, after ln_f, with PEFT's names and
  // initialisation (A Kaiming-uniform, B zeros); each target is a group of
  // its own (GPT-2 fuses nothing PEFT names apart).
  void add_lora_blocks() {
    const int64_t r = c_.lora.r;
    for (int64_t l = 0; l < c_.n_layer; ++l) {
      BlockSpec b{"h." + std::to_string(l) + ".lora", {}};
      for (int t = 0; t < kGptLoraTargets; ++t) {
        if (!c_.lora.targets_module(kGptLoraModules[t])) continue;
        const auto [in, out] = lora_shape(t);
        const std::string path = kGptLoraPaths[t];
        b.params.push_back({path + ".lora_A.weight", {r, in}, Init::kUniform,
                            static_cast<float>(1.0 / std::sqrt(static_cast<double>(in)))});
        b.params.push_back({path + ".lora_B.weight", {out, r}, Init::kZeros});
      }
      specs_.push_back(std::move(b));
    }
    lora_groups_ = lora_groups(1);
  }
  // Every layer's groups on one of `parts` tensor parts: each target's A
  // and B in the order add_lora_blocks placed them.
  std::vector<std::array<detail::LoraGroup, kGptLoraTargets>> lora_groups(int parts) const {
    std::vector<std::array<detail::LoraGroup, kGptLoraTargets>> all(static_cast<size_t>(c_.n_layer));
    for (auto& groups : all) {
      int next = 0;
      for (int t = 0; t < kGptLoraTargets; ++t) {
        const auto [in, out] = lora_shape(t, parts);
        detail::LoraGroup& g = groups[static_cast<size_t>(t)];
        g.in = in;
        g.width = out;
        if (!c_.lora.targets_module(kGptLoraModules[t])) continue;
        g.members.push_back({next, next + 1, 0, out});
        next += 2;
      }
    }
    return all;
  }
  // Where layer l's weight of target t stays packed for its forward (grad
  // false) or its input gradient (grad true): the frozen base under LoRA,
  // held in place by the engine (Note [packed frozen weights] in
  // kernels/matmul.cpp). Empty otherwise.
  detail::PackedSlot packed(const HeldParams& p, int64_t l, int t, bool grad) {
    return packed_.at(p.params().generation, c_.lora.pack_base, c_.n_layer, kGptLoraTargets, l, t, grad);
  }
  bool lora_forward(const HeldParams* lp, LayerActs& a, int64_t l, int t, CView x, float* dst, int64_t N, DType dt) {
    if (!lp) return false;
    float* u = a.lora_u.as<float>() + t * N * c_.lora.r;
    return detail::lora_forward(*ops_, lora_scratch_, *lp, lora_groups_[static_cast<size_t>(l)][static_cast<size_t>(t)],
                                c_.lora.r, c_.lora.scale(), x, dst, N, dt, u, a.lora_saved[t], lora_drop(l, t));
  }
  bool lora_backward(const HeldParams* lp, const BlockGrads& lg, LayerActs& a, int64_t l, int t, CView x, CView dy_in,
                     float* dx, int64_t N, DType dt) {
    if (!lp) return false;
    return detail::lora_backward(*ops_, lora_scratch_, *lp, lg,
                                 lora_groups_[static_cast<size_t>(l)][static_cast<size_t>(t)], c_.lora.r,
                                 c_.lora.scale(), x, a.lora_saved[t], dy_in, dx, N, dt, lora_drop(l, t));
  }

  // fused: the Ops writes ln1, ln2, gelu and lnf as bf16 operands only
  // (Ops::fuses_operand16), so their fp32 buffers stay empty.
  // A pipeline stage holds its own layers' activations only.
  // drop_att: attention writes the projection's operand only
  // (Ops::fuses_every_operand16, without sequence ranks), so a.att stays empty.
  // grad16: the logit gradient is its 16-bit operand only (logit_grad16).
  void ensure_buffers(int64_t B, int64_t T, bool fused, bool drop_att, bool grad16, const StageRange& sr) {
    const int dropped = (drop_att ? kDropAtt : 0) | (grad16 ? kLogitGrad16 : 0);
    if (B == pass_.B && T == pass_.T && fused == pass_.fused && dropped == pass_.dropped && sr == pass_.alloc) return;
    const size_t N = static_cast<size_t>(B * T), C = static_cast<size_t>(c_.n_embd);
    const size_t A = static_cast<size_t>(A_), F = static_cast<size_t>(F_);
    for (int64_t l = 0; l < c_.n_layer; ++l)
      pass_.x_in[static_cast<size_t>(l)] = l >= sr.lo && l <= sr.hi ? ops_->alloc_f32(N * C) : Buf{};
    for (size_t i = 0; i < pass_.acts.size(); ++i) {
      LayerActs& a = pass_.acts[i];
      const bool used = c_.gradient_checkpointing ? sr.hi > sr.lo
                                                  : static_cast<int64_t>(i) >= sr.lo && static_cast<int64_t>(i) < sr.hi;
      if (!used) {
        void* ws = a.ws;
        a = LayerActs{};
        a.ws = ws;
        continue;
      }
      a.ln1 = fused ? Buf() : ops_->alloc_f32(N * C);
      a.ln1_mean = ops_->alloc_f32(N);
      a.ln1_rstd = ops_->alloc_f32(N);
      a.qkv = ops_->alloc_f32(N * 3 * A);
      a.att = drop_att ? Buf() : ops_->alloc_f32(N * A);
      a.x_mid = ops_->alloc_f32(N * C);
      a.ln2 = fused ? Buf() : ops_->alloc_f32(N * C);
      a.ln2_mean = ops_->alloc_f32(N);
      a.ln2_rstd = ops_->alloc_f32(N);
      a.fc = ops_->alloc_f32(N * F);
      a.gelu = fused ? Buf() : ops_->alloc_f32(N * F);
    }
    x_final_ = ops_->alloc_f32(N * C);
    lnf_ = fused ? Buf() : ops_->alloc_f32(N * C);
    lnf_mean_ = ops_->alloc_f32(N);
    lnf_rstd_ = ops_->alloc_f32(N);
    logits_ = sr.head ? ops_->alloc_f32(N * static_cast<size_t>(Vh_)) : Buf{};
    dlogits_ = !sr.head ? Buf{}
               : grad16 ? ops_->alloc(N * static_cast<size_t>(Vh_) * 2)
                        : ops_->alloc_f32(N * static_cast<size_t>(Vh_));
    dlnf_ = ops_->alloc_f32(N * C);
    dres_ = ops_->alloc_f32(N * C);
    dsmall_ = ops_->alloc_f32(N * C);
    dbig_ = ops_->alloc_f32(N * F);
    if (lora()) {
      const size_t r = static_cast<size_t>(c_.lora.r);
      for (LayerActs& a : pass_.acts)
        if (a.ln1_mean.bytes() > 0) a.lora_u = ops_->alloc_f32(N * kGptLoraTargets * r);  // not another stage's layer
      lora_scratch_.ensure(*ops_, static_cast<int64_t>(N), c_.lora.r, detail::lora_all_groups(lora_groups_),
                           c_.lora.dropout > 0);
      sink_ = ops_->alloc_f32(2 * C);
    }
    pass_.B = B;
    pass_.T = T;
    pass_.fused = fused;
    pass_.dropped = dropped;
    pass_.alloc = sr;
  }


  // Sequence ranks (Note [sequence parallelism] in engine/sequence_parallel.cpp).
  bool sequence_split() const { return pass_ctx_ && pass_ctx_->sequence_split().split(); }
  int64_t seq_size() const { return pass_ctx_->sequence_split().size; }
  // Whole rows of this rank's heads.
  kernels::AttentionShape attention_shape() const {
    return {pass_.B, whole_T_, A_ / seq_size(), Hh_ / seq_size(), whole_pos_};
  }
  void ensure_wpe_rows(int64_t N) {
    if (wpe_rows_.bytes() < static_cast<size_t>(N * c_.n_embd) * sizeof(float))
      wpe_rows_ = ops_->alloc_f32(static_cast<size_t>(N * c_.n_embd));
  }

  GptConfig c_;
  detail::Ops* ops_;  // the device's kernels (models/detail/ops.h)
  // Sequence ranks: the whole rows' length and positions of the forward
  // under way, the position embeddings' rows, the exchanges' buffers.
  int64_t whole_T_ = 0;
  std::vector<int32_t> whole_positions_;
  Buf whole_pos_store_;
  const int32_t* whole_pos_ = nullptr;
  Buf wpe_rows_;
  detail::SequenceExchange seq_;
  std::vector<BlockSpec> specs_;
  // Tensor parts (use_tensor_part): this part's attention width, heads and
  // MLP width (the whole model's: C, n_head, 4C), the whole model's blocks
  // (blocks() describes them), and the pass's context.
  int64_t A_ = 0, Hh_ = 0, F_ = 0;
  int tp_rank_ = 0, tp_size_ = 1;
  // Vocabulary parts (Note [vocabulary parts] in engine/tensor_parallel.cpp):
  // the rows of wte this part holds from vlo_, of them the real ones (the
  // last part's past V are padding); V, 0, V without parts.
  int64_t Vh_ = 0, vlo_ = 0, Vv_ = 0;
  bool vocab_split() const { return Vh_ < c_.vocab_size; }
  // Whether the cross-entropy writes the logit gradient as the head's 16-bit
  // backward operand only (Ops::cross_entropy_operand16): where the Ops
  // writes every 16-bit operand itself, over the whole vocabulary. In fp16
  // the forward folds in the loss scale its backward will be given
  // (StepContext::coming_loss_scale), kept in grad16_scale_.
  bool logit_grad16(DType dt) const { return ops_->fuses_every_operand16(dt) && !vocab_split(); }
  float grad16_scale_ = 1.0f;
  // PassState::dropped's flags.
  static constexpr int kDropAtt = 1, kLogitGrad16 = 2;
  std::vector<BlockSpec> whole_;
  StepContext* pass_ctx_ = nullptr;
  Buf targets_store_;
  // What the forward leaves for its backward (the selected activation set) and
  // the other sets of a pipeline stage's micro-batches in flight.
  using Pass = detail::PassState<LayerActs, StageRange>;
  Pass pass_;
  detail::PassSlots<Pass> slots_;
  Buf x_final_, lnf_, lnf_mean_, lnf_rstd_, logits_, dlogits_;
  Buf dlnf_, dres_, dsmall_, dbig_;
  Buf dy16_;  // linear_backward's 16-bit copy of dy
  // LoRA: each layer's groups (one target each), their shared scratch, and
  // the frozen norms' weight and bias gradients (a sink of two halves).
  std::vector<std::array<detail::LoraGroup, kGptLoraTargets>> lora_groups_;
  detail::LoraScratch lora_scratch_;
  // Note [packed frozen weights] (kernels/matmul.cpp): each layer's four
  // weights packed for their forward and their input gradient (packed()).
  detail::PackedSlots packed_;
  Buf sink_;
  CView lnf_in_;          // what the head's matmuls read of lnf_ (see LayerActs)
  Buf lnf_16_;
};

}  // namespace

std::optional<SizeError> size_error(const GptConfig& c) {
  if (c.vocab_size < 2) return SizeError{"vocab_size", "must be >= 2, got " + std::to_string(c.vocab_size)};
  for (auto [field, v] : {std::pair<const char*, int64_t>{"n_layer", c.n_layer},
                          {"n_head", c.n_head},
                          {"n_embd", c.n_embd},
                          {"block_size", c.block_size}}) {
    if (v < 1) return SizeError{field, "must be >= 1, got " + std::to_string(v)};
  }
  if (const std::string why = layers_refusal(c.n_layer); !why.empty()) return SizeError{"n_layer", why};
  // Attention splits the embedding evenly across the heads.
  if (c.n_embd % c.n_head != 0) {
    return SizeError{"n_embd", "must be divisible by n_head " + std::to_string(c.n_head) + ", got " +
                                   std::to_string(c.n_embd)};
  }
  if (c.lora.r < 0) return SizeError{"lora.r", "must be >= 1, got " + std::to_string(c.lora.r)};
  if (c.lora.enabled()) {
    if (c.lora.targets.empty()) return SizeError{"lora.target_modules", "names no module to adapt"};
    for (const std::string& t : c.lora.targets)
      if (t != "c_attn" && t != "c_proj" && t != "c_fc")
        return SizeError{"lora.target_modules",
                         "\"" + t + "\" is not a linear layer of GPT-2 (c_attn, c_proj, c_fc, or \"all-linear\")"};
    if (!c.lora.modules_to_save.empty())
      return SizeError{"lora.modules_to_save", "GPT-2's head is its embedding (wte): training it beside the "
                                               "adapters is not implemented (PEFT unties them)"};
  }
  return std::nullopt;
}

std::shared_ptr<Model> make_gpt(const GptConfig& cfg) { return std::make_shared<Gpt>(cfg); }

}  // namespace zinc::models
