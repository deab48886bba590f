#include "core/cpu.h"

#include <cpuid.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace zinc {
namespace {

// The instructions each level needs beyond the previous one. libgcc's
// __builtin_cpu_supports also checks that the OS saves the wider registers
// (XCR0), so a level reported here can run.
struct LevelNeeds {
  CpuIsa isa;
  std::vector<const char*> features;
};

const std::vector<LevelNeeds>& level_needs() {
  static const std::vector<LevelNeeds> needs = {
      {CpuIsa::kAvx2, {"avx2", "fma"}},
      {CpuIsa::kAvx512, {"avx512f", "avx512bw", "avx512vl", "avx512dq"}},
      {CpuIsa::kAvx512Bf16, {"avx512bf16"}},
  };
  return needs;
}

bool has(const char* f) {
  // __builtin_cpu_supports needs a literal; map the few names used above.
  std::string_view s(f);
  if (s == "avx2") return __builtin_cpu_supports("avx2");
  if (s == "fma") return __builtin_cpu_supports("fma");
  if (s == "avx512f") return __builtin_cpu_supports("avx512f");
  if (s == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (s == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (s == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (s == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  return false;
}

// Instructions of `want` (and the levels below it) that the CPU lacks.
std::vector<std::string> lacking(CpuIsa want) {
  __builtin_cpu_init();
  std::vector<std::string> out;
  for (const LevelNeeds& l : level_needs()) {
    if (l.isa > want) break;
    for (const char* f : l.features)
      if (!has(f)) out.emplace_back(f);
  }
  return out;
}

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

CpuIsa parse_cap(const std::string& raw) {
  const std::string v = upper(raw);
  if (v.empty() || v == "ALL" || v == "DEFAULT") return CpuIsa::kAvx512Bf16;
  if (v == "SSE41" || v == "AVX") return CpuIsa::kBaseline;
  if (v == "AVX2" || v == "AVX2_VNNI") return CpuIsa::kAvx2;
  if (v == "AVX512_MIC" || v == "AVX512_MIC_4OPS" || v == "AVX512_CORE" || v == "AVX512_CORE_VNNI")
    return CpuIsa::kAvx512;
  if (v == "AVX512_CORE_BF16" || v == "AVX512_CORE_FP16" || v == "AVX512_CORE_AMX")
    return CpuIsa::kAvx512Bf16;
  throw Error("ONEDNN_MAX_CPU_ISA=" + raw +
              ": unknown ISA (expected one of SSE41, AVX, AVX2, AVX2_VNNI, AVX512_CORE, "
              "AVX512_CORE_VNNI, AVX512_CORE_BF16, AVX512_CORE_AMX, ALL)");
}

}  // namespace

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512_bf16";
  }
  return "?";
}

CpuIsa cpu_isa_detected() {
  static const CpuIsa detected = [] {
    CpuIsa best = CpuIsa::kBaseline;
    for (CpuIsa i : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
      if (!lacking(i).empty()) break;
      best = i;
    }
    return best;
  }();
  return detected;
}

std::string cpu_isa_cap_env() {
  const char* env = std::getenv("ONEDNN_MAX_CPU_ISA");
  return env ? std::string(env) : std::string();
}

CpuIsa cpu_isa_cap() { return parse_cap(cpu_isa_cap_env()); }

CpuIsa cpu_isa() { return std::min(cpu_isa_detected(), cpu_isa_cap()); }

std::string cpu_isa_missing(CpuIsa want) {
  std::vector<std::string> l = lacking(want);
  if (!l.empty()) {
    std::string s = "the CPU lacks";
    for (const std::string& f : l) s += " " + f;
    return s;
  }
  if (want > cpu_isa_cap()) return "capped by ONEDNN_MAX_CPU_ISA=" + cpu_isa_cap_env();
  return "";
}

std::string cpu_isa_summary() {
  const CpuIsa active = cpu_isa(), detected = cpu_isa_detected();
  std::string s = "cpu: " + std::string(cpu_isa_name(active)) + " kernels (";
  if (active < detected) {
    s += "capped by ONEDNN_MAX_CPU_ISA=" + cpu_isa_cap_env() + "; the CPU has " +
         std::string(cpu_isa_name(detected)) + ")";
  } else if (detected == CpuIsa::kAvx512Bf16) {
    s += "the best zinc has for this CPU)";
  } else {
    s += cpu_isa_missing(static_cast<CpuIsa>(static_cast<int>(detected) + 1)) + ")";
  }
  return s;
}

bool cpu_is_intel() {
  static const bool intel = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    return std::strcmp(vendor, "GenuineIntel") == 0;
  }();
  return intel;
}

std::string cpu_model_and_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU", flags;
  bool have_model = false, have_flags = false;
  while (std::getline(in, line) && !(have_model && have_flags)) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, line.find_first_of(" \t"));
    std::string value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model" && line.rfind("model name", 0) == 0 && !have_model) {
      model = value;
      have_model = true;
    } else if (key == "flags" && !have_flags) {
      std::istringstream words(value);
      std::string w;
      for (const char* want : {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                               "avx512_bf16", "amx_bf16"}) {
        words.clear();
        words.str(value);
        while (words >> w)
          if (w == want) {
            flags += (flags.empty() ? "" : " ") + w;
            break;
          }
      }
      have_flags = true;
    }
  }
  return model + " | " + (flags.empty() ? "no avx2" : flags);
}

namespace detail {

std::atomic<int> g_dispatch_isa{-1};

CpuIsa resolve_dispatch_isa() {
  // Kernels may run inside OpenMP regions, where an exception would end the
  // process: a bad ONEDNN_MAX_CPU_ISA is reported by cpu_isa() where zinc
  // starts (Engine::initialize, the tools); here it is ignored.
  CpuIsa isa;
  try {
    isa = cpu_isa();
  } catch (const Error&) {
    isa = cpu_isa_detected();
  }
  int expected = -1;
  g_dispatch_isa.compare_exchange_strong(expected, static_cast<int>(isa));
  return static_cast<CpuIsa>(g_dispatch_isa.load());
}

void set_dispatch_isa_for_testing(CpuIsa isa) {
  if (isa > cpu_isa())
    throw Error("set_dispatch_isa_for_testing: " + std::string(cpu_isa_name(isa)) +
                " cannot run here: " + cpu_isa_missing(isa));
  g_dispatch_isa.store(static_cast<int>(isa));
}

void reset_dispatch_isa_for_testing() { g_dispatch_isa.store(static_cast<int>(cpu_isa())); }

}  // namespace detail
}  // namespace zinc
