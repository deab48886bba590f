// Checkpoints across ranks (part of engine_multirank_test, under mpirun -np
// 2 and 4 over MPI and shared memory): a run resumed from a checkpoint
// continues bit for bit at every stage and offload; a checkpoint loads at
// another stage and at another world size (one rank here) and continues
// within the ZeRO tolerance; a rank that cannot write fails the save on
// every rank and leaves the previous checkpoint as `latest`.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "comm/comm.h"
#include "core/error.h"
#include "tests/engine/checkpoint_util.h"
#include "tests/engine/tiny_models.h"

namespace zinc {

extern std::shared_ptr<comm::Communicator> g_world;

namespace {

using testing_train::RunSpec;

// A folder every rank agrees on, emptied first.
std::string shared_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "zinc-ckpt-mr-" + name + "-np" + std::to_string(g_world->size());
  g_world->barrier();
  if (g_world->rank() == 0) std::filesystem::remove_all(dir);
  g_world->barrier();
  return dir;
}

TEST(Checkpoint, ResumesBitExactAtEveryStageAndOffload) {
  testing_train::for_each_stage_and_offload([](bool bf16, int stage, const std::string& offload,
                                               const std::string& what) {
    RunSpec r;
    r.bf16 = bf16;
    r.stage = stage;
    r.offload = offload;
    if (stage == 3 && offload != "none")
      r.zero_extra = {{"offload_param", {{"device", offload}, {"nvme_path", ::testing::TempDir()}}},
                      {"stage3_max_reuse_distance", 0}};
    testing_train::expect_bit_exact_resume(r, g_world, shared_dir("resume"), 3, what);
  });
}

TEST(Checkpoint, AccumulationAndTheMlpResumeBitExact) {
  RunSpec r;
  r.model = "mlp";
  r.stage = 2;
  r.gas = 2;
  r.overlap = true;
  testing_train::expect_bit_exact_resume(r, g_world, shared_dir("gas"), 3, "mlp, stage 2, accumulation 2");
}

// Saved at stage 2, loaded at 3, saved again and loaded at 0: each run
// continues within the tolerance of summation order (the stages compute the
// same weights, so in fact exactly).
TEST(Checkpoint, LoadsAtAnotherStage) {
  RunSpec r;
  r.stage = 2;
  const testing_train::Segment straight = train_segment(r, g_world, 6);
  const std::string dir = shared_dir("stages");
  train_segment(r, g_world, 2, "", dir);
  RunSpec r3 = r;
  r3.stage = 3;
  train_segment(r3, g_world, 2, dir, dir);
  RunSpec r0 = r;
  r0.stage = 0;
  const testing_train::Segment last = train_segment(r0, g_world, 2, dir);
  EXPECT_CLOSE_WEIGHTS(last.weights, straight.weights, "stage 2 -> 3 -> 0");
  EXPECT_EQ(last.global_steps, 6);
}

// Saved by all ranks, loaded by one process alone (rank 0, a one-rank
// engine), and the other way round.
TEST(Checkpoint, LoadsAtAnotherWorldSize) {
  RunSpec r;
  r.stage = 1;
  const testing_train::Segment straight = train_segment(r, g_world, 4);
  const std::string dir = shared_dir("world");
  train_segment(r, g_world, 2, "", dir);
  if (g_world->rank() == 0) {
    const testing_train::Segment one = train_segment(r, nullptr, 2, dir);
    EXPECT_CLOSE_WEIGHTS(one.weights, straight.weights, "saved at " << g_world->size() << " ranks, loaded at 1");
  }
  g_world->barrier();
  const std::string dir1 = shared_dir("world1");
  if (g_world->rank() == 0) train_segment(r, nullptr, 2, "", dir1);
  g_world->barrier();
  const testing_train::Segment many = train_segment(r, g_world, 2, dir1);
  EXPECT_CLOSE_WEIGHTS(many.weights, straight.weights, "saved at 1 rank, loaded at " << g_world->size());
}

// The last rank cannot write (it is given a folder that does not exist, as
// a rank on a node without the shared filesystem would be): every rank's
// save fails, no partial tag is left, and `latest` still names the earlier
// checkpoint, which loads.
TEST(Checkpoint, ARankThatCannotWriteFailsTheSaveEverywhere) {
  RunSpec r;
  r.stage = 2;
  const std::string dir = shared_dir("fail");
  train_segment(r, g_world, 1, "", dir);  // global_step1
  auto model = testing_train::make_model(r.model);
  Engine e = Engine::initialize(model, testing_train::make_config(r), g_world);
  const bool last = g_world->rank() == g_world->size() - 1;
  std::string what;
  try {
    e.save_checkpoint(last ? dir + "/no/such/place" : dir, "bad");
  } catch (const IoError& ex) {
    what = ex.what();
  }
  if (last) EXPECT_NE(what.find("no/such/place"), std::string::npos) << what;
  else EXPECT_NE(what.find("rank " + std::to_string(g_world->size() - 1) + " failed"), std::string::npos) << what;
  g_world->barrier();
  EXPECT_FALSE(std::filesystem::exists(dir + "/bad"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/.bad.partial"));
  std::ifstream latest(dir + "/latest");
  std::string tag;
  std::getline(latest, tag);
  EXPECT_EQ(tag, "global_step1");
  const testing_train::Segment again = train_segment(r, g_world, 1, dir);
  EXPECT_EQ(again.global_steps, 2);
}


// Ranks that pass different tags: with tag_validation Warn (the default) all
// save under rank 0's tag, which loads; with Fail every rank throws, naming
// both tags, and nothing is saved.
TEST(Checkpoint, RanksWithDifferentTagsSaveUnderRankZerosOrFail) {
  RunSpec r;
  r.stage = 1;
  const std::string dir = shared_dir("tags");
  auto model = testing_train::make_model(r.model);
  const std::string mine = g_world->rank() == 0 ? "agreed" : "rank" + std::to_string(g_world->rank());
  {
    Engine e = Engine::initialize(model, testing_train::make_config(r), g_world);
    e.save_checkpoint(dir, mine);
  }
  g_world->barrier();
  EXPECT_TRUE(std::filesystem::exists(dir + "/agreed/metadata.json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/rank1"));
  {
    Engine e = Engine::initialize(model, testing_train::make_config(r), g_world);
    e.load_checkpoint(dir);
  }
  nlohmann::json cfg = testing_train::make_config(r);
  cfg["checkpoint"] = {{"tag_validation", "Fail"}};
  Engine e = Engine::initialize(model, cfg, g_world);
  std::string what;
  try {
    e.save_checkpoint(dir, mine == "agreed" ? "second" : mine);
  } catch (const Error& ex) {
    what = ex.what();
  }
  EXPECT_NE(what.find("tag_validation is Fail"), std::string::npos) << what;
  if (g_world->rank() == 1) {
    EXPECT_NE(what.find("\"rank1\" but rank 0 passed \"second\""), std::string::npos) << what;
  }
  g_world->barrier();
  EXPECT_FALSE(std::filesystem::exists(dir + "/second"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/.second.partial"));
}

}  // namespace
}  // namespace zinc
