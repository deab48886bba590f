// zinc comm: collectives between data-parallel ranks (public header of comm/).
//
// Communicator is the transport: MPI between processes (make_mpi_communicator),
// shared memory between the ranks of one machine, hierarchical (shared memory
// inside machines, MPI across), NCCL between GPUs (make_nccl_communicator;
// its buffers are device pointers), or a world of one
// (make_single_communicator); make_communicator picks one. The interface
// names no MPI, CUDA or NCCL type. Buffers are fp32, bf16 or fp16 (16-bit
// sums are formed in fp32 and rounded to the buffer's format once per
// pairwise combination; NCCL rounds the same way per combination but groups
// the ranks by its own algorithm, see nccl_communicator.cpp). For a given
// world size and backend every collective combines ranks in a fixed order,
// so results are deterministic run to run.
//
// Failures throw zinc::CommError naming the rank and the operation. abort()
// brings the whole job down (every rank exits) after printing its message:
// a rank that fails must call it rather than leave the others waiting.
//
// Threading: a Communicator is used by one thread at a time. CommStream owns
// one background thread that runs submitted work in order; while a stream
// exists, only the stream's thread may use its communicator (submit the work
// instead of calling the communicator directly). Two streams that must not
// wait for each other run over a communicator and its twin().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/dtype.h"

namespace zinc::comm {

// The default of comm.timeout_seconds (make_communicator).
inline constexpr double kCommTimeoutSeconds = 600;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  // Ranks that share this machine with this rank (including itself).
  virtual int local_size() const = 0;
  // This rank's index among them, in [0, local_size()) (MPI's shared-memory
  // split: right however the launcher places ranks). Picks its GPU.
  virtual int local_rank() const = 0;
  // The longest this communicator waits for a peer (comm.timeout_seconds,
  // make_communicator). The NCCL backend takes its bootstrap's.
  virtual double timeout_seconds() const { return kCommTimeoutSeconds; }

