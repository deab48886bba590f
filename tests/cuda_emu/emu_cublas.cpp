// The cuBLAS of kernel emulation (Note [kernel emulation] in cuda_emu.h): a
// shared library with the C entry points matmul.cu opens, computing
// cublasGemmStridedBatchedEx by its documented definition (column-major,
//   C_b = alpha op(A_b) op(B_b) + beta C_b,  op(X) = X or X^T,
// C not read when beta == 0) with the argument checks cuBLAS documents, so
// that zinc's row-major mapping (Note [cuBLAS matmul layout]) and its
// leading dimensions and strides are checked without a GPU. 16-bit operands
// are widened exactly; products are summed in fp32 in k order (cuBLAS sums in
// another order: results are close to it, not equal).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "tests/cuda_emu/emu_gemm.h"
#include "tests/cuda_emu/include/cublas_v2.h"

namespace {

struct Handle {
  bool workspace_set = false;
  cudaStream_t stream = nullptr;
};

// One GEMM call's arguments, alpha and beta read at the call (host pointer mode).
struct Gemm {
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc, batch;
  long long sa, sb, sc;
  const void *A, *B;
  cudaDataType at, bt;
  float alpha, beta;
  float* C;
  void run() const;
};

bool known(cudaDataType t) { return t == CUDA_R_32F || t == CUDA_R_16F || t == CUDA_R_16BF; }

}  // namespace

// In the test executable (tests/cuda_emu/cuda_emu.cpp, exported).
extern "C" void zinc_emu_enqueue(cudaStream_t stream, void (*fn)(void*), void* arg);

void Gemm::run() const {
  std::vector<float> w, bcol(static_cast<size_t>(k)), col(static_cast<size_t>(m));
  for (long long b = 0; b < batch; ++b) {
    zinc_emu_gemm::widen_a(A, at, b * sa, lda, ta == CUBLAS_OP_T, m, k, w);
    for (int j = 0; j < n; ++j) {
      for (int l = 0; l < k; ++l)
        bcol[static_cast<size_t>(l)] =
            zinc_emu_gemm::load(B, bt, b * sb + (tb == CUBLAS_OP_N ? l + static_cast<long long>(j) * ldb
                                                                   : j + static_cast<long long>(l) * ldb));
      zinc_emu_gemm::column(w, bcol.data(), m, k, col.data());
      float* out = C + b * sc + static_cast<long long>(j) * ldc;
      for (int i = 0; i < m; ++i) out[i] = beta == 0.0f ? alpha * col[i] : alpha * col[i] + beta * out[i];
    }
  }
}

extern "C" {

const char* cublasGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    default: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
}
const char* cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "success" : "an invalid or unsupported argument (kernel emulation)";
}
cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
  *h = reinterpret_cast<cublasHandle_t>(new Handle());
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  delete reinterpret_cast<Handle*>(h);
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t) {
  return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t h, cublasPointerMode_t mode) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  return mode == CUBLAS_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t stream) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  reinterpret_cast<Handle*>(h)->workspace_set = false;  // as cuBLAS: a new stream resets the workspace
  reinterpret_cast<Handle*>(h)->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void* ws, size_t bytes) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (bytes && !ws) return CUBLAS_STATUS_INVALID_VALUE;
  reinterpret_cast<Handle*>(h)->workspace_set = true;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void* alpha_p, const void* A, cudaDataType at, int lda,
                                          long long sa, const void* B, cudaDataType bt, int ldb, long long sb,
                                          const void* beta_p, void* C, cudaDataType ct, int ldc, long long sc,
                                          int batch, cublasComputeType_t compute, cublasGemmAlgo_t) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  // The documented checks.
  if (m < 0 || n < 0 || k < 0 || batch < 0) return CUBLAS_STATUS_INVALID_VALUE;
  if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (lda < std::max(1, ta == CUBLAS_OP_N ? m : k) || ldb < std::max(1, tb == CUBLAS_OP_N ? k : n) ||
      ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (!known(at) || !known(bt) || ct != CUDA_R_32F || at != bt || compute != CUBLAS_COMPUTE_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  auto* g = new Gemm{ta, tb, m, n, k, lda, ldb, ldc, batch, sa, sb, sc, A, B, at, bt,
                     *static_cast<const float*>(alpha_p), *static_cast<const float*>(beta_p), static_cast<float*>(C)};
  // In order on the handle's stream (Note [emulated streams] in cuda_emu.cpp).
  zinc_emu_enqueue(reinterpret_cast<Handle*>(h)->stream, [](void* p) {
    std::unique_ptr<Gemm> g(static_cast<Gemm*>(p));
    g->run();
  }, g);
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
