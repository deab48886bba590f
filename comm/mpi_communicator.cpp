// MPI backend of Communicator.
//
// Ownership: one MpiCommunicator owns a duplicate of MPI_COMM_WORLD (its own
// message space, with MPI_ERRORS_RETURN so that failures come back as codes
// and become CommError through mpi_error), the bf16 datatype and the bf16 sum
// operation. All of them are freed by its destructor. MPI itself is shared by
// the process: MpiRuntime counts live communicators and finalises MPI when
// the last one goes, if zinc initialised it (Note [MPI lifetime]).
//
// Threads: like every Communicator, one thread at a time (CommStream's thread
// while a stream exists). MPI is initialised with MPI_THREAD_MULTIPLE
// requested and at least MPI_THREAD_SERIALIZED required: the collectives run
// on the stream's thread, not the thread that initialised MPI. duplicate()
// needs MPI_THREAD_MULTIPLE (two streams' threads in MPI at once).
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "core/log.h"

namespace zinc::comm {
namespace detail {

CommError mpi_error(const std::string& op, int rc) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  const bool running = initialized && !finalized;
  std::string rank = "?";
  std::string text = "MPI error code " + std::to_string(rc);
  if (running) {
    int r = 0;
    if (MPI_Comm_rank(MPI_COMM_WORLD, &r) == MPI_SUCCESS) rank = std::to_string(r);
    char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, buf, &len) == MPI_SUCCESS) text.assign(buf, static_cast<size_t>(len));
    int cls = 0;
    if (MPI_Error_class(rc, &cls) == MPI_SUCCESS) text += " (MPI error class " + std::to_string(cls) + ")";
  }
  return CommError("rank " + rank + ": " + op + " failed: " + text);
}

}  // namespace detail

namespace {

using detail::comm_error;
using detail::mpi_error;

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "unknown";
}

// Note [MPI lifetime]
// MPI can be initialised and finalised once per process. The first
// communicator initialises it (unless the program already did), each
// communicator holds a reference, and the last one to go finalises it, but
// only if zinc initialised it: a program that called MPI_Init itself also
// calls MPI_Finalize itself. After that MPI cannot come back, so a program
// keeps one communicator alive for its whole run.
class MpiRuntime {
 public:
  static void acquire() {
    std::scoped_lock lock(mu());
    State& s = state();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      throw CommError(
          "rank ?: MPI_Init_thread: MPI has already been finalised in this process and cannot start again "
          "(keep one communicator alive for the whole run)");
    }
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) throw mpi_error("MPI_Init_thread", rc);
      s.we_initialised = true;
    } else {
      MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_SERIALIZED) {
      CommError err(std::string("rank ?: MPI_Init_thread: MPI provides ") + thread_level_name(provided) +
                    "; zinc needs at least MPI_THREAD_SERIALIZED because its CommStream thread issues the "
                    "collectives (initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let "
                    "zinc initialise it)");
      if (s.live == 0 && s.we_initialised) {
        MPI_Finalize();
        s.we_initialised = false;
      }
      throw err;
    }
    ++s.live;
    s.thread_level = provided;
  }

  // The thread level MPI provides (valid while a communicator lives).
  static int thread_level() {
    std::scoped_lock lock(mu());
    return state().thread_level;
  }

  // A communicator that goes while an error unwinds (its own set-up
  // failed, on this rank only) does not finalise: MPI_Finalize waits for
  // every rank, and the others wait in a collective for this one, so the
  // job hung with this rank's error unsaid. Left initialised, the process
  // ends with its error line and mpirun ends the job; a later
  // communicator's release finalises as usual.
  // `failing`: called from the handler of a failed set-up (where the
  // exception is caught, not unwinding).
  static void release(bool failing = false) {
    std::scoped_lock lock(mu());
    State& s = state();
    if (--s.live > 0 || !s.we_initialised) return;
    int world = 1;
    if ((failing || std::uncaught_exceptions() > 0) && MPI_Comm_size(MPI_COMM_WORLD, &world) == MPI_SUCCESS &&
        world > 1)
      return;
    const int rc = MPI_Finalize();
    s.we_initialised = false;
    if (rc != MPI_SUCCESS) log_warn("MPI_Finalize failed (code " + std::to_string(rc) + ")");
  }

 private:
  struct State {
    int live = 0;
    int thread_level = MPI_THREAD_SINGLE;
    bool we_initialised = false;
  };
  // Never destroyed: a communicator released during static destruction must
  // still find them.
  static std::mutex& mu() {
    static auto* m = new std::mutex;
    return *m;
  }
  static State& state() {
    static auto* s = new State;
    return *s;
  }
};

