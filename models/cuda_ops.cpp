// The GPU's Ops (CUDA builds): kernels_cuda.h on device memory, every call
// enqueued on the legacy default stream (the model's compute stream; the
// engine orders its parameter uploads and gradient copies against it with
// events). Host code never reads the activations: only the loss comes back
// (cross_entropy synchronises the stream to return it).
#include <cuda_runtime_api.h>

#include <string>
#include <unordered_map>

#include "core/cuda_util.h"
#include "core/device.h"
#include "core/error.h"
#include "kernels/kernels_cuda.h"
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
      ZINC_CUDA_CHECK(cudaMalloc(&p, bytes), ("model activations: cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
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
    const size_t bytes = host.size() * sizeof(int32_t);
    if (store.bytes() < bytes) store = alloc(bytes);
    ZINC_CUDA_CHECK(cudaMemcpyAsync(store.data(), host.data(), bytes, cudaMemcpyHostToDevice, kStream),
                    "upload of the batch's tokens");
    // The embedding's inputs also get their rows grouped by token, for a
    // parallel embedding backward (kernels::cuda::TokenIndex), kept per
    // device copy (so per model).
    if (std::string(what) == "embedding_forward")
      indexes_[store.data()].build(host.data(), static_cast<int64_t>(host.size()), V, kStream);
    return store.as<int32_t>();
  }
  // Masked targets and packed documents are refused until their CUDA
  // twins exist (issue 31), with one line naming the batch field.
  const int32_t* targets(const std::vector<int32_t>& host, int64_t V, Buf& store) override {
    for (size_t i = 0; i < host.size(); ++i)
      if (host[i] == kernels::kIgnoreTarget)
        throw Error("batch.targets: masked targets (" + std::to_string(kernels::kIgnoreTarget) + " at position " +
                    std::to_string(i) + ") are not supported with \"device\": \"cuda\" yet");
    return tokens(host, V, "cross_entropy", store);
  }
  const int32_t* positions(const std::vector<int32_t>& host, Buf& store) override {
    if (host.empty()) return nullptr;
    throw Error("batch.positions: packed documents are not supported with \"device\": \"cuda\" yet");
  }
  // The Llama kernels' CUDA twins (llama_layers.cu), bit for bit the CPU's.
  void rmsnorm_forward(float* out, float* rstd, const float* x, CView w, int64_t N, int64_t C, float eps) override {
    kernels::cuda::rmsnorm_forward(out, rstd, x, w, N, C, eps, kStream);
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, CView w, const float* rstd, int64_t N,
                        int64_t C) override {
    kernels::cuda::rmsnorm_backward(dx, dw, dout, x, w, rstd, N, C, kStream);
  }
  void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) override {
    kernels::cuda::swiglu_forward(out, gate_up, N, I, kStream);
  }
  void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N, int64_t I) override {
    kernels::cuda::swiglu_backward(dgate_up, dout, gate_up, N, I, kStream);
  }
  void rope(float* x, const float* cos, const float* sin, kernels::RopeShape s, bool inverse) override {
    kernels::cuda::rope(x, cos, sin, s, inverse, kStream);
  }
  void gqa_expand(float* qkv, const float* q_kv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) override {
    kernels::cuda::gqa_expand(qkv, q_kv, N, H, Hkv, hd, kStream);
  }
  void gqa_reduce(float* dq_kv, const float* dqkv, int64_t N, int64_t H, int64_t Hkv, int64_t hd) override {
    kernels::cuda::gqa_reduce(dq_kv, dqkv, N, H, Hkv, hd, kStream);
  }
  void copy_in(Buf& dst, const float* host, int64_t n) override {
    dst = alloc(static_cast<size_t>(n) * sizeof(float));
    ZINC_CUDA_CHECK(cudaMemcpyAsync(dst.data(), host, static_cast<size_t>(n) * sizeof(float), cudaMemcpyHostToDevice,
                                    kStream),
                    "upload of a model table");
    ZINC_CUDA_CHECK(cudaStreamSynchronize(kStream), "upload of a model table");
  }
  void matmul(const kernels::MatmulDesc& d, CView a, CView b, float* c, CView bias) override {
    kernels::cuda::matmul(d, a, b, c, kStream, bias);
  }
  void bias_backward(float* dbias, const float* dy, int64_t M, int64_t N) override {
    kernels::cuda::bias_backward(dbias, dy, M, N, kStream);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, CView w, CView b, int64_t N,
                         int64_t C) override {
    kernels::cuda::layernorm_forward(out, mean, rstd, x, w, b, N, C, kStream);
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
  void scale(float* x, float alpha, int64_t n) override { kernels::cuda::scale(x, alpha, n, kStream); }
  void embedding_forward(float* out, const int32_t* tokens, CView wte, CView wpe, int64_t B, int64_t T, int64_t C,
                         int64_t V, const int32_t* positions) override {
    kernels::cuda::embedding_forward(out, tokens, wte, wpe, B, T, C, kStream);
  }
  void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                          int64_t C, int64_t V, const int32_t* positions) override {
    auto it = indexes_.find(tokens);
    kernels::cuda::embedding_backward(dwte, dwpe, dout, tokens, B, T, C, kStream,
                                      it == indexes_.end() ? nullptr : &it->second);
  }
  double cross_entropy(const float* logits, const int32_t* targets, int64_t N, int64_t V, float* dlogits,
                       float dloss_scale) override {
    const size_t bytes = static_cast<size_t>(N) * sizeof(double);
    if (row_loss_.bytes() < bytes) row_loss_ = alloc(bytes);
    kernels::cuda::cross_entropy(logits, targets, N, V, dlogits, dloss_scale, row_loss_.as<double>(), kStream);
    return kernels::cuda::cross_entropy_mean(row_loss_.as<double>(), N, kStream);
  }
  void* attention_create() override { return kernels::cuda::attention_workspace_create(); }
  void attention_destroy(void* ws) override {
    kernels::cuda::attention_workspace_destroy(static_cast<kernels::cuda::CudaAttentionWorkspace*>(ws));
  }
  void attention_forward(void* ws, float* out, const float* qkv, kernels::AttentionShape s, DType compute) override {
    kernels::cuda::attention_forward(static_cast<kernels::cuda::CudaAttentionWorkspace*>(ws), out, qkv, s, compute,
                                     kStream);
  }
  void attention_backward(void* ws, float* dqkv, const float* dout, const float* qkv, kernels::AttentionShape s,
                          DType compute) override {
    kernels::cuda::attention_backward(static_cast<kernels::cuda::CudaAttentionWorkspace*>(ws), dqkv, dout, qkv, s,
                                      compute, kStream);
  }
  // cuBLAS multiplies 16-bit operands natively: a converted copy.
  CView matmul_input(float* x, int64_t n, DType compute, Buf& scratch) override {
    if (!is_16bit(compute)) return CView{x, DType::kF32};
    return operand16_copy(x, n, compute, scratch);
  }
  CView operand16_copy(const float* dy, int64_t n, DType compute, Buf& scratch) override {
    const size_t bytes = static_cast<size_t>(n) * 2;
    if (scratch.bytes() < bytes) scratch = alloc(bytes);
    kernels::cuda::convert_f32_to_16(dy, scratch.data(), n, compute, kStream);
    return CView{scratch.data(), compute};
  }

 private:
  Buf row_loss_;
  std::unordered_map<const void*, kernels::cuda::TokenIndex> indexes_;
};

}  // namespace

Ops& cuda_ops() {
  const CudaStatus& st = cuda_status();
  if (st.devices == 0) throw Error("device \"cuda\": no GPU is visible (" + st.why + ")");
  static CudaOps ops;
  return ops;
}

}  // namespace zinc::models::detail
