// zinc models, private: the kernels a built-in model calls, on the CPU or
// the GPU. The GPT is written once against Ops; cpu_ops() runs kernels.h on
// host memory, cuda_ops() (CUDA builds, models/cuda_ops.cpp) runs
// kernels_cuda.h on device memory, enqueued on the legacy default stream,
// the one compute stream the engine orders its copies against.
//
// Buffers come from Ops::alloc (zero-filled; host AlignedBuffer or device
// memory), so the model never touches its activations with host code: every
// access goes through a kernel of the same Ops.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/alloc.h"
#include "core/error.h"
#include "engine/model.h"
#include "kernels/kernels.h"

namespace zinc::models::detail {

using kernels::CView;

// A zero-filled buffer of an Ops: host memory (an AlignedBuffer, 64-byte
// aligned, so the memory estimates' sizes hold) or device memory.
class Buf {
 public:
  Buf() = default;
  explicit Buf(AlignedBuffer host) : host_(std::move(host)) {}
  Buf(void* dev, size_t bytes, void (*dev_free)(void*)) : dev_(dev), dev_bytes_(bytes), dev_free_(dev_free) {}
  ~Buf() {
    if (dev_) dev_free_(dev_);
  }
  Buf(Buf&& o) noexcept { *this = std::move(o); }
  Buf& operator=(Buf&& o) noexcept {
    if (this != &o) {
      if (dev_) dev_free_(dev_);
      host_ = std::move(o.host_);
      dev_ = std::exchange(o.dev_, nullptr);
      dev_bytes_ = std::exchange(o.dev_bytes_, 0);
      dev_free_ = o.dev_free_;
    }
    return *this;
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  void* data() const { return dev_ ? dev_ : host_.data(); }
  size_t bytes() const { return dev_ ? dev_bytes_ : host_.bytes(); }
  template <class T>
  T* as() const {
    return static_cast<T*>(data());
  }
  AlignedBuffer& host() { return host_; }  // CPU Ops only

 private:
  AlignedBuffer host_;
  void* dev_ = nullptr;
  size_t dev_bytes_ = 0;
  void (*dev_free_)(void*) = nullptr;
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual Device device() const = 0;
  virtual Buf alloc(size_t bytes) = 0;
  Buf alloc_f32(size_t n) { return alloc(n * sizeof(float)); }
  virtual void zero(float* x, int64_t n) = 0;

  // The batch's tokens (or targets) where the kernels read them: the host
  // vector itself, or a copy in `store` on the device. Checks every value
  // is in [0, V) first and throws zinc::Error naming the position.
  virtual const int32_t* tokens(const std::vector<int32_t>& host, int64_t V, const char* what, Buf& store) = 0;
  // The batch's targets likewise, each in [0, V) or kernels::kIgnoreTarget.
  virtual const int32_t* targets(const std::vector<int32_t>& host, int64_t V, Buf& store) = 0;
  // The batch's positions (Batch::positions, checked by the engine) where
  // the kernels read them; nullptr when the batch has none.
  virtual const int32_t* positions(const std::vector<int32_t>& host, Buf& store) = 0;

  virtual void matmul(const kernels::MatmulDesc& d, CView a, CView b, float* c, CView bias = {}) = 0;
  // matmul with B kept packed in `slot` from call to call (Note [packed
  // frozen weights] in kernels/matmul.cpp; generation: BlockParams's). The
  // plain matmul where the backend packs nothing (the GPU).
  virtual void matmul_packed(const kernels::MatmulDesc& d, CView a, CView b, uint64_t generation,
                             kernels::PackedWeight& slot, float* c, CView bias = {}) {
    matmul(d, a, b, c, bias);
  }
  virtual void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N) = 0;
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                                 int64_t C, float eps) = 0;
  virtual void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, CView w,
                                  const float* mean, const float* rstd, int64_t N, int64_t C) = 0;
  virtual void gelu_forward(float* out, const float* x, int64_t n) = 0;
  virtual void gelu_backward(float* dx, const float* x, const float* dout, int64_t n) = 0;
  virtual void add(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual void scale(float* x, float alpha, int64_t n) = 0;
  virtual void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T,
                                 int64_t C, int64_t V, const int32_t* positions) = 0;
  virtual void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                                  int64_t T, int64_t C, int64_t V, const int32_t* positions) = 0;
  // Mean loss over the rows with a target (kernels::cross_entropy); `targets` from targets().
  virtual double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, float* dlogits,
                               float dloss_scale) = 0;
  // cross_entropy with the logit gradient written only as the head's
  // backward operand, rounded to 16-bit `compute` (Note [fused 16-bit
  // operands] in kernels_cuda.h): N x V values at dlogits16. Only where
  // fuses_every_operand16(compute); the bits are cross_entropy's, then the
  // rounding.
  virtual double cross_entropy_operand16(const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                         void* dlogits16, DType compute, float dloss_scale) {
    throw Error("cross_entropy_operand16: this backend writes no 16-bit logit gradient");
  }
  // Vocabulary parts (kernels.h; tensor parallelism, which runs on the CPU
  // only: a backend without them throws). The row maxima and sums are
  // host memory.
  virtual void embedding_part_forward(float* out, const int32_t* tokens, CView wte, int64_t N, int64_t C, int64_t lo,
                                      int64_t n) {
    throw Error("embedding_part_forward: vocabulary parts run on the CPU only");
  }
  virtual void embedding_part_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t C,
                                       int64_t lo, int64_t n) {
    throw Error("embedding_part_backward: vocabulary parts run on the CPU only");
  }
  virtual void cross_entropy_part_max(const float* logits, int64_t N, int64_t Vp, double* row_maxes) {
    throw Error("cross_entropy_part_max: vocabulary parts run on the CPU only");
  }
  virtual void cross_entropy_part_sums(const float* logits, const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                                       const double* row_maxes, double* sums, float* dlogits) {
    throw Error("cross_entropy_part_sums: vocabulary parts run on the CPU only");
  }
  virtual double cross_entropy_part_finish(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                                           const double* row_maxes, const double* sums, float* dlogits,
                                           float dloss_scale) {
    throw Error("cross_entropy_part_finish: vocabulary parts run on the CPU only");
  }

  // The Llama family's layers (kernels.h). A backend without them throws
  // zinc::Error naming the kernel (the CUDA twins are not written yet).
  // w_offset: 0, or 1 for Gemma's norm, which scales by 1 + w.
  virtual void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps,
                               float w_offset) = 0;
  virtual void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd,
                                int64_t N, int64_t C, float w_offset) = 0;
  virtual void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) = 0;
  virtual void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) = 0;
  virtual void geglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) = 0;
  virtual void geglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) = 0;
  virtual void gelu_erf_forward(float* out, const float* x, int64_t n) = 0;
  virtual void gelu_erf_backward(float* dx, const float* x, const float* dout, int64_t n) = 0;
  virtual void softcap_forward(float* x, float cap, int64_t n) = 0;
  virtual void softcap_backward(float* dx, const float* y, float cap, int64_t n) = 0;
  // cos, sin: (T, head_dim/2) tables where the kernels read them (copy_in).
  virtual void rope(float* x, const float* cos, const float* sin, kernels::RopeShape s, bool inverse) = 0;
  virtual void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) = 0;
  virtual void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) = 0;
  // dst (rows x cols, row stride ldd) += src^T, src (cols x rows, row stride
  // lds): LoRA's B gradients, which its products make transposed (Note
  // [LoRA's B gradient transposed] in models/detail/lora.h).
  virtual void add_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) = 0;
  // kernels::copy_columns: N rows of `width` floats between row strides.
  virtual void copy_columns(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t N, int64_t width) = 0;
  // kernels::dropout: out (=, or += with accumulate) x / (1 - p) where
  // stream `key` keeps the element (of `window`'s matrix), else 0.
  virtual void dropout(float* out, const float* x, int64_t n, float p, uint64_t key, bool accumulate,
                       kernels::DropoutColumns window) = 0;
  // n values of x (fp32, bf16 or fp16, on this device) as fp32 in out (exact).
  virtual void to_f32(float* out, CView x, int64_t n) = 0;
  // Host floats into a buffer of this Ops (small tables: the rope angles).
  virtual void copy_in(Buf& dst, const float* host, int64_t n) = 0;
  // int32 values into a buffer of this Ops (allocated to n values), and out
  // of this Ops' memory to the host (waits for the work before it): the
  // experts a router chose go to the host, which groups them and launches
  // each expert's GEMM, and the grouping comes back.
  virtual void copy_in_i32(Buf& dst, const int32_t* host, int64_t n) = 0;
  virtual void copy_out(float* host, const float* src, int64_t n) = 0;
  virtual void copy_out_i32(int32_t* host, const int32_t* src, int64_t n) = 0;

  // Mixture of experts (kernels.h; the grouping is kernels::moe_group, on
  // the host).
  virtual void moe_route(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs,
                         int32_t* expert, float* weight) = 0;
  virtual void moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* dweight,
                                  const float* dprobs, int64_t N, int64_t E, int64_t k, bool renormalize,
                                  float* dlogits) = 0;
  virtual void moe_gather(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C) = 0;
  virtual void moe_combine(float* out, const float* y, const float* weight, const int32_t* row_of_slot, int64_t N,
                           int64_t k, int64_t C) = 0;
  virtual void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const float* weight,
                                    const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) = 0;
  virtual void moe_gather_backward(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N, int64_t k,
                                   int64_t C) = 0;

  // Attention with a workspace per layer (opaque; create/destroy pair).
  virtual void* attention_create() = 0;
  virtual void attention_destroy(void* ws) = 0;
  virtual void attention_forward(void* ws, float* out, const float* qkv, kernels::AttentionShape s, DType compute) = 0;
  virtual void attention_backward(void* ws, float* dqkv, const float* dout, const float* qkv,
                                  kernels::AttentionShape s, DType compute) = 0;
  // attention_forward then matmul_input of `out`. Where the returned view
  // is a 16-bit copy the backend may leave `out` unwritten (the GPU's fused
  // attention writes the operand itself; Note [fused 16-bit operands]).
  virtual CView attention_forward_input(void* ws, float* out, const float* qkv, kernels::AttentionShape s,
                                        DType compute, Buf& scratch) {
    attention_forward(ws, out, qkv, s, compute);
    return matmul_input(out, s.B * s.T * s.C, compute, scratch);
  }
  // Bytes of one attention workspace (what forward keeps for backward).
  virtual int64_t attention_workspace_bytes(kernels::AttentionShape s, DType compute) const {
    return kernels::attention_workspace_bytes(s);
  }
  // The kernels' own scratch for a pass of layers with attention of shape
  // s, beyond the model's buffers, for the estimates: the CPU kernels'
  // (`tally`: oneDNN's scratchpads, converted operands, attention's slots)
  // by default. A backend whose kernels keep other scratch says its own.
  virtual int64_t kernel_scratch_bytes(const kernels::ScratchTally& tally, kernels::AttentionShape s,
                                       DType compute) const {
    (void)s, (void)compute;
    return tally.bytes();
  }
  // What matmul_input keeps for an n-element activation's 16-bit operand,
  // for the estimates: the CPU's in-place rules by default (none in fp16,
  // which computes in fp32, nor in bf16 on a CPU without bf16 products).
  virtual int64_t matmul_input_bytes(int64_t n, DType compute) const {
    return is_16bit(compute) ? kernels::ScratchTally::operand16_bytes(n, /*in_place=*/true, compute) : 0;
  }
  // Whether attention reads grouped-query heads in place
  // (AttentionShape::kv_heads) at this head size and compute dtype; if
  // not, a model repeats them to every query head (gqa_expand).
  virtual bool attention_reads_kv_heads(int64_t head_dim, DType compute) const { return false; }

  // An activation that only matmuls read, as they read it (see
  // linear.h's matmul_input): the fp32 buffer itself for fp32 compute, else
  // converted once into `scratch` (or rounded in place on the CPU fallback).
  virtual CView matmul_input(float* x, int64_t n, DType compute, Buf& scratch) = 0;
  // An fp32 dy converted for 16-bit matmuls (a copy; dy itself is kept for
  // the bias gradient).
  virtual CView operand16_copy(const float* dy, int64_t n, DType compute, Buf& scratch) = 0;

  // Fused forms of the above where a matmul reads a kernel's output (or
  // dy), each with the same values as the unfused calls. A backend may fuse
  // them; these defaults just call the two steps.
  // Whether the forward ones below leave `out` unwritten for this compute
  // dtype (they write the 16-bit operand only): then a model need not
  // allocate `out` at all and passes nullptr.
  virtual bool fuses_operand16(DType compute) const { return false; }
  // Whether every forward form here (the norms, the activations and
  // attention_forward_input) leaves `out` unwritten for this compute dtype,
  // so that a model need allocate none of those fp32 buffers (the GPU's
  // kernels write the 16-bit operands themselves; the CPU's fuse some).
  virtual bool fuses_every_operand16(DType compute) const { return false; }
  // layernorm_forward then matmul_input of `out`. Where the returned view is
  // a 16-bit copy the backend may leave `out` unwritten (fuses_operand16).
  virtual CView layernorm_forward_input(float* out, float* mean, float* rstd, const float* x, CView w, CView b,
                                        int64_t N, int64_t C, DType compute, Buf& scratch) {
    layernorm_forward(out, mean, rstd, x, w, b, N, C, 1e-5f);  // the GPT's eps
    return matmul_input(out, N * C, compute, scratch);
  }
  // A residual connection and the norm after it: x += residual, then the
  // norm of x (x is rewritten). The GPU runs each as one kernel; these
  // defaults call add and the norm, the same values.
  virtual CView add_layernorm_forward_input(float* out, float* mean, float* rstd, float* x, const float* residual,
                                            CView w, CView b, int64_t N, int64_t C, DType compute, Buf& scratch) {
    add(x, x, residual, N * C);
    return layernorm_forward_input(out, mean, rstd, x, w, b, N, C, compute, scratch);
  }
  virtual void add_layernorm_forward(float* out, float* mean, float* rstd, float* x, const float* residual, CView w,
                                     CView b, int64_t N, int64_t C, float eps) {
    add(x, x, residual, N * C);
    layernorm_forward(out, mean, rstd, x, w, b, N, C, eps);
  }
  virtual void add_rmsnorm_forward(float* out, float* rstd, float* x, const float* residual, CView w, int64_t N,
                                   int64_t C, float eps, float w_offset) {
    add(x, x, residual, N * C);
    rmsnorm_forward(out, rstd, x, w, N, C, eps, w_offset);
  }
  // rmsnorm_forward (residual null) or add_rmsnorm_forward, then
  // matmul_input of `out` (the same licence).
  virtual CView rmsnorm_forward_input(float* out, float* rstd, float* x, const float* residual, CView w, int64_t N,
                                      int64_t C, float eps, float w_offset, DType compute, Buf& scratch) {
    if (residual)
      add_rmsnorm_forward(out, rstd, x, residual, w, N, C, eps, w_offset);
    else
      rmsnorm_forward(out, rstd, x, w, N, C, eps, w_offset);
    return matmul_input(out, N * C, compute, scratch);
  }
  // geglu_forward (gelu) or swiglu_forward, then matmul_input of `out`
  // (the same licence).
  virtual CView gated_forward_input(float* out, const float* gate_up, int64_t N, int64_t I, bool gelu, DType compute,
                                    Buf& scratch) {
    if (gelu)
      geglu_forward(out, gate_up, N, I);
    else
      swiglu_forward(out, gate_up, N, I);
    return matmul_input(out, N * I, compute, scratch);
  }
  // gelu_forward then matmul_input of `out` (the same licence).
  virtual CView gelu_forward_input(float* out, const float* x, int64_t n, DType compute, Buf& scratch) {
    gelu_forward(out, x, n);
    return matmul_input(out, n, compute, scratch);
  }
  // dy(M,N) as linear_backward's matmuls read it (dy itself for fp32
  // compute, else operand16_copy's), with db += its column sums
  // (bias_backward) where db is not null.
  virtual CView dy_operand(const float* dy, float* db, int64_t M, int64_t N, DType compute, Buf& scratch) {
    if (db) bias_backward(db, dy, M, N);
    if (!is_16bit(compute)) return CView{dy, DType::kF32};
    return operand16_copy(dy, M * N, compute, scratch);
  }
  // gelu_backward's dx(M,N) = dout * gelu'(x), then dy_operand of it (with
  // db). Where the returned view is a 16-bit copy the backend may leave dx
  // unwritten.
  virtual CView gelu_backward_operand(float* dx, float* db, const float* x, const float* dout, int64_t M, int64_t N,
                                      DType compute, Buf& scratch) {
    gelu_backward(dx, x, dout, M * N);
    return dy_operand(dx, db, M, N, compute, scratch);
  }
};

// The CPU's Ops (kernels.h; one instance per process).
Ops& cpu_ops();
// The GPU's Ops (kernels_cuda.h on the legacy default stream); throws
// zinc::Error when zinc was built without CUDA or no GPU is visible.
Ops& cuda_ops();
Ops& ops_for(Device d);

}  // namespace zinc::models::detail