// Note [MPI collectives: the time limit]
// A rank that waits in an MPI collective for a peer that never comes (the
// peer caught an error and went on, or waits in another collective, or a
// --set on one rank only changed what it calls) waited forever: Open MPI has
// no time limit, and mpirun ends the job only when a process exits. Each
// MPI call a communicator makes that waits for other ranks (the
// collectives, the pipeline's point-to-point waits, the splits), and each
// that the shm backend makes on its own node and cross-node communicators
// (detail::MpiWait), records what it is and when it began; one watchdog
// thread per process looks every quarter second (or an eighth of the
// limit) and, when a call has waited longer than comm.timeout_seconds
// (ZINC_COMM_TIMEOUT), prints one line naming the rank, the call and the
// wait, and ends the job with MPI_Abort
// (mpirun then ends every rank). Blocking MPI calls cannot be left, so the
// shm backend's choice, an exception in the waiting rank, is not open here;
// nonblocking collectives polled against a clock could, but Open MPI runs
// them through another, slower component (libnbc) than the blocking ones.
// The cost on the path is two atomic stores a call.
class MpiCall;

class Watchdog {
 public:
  static Watchdog& get() {
    static auto* w = new Watchdog;  // never destroyed: its thread outlives static destruction
    return *w;
  }
  void add(MpiCall* c) {
    std::scoped_lock lock(mu_);
    calls_.push_back(c);
    if (!started_) {
      try {
        std::thread([this] { run(); }).detach();
      } catch (const std::system_error& e) {
        calls_.pop_back();
        throw CommError(std::string("rank ?: cannot start the thread that watches MPI's time limits: ") + e.what() +
                        " (a process or address-space limit: ulimit -u, ulimit -v)");
      }
      started_ = true;
    }
  }
  void remove(MpiCall* c) {
    std::scoped_lock lock(mu_);
    calls_.erase(std::remove(calls_.begin(), calls_.end(), c), calls_.end());
  }

 private:
  void run();
  std::mutex mu_;
  std::vector<MpiCall*> calls_;
  bool started_ = false;
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What one communicator is waiting in, for the watchdog.
class MpiCall {
 public:
  // MPI must be initialised: the line names the rank in MPI_COMM_WORLD.
  MpiCall() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    Watchdog::get().add(this);
  }
  ~MpiCall() { Watchdog::get().remove(this); }
  MpiCall(const MpiCall&) = delete;
  MpiCall& operator=(const MpiCall&) = delete;

  // A limit past what an int64 of nanoseconds holds (292 years; a config's
  // 1e12 or ZINC_COMM_TIMEOUT=inf, meant as "none") is no limit. Converted
  // as it was, it wrapped to a negative one, and the first call ended the job.
  void set_timeout(double seconds) {
    const double ns = seconds * 1e9;
    timeout_ns_.store(ns < 9.2e18 ? static_cast<int64_t>(ns) : INT64_MAX, std::memory_order_relaxed);
  }
  double timeout_s() const { return static_cast<double>(timeout_ns_.load(std::memory_order_relaxed)) / 1e9; }

  // Marks one MPI call: fn the MPI function, what the collective, count and
  // dtype its size (count < 0: none).
  void begin(const char* fn, const char* what, int64_t count, DType dtype) {
    fn_.store(fn, std::memory_order_relaxed);
    what_.store(what, std::memory_order_relaxed);
    count_.store(count, std::memory_order_relaxed);
    dtype_.store(static_cast<int>(dtype), std::memory_order_relaxed);
    since_ns_.store(now_ns(), std::memory_order_release);
  }
  void end() { since_ns_.store(0, std::memory_order_release); }

