// zinc kernels: the numeric building blocks of the built-in models, on the CPU.
//
// Conventions (every function):
// - Activations and gradients are fp32, row-major and contiguous. Shapes are
//   given in the comments as (B,T,C) etc.
// - Parameters arrive as a CView: a pointer plus its dtype (fp32, bf16 or
//   fp16), because with bf16 (fp16) on the model's weights are bf16 (fp16). Parameter gradients are
//   always fp32 and are ACCUMULATED (+=) into, so that gradient accumulation
//   over micro-batches needs no extra buffer. Activation gradients are written
//   (=) unless the function says otherwise.
// - Threaded with OpenMP (the same pool as oneDNN); results do not depend on
//   the thread count, except for matmul, whose blocking oneDNN chooses.
// - Every kernel has a plain scalar reference in kernels/reference.h, used as
//   the test oracle.
// Thread-safety: functions may be called from one thread at a time per
// output buffer; matmul keeps a primitive cache guarded by a mutex.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "core/alloc.h"
#include "core/dtype.h"
#include "core/error.h"

namespace zinc::kernels {

struct CView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  // fp32 data whose values are all representable in the matmul's 16-bit
  // compute format (bf16, or fp16 with fp16 compute; see bf16_operand and
  // operand16): a 16-bit matmul need not round them again.
  bool bf16_exact = false;
  float at(int64_t i) const {
    return dtype == DType::kF32 ? static_cast<const float*>(data)[i]
                                : from_16(static_cast<const uint16_t*>(data)[i], dtype);
  }
};

// ---- matmul (oneDNN) --------------------------------------------------------
// C[b](M,N) = alpha * op(A[b])(M,K) * op(B[b])(K,N)  (+ C[b] if accumulate)
// for b in [0, batch), batches contiguous (A: M*K apart, B: K*N, C: M*N).
// op(A) = A stored (M,K), or A stored (K,M) when trans_a. Same for B:
// (K,N), or stored (N,K) when trans_b.
// compute: kF32 multiplies in fp32; kBF16 multiplies bf16 values with fp32
// accumulation; kF16 multiplies fp16 values with fp32 accumulation (always
// through the fp32 primitive: Note [fp16 compute] in matmul.cpp). An operand whose dtype differs from `compute` is converted
// into scratch first (so a model can pass fp32 activations with bf16 weights).
// Where oneDNN has no native bf16 kernel for a shape (CPUs without AVX-512),
// kBF16 runs the fp32 primitive on the bf16 values widened to fp32: the same
// products, the same fp32 accumulation (Note [bf16 matmul without native
// bf16] in matmul.cpp).
// bias: C[b] += bias(N) broadcast over rows, fused into the matmul (one pass
// over C instead of two); needs alpha == 1 and a bias view at the call.
// lda, ldb, ldc (batch 1 only; 0: dense): the stored rows' stride in
// elements, for an operand or a result that is a column block of a wider
// matrix (LoRA's targets inside a fused q|k|v: Note [LoRA by groups]). A
// strided operand that must be converted is gathered densely first. On the
// GPU (kernels::cuda::matmul) cuBLAS's leading dimensions, a converted
// operand keeping its strides.
struct MatmulDesc {
  int64_t batch = 1, M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  bool accumulate = false;
  bool bias = false;
  float alpha = 1.0f;
  DType compute = DType::kF32;
  int64_t lda = 0, ldb = 0, ldc = 0;
};
void matmul(const MatmulDesc& d, CView a, CView b, float* c, CView bias = {});

// What matmul runs for a descriptor: the dtype oneDNN multiplies in (kF32 for
// the bf16 fallback), oneDNN's implementation name (e.g. "brg:avx2") and, for
// the fallback, why. Creates and caches the primitive.
struct MatmulPath {
  DType multiply = DType::kF32;
  std::string impl;
  std::string why;
};
MatmulPath matmul_path(const MatmulDesc& d);
// One line for headers: "matmul fp32: oneDNN brg:avx2 | matmul bf16: via fp32
// (oneDNN brg:avx2), no native bf16 on this CPU".
std::string matmul_paths_summary();

