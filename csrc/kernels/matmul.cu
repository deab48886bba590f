// matmul on the GPU through cuBLAS (kernels_cuda.h).
//
// Note [cuBLAS matmul layout]
// cuBLAS is column-major; zinc's matrices are row-major. A row-major (R,C)
// matrix is the column-major (C,R) matrix of the same bytes, i.e. its
// transpose. So the row-major C = op(A) op(B) is computed as the column-major
// C^T = op(B)^T op(A)^T: cuBLAS's first operand is B, its second A, with
// m = N, n = M, k = K and
//   B: trans_b ? stored (N,K) -> op T, ld K : stored (K,N) -> op N, ld N
//   A: trans_a ? stored (K,M) -> op T, ld M : stored (M,K) -> op N, ld K
//   C: ld N.
// Batches are contiguous as in the CPU contract (strides M*K, K*N, M*N), one
// cublasGemmStridedBatchedEx call for all of them. alpha is cuBLAS's alpha;
// accumulate is beta = 1 (else 0).
//
// Precision: CUBLAS_COMPUTE_32F for every dtype, math mode CUBLAS_DEFAULT_MATH
// (no TF32: fp32 operands are multiplied in fp32). kBF16 / kF16 pass 16-bit
// operands (CUDA_R_16BF / CUDA_R_16F) with fp32 C, so products of two 16-bit
// values are exact and accumulated in fp32, as on the CPU (Note [fp16
// compute] in matmul.cpp: the CPU rounds fp32 operands to fp16 and multiplies
// the fp16 values in fp32; here the same fp16 values go to the tensor cores:
// the same products, a different summation order). The results are therefore
// close to the CPU's, not bit-identical.
//
// Operands whose dtype differs from `compute` are converted into device
// scratch by convert_operand below (float_to_16 / from_16 of core/dtype.h, the
// CPU's bits): fp32 -> the 16-bit compute dtype (rounded, as the CPU rounds
// them), 16-bit -> fp32 for fp32 compute (exact), and the other 16-bit format
// -> compute (through fp32).
//
// Bias: see Note [the bias in the GEMM's epilogue]. Where the epilogue does
// not apply, cuda::add_bias (layers.cu) after the GEMM, c[r, j] += bias[j]
// (bias in any dtype), on the same stream; with accumulate the GEMM adds C
// first (beta = 1), then the bias.
//
// Note [the bias in the GEMM's epilogue]
// A separate bias pass reads and writes all of C in fp32: 8 bytes an
// element, against the GEMM's 2K flops an element. At the GPT's K = 1024 on
// an H200 (about 4.8 TB/s, about 500 dense bf16 TFLOP/s at these shapes)
// that is about half the GEMM's own time, and the forward has four such
// products per layer. So a matmul with a bias, alpha 1, one batch and no
// accumulate runs as one cublasLtMatmul with CUBLASLT_EPILOGUE_BIAS
// (D = op(A) op(B) + bias, the bias broadcast over D's columns: zinc's
// rows), the same layouts as Note [cuBLAS matmul layout]. cuBLASLt wants
// the bias in D's dtype (fp32), 16-byte aligned: it is converted (or
// copied) into per-stream scratch first, N floats. The plan (descriptor,
// layouts and the heuristic's first algorithm within the stream's
// workspace) is made once per shape and thread; a shape the heuristic has
// no algorithm for, or a machine whose cuBLASLt does not load, keeps the
// separate pass. The sum is cuBLAS's fp32 accumulator plus the bias in
// fp32, as the separate pass adds it; cuBLASLt may pick another algorithm
// than cublasGemmEx for the shape, so the bits are close to the separate
// pass's, not equal (under kernel emulation they are equal).
// ZINC_CUDA_MATMUL_BIAS=separate keeps the separate pass everywhere (for
// measuring the difference).
//
// Handles and scratch: one cuBLAS handle per (calling thread, device), math
// mode and pointer mode set once. Each call sets the handle to its stream;
// cublasSetStream resets cuBLAS's workspace, so the call then hands it a
// workspace of its own for that stream, together with the grow-only
// conversion scratch (also per stream: two streams of one thread may run
// at once, and must not share scratch; at most kMaxStreams streams per
// thread and device keep scratch). Growing a buffer first waits for its
// stream, since the old buffer may still be read there.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "core/dynlib.h"
#include "core/error.h"
#include "core/log.h"
#include "kernels/cuda_common.cuh"
#include "kernels/gpu_profile.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda.h"