  class Scope {
   public:
    Scope(MpiCall& c, const char* fn, const char* what, int64_t count = -1, DType dtype = DType::kF32) : c_(c) {
      c_.begin(fn, what, count, dtype);
    }
    ~Scope() { c_.end(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    MpiCall& c_;
  };

  // The line to end the job with, if the call in flight has waited past the
  // limit at `now`; "" otherwise.
  std::string overdue(int64_t now) const {
    const int64_t since = since_ns_.load(std::memory_order_acquire);
    const int64_t limit = timeout_ns_.load(std::memory_order_relaxed);
    if (since == 0 || now - since <= limit) return "";
    const char* fn = fn_.load(std::memory_order_relaxed);
    const char* what = what_.load(std::memory_order_relaxed);
    const int64_t count = count_.load(std::memory_order_relaxed);
    const auto dtype = static_cast<DType>(dtype_.load(std::memory_order_relaxed));
    if (since_ns_.load(std::memory_order_acquire) != since) return "";  // that call ended meanwhile
    char waited[32], allowed[32];
    std::snprintf(waited, sizeof waited, "%.1f", static_cast<double>(now - since) / 1e9);
    std::snprintf(allowed, sizeof allowed, "%g", static_cast<double>(limit) / 1e9);
    std::string call = std::string(fn) + " (" + what;
    if (count >= 0) call += " of " + std::to_string(count) + " " + std::string(dtype_name(dtype));
    return "rank " + std::to_string(rank_) + ": " + call + ") has waited " + waited +
           " s for the other ranks, past comm.timeout_seconds (" + allowed +
           " s; ZINC_COMM_TIMEOUT overrides it): a rank has stopped, or waits in another collective, or was "
           "given another config; ending the job";
  }

 private:
  int rank_ = -1;
  std::atomic<int64_t> timeout_ns_{static_cast<int64_t>(kCommTimeoutSeconds * 1e9)};
  std::atomic<int64_t> since_ns_{0};
  std::atomic<const char*> fn_{""};
  std::atomic<const char*> what_{""};
  std::atomic<int64_t> count_{-1};
  std::atomic<int> dtype_{0};
};

void Watchdog::run() {
  while (true) {
    double step = 0.25;
    std::string line;
    {
      std::scoped_lock lock(mu_);
      const int64_t now = now_ns();
      for (const MpiCall* c : calls_) {
        step = std::min(step, c->timeout_s() / 8);
        if (line.empty()) line = c->overdue(now);
      }
      if (!line.empty()) {
        std::fprintf(stderr, "zinc: %s\n", line.c_str());
        std::fflush(stderr);
        std::fflush(stdout);
        MPI_Abort(MPI_COMM_WORLD, 1);
        std::_Exit(1);  // MPI_Abort does not return; if it ever does, still end this rank
      }
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(step, 0.001)));
  }
}

// bf16 sum as an MPI user operation: each pairwise combination is formed in
// fp32 and rounded once (round to nearest even), inout = in + inout.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const bf16* a = static_cast<const bf16*>(in);
  bf16* b = static_cast<bf16*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

// The same for fp16.
void f16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const f16* a = static_cast<const f16*>(in);
  f16* b = static_cast<f16*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) b[i] = float_to_f16(f16_to_float(a[i]) + f16_to_float(b[i]));
}

