// zinc-bench collectives: the engine's reduce-scatter and all-gather (a
// Communicator driven through a CommStream: submit, then wait, as the ZeRO
// stages use them) against the raw MPI call of the same size on the same
// ranks, measured alternately in the same run.
//
//   mpirun -np 2 zinc-bench collectives [--json] [--rounds N]
//
// Sizes are those of the full fp32 buffer (1, 16, 128 MiB): reduce-scatter
// reads the full buffer and leaves each rank its 1/world_size block;
// all-gather fills the full buffer in place from each rank's block.
// Bandwidth = full buffer bytes / time (not bus bandwidth). One sample =
// barrier, the collective repeated `reps` times, the slowest rank's mean time;
// the figure is the median over rounds, the variants alternating (and
// rotating which goes first every round).
//
// The bound is the raw MPI call made from a plain worker thread, because the
// engine's collectives run on the CommStream's thread and the thread matters:
// Open MPI allocates a scratch buffer per MPI_Reduce_scatter_block call, and
// on the main thread glibc's main arena hands it back to the kernel after
// every call (trim / mmap thresholds), so each call page-faults it in again.
// The same raw call from the main thread is reported too ("raw_main"), since
// that is what a naive comparison would measure.
#include "bench/benches.h"

#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "core/alloc.h"

namespace zinc::bench {
namespace {

// Mean seconds per call over `reps` calls, the slowest rank's. With
// on_worker the calls run on a fresh plain thread (its start is in the time;
// it is tens of microseconds against >= 10 ms per sample).
template <class Fn>
double sample(int reps, bool on_worker, Fn&& fn) {
  auto calls = [&] {
    for (int i = 0; i < reps; ++i) fn();
  };
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = now_s();
  if (on_worker) {
    std::thread t(calls);
    t.join();
  } else {
    calls();
  }
  double dt = (now_s() - t0) / reps;
  MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return dt;
}

void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) throw CommError(std::string("zinc-bench collectives: ") + what + " failed");
}

// Inputs whose results are known exactly: rank r's reduce-scatter input is
// all r + 1, so each block of the sum is world * (world + 1) / 2; rank r's
// all-gather block is all r + 1.
void fill_inputs(float* rs_full, float* ag_full, int64_t full, int64_t shard, int rank) {
  for (int64_t i = 0; i < full; ++i) rs_full[i] = static_cast<float>(rank + 1);
  for (int64_t i = 0; i < full; ++i) ag_full[i] = -1.0f;
  for (int64_t i = 0; i < shard; ++i) ag_full[rank * shard + i] = static_cast<float>(rank + 1);
}

bool check_outputs(const float* shard_out, const float* ag_full, int64_t shard, int world) {
  const float sum = static_cast<float>(world * (world + 1) / 2);
  for (int64_t i = 0; i < shard; ++i)
    if (shard_out[i] != sum) return false;
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < shard; ++i)
      if (ag_full[r * shard + i] != static_cast<float>(r + 1)) return false;
  return true;
}

}  // namespace

