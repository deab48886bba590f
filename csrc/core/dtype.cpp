#include "core/dtype.h"

#include "core/parallel.h"

namespace zinc {

// The loops below are written so that GCC vectorises them (the NaN test
// becomes a blend); they run over OpenMP chunks of at least 64 KiB of work.
void convert_f32_to_bf16(const float* src, bf16* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) dst[i] = float_to_bf16(src[i]);
  });
}

void convert_bf16_to_f32(const bf16* src, float* dst, size_t n) {
  parallel_for(n, 1 << 14, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) dst[i] = bf16_to_float(src[i]);
  });
}

}  // namespace zinc