class MpiCommunicator final : public Communicator {
 public:
  // Over the ranks of `parent` (MPI_COMM_NULL: MPI_COMM_WORLD, read once
  // MPI is initialised), through a duplicate of it: its own message space.
  MpiCommunicator(int64_t chunk_count, int64_t max_count, MPI_Comm parent = MPI_COMM_NULL,
                  double timeout_s = kCommTimeoutSeconds)
      : chunk_count_(chunk_count), max_count_(max_count) {
    MpiRuntime::acquire();
    try {
      call_ = std::make_unique<MpiCall>();
      call_->set_timeout(timeout_s);
      {
        auto w = waiting("MPI_Comm_dup", "a new communicator");
        check(MPI_Comm_dup(parent == MPI_COMM_NULL ? MPI_COMM_WORLD : parent, &comm_), "MPI_Comm_dup");
      }
      check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
      check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
      check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
      MPI_Comm node = MPI_COMM_NULL;
      {
        auto w = waiting("MPI_Comm_split_type", "the ranks of this machine");
        check(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node),
              "MPI_Comm_split_type");
      }
      int rc = MPI_Comm_size(node, &local_size_);
      if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(node, &local_rank_);
      MPI_Comm_free(&node);
      check(rc, "MPI_Comm_size/rank (node)");
      check(MPI_Type_contiguous(1, MPI_UINT16_T, &bf16_type_), "MPI_Type_contiguous");
      check(MPI_Type_commit(&bf16_type_), "MPI_Type_commit");
      check(MPI_Op_create(&bf16_sum, /*commute=*/1, &bf16_sum_), "MPI_Op_create");
      check(MPI_Op_create(&f16_sum, /*commute=*/1, &f16_sum_), "MPI_Op_create");
    } catch (...) {
      free_handles();
      call_.reset();
      MpiRuntime::release(/*failing=*/true);
      throw;
    }
    set_log_rank(rank_);
  }

  ~MpiCommunicator() override {
    free_handles();
    call_.reset();
    MpiRuntime::release();
  }

  // Note [MPI collectives: the time limit].
  void set_timeout(double seconds) { call_->set_timeout(seconds); }
  MpiCall& call() { return *call_; }

  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  double timeout_seconds() const override { return call_->timeout_s(); }
  int local_size() const override { return local_size_; }
  int local_rank() const override { return local_rank_; }

  void all_reduce(const void* send, void* recv, int64_t count, DType dtype) override {
    detail::check_all_reduce(rank_, send, recv, count, dtype);
    const size_t elem = dtype_bytes(dtype);
    for (int64_t off = 0; off < count; off += chunk_count_) {
      const int n = static_cast<int>(std::min(chunk_count_, count - off));
      void* r = static_cast<char*>(recv) + static_cast<size_t>(off) * elem;
      const void* s = send == recv ? MPI_IN_PLACE : static_cast<const char*>(send) + static_cast<size_t>(off) * elem;
      auto w = waiting("MPI_Allreduce", "all_reduce", count, dtype);
      check(MPI_Allreduce(s, r, n, type(dtype), sum(dtype), comm_), "MPI_Allreduce", "all_reduce", count, dtype);
    }
  }

  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype) override {
    detail::check_reduce_scatter(rank_, size_, send, recv, recv_count, dtype);
    if (recv_count == 0) return;
    check_limit("reduce_scatter", recv_count, "reduce_bucket_size");
    auto w = waiting("MPI_Reduce_scatter_block", "reduce_scatter", recv_count, dtype);
    check(MPI_Reduce_scatter_block(send, recv, static_cast<int>(recv_count), type(dtype), sum(dtype), comm_),
          "MPI_Reduce_scatter_block", "reduce_scatter", recv_count, dtype);
  }

  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype) override {
    const bool in_place = detail::check_all_gather(rank_, size_, send, recv, send_count, dtype);
    if (send_count == 0) return;
    check_limit("all_gather", send_count, "allgather_bucket_size");
    const int n = static_cast<int>(send_count);
    auto w = waiting("MPI_Allgather", "all_gather", send_count, dtype);
    check(MPI_Allgather(in_place ? MPI_IN_PLACE : send, n, type(dtype), recv, n, type(dtype), comm_),
          "MPI_Allgather", "all_gather", send_count, dtype);
  }

  // One MPI_Alltoall, within the same int limit as all_gather (size *
  // count_per_rank elements: MPI implementations index the full buffer).
  void all_to_all(const void* send, void* recv, int64_t count_per_rank, DType dtype) override {
    detail::check_all_to_all(rank_, size_, send, recv, count_per_rank, dtype);
    if (count_per_rank == 0) return;
    check_limit("all_to_all", count_per_rank, "the 1-bit buffer size");
    const int n = static_cast<int>(count_per_rank);
    auto w = waiting("MPI_Alltoall", "all_to_all", count_per_rank, dtype);
    check(MPI_Alltoall(send, n, type(dtype), recv, n, type(dtype), comm_), "MPI_Alltoall", "all_to_all",
          count_per_rank, dtype);
  }

  void broadcast(void* buf, int64_t count, DType dtype, int root) override {
    detail::check_broadcast(rank_, size_, count, root);
    const size_t elem = dtype_bytes(dtype);
    for (int64_t off = 0; off < count; off += chunk_count_) {
      const int n = static_cast<int>(std::min(chunk_count_, count - off));
      auto w = waiting("MPI_Bcast", "broadcast", count, dtype);
      check(MPI_Bcast(static_cast<char*>(buf) + static_cast<size_t>(off) * elem, n, type(dtype), root, comm_),
            "MPI_Bcast", "broadcast", count, dtype);
    }
  }

  void all_reduce_f64(double* buf, int64_t count) override { reduce_f64(buf, count, MPI_SUM, "all_reduce_f64"); }
  void all_reduce_max_f64(double* buf, int64_t count) override {
    reduce_f64(buf, count, MPI_MAX, "all_reduce_max_f64");
  }

  void barrier() override {
    auto w = waiting("MPI_Barrier", "barrier");
    check(MPI_Barrier(comm_), "MPI_Barrier");
  }

  // Another MPI_Comm_dup of this one's ranks: its own message space, so its
  // collectives never match this one's. Two threads in MPI at once need
  // MPI_THREAD_MULTIPLE.
  std::unique_ptr<Communicator> duplicate() override {
    if (MpiRuntime::thread_level() < MPI_THREAD_MULTIPLE) return nullptr;
    return std::make_unique<MpiCommunicator>(chunk_count_, max_count_, comm_, call_->timeout_s());
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    if (color < 0) throw detail::comm_error(rank_, "split", "color must be >= 0, got " + std::to_string(color));
    MPI_Comm part = MPI_COMM_NULL;
    {
      auto w = waiting("MPI_Comm_split", "split");
      check(MPI_Comm_split(comm_, color, key, &part), "MPI_Comm_split");
    }
    try {
      auto out = std::make_unique<MpiCommunicator>(chunk_count_, max_count_, part, call_->timeout_s());
      MPI_Comm_free(&part);
      return out;
    } catch (...) {
      MPI_Comm_free(&part);
      throw;
    }
  }

  // Nonblocking sends and receives of every chunk, then one wait: a send
  // and a receive between two ranks that exchange with each other at the
  // same time never wait for each other (MPI_Sendrecv's guarantee).
  void exchange(const void* send_buf, int64_t send_count, int to, void* recv_buf, int64_t recv_count, int from,
                DType dtype) override {
    detail::check_exchange(rank_, size_, to, send_count, from, recv_count);
    const size_t elem = dtype_bytes(dtype);
    std::vector<MPI_Request> reqs;
    auto post = [&](bool sending, int64_t count, int peer, char* p) {
      for (int64_t off = 0; off < count; off += chunk_count_) {
        const int n = static_cast<int>(std::min(chunk_count_, count - off));
        MPI_Request r = MPI_REQUEST_NULL;
        char* at = p + static_cast<size_t>(off) * elem;
        const int rc = sending ? MPI_Isend(at, n, type(dtype), peer, kP2pTag, comm_, &r)
                               : MPI_Irecv(at, n, type(dtype), peer, kP2pTag, comm_, &r);
        if (rc != MPI_SUCCESS) {
          for (MPI_Request& q : reqs) MPI_Cancel(&q);
          throw mpi_error(sending ? "MPI_Isend" : "MPI_Irecv", rc);
        }
        reqs.push_back(r);
      }
    };
    if (from != -1) post(false, recv_count, from, static_cast<char*>(recv_buf));
    if (to != -1) post(true, send_count, to, static_cast<char*>(const_cast<void*>(send_buf)));
    if (reqs.empty()) return;
    auto w = waiting("MPI_Waitall", to != -1 && from != -1 ? "exchange" : to != -1 ? "send" : "recv",
                     std::max(send_count, recv_count), dtype);
    check(MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), "MPI_Waitall", "exchange",
          std::max(send_count, recv_count), dtype);
  }

  [[noreturn]] void abort(int code, const std::string& msg) override {
    std::fprintf(stderr, "zinc: [rank %d] fatal: %s\n", rank_, msg.c_str());
    std::fflush(stderr);
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);  // MPI_Abort does not return; if it ever does, still end this rank
  }

 private:
  void reduce_f64(double* buf, int64_t count, MPI_Op op, const char* what) {
    detail::check_count(rank_, what, count);
    for (int64_t off = 0; off < count; off += chunk_count_) {
      const int n = static_cast<int>(std::min(chunk_count_, count - off));
      auto w = waiting("MPI_Allreduce", what);  // the name says f64; no dtype_name for it
      const int rc = MPI_Allreduce(MPI_IN_PLACE, buf + off, n, MPI_DOUBLE, op, comm_);
      if (rc != MPI_SUCCESS) throw mpi_error(std::string("MPI_Allreduce (") + what + " of " +
                                                 std::to_string(count) + " f64)", rc);
    }
  }

  // reduce_scatter, all_gather and all_to_all are not split: their blocks interleave in
  // the full buffer, and MPI's predefined sum does not take the derived
  // datatypes that a split would need. Both the per-rank count and the full
  // buffer stay within one int, since MPI implementations index the full
  // buffer with it.
  void check_limit(const char* op, int64_t count, const char* bucket_key) const {
    if (count <= max_count_ / size_) return;
    throw comm_error(rank_, op,
                     std::to_string(count) + " elements per rank x " + std::to_string(size_) +
                         " ranks exceed the limit of " + std::to_string(max_count_) +
                         " elements per MPI call (an int count); use smaller buckets (" + bucket_key + ")");
  }

  static constexpr int kP2pTag = 7;
  MPI_Datatype MPI_BYTE_TYPE(DType dtype) const { return type(dtype); }
  // bf16 and fp16 travel as the same 16-bit type; only their sums differ.
  MPI_Datatype type(DType dtype) const { return dtype == DType::kF32 ? MPI_FLOAT : bf16_type_; }
  MPI_Op sum(DType dtype) const {
    return dtype == DType::kF32 ? MPI_SUM : dtype == DType::kF16 ? f16_sum_ : bf16_sum_;
  }

  MpiCall::Scope waiting(const char* fn, const char* what, int64_t count = -1, DType dtype = DType::kF32) {
    return MpiCall::Scope(*call_, fn, what, count, dtype);
  }

  // The one place MPI return codes are checked.
  static void check(int rc, const char* mpi_fn) {
    if (rc != MPI_SUCCESS) throw mpi_error(mpi_fn, rc);
  }
  static void check(int rc, const char* mpi_fn, const char* what, int64_t count, DType dtype) {
    if (rc == MPI_SUCCESS) return;
    throw mpi_error(std::string(mpi_fn) + " (" + what + " of " + std::to_string(count) + " " +
                        std::string(dtype_name(dtype)) + ")",
                    rc);
  }

  void free_handles() {
    if (bf16_sum_ != MPI_OP_NULL) MPI_Op_free(&bf16_sum_);
    if (f16_sum_ != MPI_OP_NULL) MPI_Op_free(&f16_sum_);
    if (bf16_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&bf16_type_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  friend const void* detail::mpi_comm_of(const Communicator&);
  const int64_t chunk_count_;  // all_reduce/broadcast/f64: elements per MPI call
  const int64_t max_count_;    // reduce_scatter/all_gather: limit on size * count
  std::unique_ptr<MpiCall> call_;  // what this communicator waits in (Note [MPI collectives: the time limit])
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Datatype bf16_type_ = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL;
  MPI_Op f16_sum_ = MPI_OP_NULL;
  int rank_ = 0, size_ = 1, local_size_ = 1, local_rank_ = 0;
};

}  // namespace

