// matmul through oneDNN.
//
// Note [matmul primitive cache]
// A oneDNN primitive is expensive to create (JIT code generation, ~ms) and
// cheap to execute, and a training step calls the same handful of shapes over
// and over. So primitives are created once per MatmulDesc (all fields are part
// of the key, alpha included, because 2.6 bakes output scales into the
// primitive) and kept for the life of the process in a map guarded by a mutex.
// Primitives are created with fully known dims (no DNNL_RUNTIME_DIM_VAL):
// oneDNN picks its blocking for the exact shape, which is what makes the
// brgemm kernels fast.
//
// Scratchpads are user-managed (scratchpad_mode::user) and come from a
// thread-local buffer, and each calling thread has its own stream, so two
// threads may run the same cached primitive at once on different outputs.
// Operands whose dtype differs from desc.compute are converted into
// thread-local scratch first.
//
// Note [fp16 compute]
// oneDNN 2.6 multiplies fp16 natively only on CPUs with AVX512-FP16, and
// zinc's fp16 mode exists to behave like fp16 training on a GPU (storage,
// wire, overflow and loss scaling), so fp16 matmuls always take the fp32
// route the bf16 fallback takes: fp16 operands are widened (exact), fp32
// operands are rounded to fp16 first (so a value above 65504 becomes Inf
// and a tiny one flushes, as in an fp16 GEMM), and the products of two fp16
// values are exact in fp32, accumulated in fp32. CView::bf16_exact then
// marks fp32 data that is exactly fp16-representable.
//
// Note [bf16 matmul without native bf16]
// oneDNN 2.6 has bf16 matmul kernels only from avx512_core up; below that it
// cannot create the primitive at all. So for compute == kBF16 the cache asks
// oneDNN for the native bf16 primitive first and, when oneDNN answers that it
// has none (or only its slow reference implementation), creates the fp32
// primitive for the same shape instead and remembers that decision with it.
// Such a call widens bf16 operands to fp32 (exact) and rounds fp32 operands
// through bf16 (what the native path's conversion does), so the multiplier
// sees exactly the values the native path sees: products of two bf16 values
// are exact in fp32 and both paths accumulate in fp32, so they differ only in
// summation order. It is logged once per process.
// set_matmul_bf16_path_for_testing forces the fallback on a CPU that has the
// native kernels, so one machine tests both.
//
// Native means bf16 arithmetic in the CPU that multiplies faster than fp32:
// the native primitive is asked for only at zinc's avx512_bf16 level
// (AVX512-BF16, under the cap), and there not on Intel unless AMX is on. On
// AVX-512 without BF16 (Skylake-SP to Ice Lake) oneDNN 2.6 does return a
// non-reference bf16 primitive (gemm:jit), but it emulates bf16 products with
// integer instructions and ran the reference GPT's step about 4x slower than
// fp32 (issue 28), so there the fp32 route is taken for every shape. Below
// AVX-512 oneDNN has no bf16 primitive at all. On Intel's AVX512-BF16 CPUs
// (Cooper Lake, Sapphire Rapids and later) with AMX off (Note [no AMX]),
// oneDNN's avx512_core_bf16 kernels multiply no faster than its fp32 ones:
// on a Sapphire Rapids Xeon, 2 threads, 2026-11-28, they ran the reference
// GPT's matmuls at 136 GFLOP/s against 190 for fp32 in the same minutes,
// and the bf16 step at 0.67x the fp32 step (bench/RESULTS.md, "bf16 on an
// Intel Xeon with AVX512-BF16"); the fp32 route ran it at 0.95x. (AMD's
// Zen 4 runs the same bf16 kernels at 2x its fp32 rate.) So on Intel the
// fp32 route is taken there too, unless ONEDNN_MAX_CPU_ISA names AMX. At
// the avx512_bf16 level elsewhere the decision is per shape, from oneDNN's
// own answer (a reference-only shape takes the fp32 route).
//
// Note [no AMX]
// oneDNN 2.6.3's AMX kernels (brg:avx512_core_amx_bf16) gave wrong bf16
// products: on an H100 machine's Xeon (amx_bf16), 2026-11-25, a batch-2
// 37x53x19 product with B transposed and one operand converted from fp32
// differed from the GPU in a third of its elements, by a different count
// in each run; capped at AVX512_CORE_BF16 the same test passed
// (bench/RESULTS.md, "GPU"). No 2-core CI machine has AMX, so nothing here
// could keep that path honest: zinc caps oneDNN at avx512_core_bf16 unless
// ONEDNN_MAX_CPU_ISA asks for AMX by name (then a warning says why not).
//
// The cap: before the first primitive, the ONEDNN_MAX_CPU_ISA value zinc
// parsed (core/cpu.h) is handed to dnnl::set_max_cpu_isa, so oneDNN and
// zinc's own kernels run under the same cap whatever the spelling.
//
// Layouts: op(A) = A stored (M,K) is tag ab; A stored (K,M) (trans_a) is the
// same logical (M,K) tensor with strides {1,M}, tag ba (acb with a batch).
// oneDNN 2.6 picks brgemm (brg:avx512_core_bf16 / brg:avx512_core) for all
// four transpose combinations at the GPT shapes and copies transposed blocks
// into its packed format itself. Measured on 2 cores (bf16, M=2048 rows):
// y = x W^T (trans_b) and dX = dY W (plain) ~800 GFLOP/s, dW += dY^T X
// (trans_a) ~600-700 GFLOP/s. An explicit transpose-and-convert of dY into
// scratch costs about as much as the gap, so none is done.
//
// Note [packed frozen weights]
// oneDNN's brgemm matmul reads B in a blocked layout of its own. Given B in
// a plain layout (a weight as the model stores it), each call first copies
// it into that layout, and for the ~100M Llama's layer shapes (1024 rows)
// that copy is 5-12% of the product: on this project's 2-core AMD EPYC
// (AVX512-BF16), 2026-11-30, gate|up's forward took 13.08 ms from the plain
// weight against 11.89 from a packed one, its input gradient 13.13 against
// 12.01, down_proj's input gradient 6.51 against 5.75. A trained weight
// changes every step, so packing it once per step only moves the copy (a
// reorder costs 0.2-1.5 ms, about what it saves). A frozen one does not: a
// LoRA base's weights never change, so matmul_packed keeps each one packed
// in a PackedWeight slot of the model's and reuses it call after call. Its
// validity is the engine's promise, BlockParams::generation: nonzero where
// a frozen block stays at one address with the same values (ZeRO stages
// 0-2, and stage 3 where one rank shards nothing), the same number for the
// engine's life and another in every engine, so a model handed to a second
// engine packs again. A slot packs again whenever the address, the
// generation or the layout the primitive asks for (it depends on the shape)
// changes. Where bf16 multiplies through fp32 (Note [bf16 matmul without
// native bf16]) the packed copy holds the widened weight, which also saves
// that conversion on every call. The cost is memory: each weight packed
// for its forward and its input gradient, two more copies of the base's
// layer weights (4 B a parameter in bf16, 8 through fp32), which the
// estimate counts (ActivationMemory::packed) and model.pack_frozen_weights
// false turns off. The products are the same sums; where oneDNN picks the
// same kernel for both layouts (every layer shape of the built-in models
// tried) they are bit-identical.
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "core/alloc.h"
#include "core/cpu.h"
#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"
#include "kernels/kernels.h"
#include "kernels/profile.h"