namespace zinc::kernels::cuda {
namespace {

// cuBLAS's functions, from libcublas opened on first use (core/dynlib.h:
// linking it would load it into every zinc process, GPU or not). The names
// go through cublas_v2.h's macros (cublasCreate is cublasCreate_v2).
#define ZINC_STR_(x) #x
#define ZINC_STR(x) ZINC_STR_(x)
// The C entry point (the header adds a C++ overload of the same name).
using GemmStridedBatchedExFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                                  const void*, const void*, cudaDataType, int, long long int,
                                                  const void*, cudaDataType, int, long long int, const void*, void*,
                                                  cudaDataType, int, long long int, int, cublasComputeType_t,
                                                  cublasGemmAlgo_t);
struct CublasApi {
  DynLib lib;
  decltype(&::cublasGetStatusName) GetStatusName;
  decltype(&::cublasGetStatusString) GetStatusString;
  decltype(&::cublasCreate) Create;
  decltype(&::cublasSetMathMode) SetMathMode;
  decltype(&::cublasSetPointerMode) SetPointerMode;
  decltype(&::cublasDestroy) Destroy;
  decltype(&::cublasSetStream) SetStream;
  decltype(&::cublasSetWorkspace) SetWorkspace;
  GemmStridedBatchedExFn GemmStridedBatchedEx;

  CublasApi()
      : lib(DynLib::open({"libcublas.so." ZINC_STR(CUBLAS_VER_MAJOR), ZINC_CUDA_LIB_DIR "/libcublas.so." ZINC_STR(CUBLAS_VER_MAJOR)},
                         "cuBLAS (the GPU matmuls)")) {
    GetStatusName = lib.get<decltype(&::cublasGetStatusName)>(ZINC_STR(cublasGetStatusName));
    GetStatusString = lib.get<decltype(&::cublasGetStatusString)>(ZINC_STR(cublasGetStatusString));
    Create = lib.get<decltype(&::cublasCreate)>(ZINC_STR(cublasCreate));
    SetMathMode = lib.get<decltype(&::cublasSetMathMode)>(ZINC_STR(cublasSetMathMode));
    SetPointerMode = lib.get<decltype(&::cublasSetPointerMode)>(ZINC_STR(cublasSetPointerMode));
    Destroy = lib.get<decltype(&::cublasDestroy)>(ZINC_STR(cublasDestroy));
    SetStream = lib.get<decltype(&::cublasSetStream)>(ZINC_STR(cublasSetStream));
    SetWorkspace = lib.get<decltype(&::cublasSetWorkspace)>(ZINC_STR(cublasSetWorkspace));
    GemmStridedBatchedEx = lib.get<GemmStridedBatchedExFn>(ZINC_STR(cublasGemmStridedBatchedEx));
  }
};
const CublasApi& cublas() {
  static const CublasApi api;
  return api;
}

// cuBLASLt's functions (the same library folder; libcublas itself needs
// it), for Note [the bias in the GEMM's epilogue].
struct LtApi {
  DynLib lib;
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtDestroy) Destroy;
  decltype(&::cublasLtGetStatusName) GetStatusName;
  decltype(&::cublasLtMatmulDescCreate) DescCreate;
  decltype(&::cublasLtMatmulDescDestroy) DescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) DescSet;
  decltype(&::cublasLtMatrixLayoutCreate) LayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) LayoutDestroy;
  decltype(&::cublasLtMatmulPreferenceCreate) PrefCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) PrefDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) PrefSet;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) Heuristic;
  decltype(&::cublasLtMatmul) Matmul;

  LtApi()
      : lib(DynLib::open({"libcublasLt.so." ZINC_STR(CUBLAS_VER_MAJOR),
                          ZINC_CUDA_LIB_DIR "/libcublasLt.so." ZINC_STR(CUBLAS_VER_MAJOR)},
                         "cuBLASLt (the GPU matmuls' fused bias)")) {
    Create = lib.get<decltype(Create)>("cublasLtCreate");
    Destroy = lib.get<decltype(Destroy)>("cublasLtDestroy");
    GetStatusName = lib.get<decltype(GetStatusName)>("cublasLtGetStatusName");
    DescCreate = lib.get<decltype(DescCreate)>("cublasLtMatmulDescCreate");
    DescDestroy = lib.get<decltype(DescDestroy)>("cublasLtMatmulDescDestroy");
    DescSet = lib.get<decltype(DescSet)>("cublasLtMatmulDescSetAttribute");
    LayoutCreate = lib.get<decltype(LayoutCreate)>("cublasLtMatrixLayoutCreate");
    LayoutDestroy = lib.get<decltype(LayoutDestroy)>("cublasLtMatrixLayoutDestroy");
    PrefCreate = lib.get<decltype(PrefCreate)>("cublasLtMatmulPreferenceCreate");
    PrefDestroy = lib.get<decltype(PrefDestroy)>("cublasLtMatmulPreferenceDestroy");
    PrefSet = lib.get<decltype(PrefSet)>("cublasLtMatmulPreferenceSetAttribute");
    Heuristic = lib.get<decltype(Heuristic)>("cublasLtMatmulAlgoGetHeuristic");
    Matmul = lib.get<decltype(Matmul)>("cublasLtMatmul");
  }
};
// Null where cuBLASLt does not load (said once; the separate bias pass then).
const LtApi* cublas_lt() {
  static const LtApi* api = []() -> const LtApi* {
    try {
      return new LtApi();
    } catch (const Error& e) {
      log_warn(std::string("matmul: the bias stays a separate pass after each GEMM: ") + e.what());
      return nullptr;
    }
  }();
  return api;
}

