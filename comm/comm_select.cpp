// make_communicator: picks the backend for a job (MPI, shared memory,
// hierarchical, NCCL) from the argument, the topology and the environment
// (comm.h), and the test factories of comm_internal.h; Communicator::twin.
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/comm_internal.h"

namespace zinc::comm {
namespace {

std::string env_or(const char* var, const std::string& fallback) {
  const char* v = std::getenv(var);
  return v && *v ? std::string(v) : fallback;
}

size_t slot_bytes_from_env() {
  const char* v = std::getenv("ZINC_SHM_SLOT_BYTES");
  if (!v || !*v) return detail::kShmSlotBytes;
  // Checked: a misspelt value once read as 0 bytes (strtoull's answer to
  // what it cannot parse).
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(v, &end, 10);  // decimal: "010" is ten, not octal eight
  if (*end != '\0' || errno != 0 || *v == '-' || n == 0 || n > (1ull << 34))
    throw CommError(std::string("rank ?: make_communicator: ZINC_SHM_SLOT_BYTES=\"") + v +
                    "\" is not a number of bytes from 1 to 2^34");
  return static_cast<size_t>(n);
}

// ZINC_COMM_TIMEOUT (seconds) when set, else `fallback`.
double timeout_from_env(double fallback) {
  const char* v = std::getenv("ZINC_COMM_TIMEOUT");
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  if (*end != '\0' || !(t > 0)) {
    throw CommError(std::string("rank ?: make_communicator: ZINC_COMM_TIMEOUT=\"") + v +
                    "\" is not a positive number of seconds");
  }
  return t;
}

int fake_node_size_from_env() {
  const char* v = std::getenv("ZINC_COMM_FAKE_NODE_SIZE");
  return v && *v ? std::atoi(v) : 0;
}

}  // namespace

namespace detail {

// An MPI communicator with the time limit of ZINC_COMM_TIMEOUT or `fallback`.
std::unique_ptr<Communicator> mpi_with_limit(double timeout) {
  std::unique_ptr<Communicator> mpi = comm::make_mpi_communicator();
  set_mpi_timeout(*mpi, timeout);
  return mpi;
}

std::unique_ptr<Communicator> make_shm_communicator(size_t slot_bytes) {
  const double timeout = timeout_from_env(kCommTimeoutSeconds);
  return make_shm_backend(mpi_with_limit(timeout), slot_bytes, fake_node_size_from_env(), /*hierarchical=*/false,
                          timeout);
}

std::unique_ptr<Communicator> make_hierarchical_communicator(size_t slot_bytes, int fake_node_size) {
  const double timeout = timeout_from_env(kCommTimeoutSeconds);
  return make_shm_backend(mpi_with_limit(timeout), slot_bytes, fake_node_size, /*hierarchical=*/true, timeout);
}

}  // namespace detail

std::unique_ptr<Communicator> make_communicator(const std::string& mode_arg, double timeout_seconds) {
  const char* env = std::getenv("ZINC_COMM_BACKEND");
  const bool from_env = env && *env;
  std::string mode = env_or("ZINC_COMM_BACKEND", mode_arg);
  if (mode != "mpi" && mode != "shm" && mode != "hierarchical" && mode != "nccl" && mode != "auto") {
    throw CommError("rank ?: make_communicator: unknown backend \"" + mode +
                    "\" (expected mpi, shm, hierarchical, nccl or auto; from " +
                    (from_env ? "ZINC_COMM_BACKEND" : "the argument") + ")");
  }
  if (!(timeout_seconds > 0)) {
    throw CommError("rank ?: make_communicator: the timeout must be a positive number of seconds, not " +
                    std::to_string(timeout_seconds));
  }
  const double timeout = timeout_from_env(timeout_seconds);
  std::unique_ptr<Communicator> mpi = detail::mpi_with_limit(timeout);
  // Every rank must take the same backend: a rank on MPI and another on
  // shared memory wait in collectives the other never joins, with no time
  // limit (ZINC_COMM_BACKEND set on one rank, an MPMD launch with two
  // configs). Agreed here, in the one MPI call every backend's set-up
  // starts with, before any rank issues a collective of its own backend.
  if (mpi->size() > 1) {
    static const char* const kModes[] = {"mpi", "shm", "hierarchical", "nccl", "auto"};
    double code = 0;
    for (int i = 0; i < 5; ++i)
      if (mode == kModes[i]) code = i;
    double range[2] = {code, -code};
    mpi->all_reduce_max_f64(range, 2);
    if (range[0] != -range[1]) {
      throw CommError("rank " + std::to_string(mpi->rank()) + ": make_communicator: the ranks chose different " +
                      "backends: this rank \"" + mode + "\" (from " +
                      (from_env ? "ZINC_COMM_BACKEND" : "the config's comm.backend") + "), another rank \"" +
                      kModes[static_cast<int>(range[0] == code ? -range[1] : range[0])] +
                      "\"; give every rank the same comm.backend and ZINC_COMM_BACKEND");
    }
  }
  if (mode == "mpi") return mpi;
  // NCCL bootstraps over MPI and keeps it (abort, and the ranks' lifetime).
  if (mode == "nccl") return detail::make_nccl_backend(std::move(mpi), /*device=*/-1);
  const int fake = fake_node_size_from_env();
  if (mode == "auto") {
    if (mpi->size() == 1) return mpi;
    // From the topology alone: shm when every rank is on this machine,
    // hierarchical when some are not. (Session 1 kept MPI on machines with
    // fewer cores than two threads per rank; the engine measurements in
    // bench/RESULTS.md, shared memory, show Open MPI no faster there, its
    // polling only hides its waiting in the compute thread's lost CPU time.)
    // Every rank reaches the same answer through a max-reduction.
    const int node_size = fake > 0 ? fake : mpi->local_size();
    double several_nodes = node_size != mpi->size() ? 1.0 : 0.0;
    mpi->all_reduce_max_f64(&several_nodes, 1);
    mode = several_nodes > 0 ? "hierarchical" : "shm";
  }
  return detail::make_shm_backend(std::move(mpi), slot_bytes_from_env(), fake, mode == "hierarchical", timeout);
}

std::unique_ptr<Communicator> Communicator::split(int, int) {
  throw detail::comm_error(rank(), "split", "the " + backend() + " backend cannot split into groups");
}
void Communicator::send(const void* buf, int64_t count, DType dtype, int peer) {
  exchange(buf, count, peer, nullptr, 0, -1, dtype);
}
void Communicator::recv(void* buf, int64_t count, DType dtype, int peer) {
  exchange(nullptr, 0, -1, buf, count, peer, dtype);
}
void Communicator::exchange(const void*, int64_t, int, void*, int64_t, int, DType) {
  throw detail::comm_error(rank(), "exchange", "the " + backend() + " backend has no point-to-point transfers");
}

void Communicator::all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                                DType dtype) {
  const int n = size(), me = rank();
  const size_t elem = dtype_bytes(dtype);
  std::vector<int64_t> at_send, at_recv;
  detail::check_all_to_all_v(me, n, send, send_counts, recv, recv_counts, dtype, at_send, at_recv);
  const char* s = static_cast<const char*>(send);
  char* r = static_cast<char*>(recv);
  if (send_counts[me] > 0)
    std::memcpy(r + static_cast<size_t>(at_recv[static_cast<size_t>(me)]) * elem,
                s + static_cast<size_t>(at_send[static_cast<size_t>(me)]) * elem,
                static_cast<size_t>(send_counts[me]) * elem);
  for (int d = 1; d < n; ++d) {
    const int to = (me + d) % n, from = (me - d + n) % n;
    exchange(s + static_cast<size_t>(at_send[static_cast<size_t>(to)]) * elem, send_counts[to], to,
             r + static_cast<size_t>(at_recv[static_cast<size_t>(from)]) * elem, recv_counts[from], from, dtype);
  }
}

Communicator* Communicator::twin() {
  if (!twin_made_) {
    twin_ = duplicate();
    twin_made_ = true;
  }
  return twin_.get();
}

}  // namespace zinc::comm
