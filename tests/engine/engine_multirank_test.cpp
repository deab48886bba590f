// The engine across ranks (run under mpirun -np 2 and -np 4 by CTest).
// Every rank computes the single-rank reference itself (same seed, the whole
// global batch, no communication) and checks its own result against it, so a
// rank that diverges fails on its own.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdlib>
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

// Lamb's trust ratios need whole-tensor norms: at stages 1-3 every rank holds
// a shard that cuts through tensors, and the partial sums are added over the
// ranks. Each stage must train like the single-rank run (and stage 0, whose
// ranks each hold whole tensors, must not add them up again).
TEST(ZeroLamb, EveryStageMatchesTheSingleRankRun) {
  RunSpec base;
  // Wider than tiny_gpt so that a layer's flat block (about 7,000 elements)
  // is cut between the ranks' 4 KiB-aligned shards inside its tensors.
  base.make = [] { return testing_models::small_gpt(24); };
  base.steps = 12;
  base.optimizer = {{"type", "Lamb"}, {"params", {{"lr", 5e-3}, {"weight_decay", 0.01}, {"max_coeff", 2.0}}}};
  base.scheduler = {{"type", "OneCycle"},
                    {"params",
                     {{"cycle_min_lr", 1e-3}, {"cycle_max_lr", 5e-3}, {"cycle_first_step_size", 4},
                      {"cycle_min_mom", 0.85}, {"cycle_max_mom", 0.95}}}};
  std::vector<double> ref_losses;
  const std::vector<float> ref = train(base, nullptr, &ref_losses);
  for (int stage : {0, 1, 2, 3})
    for (const char* offload : {"none", "nvme"}) {
      if (stage == 0 && std::string(offload) == "nvme") continue;
      RunSpec r = base;
      r.stage = stage;
      r.overlap = true;
      r.bucket = 3000;
      r.offload = offload;
      std::vector<double> losses;
      const std::vector<float> w = train(r, g_world, &losses);
      EXPECT_CLOSE_WEIGHTS(w, ref, "Lamb stage " << stage << " offload " << offload);
      for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], ref_losses[i], 1e-5) << "step " << i;
    }
}

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

// The synthetic samples with most targets masked, unevenly: sample i keeps
// only its first 1 + (i * 5) % T targets, so micro-batches and ranks hold
// very different counts.
class UnevenlyMaskedSource final : public DataSource {
 public:
  UnevenlyMaskedSource() {
    DataConfig dc;
    dc.vocab_size = testing_models::kVocab;
    dc.seq_len = testing_models::kSeq;
    inner_ = make_data_source(dc);
  }
  std::string describe() const override { return "masked " + inner_->describe(); }
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  int64_t seq_len() const override { return inner_->seq_len(); }
  int64_t num_samples() const override { return inner_->num_samples(); }
  void sample(int64_t index, int32_t* inputs, int32_t* targets) const override {
    inner_->sample(index, inputs, targets);
    const int64_t T = seq_len(), keep = 1 + (index * 5) % T;
    for (int64_t t = keep; t < T; ++t) targets[t] = kIgnoreTarget;
  }

 private:
  std::unique_ptr<DataSource> inner_;
};