  // recv[i] = sum over ranks of send[i], i < count. send == recv is in place.
  virtual void all_reduce(const void* send, void* recv, int64_t count, DType dtype) = 0;
  // Sum over ranks of send (size() * recv_count elements); this rank receives
  // block rank() of the sum (recv_count elements). send != recv.
  virtual void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype) = 0;
  // recv (size() * send_count elements) = the ranks' send blocks in rank
  // order. send may point at this rank's block inside recv (in place).
  virtual void all_gather(const void* send, void* recv, int64_t send_count, DType dtype) = 0;
  // send holds size() blocks of count_per_rank elements; block j goes to rank
  // j. recv (size() * count_per_rank elements) = block rank() of every
  // rank's send, in rank order. No arithmetic: the dtype only sizes the
  // elements (the 1-bit all-reduce, comm/onebit.h, sends packed bits as f32
  // words). send and recv must not overlap. NCCL: one group of ncclSend and ncclRecv.
  virtual void all_to_all(const void* send, void* recv, int64_t count_per_rank, DType dtype) = 0;
  // The same with a count per pair: block j of send (send_counts[j]
  // elements, the blocks one after the other in rank order) goes to rank j,
  // and recv gets recv_counts[i] elements from rank i, in rank order. Each
  // pair's counts must agree (what i sends to j is what j expects from i;
  // callers exchange them first with all_to_all). Runs as size() - 1 rounds
  // of exchange (round d: to rank + d, from rank - d), so it needs point to
  // point: the MPI and shm backends run it so, NCCL as one group of
  // ncclSend and ncclRecv (Note [NCCL point to point] in nccl_communicator.cpp).
  // Not in place. The expert exchange of a mixture-of-experts layer uses it
  // (Note [expert parallelism] in engine/expert_parallel.cpp).
  virtual void all_to_all_v(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                            DType dtype);
  virtual void broadcast(void* buf, int64_t count, DType dtype, int root) = 0;
  // In-place sum of doubles (norms, losses, counters).
  virtual void all_reduce_f64(double* buf, int64_t count) = 0;
  // In-place maximum of doubles (peak memory, timings).
  virtual void all_reduce_max_f64(double* buf, int64_t count) = 0;
  virtual void barrier() = 0;
  // Prints "zinc: [rank r] fatal: msg" and ends every rank of the job with `code`.
  [[noreturn]] virtual void abort(int code, const std::string& msg) = 0;
  // A new communicator over the same ranks, with the same backend, whose
  // collectives are independent of this one's: two threads may each drive
  // one of them at the same time, and each keeps its own order. Collective:
  // every rank calls it at the same point, and destroys the result at the
  // same point (the shm backend's teardown synchronises the ranks). Returns
  // null when the transport cannot run two communicators at once (MPI
  // initialised below MPI_THREAD_MULTIPLE); the caller then shares this one.
  virtual std::unique_ptr<Communicator> duplicate() = 0;

  // A communicator over the ranks of this one that pass the same `color`,
  // ranked by `key` (ties by this communicator's rank), with the same
  // backend: MPI_Comm_split. Collective over every rank of this one. The
  // engine makes its pipeline and data-parallel groups with it (Note
  // [pipeline parallelism] in engine/pipeline.cpp). NCCL splits with
  // ncclCommSplit (2.18 and later; earlier, CommError naming the rank).
  virtual std::unique_ptr<Communicator> split(int color, int key);

  // Point to point (the pipeline's activations and their gradients): send
  // blocks until `peer` may take the buffer back, recv until the data has
  // arrived. Messages between two ranks arrive in the order they were sent.
  // exchange sends to `to` and receives from `from` at once (either may be
  // -1: none), so two neighbours that send to each other never wait for
  // each other. No arithmetic: the dtype sizes the elements. NCCL: ncclSend
  // and ncclRecv in one group; a world of one has no peer (CommError).
  virtual void send(const void* buf, int64_t count, DType dtype, int peer);
  virtual void recv(void* buf, int64_t count, DType dtype, int peer);
  virtual void exchange(const void* send_buf, int64_t send_count, int to, void* recv_buf, int64_t recv_count,
                        int from, DType dtype);

  // This communicator's own duplicate, made by the first call (collective,
  // like duplicate()) and kept until this communicator goes. The engine
  // runs parameter gathers on it and gradient reductions on this one, two
  // streams that never wait for each other. Owned here rather than by the
  // engine so that an engine torn down by an exception on one rank never
  // waits in a teardown for ranks that are elsewhere (they are ended by
  // abort()). Null where duplicate() is.
  Communicator* twin();

 private:
  std::unique_ptr<Communicator> twin_;
  bool twin_made_ = false;
};

// Initialises MPI (thread level: at least serialized) unless the process has
// done so already, and finalises it when the last MPI communicator is
// destroyed if it initialised it. Errors become CommError.
std::unique_ptr<Communicator> make_mpi_communicator();
// A world of one rank: collectives copy; no MPI.
std::unique_ptr<Communicator> make_single_communicator();

// The NCCL backend over the ranks of `bootstrap` (an MPI communicator, or any
// host backend over the same ranks). Collective over bootstrap's ranks: rank
// 0 creates NCCL's unique id and broadcasts it over `bootstrap`, which must
// outlive the result (its abort() ends the job; make_communicator("nccl")
// keeps its own MPI communicator inside the result instead).
//
// device: the GPU of this rank; -1 picks (rank % local_size) % GPUs, and
// refuses (CommError naming the rank) when the machine has fewer GPUs than
// ranks: NCCL cannot put two ranks on one GPU. Without CUDA or NCCL in the
// build, or without a visible GPU (zinc::cuda_status()), it throws CommError
// "[rank r] nccl backend: <why>"; every rank learns of a failure on any rank
// before NCCL starts, so none is left waiting.
//
// Buffers of the collectives are DEVICE pointers of that GPU; the f64
// reductions take HOST doubles (norms, losses). Each communicator owns one
// CUDA stream; a collective is enqueued on it and the call returns when it
// has completed on the GPU, so the interface stays synchronous and a
// CommStream over this communicator blocks its own thread, never the
// caller's compute stream. The caller must make the input complete before
// the call: work submitted to a CommStream first calls wait_cuda_event()
// with an event the compute stream recorded after producing the data.
// Output is complete (and visible to any stream) when the call returns.
// duplicate() is ncclCommSplit (NCCL >= 2.18; null before), with a stream
// of its own. Destruction is collective, like the shm backend's: every rank
// destroys its NCCL communicators at the same point.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, int device = -1);
// Opens libnccl (on first use; it is never linked, see core/dynlib.h) and
// returns the file it loaded and NCCL's version, e.g. "libnccl.so.2 (NCCL
// 22703)". Throws zinc::Error naming what it tried where it cannot, and
// CommError in a build without NCCL. Needs no GPU.
std::string nccl_library();

