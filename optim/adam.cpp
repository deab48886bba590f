// Adam dispatch: picks the ISA path once, splits spans between threads.
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "core/cpu.h"
#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"
#include "optim/detail/adam_math.h"
#include "optim/detail/lamb_math.h"
#include "optim/optim.h"
#include "optim/detail/adam_args.h"

namespace zinc::optim {
namespace {

using detail::IsaKernels;

CpuIsa cpu_level(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return CpuIsa::kBaseline;
    case Isa::kAvx2: return CpuIsa::kAvx2;
    case Isa::kAvx512: return CpuIsa::kAvx512;
    case Isa::kAvx512Bf16: return CpuIsa::kAvx512Bf16;
  }
  return CpuIsa::kAvx512Bf16;
}

const IsaKernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return detail::scalar_kernels();
    case Isa::kAvx2: return detail::avx2_kernels();
    case Isa::kAvx512: return detail::avx512_kernels();
    case Isa::kAvx512Bf16: return detail::avx512_bf16_kernels();
  }
  throw Error("unknown optimizer ISA");
}

std::atomic<int> g_forced{-1};  // set_isa
std::once_flag g_once;
Isa g_active = Isa::kScalar;

Isa resolve_active() {
  std::call_once(g_once, [] {
    const char* env = std::getenv("ZINC_OPTIM_ISA");
    if (env && *env) {
      Isa want = parse_isa(env);
      if (!isa_supported(want))
        throw Error(std::string("ZINC_OPTIM_ISA=") + env + ": cannot run here: " +
                    cpu_isa_missing(cpu_level(want)) + " (best: " + std::string(isa_name(detect_isa())) + ")");
      g_active = want;
      log_info("optimizer: " + std::string(isa_name(want)) + " kernels (forced by ZINC_OPTIM_ISA)");
    } else {
      g_active = detect_isa();
      log_info("optimizer: " + std::string(isa_name(g_active)) + " kernels");
    }
  });
  int forced = g_forced.load();
  return forced >= 0 ? static_cast<Isa>(forced) : g_active;
}

// Threads take whole 16-element (64-byte) blocks: no two threads write the
// same cache line of param, m or v.
constexpr int64_t kBlock = 16;
constexpr int64_t kNormChunk = 16384;
std::atomic<int64_t> g_stream_min_bytes{kStreamMinBytes};

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

Isa parse_isa(std::string_view name) {
  for (Isa i : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16})
    if (isa_name(i) == name) return i;
  throw Error("unknown optimizer ISA '" + std::string(name) + "' (expected scalar, avx2, avx512 or avx512_bf16)");
}

// A path runs where the CPU has its instructions and ONEDNN_MAX_CPU_ISA does
// not cap them away (core/cpu.h): the optimizer follows the same cap as the
// kernels and oneDNN.
bool isa_supported(Isa isa) { return cpu_level(isa) <= cpu_isa(); }

Isa detect_isa() {
  for (Isa i : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2})
    if (isa_supported(i)) return i;
  return Isa::kScalar;
}

Isa active_isa() { return resolve_active(); }

void set_isa(Isa isa) {
  if (!isa_supported(isa))
    throw Error("optimizer ISA " + std::string(isa_name(isa)) + " cannot run here: " + cpu_isa_missing(cpu_level(isa)));
  g_forced.store(static_cast<int>(isa));
}

void set_stream_min_bytes(int64_t bytes) { g_stream_min_bytes.store(bytes); }
int64_t detail::stream_min_bytes() { return g_stream_min_bytes.load(std::memory_order_relaxed); }

detail::AdamArgs detail::make_adam_args(const AdamParams& p, int64_t step, float grad_scale) {
  detail::AdamArgs a{};
  // The moments decay by the fp32 betas (below), so the bias corrections
  // are those betas' too, as DeepSpeed's CPU Adam takes them: with the exact
  // double beta2 = 0.999 against fp32's 0.99900001, the first step's
  // second moment was 1.3e-5 off its own 1 - beta2^t (6.7e-6 in the update).
  const double b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2);
  const double bc1 = p.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
  a.grad_scale = grad_scale;
  a.beta1 = static_cast<float>(p.beta1);
  a.one_minus_beta1 = 1.0f - a.beta1;
  a.beta2 = static_cast<float>(p.beta2);
  a.one_minus_beta2 = 1.0f - a.beta2;
  a.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  a.eps = static_cast<float>(p.eps);
  a.neg_lr_wd = -static_cast<float>(p.lr) * static_cast<float>(p.weight_decay);
  a.wd = static_cast<float>(p.weight_decay);
  a.neg_step_size = -static_cast<float>(p.lr / bc1);
  return a;
}

detail::Decay detail::adam_decay(const AdamParams& p) {
  return p.weight_decay == 0.0 ? detail::Decay::kNone
                        : p.adam_w_mode       ? detail::Decay::kAdamW
                                              : detail::Decay::kL2;
}

void adam_step(const AdamParams& p, int64_t step, float grad_scale, const AdamSpan& s) {
  adam_step(p, step, grad_scale, s, resolve_active());
}

void adam_step(const AdamParams& p, int64_t step, float grad_scale, const AdamSpan& s, Isa isa) {
  if (s.n == 0) return;
  if (step < 1) throw Error("adam_step: step must be >= 1, got " + std::to_string(step));
  const detail::AdamArgs a = detail::make_adam_args(p, step, grad_scale);
  const detail::Decay decay = detail::adam_decay(p);
  // Stream the bf16 copy past the caches when the span is far larger than
  // them (and aligned for it): plain stores would first read every line.
  const bool stream = s.bf16_out && s.n * 2 >= g_stream_min_bytes.load(std::memory_order_relaxed) && reinterpret_cast<uintptr_t>(s.bf16_out) % 64 == 0;
  detail::AdamFn fn = kernels_for(isa).adam[static_cast<int>(decay)][s.grad_dtype == DType::kBF16 ? 1 : 0]
                                           [!s.bf16_out ? 0 : stream ? 2 : 1];
  const int64_t blocks = (s.n + kBlock - 1) / kBlock;
  parallel_for(static_cast<size_t>(blocks), 1 << 12, [&](size_t lo, size_t hi) {
    const int64_t b = static_cast<int64_t>(lo) * kBlock;
    const int64_t e = std::min(s.n, static_cast<int64_t>(hi) * kBlock);
    fn(a, s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.bf16_out, b, e);
  });
}

double grad_squared_norm(const void* grad, DType dtype, int64_t n) {
  return grad_squared_norm(grad, dtype, n, resolve_active());
}

double grad_squared_norm(const void* grad, DType dtype, int64_t n, Isa isa) {
  if (n <= 0) return 0.0;
  detail::SqNormFn fn = kernels_for(isa).sqnorm[dtype == DType::kBF16 ? 1 : 0];
  const int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(static_cast<size_t>(chunks));
  parallel_for(static_cast<size_t>(chunks), 4, [&](size_t lo, size_t hi) {
    for (size_t c = lo; c < hi; ++c) {
      const int64_t b = static_cast<int64_t>(c) * kNormChunk;
      partial[c] = fn(grad, b, std::min(n, b + kNormChunk));
    }
  });
  double s = 0;
  for (double x : partial) s += x;
  return s;
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

}  // namespace zinc::optim
