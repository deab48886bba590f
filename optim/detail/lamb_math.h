// zinc optim, private: the Lamb update written once, for any mapping V
// (vec_scalar.h, vec_avx2.h, vec_avx512.h), as adam_math.h does for Adam.
//
// Note [Lamb arithmetic]: DeepSpeed's FusedLamb (csrc/lamb), per element,
// with g = grad * grad_scale and m, v NOT bias-corrected:
//   m = b1 * m + (1 - b1) * g
//   v = b2 * v + ((1 - b2) * g) * g
//   denom = sqrt(v) + eps             (eps_inside_sqrt: sqrt(v + eps))
//   u = wd * w + m / denom
// and per parameter tensor (over all its elements, on every rank):
//   ratio = ||w|| / ||u||  (w before the update) clamped to [min_coeff,
//           max_coeff]; 1 where either norm is 0
//   w = (-step_size * ratio) * u + w,  step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)
//                                       (no bias correction: lr)
// Bias correction is folded into step_size, so ||u|| is the norm of the
// uncorrected update, and the weight-decay term is scaled by it too: that
// is what DeepSpeed computes, which differs from the LAMB paper's
// m_hat / (sqrt(v_hat) + eps) + wd * w at small t.
//
// Two passes, so that the ratios can be summed over ranks in between: pass
// 1 (lamb_norms_range) only reads w, g, m, v and adds w^2 and u^2 in double;
// pass 2 (lamb_apply_range) computes m, v and u again with the same
// operations (so the u it applies is bit for bit the u it measured) and
// writes w, m, v and the bf16 copy. Every "x * y + z" is V::fma, as in Note
// [Adam arithmetic].
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "core/dtype.h"
#include "optim/detail/lamb_update.h"

namespace zinc::optim::detail {

template <class W, bool kGradBf16>
inline typename W::F lamb_load_grad(const void* grad, int64_t j) {
  if constexpr (kGradBf16)
    return W::load_bf16(static_cast<const bf16*>(grad) + j);
  else
    return W::load(static_cast<const float*>(grad) + j);
}

// Pass 1 over elements [lo, hi): {sum w^2, sum u^2} in double, whole
// registers of V into its double accumulators (lanes added in order), then
// the rest with T. Reads only.
template <class V, class T, bool kEpsInside, bool kGradBf16>
std::pair<double, double> lamb_norms_range(const LambArgs& a, const float* w, const void* grad, const float* m,
                                           const float* v, int64_t lo, int64_t hi) {
  typename V::D acc_w = V::dzero(), acc_u = V::dzero();
  int64_t i = lo;
  for (; i + V::kWidth <= hi; i += V::kWidth) {
    typename V::F wi = V::load(w + i), mi = V::load(m + i), vi = V::load(v + i);
    typename V::F u = lamb_u<V, kEpsInside>(a, wi, lamb_load_grad<V, kGradBf16>(grad, i), mi, vi);
    acc_w = V::sq_acc(acc_w, wi);
    acc_u = V::sq_acc(acc_u, u);
  }
  double sw = V::dsum(acc_w), su = V::dsum(acc_u);
  for (; i < hi; ++i) {
    float wi = w[i], mi = m[i], vi = v[i];
    float u = lamb_u<T, kEpsInside>(a, wi, lamb_load_grad<T, kGradBf16>(grad, i), mi, vi);
    sw = T::sq_acc(sw, wi);
    su = T::sq_acc(su, u);
  }
  return {sw, su};
}

// Pass 2 over elements [lo, hi): w = neg_coef * u + w (neg_coef = -step_size
// * ratio of the tensor the range lies in), m, v, w stored, w copied out as
// bf16 (kOut as adam_range's: 0 none, 1 stores, 2 non-temporal stores; with
// 2 the first elements go through T until out is aligned for V).
template <class V, class T, bool kEpsInside, bool kGradBf16, int kOut>
void lamb_apply_range(const LambArgs& a, float neg_coef, float* w, const void* grad, float* m, float* v, bf16* out,
                      int64_t lo, int64_t hi) {
  auto body = [&](auto vec, int64_t j) {
    using W = decltype(vec);
    typename W::F wi = W::load(w + j), mi = W::load(m + j), vi = W::load(v + j);
    typename W::F u = lamb_u<W, kEpsInside>(a, wi, lamb_load_grad<W, kGradBf16>(grad, j), mi, vi);
    wi = W::fma(W::set1(neg_coef), u, wi);
    W::store(w + j, wi);
    W::store(m + j, mi);
    W::store(v + j, vi);
    if constexpr (kOut == 1) W::store_bf16(out + j, wi);
    if constexpr (kOut == 2) W::stream_bf16(out + j, wi);
  };
  int64_t i = lo;
  if constexpr (kOut == 2) {
    constexpr uintptr_t kAlign = static_cast<uintptr_t>(V::kWidth) * 2;
    for (; i < hi && reinterpret_cast<uintptr_t>(out + i) % kAlign != 0; ++i) {
      typename T::F wi = w[i], mi = m[i], vi = v[i];
      typename T::F u = lamb_u<T, kEpsInside>(a, wi, lamb_load_grad<T, kGradBf16>(grad, i), mi, vi);
      wi = T::fma(neg_coef, u, wi);
      w[i] = wi;
      m[i] = mi;
      v[i] = vi;
      T::store_bf16(out + i, wi);
    }
  }
  for (; i + V::kWidth <= hi; i += V::kWidth) body(V{}, i);
  for (; i < hi; ++i) body(T{}, i);
  if constexpr (kOut == 2) V::fence();
}

using LambNormsFn = std::pair<double, double> (*)(const LambArgs&, const float*, const void*, const float*,
                                                  const float*, int64_t, int64_t);
using LambApplyFn = void (*)(const LambArgs&, float, float*, const void*, float*, float*, bf16*, int64_t, int64_t);

// One ISA's Lamb entry points: norms[eps inside][grad bf16],
// apply[eps inside][grad bf16][copy-out: none, store, stream].
struct LambKernels {
  LambNormsFn norms[2][2];
  LambApplyFn apply[2][2][3];
};

template <class V, class T>
LambKernels make_lamb_table() {
  LambKernels k{};
  auto fill = [&](auto inside_tag, auto bf16_tag) {
    constexpr bool in = decltype(inside_tag)::value;
    constexpr bool b = decltype(bf16_tag)::value;
    k.norms[in][b] = &lamb_norms_range<V, T, in, b>;
    k.apply[in][b][0] = &lamb_apply_range<V, T, in, b, 0>;
    k.apply[in][b][1] = &lamb_apply_range<V, T, in, b, 1>;
    k.apply[in][b][2] = &lamb_apply_range<V, T, in, b, 2>;
  };
  using F = std::false_type;
  using Tr = std::true_type;
  fill(F{}, F{});
  fill(F{}, Tr{});
  fill(Tr{}, F{});
  fill(Tr{}, Tr{});
  return k;
}

// set_stream_min_bytes's value (adam.cpp).
int64_t stream_min_bytes();

// Defined in adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp (the files
// built with each ISA's flags).
const LambKernels& scalar_lamb_kernels();
const LambKernels& avx2_lamb_kernels();
const LambKernels& avx512_lamb_kernels();
const LambKernels& avx512_bf16_lamb_kernels();

}  // namespace zinc::optim::detail