namespace zinc::kernels {
namespace {

// The last fields are the rows' strides of A, B and C (0: dense) and
// whether B comes packed (Note [packed frozen weights]).
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, bool, bool, uint32_t, DType, int, int64_t,
                       int64_t, int64_t, bool>;

std::atomic<int> g_bf16_path{static_cast<int>(MatmulBf16Path::kAuto)};

Key make_key(const MatmulDesc& d, bool packed) {
  return {d.batch, d.M, d.N, d.K, d.trans_a, d.trans_b, d.accumulate, d.bias, float_bits(d.alpha),
          d.compute, g_bf16_path.load(), d.lda, d.ldb, d.ldc, packed};
}

struct CachedMatmul {
  dnnl::matmul prim;
  dnnl::memory::desc scratch_md;
  size_t scratch_bytes = 0;
  dnnl::memory::desc weights_md;  // B's layout as the primitive reads it (its own pick where packed)
  DType multiply = DType::kF32;  // the dtype oneDNN multiplies in (kF32 for the bf16 fallback)
  std::string impl;              // oneDNN's implementation name
  std::string why;               // why a bf16 matmul multiplies in fp32 ("" when native)
};

// oneDNN's name for zinc's cap, for dnnl::set_max_cpu_isa.
dnnl::cpu_isa dnnl_cap(const std::string& raw) {
  std::string v;
  for (char c : raw) v += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (v == "SSE41") return dnnl::cpu_isa::sse41;
  if (v == "AVX") return dnnl::cpu_isa::avx;
  if (v == "AVX2") return dnnl::cpu_isa::avx2;
  if (v == "AVX2_VNNI") return dnnl::cpu_isa::avx2_vnni;
  if (v == "AVX512_MIC") return dnnl::cpu_isa::avx512_mic;
  if (v == "AVX512_MIC_4OPS") return dnnl::cpu_isa::avx512_mic_4ops;
  if (v == "AVX512_CORE") return dnnl::cpu_isa::avx512_core;
  if (v == "AVX512_CORE_VNNI") return dnnl::cpu_isa::avx512_core_vnni;
  if (v == "AVX512_CORE_BF16") return dnnl::cpu_isa::avx512_core_bf16;
  if (v == "AVX512_CORE_AMX") return dnnl::cpu_isa::avx512_core_amx;
  return dnnl::cpu_isa::all;
}

bool cpu_has_amx() { return cpu_model_and_flags().find("amx_bf16") != std::string::npos; }

// Note [no AMX]: oneDNN runs AMX only where ONEDNN_MAX_CPU_ISA names it.
bool amx_on() {
  const std::string cap = cpu_isa_cap_env();
  return !cap.empty() && dnnl_cap(cap) == dnnl::cpu_isa::avx512_core_amx && cpu_has_amx();
}

dnnl::engine& cpu_engine() {
  static dnnl::engine eng = [] {
    const std::string cap = cpu_isa_cap_env();
    if (!cap.empty()) cpu_isa_cap();  // throws for a value zinc does not know
    // Note [no AMX]: without a cap that names AMX, oneDNN stops below it.
    dnnl::cpu_isa isa = cap.empty() ? dnnl::cpu_isa::all : dnnl_cap(cap);
    if (isa == dnnl::cpu_isa::all) isa = dnnl::cpu_isa::avx512_core_bf16;
    if (amx_on())
      log_warn("ONEDNN_MAX_CPU_ISA=" + cap +
               ": oneDNN's AMX matmul kernels are on; oneDNN 2.6.3's gave wrong bf16 products on an AMX "
               "Xeon (Note [no AMX] in kernels/matmul.cpp); unset it to use AVX512-BF16 instead");
    // Fails only if oneDNN already created JIT code (then its own reading
    // of the same variable applies).
    try {
      dnnl::set_max_cpu_isa(isa);
    } catch (const dnnl::error&) {
    }
    return dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return eng;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream s(cpu_engine());
  return s;
}

// Grow-only thread-local scratch; slot 0,1 for converted operands, 2 for the
// oneDNN scratchpad, 3 for a widened bias.
void* thread_scratch(int slot, size_t bytes) {
  thread_local AlignedBuffer bufs[4];
  return grow_scratch(bufs[slot], bytes);
}
int64_t scratch_size(size_t bytes) { return static_cast<int64_t>(scratch_bytes(bytes)); }

dnnl::memory::data_type dnnl_type(DType t) {
  return t == DType::kF32 ? dnnl::memory::data_type::f32 : dnnl::memory::data_type::bf16;
}

// Logical (rows, cols) matrix, stored transposed when `trans`; `ld` (batch
// 1): the stored rows' stride (0: dense).
dnnl::memory::desc operand_desc(int64_t batch, int64_t rows, int64_t cols, bool trans,
                                dnnl::memory::data_type dt, int64_t ld = 0) {
  using tag = dnnl::memory::format_tag;
  if (ld != 0) return dnnl::memory::desc({rows, cols}, dt, trans ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1});
  if (batch == 1) return dnnl::memory::desc({rows, cols}, dt, trans ? tag::ba : tag::ab);
  return dnnl::memory::desc({batch, rows, cols}, dt, trans ? tag::acb : tag::abc);
}

// bias(N) as a (1,N) or (1,1,N) fp32 tensor, broadcast by oneDNN.
dnnl::memory::desc bias_desc(const MatmulDesc& d) {
  using tag = dnnl::memory::format_tag;
  if (d.batch == 1) return dnnl::memory::desc({1, d.N}, dnnl::memory::data_type::f32, tag::ab);
  return dnnl::memory::desc({1, 1, d.N}, dnnl::memory::data_type::f32, tag::abc);
}

// The primitive for `d` multiplying in `multiply`; throws dnnl::error when
// oneDNN has none.
// packed: B in the layout oneDNN picks (Note [packed frozen weights]).
std::shared_ptr<CachedMatmul> create_as(const MatmulDesc& d, DType multiply, bool packed) {
  auto dt = dnnl_type(multiply);
  auto a_md = operand_desc(d.batch, d.M, d.K, d.trans_a, dt, d.lda);
  auto b_md = packed ? dnnl::memory::desc({d.K, d.N}, dt, dnnl::memory::format_tag::any)
                     : operand_desc(d.batch, d.K, d.N, d.trans_b, dt, d.ldb);
  auto c_md = operand_desc(d.batch, d.M, d.N, false, dnnl::memory::data_type::f32, d.ldc);
  dnnl::memory::desc bias_md;  // zero desc: no bias
  if (d.bias) bias_md = bias_desc(d);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (d.alpha != 1.0f) attr.set_output_scales(0, {d.alpha});
  if (d.accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  auto pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), attr, cpu_engine());
  auto out = std::make_shared<CachedMatmul>();
  out->prim = dnnl::matmul(pd);
  out->scratch_md = pd.scratchpad_desc();
  out->scratch_bytes = out->scratch_md.get_size();
  out->weights_md = pd.weights_desc();
  out->multiply = multiply;
  out->impl = pd.impl_info_str();
  return out;
}

// Note [bf16 matmul without native bf16]: native first, fp32 when oneDNN has
// no (or only a reference) bf16 implementation for this shape.
std::shared_ptr<const CachedMatmul> create(const MatmulDesc& d, bool packed) {
  if (d.compute == DType::kF32) return create_as(d, DType::kF32, packed);
  if (d.compute == DType::kF16) {
    // Note [fp16 compute]: always fp32 multiplies of fp16-exact operands.
    auto f = create_as(d, DType::kF32, packed);
    f->why = "zinc multiplies fp16 operands in fp32";
    return f;
  }
  std::string why;
  if (static_cast<MatmulBf16Path>(g_bf16_path.load()) == MatmulBf16Path::kViaF32) {
    why = "forced for testing";
  } else if (cpu_isa() < CpuIsa::kAvx512Bf16) {
    // Note [bf16 matmul without native bf16]: no bf16 arithmetic here.
    why = cpu_isa_detected() > cpu_isa() ? "no native bf16 under ONEDNN_MAX_CPU_ISA=" + cpu_isa_cap_env()
          : cpu_isa() == CpuIsa::kAvx512
              ? "no native bf16 on this CPU (AVX-512 without AVX512-BF16: oneDNN would emulate it, ~4x slower)"
              : "no native bf16 on this CPU";
  } else if (cpu_is_intel() && !amx_on()) {
    // Note [bf16 matmul without native bf16]: Intel's AVX512-BF16 without AMX.
    why = "Intel's AVX512-BF16 without AMX multiplies bf16 no faster than fp32 (0.72x in oneDNN on a Sapphire Rapids)";
  } else {
    try {
      auto native = create_as(d, DType::kBF16, packed);
      if (native->impl.rfind("ref", 0) != 0) return native;
      why = "oneDNN has only its reference bf16 kernel (" + native->impl + ") here";
    } catch (const dnnl::error& e) {
      if (e.status != dnnl_unimplemented) throw;
      why = cpu_isa_detected() >= CpuIsa::kAvx512 && cpu_isa() < CpuIsa::kAvx512
                ? "no native bf16 under ONEDNN_MAX_CPU_ISA=" + cpu_isa_cap_env()
                : "no native bf16 on this CPU";
    }
  }
  auto fallback = create_as(d, DType::kF32, packed);
  fallback->why = why;
  static std::once_flag logged;
  std::call_once(logged, [&] { log_info("matmul bf16: via fp32, " + why); });
  return fallback;
}

std::shared_ptr<const CachedMatmul> lookup(const MatmulDesc& d, bool packed = false) {
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<const CachedMatmul>> cache;
  Key k = make_key(d, packed);
  std::scoped_lock lock(mu);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  // oneDNN takes 64-bit sizes but parts of its CPU matmul compute in 32
  // bits: a size past 2^31 once ended the process with SIGFPE.
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (d.batch > kMaxDim || d.M > kMaxDim || d.N > kMaxDim || d.K > kMaxDim || d.M * d.K > kMaxDim * 64 ||
      d.K * d.N > kMaxDim * 64 || d.M * d.N > kMaxDim * 64)
    throw Error("matmul: batch=" + std::to_string(d.batch) + " M=" + std::to_string(d.M) + " N=" +
                std::to_string(d.N) + " K=" + std::to_string(d.K) + " is past what oneDNN computes (a size " +
                "over 2^31, or an operand over 2^37 elements)");
  try {
    auto p = create(d, packed);
    cache.emplace(k, p);
    return p;
  } catch (const dnnl::error& e) {
    throw Error("matmul: oneDNN could not create a primitive for batch=" + std::to_string(d.batch) +
                " M=" + std::to_string(d.M) + " N=" + std::to_string(d.N) +
                " K=" + std::to_string(d.K) + ": " + e.what());
  }
}

// Returns a pointer to the operand as the primitive multiplies it (`multiply`),
// converting into thread-local scratch slot `slot` when needed. With the bf16
// fallback (compute bf16, multiply fp32) fp32 operands are rounded through
// bf16 so that they carry the values the native path would multiply; with
// fp16 compute they are rounded through fp16 (Note [fp16 compute]).
bool converts(DType dtype, bool exact, DType compute, DType multiply) {
  return !(dtype == multiply && !(is_16bit(compute) && dtype == DType::kF32 && !exact));
}

// Converts n elements of `v` into `dst` as the primitive multiplies them.
void convert_into(CView v, DType compute, DType multiply, size_t n, void* dst) {
  if (multiply == DType::kBF16 && v.dtype == DType::kF16) {
    // An fp16 operand of a bf16 matmul: its values rounded to bf16.
    const f16* src = static_cast<const f16*>(v.data);
    bf16* out = static_cast<bf16*>(dst);
    for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16(f16_to_float(src[i]));
  } else if (multiply == DType::kBF16) {
    convert_f32_to_bf16(static_cast<const float*>(v.data), static_cast<bf16*>(dst), n);
  } else if (is_16bit(v.dtype)) {
    convert_16_to_f32(v.data, static_cast<float*>(dst), n, v.dtype);
    // The other 16-bit format than the compute's: its values rounded to the
    // compute format, as the native path and the GPU multiply them.
    if (is_16bit(compute) && compute != v.dtype) {
      if (compute == DType::kF16)
        round_to_f16(static_cast<const float*>(dst), static_cast<float*>(dst), n);
      else
        round_to_bf16(static_cast<const float*>(dst), static_cast<float*>(dst), n);
    }
  } else if (compute == DType::kF16) {
    round_to_f16(static_cast<const float*>(v.data), static_cast<float*>(dst), n);
  } else {
    round_to_bf16(static_cast<const float*>(v.data), static_cast<float*>(dst), n);
  }
}

const void* as_multiply(CView v, DType compute, DType multiply, size_t n, int slot) {
  if (!converts(v.dtype, v.bf16_exact, compute, multiply)) return v.data;
  void* dst = thread_scratch(slot, n * dtype_bytes(multiply));
  convert_into(v, compute, multiply, n, dst);
  return dst;
}

CView offset_view(CView v, int64_t elems) {
  v.data = static_cast<const char*>(v.data) + static_cast<size_t>(elems) * dtype_bytes(v.dtype);
  return v;
}

// Note [widened operands in chunks]
// A matmul that converts its B operand (a bf16 weight widened to fp32 where
// bf16 is multiplied via fp32, Note [bf16 matmul without native bf16]) needs
// scratch the size of B in the multiply dtype. For a large vocabulary's head
// (32,000 x 2,048: 262 MB as fp32) that scratch alone was the biggest piece
// of a LoRA run's memory after the process itself (bench/RESULTS.md, "capacity
// --pretrained --lora"). So when B's converted copy would pass
// kWidenChunkBytes, the product runs over blocks of C's columns, each
// converting only its block of B (rows of the stored weight for y = x W^T,
// a strided column block for dX = dY W). K is never split, so every element
// of C sums the same products as in one product (oneDNN may block K
// differently for a narrower C, so the last bits can differ: 2.4e-6 at 8.9
// in the test); the scratch stays under kWidenChunkBytes. A converted A is
// converted once for all blocks. The decision depends on the shape and the
// dtypes alone, so a run takes the same path every step and on every rank.
constexpr size_t kWidenChunkBytes = size_t{32} << 20;

// C's columns per block when B's converted copy is chunked; 0: one product.
int64_t widen_chunk_cols(const MatmulDesc& d, DType b_dtype, bool b_exact, DType mul) {
  if (d.batch != 1 || d.lda != 0 || d.ldb != 0 || d.ldc != 0 || !converts(b_dtype, b_exact, d.compute, mul)) return 0;
  const size_t col_bytes = static_cast<size_t>(d.K) * dtype_bytes(mul);
  if (col_bytes * static_cast<size_t>(d.N) <= kWidenChunkBytes) return 0;
  const int64_t cols = std::max<int64_t>(64, static_cast<int64_t>(kWidenChunkBytes / col_bytes) / 64 * 64);
  return cols < d.N ? cols : 0;
}

// Runs the primitive on operands already in its multiply dtype (with d's
// strides).
// B as `b_mem` (a packed weight's memory; empty: b_ptr with d's layout).
void execute(const MatmulDesc& d, const CachedMatmul& cached, const void* a_ptr, const void* b_ptr, float* c,
             CView bias, dnnl::memory b_mem = {}) {
  auto dt = dnnl_type(cached.multiply);
  auto& eng = cpu_engine();
  dnnl::memory a_mem(operand_desc(d.batch, d.M, d.K, d.trans_a, dt, d.lda), eng, const_cast<void*>(a_ptr));
  if (!b_mem) b_mem = dnnl::memory(operand_desc(d.batch, d.K, d.N, d.trans_b, dt, d.ldb), eng, const_cast<void*>(b_ptr));
  dnnl::memory c_mem(operand_desc(d.batch, d.M, d.N, false, dnnl::memory::data_type::f32, d.ldc), eng, c);
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}};
  if (d.bias) {
    const float* bias_f32 = static_cast<const float*>(bias.data);
    if (bias.dtype != DType::kF32) {
      float* w = static_cast<float*>(thread_scratch(3, static_cast<size_t>(d.N) * sizeof(float)));
      convert_16_to_f32(bias.data, w, static_cast<size_t>(d.N), bias.dtype);
      bias_f32 = w;
    }
    args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_desc(d), eng, const_cast<float*>(bias_f32)));
  }
  if (cached.scratch_bytes > 0) {
    dnnl::memory s_mem(cached.scratch_md, eng, thread_scratch(2, cached.scratch_bytes));
    args.emplace(DNNL_ARG_SCRATCHPAD, s_mem);
  }
  auto& s = thread_stream();
  cached.prim.execute(s, args);
  s.wait();
}