// Orders the next collectives of `comm` after `cuda_event` (a cudaEvent_t,
// passed as void* so that this header names no CUDA type) recorded on a
// producer stream. NCCL backend: the communicator's stream waits for the
// event on the GPU (cudaStreamWaitEvent; the host does not block). Other
// backends (host buffers): the calling thread waits until the event has
// completed. Null event: nothing to wait for. Errors: CommError naming the
// rank; without CUDA in the build a non-null event is an error.
void wait_cuda_event(Communicator& comm, void* cuda_event);

// The backend for this job. mode: "mpi" (make_mpi_communicator), "shm"
// (shared memory between the ranks of one machine; CommError when the ranks
// span several machines), "hierarchical" (shm inside each machine, MPI
// between machines; needs the same number of ranks on every machine,
// numbered consecutively), "nccl" (make_nccl_communicator over an MPI
// bootstrap kept inside it; GPU buffers) or "auto" (one rank: mpi; several
// ranks on one machine: shm; several machines: hierarchical; never nccl,
// whose buffers live elsewhere). The environment variable
// ZINC_COMM_BACKEND, when set, overrides mode; ZINC_COMM_FAKE_NODE_SIZE=k
// (tests) treats each k consecutive ranks as one machine. backend() names
// the choice. The shm backend sums bf16 in fp32 over the ranks of a machine
// and rounds once (see shm_communicator.cpp). timeout_seconds: the longest a
// shm collective waits for a peer before it throws CommError naming the peer;
// an MPI call (the mpi backend, and the MPI steps of the others) that waits
// longer ends the job with one line naming the call (ZINC_COMM_TIMEOUT
// overrides it; Note [MPI collectives: the time limit]).
std::unique_ptr<Communicator> make_communicator(const std::string& mode,
                                                double timeout_seconds = kCommTimeoutSeconds);
// True when the process runs under an MPI launcher (mpirun/srun set
// OMPI_COMM_WORLD_SIZE, PMI_SIZE, ...) with more than one rank.
bool launched_with_mpi();

// A waitable result of CommStream::submit. Keeps the work's state alive;
// wait() blocks until the work ran and rethrows its exception if it threw.
class CommHandle {
 public:
  CommHandle() = default;
  void wait();
  bool done() const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class CommStream;
  struct State;
  std::shared_ptr<State> state_;
  class CommStream* stream_ = nullptr;
};

// An ordered background queue of collectives. Work runs on one thread in
// submission order; every rank must submit the same collectives in the same
// order. The stream records how long callers spent blocked in wait() and
// synchronize() (exposed communication time).
class CommStream {
 public:
  explicit CommStream(Communicator& comm);
  ~CommStream();  // drains the queue, then joins
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  CommHandle submit(std::function<void(Communicator&)> work);
  // Waits for everything submitted so far; rethrows the first error.
  void synchronize();
  Communicator& comm() { return comm_; }

  // Seconds callers spent blocked waiting on this stream, and seconds the
  // stream's thread spent running work, since construction or reset.
  double wait_seconds() const;
  double busy_seconds() const;
  void reset_counters();

 private:
  friend class CommHandle;
  void run();
  Communicator& comm_;
  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::deque<std::pair<std::function<void(Communicator&)>, std::shared_ptr<CommHandle::State>>> queue_;
  // Work that threw and whose error neither wait() nor synchronize() has reported yet.
  std::deque<std::shared_ptr<CommHandle::State>> failed_;
  bool stop_ = false;
  double wait_s_ = 0, busy_s_ = 0;
  std::thread thread_;
};

}  // namespace zinc::comm
