// zinc models, private: the pieces both decoders use to describe a tensor
// part (Model::tensor_part; Note [tensor parallelism] in
// engine/tensor_parallel.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/model.h"

namespace zinc::models::detail {

// The whole model's blocks as a part whose every parameter is whole, with
// `what` describing its share; the model then cuts the split parameters.
inline TensorPart whole_tensor_part(const std::vector<BlockSpec>& blocks, std::string what) {
  TensorPart out{blocks, {}, std::move(what)};
  for (const BlockSpec& b : out.blocks) out.splits.emplace_back(b.params.size());
  return out;
}

// Vocabulary parts (Note [vocabulary parts] in engine/tensor_parallel.cpp):
// the embedding rows each of `parts` parts holds, ceil(V / parts), the last
// part's past V padding; V itself (whole on every part) without parts, or
// where some part would hold padding only.
inline int64_t vocab_share(int64_t V, int parts) {
  if (parts <= 1) return V;
  const int64_t v = (V + parts - 1) / parts;
  return (parts - 1) * v < V ? v : V;
}

// "2-3 of 4" (or "1 of 2"): the n of `of` from lo, for the part's description.
inline std::string part_span(int64_t lo, int64_t n, int64_t of) {
  return (n == 1 ? std::to_string(lo) : std::to_string(lo) + "-" + std::to_string(lo + n - 1)) + " of " +
         std::to_string(of);
}

}  // namespace zinc::models::detail
