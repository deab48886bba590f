// The cuBLASLt of kernel emulation (Note [kernel emulation] in cuda_emu.h):
// a shared library with the C entry points matmul.cu opens for its fused
// bias, computing cublasLtMatmul by its documented definition (column-major,
//   D = alpha op(A) op(B) + beta C, then + bias[i] on row i of D with
//   CUBLASLT_EPILOGUE_BIAS; C not read when beta == 0),
// with the checks the documentation states: each layout's rows and columns
// against the operation's m, n and k, the attribute sizes, a bias pointer
// and a bias of D's type with the bias epilogue, an algorithm from the
// heuristic and the workspace it asked for. 16-bit operands are widened
// exactly; products are summed in fp32 in k order, then the bias added (the
// emulated GEMM of emu_cublas.cpp, then zinc's add_bias, gives the same
// bits).
#include <cstring>
#include <memory>
#include <vector>

#include "tests/cuda_emu/emu_gemm.h"
#include "tests/cuda_emu/include/cublasLt.h"

// In the test executable (tests/cuda_emu/cuda_emu.cpp, exported).
extern "C" void zinc_emu_enqueue(cudaStream_t stream, void (*fn)(void*), void* arg);

struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType scale;
  int32_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
  uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  int32_t bias_type = -1;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch = 1;
  int64_t stride = 0;
};
struct cublasLtMatmulPreferenceOpaque_t {
  uint64_t max_workspace = 0;
};

