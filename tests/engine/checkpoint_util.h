// Shared by engine_test (one rank) and engine_multirank_test: training in
// segments through checkpoints (Engine::save_checkpoint / load_checkpoint),
// on the RunSpec runs of train_util.h.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/engine/train_util.h"

namespace zinc::testing_train {

struct Segment {
  std::vector<double> losses;
  std::vector<float> weights;
  int64_t global_steps = 0;
};

// A fresh engine for `r` (on `comm`, null: one rank): loads `load_dir` first
// if given (and the data loader's position kept with it), trains `steps`
// global batches, saves to `save_dir` if given (with the loader's position).
inline Segment train_segment(const RunSpec& r, std::shared_ptr<comm::Communicator> comm, int steps,
                             const std::string& load_dir = "", const std::string& save_dir = "") {
  const int world = comm ? comm->size() : 1;
  const int rank = comm ? comm->rank() : 0;
  auto model = r.make ? r.make() : make_model(r.model);
  Engine e = Engine::initialize(model, make_config(r), comm);
  DataConfig dc;
  dc.vocab_size = 13;
  dc.seq_len = 9;
  auto src = std::shared_ptr<const DataSource>(make_data_source(dc));
  DataLoader loader(src, r.global_batch / r.gas / world, r.gas, world, rank, 7);
  if (!load_dir.empty()) {
    const nlohmann::json client = e.load_checkpoint(load_dir);
    loader.set_position(client.at("samples").get<int64_t>());
  }
  Segment out;
  for (int s = 0; s < steps; ++s) out.losses.push_back(e.train_batch(loader));
  if (!save_dir.empty()) e.save_checkpoint(save_dir, "", {{"samples", loader.position()}});
  out.weights = all_weights(e);
  out.global_steps = e.global_steps();
  return out;
}

// A run of 2k steps against k steps, a save, and a new engine that loads
// and trains k more: the same losses and weights, bit for bit.
inline void expect_bit_exact_resume(const RunSpec& r, std::shared_ptr<comm::Communicator> comm,
                                    const std::string& dir, int k, const std::string& what) {
  const Segment straight = train_segment(r, comm, 2 * k);
  const Segment first = train_segment(r, comm, k, "", dir);
  const Segment second = train_segment(r, comm, k, dir);
  std::vector<double> resumed = first.losses;
  resumed.insert(resumed.end(), second.losses.begin(), second.losses.end());
  EXPECT_EQ(resumed, straight.losses) << what;
  EXPECT_EQ(second.weights, straight.weights) << what;
  EXPECT_EQ(second.global_steps, 2 * k) << what;
}

}  // namespace zinc::testing_train
