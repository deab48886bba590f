// NCCL backend of Communicator (built when ZINC_WITH_NCCL; otherwise
// nccl_unavailable.cpp defines the same functions, which refuse).
//
// Ownership: an NcclCommunicator owns its ncclComm_t, one non-blocking CUDA
// stream, one completion event, a small device scratch and a small pinned
// host scratch (the f64 reductions and barrier), and, when made by
// make_communicator("nccl"), the MPI communicator it bootstrapped over. It
// refers to the bootstrap communicator for abort() only, so the bootstrap
// must outlive it (Note [NCCL bootstrap]).
//
// Synchrony: every collective is enqueued on the communicator's own stream,
// an event is recorded after it, and the call returns only when the event
// has completed (Note [NCCL completion]). The interface therefore stays as
// synchronous as the host backends': CommStream and CommHandle work
// unchanged over device buffers, the CommStream's thread blocks while the
// caller's compute stream runs on. Inputs: the caller orders them before
// the call (wait_cuda_event, comm.h).
//
// Threads: one thread at a time per communicator, like every backend. The
// CUDA device is per thread, so every call sets this communicator's device
// for its duration and restores the caller's (DeviceGuard).
//
// Errors: argument errors are the shared checks of comm_internal.h ("rank R:
// op: ..."), identical on every backend; a failing NCCL or CUDA call throws
// CommError("[rank R] nccl <op>: <what failed>").
//
// Note [NCCL 16-bit sums]
// NCCL sums fp16 and bf16 in the buffer's own format, one rounding per
// pairwise combination: its FuncSum specialisations use __hadd/__hadd2 for
// half (sm_53 and later) and for __nv_bfloat16 (sm_80 and later), and
// convert through float and back on older GPUs (src/device/reduce_kernel.h
// in NVIDIA/nccl). A correctly rounded 16-bit add gives the same bits as
// zinc's MPI backend's "add in fp32, round once" (fp32 has at least 2p+2
// significand bits for both formats, so the double rounding is harmless);
// per combination the two backends agree. What differs is the grouping:
// MPI's order is Open MPI's, NCCL's depends on the algorithm it picks for the
// size and topology (ring: a running sum that takes one rank at a time; tree:
// partial sums of equal weight, NVIDIA/nccl issue #1026), and on Hopper with
// NVLink SHARP (NVLS) the switch reduces with multimem.ld_reduce
// .acc::f32, summing every rank in fp32 and rounding once. Sums that are not
// exact in the 16-bit format can therefore differ in the last bits between
// the backends, and between NCCL algorithms; every rank still receives the
// same result (NCCL broadcasts the finished sum), and the same algorithm
// repeats the same bits. fp32 sums differ only by grouping, as between any
// two MPI implementations.
//
// Note [NCCL point to point]
// send, recv and exchange (the pipeline's activations and their gradients
// between stages), all_to_all and all_to_all_v (sequence and expert ranks)
// are ncclSend and ncclRecv calls in one group (ncclGroupStart/End): NCCL
// starts a group's transfers together, so two ranks that send to each other
// in one call never wait on each other, and a rank's send to itself is a
// copy on the GPU. NCCL pairs a send with the peer's receive in the order
// each was called, as MPI pairs messages of one tag. Completed before the
// call returns, like the collectives (Note [NCCL completion]). split makes a
// communicator of the ranks with one colour with ncclCommSplit, and splits
// the host bootstrap alike for the new communicator's ranks, sizes and
// abort.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "core/device.h"
#include "core/dynlib.h"
#include "core/log.h"

