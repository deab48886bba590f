// The end of every multi-rank GoogleTest main(): rank 0 keeps gtest's full
// report, the other ranks print only their failures (tagged with the rank),
// and every rank exits with the same code (a failure on any rank fails all),
// so mpirun and CTest see one verdict.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>

#include "comm/comm.h"

namespace zinc::comm::testing {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.summary());
  }

 private:
  int rank_;
};

// Call after ::testing::InitGoogleTest; `world` spans every rank.
inline int run_all_tests_on_every_rank(Communicator& world) {
  if (world.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world.rank()));
  }
  double failed = RUN_ALL_TESTS() != 0 ? 1.0 : 0.0;
  world.all_reduce_max_f64(&failed, 1);
  return failed > 0 ? 1 : 0;
}

}  // namespace zinc::comm::testing