// A (rows, cols) block whose rows are `ld` elements apart, converted
// densely into thread-local scratch slot `slot`.
const void* gather_converted(CView v, int64_t rows, int64_t cols, int64_t ld, DType compute, DType mul, int slot) {
  const size_t es = dtype_bytes(mul);
  char* dst = static_cast<char*>(thread_scratch(slot, static_cast<size_t>(rows * cols) * es));
  for (int64_t r = 0; r < rows; ++r)
    convert_into(offset_view(v, r * ld), compute, mul, static_cast<size_t>(cols), dst + static_cast<size_t>(r * cols) * es);
  return dst;
}

// An operand (rows, cols) of d as the primitive multiplying in `mul` reads
// it: converted into thread-local scratch `slot` where needed; a strided
// one that must be converted is gathered densely, its stride `ld` then
// cleared (the caller's primitive reads it dense).
const void* multiply_operand(const MatmulDesc& d, DType mul, CView v, int64_t rows, int64_t cols, bool trans,
                             int64_t& ld, int slot) {
  if (ld == 0 || !converts(v.dtype, v.bf16_exact, d.compute, mul))
    return as_multiply(v, d.compute, mul, static_cast<size_t>(d.batch * rows * cols), slot);
  const int64_t stride = ld;
  ld = 0;
  return trans ? gather_converted(v, cols, rows, stride, d.compute, mul, slot)
               : gather_converted(v, rows, cols, stride, d.compute, mul, slot);
}

