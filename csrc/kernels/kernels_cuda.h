// zinc kernels on the GPU: the CUDA twins of kernels.h (CUDA builds only).
//
// Same conventions as kernels.h (shapes, dtypes, += for parameter
// gradients, = for activation gradients), with these differences:
// - Every pointer, and the data of every CView, is DEVICE memory on the
//   current device. Token and target arrays are device int32 too.
// - Every function enqueues its work on `stream` and returns at once; the
//   caller orders streams with events. Errors in launching throw zinc::Error
//   naming the kernel. Values are NOT range-checked on the device (a token
//   outside [0,V) is the caller's bug; the engine checks batches on the host
//   before uploading them).
// - Per-element and per-row math is kernels/math.h, the code the CPU kernels
//   run; the row sums follow Note [lane order]. So layernorm, GELU, bias,
//   embeddings, cross-entropy, the Llama layers (RMSNorm, SwiGLU, RoPE, the
//   grouped-query heads), the conversions and the vector ops give the CPU's
//   bits exactly; matmul (cuBLAS) and attention (built on cuBLAS) do
//   not, since cuBLAS and oneDNN block their sums differently.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "kernels/kernels.h"

namespace zinc::kernels::cuda {

// cuBLAS is opened on first use, never linked (core/dynlib.h). Opens it and
// returns the file loaded; throws zinc::Error naming what it tried. Needs no GPU.
std::string cublas_library();

// ---- conversions -------------------------------------------------------------
// dst(n) = float_to_16(src) (kBF16 / kF16), bit for bit as core/dtype.h; kF32 copies.
void convert_f32_to_16(const float* src, void* dst, int64_t n, DType t, cudaStream_t stream);
void convert_16_to_f32(const void* src, float* dst, int64_t n, DType t, cudaStream_t stream);

// ---- matmul (cuBLAS) -------------------------------------------------------------
// kernels::matmul's contract (MatmulDesc, CView operands, fp32 C, fused bias)
// on device pointers. compute kF32: fp32 multiply-add (no TF32); kBF16 / kF16:
// 16-bit operands with fp32 accumulation. An operand whose dtype differs from
// `compute` is converted into device scratch first (owned by the calling
// thread, grow-only).
// A bias with alpha 1, one batch and no accumulate goes in cuBLASLt's
// epilogue (Note [the bias in the GEMM's epilogue] in matmul.cu), unless
// ZINC_CUDA_MATMUL_BIAS=separate or set_separate_bias_for_testing(true).
void matmul(const MatmulDesc& d, CView a, CView b, float* c, cudaStream_t stream, CView bias = {});
void set_separate_bias_for_testing(bool separate);
// Whether matmul runs d's bias in the epilogue on this thread's current
// device (makes the shape's plan).
bool matmul_bias_in_epilogue(const MatmulDesc& d);

// ---- bias ------------------------------------------------------------------------------
void add_bias(float* y, CView bias, int64_t M, int64_t N, cudaStream_t stream);
// dbias(N) += column sums of dy(M,N), rows added in order in double (as the CPU).
void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N, cudaStream_t stream);

// ---- layernorm ----------------------------------------------------------------------------
void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                       int64_t C, cudaStream_t stream, float eps = 1e-5f);
// x += residual (a residual connection), then layernorm_forward of the new
// x, in one pass over each row: the bits of add then layernorm_forward.
void add_layernorm_forward(float* out, float* mean, float* rstd, float* x, const float* residual, CView w, CView b,
                           int64_t N, int64_t C, cudaStream_t stream, float eps = 1e-5f);
void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, CView w,
                        const float* mean, const float* rstd, int64_t N, int64_t C, cudaStream_t stream);

// ---- GELU -----------------------------------------------------------------------------------
void gelu_forward(float* out, const float* x, int64_t n, cudaStream_t stream);
void gelu_backward(float* dx, const float* x, const float* dout, int64_t n, cudaStream_t stream);

// ---- fused 16-bit operands ------------------------------------------------------------------
// Note [fused 16-bit operands]
// In bf16 and fp16 compute a matmul reads its activation operands as 16-bit
// values: the fp32 result of the kernel before it, rounded by
// convert_f32_to_16. The forms below write that rounded operand in the
// producing kernel's own pass, so the fp32 result is neither written nor
// read again (Ops::fuses_operand16 in models/detail/ops.h): the bits equal
// the kernel, then convert_f32_to_16 of its output. The gradient sums keep
// bias_backward's order (t: kBF16 or kF16; anything else throws).
// layernorm_forward (residual null) or add_layernorm_forward (x +=
// residual first), the output written to out16 only.
void layernorm_forward_16(void* out16, DType t, float* mean, float* rstd, float* x, const float* residual, CView w,
                          CView b, int64_t N, int64_t C, cudaStream_t stream, float eps = 1e-5f);