namespace zinc::comm {
namespace {

// NCCL's functions, from libnccl.so.<NCCL_MAJOR> (libnccl.so.2) opened on
// first use (core/dynlib.h: linking it would load it into every zinc
// process, and into PyTorch's).
#define ZINC_NCCL_STR_(x) #x
#define ZINC_NCCL_STR(x) ZINC_NCCL_STR_(x)
struct NcclApi {
  DynLib lib;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetLastError) GetLastError;
  decltype(&::ncclCommInitRank) CommInitRank;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclCommSplit) CommSplit;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclCommFinalize) CommFinalize;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;

  NcclApi()
      : lib(DynLib::open({"libnccl.so." ZINC_NCCL_STR(NCCL_MAJOR), ZINC_CUDA_LIB_DIR "/libnccl.so." ZINC_NCCL_STR(NCCL_MAJOR)},
                         "NCCL (the nccl backend)")) {
    GetErrorString = lib.get<decltype(&::ncclGetErrorString)>("ncclGetErrorString");
    GetLastError = lib.get<decltype(&::ncclGetLastError)>("ncclGetLastError");
    CommInitRank = lib.get<decltype(&::ncclCommInitRank)>("ncclCommInitRank");
    CommAbort = lib.get<decltype(&::ncclCommAbort)>("ncclCommAbort");
    AllReduce = lib.get<decltype(&::ncclAllReduce)>("ncclAllReduce");
    ReduceScatter = lib.get<decltype(&::ncclReduceScatter)>("ncclReduceScatter");
    AllGather = lib.get<decltype(&::ncclAllGather)>("ncclAllGather");
    Broadcast = lib.get<decltype(&::ncclBroadcast)>("ncclBroadcast");
    CommSplit = lib.get<decltype(&::ncclCommSplit)>("ncclCommSplit");
    CommGetAsyncError = lib.get<decltype(&::ncclCommGetAsyncError)>("ncclCommGetAsyncError");
    CommFinalize = lib.get<decltype(&::ncclCommFinalize)>("ncclCommFinalize");
    CommDestroy = lib.get<decltype(&::ncclCommDestroy)>("ncclCommDestroy");
    GetUniqueId = lib.get<decltype(&::ncclGetUniqueId)>("ncclGetUniqueId");
    GetVersion = lib.get<decltype(&::ncclGetVersion)>("ncclGetVersion");
    Send = lib.get<decltype(&::ncclSend)>("ncclSend");
    Recv = lib.get<decltype(&::ncclRecv)>("ncclRecv");
    GroupStart = lib.get<decltype(&::ncclGroupStart)>("ncclGroupStart");
    GroupEnd = lib.get<decltype(&::ncclGroupEnd)>("ncclGroupEnd");
  }
};
const NcclApi& nccl() {
  static const NcclApi api;
  return api;
}


using detail::nccl_backend_error;

// "[rank R] nccl op: text".
CommError nccl_failure(int rank, const std::string& op, const std::string& text) {
  return CommError("[rank " + std::to_string(rank) + "] nccl " + op + ": " + text);
}

std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  std::string s = nccl().GetErrorString(r);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  const char* last = nccl().GetLastError(comm);
  if (last && *last) s += std::string(" ") + last;
#endif
  return s;
}

std::string cuda_text(const char* fn, cudaError_t e) {
  return std::string(fn) + " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
}

// Sets `device` as the calling thread's current device for the scope and
// restores the previous one (CUDA keeps the current device per thread, and
// a communicator may be driven by a thread that computes on another GPU).
class DeviceGuard {
 public:
  DeviceGuard(int rank, int device, const std::string& op) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      (void)cudaGetLastError();
      prev_ = -1;
    }
    if (prev_ != device_) {
      const cudaError_t e = cudaSetDevice(device_);
      if (e != cudaSuccess) throw nccl_failure(rank, op, cuda_text("cudaSetDevice", e));
    }
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int prev_ = -1;
};