// Note [widened operands in chunks]: C in blocks of `cols` columns.
void matmul_in_blocks(const MatmulDesc& d, CView a, CView b, float* c, CView bias, int64_t cols) {
  const void* a_ptr = nullptr;
  DType a_mul = DType::kF32;
  for (int64_t n0 = 0; n0 < d.N; n0 += cols) {
    MatmulDesc dc = d;
    dc.N = std::min(cols, d.N - n0);
    dc.ldc = d.N;
    auto cached = lookup(dc);
    const DType mul = cached->multiply;
    if (!a_ptr || a_mul != mul) {
      a_ptr = as_multiply(a, d.compute, mul, static_cast<size_t>(d.M * d.K), 0);
      a_mul = mul;
    }
    const void* b_ptr;
    if (d.trans_b) {  // stored (N, K): the block is rows n0.. of it
      b_ptr = as_multiply(offset_view(b, n0 * d.K), d.compute, mul, static_cast<size_t>(dc.N * d.K), 1);
    } else if (!converts(b.dtype, b.bf16_exact, d.compute, mul)) {
      // Only where this block's primitive multiplies B's own dtype (a shape
      // decided otherwise): copied as it is.
      const size_t es = dtype_bytes(mul);
      char* dst = static_cast<char*>(thread_scratch(1, static_cast<size_t>(dc.N * d.K) * es));
      for (int64_t k = 0; k < d.K; ++k)
        std::memcpy(dst + static_cast<size_t>(k * dc.N) * es, offset_view(b, k * d.N + n0).data,
                    static_cast<size_t>(dc.N) * es);
      b_ptr = dst;
    } else {  // stored (K, N): columns n0.. of each row, gathered
      b_ptr = gather_converted(offset_view(b, n0), d.K, dc.N, d.N, d.compute, mul, 1);
    }
    execute(dc, *cached, a_ptr, b_ptr, c + n0, d.bias ? offset_view(bias, n0) : bias);
  }
}

}  // namespace