// A matmul's B operand kept in the layout its primitive reads (oneDNN's
// blocked format, in the dtype it multiplies), for a weight that stays the
// same from call to call: Note [packed frozen weights] in matmul.cpp.
// Empty until matmul_packed fills it; movable, not copyable.
class PackedWeight {
 public:
  PackedWeight();
  ~PackedWeight();
  PackedWeight(PackedWeight&&) noexcept;
  PackedWeight& operator=(PackedWeight&&) noexcept;
  bool empty() const { return impl_ == nullptr; }
  // Bytes of the packed copy (0 when empty).
  int64_t bytes() const;
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  friend void matmul_packed(const MatmulDesc&, CView, CView, uint64_t, PackedWeight&, float*, CView);
};
// matmul(d, a, b, c, bias) with b read from `slot`, which keeps b packed
// from one call to the next: b is packed into it where the slot is empty or
// holds another weight (address), another `generation` or another layout,
// and reused otherwise. generation 0 (a weight that may change between
// calls) and a B that cannot be packed (batch > 1, strided) run the plain
// matmul and leave the slot as it is. The same sums as matmul's: bit for
// bit where oneDNN runs the same kernel on both layouts (the last bits may
// differ where it picks another, as at some small strided shapes).
void matmul_packed(const MatmulDesc& d, CView a, CView b, uint64_t generation, PackedWeight& slot, float* c,
                   CView bias = {});
// The bytes matmul_packed keeps in a slot for d's B (0: not packed).
int64_t packed_weight_bytes(const MatmulDesc& d);
// An fp32 operand converted ONCE for several bf16 matmuls (a layer's input
// feeds its forward and its weight-gradient matmul; dY feeds the input- and
// the weight-gradient matmul), instead of once in every matmul. Where oneDNN
// multiplies bf16 natively the values are converted into `scratch` as bf16;
// where it falls back to fp32 they are rounded to bf16 precision, into
// `scratch` (bf16_operand_copy) or in place (bf16_operand_in_place, for an
// activation that only matmuls read), and marked bf16_exact. Either way every
// matmul sees exactly the values it would have converted itself. `scratch`
// grows as needed and must outlive the returned view.
CView bf16_operand_copy(const float* x, int64_t n, AlignedBuffer& scratch);
CView bf16_operand_in_place(float* x, int64_t n, AlignedBuffer& scratch);
// Whether bf16 operands are converted to bf16 (true: the CPU multiplies
// bf16 natively) or rounded in fp32 (false: the fallback), as the two
// functions above decide.
bool bf16_operands_native();
// `scratch` grown to hold n bf16 values (grow_scratch): where the fused
// kernels write a bf16 operand themselves.
bf16* bf16_scratch(AlignedBuffer& scratch, int64_t n);
// The same for either 16-bit compute dtype: bf16 as above; fp16 rounds to
// fp16 precision in fp32 (Note [fp16 compute] in matmul.cpp).
CView operand16_copy(const float* x, int64_t n, DType compute, AlignedBuffer& scratch);
CView operand16_in_place(float* x, int64_t n, DType compute, AlignedBuffer& scratch);

// Tests: kViaF32 makes every bf16 matmul created from now on take the fp32
// fallback, also where oneDNN has native bf16 kernels.
enum class MatmulBf16Path { kAuto = 0, kViaF32 = 1 };
void set_matmul_bf16_path_for_testing(MatmulBf16Path path);

// y(M,N) += bias(N) broadcast over rows.
void add_bias(float* y, CView bias, int64_t M, int64_t N);
// dbias(N) += sum over rows of dy(M,N).
void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N);
// bias_backward (the same bits) and dy16 = dy as bf16 in one pass over dy.
void bias_backward_bf16(float* dbias, bf16* dy16, const float* dy, int64_t M, int64_t N);

// ---- layernorm over the last dim ---------------------------------------------
// out(N,C) = (x - mean) * rstd * w + b; saves mean(N), rstd(N) for backward.
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b,
                       int64_t N, int64_t C, float eps = 1e-5f);
// dx(N,C) += ..., dw(C) += ..., db(C) += ...
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, CView w,
                        const float* mean, const float* rstd, int64_t N, int64_t C);
