// zinc comm, private: argument checks shared by every backend, the MPI error
// translation, and test hooks. Not included outside comm/ and tests/comm/.
//
// Every backend validates its arguments with the same functions, so a caller
// bug (a negative count, an overlapping reduce-scatter buffer, a bad root)
// fails the same way at world size 1 as at world size N. The checks run
// before any communication: when every rank passes the same arguments (as
// they must), every rank throws and none is left waiting.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"

namespace zinc::comm::detail {

// Largest element count one MPI call takes (its count argument is an int).
inline constexpr int64_t kMpiMaxCount = 2147483647;
// all_reduce, broadcast and the f64 reductions split larger buffers into
// calls of at most this many elements (a power of two keeps chunks aligned).
inline constexpr int64_t kMpiChunkCount = int64_t{1} << 30;

// "rank R: op: msg" as a CommError.
CommError comm_error(int rank, const std::string& op, const std::string& msg);

// Throw CommError when the arguments are invalid; `op` names the collective.
void check_count(int rank, const char* op, int64_t count);
// Whether the byte ranges [a, a + an) and [b, b + bn) share a byte.
bool overlaps(const void* a, size_t an, const void* b, size_t bn);
void check_all_reduce(int rank, const void* send, const void* recv, int64_t count, DType dtype);
void check_reduce_scatter(int rank, int size, const void* send, const void* recv, int64_t recv_count,
                          DType dtype);
// Returns true when send is this rank's block inside recv (in place).
bool check_all_gather(int rank, int size, const void* send, const void* recv, int64_t send_count,
                      DType dtype);
void check_broadcast(int rank, int size, int64_t count, int root);
void check_all_to_all(int rank, int size, const void* send, const void* recv, int64_t count_per_rank,
                      DType dtype);
// all_to_all_v's counts (each >= 0, this rank's to itself as it expects
// from itself) and buffers (not overlapping); at_send and at_recv get each
// rank's block's first element (size + 1 entries, the last the total).
void check_all_to_all_v(int rank, int size, const void* send, const int64_t* send_counts, const void* recv,
                        const int64_t* recv_counts, DType dtype, std::vector<int64_t>& at_send,
                        std::vector<int64_t>& at_recv);
// exchange (and send, recv): each of to and from is -1 (none) or another
// rank, with a count >= 0.
void check_exchange(int rank, int size, int to, int64_t send_count, int from, int64_t recv_count);

// Translates an MPI return code: CommError("rank R: <op> failed: <MPI_Error_string> (MPI error
// class C)"). R is the rank in MPI_COMM_WORLD, or "?" when MPI is not running.
CommError mpi_error(const std::string& op, int rc);

// The MPI_Comm (a pointer to it: this header names no MPI type) of a
// communicator that make_mpi_communicator made, or that its split() made.
const void* mpi_comm_of(const Communicator& mpi);
// The longest an MPI communicator (from make_mpi_communicator, or its
// split() or duplicate(), which inherit it) waits in one MPI call for the
// other ranks before it ends the job (Note [MPI collectives: the time limit]
// in mpi_communicator.cpp).
void set_mpi_timeout(Communicator& mpi, double seconds);
// Marks an MPI call that a backend makes on its own MPI communicators (the
// shm backend's node and cross-node ones) as a wait of `mpi`, the MPI
// communicator it owns, for that time limit. One at a time per `mpi`, as
// its calls are.
class MpiWait {
 public:
  MpiWait(Communicator& mpi, const char* fn, const char* what, int64_t count = -1, DType dtype = DType::kF32);
  ~MpiWait();
  MpiWait(const MpiWait&) = delete;
  MpiWait& operator=(const MpiWait&) = delete;

 private:
  void* call_;  // the communicator's in-flight record (mpi_communicator.cpp)
};

// make_mpi_communicator with a smaller per-call element limit (tests exercise
// chunking and the limit errors with small buffers). max_count is both the
// chunk size of all_reduce/broadcast/f64 reductions and the limit of
// reduce_scatter/all_gather.
std::unique_ptr<Communicator> make_mpi_communicator(int64_t max_count);

// Bytes of one rank's slot in the shared-memory backend (two halves used by
// alternate chunks; Note [shm collectives: memory ordering]). Small on
// purpose: a 512 KiB chunk is still in cache when the other ranks read it
// (measured on 2 ranks, 128 MiB reduce-scatter: 11 GB/s with 1 MiB slots,
// 6.6 GB/s with 8 MiB, 5.3 GB/s with 32 MiB). ZINC_SHM_SLOT_BYTES overrides
// it in make_communicator.
inline constexpr size_t kShmSlotBytes = size_t{1} << 20;

// The shared-memory backend with a given slot size (tests exercise chunking
// with small slots). Throws CommError unless every rank is on this machine.
// ZINC_COMM_FAKE_NODE_SIZE applies as in make_communicator.
std::unique_ptr<Communicator> make_shm_communicator(size_t slot_bytes);
// The hierarchical backend (shm inside each node, MPI between nodes);
// fake_node_size > 0 treats each group of that many consecutive ranks as a
// node, so one machine can exercise it.
std::unique_ptr<Communicator> make_hierarchical_communicator(size_t slot_bytes, int fake_node_size);

// The shared-memory (or, with `hierarchical`, the hierarchical) backend over
// an MPI communicator of the same ranks, which it keeps for broadcast, the
// f64 reductions, barrier and abort (make_communicator, comm_select.cpp).
// Collective. fake_node_size > 0: each group of that many consecutive ranks
// acts as a node. timeout_s: the longest wait for a peer in a collective.
std::unique_ptr<Communicator> make_shm_backend(std::unique_ptr<Communicator> mpi, size_t slot_bytes,
                                               int fake_node_size, bool hierarchical, double timeout_s);

// The NCCL backend over `bootstrap`, which it keeps alive inside it
// (make_communicator("nccl")). Built without NCCL: throws, like
// make_nccl_communicator.
std::unique_ptr<Communicator> make_nccl_backend(std::unique_ptr<Communicator> bootstrap, int device);
// CommError("[rank R] nccl backend: why"), the refusals of make_nccl_communicator.
CommError nccl_backend_error(int rank, const std::string& why);

// Threads of this process blocked in CommHandle::wait or
// CommStream::synchronize right now (any stream). While it is non-zero the
// shm backend polls instead of sleeping: the caller has given up its core.
int blocked_callers();

}  // namespace zinc::comm::detail
