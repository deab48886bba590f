// The fault-injecting IoEngine test double (leveldb's fault_injection_test
// idea at the request level).
#include <cerrno>
#include <deque>
#include <utility>

#include "core/error.h"
#include "offload/offload.h"

namespace zinc::offload {
namespace {

// Counts operations as they are submitted. After ok_ops of them:
//  - err == 0: the next one moves only half of its bytes (rounded down to
//    4 KiB when that leaves something, so that O_DIRECT can resume the
//    rest); later ones pass through.
//  - err == EINTR or EAGAIN: the next one fails with -err (these are
//    transient by nature); later ones pass through.
//  - any other err: that one and every later one fail with -err without
//    reaching the disk (a failed disk stays failed, a full one stays full).
// Failed operations complete at once: wait() returns them before anything
// the inner engine holds.
class FaultyEngine final : public IoEngine {
 public:
  FaultyEngine(std::unique_ptr<IoEngine> inner, int64_t ok_ops, int err)
      : inner_(std::move(inner)), ok_ops_(ok_ops), err_(err) {
    ZINC_CHECK(inner_ != nullptr, "make_faulty_engine needs an inner engine");
    ZINC_CHECK(err >= 0, "make_faulty_engine: err is a positive errno or 0");
  }

  void submit_read(int fd, void* buf, int64_t bytes, int64_t offset, uint64_t tag) override {
    if (inject(bytes, tag)) inner_->submit_read(fd, buf, bytes_now_, offset, tag);
  }
  void submit_write(int fd, const void* buf, int64_t bytes, int64_t offset, uint64_t tag) override {
    if (inject(bytes, tag)) inner_->submit_write(fd, buf, bytes_now_, offset, tag);
  }
  void flush() override { inner_->flush(); }
  Completion wait() override {
    if (failed_.empty()) return inner_->wait();
    const Completion c = failed_.front();
    failed_.pop_front();
    return c;
  }
  int in_flight() const override { return inner_->in_flight() + static_cast<int>(failed_.size()); }
  int registered_buffers() const override { return inner_->registered_buffers(); }

 private:
  // Decides the fate of one operation: true = pass bytes_now_ bytes to the
  // inner engine; false = it failed (queued in failed_).
  bool inject(int64_t bytes, uint64_t tag) {
    const int64_t n = ops_++;
    bytes_now_ = bytes;
    if (n < ok_ops_) return true;
    const bool transient = err_ == 0 || err_ == EINTR || err_ == EAGAIN;
    if (transient && n > ok_ops_) return true;
    if (err_ == 0) {
      const int64_t half = bytes / 2 / 4096 * 4096;
      bytes_now_ = half > 0 ? half : bytes / 2;
      if (bytes_now_ > 0) return true;
    }
    failed_.push_back({tag, err_ == 0 ? int64_t{0} : -int64_t{err_}});
    return false;
  }

  std::unique_ptr<IoEngine> inner_;
  int64_t ok_ops_;
  int err_;
  int64_t ops_ = 0;
  int64_t bytes_now_ = 0;
  std::deque<Completion> failed_;
};

}  // namespace

std::unique_ptr<IoEngine> make_faulty_engine(std::unique_ptr<IoEngine> inner, int64_t ok_ops, int err) {
  return std::make_unique<FaultyEngine>(std::move(inner), ok_ops, err);
}

}  // namespace zinc::offload