void gelu_forward_16(void* out16, DType t, const float* x, int64_t n, cudaStream_t stream);
// bias_backward of dy with dy itself written to dy16.
void bias_backward_16(float* dbias, void* dy16, DType t, const float* dy, int64_t M, int64_t N, cudaStream_t stream);
// rmsnorm_forward (residual null) or add_rmsnorm_forward, the output
// written to out16 only.
void rmsnorm_forward_16(void* out16, DType t, float* rstd, float* x, const float* residual, CView w, int64_t N,
                        int64_t C, float eps, cudaStream_t stream, float w_offset = 0.0f);
// geglu_forward (gelu) or swiglu_forward, written to out16 only.
void gated_forward_16(void* out16, DType t, const float* gate_up, int64_t N, int64_t I, bool gelu,
                      cudaStream_t stream);
// gelu_backward's dx = gelu'(x) * dout written to dx16 only, and, unless
// dbias is null, bias_backward of that dx.
void gelu_backward_bias_16(float* dbias, void* dx16, DType t, const float* x, const float* dout, int64_t M,
                           int64_t N, cudaStream_t stream);
// cross_entropy with dlogits written to dlogits16 only (N x V, 16-bit, not
// overlapping logits):
// the head's logit gradient as its backward products read it. Its third
// pass recomputes the exponentials instead of reading them back, so the
// logits are read three times and no fp32 gradient is written.
void cross_entropy_16(const float* logits, const int32_t* targets, int64_t N, int64_t V, void* dlogits16, DType t,
                      float dloss_scale, double* row_loss, cudaStream_t stream);

// ---- Llama-family layers (llama_layers.cu) -------------------------------------------------
// kernels::rmsnorm_forward/backward, swiglu_ and geglu_forward/backward,
// softcap_forward/backward, rope and
// gqa_expand/gqa_reduce (kernels.h) on device pointers, bit for bit the
// CPU's: the rows of RMSNorm in lane order, its dw(C) += in Note [column
// sums]'s order (double, no atomics). The rope tables cos, sin (T,
// head_dim/2) are device memory; rope scaling is in the tables only. The
// argument checks are the CPU's (zinc::Error naming the cuda:: twin);
// gqa_* with H == 0 write nothing.
// rope's RopeShape::positions, when set, are device memory (B*T, each in
// [0, T)) and not checked here: the caller checks them on the host.
void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps,
                     cudaStream_t stream, float w_offset = 0.0f);
// x += residual, then rmsnorm_forward of the new x in one pass (as
// add_layernorm_forward).
void add_rmsnorm_forward(float* out, float* rstd, float* x, const float* residual, CView w, int64_t N, int64_t C,
                         float eps, cudaStream_t stream, float w_offset = 0.0f);
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd, int64_t N,
                      int64_t C, cudaStream_t stream, float w_offset = 0.0f);
void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I, cudaStream_t stream);
void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I,
                     cudaStream_t stream);
void geglu_forward(float* out, const float* gate_up, int64_t N, int64_t I, cudaStream_t stream);
void geglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I,
                    cudaStream_t stream);
void gelu_erf_forward(float* out, const float* x, int64_t n, cudaStream_t stream);
void gelu_erf_backward(float* dx, const float* x, const float* dout, int64_t n, cudaStream_t stream);
void softcap_forward(float* x, float cap, int64_t n, cudaStream_t stream);
void softcap_backward(float* dx, const float* y, float cap, int64_t n, cudaStream_t stream);
void rope(float* x, const float* cos, const float* sin, RopeShape s, bool inverse, cudaStream_t stream);
void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd, cudaStream_t stream);
void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd, cudaStream_t stream);

// ---- mixture of experts (moe.cu) --------------------------------------------------------------
// kernels::moe_route, moe_route_backward, moe_gather, moe_combine,
// moe_combine_backward and moe_gather_backward on device pointers (the
// expert ids and grouped rows too), bit for bit the CPU's. The grouping
// (kernels::moe_group) runs on the host.
void moe_route(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs, int32_t* expert,
               float* weight, cudaStream_t stream);
void moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* dweight,
                        const float* dprobs, int64_t N, int64_t E, int64_t k, bool renormalize, float* dlogits,
                        cudaStream_t stream);
void moe_gather(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C, cudaStream_t stream);
void moe_combine(float* out, const float* y, const float* weight, const int32_t* row_of_slot, int64_t N, int64_t k,
                 int64_t C, cudaStream_t stream);
