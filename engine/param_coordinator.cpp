#include "engine/param_coordinator.h"

namespace zinc {

BlockParams ParamCoordinator::acquire(int block) {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  ZINC_CHECK(s.param_state == ParamState::kGathered, "stages 0-2 keep every block gathered");
  s.held += 1;
  // At stage 0 in fp32 the master weights are the compute weights.
  const void* base = s.compute.empty() ? static_cast<const void*>(s.master_compute) : s.compute.data();
  return BlockParams{base, compute_, &s.layout};
}

void ParamCoordinator::release(int block) noexcept {
  BlockShard& s = blocks_[static_cast<size_t>(block)];
  ZINC_CHECK(s.held > 0, "release of block " + std::to_string(block) + ", which is not held");
  s.held -= 1;
}

int ParamCoordinator::first_held() const {
  for (size_t b = 0; b < blocks_.size(); ++b)
    if (blocks_[b].held > 0) return static_cast<int>(b);
  return -1;
}

void ParamCoordinator::gather_after_step() {
  ZINC_CHECK(gather_ != nullptr, "gather_after_step needs the gather stream (several ranks)");
  const DType dt = compute_;
  std::vector<BlockShard*> group;
  int64_t group_numel = 0;
  auto submit = [&] {
    if (group.empty()) return;
    gather_->submit([group, dt](comm::Communicator& c) {
      const size_t es = dtype_bytes(dt);
      for (BlockShard* s : group) {
        char* base = s->compute.as<char>();
        c.all_gather(base + static_cast<size_t>(s->part.own_offset()) * es, base, s->part.shard_numel, dt);
      }
    });
    group.clear();
    group_numel = 0;
  };
  for (BlockShard& s : blocks_) {
    group.push_back(&s);
    group_numel += s.part.padded_numel;
    if (group_numel >= bucket_numel_) submit();
  }
  submit();
  gather_->synchronize();
}

}  // namespace zinc
