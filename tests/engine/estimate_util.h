// Shared by engine_test (one rank) and engine_multirank_test: the memory
// estimate's model state (zinc::estimate_memory) against what the engine's
// StateMemory counted at its peak after a training run.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "engine/memory_estimate.h"
#include "tests/engine/train_util.h"

namespace zinc::testing_train {

struct EstimateCheck {
  int64_t estimated = 0;  // MemoryEstimate::model_state_bytes()
  int64_t measured = 0;   // Engine::model_state_peak_bytes()
};

// Trains `r` (its sequences are 9 tokens, train_util.h) and returns both.
inline EstimateCheck estimate_vs_engine(RunSpec r, std::shared_ptr<comm::Communicator> comm) {
  EstimateCheck out;
  r.steps = 3;  // the ZeRO-3 trace is followed (and blocks kept) from the second step
  r.inspect = [&out](Engine& e) {
    out.estimated = estimate_memory(e.model(), e.config(), 9).model_state_bytes();
    out.measured = e.model_state_peak_bytes();
  };
  train(r, comm);
  return out;
}

// Every deterministic config: the estimate is the engine's peak exactly.
inline void expect_estimate_exact(const RunSpec& r, std::shared_ptr<comm::Communicator> comm,
                                  const std::string& what) {
  const EstimateCheck c = estimate_vs_engine(r, comm);
  EXPECT_GT(c.measured, 0) << what;
  EXPECT_EQ(c.estimated, c.measured) << what;
}

}  // namespace zinc::testing_train