void matmul(const MatmulDesc& d, CView a, CView b, float* c, CView bias) {
  ProfileScope profile_scope(Op::kMatmul);
  if (d.batch < 0 || d.M < 0 || d.N < 0 || d.K < 0) throw Error("matmul: negative dimension");
  if (d.bias && (!bias.data || d.alpha != 1.0f))
    throw Error("matmul: a fused bias needs a bias view and alpha == 1");
  if (d.batch == 0 || d.M == 0 || d.N == 0) return;
  const size_t c_numel = static_cast<size_t>(d.batch * d.M * d.N);
  if (d.K == 0) {  // empty sum: alpha * 0 (+ C) (+ bias)
    if (!d.accumulate) std::memset(c, 0, c_numel * sizeof(float));
    if (d.bias)
      for (int64_t r = 0; r < d.batch * d.M; ++r)
        for (int64_t j = 0; j < d.N; ++j) c[r * d.N + j] += bias.at(j);
    return;
  }
  auto cached = lookup(d);
  const DType mul = cached->multiply;
  if (int64_t cols = widen_chunk_cols(d, b.dtype, b.bf16_exact, mul)) {
    matmul_in_blocks(d, a, b, c, bias, cols);
    return;
  }
  if ((d.lda != 0 || d.ldb != 0 || d.ldc != 0) && d.batch != 1) throw Error("matmul: strided operands need batch 1");
  // The operands as the primitive multiplies them (multiply_operand; a
  // gathered one's stride cleared in e).
  MatmulDesc e = d;
  const void* a_ptr = multiply_operand(d, mul, a, d.M, d.K, d.trans_a, e.lda, 0);
  const void* b_ptr = multiply_operand(d, mul, b, d.K, d.N, d.trans_b, e.ldb, 1);
  if (e.lda != d.lda || e.ldb != d.ldb) {
    cached = lookup(e);
    ZINC_CHECK(cached->multiply == mul, "matmul: a gathered operand's primitive multiplies another dtype");
  }
  execute(e, *cached, a_ptr, b_ptr, c, bias);
}

