// The Adam-pattern probe's AVX-512 body (this file is compiled with
// -mavx512f): explicit 512-bit loads and stores, as the optimizer's AVX-512
// path issues them, so the probe draws the bandwidth that path could.
#include <immintrin.h>

#include <cstdint>

namespace zinc::optim {

void probe_range_avx512(float* a, const float* b, float* c, float* d, int64_t lo, int64_t hi) {
  const __m512 half = _mm512_set1_ps(0.5f);
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    __m512 x = _mm512_loadu_ps(b + i);
    _mm512_storeu_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(a + i), x));
    _mm512_storeu_ps(c + i, _mm512_sub_ps(_mm512_loadu_ps(c + i), x));
    _mm512_storeu_ps(d + i, _mm512_fmadd_ps(_mm512_loadu_ps(d + i), half, x));
  }
  for (; i < hi; ++i) {
    a[i] += b[i];
    c[i] -= b[i];
    d[i] = d[i] * 0.5f + b[i];
  }
}

}  // namespace zinc::optim
