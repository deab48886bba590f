// The CPU's Ops: kernels.h on host memory.
#include <cstring>
#include <string>

#include "core/error.h"
#include "models/detail/ops.h"

namespace zinc::models::detail {
namespace {

class CpuOps : public Ops {
 public:
  Device device() const override { return Device::kCpu; }
  Buf alloc(size_t bytes) override { return Buf(AlignedBuffer(bytes)); }
  void zero(float* x, int64_t n) override { std::memset(x, 0, static_cast<size_t>(n) * sizeof(float)); }
  const int32_t* tokens(const std::vector<int32_t>& host, int64_t V, const char* what, Buf& store) override {
    return host.data();  // the kernels check the range themselves
  }
  const int32_t* targets(const std::vector<int32_t>& host, int64_t V, Buf& store) override { return host.data(); }
  const int32_t* positions(const std::vector<int32_t>& host, Buf& store) override {
    return host.empty() ? nullptr : host.data();
  }
  void matmul(const kernels::MatmulDesc& d, CView a, CView b, float* c, CView bias) override {
    kernels::matmul(d, a, b, c, bias);
  }
  void matmul_packed(const kernels::MatmulDesc& d, CView a, CView b, uint64_t generation, kernels::PackedWeight& slot,
                     float* c, CView bias) override {
    kernels::matmul_packed(d, a, b, generation, slot, c, bias);
  }
  void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N) override {
    kernels::bias_backward(dbias, dy, M, N);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                         int64_t C, float eps) override {
    kernels::layernorm_forward(out, mean, rstd, x, w, b, N, C, eps);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, CView w,
                          const float* mean, const float* rstd, int64_t N, int64_t C) override {
    kernels::layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C);
  }
  void gelu_forward(float* out, const float* x, int64_t n) override { kernels::gelu_forward(out, x, n); }
  void gelu_backward(float* dx, const float* x, const float* dout, int64_t n) override {
    kernels::gelu_backward(dx, x, dout, n);
  }
  void add(float* out, const float* a, const float* b, int64_t n) override { kernels::add(out, a, b, n); }
  void scale(float* x, float alpha, int64_t n) override { kernels::scale(x, alpha, n); }
  void add_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) override {
    // rows x cols is a B gradient (up to a few thousand x r): a plain loop,
    // in tiles of 64 rows so that src's columns stay in cache.
    for (int64_t i0 = 0; i0 < rows; i0 += 64) {
      const int64_t i1 = std::min(rows, i0 + 64);
      for (int64_t k = 0; k < cols; ++k) {
        const float* s = src + k * lds;
        for (int64_t i = i0; i < i1; ++i) dst[i * ldd + k] += s[i];
      }
    }
  }
  void copy_columns(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t N, int64_t width) override {
    kernels::copy_columns(dst, dst_W, src, src_W, N, width);
  }
  void dropout(float* out, const float* x, int64_t n, float p, uint64_t key, bool accumulate,
               kernels::DropoutColumns window) override {
    kernels::dropout(out, x, n, p, key, accumulate, window);
  }
  void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T, int64_t C,
                         int64_t V, const int32_t* positions) override {
    kernels::embedding_forward(out, tokens, wte, wpe, B, T, C, V, positions);
  }
  void embedding_part_forward(float* out, const int32_t* tokens, CView wte, int64_t N, int64_t C, int64_t lo,
                              int64_t n) override {
    kernels::embedding_part_forward(out, tokens, wte, N, C, lo, n);
  }
  void embedding_part_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t lo,
                               int64_t n) override {
    kernels::embedding_part_backward(dwte, dout, tokens, N, C, lo, n);
  }
  void cross_entropy_part_max(const float* logits, int64_t N, int64_t Vp, double* row_maxes) override {
    kernels::cross_entropy_part_max(logits, N, Vp, row_maxes);
  }
  void cross_entropy_part_sums(const float* logits, const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                               const double* row_maxes, double* sums, float* dlogits) override {
    kernels::cross_entropy_part_sums(logits, targets, N, Vp, lo, row_maxes, sums, dlogits);
  }
  double cross_entropy_part_finish(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo, const double* row_maxes,
                                   const double* sums, float* dlogits, float dloss_scale) override {
    return kernels::cross_entropy_part_finish(targets, N, Vp, lo, row_maxes, sums, dlogits, dloss_scale);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                          int64_t C, int64_t V, const int32_t* positions) override {
    kernels::embedding_backward(dwte, dwpe, dout, tokens, B, T, C, V, positions);
  }
  double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, float* dlogits,
                       float dloss_scale) override {
    return kernels::cross_entropy(logits, targets, N, V, dlogits, dloss_scale);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps,
                       float w_offset) override {
    kernels::rmsnorm_forward(out, rstd, x, w, N, C, eps, w_offset);
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd, int64_t N,
                        int64_t C, float w_offset) override {
    kernels::rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C, w_offset);
  }
  void geglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) override {
    kernels::geglu_forward(out, gate_up, N, I);
  }
  void geglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) override {
    kernels::geglu_backward(dgate_up, dout, gate_up, N, I);
  }
  void gelu_erf_forward(float* out, const float* x, int64_t n) override { kernels::gelu_erf_forward(out, x, n); }
  void gelu_erf_backward(float* dx, const float* x, const float* dout, int64_t n) override {
    kernels::gelu_erf_backward(dx, x, dout, n);
  }
  void softcap_forward(float* x, float cap, int64_t n) override { kernels::softcap_forward(x, cap, n); }
  void softcap_backward(float* dx, const float* y, float cap, int64_t n) override {
    kernels::softcap_backward(dx, y, cap, n);
  }
  void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) override {
    kernels::swiglu_forward(out, gate_up, N, I);
  }
  void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) override {
    kernels::swiglu_backward(dgate_up, dout, gate_up, N, I);
  }
  void rope(float* x, const float* cos, const float* sin, kernels::RopeShape s, bool inverse) override {
    kernels::rope(x, cos, sin, s, inverse);
  }
  void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) override {
    kernels::gqa_expand(qkv, q_kv, N, H, Hkv, hd);
  }
  void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) override {
    kernels::gqa_reduce(dq_kv, dqkv, N, H, Hkv, hd);
  }
  void copy_in(Buf& dst, const float* host, int64_t n) override {
    dst = alloc_f32(static_cast<size_t>(n));
    if (n > 0) std::memcpy(dst.data(), host, static_cast<size_t>(n) * sizeof(float));  // none: host may be null
  }
  void copy_in_i32(Buf& dst, const int32_t* host, int64_t n) override {
    dst = alloc(static_cast<size_t>(n) * sizeof(int32_t));
    if (n > 0) std::memcpy(dst.data(), host, static_cast<size_t>(n) * sizeof(int32_t));  // an expert rank sent no rows
  }
  void copy_out(float* host, const float* src, int64_t n) override {
    if (n > 0) std::memcpy(host, src, static_cast<size_t>(n) * sizeof(float));
  }
  void to_f32(float* out, CView x, int64_t n) override {
    if (x.dtype == DType::kF32) {
      if (n > 0) std::memcpy(out, x.data, static_cast<size_t>(n) * sizeof(float));
    } else {
      convert_16_to_f32(x.data, out, static_cast<size_t>(n), x.dtype);
    }
  }
  void copy_out_i32(int32_t* host, const int32_t* src, int64_t n) override {
    if (n > 0) std::memcpy(host, src, static_cast<size_t>(n) * sizeof(int32_t));
  }
  void moe_route(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs, int32_t* expert,
                 float* weight) override {
    kernels::moe_route(logits, N, E, k, renormalize, probs, expert, weight);
  }
  void moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* dweight,
                          const float* dprobs, int64_t N, int64_t E, int64_t k, bool renormalize,
                          float* dlogits) override {
    kernels::moe_route_backward(probs, expert, weight, dweight, dprobs, N, E, k, renormalize, dlogits);
  }
  void moe_gather(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C) override {
    kernels::moe_gather(xg, x, token_of_row, M, C);
  }
  void moe_combine(float* out, const float* y, const float* weight, const int32_t* row_of_slot, int64_t N, int64_t k,
                   int64_t C) override {
    kernels::moe_combine(out, y, weight, row_of_slot, N, k, C);
  }
  void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const float* weight,
                            const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) override {
    kernels::moe_combine_backward(dy, dweight, dout, y, weight, row_of_slot, N, k, C);
  }
  void moe_gather_backward(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N, int64_t k,
                           int64_t C) override {
    kernels::moe_gather_backward(dx, dxg, row_of_slot, N, k, C);
  }
  void* attention_create() override { return kernels::attention_workspace_create(); }
  void attention_destroy(void* ws) override {
    kernels::attention_workspace_destroy(static_cast<kernels::AttentionWorkspace*>(ws));
  }
  void attention_forward(void* ws, float* out, const float* qkv, kernels::AttentionShape s, DType compute) override {
    kernels::attention_forward(static_cast<kernels::AttentionWorkspace*>(ws), out, qkv, s, compute);
  }
  void attention_backward(void* ws, float* dqkv, const float* dout, const float* qkv, kernels::AttentionShape s,
                          DType compute) override {
    kernels::attention_backward(static_cast<kernels::AttentionWorkspace*>(ws), dqkv, dout, qkv, s, compute);
  }
  CView matmul_input(float* x, int64_t n, DType compute, Buf& scratch) override {
    if (!is_16bit(compute)) return CView{x, DType::kF32};
    return kernels::operand16_in_place(x, n, compute, scratch.host());
  }
  CView operand16_copy(const float* dy, int64_t n, DType compute, Buf& scratch) override {
    return kernels::operand16_copy(dy, n, compute, scratch.host());
  }

  // With native bf16 matmuls the fused kernels write the bf16 operand in the
  // same pass (the fp32 output of the forward ones is never written).
  bool fuses_operand16(DType compute) const override { return native_bf16(compute); }
  CView layernorm_forward_input(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                                int64_t C, DType compute, Buf& scratch) override {
    if (!native_bf16(compute)) return Ops::layernorm_forward_input(out, mean, rstd, x, w, b, N, C, compute, scratch);
    bf16* dst = bf16_scratch(scratch, N * C);
    kernels::layernorm_forward_bf16(dst, mean, rstd, x, w, b, N, C);
    return CView{dst, DType::kBF16};
  }
  CView gelu_forward_input(float* out, const float* x, int64_t n, DType compute, Buf& scratch) override {
    if (!native_bf16(compute)) return Ops::gelu_forward_input(out, x, n, compute, scratch);
    bf16* dst = bf16_scratch(scratch, n);
    kernels::gelu_forward_bf16(dst, x, n);
    return CView{dst, DType::kBF16};
  }
  CView dy_operand(const float* dy, float* db, int64_t M, int64_t N, DType compute, Buf& scratch) override {
    if (!db || !native_bf16(compute)) return Ops::dy_operand(dy, db, M, N, compute, scratch);
    bf16* dst = bf16_scratch(scratch, M * N);
    kernels::bias_backward_bf16(db, dst, dy, M, N);
    return CView{dst, DType::kBF16};
  }
  CView gelu_backward_operand(float* dx, float* db, const float* x, const float* dout, int64_t M, int64_t N,
                              DType compute, Buf& scratch) override {
    if (!db || !native_bf16(compute)) return Ops::gelu_backward_operand(dx, db, x, dout, M, N, compute, scratch);
    bf16* dst = bf16_scratch(scratch, M * N);
    kernels::gelu_backward_bias_bf16(db, dst, x, dout, M, N);
    return CView{dst, DType::kBF16};
  }

 private:
  static bool native_bf16(DType compute) { return compute == DType::kBF16 && kernels::bf16_operands_native(); }
  static bf16* bf16_scratch(Buf& scratch, int64_t n) { return kernels::bf16_scratch(scratch.host(), n); }
};

}  // namespace

Ops& cpu_ops() {
  static CpuOps ops;
  return ops;
}

#if !defined(ZINC_MODELS_CUDA)
Ops& cuda_ops() {
  throw Error("device \"cuda\": zinc was built without CUDA (configure with nvcc present, or -DZINC_CUDA=ON)");
}
#endif

Ops& ops_for(Device d) {
  if (d == Device::kCpu) return cpu_ops();
  return cuda_ops();
}

}  // namespace zinc::models::detail