void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const float* weight,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C, cudaStream_t stream);
void moe_gather_backward(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C,
                         cudaStream_t stream);

// ---- causal attention ------------------------------------------------------------------------
// kernels::attention_forward/backward on the GPU; the workspace holds P
// (B,H,T,T) fp32 in device memory between forward and backward.
// AttentionShape::positions (packed documents, Note [document boundaries]
// in attention.cpp), when set, are device memory and NOT checked here (the
// CPU's check reads them): the caller checks on the host that each is in
// [0, t] for its token t, as models/cuda_ops.cpp does before the upload.
//
// With bf16 or fp16 compute and head sizes up to 128 both run the fused
// kernels below (ZINC_CUDA_ATTENTION=unfused keeps the unfused path, to
// compare); the workspace then holds each row's log-sum-exp and a copy of
// the output instead of P.
class CudaAttentionWorkspace;
CudaAttentionWorkspace* attention_workspace_create();
void attention_workspace_destroy(CudaAttentionWorkspace* ws);
// out16 (optional, compute bf16 or fp16): the output's 16-bit rounding is
// also written there, for the projection after attention (Note [fused
// 16-bit operands]). `out` may then be null: the fused path never writes
// it (its kernel writes the rounding itself), the unfused one writes it
// where given.
void attention_forward(CudaAttentionWorkspace* ws, float* out, const float* qkv, AttentionShape s, DType compute,
                       cudaStream_t stream, void* out16 = nullptr);
void attention_backward(CudaAttentionWorkspace* ws, float* dqkv, const float* dout, const float* qkv,
                        AttentionShape s, DType compute, cudaStream_t stream);
// Tests: the unfused path for every later forward (true), or the fused one
// where it applies (false), whatever ZINC_CUDA_ATTENTION says.
void set_unfused_attention_for_testing(bool unfused);
// Whether attention_forward runs the fused kernels at this head size and
// compute dtype (then AttentionShape::kv_heads may differ from H).
bool fused_attention_used(int64_t head_dim, DType compute);
// Bytes of one workspace between forward and backward: the fused path's
// row statistics and output copy, or the unfused path's P.
int64_t attention_workspace_bytes(AttentionShape s, DType compute);
// Bytes of the stream's scratch that attention_forward and backward of this
// shape grow to (the unfused path's head-major operands, dP, dS and the
// heads' outputs; none on the fused path), for the estimates.
int64_t attention_scratch_bytes(AttentionShape s, DType compute);

// ---- fused causal attention (flash_attention.cu; Note [fused attention]) ----------------------
// Rows of B*T tokens. Query head h is D floats at column h*D of q's rows
// (stride q_stride floats), kv head g (of Hkv; H a multiple of Hkv, query
// head h reads kv head h / (H / Hkv)) at column g*D of k's and v's rows
// (stride kv_stride); out, dout (strides out_stride, dout_stride) and dq
// (q_stride), dk and dv (kv_stride) likewise. lse and di are (B*H*T)
// floats, row (b*H + h)*T + t. positions, window, scale (resolved, not
// 0) and softcap as AttentionShape's; positions in device memory, unchecked.
struct FlashArgs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t q_stride = 0, kv_stride = 0;
  float* out = nullptr;  // forward writes, backward reads
  int64_t out_stride = 0;
  uint16_t* out16 = nullptr;  // forward also writes out rounded to `compute` here (same stride), if set
  float* lse = nullptr;  // forward writes, backward reads
  const float* dout = nullptr;
  int64_t dout_stride = 0;
  float* di = nullptr;  // backward's scratch
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  int64_t B = 0, T = 0, H = 0, Hkv = 0, D = 0;
  const int32_t* positions = nullptr;
  int64_t window = 0;
  float scale = 0.0f, softcap = 0.0f;
};
// Whether the fused kernels run this head size and compute dtype.
bool flash_attention_applies(int64_t head_dim, DType compute);
// out and lse from q, k, v.
void flash_attention_forward(const FlashArgs& a, DType compute, cudaStream_t stream);
// dq, dk, dv (written: every column of every head of rows < T) from dout,
// out, lse, q, k, v; di is scratch.
void flash_attention_backward(const FlashArgs& a, DType compute, cudaStream_t stream);

// ---- softmax cross-entropy -------------------------------------------------------------------
// Per-row losses (double, N) into row_loss; dlogits as kernels::cross_entropy
// (may alias logits, may be null): a row whose target is kIgnoreTarget gets
// a row loss of 0 and a zero dlogits row, the others (softmax - onehot) *
// dloss_scale / N. The targets are not range-checked (the caller counts and
// checks them on the host). The mean loss is the sum of row_loss in row
// order / `targets`, the count of rows with a target (0 when there are
// none): cross_entropy_mean reads it back (synchronises `stream`).
void cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, float* dlogits,
                   float dloss_scale, double* row_loss, cudaStream_t stream);
