// zinc optim, private: Lamb's per-element update u (Note [Lamb arithmetic]
// in lamb_math.h), shared by the CPU paths (lamb_math.h, with the vector
// mappings of vec_*.h) and the GPU's Lamb (lamb_cuda.cu, with VecHD of
// adam_update.h), as adam_update.h is for Adam: the same roundings, so the
// GPU's u is the CPU's bit for bit. Also the host-side pieces both cut a
// span into, and the float arguments of a step.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/hd.h"
#include "optim/detail/adam_update.h"
#include "optim/optim.h"

namespace zinc::optim::detail {

struct LambArgs {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float wd;
};

// m, v and u of one register; kEpsInside: eps under the square root.
template <class V, bool kEpsInside>
ZINC_HD typename V::F lamb_u(const LambArgs& a, typename V::F w, typename V::F g, typename V::F& m,
                             typename V::F& v) {
  g = V::mul(g, V::set1(a.grad_scale));
  m = V::fma(V::set1(a.beta1), m, V::mul(V::set1(a.one_minus_beta1), g));
  v = V::fma(V::set1(a.beta2), v, V::mul(V::mul(V::set1(a.one_minus_beta2), g), g));
  typename V::F denom = kEpsInside ? V::sqrt(V::add(v, V::set1(a.eps))) : V::add(V::sqrt(v), V::set1(a.eps));
  return V::fma(V::set1(a.wd), w, V::div(m, denom));
}

// The float arguments of every path (lamb.cpp).
LambArgs make_lamb_args(const LambParams& p, float grad_scale);

// Norm sums are taken in pieces of this many elements from each segment's
// start: a fixed order, whatever the thread count (or the GPU's blocks).
constexpr int64_t kLambPiece = 16384;

struct LambPiece {
  int64_t begin, end;
  int seg;
};

// The segments of a span of n elements (checked: in order, covering [0, n)
// exactly; `who` names the caller in the error) cut into pieces.
std::vector<LambPiece> lamb_pieces(int64_t n, std::span<const LambSegment> segs, const char* who);

// Per segment, the coefficient -step_size * ratio that pass 2 applies (1 as
// the ratio of padding), in float as every path takes it.
std::vector<float> lamb_coefficients(const LambParams& p, int64_t step, std::span<const LambSegment> segs,
                                     const double* ratios);

}  // namespace zinc::optim::detail