int bench_collectives(const BenchOptions& o) {
  std::unique_ptr<comm::Communicator> world = comm::make_mpi_communicator();  // initialises MPI
  const int rank = world->rank(), size = world->size();
  if (rank == 0 && !o.json) {
    std::printf("collectives: np %d; GB/s = full fp32 buffer bytes / time (1e9 B/s); engine = Communicator via "
                "CommStream submit + wait; raw MPI = the same MPI call on MPI_COMM_WORLD from a worker thread; "
                "median of %d rounds\n",
                size, o.rounds);
  }
  int failures = 0;
  {
    comm::CommStream stream(*world);
    for (const int64_t mib : {1, 16, 128}) {
      const int64_t shard = (mib << 20) / 4 / size;  // elements per rank
      const int64_t full = shard * size;            // elements of the full buffer
      const double bytes = static_cast<double>(full) * 4;
      AlignedBuffer rs_full = make_buffer<float>(full), rs_out = make_buffer<float>(shard);
      AlignedBuffer ag_full = make_buffer<float>(full);
      float* rs_in = rs_full.as<float>();
      float* rs_shard = rs_out.as<float>();
      float* ag = ag_full.as<float>();
      float* ag_own = ag + rank * shard;
      const int n = static_cast<int>(shard);

      auto rs_engine = [&] {
        stream.submit([&](comm::Communicator& c) { c.reduce_scatter(rs_in, rs_shard, shard, DType::kF32); }).wait();
      };
      auto rs_raw = [&] {
        check_mpi(MPI_Reduce_scatter_block(rs_in, rs_shard, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                  "MPI_Reduce_scatter_block");
      };
      auto ag_engine = [&] {
        stream.submit([&](comm::Communicator& c) { c.all_gather(ag_own, ag, shard, DType::kF32); }).wait();
      };
      auto ag_raw = [&] {
        check_mpi(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, ag, n, MPI_FLOAT, MPI_COMM_WORLD),
                  "MPI_Allgather");
      };

      // Validate both sides once before timing them (this also warms up).
      bool ok = true;
      fill_inputs(rs_in, ag, full, shard, rank);
      rs_engine();
      ag_engine();
      ok = ok && check_outputs(rs_shard, ag, shard, size);
      fill_inputs(rs_in, ag, full, shard, rank);
      rs_raw();
      ag_raw();
      ok = ok && check_outputs(rs_shard, ag, shard, size);
      int bad = ok ? 0 : 1;
      MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      if (bad) {
        if (rank == 0) std::fprintf(stderr, "collectives: wrong results at %lld MiB\n", static_cast<long long>(mib));
        ++failures;
        continue;
      }

      // Small messages repeat within a sample so that one sample moves >= 64 MiB.
      const int reps = static_cast<int>(std::max<int64_t>(1, 64 / mib));
      // [op][variant]: op 0 reduce_scatter, 1 all_gather; variant 0 engine,
      // 1 raw MPI on a worker thread (the bound), 2 raw MPI on the main thread.
      std::vector<double> t[2][3];
      for (int round = 0; round < o.rounds; ++round) {
        for (int k = 0; k < 3; ++k) {
          const int v = (round + k) % 3;
          if (v == 0) {
            t[0][0].push_back(sample(reps, false, rs_engine));
            t[1][0].push_back(sample(reps, false, ag_engine));
          } else {
            t[0][v].push_back(sample(reps, v == 1, rs_raw));
            t[1][v].push_back(sample(reps, v == 1, ag_raw));
          }
        }
      }
      if (rank != 0) continue;
      for (int op = 0; op < 2; ++op) {
        const double gbps[3] = {bytes / median(t[op][0]) / 1e9, bytes / median(t[op][1]) / 1e9,
                                bytes / median(t[op][2]) / 1e9};
        const std::string name = std::string(op == 0 ? "reduce_scatter" : "all_gather") + "/" +
                                 std::to_string(mib) + "MiB";
        char human[256];
        std::snprintf(human, sizeof human,
                      "%-22s engine %6.2f GB/s  raw MPI %6.2f GB/s  ratio %.3f  (raw MPI on the main thread %6.2f GB/s)",
                      name.c_str(), gbps[0], gbps[1], gbps[0] / gbps[1], gbps[2]);
        emit(o.json,
             {{"bench", "collectives"},
              {"case", name},
              {"figure", gbps[0]},
              {"unit", "GB/s"},
              {"bound", gbps[1]},
              {"ratio", gbps[0] / gbps[1]},
              {"world_size", size},
              {"bytes", static_cast<int64_t>(bytes)},
              {"raw_main", gbps[2]}},
             human);
      }
    }
  }  // the stream joins before the communicator (and MPI) goes
  return failures == 0 ? 0 : 1;
}

}  // namespace zinc::bench
