// The engine across ranks (run under mpirun -np 2 and -np 4 by CTest).
// Every rank computes the single-rank reference itself (same seed, the whole
// global batch, no communication) and checks its own result against it, so a
// rank that diverges fails on its own.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "tests/comm/mpi_test_main.h"
#include "engine/engine.h"
#include "models/models.h"
#include "tests/engine/tiny_models.h"
#include "tests/engine/train_util.h"

namespace zinc {

// The world every test of this binary runs on (also grad_reducer_test.cpp).
std::shared_ptr<comm::Communicator> g_world;

namespace {

using testing_train::make_model;
using testing_train::RunSpec;
using testing_train::train;

class ZeroStages : public ::testing::TestWithParam<std::string> {};

TEST_P(ZeroStages, EveryStageMatchesTheSingleRankRunAndEachOtherBitForBit) {
  const std::string kind = GetParam();
  RunSpec base;
  base.model = kind;
  std::vector<double> ref_losses;
  const std::vector<float> ref = train(base, nullptr, &ref_losses);
  std::vector<float> first;
  for (int stage : {0, 1, 2})
    for (bool overlap : {false, true}) {
      RunSpec r = base;
      r.stage = stage;
      r.overlap = overlap;
      r.bucket = 3000;  // several buckets per step
      std::vector<double> losses;
      std::vector<float> w = train(r, g_world, &losses);
      // Different summation order across ranks than the single-rank run;
      // fp32 rounding through 20 Adam steps stays far below 1e-4 relative.
      EXPECT_CLOSE_WEIGHTS(w, ref, kind << " stage " << stage << " overlap " << overlap);
      for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5) << "step " << i;
      if (first.empty())
        first = w;
      else
        EXPECT_EQ(w, first) << kind << " stage " << stage << " overlap " << overlap
                            << " differs bitwise from stage 0 without overlap";
    }
}

INSTANTIATE_TEST_SUITE_P(Models, ZeroStages, ::testing::Values("gpt", "mlp"));

TEST(GradientCheckpointing, LossesNormsAndWeightsAreBitIdenticalAcrossRanks) {
  testing_train::expect_gradient_checkpointing_bit_identical(g_world);
}

TEST(ZeroAccumulation, NoSyncAccumulationEqualsTheSameGlobalBatchWithout) {
  for (int stage : {0, 2}) {
    RunSpec a, b;
    a.stage = b.stage = stage;
    a.overlap = b.overlap = true;
    a.global_batch = b.global_batch = 8;
    a.gas = 2;  // micro-batch 8 / 2 / world
    b.gas = 1;
    a.steps = b.steps = 10;
    const std::vector<float> wa = train(a, g_world), wb = train(b, g_world);
    EXPECT_CLOSE_WEIGHTS(wa, wb, "stage " << stage);
  }
}

TEST(ZeroOffload, WeightsAreBitIdenticalWithOffloadNoneCpuAndNvme) {
  for (int stage : {1, 2}) {
    RunSpec r;
    r.stage = stage;
    r.overlap = true;
    r.bf16 = true;
    const std::vector<float> none = train(r, g_world);
    for (const char* device : {"cpu", "nvme"}) {
      r.offload = device;
      EXPECT_EQ(train(r, g_world), none) << device << " stage " << stage;
    }
  }
}

TEST(ZeroPrecision, Bf16ComputeAndBf16WireTrainLikeFp32) {
  RunSpec fp32;
  fp32.stage = 2;
  fp32.steps = 10;
  RunSpec mixed = fp32;
  mixed.bf16 = true;
  mixed.wire = "bf16";
  std::vector<double> l32, l16;
  train(fp32, g_world, &l32);
  train(mixed, g_world, &l16);
  EXPECT_NEAR(l16.back(), l32.back(), 0.05);
  EXPECT_LT(l16.back(), l16.front());
}

TEST(ZeroMemory, Stage2HoldsLessModelStateThanStage1ThanStage0) {
  std::vector<int64_t> peak;
  for (int stage : {0, 1, 2}) {
    nlohmann::json cfg = {{"train_batch_size", 8},
                          {"zero_optimization", {{"stage", stage}, {"reduce_bucket_size", 3000}}},
                          {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}};
    auto model = make_model("gpt");
    Engine e = Engine::initialize(model, cfg, g_world);
    DataConfig dc;
    dc.vocab_size = 13;
    dc.seq_len = 9;
    DataLoader loader(std::shared_ptr<const DataSource>(make_data_source(dc)), 8 / g_world->size(), 1,
                      g_world->size(), g_world->rank(), 1);
    e.train_batch(loader);
    peak.push_back(e.model_state_peak_bytes());
  }
  EXPECT_GT(peak[0], peak[1]);
  EXPECT_GT(peak[1], peak[2]);
}

}  // namespace
}  // namespace zinc

// --backend=mpi|shm|hierarchical (default mpi): the communicator every test
// runs on (make_communicator; ZINC_COMM_BACKEND would override it).
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string backend = "mpi";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--backend=", 0) == 0) backend = a.substr(10);
  }
  zinc::g_world = zinc::comm::make_communicator(backend);
  if (zinc::g_world->backend() != backend) {
    std::fprintf(stderr, "engine_multirank_test: asked for backend %s, got %s\n", backend.c_str(),
                 zinc::g_world->backend().c_str());
    return 1;
  }
  const int rc = zinc::comm::testing::run_all_tests_on_every_rank(*zinc::g_world);
  zinc::g_world.reset();  // the last communicator: finalises MPI
  return rc;
}
