// Kernel emulation (Note [kernel emulation] in ../cuda_emu.h): bf16 as the
// fragments of mma.h hold it, its bits and its value; nothing else of
// CUDA's header.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
  float to_float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};
inline float __bfloat162float(__nv_bfloat16 h) { return h.to_float(); }
