// zinc optim, private: AdamParams at a step -> the float arguments of the
// per-element update, computed once per step on the host for every path
// (CPU ISA paths and the GPU's AdamW alike).
#pragma once

#include <cstdint>

#include "optim/detail/adam_update.h"
#include "optim/optim.h"

namespace zinc::optim::detail {

AdamArgs make_adam_args(const AdamParams& p, int64_t step, float grad_scale);
Decay adam_decay(const AdamParams& p);

}  // namespace zinc::optim::detail
