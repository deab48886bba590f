#include "engine/model.h"

#include "core/alloc.h"

namespace zinc {

BlockLayout BlockLayout::from_spec(const BlockSpec& spec) {
  BlockLayout l;
  int64_t off = 0;
  for (const ParamSpec& p : spec.params) {
    l.offsets.push_back(off);
    l.numels.push_back(p.shape.numel());
    off += static_cast<int64_t>(round_up(static_cast<size_t>(p.shape.numel()), kParamAlignNumel));
  }
  l.numel = off;
  return l;
}

}  // namespace zinc