namespace detail {

const void* mpi_comm_of(const Communicator& mpi) {
  const auto* m = dynamic_cast<const MpiCommunicator*>(&mpi);
  ZINC_CHECK(m != nullptr, "mpi_comm_of: not an MPI communicator");
  return &m->comm_;
}

MpiWait::MpiWait(Communicator& mpi, const char* fn, const char* what, int64_t count, DType dtype) {
  auto* m = dynamic_cast<MpiCommunicator*>(&mpi);
  ZINC_CHECK(m != nullptr, "MpiWait: not an MPI communicator");
  MpiCall& c = m->call();
  c.begin(fn, what, count, dtype);
  call_ = &c;
}

MpiWait::~MpiWait() { static_cast<MpiCall*>(call_)->end(); }

void set_mpi_timeout(Communicator& mpi, double seconds) {
  auto* m = dynamic_cast<MpiCommunicator*>(&mpi);
  ZINC_CHECK(m != nullptr, "set_mpi_timeout: not an MPI communicator");
  m->set_timeout(seconds);
}

std::unique_ptr<Communicator> make_mpi_communicator(int64_t max_count) {
  ZINC_CHECK(max_count >= 1 && max_count <= kMpiMaxCount, "max_count out of range");
  return std::make_unique<MpiCommunicator>(max_count, max_count);
}

}  // namespace detail

std::unique_ptr<Communicator> make_mpi_communicator() {
  return std::make_unique<MpiCommunicator>(detail::kMpiChunkCount, detail::kMpiMaxCount);
}

bool launched_with_mpi() {
  // World-size variables of the common launchers: Open MPI's mpirun, PMI
  // (MPICH hydra, Intel MPI, Slurm's srun --mpi=pmi2), MVAPICH.
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}) {
    const char* v = std::getenv(var);
    if (v && *v) return std::atoi(v) > 1;
  }
  // PMIx launchers (srun --mpi=pmix, prterun) publish the rank but not the
  // size: a rank above 0 proves a multi-rank job; rank 0 cannot tell.
  for (const char* var : {"PMIX_RANK", "PMI_RANK"}) {
    const char* v = std::getenv(var);
    if (v && *v && std::atoi(v) > 0) return true;
  }
  return false;
}

}  // namespace zinc::comm
