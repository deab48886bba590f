// zinc-bench collectives: reduce-scatter, all-gather and all-reduce of the
// shared-memory Communicator (make_communicator("shm"), driven through a
// CommStream: submit, then wait, as the ZeRO stages use them) against the
// bound the machine sets, a single-thread memcpy of the same full buffer on
// every rank at once, and against the raw MPI call of the same size on the
// same ranks, measured alternately in the same run. The MPI Communicator
// through a CommStream ("engine_mpi") and the raw MPI call from the main
// thread ("raw_main") are reported as extra fields.
//
//   mpirun -np 2 zinc-bench collectives [--json] [--rounds N]
//
// One line per case: figure = shm GB/s, bound = copy GB/s, ratio =
// figure / bound, mpi = raw MPI GB/s; traffic_bound = the copy rate scaled
// by the least memory traffic the collective needs against a copy's, and
// traffic_ratio = figure / traffic_bound. With one rank, or ranks on several
// machines, there is no shm backend and figure is 0.
//
// Sizes are those of the full fp32 buffer (1, 16, 128 MiB): reduce-scatter
// reads the full buffer and leaves each rank its 1/world_size block;
// all-gather fills the full buffer in place from each rank's block;
// all-reduce sums the full buffer out of place. Bandwidth = full buffer bytes
// / time (not bus bandwidth; a reduce-scatter rank moves less than the full
// buffer, so figure can exceed the copy bound). One sample = barrier, the
// call repeated `reps` times, the slowest rank's mean time; the figure is the
// median over rounds, the variants alternating (and rotating which goes
// first every round).
//
// The raw MPI call runs on a plain worker thread, because the engine's
// collectives run on the CommStream's thread and the thread matters: Open MPI
// allocates a scratch buffer per MPI_Reduce_scatter_block call, and on the
// main thread glibc's main arena hands it back to the kernel after every call
// (trim / mmap thresholds), so each call page-faults it in again.
#include "bench/benches.h"

#include <mpi.h>

