// Argument checks shared by the backends (see comm_internal.h).
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "comm/comm_internal.h"

namespace zinc::comm::detail {
namespace {

using Addr = uintptr_t;

Addr addr(const void* p) { return reinterpret_cast<Addr>(p); }

}  // namespace

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  if (an == 0 || bn == 0) return false;
  return addr(a) < addr(b) + bn && addr(b) < addr(a) + an;
}

CommError comm_error(int rank, const std::string& op, const std::string& msg) {
  return CommError("rank " + std::to_string(rank) + ": " + op + ": " + msg);
}

void check_count(int rank, const char* op, int64_t count) {
  if (count < 0) throw comm_error(rank, op, "count must be >= 0, got " + std::to_string(count));
}

void check_all_to_all_v(int rank, int size, const void* send, const int64_t* send_counts, const void* recv,
                        const int64_t* recv_counts, DType dtype, std::vector<int64_t>& at_send,
                        std::vector<int64_t>& at_recv) {
  at_send.assign(static_cast<size_t>(size) + 1, 0);
  at_recv.assign(static_cast<size_t>(size) + 1, 0);
  for (int r = 0; r < size; ++r) {
    check_count(rank, "all_to_all_v", send_counts[r]);
    check_count(rank, "all_to_all_v", recv_counts[r]);
    at_send[static_cast<size_t>(r) + 1] = at_send[static_cast<size_t>(r)] + send_counts[r];
    at_recv[static_cast<size_t>(r) + 1] = at_recv[static_cast<size_t>(r)] + recv_counts[r];
  }
  if (send_counts[rank] != recv_counts[rank])
    throw comm_error(rank, "all_to_all_v", "this rank sends itself " + std::to_string(send_counts[rank]) +
                                               " elements but expects " + std::to_string(recv_counts[rank]));
  const size_t elem = dtype_bytes(dtype);
  if (overlaps(send, static_cast<size_t>(at_send.back()) * elem, recv, static_cast<size_t>(at_recv.back()) * elem))
    throw comm_error(rank, "all_to_all_v", "send and recv overlap; all_to_all_v is not in place");
}

void check_exchange(int rank, int size, int to, int64_t send_count, int from, int64_t recv_count) {
  for (auto [peer, count, what] : {std::tuple{to, send_count, "send"}, std::tuple{from, recv_count, "recv"}}) {
    if (peer == -1) continue;
    check_count(rank, what, count);
    if (peer < 0 || peer >= size || peer == rank)
      throw comm_error(rank, what, "peer " + std::to_string(peer) + " is not another rank of " + std::to_string(size));
  }
}

void check_all_reduce(int rank, const void* send, const void* recv, int64_t count, DType dtype) {
  check_count(rank, "all_reduce", count);
  const size_t bytes = static_cast<size_t>(count) * dtype_bytes(dtype);
  if (send != recv && overlaps(send, bytes, recv, bytes)) {
    throw comm_error(rank, "all_reduce",
                     "send and recv overlap without being the same buffer (pass send == recv for in place)");
  }
}

void check_reduce_scatter(int rank, int size, const void* send, const void* recv, int64_t recv_count,
                          DType dtype) {
  check_count(rank, "reduce_scatter", recv_count);
  const size_t elem = dtype_bytes(dtype);
  const size_t recv_bytes = static_cast<size_t>(recv_count) * elem;
  if (overlaps(send, recv_bytes * static_cast<size_t>(size), recv, recv_bytes)) {
    throw comm_error(rank, "reduce_scatter",
                     "recv overlaps send; reduce_scatter is not in place (recv needs its own " +
                         std::to_string(recv_count) + " elements)");
  }
}

bool check_all_gather(int rank, int size, const void* send, const void* recv, int64_t send_count,
                      DType dtype) {
  check_count(rank, "all_gather", send_count);
  const size_t block_bytes = static_cast<size_t>(send_count) * dtype_bytes(dtype);
  const void* own = static_cast<const char*>(recv) + static_cast<size_t>(rank) * block_bytes;
  if (send == own) return true;
  if (overlaps(send, block_bytes, recv, block_bytes * static_cast<size_t>(size))) {
    throw comm_error(rank, "all_gather",
                     "send overlaps recv but is not this rank's block (in place needs send == recv + rank * "
                     "send_count elements)");
  }
  return false;
}

void check_broadcast(int rank, int size, int64_t count, int root) {
  check_count(rank, "broadcast", count);
  if (root < 0 || root >= size) {
    throw comm_error(rank, "broadcast",
                     "root " + std::to_string(root) + " is not a rank of this world of " + std::to_string(size));
  }
}

void check_all_to_all(int rank, int size, const void* send, const void* recv, int64_t count_per_rank,
                      DType dtype) {
  check_count(rank, "all_to_all", count_per_rank);
  const size_t bytes = static_cast<size_t>(count_per_rank) * dtype_bytes(dtype) * static_cast<size_t>(size);
  if (overlaps(send, bytes, recv, bytes)) {
    throw comm_error(rank, "all_to_all", "send and recv overlap; all_to_all is not in place");
  }
}

}  // namespace zinc::comm::detail
