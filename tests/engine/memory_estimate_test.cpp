// The memory estimate across ranks (part of engine_multirank_test): for
// every stage, with and without optimizer and parameter offload, in fp32 and
// bf16, the model state zinc-train --estimate predicts is exactly the peak
// the engine's StateMemory counts while training; where the peak depends on
// timing (small stage 2 buckets, ZeRO-3 with a short reuse distance) the
// estimate is a bound the run stays within. (The whole-process figure, peak
// RSS, is checked by zinc-bench estimate.)
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "comm/comm.h"
#include "tests/engine/estimate_util.h"

namespace zinc {

extern std::shared_ptr<comm::Communicator> g_world;

namespace {

using testing_train::RunSpec;

TEST(MemoryEstimate, ModelStateEqualsTheEnginesPeakAtEveryStageAndOffload) {
  for (const std::string model : {"gpt", "mlp"})
    testing_train::for_each_stage_and_offload([&](bool bf16, int stage, const std::string& offload,
                                                  const std::string& what) {
      RunSpec r;
      r.model = model;
      r.bf16 = bf16;
      r.stage = stage;
      r.offload = offload;
      testing_train::expect_estimate_exact(r, g_world, model + " " + what);
    });
}

TEST(MemoryEstimate, Stage3ParameterOffloadAccumulationAndBf16Wire) {
  for (const std::string param : {"cpu", "nvme"})
    for (const std::string opt : {"none", "nvme"}) {
      RunSpec r;
      r.bf16 = true;
      r.stage = 3;
      r.offload = opt;
      r.zero_extra = {{"offload_param", {{"device", param}, {"nvme_path", ::testing::TempDir()}}},
                      {"stage3_param_persistence_threshold", 100}};
      testing_train::expect_estimate_exact(r, g_world, "offload_param " + param + ", offload_optimizer " + opt);
    }
  RunSpec gas;
  gas.stage = 2;
  gas.gas = 2;
  gas.wire = "bf16";
  testing_train::expect_estimate_exact(gas, g_world, "stage 2, accumulation 2, bf16 wire");
}

TEST(MemoryEstimate, TimingDependentPeaksStayWithinTheEstimate) {
  RunSpec buckets;
  buckets.stage = 2;
  buckets.overlap = true;
  buckets.bucket = 2048;
  const auto b = testing_train::estimate_vs_engine(buckets, g_world);
  EXPECT_LE(b.measured, b.estimated) << "stage 2 with 2048-element buckets";
  RunSpec s3;
  s3.stage = 3;
  s3.zero_extra = {{"stage3_max_reuse_distance", 0}, {"stage3_prefetch_bucket_size", 1},
                   {"stage3_param_persistence_threshold", 100}};
  const auto z = testing_train::estimate_vs_engine(s3, g_world);
  EXPECT_LE(z.measured, z.estimated) << "stage 3 with no reuse and no prefetch";
}

}  // namespace
}  // namespace zinc
