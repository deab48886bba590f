// The Adam-pattern streaming probe: the memory bandwidth the optimizer's
// access pattern can draw on this machine, the bound the optimizer's speed
// is measured against. Beside the optimizer it bounds; zinc-bench adamw and
// the Python module (zinc._bench.adam_probe) both call it, so both measure
// the same bound.
#pragma once

#include <cstdint>

namespace zinc::optim {

// Per element: read a, b, c, d and write a, c, d back in place (28 bytes),
// with trivial arithmetic; threads split the range like the optimizer does.
// With AVX-512 it uses explicit 512-bit accesses (adam_probe_avx512.cpp; GCC's
// auto-vectoriser prefers 256-bit ones), else the compiler's best clone.
void adam_probe(float* a, const float* b, float* c, float* d, int64_t n);

// Bytes the probe moves per element.
constexpr double kAdamProbeBytes = 28.0;

}  // namespace zinc::optim