namespace {

constexpr uint64_t kAlgoMark = 0x7a696e634c74ULL;  // the heuristic's algorithm

bool known(cudaDataType t) { return t == CUDA_R_32F || t == CUDA_R_16F || t == CUDA_R_16BF; }

template <class T>
cublasStatus_t set(T& field, const void* buf, size_t bytes) {
  if (!buf || bytes != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

// The operation's shape from the descriptors, or a status: op(A) (m,k),
// op(B) (k,n), C and D (m,n), the same batch everywhere; the types zinc
// asks for (16-bit or fp32 A and B alike, fp32 C and D, fp32 compute and
// scale); with the bias epilogue a bias pointer (at the call) of D's type.
struct Shape {
  int64_t m, n, k;
  int32_t batch;
};
cublasStatus_t check(const cublasLtMatmulDescOpaque_t* op, const cublasLtMatrixLayoutOpaque_t* a,
                     const cublasLtMatrixLayoutOpaque_t* b, const cublasLtMatrixLayoutOpaque_t* c,
                     const cublasLtMatrixLayoutOpaque_t* d, bool at_call, Shape& s) {
  if (!op || !a || !b || !c || !d) return CUBLAS_STATUS_INVALID_VALUE;
  if (op->compute != CUBLAS_COMPUTE_32F || op->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!known(a->type) || a->type != b->type || c->type != CUDA_R_32F || d->type != CUDA_R_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (op->epilogue != CUBLASLT_EPILOGUE_DEFAULT && op->epilogue != CUBLASLT_EPILOGUE_BIAS)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (op->epilogue == CUBLASLT_EPILOGUE_BIAS && op->bias_type != -1 && op->bias_type != d->type)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (at_call && op->epilogue == CUBLASLT_EPILOGUE_BIAS && !op->bias) return CUBLAS_STATUS_INVALID_VALUE;
  const bool ta = op->ta == CUBLAS_OP_T, tb = op->tb == CUBLAS_OP_T;
  s.m = static_cast<int64_t>(d->rows);
  s.n = static_cast<int64_t>(d->cols);
  s.k = static_cast<int64_t>(ta ? a->rows : a->cols);
  s.batch = d->batch;
  if ((ta ? a->cols : a->rows) != d->rows || (tb ? b->rows : b->cols) != d->cols ||
      (tb ? b->cols : b->rows) != static_cast<uint64_t>(s.k) || c->rows != d->rows || c->cols != d->cols ||
      c->ld != d->ld)
    return CUBLAS_STATUS_INVALID_VALUE;
  for (const auto* l : {a, b, c, d})
    if (l->ld < static_cast<int64_t>(l->rows) || l->ld < 1 || l->batch != s.batch) return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

struct Call {
  Shape s;
  bool ta, tb, bias;
  cudaDataType ab;
  const void *A, *B, *bias_p;
  int64_t lda, ldb, ldd, sa, sb, sd;
  float alpha, beta;
  float* D;
  void run() const {
    std::vector<float> w, bcol(static_cast<size_t>(s.k)), col(static_cast<size_t>(s.m));
    for (int32_t bt = 0; bt < s.batch; ++bt) {
      zinc_emu_gemm::widen_a(A, ab, bt * sa, lda, ta, s.m, s.k, w);
      for (int64_t j = 0; j < s.n; ++j) {
        for (int64_t l = 0; l < s.k; ++l) bcol[l] = zinc_emu_gemm::load(B, ab, bt * sb + (tb ? j + l * ldb : l + j * ldb));
        zinc_emu_gemm::column(w, bcol.data(), s.m, s.k, col.data());
        for (int64_t i = 0; i < s.m; ++i) {
          float& out = D[bt * sd + i + j * ldd];
          float v = beta == 0.0f ? alpha * col[i] : alpha * col[i] + beta * out;
          if (bias) v += static_cast<const float*>(bias_p)[i];
          out = v;
        }
      }
    }
  }
};

}  // namespace

extern "C" {

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  if (!h) return CUBLAS_STATUS_INVALID_VALUE;
  *h = new cublasLtContext();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasLtGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    default: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
}
const char* cublasLtGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "success" : "an invalid or unsupported argument (kernel emulation)";
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  *d = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t bytes) {
  if (!d) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA: return set(d->ta, buf, bytes);
    case CUBLASLT_MATMUL_DESC_TRANSB: return set(d->tb, buf, bytes);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return set(d->epilogue, buf, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return set(d->bias, buf, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return set(d->bias_type, buf, bytes);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t bytes) {
  if (!l) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return set(l->batch, buf, bytes);
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: return set(l->stride, buf, bytes);
    default: return CUBLAS_STATUS_NOT_SUPPORTED;
  }
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  *p = new cublasLtMatmulPreferenceOpaque_t();
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t bytes) {
  if (!p) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES) return CUBLAS_STATUS_NOT_SUPPORTED;
  return set(p->max_workspace, buf, bytes);
}
// One algorithm; it asks for 1 KiB of workspace when the preference allows
// it (so a caller that passes none fails), none otherwise.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref,
                                              int requested, cublasLtMatmulHeuristicResult_t results[],
                                              int* returned) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!pref || requested < 1 || !results || !returned) return CUBLAS_STATUS_INVALID_VALUE;
  Shape s;
  const cublasStatus_t st = check(op, a, b, c, d, false, s);
  *returned = 0;
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  std::memset(&results[0], 0, sizeof(results[0]));
  results[0].algo.data[0] = kAlgoMark;
  results[0].workspaceSize = pref->max_workspace >= 1024 ? 1024 : 0;
  results[0].algo.data[1] = results[0].workspaceSize;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t op, const void* alpha, const void* A,
                              cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                              const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                              const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
  Shape s;
  const cublasStatus_t st = check(op, a, b, c, d, true, s);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (!alpha || !beta || !A || !B || !D || !algo || algo->data[0] != kAlgoMark) return CUBLAS_STATUS_INVALID_VALUE;
  if ((workspace_bytes && !workspace) || workspace_bytes < algo->data[1]) return CUBLAS_STATUS_INVALID_VALUE;
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  if (be != 0.0f && C != D) return CUBLAS_STATUS_NOT_SUPPORTED;  // zinc passes C = D
  auto* call = new Call{s, op->ta == CUBLAS_OP_T, op->tb == CUBLAS_OP_T, op->epilogue == CUBLASLT_EPILOGUE_BIAS, a->type,
                        A, B, op->bias, a->ld, b->ld, d->ld, a->stride, b->stride, d->stride, al, be,
                        static_cast<float*>(D)};
  // In order on the stream (Note [emulated streams] in cuda_emu.cpp).
  zinc_emu_enqueue(stream, [](void* p) {
    std::unique_ptr<Call> c(static_cast<Call*>(p));
    c->run();
  }, call);
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