std::string describe(const char* what, int64_t count, DType dtype) {
  return std::string(what) + " of " + std::to_string(count) + " " + std::string(dtype_name(dtype));
}

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (may be null: init() makes it) and creates the
  // stream, the event and the scratch buffers on `device`.
  NcclCommunicator(Communicator& bootstrap, int device, ncclComm_t comm)
      : bootstrap_(bootstrap),
        timeout_s_(bootstrap.timeout_seconds()),
        rank_(bootstrap.rank()),
        size_(bootstrap.size()),
        local_size_(bootstrap.local_size()),
        local_rank_(bootstrap.local_rank()),
        device_(device),
        comm_(comm) {
    try {
      DeviceGuard g(rank_, device_, "backend");
      cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "backend", "cudaStreamCreateWithFlags");
      cuda_check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "backend", "cudaEventCreateWithFlags");
      reserve_scratch(64, "backend");
    } catch (...) {
      release(/*abort_comm=*/true);
      throw;
    }
  }

  // A communicator whose NCCL or CUDA call failed is aborted, not finalised:
  // a finalize waits for peers that may never arrive. So is every other one
  // of the process once one failed (its duplicate, its splits): their peers
  // are likely the same.
  ~NcclCommunicator() override { release(/*abort_comm=*/broken_ || any_failed().load()); }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // ncclCommInitRank with the id every rank received (collective in NCCL).
  void init(const ncclUniqueId& id) {
    DeviceGuard g(rank_, device_, "backend");
    const ncclResult_t r = nccl().CommInitRank(&comm_, size_, id, rank_);
    if (r != ncclSuccess) {
      const std::string text = nccl_text(r, comm_);
      if (comm_) nccl().CommAbort(comm_);
      comm_ = nullptr;
      throw nccl_failure(rank_, "backend", "ncclCommInitRank failed: " + text);
    }
  }

  // make_communicator("nccl"): keep the bootstrap MPI communicator (which
  // `bootstrap_` refers to) for as long as this one lives.
  void adopt_bootstrap(std::unique_ptr<Communicator> owned) { owned_bootstrap_ = std::move(owned); }

  int device() const { return device_; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  int local_size() const override { return local_size_; }
  int local_rank() const override { return local_rank_; }
  double timeout_seconds() const override { return timeout_s_; }

  void all_reduce(const void* send, void* recv, int64_t count, DType dtype) override {
    detail::check_all_reduce(rank_, send, recv, count, dtype);
    collective("all_reduce", count, dtype, "ncclAllReduce", [&](ncclDataType_t t) {
      return nccl().AllReduce(send, recv, static_cast<size_t>(count), t, ncclSum, comm_, stream_);
    });
  }

  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype) override {
    detail::check_reduce_scatter(rank_, size_, send, recv, recv_count, dtype);
    collective("reduce_scatter", recv_count, dtype, "ncclReduceScatter", [&](ncclDataType_t t) {
      return nccl().ReduceScatter(send, recv, static_cast<size_t>(recv_count), t, ncclSum, comm_, stream_);
    });
  }

  // In place when send == recv + rank * send_count, which NCCL recognises
  // by the same rule (its in-place all-gather), so send passes unchanged.
  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype) override {
    detail::check_all_gather(rank_, size_, send, recv, send_count, dtype);
    collective("all_gather", send_count, dtype, "ncclAllGather", [&](ncclDataType_t t) {
      return nccl().AllGather(send, recv, static_cast<size_t>(send_count), t, comm_, stream_);
    });
  }

  // Note [NCCL point to point]: every block in one group.
  void all_to_all(const void* send, void* recv, int64_t count_per_rank, DType dtype) override {
    detail::check_all_to_all(rank_, size_, send, recv, count_per_rank, dtype);
    const ncclDataType_t type = nccl_type(dtype, "all_to_all");
    if (count_per_rank == 0) return;
    const std::string op = describe("all_to_all", count_per_rank, dtype);
    const size_t block = static_cast<size_t>(count_per_rank) * dtype_bytes(dtype);
    DeviceGuard g(rank_, device_, op);
    grouped(op, [&] {
      for (int r = 0; r < size_; ++r) {
        nccl_check(nccl().Send(static_cast<const char*>(send) + r * block, static_cast<size_t>(count_per_rank), type, r,
                               comm_, stream_),
                   op, "ncclSend");
        nccl_check(nccl().Recv(static_cast<char*>(recv) + r * block, static_cast<size_t>(count_per_rank), type, r,
                               comm_, stream_),
                   op, "ncclRecv");
      }
    });
    complete(op);
  }

  // The host backends' checks (comm_select.cpp), then every pair's blocks
  // in one group.
  void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                    DType dtype) override {
    const size_t elem = dtype_bytes(dtype);
    std::vector<int64_t> at_send, at_recv;
    detail::check_all_to_all_v(rank_, size_, send, send_counts, recv, recv_counts, dtype, at_send, at_recv);
    const int64_t sent = at_send.back(), received = at_recv.back();
    const ncclDataType_t type = nccl_type(dtype, "all_to_all_v");
    if (sent == 0 && received == 0) return;
    const std::string op = describe("all_to_all_v", std::max(sent, received), dtype);
    DeviceGuard g(rank_, device_, op);
    grouped(op, [&] {
      for (int r = 0; r < size_; ++r) {
        const size_t ri = static_cast<size_t>(r);
        if (send_counts[r] > 0)
          nccl_check(nccl().Send(static_cast<const char*>(send) + static_cast<size_t>(at_send[ri]) * elem,
                                 static_cast<size_t>(send_counts[r]), type, r, comm_, stream_),
                     op, "ncclSend");
        if (recv_counts[r] > 0)
          nccl_check(nccl().Recv(static_cast<char*>(recv) + static_cast<size_t>(at_recv[ri]) * elem,
                                 static_cast<size_t>(recv_counts[r]), type, r, comm_, stream_),
                     op, "ncclRecv");
      }
    });
    complete(op);
  }

  // Note [NCCL point to point].
  void send(const void* buf, int64_t count, DType dtype, int peer) override {
    exchange(buf, count, peer, nullptr, 0, -1, dtype);
  }
  void recv(void* buf, int64_t count, DType dtype, int peer) override {
    exchange(nullptr, 0, -1, buf, count, peer, dtype);
  }
  void exchange(const void* send_buf, int64_t send_count, int to, void* recv_buf, int64_t recv_count, int from,
                DType dtype) override {
    detail::check_exchange(rank_, size_, to, send_count, from, recv_count);
    const ncclDataType_t type = nccl_type(dtype, "exchange");
    const bool sending = to != -1 && send_count > 0, receiving = from != -1 && recv_count > 0;
    if (!sending && !receiving) return;
    const std::string op = describe(sending && receiving ? "exchange" : sending ? "send" : "recv",
                                    std::max(sending ? send_count : 0, receiving ? recv_count : 0), dtype);
    DeviceGuard g(rank_, device_, op);
    grouped(op, [&] {
      if (sending)
        nccl_check(nccl().Send(send_buf, static_cast<size_t>(send_count), type, to, comm_, stream_), op, "ncclSend");
      if (receiving)
        nccl_check(nccl().Recv(recv_buf, static_cast<size_t>(recv_count), type, from, comm_, stream_), op,
                   "ncclRecv");
    });
    complete(op);
  }

  // Note [NCCL point to point]: the bootstrap split first (its ranks are
  // this communicator's), then NCCL's.
  std::unique_ptr<Communicator> split(int color, int key) override {
    if (color < 0) throw detail::comm_error(rank_, "split", "color must be >= 0, got " + std::to_string(color));
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    std::unique_ptr<Communicator> host = bootstrap_.split(color, key);
    usable("split");
    DeviceGuard g(rank_, device_, "split");
    ncclComm_t child = nullptr;
    nccl_check(nccl().CommSplit(comm_, color, key, &child, /*config=*/nullptr), "split", "ncclCommSplit");
    auto out = std::make_unique<NcclCommunicator>(*host, device_, child);
    out->adopt_bootstrap(std::move(host));
    return out;
#else
    throw detail::comm_error(rank_, "split", "needs NCCL 2.18 or later (ncclCommSplit)");
#endif
  }

  void broadcast(void* buf, int64_t count, DType dtype, int root) override {
    detail::check_broadcast(rank_, size_, count, root);
    collective("broadcast", count, dtype, "ncclBroadcast", [&](ncclDataType_t t) {
      return nccl().Broadcast(buf, buf, static_cast<size_t>(count), t, root, comm_, stream_);
    });
  }

  void all_reduce_f64(double* buf, int64_t count) override { reduce_host_f64(buf, count, ncclSum, "all_reduce_f64"); }
  void all_reduce_max_f64(double* buf, int64_t count) override {
    reduce_host_f64(buf, count, ncclMax, "all_reduce_max_f64");
  }

  // The shared part of every collective: the dtype (refused before any
  // communication), nothing for a count of 0, this communicator's device,
  // the call (`call(type)` returns NCCL's result), its completion.
  template <class Call>
  void collective(const char* name, int64_t count, DType dtype, const char* fn, Call call) {
    const ncclDataType_t type = nccl_type(dtype, name);
    if (count == 0) return;
    const std::string op = describe(name, count, dtype);
    usable(op);
    DeviceGuard g(rank_, device_, op);
    nccl_check(call(type), op, fn);
    complete(op);
  }

  // A one-element all-reduce, completed: no rank leaves before every rank
  // has entered (NCCL has no barrier of its own before 2.29's device API).
  void barrier() override { meet("barrier"); }

  // ncclCommSplit with one colour keeps every rank in its order: a new
  // communicator of the same ranks and GPUs, independent of this one, with
  // its own stream. NCCL's thread-safety rules forbid calls on two
  // communicators of one GPU from two threads at once (NCCL kernels block
  // until their peers arrive, and two communicators' kernels need not run
  // side by side), so the duplicate must not be driven concurrently with
  // this one; the engine drives one NCCL communicator from one thread.
  // ncclCommSplit (blocking) waits for every rank with no time limit, so the
  // ranks first meet in a barrier of this communicator, which has one: a
  // rank that never comes (it failed before, or took another path) is
  // named at comm.timeout_seconds instead of waited for forever.
  std::unique_ptr<Communicator> duplicate() override {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    meet("duplicate");
    DeviceGuard g(rank_, device_, "duplicate");
    ncclComm_t child = nullptr;
    nccl_check(nccl().CommSplit(comm_, /*color=*/0, /*key=*/rank_, &child, /*config=*/nullptr), "duplicate",
               "ncclCommSplit");
    return std::make_unique<NcclCommunicator>(bootstrap_, device_, child);
#else
    return nullptr;  // no ncclCommSplit: the caller shares this communicator
#endif
  }

  // Stops this rank's NCCL work (a peer that died would otherwise leave it
  // waiting on the GPU), then ends the job through the bootstrap. Called
  // while a CommStream's thread polls this communicator, that thread may
  // see the freed communicator; the process is ending either way.
  [[noreturn]] void abort(int code, const std::string& msg) override {
    if (comm_) {
      nccl().CommAbort(comm_);
      comm_ = nullptr;
    }
    bootstrap_.abort(code, msg);
    std::_Exit(code);  // not reached: a backend's abort does not return
  }

  // wait_cuda_event: the stream waits on the GPU.
  void stream_wait(void* event) {
    DeviceGuard g(rank_, device_, "wait_cuda_event");
    cuda_check(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event), 0), "wait_cuda_event",
               "cudaStreamWaitEvent");
  }

 private:
  // Before any communication, so every rank (passing the same arguments)
  // refuses alike.
  ncclDataType_t nccl_type(DType dtype, const std::string& op) const {
    switch (dtype) {
      case DType::kF32: return ncclFloat32;
      case DType::kBF16: return ncclBfloat16;
      case DType::kF16: return ncclFloat16;
    }
    throw detail::comm_error(rank_, op, "unknown dtype " + std::to_string(static_cast<int>(dtype)));
  }

  // fn()'s NCCL calls as one group; the group is closed on every path.
  template <class Fn>
  void grouped(const std::string& op, Fn fn) {
    usable(op);
    nccl_check(nccl().GroupStart(), op, "ncclGroupStart");
    try {
      fn();
    } catch (...) {
      (void)nccl().GroupEnd();
      throw;
    }
    nccl_check(nccl().GroupEnd(), op, "ncclGroupEnd");
  }

  void nccl_check(ncclResult_t r, const std::string& op, const char* fn) const {
    if (r == ncclSuccess) return;
    broken_ = true;
    throw nccl_failure(rank_, op, std::string(fn) + " failed: " + nccl_text(r, comm_));
  }
  void cuda_check(cudaError_t e, const std::string& op, const char* fn) const {
    if (e == cudaSuccess) return;
    broken_ = true;
    throw nccl_failure(rank_, op, cuda_text(fn, e));
  }

  // Note [NCCL completion]
  // Records the event after the enqueued work and waits for it, polling so
  // that an asynchronous NCCL error (a peer that failed, a network error)
  // is reported instead of waiting forever: cudaEventSynchronize would wait
  // for kernels that never finish. The first 100 us yield, then each poll
  // sleeps 50 us, which costs a long collective at most that much latency.
  // A peer that died or took another path never joins: after
  // comm.timeout_seconds (this communicator's bootstrap's limit, which
  // ZINC_COMM_TIMEOUT overrides) the collective is given up, as the host
  // backends give theirs up.
  // Either way the communicator is aborted before the error is thrown
  // (Note [a failed NCCL collective]).
  void complete(const std::string& op) {
    cuda_check(cudaEventRecord(done_, stream_), op, "cudaEventRecord");
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda_check(e, op, "cudaEventQuery");
      ncclResult_t async = ncclSuccess;
      nccl_check(nccl().CommGetAsyncError(comm_, &async), op, "ncclCommGetAsyncError");
      if (async != ncclSuccess && async != ncclInProgress)
        fail_and_abort(op, std::string("asynchronous error: ") + nccl_text(async, comm_));
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (waited > timeout_s_) {
        char limit[32];
        std::snprintf(limit, sizeof(limit), "%g", timeout_s_);
        fail_and_abort(op, "no completion after " + std::string(limit) +
                               " s, past comm.timeout_seconds (ZINC_COMM_TIMEOUT overrides it): a rank has "
                               "stopped, or waits in another collective, or was given another config");
      }
      if (waited < 1e-4) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  // Note [a failed NCCL collective]
  // A collective that failed or timed out leaves its kernel on the GPU,
  // waiting for peers that will not come. Any later wait for the whole
  // device would then wait for it too, forever: cudaFree and
  // cudaDeviceSynchronize, which a teardown may run while the error unwinds
  // (before zinc-train's handler can end the job), and a Python script that
  // caught the error and saves what it can does run. So the
  // communicator is aborted here, at once (ncclCommAbort ends its kernels),
  // and every later call on it names the first failure. The kernel
  // emulation holds such a collective on its stream and ends the process
  // if a wait reaches it (ZINC_EMU_NCCL_STALL, tests/cuda_emu).
  [[noreturn]] void fail_and_abort(const std::string& op, const std::string& why) {
    broken_ = true;
    any_failed().store(true);
    failure_ = op + ": " + why;
    if (comm_) {
      nccl().CommAbort(comm_);
      comm_ = nullptr;
    }
    throw nccl_failure(rank_, op, why + " (the NCCL communicator was aborted)");
  }

  // Every rank's one-element all-reduce, completed (within the time limit):
  // no rank leaves before every rank has entered. `op` names the caller.
  void meet(const std::string& op) {
    usable(op);
    DeviceGuard g(rank_, device_, op);
    nccl_check(nccl().AllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_), op, "ncclAllReduce");
    complete(op);
  }

  // Whether a communicator of this process gave a collective up.
  static std::atomic<bool>& any_failed() {
    static std::atomic<bool> failed{false};
    return failed;
  }

  // Refuses a call on a communicator that fail_and_abort ended.
  void usable(const std::string& op) const {
    if (!comm_) {
      throw nccl_failure(rank_, op, "the NCCL communicator was aborted after an earlier failure (" +
                                        (failure_.empty() ? std::string("its set-up failed") : failure_) + ")");
    }
  }

  // Host doubles through the pinned and device scratch: copy in, reduce in
  // fp64 on the GPU, copy out, completed before returning.
  void reduce_host_f64(double* buf, int64_t count, ncclRedOp_t red, const char* what) {
    detail::check_count(rank_, what, count);
    if (count == 0) return;
    const std::string op = std::string(what) + " of " + std::to_string(count) + " f64";
    usable(op);
    const size_t bytes = static_cast<size_t>(count) * sizeof(double);
    DeviceGuard g(rank_, device_, op);
    reserve_scratch(bytes, op);
    std::memcpy(host_scratch_, buf, bytes);
    cuda_check(cudaMemcpyAsync(scratch_, host_scratch_, bytes, cudaMemcpyHostToDevice, stream_), op,
               "cudaMemcpyAsync host to device");
    nccl_check(nccl().AllReduce(scratch_, scratch_, static_cast<size_t>(count), ncclFloat64, red, comm_, stream_), op,
               "ncclAllReduce");
    cuda_check(cudaMemcpyAsync(host_scratch_, scratch_, bytes, cudaMemcpyDeviceToHost, stream_), op,
               "cudaMemcpyAsync device to host");
    complete(op);
    std::memcpy(buf, host_scratch_, bytes);
  }

  // Grows both scratch buffers to at least `bytes` (after finishing the
  // stream's work, which may still read them).
  void reserve_scratch(size_t bytes, const std::string& op) {
    if (bytes <= scratch_bytes_) return;
    if (stream_) cuda_check(cudaStreamSynchronize(stream_), op, "cudaStreamSynchronize");
    if (scratch_) cudaFree(scratch_);
    if (host_scratch_) cudaFreeHost(host_scratch_);
    scratch_ = nullptr;
    host_scratch_ = nullptr;
    scratch_bytes_ = 0;
    cuda_check(cudaMalloc(&scratch_, bytes), op, "cudaMalloc");
    cuda_check(cudaHostAlloc(&host_scratch_, bytes, cudaHostAllocDefault), op, "cudaHostAlloc");
    scratch_bytes_ = bytes;
  }

  // Frees everything this communicator holds. ncclCommFinalize flushes the
  // communicator's work and waits until the peers are quiescent, which is
  // why destruction is collective (comm.h); ncclCommAbort instead when the
  // construction failed half way (no peer waits for a finalize then).
  void release(bool abort_comm) noexcept {
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) (void)cudaGetLastError();
    cudaSetDevice(device_);
    if (comm_) {
      if (abort_comm) {
        nccl().CommAbort(comm_);
      } else {
        if (stream_) cudaStreamSynchronize(stream_);
        const ncclResult_t f = nccl().CommFinalize(comm_);
        const ncclResult_t d = nccl().CommDestroy(comm_);
        if (f != ncclSuccess || d != ncclSuccess) {
          log_warn("[rank " + std::to_string(rank_) +
                   "] nccl teardown: " + nccl_text(f != ncclSuccess ? f : d, nullptr));
        }
      }
      comm_ = nullptr;
    }
    if (done_) cudaEventDestroy(done_);
    if (stream_) cudaStreamDestroy(stream_);
    if (scratch_) cudaFree(scratch_);
    if (host_scratch_) cudaFreeHost(host_scratch_);
    done_ = nullptr;
    stream_ = nullptr;
    scratch_ = nullptr;
    host_scratch_ = nullptr;
    if (prev >= 0 && prev != device_) cudaSetDevice(prev);
  }

  // Note [NCCL bootstrap]
  // Declared first, so destroyed last: the MPI communicator that
  // make_communicator("nccl") made (null when the caller owns the bootstrap).
  std::unique_ptr<Communicator> owned_bootstrap_;
  Communicator& bootstrap_;
  // How long a collective may take before it is given up (complete()).
  const double timeout_s_;
  const int rank_, size_, local_size_, local_rank_, device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  void* scratch_ = nullptr;       // device
  void* host_scratch_ = nullptr;  // pinned host, same size
  size_t scratch_bytes_ = 0;
  mutable bool broken_ = false;  // an NCCL or CUDA call failed
  std::string failure_;          // what fail_and_abort ended the communicator for
};