struct PackedWeight::Impl {
  dnnl::memory mem;  // B packed, in the layout and dtype of the primitive that reads it
  const void* source = nullptr;
  uint64_t generation = 0;
};
PackedWeight::PackedWeight() = default;
PackedWeight::~PackedWeight() = default;
PackedWeight::PackedWeight(PackedWeight&&) noexcept = default;
PackedWeight& PackedWeight::operator=(PackedWeight&&) noexcept = default;
int64_t PackedWeight::bytes() const { return impl_ ? static_cast<int64_t>(impl_->mem.get_desc().get_size()) : 0; }

namespace {
bool packable(const MatmulDesc& d) { return d.batch == 1 && d.ldb == 0 && d.M > 0 && d.N > 0 && d.K > 0; }
}  // namespace

void matmul_packed(const MatmulDesc& d, CView a, CView b, uint64_t generation, PackedWeight& slot, float* c,
                   CView bias) {
  if (generation == 0 || !packable(d)) return matmul(d, a, b, c, bias);
  ProfileScope profile_scope(Op::kMatmul);
  if (d.bias && (!bias.data || d.alpha != 1.0f))
    throw Error("matmul: a fused bias needs a bias view and alpha == 1");
  auto cached = lookup(d, /*packed=*/true);
  const DType mul = cached->multiply;
  // A as the primitive multiplies it: a strided one that must be converted
  // is gathered densely (as in matmul), read dense by its own primitive.
  MatmulDesc e = d;
  const void* a_ptr = multiply_operand(d, mul, a, d.M, d.K, d.trans_a, e.lda, 0);
  if (e.lda != d.lda) {
    cached = lookup(e, true);
    ZINC_CHECK(cached->multiply == mul, "matmul: a gathered operand's primitive multiplies another dtype");
  }
  PackedWeight::Impl* p = slot.impl_.get();
  if (!p || p->source != b.data || p->generation != generation || p->mem.get_desc() != cached->weights_md) {
    // Packed (again): reordered into the primitive's layout, widened on the
    // way where bf16 multiplies through fp32 (exact, as convert_into would);
    // any other conversion goes through a copy of its own, freed after (not
    // the grow-only thread scratch: a layer weight can pass the chunking
    // bound of Note [widened operands in chunks]).
    auto& eng = cpu_engine();
    const size_t numel = static_cast<size_t>(d.K * d.N);
    const bool as_is = !converts(b.dtype, b.bf16_exact, d.compute, mul);
    const bool widen = b.dtype == DType::kBF16 && d.compute == DType::kBF16 && mul == DType::kF32;
    AlignedBuffer converted;
    const void* src = b.data;
    DType src_dtype = as_is ? mul : b.dtype;
    if (!as_is && !widen) {
      converted = AlignedBuffer(numel * dtype_bytes(mul));
      convert_into(b, d.compute, mul, numel, converted.data());
      src = converted.data();
      src_dtype = mul;
    }
    dnnl::memory plain(operand_desc(1, d.K, d.N, d.trans_b, dnnl_type(src_dtype)), eng, const_cast<void*>(src));
    auto fresh = std::make_unique<PackedWeight::Impl>();
    slot.impl_.reset();  // the old copy goes first: at most one copy of a weight at a time
    fresh->mem = dnnl::memory(cached->weights_md, eng);
    fresh->source = b.data;
    fresh->generation = generation;
    auto& s = thread_stream();
    dnnl::reorder(plain, fresh->mem).execute(s, plain, fresh->mem);
    s.wait();
    slot.impl_ = std::move(fresh);
    p = slot.impl_.get();
  }
  execute(e, *cached, a_ptr, nullptr, c, bias, p->mem);
}

