// The 1-bit compressed all-reduce across ranks (mpirun -np 2 and 4): every
// rank's result equals the reference of onebit_reference.h (which simulates
// all ranks in one process) bit for bit, over successive steps so that the
// worker and server error feedback carry over, on odd sizes, zeros and
// large values, over the MPI and the shared-memory backends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "comm/onebit.h"
#include "core/cpu.h"
#include "comm_test_util.h"
#include "tests/comm/mpi_test_main.h"
#include "tests/comm/onebit_reference.h"

namespace zinc::comm::testing {
namespace {
std::unique_ptr<Communicator> g_mpi, g_shm;
}  // namespace

Communicator& world() { return *g_mpi; }

namespace {

// How the buffer goes in: average(buf), or written into input() and
// averaged with average_input into input() itself or into another buffer.
enum class Call { kAverage, kInputInPlace, kInputToOther };

void check_against_reference(Communicator& c, int kind, int64_t n, int steps, Call call = Call::kAverage) {
  const int p = c.size();
  CompressedAllReduce car(n, p);
  OnebitReference ref(n, p);
  for (int step = 0; step < steps; ++step) {
    std::vector<std::vector<float>> in(p, std::vector<float>(n));
    for (int r = 0; r < p; ++r)
      for (int64_t i = 0; i < n; ++i) in[r][i] = onebit_input(kind, step, r, i);
    const std::vector<float> want = ref.step(in);
    std::vector<float> buf = in[c.rank()];
    if (call == Call::kAverage) {
      car.average(c, buf.data(), n);
    } else {
      std::memcpy(car.input(), buf.data(), n * sizeof(float));
      std::fill(buf.begin(), buf.end(), -7.0f);
      float* out = call == Call::kInputInPlace ? car.input() : buf.data();
      car.average_input(c, out);
      if (out != buf.data()) std::memcpy(buf.data(), out, n * sizeof(float));
    }
    EXPECT_EQ(std::memcmp(buf.data(), want.data(), n * sizeof(float)), 0)
        << c.backend() << " kind " << kind << " n=" << n << " step " << step;
    EXPECT_EQ(car.worker_error(), ref.worker_error[c.rank()]) << "worker error, step " << step;
    EXPECT_EQ(car.server_error(), ref.server_error[c.rank()]) << "server error, step " << step;
  }
}

TEST(OnebitMulti, EqualsTheReferenceBitForBitOverStepsOnMpiAndShm) {
  for (Communicator* c : {g_mpi.get(), g_shm.get()}) {
    for (int kind : {0, 1, 2}) {
      for (int64_t n : {int64_t{1}, int64_t{13}, int64_t{1001}, int64_t{65537}}) {
        check_against_reference(*c, kind, n, 4);
      }
    }
  }
}

// The fused form (the caller writes input(); the average goes to input() or
// to another buffer), at every ISA level this CPU runs: the same bits.
TEST(OnebitMulti, InputFormEqualsTheReferenceAtEveryIsaLevel) {
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (isa > cpu_isa()) continue;
    detail::set_dispatch_isa_for_testing(isa);
    for (Communicator* c : {g_mpi.get(), g_shm.get()})
      for (Call call : {Call::kAverage, Call::kInputInPlace, Call::kInputToOther})
        for (int64_t n : {int64_t{13}, int64_t{1001}, int64_t{65537}}) check_against_reference(*c, 0, n, 3, call);
    detail::reset_dispatch_isa_for_testing();
  }
}

// The volume on the wire, and the average is close to the true mean (the
// compression is lossy; error feedback makes the sum over steps converge).
TEST(OnebitMulti, PrintsTheWireVolumeAndTracksTheMeanOverSteps) {
  Communicator& c = *g_mpi;
  const int p = c.size();
  const int64_t n = 4099;
  CompressedAllReduce car(n, p);
  std::vector<double> sum_got(n, 0.0), sum_true(n, 0.0);
  const int steps = 200;
  for (int step = 0; step < steps; ++step) {
    std::vector<float> buf(n);
    for (int64_t i = 0; i < n; ++i) {
      buf[i] = onebit_input(0, 7, c.rank(), i);  // the same gradient every step
      double mean = 0;
      for (int r = 0; r < p; ++r) mean += onebit_input(0, 7, r, i);
      sum_true[i] += mean / p;
    }
    car.average(c, buf.data(), n);
    for (int64_t i = 0; i < n; ++i) sum_got[i] += buf[i];
  }
  // Error feedback: the accumulated compression error stays bounded, so the
  // mean over steps approaches the true mean (within a few % of its rms).
  double err = 0, mag = 0;
  for (int64_t i = 0; i < n; ++i) {
    err += (sum_got[i] - sum_true[i]) * (sum_got[i] - sum_true[i]);
    mag += sum_true[i] * sum_true[i];
  }
  EXPECT_LT(std::sqrt(err / mag), 0.05) << "relative error of the summed averages over " << steps << " steps";
  if (c.rank() == 0) {
    CompressedAllReduce big(int64_t{1} << 20, p);
    std::printf("p=%d n=%d: 1-bit %lld bytes sent per rank per step vs fp32 ring all-reduce %.0f; "
                "summed-average relative error after %d steps %.4f\n",
                p, 1 << 20, static_cast<long long>(big.wire_bytes_per_rank()),
                2.0 * (p - 1) / p * 4.0 * double(int64_t{1} << 20), steps, std::sqrt(err / mag));
  }
}

}  // namespace
}  // namespace zinc::comm::testing

int main(int argc, char** argv) {
  namespace zt = zinc::comm::testing;
  ::testing::InitGoogleTest(&argc, argv);
  unsetenv("ZINC_COMM_BACKEND");
  zt::g_mpi = zinc::comm::make_mpi_communicator();
  zt::g_shm = zinc::comm::make_communicator("shm");
  const int rc = zt::run_all_tests_on_every_rank(*zt::g_mpi);
  zt::g_shm.reset();
  zt::g_mpi.reset();
  return rc;
}