// layernorm_forward's out written as bf16 only (the operand a native bf16
// matmul reads), without the fp32 pass: each row is normalised in a
// thread's scratch and converted from there. Same bits as
// convert_f32_to_bf16 of layernorm_forward's out; mean and rstd as there.
void layernorm_forward_bf16(bf16* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                            int64_t C, float eps = 1e-5f);

// ---- GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) --------
void gelu_forward(float* out, const float* x, int64_t n);
// dx = dout * gelu'(x)   (written, not accumulated)
void gelu_backward(float* dx, const float* x, const float* dout, int64_t n);
// gelu_forward written as bf16 only (a native bf16 matmul's operand), in
// one pass: the same bits as convert_f32_to_bf16 of gelu_forward's out.
void gelu_forward_bf16(bf16* out, const float* x, int64_t n);
// gelu_backward's dx(M,N) written as bf16 only (dx16), with dbias(N) +=
// the column sums of the fp32 dx in bias_backward's order and bits, in one
// pass over x and dout.
void gelu_backward_bias_bf16(float* dbias, bf16* dx16, const float* x, const float* dout, int64_t M, int64_t N);

// ---- GELU, exact form: x Phi(x) with erf (math::gelu_erf; GPT-NeoX's "gelu") ----------
void gelu_erf_forward(float* out, const float* x, int64_t n);
// dx = dout * gelu_erf'(x)   (written, not accumulated)
void gelu_erf_backward(float* dx, const float* x, const float* dout, int64_t n);

// ---- causal multi-head self-attention ------------------------------------------
// qkv(B,T,3C) holds q, k, v side by side in the last dim, each C = H*hs wide
// (head h uses columns h*hs..h*hs+hs-1 of its part). out(B,T,C) is the
// attention output before the output projection. softmax(q k^T / sqrt(hs))
// with a causal mask. The workspace keeps what backward needs; it must live
// from forward to backward and may be reused across layers only if each layer
// has its own.
// Packed documents (Note [document boundaries] in attention.cpp): with
// `positions` (B*T, each row 0,1,.. restarting at 0 where a document
// begins; the first of a row is 0), query t attends only to keys
// t - positions[t] .. t, its own document: a block-diagonal causal mask.
// nullptr: one document per row. Backward must get the same positions.
class AttentionWorkspace;
struct AttentionShape {
  int64_t B = 0, T = 0, C = 0, H = 0;
  const int32_t* positions = nullptr;  // (B*T) or nullptr; device memory for the CUDA twins
  // Sliding-window attention (Mistral's sliding_window): query t sees at
  // most the `window` keys t - window + 1 .. t (0: no window).
  int64_t window = 0;
  // The score scale (Granite's attention_multiplier); 0: 1/sqrt(head size).
  float scale = 0.0f;
  float score_scale() const { return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(C / H)); }
  // Gemma 2's attn_logit_softcapping: the scaled scores become
  // softcap tanh(score / softcap) before the mask and the softmax (0: none).
  // Backward recomputes the scores (one more Q K^T product per head).
  float softcap = 0.0f;
  // Grouped-query heads read in place: each row of qkv (and dqkv) is q (H
  // heads) | k (kv_heads heads) | v (kv_heads heads), C / H wide each
  // (0: kv_heads = H, the (B,T,3C) layout). Only the GPU's fused attention
  // reads other values (Ops::attention_reads_kv_heads); the others refuse them.
  int64_t kv_heads = 0;
  int64_t kv() const { return kv_heads > 0 ? kv_heads : H; }
};
AttentionWorkspace* attention_workspace_create();
void attention_workspace_destroy(AttentionWorkspace* ws);
void attention_forward(AttentionWorkspace* ws, float* out, const float* qkv, AttentionShape s,
                       DType compute);
// dqkv(B,T,3C) is written.
void attention_backward(AttentionWorkspace* ws, float* dqkv, const float* dout, const float* qkv,
                        AttentionShape s, DType compute);

// Bytes of one workspace (the softmax probabilities backward reads).
int64_t attention_workspace_bytes(AttentionShape s);

// The cuBLAS workspace a stream that runs the GPU's matmuls holds
// (kernels::cuda in matmul.cu): 32 MiB on Hopper and later, 4 MiB before.
// The memory estimate counts the larger.
inline constexpr int64_t kCudaMatmulWorkspaceBytes = int64_t{32} << 20;
// Heads per group in attention (Note [attention by head groups]); 0 (the
// default) chooses by the cache. The result is the same bits at any value.
void set_attention_heads_per_group_for_testing(int64_t g);