// Picks this rank's GPU and builds the communicator's local parts (stream,
// event, scratch), and on rank 0 creates the unique id. Throws CommError
// naming the rank and the reason.
std::unique_ptr<NcclCommunicator> prepare(Communicator& bootstrap, int device, ncclUniqueId& id) {
  const int rank = bootstrap.rank();
  const CudaStatus& cuda = cuda_status();
  if (cuda.devices == 0) throw nccl_backend_error(rank, "no GPU visible (" + cuda.why + ")");
  const int local = bootstrap.local_size();
  int dev = device;
  if (device < 0) {
    if (cuda.devices < local) {
      throw nccl_backend_error(rank, std::to_string(local) + " ranks run on this machine but it has only " +
                                         std::to_string(cuda.devices) +
                                         " visible GPU(s); NCCL cannot put two ranks on one GPU (run at most " +
                                         std::to_string(cuda.devices) + " ranks per machine)");
    }
    dev = bootstrap.local_rank() % cuda.devices;
  } else if (device >= cuda.devices) {
    throw nccl_backend_error(rank, "device " + std::to_string(device) + " is not one of the " +
                                       std::to_string(cuda.devices) + " visible GPU(s)");
  }
  auto c = std::make_unique<NcclCommunicator>(bootstrap, dev, nullptr);
  if (rank == 0) {
    const ncclResult_t r = nccl().GetUniqueId(&id);
    if (r != ncclSuccess) {
      throw nccl_backend_error(rank, std::string("ncclGetUniqueId failed: ") + nccl_text(r, nullptr));
    }
  }
  return c;
}