double cross_entropy_mean(const double* row_loss, int64_t N, int64_t targets, cudaStream_t stream);

// ---- vocabulary parts (kernels.h's embedding_part_* and cross_entropy_part_*,
// the same bits; the row maxima and sums in device memory) -----------------
void embedding_part_forward(float* out, const int32_t* tokens, CView wte, int64_t N, int64_t C, int64_t lo, int64_t n,
                            cudaStream_t stream);
void embedding_part_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t lo,
                             int64_t n, cudaStream_t stream);
void cross_entropy_part_max(const float* logits, int64_t N, int64_t Vp, double* row_maxes, cudaStream_t stream);
void cross_entropy_part_sums(const float* logits, const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                             const double* row_maxes, double* sums, float* dlogits, cudaStream_t stream);
// dlogits only (the loss is the host's: kernels::cross_entropy_part_finish's sum in row order).
void cross_entropy_part_finish(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo, const double* sums,
                               float* dlogits, float dloss_scale, cudaStream_t stream);

// ---- embeddings --------------------------------------------------------------------------------
// Packed documents: `positions` (device, B*T, each in [0, T), unchecked;
// nullptr: row r is at position r % T) index wpe as kernels::embedding_forward's.
void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T, int64_t C,
                       cudaStream_t stream, const int32_t* positions = nullptr);
// The rows of a token array grouped by token (a counting sort on the host,
// rows in increasing order within a token), in device memory. With it
// embedding_backward gives a thread to each (distinct token, column) pair
// instead of one to each column, and each still adds its token's rows in
// the CPU's order. build() enqueues the uploads on `stream`; the index
// must live until the kernels that read it ran.
class TokenIndex {
 public:
  void build(const int32_t* host_tokens, int64_t n, int64_t V, cudaStream_t stream);
  // The host half of build (no GPU needed): throws zinc::Error for a token
  // outside [0, V), naming its position.
  static void group(const int32_t* tokens, int64_t n, int64_t V, std::vector<int32_t>& ids,
                    std::vector<int32_t>& starts, std::vector<int32_t>& rows);
  int64_t distinct() const { return distinct_; }
  const int32_t* ids() const;     // (distinct) the tokens that occur, ascending
  const int32_t* starts() const;  // (distinct + 1) where each token's rows begin in rows()
  const int32_t* rows() const;    // (n) row indexes grouped by token

 private:
  ::zinc::cuda::DeviceBuffer ids_, starts_, rows_;
  std::vector<int32_t> host_ids_, host_starts_, host_rows_;
  int64_t distinct_ = 0;
};

// Deterministic and bit-identical to the CPU: every element of dwte and
// dwpe gets its rows added in token order. Without `index`, one thread per
// column walks every row; with it, one thread per (distinct token, column)
// for dwte and per (position, column) for dwpe. With `positions` (as
// embedding_forward's) dwpe rows are scattered by position; next to
// `index`, `position_index` (a TokenIndex of the host positions, built with
// V > every position) gives one thread per (position that occurs, column),
// and without it one thread per column walks every row for dwpe.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, cudaStream_t stream, const TokenIndex* index = nullptr,
                        const int32_t* positions = nullptr, const TokenIndex* position_index = nullptr);

// ---- vector ops --------------------------------------------------------------------------------
void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream);
void accumulate(float* y, const float* x, int64_t n, cudaStream_t stream);
void scale(float* x, float alpha, int64_t n, cudaStream_t stream);
void axpy(float* y, float alpha, const float* x, int64_t n, cudaStream_t stream);
// kernels::dropout, bit for bit (Note [dropout masks] in math.h).
void dropout(float* out, const float* x, int64_t n, float p, uint64_t key, bool accumulate, cudaStream_t stream,
             DropoutColumns window = {});
void copy_columns(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t N, int64_t width,
                  cudaStream_t stream);
// dst (rows x cols, row stride ldd) += src^T, src (cols x rows, row stride
// lds): LoRA's B gradients (Ops::add_transposed), one float add each, the
// CPU's bits.
void add_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols,
                    cudaStream_t stream);
// sum x^2 in double in kernels::squared_norm's chunk and lane order, written
// to *out (device). Bit-identical to the CPU.
void squared_norm(const float* x, int64_t n, double* out, cudaStream_t stream);

}  // namespace zinc::kernels::cuda