// ---- mixture of experts (moe.cpp; Note [expert routing order]) ---------------------------
// The router over N tokens and E experts: probs(N,E) = softmax(logits),
// expert(N,k) the top k of each token (descending; ties: the lower index),
// weight(N,k) their probabilities, renormalised to sum 1 with renormalize
// (Mixtral always; Qwen3-MoE with norm_topk_prob).
void moe_route(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs, int32_t* expert,
               float* weight);
// dlogits(N,E) (written) from dweight(N,k) and, if not null, dprobs(E):
// d loss / d probs(t, e) for every token t (the auxiliary load-balancing
// loss's gradient depends on the expert alone).
void moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* dweight,
                        const float* dprobs, int64_t N, int64_t E, int64_t k, bool renormalize, float* dlogits);
// The N*k (token, slot) pairs grouped by expert, tokens in order within
// each (host memory, on any backend: the experts' GEMM sizes are the
// host's to launch): offsets(E+1) the first row of each expert's group,
// token_of_row(N*k) the token of each grouped row, row_of_slot(N*k) the
// grouped row of (token, slot). Throws naming a token whose expert is out
// of range.
void moe_group(const int32_t* expert, int64_t N, int64_t k, int64_t E, int64_t* offsets, int32_t* token_of_row,
               int32_t* row_of_slot);
// xg(M,C) row r = x(token_of_row[r]).
void moe_gather(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C);
// out(N,C) = sum over slots s of weight(t,s) y(row_of_slot(t,s)) (written).
void moe_combine(float* out, const float* y, const float* weight, const int32_t* row_of_slot, int64_t N, int64_t k,
                 int64_t C);
// Its backward: dy(row_of_slot(t,s)) = weight(t,s) dout(t) (written, every
// grouped row once); dweight(t,s) = dout(t) . y(row_of_slot(t,s)).
void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const float* weight,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C);
// moe_gather's backward: dx(t) += the sum over its slots of dxg(row_of_slot(t,s)).
void moe_gather_backward(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C);

// ---- memory estimates ------------------------------------------------------------
// The kernels keep grow-only thread-local scratch (converted matmul operands,
// oneDNN scratchpads, attention's head-major copies): after a training pass
// each slot holds the largest size any call asked of it. A tally replays a
// pass's kernel calls by shape alone, with the sizing rules the kernels
// themselves use (and, for matmuls, oneDNN's own answer for the primitive and
// its scratchpad), to say how many bytes that scratch will hold. Used by
// models' Model::activation_memory. Not thread-safe.
class ScratchTally {
 public:
  // A matmul whose operands have these dtypes (exact: fp32 values marked
  // bf16_exact) and, with d.bias, a bias of bias_dtype.
  void matmul(const MatmulDesc& d, DType a, bool a_exact, DType b, bool b_exact, DType bias_dtype = DType::kF32);
  // The same product through matmul_packed (B packed: no B converted per
  // call, the packed primitive's scratchpad); a B that cannot be packed
  // (of dtype b) as matmul.
  void matmul_packed(const MatmulDesc& d, DType a, bool a_exact, DType b, DType bias_dtype = DType::kF32);
  // attention_forward and attention_backward of one shape (their matmuls included).
  void attention(AttentionShape s, DType compute);
  // bf16_operand_copy / bf16_operand_in_place of n elements into a scratch
  // buffer of its own (returns its bytes; 0 when nothing is copied).
  static int64_t bf16_operand_bytes(int64_t n, bool in_place);
  // operand16_copy / operand16_in_place of n elements for `compute`.
  static int64_t operand16_bytes(int64_t n, bool in_place, DType compute);
  int64_t bytes() const;
  static constexpr int kAttentionSlots = 12;  // attention.cpp's scratch slots

 private:
  int64_t matmul_[4] = {};
  int64_t attention_[kAttentionSlots] = {};
  int64_t other_threads_ = 0;  // what threads other than the caller keep
};

