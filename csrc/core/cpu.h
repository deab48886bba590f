// zinc core: what the CPU can do, the cap on it, and run-time ISA dispatch.
//
// Note [ISA levels and the cap]
// zinc's vector code comes in three compiled forms: the x86-64 baseline
// (SSE2), AVX2 (with FMA, as every AVX2 CPU has it) and AVX-512
// (F, BW, VL, DQ: oneDNN's avx512_core). A fourth level, AVX-512 with the
// BF16 instructions, matters to the optimizer's copy-out and to oneDNN's bf16
// matmul. The level in use is the best the CPU and the OS support, capped by
// ONEDNN_MAX_CPU_ISA: one variable caps zinc's kernels and oneDNN together
// (oneDNN's own names: SSE41, AVX, AVX2, AVX2_VNNI, AVX512_CORE,
// AVX512_CORE_VNNI, AVX512_CORE_BF16, AVX512_CORE_AMX, ALL; any case). zinc
// also hands the cap to oneDNN explicitly (kernels/matmul.cpp), so the two
// agree even where oneDNN would not parse the spelling. With the cap a
// machine with AVX-512 runs exactly the code an AVX2 machine runs, which is
// how CI proves the small CPU on a big one.
//
// The level is read once per process; an unknown ONEDNN_MAX_CPU_ISA value is
// an error naming the variable and the accepted names.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace zinc {

enum class CpuIsa : uint8_t { kBaseline = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// "baseline", "avx2", "avx512", "avx512_bf16".
std::string_view cpu_isa_name(CpuIsa isa);

// The best level the CPU and OS support, ignoring the cap.
CpuIsa cpu_isa_detected();
// The cap from ONEDNN_MAX_CPU_ISA (kAvx512Bf16 when unset or ALL). Throws
// zinc::Error for an unknown value.
CpuIsa cpu_isa_cap();
// The raw ONEDNN_MAX_CPU_ISA value ("" when unset).
std::string cpu_isa_cap_env();
// min(detected, cap): the level every zinc kernel dispatches on.
CpuIsa cpu_isa();

// Why `want` cannot run here: "" when it can, else e.g. "the CPU lacks
// avx512f avx512bw" or "capped by ONEDNN_MAX_CPU_ISA=AVX2". Tests use it in
// their skip messages.
std::string cpu_isa_missing(CpuIsa want);

// One line for logs and headers: "cpu: avx2 (AVX2 FMA F16C; no AVX-512)" or
// "cpu: avx2 (capped by ONEDNN_MAX_CPU_ISA=AVX2; the CPU has avx512_bf16)".
std::string cpu_isa_summary();

// The CPU's model name and its vector flags as /proc/cpuinfo lists them, for
// benchmark records: "AMD EPYC | avx2 fma" or "Intel(R) Xeon(R) ... | avx2
// fma avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_bf16".
std::string cpu_model_and_flags();

// Whether the CPU is Intel's (CPUID vendor "GenuineIntel"). The bf16 matmul
// route depends on it (Note [bf16 matmul without native bf16]).
bool cpu_is_intel();

}  // namespace zinc

// ---- run-time dispatch ---------------------------------------------------------
// ZINC_ISA_VARIANTS(ret, name, (params), (args)) defines name_baseline,
// name_avx2 and name_avx512 from one always-inline body `name_body`, each
// compiled for its level with GCC's target attribute, and `name(params)`
// that calls the variant for zinc::detail::dispatch_isa(). The body is
// written once in plain C++ and vectorised by the compiler for each target
// (Note [kernel vectorisation] in kernels/simd_math.h).
#define ZINC_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define ZINC_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define ZINC_ALWAYS_INLINE __attribute__((always_inline)) inline

#define ZINC_ISA_VARIANTS(ret, name, params, args)                              \
  ret name##_baseline params { return name##_body args; }                       \
  ZINC_TARGET_AVX2 ret name##_avx2 params { return name##_body args; }          \
  ZINC_TARGET_AVX512 ret name##_avx512 params { return name##_body args; }      \
  ret name params {                                                             \
    switch (::zinc::detail::dispatch_isa()) {                                   \
      case ::zinc::CpuIsa::kBaseline: return name##_baseline args;              \
      case ::zinc::CpuIsa::kAvx2: return name##_avx2 args;                      \
      default: return name##_avx512 args;                                       \
    }                                                                           \
  }

namespace zinc::detail {

// The level ZINC_ISA_VARIANTS dispatches on: cpu_isa() unless a test forced
// another (one relaxed atomic load once resolved).
extern std::atomic<int> g_dispatch_isa;  // -1 until first use
CpuIsa resolve_dispatch_isa();
inline CpuIsa dispatch_isa() {
  const int v = g_dispatch_isa.load(std::memory_order_relaxed);
  return v >= 0 ? static_cast<CpuIsa>(v) : resolve_dispatch_isa();
}
// Tests: run the vector code at `isa` (must be <= cpu_isa(); throws
// otherwise). Not for use while other threads run kernels.
void set_dispatch_isa_for_testing(CpuIsa isa);
void reset_dispatch_isa_for_testing();

}  // namespace zinc::detail
