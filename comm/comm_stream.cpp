// CommStream: an ordered queue of work run by one background thread.
//
// Ownership: the stream owns its thread and the queued work; each handle
// shares its item's State with the stream, so a handle stays valid (and its
// error readable) after the stream is gone. The stream's destructor runs
// everything queued before it joins, so a handle that outlives the stream is
// always done.
//
// Threads: submit, synchronize, the counters and CommHandle::wait may be
// called from any thread except the stream's own (waiting there would wait
// for itself; ZINC_CHECK catches it). The work runs on the stream's thread,
// one item at a time, in submission order. Work never lets an exception
// escape the thread: it is stored in the item's State and reported by wait()
// and, if nobody waited on it, by synchronize().
#include <atomic>
#include <chrono>
#include <string>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "core/error.h"
#include "core/log.h"

namespace zinc::comm {

struct CommHandle::State {
  // Set by the stream's thread before `done` is stored (release); read only
  // after `done` is seen true (acquire), so it needs no lock.
  std::exception_ptr error;
  std::atomic<bool> done{false};
  // The error was rethrown by wait() or synchronize(): synchronize() does not
  // report it (again).
  std::atomic<bool> reported{false};
};

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

// Callers of this process blocked in wait() or synchronize() on any stream.
std::atomic<int> g_blocked_callers{0};

struct BlockedCaller {
  BlockedCaller() { g_blocked_callers.fetch_add(1, std::memory_order_relaxed); }
  ~BlockedCaller() { g_blocked_callers.fetch_sub(1, std::memory_order_relaxed); }
  BlockedCaller(const BlockedCaller&) = delete;
  BlockedCaller& operator=(const BlockedCaller&) = delete;
};

}  // namespace

namespace detail {
int blocked_callers() { return g_blocked_callers.load(std::memory_order_relaxed); }
}  // namespace detail

void CommHandle::wait() {
  if (!state_) return;
  if (!state_->done.load(std::memory_order_acquire)) {
    CommStream& s = *stream_;
    ZINC_CHECK(std::this_thread::get_id() != s.thread_.get_id(),
               "CommHandle::wait() called from the CommStream's own thread (it would wait for itself)");
    std::unique_lock lock(s.mu_);
    const double t0 = now_s();
    BlockedCaller blocked;
    s.cv_done_.wait(lock, [&] { return state_->done.load(std::memory_order_acquire); });
    s.wait_s_ += now_s() - t0;
  }
  if (state_->error) {
    state_->reported.store(true);
    std::rethrow_exception(state_->error);
  }
}

bool CommHandle::done() const { return !state_ || state_->done.load(std::memory_order_acquire); }

CommStream::CommStream(Communicator& comm) : comm_(comm), thread_([this] { run(); }) {}

CommStream::~CommStream() {
  ZINC_CHECK(std::this_thread::get_id() != thread_.get_id(),
             "CommStream destroyed from its own thread (it would join itself)");
  {
    std::scoped_lock lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  thread_.join();  // run() returns only once the queue is empty
  size_t unreported = 0;
  std::string first;
  for (const auto& st : failed_) {
    if (st->reported.load()) continue;
    if (unreported++ == 0) first = describe(st->error);
  }
  if (unreported > 0) {
    log_error("CommStream destroyed with " + std::to_string(unreported) +
              " unreported error(s) from its work; the first: " + first);
  }
}

CommHandle CommStream::submit(std::function<void(Communicator&)> work) {
  ZINC_CHECK(static_cast<bool>(work), "CommStream::submit: empty work");
  auto state = std::make_shared<CommHandle::State>();
  {
    std::scoped_lock lock(mu_);
    ZINC_CHECK(!stop_, "CommStream::submit while the stream is being destroyed");
    queue_.emplace_back(std::move(work), state);
  }
  cv_work_.notify_one();
  CommHandle h;
  h.state_ = std::move(state);
  h.stream_ = this;
  return h;
}

void CommStream::synchronize() {
  ZINC_CHECK(std::this_thread::get_id() != thread_.get_id(),
             "CommStream::synchronize() called from the stream's own thread (it would wait for itself)");
  std::exception_ptr error;
  {
    std::unique_lock lock(mu_);
    // Work runs in order, so the last item queued now being done means all
    // of it is; work submitted while we wait is not waited for.
    if (!queue_.empty()) {
      std::shared_ptr<CommHandle::State> last = queue_.back().second;
      const double t0 = now_s();
      BlockedCaller blocked;
      cv_done_.wait(lock, [&] { return last->done.load(std::memory_order_acquire); });
      wait_s_ += now_s() - t0;
    }
    while (!failed_.empty() && !error) {
      std::shared_ptr<CommHandle::State> st = std::move(failed_.front());
      failed_.pop_front();
      if (!st->reported.exchange(true)) error = st->error;
    }
  }
  if (error) std::rethrow_exception(error);
}

double CommStream::wait_seconds() const {
  std::scoped_lock lock(mu_);
  return wait_s_;
}

double CommStream::busy_seconds() const {
  std::scoped_lock lock(mu_);
  return busy_s_;
}

void CommStream::reset_counters() {
  std::scoped_lock lock(mu_);
  wait_s_ = 0;
  busy_s_ = 0;
}

void CommStream::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything queued has run
    // Only this thread pops, so the front stays put while the lock is released.
    std::function<void(Communicator&)> work = std::move(queue_.front().first);
    std::shared_ptr<CommHandle::State> state = queue_.front().second;
    lock.unlock();
    const double t0 = now_s();
    std::exception_ptr error;
    try {
      work(comm_);
    } catch (...) {
      error = std::current_exception();
    }
    work = nullptr;  // release what the work captured before anyone sees it done
    const double t1 = now_s();
    lock.lock();
    busy_s_ += t1 - t0;
    if (error) {
      state->error = std::move(error);
      failed_.push_back(state);
    }
    state->done.store(true, std::memory_order_release);
    queue_.pop_front();
    cv_done_.notify_all();
  }
}

}  // namespace zinc::comm