int64_t packed_weight_bytes(const MatmulDesc& d) {
  if (!packable(d)) return 0;
  return static_cast<int64_t>(lookup(d, true)->weights_md.get_size());
}

void set_matmul_bf16_path_for_testing(MatmulBf16Path path) { g_bf16_path.store(static_cast<int>(path)); }

namespace {
// Whether bf16 matmuls multiply bf16 natively here, asked once for a typical
// shape (a shape that decides otherwise still gets correct operands: bf16 is
// widened, bf16-exact fp32 is converted exactly).
bool bf16_native() {
  if (static_cast<MatmulBf16Path>(g_bf16_path.load()) == MatmulBf16Path::kViaF32) return false;
  static const bool native = [] {
    MatmulDesc d;
    d.M = 256;
    d.N = 256;
    d.K = 256;
    d.trans_b = true;
    d.compute = DType::kBF16;
    return lookup(d)->multiply == DType::kBF16;
  }();
  return native;
}

float* f32_scratch(AlignedBuffer& scratch, int64_t n) {
  return static_cast<float*>(grow_scratch(scratch, static_cast<size_t>(n) * sizeof(float)));
}
}  // namespace

bf16* bf16_scratch(AlignedBuffer& scratch, int64_t n) {
  return static_cast<bf16*>(grow_scratch(scratch, static_cast<size_t>(n) * sizeof(bf16)));
}

CView operand16_copy(const float* x, int64_t n, DType compute, AlignedBuffer& scratch) {
  if (compute == DType::kBF16) return bf16_operand_copy(x, n, scratch);
  ZINC_CHECK(compute == DType::kF16, "operand16_copy: compute must be bf16 or fp16");
  float* dst = f32_scratch(scratch, n);
  round_to_f16(x, dst, static_cast<size_t>(n));
  return {dst, DType::kF32, true};
}

CView operand16_in_place(float* x, int64_t n, DType compute, AlignedBuffer& scratch) {
  if (compute == DType::kBF16) return bf16_operand_in_place(x, n, scratch);
  ZINC_CHECK(compute == DType::kF16, "operand16_in_place: compute must be bf16 or fp16");
  round_to_f16(x, x, static_cast<size_t>(n));
  return {x, DType::kF32, true};
}

