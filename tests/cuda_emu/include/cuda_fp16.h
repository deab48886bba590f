// Kernel emulation (Note [kernel emulation] in ../cuda_emu.h): fp16 as the
// fragments of mma.h hold it, its bits and its value; nothing else of
// CUDA's header.
#pragma once
#include <cmath>
#include <cstdint>

struct __half {
  uint16_t bits;
  float to_float() const {
    const int e = (bits >> 10) & 0x1f, m = bits & 0x3ff;
    const float sign = (bits & 0x8000) ? -1.0f : 1.0f;
    if (e == 0x1f) return m ? NAN : sign * INFINITY;
    if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);  // subnormal
    return sign * std::ldexp(static_cast<float>(m | 0x400), e - 25);
  }
};
using half = __half;
inline float __half2float(__half h) { return h.to_float(); }