// -1: ZINC_CUDA_MATMUL_BIAS decides; 0 or 1: set_separate_bias_for_testing.
std::atomic<int> separate_bias_override{-1};
bool bias_in_epilogue() {
  static const bool separate_env = [] {
    return env_choice("ZINC_CUDA_MATMUL_BIAS", {"separate", "epilogue"}) == "separate";
  }();
  const int o = separate_bias_override.load();
  return !(o >= 0 ? o == 1 : separate_env);
}


using zinc::cuda::DeviceBuffer;

std::string shape_str(const MatmulDesc& d) {
  return "batch=" + std::to_string(d.batch) + " M=" + std::to_string(d.M) + " N=" + std::to_string(d.N) +
         " K=" + std::to_string(d.K) + " trans_a=" + std::to_string(d.trans_a) +
         " trans_b=" + std::to_string(d.trans_b) + " compute=" + std::string(dtype_name(d.compute));
}

void check_cublas(cublasStatus_t st, const char* what, const std::string& ctx = {}) {
  if (st == CUBLAS_STATUS_SUCCESS) return;
  throw Error(std::string("cuBLAS ") + what + ": " + cublas().GetStatusName(st) + ": " + cublas().GetStatusString(st) +
              (ctx.empty() ? "" : " (" + ctx + ")"));
}

// ---- kernels ------------------------------------------------------------------------

// dst(n) in `to` = src(n) in `from` (from != to), through fp32 with core/dtype.h's conversions.
__global__ void matmul_convert_operand_kernel(const void* __restrict__ src, DType from, void* __restrict__ dst,
                                              DType to, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float v = detail::load_param(src, from, i);
    if (to == DType::kF32)
      static_cast<float*>(dst)[i] = v;
    else
      static_cast<uint16_t*>(dst)[i] = float_to_16(v, to);
  }
}

// ---- per (thread, device) state ---------------------------------------------------------

// cuBLAS's recommended user workspace: 32 MiB on Hopper and later, 4 MiB before.
size_t workspace_bytes(int device) {
  int major = 0;
  ZINC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                  "cudaDeviceGetAttribute(compute capability)");
  return major >= 9 ? static_cast<size_t>(kCudaMatmulWorkspaceBytes) : (size_t{4} << 20);
}

struct StreamScratch {
  DeviceBuffer workspace;
  DeviceBuffer operand[2];  // converted A, B
  DeviceBuffer bias;        // the epilogue's fp32 bias
};

// One shape's cublasLtMatmul (Note [the bias in the GEMM's epilogue]):
// `usable` false where the heuristic found no algorithm.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    if (const LtApi* lt = cublas_lt()) {
      if (op) lt->DescDestroy(op);
      for (cublasLtMatrixLayout_t l : {a, b, c})
        if (l) lt->LayoutDestroy(l);
    }
  }
};
using LtKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, DType>;

// A thread keeps scratch for at most this many streams per device; binding a
// further stream drops the least recently used one, after waiting for the
// device (work queued on that stream, which may be gone, may still use it).
constexpr size_t kMaxStreams = 8;

struct DeviceState {
  struct Entry {
    cudaStream_t stream;
    uint64_t used;
    std::unique_ptr<StreamScratch> scratch;
  };
  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt_handle = nullptr;  // made on the first fused bias
  size_t ws_bytes = 0;
  uint64_t clock = 0;
  std::vector<Entry> streams;
  std::map<LtKey, std::unique_ptr<LtPlan>> lt_plans;

