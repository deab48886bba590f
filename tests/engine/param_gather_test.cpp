// ParamCoordinator::gather_after_step on its own, across ranks (part of
// engine_multirank_test): every rank's new shard of every block reaches every
// rank, in fp32 and bf16, one bucket per block or one for all; and the
// gathers run on their own stream, so they finish while the reduction stream
// is busy (a gather never queues behind a reduction).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "engine/param_coordinator.h"
#include "engine/shard.h"

namespace zinc {

extern std::shared_ptr<comm::Communicator> g_world;

namespace {

const int64_t kNumel[] = {3000, 1, 5000};

// Exact in bf16: small integers.
float value(int owner, int block, int64_t i) { return static_cast<float>(owner * 16 + block * 4 + (i % 3)); }

struct Blocks {
  std::vector<BlockShard> blocks;
  DType dt;
  // Each rank's compute copies hold its own shard; every other element is
  // NaN until the gather.
  explicit Blocks(DType d) : blocks(3), dt(d) {
    const int world = g_world->size(), rank = g_world->rank();
    for (int b = 0; b < 3; ++b) {
      BlockShard& s = blocks[b];
      s.part = Partition::make(kNumel[b], world, rank);
      s.compute = AlignedBuffer(static_cast<size_t>(s.part.padded_numel) * dtype_bytes(d));
      for (int64_t i = 0; i < s.part.padded_numel; ++i) {
        const bool own = i >= s.part.own_offset() && i < s.part.own_offset() + s.part.shard_numel;
        set(s, i, own ? value(rank, b, i) : NAN);
      }
    }
  }
  void set(BlockShard& s, int64_t i, float v) {
    if (dt == DType::kF32) s.compute.as<float>()[i] = v;
    else s.compute.as<bf16>()[i] = float_to_bf16(v);
  }
  float get(const BlockShard& s, int64_t i) const {
    return dt == DType::kF32 ? s.compute.as<float>()[i] : bf16_to_float(s.compute.as<bf16>()[i]);
  }
  void expect_gathered(const std::string& what) const {
    for (int b = 0; b < 3; ++b) {
      const BlockShard& s = blocks[b];
      int bad = 0;
      for (int64_t i = 0; i < s.part.padded_numel; ++i) {
        const int owner = static_cast<int>(i / s.part.shard_numel);
        if (get(s, i) != value(owner, b, i) && bad++ < 3)
          ADD_FAILURE() << what << ": block " << b << " element " << i << ": " << get(s, i);
      }
    }
  }
};

TEST(ParamCoordinator, GatherAfterStepBringsEveryRanksShardInFp32AndBf16) {
  comm::Communicator* twin = g_world->twin();
  ASSERT_NE(twin, nullptr);
  comm::CommStream gather(*twin);
  for (DType dt : {DType::kF32, DType::kBF16})
    for (int64_t bucket : {int64_t{1}, int64_t{1} << 30}) {
      Blocks f(dt);
      StateMemory memory;
      ZeroConfig o;
      o.allgather_bucket_size = bucket;
      ParamCoordinator pc(StagePlan::make(1, g_world->size()), f.blocks, dt, &gather, memory, o);
      pc.gather_after_step();
      f.expect_gathered(std::string(dtype_name(dt)) + " bucket " + std::to_string(bucket));
    }
}

TEST(ParamCoordinator, GathersFinishWhileTheReductionStreamIsBusy) {
  comm::Communicator* twin = g_world->twin();
  ASSERT_NE(twin, nullptr);
  comm::CommStream reduce(*g_world), gather(*twin);
  std::promise<void> gathered;
  std::shared_future<void> done = gathered.get_future().share();
  double sum = 1.0;
  // The reduction stream's work cannot finish before the gathers have:
  // over one stream this would wait until the bounded wait throws.
  comm::CommHandle busy = reduce.submit([done, &sum](comm::Communicator& c) {
    if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
      throw std::runtime_error("the parameter gather queued behind the reduction stream");
    c.all_reduce_f64(&sum, 1);
  });
  Blocks f(DType::kBF16);
  StateMemory memory;
  ZeroConfig o;
  o.allgather_bucket_size = 1;
  ParamCoordinator pc(StagePlan::make(2, g_world->size()), f.blocks, DType::kBF16, &gather, memory, o);
  pc.gather_after_step();
  gathered.set_value();
  busy.wait();
  f.expect_gathered("beside a busy reduction stream");
  EXPECT_EQ(sum, static_cast<double>(g_world->size()));
}

}  // namespace
}  // namespace zinc