#include <cmath>
#include <cstring>
#include <functional>
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
  // The shared-memory backend when every rank is on this machine.
  std::unique_ptr<comm::Communicator> shm;
  if (size > 1 && world->local_size() == size) shm = comm::make_communicator("shm");
  if (rank == 0 && !o.json) {
    std::printf("collectives: np %d; GB/s = full fp32 buffer bytes / time (1e9 B/s); shm = the shared-memory "
                "Communicator via its CommStream; copy = one memcpy of the full buffer per rank, all ranks at "
                "once (the bound); mpi = the raw MPI call on MPI_COMM_WORLD from a worker thread; engine = the MPI "
                "Communicator via CommStream; median of %d rounds\n",
                size, o.rounds);
  }
  int failures = 0;
  {
    comm::CommStream stream(*world);
    std::unique_ptr<comm::CommStream> shm_stream;
    if (shm) shm_stream = std::make_unique<comm::CommStream>(*shm);
    for (const int64_t mib : {1, 16, 128}) {
      const int64_t shard = (mib << 20) / 4 / size;  // elements per rank
      const int64_t full = shard * size;            // elements of the full buffer
      const double bytes = static_cast<double>(full) * 4;
      AlignedBuffer rs_full = make_buffer<float>(full), rs_out = make_buffer<float>(shard);
      AlignedBuffer ag_full = make_buffer<float>(full), ar_full = make_buffer<float>(full);
      float* rs_in = rs_full.as<float>();
      float* rs_shard = rs_out.as<float>();
      float* ag = ag_full.as<float>();
      float* ag_own = ag + rank * shard;
      float* ar = ar_full.as<float>();  // all_reduce output of rs_in; also the memcpy destination
      const int n = static_cast<int>(shard);

      // [op][variant]: op 0 reduce_scatter, 1 all_gather, 2 all_reduce.
      enum { kEngine, kRaw, kRawMain, kShm, kCopy, kVariants };
      std::function<void()> call[3][kVariants];
      call[0][kEngine] = [&] {
        stream.submit([&](comm::Communicator& c) { c.reduce_scatter(rs_in, rs_shard, shard, DType::kF32); }).wait();
      };
      call[0][kRaw] = call[0][kRawMain] = [&] {
        check_mpi(MPI_Reduce_scatter_block(rs_in, rs_shard, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                  "MPI_Reduce_scatter_block");
      };
      call[1][kEngine] = [&] {
        stream.submit([&](comm::Communicator& c) { c.all_gather(ag_own, ag, shard, DType::kF32); }).wait();
      };
      call[1][kRaw] = call[1][kRawMain] = [&] {
        check_mpi(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, ag, n, MPI_FLOAT, MPI_COMM_WORLD),
                  "MPI_Allgather");
      };
      call[2][kEngine] = [&] {
        stream.submit([&](comm::Communicator& c) { c.all_reduce(rs_in, ar, full, DType::kF32); }).wait();
      };
      call[2][kRaw] = call[2][kRawMain] = [&] {
        check_mpi(MPI_Allreduce(rs_in, ar, static_cast<int>(full), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                  "MPI_Allreduce");
      };
      if (shm_stream) {
        call[0][kShm] = [&] {
          shm_stream->submit([&](comm::Communicator& c) { c.reduce_scatter(rs_in, rs_shard, shard, DType::kF32); })
              .wait();
        };
        call[1][kShm] = [&] {
          shm_stream->submit([&](comm::Communicator& c) { c.all_gather(ag_own, ag, shard, DType::kF32); }).wait();
        };
        call[2][kShm] = [&] {
          shm_stream->submit([&](comm::Communicator& c) { c.all_reduce(rs_in, ar, full, DType::kF32); }).wait();
        };
      }
      for (int op = 0; op < 3; ++op) {
        call[op][kCopy] = [&] { std::memcpy(ar, rs_in, static_cast<size_t>(full) * 4); };
      }

      // Validate every backend once before timing (this also warms up).
      bool ok = true;
      for (int v : {int(kEngine), int(kRaw), int(kShm)}) {
        if (!call[0][v]) continue;
        fill_inputs(rs_in, ag, full, shard, rank);
        call[0][v]();
        call[1][v]();
        ok = ok && check_outputs(rs_shard, ag, shard, size);
        std::fill(ar, ar + full, -1.0f);
        call[2][v]();
        const float sum = static_cast<float>(size * (size + 1) / 2);
        for (int64_t i = 0; i < full; ++i) ok = ok && ar[i] == sum;
      }
      int bad = ok ? 0 : 1;
      MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      if (bad) {
        if (rank == 0) std::fprintf(stderr, "collectives: wrong results at %lld MiB\n", static_cast<long long>(mib));
        ++failures;
        continue;
      }

      // Small messages repeat within a sample so that one sample moves >= 64 MiB.
      const int reps = static_cast<int>(std::max<int64_t>(1, 64 / mib));
      std::vector<double> t[3][kVariants];
      for (int round = 0; round < o.rounds; ++round) {
        for (int k = 0; k < kVariants; ++k) {
          const int v = (round + k) % kVariants;
          for (int op = 0; op < 3; ++op) {
            if (!call[op][v]) continue;
            // The copy bound is the same for every op: measure it once per round.
            if (v == kCopy && op > 0) continue;
            t[op][v].push_back(sample(reps, v == kRaw, call[op][v]));
          }
        }
      }
      if (rank != 0) continue;
      auto gbps = [&](int op, int v) { return t[op][v].empty() ? 0.0 : bytes / median(t[op][v]) / 1e9; };
      const double copy = gbps(0, kCopy);
      for (int op = 0; op < 3; ++op) {
        const char* op_name = op == 0 ? "reduce_scatter" : op == 1 ? "all_gather" : "all_reduce";
        const std::string name = std::string(op_name) + "/" + std::to_string(mib) + "MiB";
        const double fig = gbps(op, kShm), mpi = gbps(op, kRaw);
        // The least memory traffic per rank, in units of the full buffer N:
        // reduce-scatter reads N and writes N / L; all-gather (in place)
        // reads its block and writes the L - 1 others; all-reduce reads N
        // and writes N. A copy moves 2 N (read and streamed write), so the
        // collective's bound is copy * 2 / traffic.
        const double L = size, traffic = op == 0 ? 1 + 1 / L : op == 1 ? 1.0 : 2.0;
        const double traffic_bound = copy * 2 / traffic;
        char human[360];
        std::snprintf(human, sizeof human,
                      "%-22s shm %6.2f GB/s  copy %6.2f GB/s  ratio %.3f  traffic bound %6.2f GB/s (%.2f)  "
                      "mpi %6.2f GB/s (shm/mpi %5.2fx)  engine(mpi) %6.2f GB/s  mpi on the main thread %6.2f GB/s",
                      name.c_str(), fig, copy, fig / copy, traffic_bound, fig / traffic_bound, mpi, fig / mpi,
                      gbps(op, kEngine), gbps(op, kRawMain));
        emit(o.json,
             {{"bench", "collectives"},
              {"case", name},
              {"figure", fig},
              {"unit", "GB/s"},
              {"bound", copy},
              {"ratio", fig / copy},
              {"mpi", mpi},
              {"shm_over_mpi", fig / mpi},
              {"traffic_bound", traffic_bound},
              {"traffic_ratio", fig / traffic_bound},
              {"engine_mpi", gbps(op, kEngine)},
              {"raw_main", gbps(op, kRawMain)},
              {"world_size", size},
              {"bytes", static_cast<int64_t>(bytes)}},
             human);
      }
    }
  }  // the streams join before the communicators (and MPI) go
  return failures == 0 ? 0 : 1;
}

}  // namespace zinc::bench