// ---- Llama-family layers (llama_layers.cpp) ----------------------------------------
// RMSNorm over the last dim: out(N,C) = (w_offset + w) * (x * rstd), rstd(N)
// = 1 / sqrt(mean(x^2) + eps) saved for backward (kernels/math.h). w_offset
// is 0 for the Llama's norm, 1 for Gemma's (transformers' GemmaRMSNorm
// scales by 1 + w, formed in fp32).
void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps,
                     float w_offset = 0.0f);
// dx(N,C) += ..., dw(C) += ... (d(w_offset + w) = dw).
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd,
                      int64_t N, int64_t C, float w_offset = 0.0f);

// SiLU-gated MLP activation on an (N, 2I) buffer whose rows are [gate | up]:
// out(N,I) = silu(gate) * up.
void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I);
// d gate_up(N, 2I) = [d gate | d up] (written).
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I);
// The same with GELU (the tanh form) for SiLU: Gemma's GeGLU,
// out = gelu(gate) * up.
void geglu_forward(float* out, const float* gate_up, int64_t N, int64_t I);
void geglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I);

// Soft-capping in place (Gemma 2's final logits): x = cap tanh(x / cap).
void softcap_forward(float* x, float cap, int64_t n);
// Its backward from the capped values y: dx *= 1 - (y / cap)^2.
void softcap_backward(float* dx, const float* y, float cap, int64_t n);

// Rotary position embedding, in place, on x(B,T,W) whose rows hold `heads`
// heads of head_dim (even) values starting at column `col` (the q or the k
// part of a fused row: W >= col + heads * head_dim). cos, sin: (T, head_dim/2),
// the angle of frequency i at position t (the model builds them, with its
// rope scaling). Backward (inverse = true) rotates by the negated angle,
// which maps d out to d x.
// With `positions` (B*T; nullptr: row b's token t is at position t) the
// token at (b,t) is rotated by the angle of positions[b*T+t] (< T).
// Partial rotary embeddings (Phi-3's partial_rotary_factor, GPT-NeoX's
// rotary_pct): only the first rotary_dim (even) values of each head rotate,
// pairing i with i + rotary_dim/2; the tables are then (T, rotary_dim/2).
struct RopeShape {
  int64_t B = 0, T = 0, W = 0, col = 0, heads = 0, head_dim = 0;
  const int32_t* positions = nullptr;
  int64_t rotary_dim = 0;  // 0: head_dim
  // The rows of cos and sin, which bound the positions (0: T; a sequence
  // rank's slice of longer rows has positions past its own T).
  int64_t table_rows = 0;
  int64_t rotated() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  int64_t rows() const { return table_rows > 0 ? table_rows : T; }
};
void rope(float* x, const float* cos, const float* sin, RopeShape s, bool inverse);

// Grouped-query attention through the multi-head kernel: from a fused
// projection row [q (H hd) | k (Hkv hd) | v (Hkv hd)] (N rows) builds the
// attention kernel's row [q | k | v], each H hd wide, repeating kv head j for
// heads j g .. j g + g - 1 (g = H / Hkv), as transformers' repeat_kv.
void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd);
// The transposed map: d q_kv(N, (H + 2 Hkv) hd) from d qkv(N, 3 H hd), the
// g heads of a group summed in head order (written).
void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd);

// ---- softmax cross-entropy over the vocabulary -----------------------------------
// A target of kIgnoreTarget (transformers' ignore_index) is not a target:
// its row adds nothing to the loss and its dlogits row is zero.
constexpr int32_t kIgnoreTarget = -100;
// logits(N,V), targets(N) in [0,V) or kIgnoreTarget. Returns the mean loss
// over the rows with a target (0 when there are none). If dlogits is not
// null, writes dlogits(N,V) = (softmax - onehot) * dloss_scale / N for the
// rows with a target, 0 for the others: the gradient of dloss_scale * (the
// sum of the targets' losses) / N, which is dloss_scale * mean loss when
// every row has a target (the engine divides by the count of targets over
// the global batch at the step). dlogits may alias logits.
// Any other target outside [0,V) throws zinc::Error naming the row.
double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V,
                     float* dlogits, float dloss_scale);

