// Hugging Face checkpoints across ranks (mpirun -np 2 by CTest): every rank
// loads the fixture through the engine (at ZeRO-3 each reads only its own
// shard, with the shards on NVMe), runs its part of transformers' reference
// batch, and the weights, the mean loss and the gradient norm must be
// transformers' at every stage.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "engine/engine.h"
#include "tests/comm/mpi_test_main.h"
#include "tests/tools/hf_test_util.h"
#include "tools/hf_model.h"
#include "tools/peft_adapter.h"

namespace zinc::tools {

std::shared_ptr<comm::Communicator> g_world;

namespace {

namespace fs = std::filesystem;

class HfRanks : public testing::TestWithParam<std::string> {};

TEST_P(HfRanks, EveryStageLoadsTheFileAndComputesTransformersLossAndGradientNorm) {
  const int world = g_world->size(), rank = g_world->rank();
  const std::string dir = fixture(GetParam());
  HfConfig cfg = read_hf_config(dir);
  Reference ref(dir);
  ASSERT_EQ(ref.B % world, 0) << "the reference batch must split over the ranks";
  const int64_t rows = ref.B / world;
  const Batch mine = rank_rows(ref, rank, world);
  const double sq = reference_grad_squares(ref);
  // One NVMe folder for all ranks (each keeps its own files in it).
  const fs::path nvme = fs::temp_directory_path() / ("zinc_hf_mr_" + std::to_string(::getppid()));
  const bool moe = ref.file.find("aux_loss") != nullptr;
  double stage0_loss = 0, stage0_norm = 0;
  for (int stage : {0, 1, 2, 3}) {
    auto model = load_pretrained(cfg);
    HostContext want(*model);
    nlohmann::json ds = {{"train_batch_size", ref.B},
                         {"train_micro_batch_size_per_gpu", rows},
                         {"gradient_clipping", 0.0},
                         {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                         {"zero_optimization", {{"stage", stage}}}};
    if (stage == 3) {
      fs::create_directories(nvme);
      ds["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", nvme.string()}};
    }
    Engine engine = Engine::initialize(model, ds, g_world);
    for (size_t b = 0; b < want.params.size(); ++b) {
      std::vector<float> got = engine.full_params(static_cast<int>(b));
      got.resize(want.params[b].size());
      EXPECT_EQ(std::memcmp(got.data(), want.params[b].data(), got.size() * 4), 0)
          << GetParam() << " stage " << stage << " block " << b << " rank " << rank;
    }
    double loss = engine.forward(mine);
    g_world->all_reduce_f64(&loss, 1);
    loss /= world;
    engine.backward();
    engine.step();
    if (!moe) {
      EXPECT_NEAR(loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << GetParam() << " stage " << stage;
      EXPECT_NEAR(engine.global_grad_norm(), std::sqrt(sq), 1e-4 * std::sqrt(sq)) << GetParam() << " stage " << stage;
      continue;
    }
    // A mixture of experts' load-balancing loss is each rank's, over its own
    // tokens (as transformers computes it under DeepSpeed's data
    // parallelism), so 2 ranks are not the 1-process reference: every
    // stage must give stage 0's loss and gradient norm.
    if (stage == 0) {
      stage0_loss = loss;
      stage0_norm = engine.global_grad_norm();
      EXPECT_NEAR(loss, ref.loss, 0.05 * std::fabs(ref.loss)) << GetParam() << ": the same model";
    } else {
      EXPECT_NEAR(loss, stage0_loss, 1e-6 * std::fabs(stage0_loss)) << GetParam() << " stage " << stage;
      EXPECT_NEAR(engine.global_grad_norm(), stage0_norm, 1e-5 * stage0_norm) << GetParam() << " stage " << stage;
    }
  }
  g_world->barrier();
  if (rank == 0) fs::remove_all(nvme);
}

// Every family zinc loads (tests/fixtures/hf/loaded.txt).
INSTANTIATE_TEST_SUITE_P(Fixtures, HfRanks, testing::ValuesIn(kFixtures),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

// LoRA (the lora_* fixtures, PEFT's references) across ranks: at every
// stage (3 with the frozen base's shards on NVMe) the loss and the adapter
// gradients' norm are PEFT's, the base never changes, and two more steps
// train the adapters to the same bits at every stage.
class HfRanksLora : public testing::TestWithParam<std::string> {};

TEST_P(HfRanksLora, EveryStageTrainsTheAdaptersWithTheBaseFrozen) {
  const int world = g_world->size(), rank = g_world->rank();
  const std::string dir = fixture(GetParam());
  const models::LoraConfig lora = read_peft_adapter_config(dir);
  std::ifstream acfg(dir + "/adapter_config.json");
  const HfConfig cfg = read_hf_config(fixture(nlohmann::json::parse(acfg).at("base_model_name_or_path")));
  Reference ref(dir);
  const int64_t rows = ref.B / world;
  const Batch mine = rank_rows(ref, rank, world);
  const double sq = reference_grad_squares(ref);
  const fs::path nvme = fs::temp_directory_path() / ("zinc_lora_mr_" + std::to_string(::getppid()));
  std::vector<std::vector<float>> first;
  for (int stage : {0, 1, 2, 3}) {
    auto model = load_pretrained(cfg, Device::kCpu, false, lora, dir);
    HostContext want(*model);
    nlohmann::json ds = {{"train_batch_size", ref.B},
                         {"train_micro_batch_size_per_gpu", rows},
                         {"gradient_clipping", 0.0},
                         {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-2}}}}},
                         {"zero_optimization", {{"stage", stage}}}};
    if (stage == 3) {
      fs::create_directories(nvme);
      ds["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", nvme.string()}};
    }
    Engine engine = Engine::initialize(model, ds, g_world);
    double loss = engine.forward(mine);
    g_world->all_reduce_f64(&loss, 1);
    loss /= world;
    engine.backward();
    engine.step();
    EXPECT_NEAR(loss, ref.loss, 1e-5 * std::fabs(ref.loss)) << GetParam() << " stage " << stage;
    EXPECT_NEAR(engine.global_grad_norm(), std::sqrt(sq), 1e-4 * std::sqrt(sq)) << GetParam() << " stage " << stage;
    for (int s = 0; s < 2; ++s) {
      engine.forward(mine);
      engine.backward();
      engine.step();
    }
    std::vector<std::vector<float>> now;
    for (size_t b = 0; b < want.params.size(); ++b) {
      std::vector<float> got = engine.full_params(static_cast<int>(b));
      got.resize(want.params[b].size());
      if (model->blocks()[b].frozen) {
        EXPECT_EQ(std::memcmp(got.data(), want.params[b].data(), got.size() * 4), 0)
            << GetParam() << " stage " << stage << ": frozen block " << b << " changed on rank " << rank;
      }
      now.push_back(std::move(got));
    }
    if (first.empty())
      first = now;
    else
      EXPECT_TRUE(now == first) << GetParam() << " stage " << stage << ": the weights differ from stage 0's";
  }
  g_world->barrier();
  if (rank == 0) fs::remove_all(nvme);
}

INSTANTIATE_TEST_SUITE_P(Lora, HfRanksLora, testing::Values("lora_llama", "lora_qwen2", "lora_gpt2"),
                         [](const testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace zinc::tools

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  zinc::tools::g_world = zinc::comm::make_communicator("mpi");
  const int rc = zinc::comm::testing::run_all_tests_on_every_rank(*zinc::tools::g_world);
  zinc::tools::g_world.reset();
  return rc;
}
