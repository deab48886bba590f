// The GPU's Ops (CUDA builds): kernels_cuda.h on device memory, every call
// enqueued on the legacy default stream (the model's compute stream; the
// engine orders its parameter uploads and gradient copies against it with
// events). Host code never reads the activations: only the loss comes back
// (cross_entropy synchronises the stream to return it).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/cuda_util.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/kernels_cuda.h"
#include "models/detail/linear.h"
#include "models/detail/ops.h"

namespace zinc::models::detail {
namespace {

constexpr cudaStream_t kStream = nullptr;  // the legacy default stream

void free_device(void* p) { cudaFree(p); }

class CudaOps final : public Ops {
 public:
  Device device() const override { return Device::kCuda; }
  Buf alloc(size_t bytes) override {
    void* p = nullptr;
    if (bytes) {
      p = ::zinc::cuda::gpu_malloc(bytes, "the model's activations");
      ZINC_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, kStream), "model activations: cudaMemset");
    }
    return Buf(p, bytes, &free_device);
  }
  void zero(float* x, int64_t n) override {
    ZINC_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(n) * sizeof(float), kStream), "cudaMemsetAsync");
  }
  const int32_t* tokens(const std::vector<int32_t>& host, int64_t V, const char* what, Buf& store) override {
    for (size_t i = 0; i < host.size(); ++i)
      if (host[i] < 0 || host[i] >= V)
        throw Error(std::string(what) + ": token " + std::to_string(host[i]) + " at position " + std::to_string(i) +
                    " is outside the vocabulary [0, " + std::to_string(V) + ")");
    upload(host, store, "upload of the batch's tokens");
    // The embedding's inputs also get their rows grouped by token, for a
    // parallel embedding backward (kernels::cuda::TokenIndex), kept per
    // device copy (so per model).
    if (std::string(what) == "embedding_forward")
      indexes_[store.data()].build(host.data(), static_cast<int64_t>(host.size()), V, kStream);
    return store.as<int32_t>();
  }
  // Targets in [0, V) or kIgnoreTarget, checked and counted here (the
  // kernel reads no count and checks nothing): cross_entropy divides by the
  // count kept beside the device copy. The message is the CPU kernel's.
  const int32_t* targets(const std::vector<int32_t>& host, int64_t V, Buf& store) override {
    int64_t counted = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      if (host[i] == kernels::kIgnoreTarget) continue;
      if (host[i] < 0 || host[i] >= V)
        throw Error("cross_entropy: target " + std::to_string(host[i]) + " at row " + std::to_string(i) +
                    " is outside the vocabulary [0, " + std::to_string(V) + ") (" +
                    std::to_string(kernels::kIgnoreTarget) + " marks a position without a target)");
      ++counted;
    }
    upload(host, store, "upload of the batch's targets");
    target_counts_[store.data()] = counted;
    target_hosts_[store.data()] = host;  // for cross_entropy_part_finish's loss
    return store.as<int32_t>();
  }
  // Packed documents: the positions go up with their rows grouped by
  // position (a TokenIndex over [0, max], for the GPT's parallel dwpe
  // scatter) and a host copy. The engine's check_batch has checked their
  // structure (each row from 0, each next 0 or the previous + 1); the
  // kernels index wpe, the rope tables and P's rows with them unchecked, so
  // every call that passes them checks them against its T first
  // (check_positions: once per shape, a scan of B*T on the host).
  const int32_t* positions(const std::vector<int32_t>& host, Buf& store) override {
    if (host.empty()) return nullptr;
    int32_t top = 0;
    for (size_t i = 0; i < host.size(); ++i) {
      if (host[i] < 0)
        throw Error("batch.positions: position " + std::to_string(host[i]) + " at index " + std::to_string(i) +
                    " is negative");
      top = std::max(top, host[i]);
    }
    upload(host, store, "upload of the batch's positions");
    DevicePositions& d = positions_[store.data()];
    d.host = host;
    d.checked_B = d.checked_T = -1;
    d.index.build(host.data(), static_cast<int64_t>(host.size()), int64_t{top} + 1, kStream);
    return store.as<int32_t>();
  }
  // The Llama kernels' CUDA twins (llama_layers.cu), bit for bit the CPU's.
  void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps,
                       float w_offset) override {
    kernels::cuda::rmsnorm_forward(out, rstd, x, w, N, C, eps, kStream, w_offset);
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd, int64_t N,
                        int64_t C, float w_offset) override {
    kernels::cuda::rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C, kStream, w_offset);
  }
  void geglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) override {
    kernels::cuda::geglu_forward(out, gate_up, N, I, kStream);
  }
  void geglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) override {
    kernels::cuda::geglu_backward(dgate_up, dout, gate_up, N, I, kStream);
  }
  void gelu_erf_forward(float* out, const float* x, int64_t n) override { kernels::cuda::gelu_erf_forward(out, x, n, kStream); }
  void gelu_erf_backward(float* dx, const float* x, const float* dout, int64_t n) override {
    kernels::cuda::gelu_erf_backward(dx, x, dout, n, kStream);
  }
  void softcap_forward(float* x, float cap, int64_t n) override { kernels::cuda::softcap_forward(x, cap, n, kStream); }
  void softcap_backward(float* dx, const float* y, float cap, int64_t n) override {
    kernels::cuda::softcap_backward(dx, y, cap, n, kStream);
  }
  void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) override {
    kernels::cuda::swiglu_forward(out, gate_up, N, I, kStream);
  }
  void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) override {
    kernels::cuda::swiglu_backward(dgate_up, dout, gate_up, N, I, kStream);
  }
  void rope(float* x, const float* cos, const float* sin, kernels::RopeShape s, bool inverse) override {
    // A sequence rank's slice of longer rows has positions past its own
    // T: rope's bound is its table's rows (the CPU kernel's check).
    check_positions(s.positions, s.B, s.T, "rope", s.rows());
    kernels::cuda::rope(x, cos, sin, s, inverse, kStream);
  }
  void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) override {
    kernels::cuda::gqa_expand(qkv, q_kv, N, H, Hkv, hd, kStream);
  }
  void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) override {
    kernels::cuda::gqa_reduce(dq_kv, dqkv, N, H, Hkv, hd, kStream);
  }
  void copy_in(Buf& dst, const float* host, int64_t n) override {
    upload(dst, host, static_cast<size_t>(n) * sizeof(float), "upload of a model table");
  }
  void matmul(const kernels::MatmulDesc& d, CView a, CView b, float* c, CView bias) override {
    kernels::cuda::matmul(d, a, b, c, kStream, bias);
  }
  void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N) override {
    kernels::cuda::bias_backward(dbias, dy, M, N, kStream);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                         int64_t C, float eps) override {
    kernels::cuda::layernorm_forward(out, mean, rstd, x, w, b, N, C, kStream, eps);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, CView w,
                          const float* mean, const float* rstd, int64_t N, int64_t C) override {
    kernels::cuda::layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C, kStream);
  }
  void gelu_forward(float* out, const float* x, int64_t n) override { kernels::cuda::gelu_forward(out, x, n, kStream); }
  void gelu_backward(float* dx, const float* x, const float* dout, int64_t n) override {
    kernels::cuda::gelu_backward(dx, x, dout, n, kStream);
  }
  void add(float* out, const float* a, const float* b, int64_t n) override { kernels::cuda::add(out, a, b, n, kStream); }
  // 16-bit compute: the kernels write the matmul operands themselves (Note
  // [fused 16-bit operands] in kernels_cuda.h), the same bits as the kernel
  // then matmul_input; the fp32 outputs are not written.
  bool fuses_operand16(DType compute) const override { return is_16bit(compute); }
  bool fuses_every_operand16(DType compute) const override { return is_16bit(compute); }
  CView layernorm_forward_input(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                                int64_t C, DType compute, Buf& scratch) override {
    if (!is_16bit(compute)) return Ops::layernorm_forward_input(out, mean, rstd, x, w, b, N, C, compute, scratch);
    void* dst = operand16(scratch, N * C);
    kernels::cuda::layernorm_forward_16(dst, compute, mean, rstd, const_cast<float*>(x), nullptr, w, b, N, C,
                                        kStream);  // the GPT's eps
    return CView{dst, compute};
  }
  CView add_layernorm_forward_input(float* out, float* mean, float* rstd, float* x, const float* residual, CView w,
                                    CView b, int64_t N, int64_t C, DType compute, Buf& scratch) override {
    if (!is_16bit(compute)) {
      kernels::cuda::add_layernorm_forward(out, mean, rstd, x, residual, w, b, N, C, kStream);  // the GPT's eps
      return matmul_input(out, N * C, compute, scratch);
    }
    void* dst = operand16(scratch, N * C);
    kernels::cuda::layernorm_forward_16(dst, compute, mean, rstd, x, residual, w, b, N, C, kStream);
    return CView{dst, compute};
  }
  CView gelu_forward_input(float* out, const float* x, int64_t n, DType compute, Buf& scratch) override {
    if (!is_16bit(compute)) return Ops::gelu_forward_input(out, x, n, compute, scratch);
    void* dst = operand16(scratch, n);
    kernels::cuda::gelu_forward_16(dst, compute, x, n, kStream);
    return CView{dst, compute};
  }
  CView rmsnorm_forward_input(float* out, float* rstd, float* x, const float* residual, CView w, int64_t N, int64_t C,
                              float eps, float w_offset, DType compute, Buf& scratch) override {
    if (!is_16bit(compute))
      return Ops::rmsnorm_forward_input(out, rstd, x, residual, w, N, C, eps, w_offset, compute, scratch);
    void* dst = operand16(scratch, N * C);
    kernels::cuda::rmsnorm_forward_16(dst, compute, rstd, x, residual, w, N, C, eps, kStream, w_offset);
    return CView{dst, compute};
  }
  CView gated_forward_input(float* out, const float* gate_up, int64_t N, int64_t I, bool gelu, DType compute,
                            Buf& scratch) override {
    if (!is_16bit(compute)) return Ops::gated_forward_input(out, gate_up, N, I, gelu, compute, scratch);
    void* dst = operand16(scratch, N * I);
    kernels::cuda::gated_forward_16(dst, compute, gate_up, N, I, gelu, kStream);
    return CView{dst, compute};
  }
  CView dy_operand(const float* dy, float* db, int64_t M, int64_t N, DType compute, Buf& scratch) override {
    if (!db || !is_16bit(compute)) return Ops::dy_operand(dy, db, M, N, compute, scratch);
    void* dst = operand16(scratch, M * N);
    kernels::cuda::bias_backward_16(db, dst, compute, dy, M, N, kStream);
    return CView{dst, compute};
  }
  CView gelu_backward_operand(float* dx, float* db, const float* x, const float* dout, int64_t M, int64_t N,
                              DType compute, Buf& scratch) override {
    if (!is_16bit(compute)) return Ops::gelu_backward_operand(dx, db, x, dout, M, N, compute, scratch);
    void* dst = operand16(scratch, M * N);
    kernels::cuda::gelu_backward_bias_16(db, dst, compute, x, dout, M, N, kStream);
    return CView{dst, compute};
  }
  void add_layernorm_forward(float* out, float* mean, float* rstd, float* x, const float* residual, CView w, CView b,
                             int64_t N, int64_t C, float eps) override {
    kernels::cuda::add_layernorm_forward(out, mean, rstd, x, residual, w, b, N, C, kStream, eps);
  }
  void add_rmsnorm_forward(float* out, float* rstd, float* x, const float* residual, CView w, int64_t N, int64_t C,
                           float eps, float w_offset) override {
    kernels::cuda::add_rmsnorm_forward(out, rstd, x, residual, w, N, C, eps, kStream, w_offset);
  }
  void scale(float* x, float alpha, int64_t n) override { kernels::cuda::scale(x, alpha, n, kStream); }
  void copy_columns(float* dst, int64_t dst_W, const float* src, int64_t src_W, int64_t N, int64_t width) override {
    kernels::cuda::copy_columns(dst, dst_W, src, src_W, N, width, kStream);
  }
  void add_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) override {
    kernels::cuda::add_transposed(dst, ldd, src, lds, rows, cols, kStream);
  }
  void dropout(float* out, const float* x, int64_t n, float p, uint64_t key, bool accumulate,
               kernels::DropoutColumns window) override {
    kernels::cuda::dropout(out, x, n, p, key, accumulate, kStream, window);
  }
  void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T, int64_t C,
                         int64_t V, const int32_t* positions) override {
    if (!wpe.data) positions = nullptr;  // no positions without a position table (the CPU's rule)
    check_positions(positions, B, T, "embedding_forward");
    kernels::cuda::embedding_forward(out, tokens, wte, wpe, B, T, C, kStream, positions);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                          int64_t C, int64_t V, const int32_t* positions) override {
    auto it = indexes_.find(tokens);
    if (!dwpe) positions = nullptr;
    check_positions(positions, B, T, "embedding_backward");
    kernels::cuda::embedding_backward(dwte, dwpe, dout, tokens, B, T, C, kStream,
                                      it == indexes_.end() ? nullptr : &it->second, positions,
                                      positions ? &positions_.at(positions).index : nullptr);
  }
  double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, float* dlogits,
                       float dloss_scale) override {
    const int64_t counted = target_count(targets, "cross_entropy");
    kernels::cuda::cross_entropy(logits, targets, N, V, dlogits, dloss_scale, row_loss(N), kStream);
    return kernels::cuda::cross_entropy_mean(row_loss(N), N, counted, kStream);
  }
  double cross_entropy_operand16(const float* logits, const int32_t* targets, int64_t N, int64_t V, void* dlogits16,
                                 DType compute, float dloss_scale) override {
    const int64_t counted = target_count(targets, "cross_entropy_operand16");
    kernels::cuda::cross_entropy_16(logits, targets, N, V, dlogits16, compute, dloss_scale, row_loss(N), kStream);
    return kernels::cuda::cross_entropy_mean(row_loss(N), N, counted, kStream);
  }
  // Vocabulary parts (Note [vocabulary parts] in engine/tensor_parallel.cpp):
  // the kernels run on the GPU; the row maxima and sums the parts exchange
  // are host doubles (Ops), which go down and up here. The loss is summed
  // on the host in row order, as the CPU kernel sums it.
  void embedding_part_forward(float* out, const int32_t* tokens, CView wte, int64_t N, int64_t C, int64_t lo,
                              int64_t n) override {
    kernels::cuda::embedding_part_forward(out, tokens, wte, N, C, lo, n, kStream);
  }
  void embedding_part_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t lo,
                               int64_t n) override {
    kernels::cuda::embedding_part_backward(dwte, dout, tokens, N, C, lo, n, kStream);
  }
  void cross_entropy_part_max(const float* logits, int64_t N, int64_t Vp, double* row_maxes) override {
    if (N <= 0) return;
    double* d = part_doubles(3 * N);
    kernels::cuda::cross_entropy_part_max(logits, N, Vp, d, kStream);
    download(row_maxes, d, static_cast<size_t>(N) * sizeof(double), "cross_entropy_part_max: the row maxima");
  }
  void cross_entropy_part_sums(const float* logits, const int32_t* targets, int64_t N, int64_t Vp, int64_t lo,
                               const double* row_maxes, double* sums, float* dlogits) override {
    if (N <= 0) return;
    double* d = part_doubles(3 * N);
    copy_up(d, row_maxes, static_cast<size_t>(N) * sizeof(double), "cross_entropy_part_sums: the row maxima");
    kernels::cuda::cross_entropy_part_sums(logits, targets, N, Vp, lo, d, d + N, dlogits, kStream);
    download(sums, d + N, static_cast<size_t>(2 * N) * sizeof(double), "cross_entropy_part_sums: the row sums");
  }
  double cross_entropy_part_finish(const int32_t* targets, int64_t N, int64_t Vp, int64_t lo, const double* row_maxes,
                                   const double* sums, float* dlogits, float dloss_scale) override {
    if (N <= 0) return 0.0;
    auto host = target_hosts_.find(targets);
    if (host == target_hosts_.end() || static_cast<int64_t>(host->second.size()) < N)
      throw Error("cross_entropy_part_finish: targets that targets() did not upload");
    double total = 0;
    int64_t counted = 0;
    for (int64_t i = 0; i < N; ++i) {  // row order, as kernels::cross_entropy_part_finish
      if (host->second[static_cast<size_t>(i)] == kernels::kIgnoreTarget) continue;
      ++counted;
      total += std::log(sums[2 * i]) + static_cast<double>(static_cast<float>(row_maxes[i])) - sums[2 * i + 1];
    }
    if (dlogits) {
      double* d = part_doubles(3 * N);
      copy_up(d + N, sums, static_cast<size_t>(2 * N) * sizeof(double), "cross_entropy_part_finish: the row sums");
      kernels::cuda::cross_entropy_part_finish(targets, N, Vp, lo, d + N, dlogits, dloss_scale, kStream);
    }
    return counted > 0 ? total / static_cast<double>(counted) : 0.0;
  }
  void copy_in_i32(Buf& dst, const int32_t* host, int64_t n) override {
    upload(dst, host, static_cast<size_t>(n) * sizeof(int32_t), "upload of int32 values");
  }
  void to_f32(float* out, CView x, int64_t n) override {
    if (x.dtype == DType::kF32)
      ZINC_CUDA_CHECK(cudaMemcpyAsync(out, x.data, static_cast<size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice,
                                      kStream),
                      "copy of floats");
    else
      kernels::cuda::convert_16_to_f32(x.data, out, n, x.dtype, kStream);
  }
  void copy_out(float* host, const float* src, int64_t n) override {
    download(host, src, static_cast<size_t>(n) * sizeof(float), "download of floats");
  }
  void copy_out_i32(int32_t* host, const int32_t* src, int64_t n) override {
    download(host, src, static_cast<size_t>(n) * sizeof(int32_t), "download of int32 values");
  }
  // A fresh device buffer holding `bytes` of host data, and the reverse;
  // both wait for the copy (the host memory may go right after).
  void upload(Buf& dst, const void* host, size_t bytes, const char* what) {
    dst = alloc(bytes);
    ZINC_CUDA_CHECK(cudaMemcpyAsync(dst.data(), host, bytes, cudaMemcpyHostToDevice, kStream), what);
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kStream), what);
  }
  // n doubles of device scratch for the vocabulary parts' row values.
  double* part_doubles(int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * sizeof(double);
    if (part_doubles_.bytes() < bytes) regrow(part_doubles_, bytes);
    return part_doubles_.as<double>();
  }
  // Host values into existing device memory, waiting for the copy.
  void copy_up(void* dst, const void* host, size_t bytes, const char* what) {
    ZINC_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, kStream), what);
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kStream), what);
  }
  void download(void* host, const void* src, size_t bytes, const char* what) {
    ZINC_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, kStream), what);
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kStream), what);
  }
  void moe_route(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs, int32_t* expert,
                 float* weight) override {
    kernels::cuda::moe_route(logits, N, E, k, renormalize, probs, expert, weight, kStream);
  }
  void moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* dweight,
                          const float* dprobs, int64_t N, int64_t E, int64_t k, bool renormalize,
                          float* dlogits) override {
    kernels::cuda::moe_route_backward(probs, expert, weight, dweight, dprobs, N, E, k, renormalize, dlogits, kStream);
  }
  void moe_gather(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C) override {
    kernels::cuda::moe_gather(xg, x, token_of_row, M, C, kStream);
  }
  void moe_combine(float* out, const float* y, const float* weight, const int32_t* row_of_slot, int64_t N, int64_t k,
                   int64_t C) override {
    kernels::cuda::moe_combine(out, y, weight, row_of_slot, N, k, C, kStream);
  }
  void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const float* weight,
                            const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) override {
    kernels::cuda::moe_combine_backward(dy, dweight, dout, y, weight, row_of_slot, N, k, C, kStream);
  }
  void moe_gather_backward(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N, int64_t k,
                           int64_t C) override {
    kernels::cuda::moe_gather_backward(dx, dxg, row_of_slot, N, k, C, kStream);
  }
  int64_t attention_workspace_bytes(kernels::AttentionShape s, DType compute) const override {
    return kernels::cuda::attention_workspace_bytes(s, compute);
  }
  // cuBLAS's workspace is the estimate's part of its own; the unfused
  // attention's buffers are what the kernels grow.
  int64_t kernel_scratch_bytes(const kernels::ScratchTally&, kernels::AttentionShape s,
                               DType compute) const override {
    return kernels::cuda::attention_scratch_bytes(s, compute);
  }
  // A 16-bit copy of every matmul input, in bf16 and fp16 alike (operand16).
  int64_t matmul_input_bytes(int64_t n, DType compute) const override {
    return is_16bit(compute) ? detail::buffer_bytes(n, 2) : 0;
  }
  bool attention_reads_kv_heads(int64_t head_dim, DType compute) const override {
    return kernels::cuda::fused_attention_used(head_dim, compute);
  }
  void* attention_create() override { return kernels::cuda::attention_workspace_create(); }
  void attention_destroy(void* ws) override {
    kernels::cuda::attention_workspace_destroy(static_cast<kernels::cuda::CudaAttentionWorkspace*>(ws));
  }
  void attention_forward(void* ws, float* out, const float* qkv, kernels::AttentionShape s, DType compute) override {
    attention_checks(s, compute);
    kernels::cuda::attention_forward(static_cast<kernels::cuda::CudaAttentionWorkspace*>(ws), out, qkv, s, compute,
                                     kStream);
  }
  CView attention_forward_input(void* ws, float* out, const float* qkv, kernels::AttentionShape s, DType compute,
                                Buf& scratch) override {
    if (!is_16bit(compute)) return Ops::attention_forward_input(ws, out, qkv, s, compute, scratch);
    attention_checks(s, compute);
    void* dst = operand16(scratch, s.B * s.T * s.C);
    kernels::cuda::attention_forward(static_cast<kernels::cuda::CudaAttentionWorkspace*>(ws), out, qkv, s, compute,
                                     kStream, dst);
    return CView{dst, compute};
  }
  void attention_checks(kernels::AttentionShape s, DType compute) {
    check_positions(s.positions, s.B, s.T, "attention_forward");
    const int64_t head_dim = s.C / s.H;
    if (is_16bit(compute) && head_dim > 128) {
      // Once per process: why this model's attention keeps T x T floats per head.
      static std::once_flag said;
      std::call_once(said, [&] {
        log_warn("attention: head size " + std::to_string(head_dim) +
                 " is over the fused GPU kernels' 128, so it runs unfused: each layer keeps " +
                 "B x heads x T x T fp32 probabilities for backward");
      });
    }
  }
  void attention_backward(void* ws, float* dqkv, const float* dout, const float* qkv, kernels::AttentionShape s,
                          DType compute) override {
    check_positions(s.positions, s.B, s.T, "attention_backward");
    kernels::cuda::attention_backward(static_cast<kernels::cuda::CudaAttentionWorkspace*>(ws), dqkv, dout, qkv, s,
                                      compute, kStream);
  }
  // cuBLAS multiplies 16-bit operands natively: a converted copy.
  CView matmul_input(float* x, int64_t n, DType compute, Buf& scratch) override {
    if (!is_16bit(compute)) return CView{x, DType::kF32};
    return operand16_copy(x, n, compute, scratch);
  }
  CView operand16_copy(const float* dy, int64_t n, DType compute, Buf& scratch) override {
    void* dst = operand16(scratch, n);
    kernels::cuda::convert_f32_to_16(dy, dst, n, compute, kStream);
    return CView{dst, compute};
  }

 private:
  // A device copy of a batch's positions, as positions() left it.
  struct DevicePositions {
    std::vector<int32_t> host;        // (B*T) what was uploaded
    kernels::cuda::TokenIndex index;  // its rows grouped by position
    int64_t checked_B = -1, checked_T = -1, checked_limit = -1;  // the check check_positions last passed
  };

  // A grow-only buffer replaced by a larger one: the old goes first, so
  // the GPU never holds both (cudaFree waits for the work that reads it).
  // The estimates count the larger alone.
  void regrow(Buf& buf, size_t bytes) {
    buf = Buf{};
    buf = alloc(bytes);
  }
  // scratch grown to n 16-bit values (grow-only).
  void* operand16(Buf& scratch, int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * 2;
    if (scratch.bytes() < bytes) regrow(scratch, bytes);
    return scratch.data();
  }
  void upload(const std::vector<int32_t>& host, Buf& store, const char* what) {
    const size_t bytes = host.size() * sizeof(int32_t);
    if (store.bytes() < bytes) regrow(store, bytes);
    ZINC_CUDA_CHECK(cudaMemcpyAsync(store.data(), host.data(), bytes, cudaMemcpyHostToDevice, kStream), what);
  }

  // Each position of the (B,T) batch in [0, t] for its token t, or with a
  // `limit` in [0, limit): the CPU kernels' checks (attention's, which
  // implies the embedding's [0, T); rope's against its table), done on the
  // host copy since the kernels get device memory.
  void check_positions(const int32_t* pos, int64_t B, int64_t T, const char* fn, int64_t limit = 0) {
    if (!pos) return;
    auto it = positions_.find(pos);
    if (it == positions_.end())
      throw Error(std::string(fn) + ": positions that positions() did not upload (they cannot be checked)");
    DevicePositions& d = it->second;
    if (d.checked_B == B && d.checked_T == T && d.checked_limit == limit) return;
    if (static_cast<int64_t>(d.host.size()) != B * T)
      throw Error(std::string(fn) + ": " + std::to_string(d.host.size()) + " positions for B*T = " +
                  std::to_string(B * T) + " tokens");
    for (int64_t r = 0; r < B * T; ++r) {
      const int64_t t = r % T, p = d.host[static_cast<size_t>(r)];
      if (limit > 0 && (p < 0 || p >= limit))
        throw Error(std::string(fn) + ": position " + std::to_string(p) + " at row " + std::to_string(r) +
                    " is outside [0, " + std::to_string(limit) + ")");
      if (limit <= 0 && (p < 0 || p > t))
        throw Error(std::string(fn) + ": position " + std::to_string(p) + " of row " + std::to_string(r / T) +
                    ", token " + std::to_string(t) + " is outside [0, " + std::to_string(t) +
                    "] (a document cannot begin before its row)");
    }
    d.checked_B = B;
    d.checked_T = T;
    d.checked_limit = limit;
  }

  // The cross-entropy's per-row losses (device scratch of N doubles), and
  // the count of rows with a target that targets() took of `targets`.
  double* row_loss(int64_t N) {
    const size_t bytes = static_cast<size_t>(N) * sizeof(double);
    if (row_loss_.bytes() < bytes) regrow(row_loss_, bytes);
    return row_loss_.as<double>();
  }
  int64_t target_count(const int32_t* targets, const char* fn) const {
    auto counted = target_counts_.find(targets);
    if (counted == target_counts_.end())
      throw Error(std::string(fn) + ": targets that targets() did not upload (their count is not known)");
    return counted->second;
  }

  Buf row_loss_, part_doubles_;
  std::unordered_map<const void*, kernels::cuda::TokenIndex> indexes_;
  std::unordered_map<const void*, std::vector<int32_t>> target_hosts_;  // device targets -> their host values
  std::unordered_map<const void*, int64_t> target_counts_;  // device targets -> how many are not kIgnoreTarget
  std::unordered_map<const void*, DevicePositions> positions_;
};

}  // namespace

Ops& cuda_ops() {
  const CudaStatus& st = cuda_status();
  if (st.devices == 0) throw Error("device \"cuda\": no GPU is visible (" + st.why + ")");
  static CudaOps ops;
  return ops;
}

}  // namespace zinc::models::detail
