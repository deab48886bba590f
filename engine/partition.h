// zinc engine: how a block's flat vector splits between ranks.
//
// A block of `numel` elements is padded to a multiple of world_size *
// kShardAlignNumel so that it splits into world_size equal shards, each a
// multiple of 1024 elements: 64-byte aligned for SIMD and 4 KiB aligned in
// fp32 for O_DIRECT. Rank r owns elements [r * shard_numel, (r+1) *
// shard_numel). Padding elements are zero in every buffer and stay zero (their
// gradient is zero and Adam leaves a zero with zero gradient at zero).
#pragma once

#include <cstdint>

namespace zinc {

constexpr int64_t kShardAlignNumel = 1024;

struct Partition {
  int world_size = 1;
  int rank = 0;
  int64_t numel = 0;         // used elements (the block layout's numel)
  int64_t padded_numel = 0;  // world_size * shard_numel
  int64_t shard_numel = 0;

  static Partition make(int64_t numel, int world_size, int rank) {
    Partition p;
    p.world_size = world_size;
    p.rank = rank;
    p.numel = numel;
    const int64_t unit = kShardAlignNumel * world_size;
    p.padded_numel = (numel + unit - 1) / unit * unit;
    if (p.padded_numel == 0) p.padded_numel = unit;
    p.shard_numel = p.padded_numel / world_size;
    return p;
  }
  int64_t shard_offset(int r) const { return static_cast<int64_t>(r) * shard_numel; }
  int64_t own_offset() const { return shard_offset(rank); }
};

}  // namespace zinc
