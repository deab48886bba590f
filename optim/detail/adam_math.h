// zinc optim, private: the Adam update written once, for any mapping V
// (vec_scalar.h, vec_avx2.h, vec_avx512.h). Each ISA file instantiates
// adam_range / sqnorm_range with its mapping and its scalar tail; the scalar
// path instantiates them with VecScalar<false> alone.
//
// Note [Adam arithmetic]: per element, with g = grad * grad_scale,
//   L2 mode:      g = wd * w + g
//   m = b1 * m + (1 - b1) * g
//   v = b2 * v + ((1 - b2) * g) * g
//   denom = sqrt(v) * (1 / sqrt(1 - b2^t)) + eps
//   AdamW mode:   w = (-lr * wd) * w + w
//   w = (-lr / (1 - b1^t)) * (m / denom) + w
// Every "x * y + z" is V::fma: one rounding in the AVX paths, two in the
// plain scalar path. Elements are independent, so a result never depends on
// how the range is split between threads.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "optim/detail/adam_update.h"

namespace zinc::optim::detail {

// Elements [lo, hi) of one span: V over whole registers, then T (the same
// arithmetic at width 1) for the rest.
// kOut: 0 no copy-out, 1 bf16 stores, 2 non-temporal bf16 stores (out must
// be aligned to a vector of bf16; for spans much larger than the caches,
// where the stores would otherwise first read every line they write).
template <class V, class T, Decay kDecay, bool kGradBf16, int kOut>
void adam_range(const AdamArgs& a, float* w, const void* grad, float* m, float* v, bf16* out, int64_t lo,
                int64_t hi) {
  const float* g32 = static_cast<const float*>(grad);
  const bf16* g16 = static_cast<const bf16*>(grad);
  int64_t i = lo;
  auto body = [&](auto vec, int64_t j) {
    using W = decltype(vec);
    typename W::F wi = W::load(w + j), mi = W::load(m + j), vi = W::load(v + j);
    typename W::F gi;
    if constexpr (kGradBf16)
      gi = W::load_bf16(g16 + j);
    else
      gi = W::load(g32 + j);
    adam_update<W, kDecay>(a, wi, gi, mi, vi);
    W::store(w + j, wi);
    W::store(m + j, mi);
    W::store(v + j, vi);
    if constexpr (kOut == 1) W::store_bf16(out + j, wi);
    if constexpr (kOut == 2) W::stream_bf16(out + j, wi);
  };
  for (; i + V::kWidth <= hi; i += V::kWidth) body(V{}, i);
  for (; i < hi; ++i) body(T{}, i);
  if constexpr (kOut == 2) V::fence();  // order the streamed stores before the caller's barrier
}

// Sum of squares of grad[lo, hi) in double: whole registers of V into its
// double accumulator, lanes added in order, then the rest with T.
template <class V, class T, bool kGradBf16>
double sqnorm_range(const void* grad, int64_t lo, int64_t hi) {
  auto load = [&](auto vec, int64_t j) {
    using W = decltype(vec);
    if constexpr (kGradBf16)
      return W::load_bf16(static_cast<const bf16*>(grad) + j);
    else
      return W::load(static_cast<const float*>(grad) + j);
  };
  typename V::D acc = V::dzero();
  int64_t i = lo;
  for (; i + V::kWidth <= hi; i += V::kWidth) acc = V::sq_acc(acc, load(V{}, i));
  double s = V::dsum(acc);
  for (; i < hi; ++i) s = T::sq_acc(s, load(T{}, i));
  return s;
}

using AdamFn = void (*)(const AdamArgs&, float*, const void*, float*, float*, bf16*, int64_t, int64_t);
using SqNormFn = double (*)(const void*, int64_t, int64_t);

// One ISA's entry points: adam[decay][grad is bf16][copy-out: none, store, stream].
struct IsaKernels {
  AdamFn adam[3][2][3];
  SqNormFn sqnorm[2];  // [grad is bf16]
};

template <class V, class T>
IsaKernels make_adam_table() {
  IsaKernels k{};
  auto fill = [&](auto decay_tag) {
    constexpr Decay d = decltype(decay_tag)::value;
    k.adam[static_cast<int>(d)][0][0] = &adam_range<V, T, d, false, 0>;
    k.adam[static_cast<int>(d)][0][1] = &adam_range<V, T, d, false, 1>;
    k.adam[static_cast<int>(d)][0][2] = &adam_range<V, T, d, false, 2>;
    k.adam[static_cast<int>(d)][1][0] = &adam_range<V, T, d, true, 0>;
    k.adam[static_cast<int>(d)][1][1] = &adam_range<V, T, d, true, 1>;
    k.adam[static_cast<int>(d)][1][2] = &adam_range<V, T, d, true, 2>;
  };
  fill(std::integral_constant<Decay, Decay::kNone>{});
  fill(std::integral_constant<Decay, Decay::kAdamW>{});
  fill(std::integral_constant<Decay, Decay::kL2>{});
  k.sqnorm[0] = &sqnorm_range<V, T, false>;
  k.sqnorm[1] = &sqnorm_range<V, T, true>;
  return k;
}

// Defined in adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp.
const IsaKernels& scalar_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& avx512_kernels();       // integer bf16 rounding
const IsaKernels& avx512_bf16_kernels();  // VCVTNEPS2BF16

}  // namespace zinc::optim::detail