  explicit DeviceState(int dev) {
    check_cublas(cublas().Create(&handle), "cublasCreate", "device " + std::to_string(dev));
    check_cublas(cublas().SetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    check_cublas(cublas().SetPointerMode(handle, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
    ws_bytes = workspace_bytes(dev);
  }
  ~DeviceState() {
    // Thread-local: destroyed at thread exit, before the runtime's own
    // teardown. Errors are dropped (destructors never throw).
    lt_plans.clear();
    if (lt_handle) cublas_lt()->Destroy(lt_handle);
    if (handle) cublas().Destroy(handle);
  }

  // The shape's plan, made on first use; null where none applies.
  LtPlan* lt_plan(const MatmulDesc& d) {
    const LtApi* lt = cublas_lt();
    if (!lt) return nullptr;
    const LtKey key{d.M, d.N, d.K, d.trans_a, d.trans_b, d.compute};
    auto it = lt_plans.find(key);
    if (it != lt_plans.end()) return it->second->usable ? it->second.get() : nullptr;
    auto plan = std::make_unique<LtPlan>();
    LtPlan* p = plan.get();
    lt_plans.emplace(key, std::move(plan));
    auto ok = [&](cublasStatus_t st, const char* what) {
      if (st == CUBLAS_STATUS_SUCCESS) return true;
      log_warn(std::string("matmul: ") + what + " failed (" + lt->GetStatusName(st) + ") for " +
               "M=" + std::to_string(d.M) + " N=" + std::to_string(d.N) + " K=" + std::to_string(d.K) +
               "; that shape keeps its bias as a separate pass");
      return false;
    };
    if (!lt_handle && !ok(lt->Create(&lt_handle), "cublasLtCreate")) return nullptr;
    // Note [cuBLAS matmul layout]: cuBLAS's first operand is zinc's B.
    const cudaDataType t = d.compute == DType::kF32 ? CUDA_R_32F : d.compute == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
    const int32_t op_b = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const uint64_t M = static_cast<uint64_t>(d.M), N = static_cast<uint64_t>(d.N), K = static_cast<uint64_t>(d.K);
    if (!ok(lt->DescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate") ||
        !ok(lt->DescSet(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)), "cublasLtMatmulDescSetAttribute") ||
        !ok(lt->DescSet(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)), "cublasLtMatmulDescSetAttribute") ||
        !ok(lt->DescSet(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)),
            "cublasLtMatmulDescSetAttribute") ||
        !ok(lt->LayoutCreate(&p->a, t, d.trans_b ? K : N, d.trans_b ? N : K, d.trans_b ? d.K : d.N),
            "cublasLtMatrixLayoutCreate") ||
        !ok(lt->LayoutCreate(&p->b, t, d.trans_a ? M : K, d.trans_a ? K : M, d.trans_a ? d.M : d.K),
            "cublasLtMatrixLayoutCreate") ||
        !ok(lt->LayoutCreate(&p->c, CUDA_R_32F, N, M, d.N), "cublasLtMatrixLayoutCreate"))
      return nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    if (!ok(lt->PrefCreate(&pref), "cublasLtMatmulPreferenceCreate")) return nullptr;
    const uint64_t max_ws = ws_bytes;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const bool heuristic =
        ok(lt->PrefSet(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws)),
           "cublasLtMatmulPreferenceSetAttribute") &&
        ok(lt->Heuristic(lt_handle, p->op, p->a, p->b, p->c, p->c, pref, 1, &result, &found),
           "cublasLtMatmulAlgoGetHeuristic");
    lt->PrefDestroy(pref);
    if (!heuristic || found < 1 || result.state != CUBLAS_STATUS_SUCCESS || result.workspaceSize > ws_bytes)
      return nullptr;
    p->algo = result.algo;
    p->usable = true;
    return p;
  }
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  StreamScratch& scratch_for(cudaStream_t stream) {
    ++clock;
    for (Entry& e : streams)
      if (e.stream == stream) {
        e.used = clock;
        return *e.scratch;
      }
    if (streams.size() >= kMaxStreams) {
      auto oldest = std::min_element(streams.begin(), streams.end(),
                                     [](const Entry& x, const Entry& y) { return x.used < y.used; });
      ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "matmul: cudaDeviceSynchronize before dropping a stream's scratch");
      streams.erase(oldest);
    }
    auto sc = std::make_unique<StreamScratch>();
    sc->workspace = DeviceBuffer(ws_bytes, "cuBLAS's workspace");
    streams.push_back({stream, clock, std::move(sc)});
    return *streams.back().scratch;
  }

  // Binds the handle to `stream` with that stream's workspace.
  StreamScratch& bind(cudaStream_t stream) {
    StreamScratch& sc = scratch_for(stream);
    check_cublas(cublas().SetStream(handle, stream), "cublasSetStream");
    check_cublas(cublas().SetWorkspace(handle, sc.workspace.data(), sc.workspace.bytes()), "cublasSetWorkspace");
    return sc;
  }
};