// The loss is the mean over the global batch's unmasked targets, wherever
// they are: 2 (or 4) ranks with 2 micro-batches each give the single-rank
// run of the same global batch in one micro-batch. A mean of per-micro-batch
// means would weigh a target of a nearly empty micro-batch up to 9x more.
TEST(LossNormaliser, RanksAndAccumulationEqualOneMicroBatchOfTheSameGlobalBatch) {
  for (const std::string kind : {"gpt", "mlp"})
    for (int stage : {0, 2, 3}) {
      RunSpec ref, r;
      ref.model = r.model = kind;
      ref.source = r.source = [] { return std::make_shared<UnevenlyMaskedSource>(); };
      ref.global_batch = r.global_batch = 8;
      ref.gas = 1;
      r.gas = 2;
      r.stage = stage;
      r.overlap = true;
      ref.steps = r.steps = 10;
      std::vector<double> lr, lm;
      const std::vector<float> w_ref = train(ref, nullptr, &lr), w = train(r, g_world, &lm);
      EXPECT_CLOSE_WEIGHTS(w, w_ref, kind << " stage " << stage);
      ASSERT_EQ(lm.size(), lr.size());
      for (size_t i = 0; i < lm.size(); ++i) EXPECT_NEAR(lm[i], lr[i], 1e-5) << kind << " stage " << stage << " step " << i;
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

// reduce_bucket_size 0 is a bucket per block and sub_group_size 0 the
// smallest sub-group (docs/train.md; transformers' ZeRO-3 test config and
// Axolotl's use them): the weights of the defaults, bit for bit (each
// element is summed over the same ranks in the same order, whatever the
// grouping). Both once stopped the run on an internal check.
TEST(ZeroBuckets, ZeroBucketAndSubGroupSizesAreTheSmallest) {
  for (int stage : {1, 2, 3}) {
    RunSpec r;
    r.stage = stage;
    r.overlap = true;
    r.steps = 4;
    const std::vector<float> plain = train(r, g_world);
    r.bucket = 0;
    r.zero_extra["allgather_bucket_size"] = 500000000;  // RunSpec sets both to bucket; this one takes >= 1
    EXPECT_EQ(train(r, g_world), plain) << "reduce_bucket_size 0, stage " << stage;
    r.offload = "nvme";
    r.zero_extra["sub_group_size"] = 0;
    EXPECT_EQ(train(r, g_world), plain) << "sub_group_size 0 on NVMe, stage " << stage;
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

// fp16 compute with fp16 gradients on the wire and dynamic loss scaling at
// every stage: each stage reduce-scatters the same fp16 buckets, so all four
// agree bit for bit; a first scale of 2^30 overflows, and every rank skips
// the same steps (the overflow is decided on the all-reduced norm, so no rank
// steps while another skips) and ends at the same scale. (That fp16 trains
// like fp32 is engine_test's EngineTraining.Fp16TracksFp32Loss.)
TEST(ZeroPrecision, Fp16WithLossScalingAgreesAcrossStagesAndRanks) {
  std::vector<float> first;
  for (int stage : {0, 1, 2, 3}) {
    RunSpec r;
    r.steps = 60;
    r.stage = stage;
    r.overlap = true;
    r.bucket = 3000;
    r.top_extra = {{"fp16", {{"enabled", true}, {"initial_scale_power", 30}, {"hysteresis", 1}}}};
    int64_t skipped = -1;
    double scale = 0;
    r.inspect = [&](Engine& e) {
      skipped = e.skipped_steps();
      scale = e.loss_scale();
      EXPECT_EQ(e.compute_dtype(), DType::kF16);
    };
    std::vector<double> l16;
    const std::vector<float> w = train(r, g_world, &l16);
    EXPECT_GT(skipped, 5) << "stage " << stage;
    // Every rank saw the same skips and holds the same scale.
    double mine[2] = {static_cast<double>(skipped), scale}, mx[2] = {mine[0], mine[1]};
    g_world->all_reduce_max_f64(mx, 2);
    EXPECT_EQ(mx[0], mine[0]) << "stage " << stage;
    EXPECT_EQ(mx[1], mine[1]) << "stage " << stage;
    for (float x : w) ASSERT_TRUE(std::isfinite(x));
    if (first.empty())
      first = w;
    else
      EXPECT_EQ(w, first) << "stage " << stage << " differs bitwise from stage 0";
    EXPECT_LT(skipped, r.steps - 20) << "stage " << stage;  // then it updated
    for (double l : l16) ASSERT_TRUE(std::isfinite(l));
  }
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
  return zinc::comm::testing::main_over_backend(argc, argv, zinc::g_world);
}