int64_t ScratchTally::operand16_bytes(int64_t n, bool in_place, DType compute) {
  if (compute == DType::kBF16) return bf16_operand_bytes(n, in_place);
  return in_place ? 0 : scratch_size(static_cast<size_t>(n) * sizeof(float));
}

CView bf16_operand_copy(const float* x, int64_t n, AlignedBuffer& scratch) {
  if (bf16_native()) {
    bf16* dst = bf16_scratch(scratch, n);
    convert_f32_to_bf16(x, dst, static_cast<size_t>(n));
    return {dst, DType::kBF16};
  }
  float* dst = f32_scratch(scratch, n);
  round_to_bf16(x, dst, static_cast<size_t>(n));
  return {dst, DType::kF32, true};
}

bool bf16_operands_native() { return bf16_native(); }

int64_t ScratchTally::bf16_operand_bytes(int64_t n, bool in_place) {
  const size_t un = static_cast<size_t>(n);
  if (bf16_native()) return scratch_size(un * sizeof(bf16));
  return in_place ? 0 : scratch_size(un * sizeof(float));
}

void ScratchTally::matmul(const MatmulDesc& d, DType a, bool a_exact, DType b, bool b_exact, DType bias_dtype) {
  if (d.batch == 0 || d.M == 0 || d.N == 0 || d.K == 0) return;
  auto cached = lookup(d);
  const DType mul = cached->multiply;
  auto grow = [this](int slot, int64_t bytes) { matmul_[slot] = std::max(matmul_[slot], bytes); };
  const size_t es = dtype_bytes(mul);
  if (converts(a, a_exact, d.compute, mul)) grow(0, scratch_size(static_cast<size_t>(d.batch * d.M * d.K) * es));
  if (int64_t cols = widen_chunk_cols(d, b, b_exact, mul)) {
    // Note [widened operands in chunks]: B converted a block at a time.
    for (int64_t n : {cols, d.N % cols}) {
      if (n == 0) continue;
      MatmulDesc dc = d;
      dc.N = n;
      dc.ldc = d.N;
      auto block = lookup(dc);
      grow(1, scratch_size(static_cast<size_t>(n * d.K) * dtype_bytes(block->multiply)));
      if (block->scratch_bytes > 0) grow(2, scratch_size(block->scratch_bytes));
    }
  } else {
    if (converts(b, b_exact, d.compute, mul)) grow(1, scratch_size(static_cast<size_t>(d.batch * d.K * d.N) * es));
    if (cached->scratch_bytes > 0) grow(2, scratch_size(cached->scratch_bytes));
  }
  if (d.bias && bias_dtype != DType::kF32) grow(3, scratch_size(static_cast<size_t>(d.N) * sizeof(float)));
}

void ScratchTally::matmul_packed(const MatmulDesc& d, DType a, bool a_exact, DType b, DType bias_dtype) {
  if (!packable(d)) return matmul(d, a, a_exact, b, false, bias_dtype);
  auto cached = lookup(d, true);
  const DType mul = cached->multiply;
  auto grow = [this](int slot, int64_t bytes) { matmul_[slot] = std::max(matmul_[slot], bytes); };
  // A as matmul_packed converts it (a strided A gathered densely: the same bytes).
  if (converts(a, a_exact, d.compute, mul))
    grow(0, scratch_size(static_cast<size_t>(d.M * d.K) * dtype_bytes(mul)));
  if (d.lda != 0 && converts(a, a_exact, d.compute, mul)) {
    MatmulDesc e = d;
    e.lda = 0;
    cached = lookup(e, true);
  }
  if (cached->scratch_bytes > 0) grow(2, scratch_size(cached->scratch_bytes));
  if (d.bias && bias_dtype != DType::kF32) grow(3, scratch_size(static_cast<size_t>(d.N) * sizeof(float)));
}

int64_t ScratchTally::bytes() const {
  int64_t n = 0;
  for (int64_t b : matmul_) n += b;
  for (int64_t b : attention_) n += b;
  return n + other_threads_;
}

CView bf16_operand_in_place(float* x, int64_t n, AlignedBuffer& scratch) {
  if (bf16_native()) {
    bf16* dst = bf16_scratch(scratch, n);
    convert_f32_to_bf16(x, dst, static_cast<size_t>(n));
    return {dst, DType::kBF16};
  }
  round_to_bf16(x, x, static_cast<size_t>(n));
  return {x, DType::kF32, true};
}

MatmulPath matmul_path(const MatmulDesc& d) {
  auto cached = lookup(d);
  return {cached->multiply, cached->impl, cached->why};
}

std::string matmul_paths_summary() {
  MatmulDesc d;
  d.M = 256;
  d.N = 256;
  d.K = 256;
  std::string out;
  for (DType t : {DType::kF32, DType::kBF16}) {
    d.compute = t;
    MatmulPath p = matmul_path(d);
    if (!out.empty()) out += " | ";
    out += "matmul " + std::string(dtype_name(t)) + ": ";
    if (t != DType::kF32 && p.multiply == DType::kF32)
      out += "via fp32 (oneDNN " + p.impl + "), " + p.why;
    else
      out += "oneDNN " + p.impl;
  }
  return out;
}

}  // namespace zinc::kernels