DeviceState& device_state() {
  int dev = 0;
  ZINC_CUDA_CHECK(cudaGetDevice(&dev), "matmul: cudaGetDevice");
  thread_local std::unordered_map<int, std::unique_ptr<DeviceState>> states;
  auto& s = states[dev];
  if (!s) s = std::make_unique<DeviceState>(dev);
  return *s;
}

// Grows a stream's scratch buffer (never shrinks); waits for the stream first,
// since work already queued there may still read the old buffer.
void* grow(DeviceBuffer& buf, size_t bytes, cudaStream_t stream) {
  if (buf.bytes() < bytes) {
    if (buf.data()) ZINC_CUDA_CHECK(cudaStreamSynchronize(stream), "matmul: cudaStreamSynchronize before growing scratch");
    buf.reserve(bytes, "a matmul's converted operand");
  }
  return buf.data();
}

cudaDataType cuda_type(DType t) {
  return t == DType::kF32 ? CUDA_R_32F : t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
}

// The operand as cuBLAS reads it (dtype `compute`), converted into `buf` when needed.
const void* as_compute(CView v, DType compute, int64_t n, DeviceBuffer& buf, cudaStream_t stream) {
  if (v.dtype == compute) return v.data;
  void* dst = grow(buf, static_cast<size_t>(n) * dtype_bytes(compute), stream);
  matmul_convert_operand_kernel<<<detail::blocks_for(n), detail::kThreads, 0, stream>>>(v.data, v.dtype, dst,
                                                                                         compute, n);
  detail::check_launch("matmul_convert_operand_kernel");
  return dst;
}

bool fits_int(int64_t v) { return v <= std::numeric_limits<int>::max(); }

// Whether d's bias may go in cuBLASLt's epilogue (Note [the bias in the
// GEMM's epilogue]); the shape's plan decides the rest.
bool epilogue_applies(const MatmulDesc& d) {
  return d.bias && !d.accumulate && d.batch == 1 && d.alpha == 1.0f && bias_in_epilogue();
}

}  // namespace

std::string cublas_library() { return cublas().lib.name(); }

void set_separate_bias_for_testing(bool separate) { separate_bias_override.store(separate ? 1 : 0); }

bool matmul_bias_in_epilogue(const MatmulDesc& d) {
  if (!epilogue_applies(d) || d.M <= 0 || d.N <= 0 || d.K <= 0 || !fits_int(d.M) || !fits_int(d.N) || !fits_int(d.K))
    return false;
  return device_state().lt_plan(d) != nullptr;
}