// `owned`, when not null, is `bootstrap` itself; it passes to the result only
// once that is complete, so that `bootstrap` lives through every failure path.
std::unique_ptr<Communicator> make_nccl(Communicator& bootstrap, std::unique_ptr<Communicator> owned, int device) {
  const int rank = bootstrap.rank();
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  std::unique_ptr<NcclCommunicator> c;
  std::string why;
  try {
    c = prepare(bootstrap, device, id);
  } catch (const std::exception& e) {
    why = e.what();
  }
  // Every rank learns whether any rank failed before the broadcast and NCCL's
  // own (collective) initialisation, so a failure on one rank ends them all
  // with an error instead of leaving the others waiting.
  double failed = why.empty() ? 0.0 : 1.0;
  bootstrap.all_reduce_f64(&failed, 1);
  if (!why.empty()) throw CommError(why);
  if (failed > 0) {
    throw nccl_backend_error(rank, std::to_string(static_cast<int>(failed)) +
                                       " other rank(s) could not start NCCL (their errors name the reason)");
  }
  static_assert(sizeof(ncclUniqueId) % 2 == 0, "the id travels as 16-bit elements");
  // bf16 only as a 16-bit carrier: a broadcast does no arithmetic.
  bootstrap.broadcast(&id, static_cast<int64_t>(sizeof(id) / 2), DType::kBF16, 0);
  c->init(id);
  c->adopt_bootstrap(std::move(owned));
  if (rank == 0) {
    int v = 0;
    nccl().GetVersion(&v);
    log_info("nccl backend: NCCL " + std::to_string(v) + " over " + std::to_string(c->size()) +
             " rank(s); rank 0 on GPU " + std::to_string(c->device()));
  }
  return c;
}

}  // namespace

namespace detail {

CommError nccl_backend_error(int rank, const std::string& why) {
  return CommError("[rank " + std::to_string(rank) + "] nccl backend: " + why);
}

std::unique_ptr<Communicator> make_nccl_backend(std::unique_ptr<Communicator> bootstrap, int device) {
  Communicator& b = *bootstrap;
  return make_nccl(b, std::move(bootstrap), device);
}

}  // namespace detail

std::string nccl_library() {
  int v = 0;
  nccl().GetVersion(&v);
  return nccl().lib.name() + " (NCCL " + std::to_string(v) + ")";
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int device) {
  return make_nccl(bootstrap, nullptr, device);
}

void wait_cuda_event(Communicator& comm, void* cuda_event) {
  if (!cuda_event) return;
  if (auto* nccl = dynamic_cast<NcclCommunicator*>(&comm)) {
    nccl->stream_wait(cuda_event);
    return;
  }
  const cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(cuda_event));
  if (e != cudaSuccess) {
    throw detail::comm_error(comm.rank(), "wait_cuda_event", cuda_text("cudaEventSynchronize", e));
  }
}

}  // namespace zinc::comm
