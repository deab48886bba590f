// Helpers shared by the optimizer tests that run every ISA path
// (adam_isa_test.cpp, lamb_test.cpp).
#pragma once

#include <cmath>

#include "optim/optim.h"

namespace zinc::optim::testing {

// Every ISA path, lowest first; a test skips those this CPU cannot run.
inline constexpr Isa kAll[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};

// One unit in the last place of |x| rounded to fp32.
inline double ulp(double x) {
  const float f = static_cast<float>(std::fabs(x));
  return std::nextafter(f, INFINITY) - f;
}

}  // namespace zinc::optim::testing
