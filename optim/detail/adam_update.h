// zinc optim, private: the per-element Adam update, shared by the CPU paths
// (adam_math.h instantiates it with the vector mappings of vec_*.h) and the
// GPU AdamW (adam_cuda.cu instantiates it with VecHD below). Note [Adam
// arithmetic] in adam_math.h gives the operation order.
//
// VecHD is the width-1 mapping with one rounding per fma, IEEE division and
// square root, on the host (std::fma) and on the device (__fmaf_rn, __fdiv_rn,
// __fsqrt_rn). Those are exactly the roundings of the AVX2 and AVX-512 paths
// (vfmadd, vdivps, vsqrtps) and of VecScalar<true>, so the GPU's AdamW and
// zinc's CPU AdamW on an FMA CPU (ZeRO-Offload) give the same bits; optim_test
// checks VecHD against every CPU path on the host.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/hd.h"

namespace zinc::optim::detail {

struct AdamArgs {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float inv_sqrt_bc2;  // 1 / sqrt(1 - b2^t), or 1 without bias correction
  float eps;
  float neg_lr_wd;      // -lr * weight_decay (AdamW mode)
  float wd;             // weight_decay (L2 mode)
  float neg_step_size;  // -lr / (1 - b1^t)
};

enum class Decay { kNone, kAdamW, kL2 };

// The whole per-element update on one register of V.
template <class V, Decay kDecay>
ZINC_HD void adam_update(const AdamArgs& a, typename V::F& w, typename V::F g, typename V::F& m,
                        typename V::F& v) {
  g = V::mul(g, V::set1(a.grad_scale));
  if constexpr (kDecay == Decay::kL2) g = V::fma(V::set1(a.wd), w, g);
  m = V::fma(V::set1(a.beta1), m, V::mul(V::set1(a.one_minus_beta1), g));
  v = V::fma(V::set1(a.beta2), v, V::mul(V::mul(V::set1(a.one_minus_beta2), g), g));
  typename V::F denom = V::fma(V::sqrt(v), V::set1(a.inv_sqrt_bc2), V::set1(a.eps));
  if constexpr (kDecay == Decay::kAdamW) w = V::fma(V::set1(a.neg_lr_wd), w, w);
  w = V::fma(V::set1(a.neg_step_size), V::div(m, denom), w);
}

struct VecHD {
  using F = float;
  static ZINC_HD F set1(float x) { return x; }
  static ZINC_HD F add(F a, F b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
  }
  static ZINC_HD F mul(F a, F b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
  }
  static ZINC_HD F div(F a, F b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
  }
  static ZINC_HD F sqrt(F a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return std::sqrt(a);
#endif
  }
  static ZINC_HD F fma(F a, F b, F c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  }
};

}  // namespace zinc::optim::detail
