// Single-rank backend: a world of one, no MPI. Collectives are copies (the
// sum over one rank is its own value, unrounded), and argument errors are the
// same as the MPI backend's (comm_internal.h). Owns nothing; one thread at a
// time, like every Communicator.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/comm.h"
#include "comm/comm_internal.h"

namespace zinc::comm {
namespace {

void copy(const void* src, void* dst, int64_t count, DType dtype) {
  if (src == dst || count == 0) return;
  std::memmove(dst, src, static_cast<size_t>(count) * dtype_bytes(dtype));
}

class SingleCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  int local_size() const override { return 1; }
  int local_rank() const override { return 0; }

  void all_reduce(const void* send, void* recv, int64_t count, DType dtype) override {
    detail::check_all_reduce(0, send, recv, count, dtype);
    copy(send, recv, count, dtype);
  }
  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype) override {
    detail::check_reduce_scatter(0, 1, send, recv, recv_count, dtype);
    copy(send, recv, recv_count, dtype);
  }
  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype) override {
    detail::check_all_gather(0, 1, send, recv, send_count, dtype);
    copy(send, recv, send_count, dtype);
  }
  void all_to_all(const void* send, void* recv, int64_t count_per_rank, DType dtype) override {
    detail::check_all_to_all(0, 1, send, recv, count_per_rank, dtype);
    copy(send, recv, count_per_rank, dtype);
  }
  void broadcast(void* buf, int64_t count, DType dtype, int root) override {
    detail::check_broadcast(0, 1, count, root);
  }
  void all_reduce_f64(double* buf, int64_t count) override { detail::check_count(0, "all_reduce_f64", count); }
  void all_reduce_max_f64(double* buf, int64_t count) override {
    detail::check_count(0, "all_reduce_max_f64", count);
  }
  void barrier() override {}

  [[noreturn]] void abort(int code, const std::string& msg) override {
    std::fprintf(stderr, "zinc: [rank 0] fatal: %s\n", msg.c_str());
    std::fflush(nullptr);
    // _Exit, not exit: abort may be called from a worker thread while other
    // threads still run, and static destructors must not race them.
    std::_Exit(code);
  }
  std::unique_ptr<Communicator> duplicate() override { return std::make_unique<SingleCommunicator>(); }
  std::unique_ptr<Communicator> split(int color, int) override {
    if (color < 0) throw detail::comm_error(0, "split", "color must be >= 0, got " + std::to_string(color));
    return std::make_unique<SingleCommunicator>();
  }
};

}  // namespace

std::unique_ptr<Communicator> make_single_communicator() { return std::make_unique<SingleCommunicator>(); }

}  // namespace zinc::comm