// ---- embeddings ----------------------------------------------------------------
// out(B,T,C) = wte[tokens[b,t]] + wpe[p(b,t)]   (wpe may have data == nullptr:
// no positions), p(b,t) = positions[b*T+t] (in [0,T)), or t when positions is null.
// A token outside [0,V) or a position outside [0,T) throws zinc::Error.
void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, const int32_t* positions = nullptr);
// dwte(V,C) += scatter of dout rows, dwpe(T,C) += scatter by position (dwpe may be null).
// Deterministic: each output row is summed in token order.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, const int32_t* positions = nullptr);

// ---- vocabulary parts (tensor parallelism: Note [vocabulary parts] in
// engine/tensor_parallel.cpp) -----------------------------------------------
// A part holds rows [lo, lo + n) of the embedding (and head): out(N,C) gets
// the part's row of each token in that range and 0 for the others (the
// parts' outputs summed are embedding_forward's); backward adds dout rows
// into the part's rows, in row order.
void embedding_part_forward(float* out, const int32_t* tokens, CView wte, int64_t N, int64_t C, int64_t lo,
                            int64_t n);
void embedding_part_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t lo,
                             int64_t n);
// cross_entropy over logits whose V columns are split over the parts (this
// part: columns [lo, lo + Vp)), in three steps with a sum over the parts
// between them: the part's row maxima (then their max over the parts);
// with those, per row the sum of exp(x - max) over the part's columns and
// the target's logit where the target is the part's (sums(N,2); then
// summed over the parts), dlogits holding the exponentials; with those,
// the loss (the same on every part: cross_entropy's) and dlogits as
// cross_entropy writes them for the part's columns.
void cross_entropy_part_max(const float* logits, int64_t N, int64_t Vp, double* row_maxes);
void cross_entropy_part_sums(const float* logits, const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                             const double* row_maxes, double* sums, float* dlogits);
double cross_entropy_part_finish(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo, const double* row_maxes,
                                 const double* sums, float* dlogits, float dloss_scale);

// ---- vector ops -------------------------------------------------------------------
void add(float* out, const float* a, const float* b, int64_t n);  // out = a + b (out may alias)
void accumulate(float* y, const float* x, int64_t n);            // y += x
void scale(float* x, float alpha, int64_t n);                    // x *= alpha
void axpy(float* y, float alpha, const float* x, int64_t n);     // y += alpha * x
// Column block copy: for each of N rows, `width` floats from src + r * src_W
// to dst + r * dst_W (the caller offsets dst and src to the first column).
// dst and src must not overlap.
void copy_columns(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t N, int64_t width);
// A column window of a wider matrix's dropout mask (Note [dropout masks]
// in math.h): x is (n / cols, cols), columns [first, first + cols) of a
// matrix `stride` wide, and element i takes the mask of that matrix's
// element (i / cols) * stride + first + i % cols. A tensor part's share of
// a row-parallel layer's input drops what the whole input would (LoRA with
// tensor parts). cols 0: element i takes mask element i.
struct DropoutColumns {
  int64_t cols = 0, stride = 0, first = 0;
};
// Inverted dropout with the mask of stream `key` (Note [dropout masks] in
// math.h): out[i] = x[i] / (1 - p) where element i is kept, else 0; added
// to out with accumulate. out may alias x (not with accumulate). The mask's
// indices stay below 2^32.
void dropout(float* out, const float* x, int64_t n, float p, uint64_t key, bool accumulate,
             DropoutColumns window = {});
// Refuses what dropout cannot take: a mask index past 2^32, a window
// outside its matrix.
inline void check_dropout_window(int64_t n, const DropoutColumns& w) {
  ZINC_CHECK(n >= 0 && n <= int64_t{0xffffffff}, "dropout: more than 2^32 elements");
  if (w.cols == 0) return;
  ZINC_CHECK(w.cols > 0 && n % w.cols == 0 && w.first >= 0 && w.first + w.cols <= w.stride,
             "dropout: a column window outside its matrix");
  ZINC_CHECK(n / w.cols * w.stride <= int64_t{0xffffffff}, "dropout: a mask of more than 2^32 elements");
}
// sum x^2 in double, in a fixed order of fixed-size chunks (thread-count independent).
double squared_norm(const float* x, int64_t n);
bool all_finite(const float* x, int64_t n);

}  // namespace zinc::kernels
