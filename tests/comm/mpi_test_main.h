// The end of every multi-rank GoogleTest main(): rank 0 keeps gtest's full
// report, the other ranks print only their failures (tagged with the rank),
// and every rank exits with the same code (a failure on any rank fails all),
// so mpirun and CTest see one verdict.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

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

// The whole main() of a multi-rank test binary whose world is the backend
// --backend=NAME names (default mpi): `world` holds it while the tests run
// on every rank, then goes (the last communicator finalises MPI).
inline int main_over_backend(int argc, char** argv, std::shared_ptr<Communicator>& world) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string backend = "mpi";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--backend=", 0) == 0) backend = a.substr(10);
  }
  world = make_communicator(backend);
  if (world->backend() != backend) {
    std::fprintf(stderr, "%s: asked for backend %s, got %s\n", argv[0], backend.c_str(), world->backend().c_str());
    return 1;
  }
  const int rc = run_all_tests_on_every_rank(*world);
  world.reset();
  return rc;
}

}  // namespace zinc::comm::testing