void matmul(const MatmulDesc& d, CView a, CView b, float* c, cudaStream_t stream, CView bias) {
  GpuProfileScope profile_scope(Op::kMatmul, stream);
  if (d.batch < 0 || d.M < 0 || d.N < 0 || d.K < 0) throw Error("cuda::matmul: negative dimension (" + shape_str(d) + ")");
  if (d.bias && (!bias.data || d.alpha != 1.0f))
    throw Error("cuda::matmul: a fused bias needs a bias view and alpha == 1");
  // Strided operands (LoRA's column blocks, Note [LoRA by groups]): the
  // stored rows' stride, as cuBLAS's leading dimensions; batch 1 only.
  const bool strided = d.lda != 0 || d.ldb != 0 || d.ldc != 0;
  const int64_t a_cols = d.trans_a ? d.M : d.K, a_rows = d.trans_a ? d.K : d.M;
  const int64_t b_cols = d.trans_b ? d.K : d.N, b_rows = d.trans_b ? d.N : d.K;
  const int64_t lda = d.lda ? d.lda : a_cols, ldb = d.ldb ? d.ldb : b_cols, ldc = d.ldc ? d.ldc : d.N;
  if (strided && d.batch != 1)
    throw Error("cuda::matmul: strided operands (lda, ldb, ldc) need batch 1 (" + shape_str(d) + ")");
  if (lda < a_cols || ldb < b_cols || ldc < d.N)
    throw Error("cuda::matmul: a row stride below its row's length (lda " + std::to_string(lda) + ", ldb " +
                std::to_string(ldb) + ", ldc " + std::to_string(ldc) + "; " + shape_str(d) + ")");
  if (d.bias && ldc != d.N) throw Error("cuda::matmul: a fused bias with a strided result (" + shape_str(d) + ")");
  if (d.batch == 0 || d.M == 0 || d.N == 0) return;
  const int64_t rows = d.batch * d.M;
  if (d.K == 0) {  // empty sum: alpha * 0 (+ C) (+ bias)
    if (!d.accumulate) {
      if (ldc == d.N)
        ZINC_CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(rows * d.N) * sizeof(float), stream),
                        "cuda::matmul: cudaMemsetAsync");
      else
        for (int64_t r = 0; r < rows; ++r)
          ZINC_CUDA_CHECK(cudaMemsetAsync(c + r * ldc, 0, static_cast<size_t>(d.N) * sizeof(float), stream),
                          "cuda::matmul: cudaMemsetAsync");
    }
    if (d.bias) add_bias(c, bias, rows, d.N, stream);
    return;
  }
  if (!fits_int(d.M) || !fits_int(d.N) || !fits_int(d.K) || !fits_int(d.batch))
    throw Error("cuda::matmul: a dimension exceeds cuBLAS's int range (" + shape_str(d) + ")");
  DeviceState& st = device_state();
  StreamScratch& sc = st.bind(stream);
  // A strided operand converts its whole extent, strides kept (the
  // elements between its rows belong to the wider matrix it is a block of).
  const int64_t a_n = strided ? (a_rows - 1) * lda + a_cols : d.batch * d.M * d.K;
  const int64_t b_n = strided ? (b_rows - 1) * ldb + b_cols : d.batch * d.K * d.N;
  const void* a_ptr = as_compute(a, d.compute, a_n, sc.operand[0], stream);
  const void* b_ptr = as_compute(b, d.compute, b_n, sc.operand[1], stream);
  const cudaDataType t = cuda_type(d.compute);
  const float alpha = d.alpha, beta = d.accumulate ? 1.0f : 0.0f;
  // Note [the bias in the GEMM's epilogue]
  if (epilogue_applies(d) && !strided)
    if (LtPlan* p = st.lt_plan(d)) {
      void* bias32 = grow(sc.bias, static_cast<size_t>(d.N) * sizeof(float), stream);
      matmul_convert_operand_kernel<<<detail::blocks_for(d.N), detail::kThreads, 0, stream>>>(
          bias.data, bias.dtype, bias32, DType::kF32, d.N);
      detail::check_launch("matmul_convert_operand_kernel (bias)");
      const LtApi& lt = *cublas_lt();
      const void* bias_ptr = bias32;
      check_cublas(lt.DescSet(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)),
                   "cublasLtMatmulDescSetAttribute(bias)", shape_str(d));
      check_cublas(lt.Matmul(st.lt_handle, p->op, &alpha, b_ptr, p->a, a_ptr, p->b, &beta, c, p->c, c, p->c, &p->algo,
                             sc.workspace.data(), sc.workspace.bytes(), stream),
                   "cublasLtMatmul", shape_str(d));
      return;
    }
  const int m = static_cast<int>(d.N), n = static_cast<int>(d.M), k = static_cast<int>(d.K);
  // Note [cuBLAS matmul layout]
  const cublasOperation_t op_b = d.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = d.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (!fits_int(lda) || !fits_int(ldb) || !fits_int(ldc))
    throw Error("cuda::matmul: a row stride exceeds cuBLAS's int range (" + shape_str(d) + ")");
  const int ld_b = static_cast<int>(ldb);
  const int ld_a = static_cast<int>(lda);
  check_cublas(cublas().GemmStridedBatchedEx(st.handle, op_b, op_a, m, n, k, &alpha, b_ptr, t, ld_b,
                                          static_cast<long long>(d.K * d.N), a_ptr, t, ld_a,
                                          static_cast<long long>(d.M * d.K), &beta, c, CUDA_R_32F,
                                          static_cast<int>(ldc), static_cast<long long>(d.M * d.N),
                                          static_cast<int>(d.batch),
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx", shape_str(d));
  if (d.bias) add_bias(c, bias, rows, d.N, stream);
}

}  // namespace zinc::kernels::cuda
