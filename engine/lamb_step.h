// zinc engine, private: how a span of a block's optimizer state maps onto
// the block's parameter tensors, for Lamb's per-tensor trust ratios
// (optim::LambSegment; Note [Lamb arithmetic] in optim/detail/lamb_math.h).
//
// A span is a range of the block's flat vector: the whole padded block
// (stage 0), the rank's shard, or one NVMe sub-group of it; it may hold
// parts of several tensors and the alignment gaps between them. Pure
// arithmetic; any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/model.h"
#include "optim/optim.h"

namespace zinc {

// The segments of the flat range [flat_begin, flat_begin + count) of a block
// laid out as `layout`, relative to flat_begin: parameter p becomes tensor
// first_tensor + p, gaps and padding tensor -1. They tile [0, count).
std::vector<optim::LambSegment> lamb_segments(const BlockLayout& layout, int64_t flat_begin, int64_t count,
                                              int first_tensor);

}  // namespace zinc
