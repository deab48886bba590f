// zinc optim, private: the width-1 "vector" mapping. With kFma the fused
// multiply-add is one rounding (std::fma, a hardware instruction in the
// files built with FMA), so the scalar tail of a vector path computes exactly
// what its vector body computes; without it, a*b+c rounds twice, as a plain
// scalar loop does on any x86-64.
#pragma once

#include <cmath>

#include "core/dtype.h"

namespace zinc::optim::detail {

// kTag only makes the type distinct per ISA file: inline template code built
// with different -m flags must not be merged by the linker across files.
template <bool kFma, int kTag = 0>
struct VecScalar {
  using F = float;
  static constexpr int kWidth = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load_bf16(const bf16* p) { return bf16_to_float(*p); }
  static void store_bf16(bf16* p, F x) { *p = float_to_bf16(x); }
  static void stream_bf16(bf16* p, F x) { *p = float_to_bf16(x); }
  static void fence() {}
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fma(F a, F b, F c) {
    if constexpr (kFma) return std::fma(a, b, c);
    return a * b + c;
  }
  // Sum-of-squares accumulator in double.
  using D = double;
  static D dzero() { return 0.0; }
  static D sq_acc(D acc, F x) {
    const double d = static_cast<double>(x);
    if constexpr (kFma) return std::fma(d, d, acc);
    return acc + d * d;
  }
  static double dsum(D acc) { return acc; }
};

}  // namespace zinc::optim::detail
