#include "engine/lamb_step.h"

#include <algorithm>

namespace zinc {

std::vector<optim::LambSegment> lamb_segments(const BlockLayout& layout, int64_t flat_begin, int64_t count,
                                              int first_tensor) {
  std::vector<optim::LambSegment> segs;
  const int64_t end = flat_begin + count;
  int64_t at = flat_begin;  // first element not yet in a segment
  for (size_t p = 0; p < layout.offsets.size() && at < end; ++p) {
    const int64_t b = std::max(at, layout.offsets[p]);
    const int64_t e = std::min(end, layout.offsets[p] + layout.numels[p]);
    if (b >= e) continue;  // the tensor lies wholly before or after the range
    if (b > at) segs.push_back({at - flat_begin, b - flat_begin, -1});
    segs.push_back({b - flat_begin, e - flat_begin, first_tensor + static_cast<int>(p)});
    at = e;
  }
  if (at < end) segs.push_back({at - flat_begin, end - flat_begin, -1});
  return segs;
}

}  // namespace zinc
