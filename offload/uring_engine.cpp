// The io_uring IoEngine: one ring, owned by one thread at a time.
#include <liburing.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>
#include <sys/uio.h>
#include <vector>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "offload/detail/io_detail.h"
#include "offload/offload.h"

namespace zinc::offload {
namespace detail {

IoError uring_error(const std::string& ctx, int err) {
  std::string hint;
  switch (err) {
    case ENOSYS:
      hint = "; this kernel has no io_uring (needs Linux >= 5.6)";
      break;
    case EPERM:
    case EACCES:
      hint = "; io_uring is disabled (sysctl kernel.io_uring_disabled) or blocked by a seccomp profile";
      break;
    case ENOMEM:
      hint = "; the ring did not fit RLIMIT_MEMLOCK on this kernel: raise ulimit -l or lower aio.queue_depth";
      break;
    default:
      break;
  }
  return IoError(ctx + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")" + hint);
}

namespace {

// Owns one struct io_uring; exits it on destruction. Not movable: liburing
// keeps pointers into the struct's own mappings, so it lives where it was
// set up (the engine holds it by value and is itself heap-allocated).
class IoUring {
 public:
  explicit IoUring(unsigned entries) {
    io_uring_params p{};
    // Completions are reaped by the submitting thread inside io_uring_enter,
    // so the kernel need not interrupt it to run task work.
    p.flags = IORING_SETUP_COOP_TASKRUN;
    int res = io_uring_queue_init_params(entries, &ring_, &p);
    if (res == -EINVAL) {  // kernels before 5.19 do not know the flag
      p = io_uring_params{};
      res = io_uring_queue_init_params(entries, &ring_, &p);
    }
    if (res < 0) throw uring_error("io_uring_queue_init(" + std::to_string(entries) + " entries)", -res);
  }
  ~IoUring() { io_uring_queue_exit(&ring_); }
  IoUring(const IoUring&) = delete;
  IoUring& operator=(const IoUring&) = delete;
  io_uring* get() { return &ring_; }

 private:
  io_uring ring_{};
};

class UringEngine final : public IoEngine {
 public:
  explicit UringEngine(const NvmeOptions& o) : ring_(static_cast<unsigned>(o.queue_depth)), single_(o.single_submit) {
    if (o.fixed_buffers.empty()) return;
    std::vector<iovec> iov;
    for (const auto& [p, n] : o.fixed_buffers) iov.push_back({p, n});
    const int res = io_uring_register_buffers(ring_.get(), iov.data(), static_cast<unsigned>(iov.size()));
    if (res < 0) {
      static std::once_flag warned;
      std::call_once(warned, [res] {
        log_warn("io_uring refused to register the I/O buffers (" + std::string(std::strerror(-res)) +
                 "; raise `ulimit -l`); using plain requests");
      });
      return;
    }
    for (size_t i = 0; i < iov.size(); ++i)
      fixed_.push_back({static_cast<const char*>(iov[i].iov_base), iov[i].iov_len, static_cast<int>(i)});
  }

  void submit_read(int fd, void* buf, int64_t bytes, int64_t offset, uint64_t tag) override {
    io_uring_sqe* sqe = next_sqe();
    const int index = fixed_index(buf, bytes);
    if (index >= 0)
      io_uring_prep_read_fixed(sqe, fd, buf, static_cast<unsigned>(bytes), static_cast<uint64_t>(offset), index);
    else
      io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(bytes), static_cast<uint64_t>(offset));
    queued(sqe, tag);
  }
  void submit_write(int fd, const void* buf, int64_t bytes, int64_t offset, uint64_t tag) override {
    io_uring_sqe* sqe = next_sqe();
    const int index = fixed_index(buf, bytes);
    if (index >= 0)
      io_uring_prep_write_fixed(sqe, fd, buf, static_cast<unsigned>(bytes), static_cast<uint64_t>(offset), index);
    else
      io_uring_prep_write(sqe, fd, buf, static_cast<unsigned>(bytes), static_cast<uint64_t>(offset));
    queued(sqe, tag);
  }
  int registered_buffers() const override { return static_cast<int>(fixed_.size()); }

  void flush() override {
    while (io_uring_sq_ready(ring_.get()) > 0) {
      const int res = io_uring_submit(ring_.get());
      if (res >= 0 || res == -EINTR) continue;
      // EBUSY: the completion queue is full; EAGAIN: the kernel is short of
      // request memory. Both clear once completions are reaped, so stash one
      // (wait() hands it out later) and try again.
      if ((res == -EBUSY || res == -EAGAIN) && in_kernel() > 0) {
        stash_.push_back(reap());
        continue;
      }
      throw uring_error("io_uring_submit", -res);
    }
  }

  Completion wait() override {
    if (stash_.empty()) {
      ZINC_CHECK(in_kernel() > 0 || io_uring_sq_ready(ring_.get()) > 0, "IoEngine::wait with nothing in flight");
      if (io_uring_sq_ready(ring_.get()) > 0) flush();  // waiting on unsubmitted requests would hang
    }
    Completion c;
    if (stash_.empty()) {
      c = reap();
    } else {
      c = stash_.front();
      stash_.pop_front();
    }
    --in_flight_;
    return c;
  }

  int in_flight() const override { return in_flight_; }

 private:
  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    if (!sqe) {  // more requests queued than the ring has entries: hand some over
      flush();
      sqe = io_uring_get_sqe(ring_.get());
    }
    ZINC_CHECK(sqe != nullptr, "io_uring submission queue full after submit");
    return sqe;
  }
  void queued(io_uring_sqe* sqe, uint64_t tag) {
    io_uring_sqe_set_data64(sqe, tag);
    ++in_flight_;
    if (single_) flush();
  }
  // Requests the kernel owes a completion for (not yet reaped into stash_).
  int in_kernel() const { return in_flight_ - static_cast<int>(stash_.size()); }

  Completion reap() {
    io_uring_cqe* cqe = nullptr;
    int res;
    do res = io_uring_wait_cqe(ring_.get(), &cqe);
    while (res == -EINTR);
    if (res < 0) throw uring_error("io_uring_wait_cqe", -res);
    const Completion c{io_uring_cqe_get_data64(cqe), cqe->res};
    io_uring_cqe_seen(ring_.get(), cqe);
    return c;
  }

  // The registered buffer holding [buf, buf + bytes), or -1.
  int fixed_index(const void* buf, int64_t bytes) const {
    const char* p = static_cast<const char*>(buf);
    for (const Fixed& f : fixed_)
      if (p >= f.base && p + bytes <= f.base + f.bytes) return f.index;
    return -1;
  }

  struct Fixed {
    const char* base;
    size_t bytes;
    int index;
  };
  IoUring ring_;
  std::vector<Fixed> fixed_;
  bool single_;
  int in_flight_ = 0;            // prepared and not yet returned by wait()
  std::deque<Completion> stash_;  // reaped during flush(), not yet returned
};

}  // namespace
}  // namespace detail

std::unique_ptr<IoEngine> make_uring_engine(const NvmeOptions& options) {
  if (options.queue_depth < 1)
    throw ConfigError("aio.queue_depth", "must be >= 1, got " + std::to_string(options.queue_depth));
  return std::make_unique<detail::UringEngine>(options);
}

}  // namespace zinc::offload
