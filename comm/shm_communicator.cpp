// Shared-memory backend of Communicator for the ranks of one machine, and
// its hierarchical variant for several machines (shm inside each, MPI
// between them; Note [shm collectives: hierarchical layout]). Its arithmetic
// is in shm_reduce.cpp; make_communicator (backend selection) in
// comm_select.cpp.
//
// Ownership: a ShmCommunicator owns an MPI communicator (make_mpi_communicator:
// it keeps MPI initialised and serves point-to-point transfers and abort, and
// across machines broadcast, the f64 reductions and barrier), a duplicate of
// MPI_COMM_WORLD split into the node communicator, and one MPI shared-memory
// window on the node: per local rank a control line (its sequence flag, and
// whether it has left) and a slot of slot_bytes, split into two halves used by
// alternate chunks (Note [shm collectives: memory ordering]). The destructor
// frees the window and the communicators before the MPI communicator goes,
// once every rank of the node has left (Note [shm collectives: leaving]).
//
// Threads: like every Communicator, one thread at a time.
//
// Arithmetic (shm_reduce.h): every element of a reduction is summed in fp32
// in local rank order 0..L-1, ((x0 + x1) + x2) + ..., independent of
// chunking, so results are deterministic for a given world size. bf16 inputs are widened to fp32,
// summed in fp32 and rounded with zinc::float_to_bf16 once at the end (the MPI
// backend rounds after every pairwise combination instead, so bf16 results of
// the two backends may differ in the last bit).
#include <emmintrin.h>
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <climits>
#include <ctime>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/comm_internal.h"
#include "comm/shm_reduce.h"
#include "core/log.h"

namespace zinc::comm {
namespace {

using detail::comm_error;
using detail::copy_out;
using detail::kStreamMinBytes;
using detail::mpi_error;
using detail::reduce_sum;

void check(int rc, const char* mpi_fn) {
  if (rc != MPI_SUCCESS) throw mpi_error(mpi_fn, rc);
}

// Note [shm collectives: memory ordering]
// Each local rank q owns one 64-bit sequence flag (in its control line) and
// one slot; only q writes its flag, and only q writes its slot. All ranks run
// the same collectives in the same order, so they post the same sequence of
// flag values: post() increments the rank's counter and stores it with
// release order; wait_all(v) returns once every flag is >= v, read with
// acquire loads. The flags only grow, so a rank that runs ahead never
// confuses a waiter.
//
// No rank reads a slot before it is fully written: the owner writes the
// chunk into its slot with ordinary stores, then post()s (release). A reader
// waits until the owner's flag reaches that value (acquire); the acquire load
// that observes the value synchronises with the release store, so every
// ordinary store made before it (the whole chunk) is visible to the reads
// that follow. all_reduce has a second phase with the same pairing: a rank
// writes its reduced sub-block into its slot, posts, and the others wait
// before copying it.
//
// No rank overwrites a slot another rank still reads. The slot has two halves
// used by alternate chunks, and a chunk reads only its own half. Every rank
// makes the first post of chunk c (its data is in) after its last read of
// chunk c-1, so that post also says "done with the half of chunk c-1"; its
// value is recorded as free_at_[h] for that half h. Before writing into half
// h for chunk c+1, a rank waits until every flag has reached free_at_[h].
// (With two halves that wait is already implied: a rank reaches chunk c+1
// only after waiting for every rank's first post of chunk c. It costs L loads
// and keeps the invariant explicit.) So a chunk costs one post and one wait
// (two of each for all_reduce), and the copy of chunk c overlaps the
// reduction of chunk c-1 on slower ranks. free_at_ persists across calls, as
// the flags do.
//
// Outputs of large calls (kStreamMinBytes) are written with non-temporal
// stores, which x86 does not order with later stores; every call that
// streamed ends with an sfence, so the caller (and the thread it hands the
// buffer to) sees a finished output. Slots are never streamed: another rank
// reads them under the release/acquire pairing above.
//
// Waiting: spin briefly (the peer usually posts within microseconds). Then,
// if a thread of this process is blocked waiting for communication
// (detail::blocked_callers, kept by CommStream), this rank's core has nothing
// better to do: poll, yielding to any runnable thread. Waking from a futex
// costs 30-40 us on this VM's idle vCPUs, per wait, which polling avoids.
// Otherwise a compute thread shares the core: sleep on the futex word beside
// the owner's flag (its own cache line), so the compute thread runs. A
// sleeper first adds itself to the owner's sleeper count, then re-reads the
// word and sleeps only if it still holds the value it read; the owner stores
// the word and then reads the count, both sequentially consistent, and calls
// FUTEX_WAKE only when the count is non-zero. Of the pairs (sleeper:
// increment, read word) and (owner: write word, read count), at least one
// side sees the other's write, so either the sleeper does not sleep or the
// owner wakes it: no wake-up is lost, and a post costs no system call while
// nobody sleeps. A wait that lasts longer than the timeout (the peer died or
// stopped issuing collectives) throws CommError naming the peer.
//
// The flags are accessed with GCC __atomic builtins on aligned words of the
// shared mapping; they are lock-free and therefore address-free, so the
// orderings hold between processes (the C++ rule for lock-free atomics in
// shared memory). The window is kept in a passive epoch (MPI_Win_lock_all)
// for its lifetime, and the set-up uses MPI_Win_sync + MPI_Barrier, the MPI
// unified-model way to publish the zeroed flags before the first collective.

constexpr size_t kControlBytes = 4096;  // per rank: its flag, futex word and sleeper count

// Note [shm collectives: hierarchical layout]
// With M nodes of L ranks each, rank g = node * L + l (consecutive ranks per
// node; checked at set-up). The node communicator holds the L ranks of one
// node; the cross communicator holds the M ranks with the same local index l,
// ordered by node.
//
// reduce_scatter (rank g receives block g of n elements): inside the node,
// local rank l sums "super-block" l, whose piece p is block p * L + l of the
// buffer (the pieces are strided in send, so the shm code addresses them
// piece by piece instead of packing a copy); this leaves M pieces of n, piece
// p the node's sum of block p * L + l. An MPI reduce-scatter over the cross
// communicator then leaves rank (node, l) piece `node` summed over all nodes:
// block node * L + l = g of the total.
// all_gather is the inverse: MPI all-gather over the cross communicator
// (piece p = block of rank p * L + l), then the shm all-gather writes local
// rank q's piece p to block p * L + q.
// all_reduce: shm reduce-scatter of the first floor(count / L) * L elements
// into a shard of count / L, MPI all-reduce of the shard over the cross
// communicator, shm all-gather; the last count % L elements go through shm
// all-reduce and an MPI all-reduce.
// Summation order: each node's ranks in local order (fp32, bf16 rounded
// once), then the nodes in MPI's order (bf16 pairwise-rounded like the MPI
// backend). This is a different order from the flat shm path, so results
// agree with it only to rounding (exactly for M = 1 or L = 1, and for sums
// that are exact).

// bf16 (fp16) sum as an MPI operation for the cross-node step: like the MPI backend,
// each pairwise combination is formed in fp32 and rounded once.
void f16_pair_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const f16* a = static_cast<const f16*>(in);
  f16* b = static_cast<f16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_f16(f16_to_float(a[i]) + f16_to_float(b[i]));
}
void bf16_pair_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const bf16* a = static_cast<const bf16*>(in);
  bf16* b = static_cast<bf16*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

class ShmCommunicator final : public Communicator {
  // One thread at a time in the slots: a second thread's collective would
  // post and read this rank's sequence out of turn and corrupt both (the
  // f64 reductions, broadcast and barrier went to MPI before, where such a
  // call passed unseen). Caught and named instead.
  class OneThread {
   public:
    OneThread(ShmCommunicator& c, const char* op) : c_(c) {
      if (c_.busy_.exchange(true, std::memory_order_acquire))
        throw comm_error(c_.rank(), op,
                         "another thread of this rank is inside a collective of the same communicator (a "
                         "Communicator serves one thread at a time; give each thread its own, e.g. twin())");
      c_.op_ = op;
    }
    ~OneThread() { c_.busy_.store(false, std::memory_order_release); }
    OneThread(const OneThread&) = delete;
    OneThread& operator=(const OneThread&) = delete;

   private:
    ShmCommunicator& c_;
  };

 public:
  // fake_node_size > 0: each group of that many consecutive ranks acts as a
  // node (tests). hierarchical: allow several nodes (MPI between them);
  // otherwise every rank must be on one node.
  // timeout_s: the longest wait for a peer inside a collective.
  ShmCommunicator(std::unique_ptr<Communicator> mpi, size_t slot_bytes, int fake_node_size, bool hierarchical,
                  double timeout_s)
      : mpi_(std::move(mpi)),
        hierarchical_(hierarchical),
        slot_bytes_(slot_bytes),
        fake_node_size_(fake_node_size),
        timeout_s_(timeout_s) {
    const int rank = mpi_->rank(), size = mpi_->size();
    try {
      // Every MPI call below waits for the other ranks: one record for the
      // watchdog (Note [MPI collectives: the time limit]).
      detail::MpiWait setting_up(*mpi_, "MPI (setting up the shm communicator)", "make_communicator");
      // The inner MPI communicator's ranks (the world, or a group split()
      // made).
      check(MPI_Comm_dup(*static_cast<const MPI_Comm*>(detail::mpi_comm_of(*mpi_)), &world_), "MPI_Comm_dup");
      check(MPI_Comm_set_errhandler(world_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
      // The knobs every rank must share (ZINC_SHM_SLOT_BYTES, ZINC_COMM_FAKE_
      // NODE_SIZE), agreed first: set on one rank only, they garbled the
      // first broadcast or left the others waiting in a split.
      {
        long long knobs[4] = {static_cast<long long>(slot_bytes), -static_cast<long long>(slot_bytes),
                              fake_node_size, -static_cast<long long>(fake_node_size)};
        check(MPI_Allreduce(MPI_IN_PLACE, knobs, 4, MPI_LONG_LONG, MPI_MAX, world_), "MPI_Allreduce");
        if (knobs[0] != -knobs[1])
          throw comm_error(rank, "make_communicator",
                           "the shm slot size differs between the ranks (" + std::to_string(-knobs[1]) + " to " +
                               std::to_string(knobs[0]) + " bytes, ZINC_SHM_SLOT_BYTES): set it alike on every rank");
        if (knobs[2] != -knobs[3])
          throw comm_error(rank, "make_communicator",
                           "ZINC_COMM_FAKE_NODE_SIZE differs between the ranks (" + std::to_string(-knobs[3]) +
                               " to " + std::to_string(knobs[2]) + "): set it alike on every rank");
      }
      if (fake_node_size > 0) {
        if (size % fake_node_size != 0) {
          throw comm_error(rank, "make_communicator",
                           "ZINC_COMM_FAKE_NODE_SIZE=" + std::to_string(fake_node_size) + " does not divide the " +
                               std::to_string(size) + " ranks");
        }
        check(MPI_Comm_split(world_, rank / fake_node_size, rank, &node_), "MPI_Comm_split");
      } else {
        check(MPI_Comm_split_type(world_, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node_),
              "MPI_Comm_split_type");
      }
      check(MPI_Comm_rank(node_, &local_rank_), "MPI_Comm_rank");
      check(MPI_Comm_size(node_, &local_size_), "MPI_Comm_size");
      // Layout checks, agreed by every rank so that all throw or none does:
      // [0] some node is not the whole world, [1] nodes differ in size or are
      // not consecutive blocks of ranks.
      int leader = rank - local_rank_;
      check(MPI_Bcast(&leader, 1, MPI_INT, 0, node_), "MPI_Bcast");
      int bad[2] = {local_size_ != size, leader != rank - local_rank_ || size % local_size_ != 0};
      int sizes[2] = {local_size_, -local_size_};
      check(MPI_Allreduce(MPI_IN_PLACE, bad, 2, MPI_INT, MPI_MAX, world_), "MPI_Allreduce");
      check(MPI_Allreduce(MPI_IN_PLACE, sizes, 2, MPI_INT, MPI_MAX, world_), "MPI_Allreduce");
      bad[1] = bad[1] || sizes[0] != -sizes[1];
      if (!hierarchical_ && bad[0]) {
        throw comm_error(rank, "make_communicator",
                         "the shm backend needs every rank on one machine, but this machine has " +
                             std::to_string(local_size_) + " of " + std::to_string(size) +
                             " ranks (use \"auto\", \"hierarchical\" or \"mpi\")");
      }
      if (hierarchical_ && bad[1]) {
        throw comm_error(rank, "make_communicator",
                         "the hierarchical backend needs the same number of ranks on every machine, numbered "
                         "consecutively per machine (use \"mpi\")");
      }
      nodes_ = size / local_size_;
      if (hierarchical_) {
        check(MPI_Comm_split(world_, local_rank_, rank, &cross_), "MPI_Comm_split");
        check(MPI_Type_contiguous(1, MPI_UINT16_T, &bf16_type_), "MPI_Type_contiguous");
        check(MPI_Type_commit(&bf16_type_), "MPI_Type_commit");
        check(MPI_Op_create(&bf16_pair_sum, /*commute=*/1, &bf16_sum_), "MPI_Op_create");
        check(MPI_Op_create(&f16_pair_sum, /*commute=*/1, &f16_sum_), "MPI_Op_create");
      }
      half_bytes_ = (slot_bytes / 2) / 64 * 64;
      if (half_bytes_ < 64 * static_cast<size_t>(local_size_)) {
        throw comm_error(rank, "make_communicator",
                         "shm slot of " + std::to_string(slot_bytes) + " bytes (ZINC_SHM_SLOT_BYTES) is too small for " +
                             std::to_string(local_size_) + " ranks on a node: at least " +
                             std::to_string(128 * static_cast<size_t>(local_size_)) + " bytes");
      }
      const MPI_Aint bytes = static_cast<MPI_Aint>(kControlBytes + 2 * half_bytes_);
      void* mine = nullptr;
      check(MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, node_, &mine, &win_),
            ("MPI_Win_allocate_shared of " + std::to_string(bytes) + " bytes a rank (the shm slot, ZINC_SHM_SLOT_BYTES " +
             std::to_string(slot_bytes) + ")")
                .c_str());
      check(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_), "MPI_Win_lock_all");
      locked_ = true;
      base_.resize(static_cast<size_t>(local_size_));
      for (int q = 0; q < local_size_; ++q) {
        MPI_Aint qbytes = 0;
        int disp = 0;
        void* p = nullptr;
        check(MPI_Win_shared_query(win_, q, &qbytes, &disp, &p), "MPI_Win_shared_query");
        base_[static_cast<size_t>(q)] = static_cast<char*>(p);
      }
      __atomic_store_n(flag(local_rank_), uint64_t{0}, __ATOMIC_RELEASE);
      __atomic_store_n(wake_word(local_rank_), uint32_t{0}, __ATOMIC_RELEASE);
      __atomic_store_n(sleepers(local_rank_), uint32_t{0}, __ATOMIC_RELEASE);
      __atomic_store_n(departed(local_rank_), uint32_t{0}, __ATOMIC_RELEASE);
      check(MPI_Win_sync(win_), "MPI_Win_sync");
      check(MPI_Barrier(node_), "MPI_Barrier");
      check(MPI_Win_sync(win_), "MPI_Win_sync");
    } catch (...) {
      free_handles();
      throw;
    }
  }

  // Note [shm collectives: leaving]
  // A rank whose communicator goes says so in its control line (`departed`,
  // stored after its last flag, release) and then waits until every rank
  // of the node has said the same: nobody may still read this rank's slot
  // when the window goes, and MPI_Win_free is collective. It does not post
  // a flag for this: a post would look like the next collective's to a
  // rank still waiting in one, which would go on with a stale slot. A rank waiting in a collective
  // for a rank that has left (departed, its flag short) throws at once,
  // naming it, instead of waiting for comm.timeout_seconds: the Python
  // script that catches an error on one rank and ends, while another rank
  // is in step(), ends both (before, both waited in MPI forever).
  ~ShmCommunicator() override {
    if (base_.empty()) {
      free_handles();
      return;
    }
    __atomic_store_n(departed(local_rank_), uint32_t{1}, __ATOMIC_RELEASE);
    // A rank unwinding an error: the others may be anywhere, in a
    // collective this rank left, so waiting for them (and the collective
    // frees) would keep it until comm.timeout_seconds with its error
    // unsaid. The window is left to the process's end: zinc-train ends
    // every rank with the error (Communicator::abort), and the rest of the
    // node, seeing this rank departed, stops waiting for it.
    if (std::uncaught_exceptions() > 0) return;
    wait_departed();
    free_handles();
  }

  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;

  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }
  std::string backend() const override { return hierarchical_ ? "hierarchical" : "shm"; }
  double timeout_seconds() const override { return timeout_s_; }
  int local_size() const override { return local_size_; }
  int local_rank() const override { return local_rank_; }

  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype) override {
    detail::check_reduce_scatter(rank(), size(), send, recv, recv_count, dtype);
    OneThread one(*this, "reduce_scatter");
    if (recv_count == 0) return;
    if (nodes_ == 1) return rs_node(static_cast<const char*>(send), static_cast<char*>(recv), recv_count, 1, dtype);
    check_cross_limit("reduce_scatter", recv_count, "reduce_bucket_size");
    char* tmp = scratch(static_cast<size_t>(recv_count) * nodes_ * dtype_bytes(dtype));
    rs_node(static_cast<const char*>(send), tmp, recv_count, nodes_, dtype);
    {
      detail::MpiWait w(*mpi_, "MPI_Reduce_scatter_block", "reduce_scatter between machines", recv_count, dtype);
      check(MPI_Reduce_scatter_block(tmp, recv, static_cast<int>(recv_count), type(dtype), sum(dtype), cross_),
            "MPI_Reduce_scatter_block");
    }
  }

  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype) override {
    const bool in_place = detail::check_all_gather(rank(), size(), send, recv, send_count, dtype);
    OneThread one(*this, "all_gather");
    if (send_count == 0) return;
    if (nodes_ == 1) {
      return ag_node(static_cast<const char*>(send), static_cast<char*>(recv), send_count, 1, in_place, dtype);
    }
    check_cross_limit("all_gather", send_count, "allgather_bucket_size");
    char* tmp = scratch(static_cast<size_t>(send_count) * nodes_ * dtype_bytes(dtype));
    const int n = static_cast<int>(send_count);
    {
      detail::MpiWait w(*mpi_, "MPI_Allgather", "all_gather between machines", send_count, dtype);
      check(MPI_Allgather(send, n, type(dtype), tmp, n, type(dtype), cross_), "MPI_Allgather");
    }
    ag_node(tmp, static_cast<char*>(recv), send_count, nodes_, /*in_place=*/false, dtype);
  }

  void all_reduce(const void* send, void* recv, int64_t count, DType dtype) override {
    detail::check_all_reduce(rank(), send, recv, count, dtype);
    OneThread one(*this, "all_reduce");
    if (count == 0) return;
    const char* in = static_cast<const char*>(send);
    char* out = static_cast<char*>(recv);
    if (nodes_ == 1) return ar_node(in, out, count, dtype);
    const size_t elem = dtype_bytes(dtype);
    const int L = local_size_;
    const int64_t shard = count / L, rest = count - shard * L;
    if (shard > 0) {
      char* tmp = scratch(static_cast<size_t>(shard) * elem);
      rs_node(in, tmp, shard, 1, dtype);
      cross_all_reduce(tmp, shard, dtype);
      ag_node(tmp, out, shard, 1, /*in_place=*/false, dtype);
    }
    if (rest > 0) {
      const size_t done = static_cast<size_t>(shard * L) * elem;
      ar_node(in + done, out + done, rest, dtype);
      cross_all_reduce(out + done, rest, dtype);
    }
  }

  // One machine: through the slots (a2a_node). Several (hierarchical): the
  // MPI backend's MPI_Alltoall over all ranks; a two-level exchange (shm
  // inside machines, one message per machine pair) is not written yet.
  void all_to_all(const void* send, void* recv, int64_t count_per_rank, DType dtype) override {
    detail::check_all_to_all(rank(), size(), send, recv, count_per_rank, dtype);
    OneThread one(*this, "all_to_all");
    if (count_per_rank == 0) return;
    if (nodes_ > 1) return mpi_->all_to_all(send, recv, count_per_rank, dtype);
    a2a_node(static_cast<const char*>(send), static_cast<char*>(recv),
             count_per_rank * static_cast<int64_t>(dtype_bytes(dtype)));
  }

  // One machine: through the slots, so that these wait with the timeout
  // and see a rank that left, like the others (over MPI they waited
  // without a limit). Several machines: MPI.
  void broadcast(void* buf, int64_t count, DType dtype, int root) override {
    if (nodes_ > 1) return mpi_->broadcast(buf, count, dtype, root);
    detail::check_broadcast(rank(), size(), count, root);
    OneThread one(*this, "broadcast");
    char* p = static_cast<char*>(buf);
    const size_t bytes = static_cast<size_t>(count) * dtype_bytes(dtype);
    for (size_t off = 0; off < bytes; off += half_bytes_) {  // one machine: local rank = rank
      const size_t k = std::min(half_bytes_, bytes - off);
      const int h = begin_chunk();
      if (local_rank_ == root) std::memcpy(slot(root, h), p + off, k);
      post_data(h);
      wait_all(seq_);
      if (local_rank_ != root) std::memcpy(p + off, slot(root, h), k);
    }
  }
  void all_reduce_f64(double* buf, int64_t count) override { reduce_f64(buf, count, /*max=*/false); }
  void all_reduce_max_f64(double* buf, int64_t count) override { reduce_f64(buf, count, /*max=*/true); }
  void barrier() override {
    if (nodes_ > 1) return mpi_->barrier();
    OneThread one(*this, "barrier");
    post();
    wait_all(seq_);
  }
  [[noreturn]] void abort(int code, const std::string& msg) override {
    mpi_->abort(code, msg);
    std::_Exit(code);  // not reached: the MPI backend's abort does not return
  }
  // A second window and node/cross communicators over a duplicate of the
  // MPI communicator: its flags and slots are its own, so its collectives
  // never wait for this one's.
  std::unique_ptr<Communicator> duplicate() override {
    std::unique_ptr<Communicator> mpi = mpi_->duplicate();
    if (!mpi) return nullptr;
    return std::make_unique<ShmCommunicator>(std::move(mpi), slot_bytes_, fake_node_size_, hierarchical_,
                                             timeout_s_);
  }

  // The group's ranks with the same layout rules (a group of ranks on one
  // machine, or the same number on each machine). With fake nodes the
  // group's ranks are numbered afresh, so a test's fake nodes are per group.
  std::unique_ptr<Communicator> split(int color, int key) override {
    return std::make_unique<ShmCommunicator>(mpi_->split(color, key), slot_bytes_, fake_node_size_, hierarchical_,
                                             timeout_s_);
  }

  // Point to point goes over MPI (on one machine MPI itself uses shared memory).
  void exchange(const void* send_buf, int64_t send_count, int to, void* recv_buf, int64_t recv_count, int from,
                DType dtype) override {
    mpi_->exchange(send_buf, send_count, to, recv_buf, recv_count, from, dtype);
  }

 private:
  // Reduce-scatter inside the node. Local rank b's super-block is M pieces
  // of n elements, piece p at in + (p * L + b) * n; this rank (local l) sums
  // super-block l into out (M * n elements, piece p at out + p * n). M = 1 is
  // the flat reduce-scatter. A chunk never crosses a piece: each rank copies
  // elements [off, off + k) of piece p of every other rank's super-block into
  // segment b of its slot half; rank l then sums segment l of all slots (its
  // own from in) into piece p of out.
  void rs_node(const char* in, char* out, int64_t n, int M, DType dtype) {
    const size_t elem = dtype_bytes(dtype);
    const int L = local_size_;
    const int64_t k_max = chunk_elems(half_bytes_ / (static_cast<size_t>(L) * elem));
    const bool stream = static_cast<size_t>(n) * M * elem >= kStreamMinBytes;
    std::vector<const char*> src(static_cast<size_t>(L));
    for (int p = 0; p < M; ++p) {
      for (int64_t off = 0; off < n; off += k_max) {
        const int64_t k = std::min(k_max, n - off);
        const size_t seg = static_cast<size_t>(k) * elem, seg_stride = static_cast<size_t>(k_max) * elem;
        auto block = [&](int b) { return in + ((static_cast<int64_t>(p) * L + b) * n + off) * static_cast<int64_t>(elem); };
        const int h = begin_chunk();
        char* mine = slot(local_rank_, h);
        // Only the other ranks read this slot: this rank's own block is read from in.
        for (int b = 0; b < L; ++b) {
          if (b != local_rank_) std::memcpy(mine + b * seg_stride, block(b), seg);
        }
        post_data(h);
        wait_all(seq_);
        for (int q = 0; q < L; ++q) src[q] = q == local_rank_ ? block(q) : slot(q, h) + local_rank_ * seg_stride;
        reduce_sum(out + (p * n + off) * static_cast<int64_t>(elem), nullptr, src, k, dtype, stream);
      }
    }
    if (stream) _mm_sfence();
  }

  // All-gather inside the node: this rank's M pieces of n elements (piece p
  // at in + p * n) go to out + (p * L + l) * n on every local rank. in_place:
  // they are already there on this rank (M = 1 only). Chunk: each rank copies
  // elements [off, off + k) of piece p into its slot half; every rank then
  // copies each other slot into its place in out.
  void ag_node(const char* in, char* out, int64_t n, int M, bool in_place, DType dtype) {
    const int64_t elem = static_cast<int64_t>(dtype_bytes(dtype));
    const int L = local_size_;
    const int64_t k_max = chunk_elems(half_bytes_ / static_cast<size_t>(elem));
    const bool stream = static_cast<size_t>(n * M * L * elem) >= kStreamMinBytes;
    for (int p = 0; p < M; ++p) {
      for (int64_t off = 0; off < n; off += k_max) {
        const int64_t k = std::min(k_max, n - off);
        const size_t bytes = static_cast<size_t>(k * elem);
        auto dst = [&](int q) { return out + ((static_cast<int64_t>(p) * L + q) * n + off) * elem; };
        const char* piece = in + (p * n + off) * elem;
        const int h = begin_chunk();
        std::memcpy(slot(local_rank_, h), piece, bytes);
        post_data(h);
        if (!in_place) copy_out(dst(local_rank_), piece, bytes, stream);
        wait_all(seq_);
        for (int q = 0; q < L; ++q) {
          if (q != local_rank_) copy_out(dst(q), slot(q, h), bytes, stream);
        }
      }
    }
    if (stream) _mm_sfence();
  }

  // All-to-all inside the node (one machine), in bytes: block b of this
  // rank's send (n bytes at in + b * n) goes to out + l * n on local rank b.
  // The slot layout of rs_node: each chunk, this rank copies bytes
  // [off, off + k) of every other rank's block into segment b of its slot
  // half and posts; every rank then copies segment l of slot q to its place
  // out + q * n + off (its own block straight from in).
  void a2a_node(const char* in, char* out, int64_t n) {
    const int L = local_size_;
    // Segments of a multiple of 64 bytes (cache lines), at least one byte.
    const int64_t fit = static_cast<int64_t>(half_bytes_ / static_cast<size_t>(L));
    const int64_t k_max = std::max<int64_t>(fit & ~int64_t{63}, 1);
    std::memcpy(out + local_rank_ * n, in + local_rank_ * n, static_cast<size_t>(n));
    if (L == 1) return;
    for (int64_t off = 0; off < n; off += k_max) {
      const int64_t k = std::min(k_max, n - off);
      const int h = begin_chunk();
      char* mine = slot(local_rank_, h);
      for (int b = 0; b < L; ++b) {
        if (b != local_rank_) std::memcpy(mine + b * k_max, in + b * n + off, static_cast<size_t>(k));
      }
      post_data(h);
      wait_all(seq_);
      for (int q = 0; q < L; ++q) {
        if (q != local_rank_) {
          std::memcpy(out + q * n + off, slot(q, h) + local_rank_ * k_max, static_cast<size_t>(k));
        }
      }
    }
  }

  // All-reduce inside the node. Chunk: each rank copies elements
  // [off, off + m) of its input, except its own sub-block, into its slot
  // half; rank l sums sub-block l of all inputs into out and into sub-block l
  // of its own slot and posts; every rank then copies sub-block q from slot q.
  void ar_node(const char* in, char* out, int64_t count, DType dtype) {
    const int64_t elem = static_cast<int64_t>(dtype_bytes(dtype));
    const int L = local_size_;
    const int64_t m_max = chunk_elems(half_bytes_ / static_cast<size_t>(elem));
    const bool stream = static_cast<size_t>(count * elem) >= kStreamMinBytes;
    std::vector<const char*> src(static_cast<size_t>(L));
    for (int64_t off = 0; off < count; off += m_max) {
      const int64_t m = std::min(m_max, count - off);
      // Sub-block q: [q * per, min((q + 1) * per, m)), per a multiple of 16 elements.
      const int64_t per = ((m + L - 1) / L + 15) & ~int64_t{15};
      auto lo = [&](int q) { return std::min<int64_t>(q * per, m); };
      const int h = begin_chunk();
      char* mine = slot(local_rank_, h);
      const int64_t my_lo = lo(local_rank_), my_hi = lo(local_rank_ + 1);
      std::memcpy(mine, in + off * elem, static_cast<size_t>(my_lo * elem));
      std::memcpy(mine + my_hi * elem, in + (off + my_hi) * elem, static_cast<size_t>((m - my_hi) * elem));
      post_data(h);
      wait_all(seq_);
      for (int q = 0; q < L; ++q) src[q] = q == local_rank_ ? in + (off + my_lo) * elem : slot(q, h) + my_lo * elem;
      if (my_hi > my_lo) {
        reduce_sum(mine + my_lo * elem, out + (off + my_lo) * elem, src, my_hi - my_lo, dtype, false, stream);
      }
      post();
      wait_all(seq_);
      for (int q = 0; q < L; ++q) {
        const int64_t n = lo(q + 1) - lo(q);
        if (q != local_rank_ && n > 0) {
          copy_out(out + (off + lo(q)) * elem, slot(q, h) + lo(q) * elem, static_cast<size_t>(n * elem), stream);
        }
      }
    }
    if (stream) _mm_sfence();
  }

  // f64 sums (in local rank order, the same on every rank) and maxima:
  // each rank copies a chunk into its slot half and every rank combines
  // the slots. Several machines: MPI.
  void reduce_f64(double* buf, int64_t count, bool max) {
    if (nodes_ > 1) return max ? mpi_->all_reduce_max_f64(buf, count) : mpi_->all_reduce_f64(buf, count);
    if (count < 0)
      throw comm_error(rank(), max ? "all_reduce_max_f64" : "all_reduce_f64",
                       "count must be >= 0, got " + std::to_string(count));
    OneThread one(*this, max ? "all_reduce_max_f64" : "all_reduce_f64");
    const int64_t per = static_cast<int64_t>(half_bytes_ / sizeof(double));
    for (int64_t off = 0; off < count; off += per) {
      const int64_t k = std::min(per, count - off);
      const int h = begin_chunk();
      std::memcpy(slot(local_rank_, h), buf + off, static_cast<size_t>(k) * sizeof(double));
      post_data(h);
      wait_all(seq_);
      for (int64_t i = 0; i < k; ++i) {
        double acc = 0;
        for (int q = 0; q < local_size_; ++q) {
          double v;
          std::memcpy(&v, slot(q, h) + i * static_cast<int64_t>(sizeof(double)), sizeof v);
          acc = q == 0 ? v : max ? (v > acc ? v : acc) : acc + v;
        }
        buf[off + i] = acc;
      }
    }
  }

  void cross_all_reduce(char* buf, int64_t count, DType dtype) {
    const int64_t elem = static_cast<int64_t>(dtype_bytes(dtype));
    for (int64_t off = 0; off < count; off += detail::kMpiChunkCount) {
      const int n = static_cast<int>(std::min(detail::kMpiChunkCount, count - off));
      detail::MpiWait w(*mpi_, "MPI_Allreduce", "all_reduce between machines", count, dtype);
      check(MPI_Allreduce(MPI_IN_PLACE, buf + off * elem, n, type(dtype), sum(dtype), cross_), "MPI_Allreduce");
    }
  }

  // The cross-node reduce-scatter and all-gather are single MPI calls over
  // nodes * count elements, which must fit an int (as in the MPI backend).
  void check_cross_limit(const char* op, int64_t count, const char* bucket_key) const {
    if (count <= detail::kMpiMaxCount / nodes_) return;
    throw comm_error(rank(), op,
                     std::to_string(count) + " elements per rank x " + std::to_string(nodes_) +
                         " nodes exceed the limit of " + std::to_string(detail::kMpiMaxCount) +
                         " elements per MPI call (an int count); use smaller buckets (" + bucket_key + ")");
  }

  // bf16 and fp16 travel as the same 16-bit type; only their sums differ.
  MPI_Datatype type(DType dtype) const { return dtype == DType::kF32 ? MPI_FLOAT : bf16_type_; }
  MPI_Op sum(DType dtype) const {
    return dtype == DType::kF32 ? MPI_SUM : dtype == DType::kF16 ? f16_sum_ : bf16_sum_;
  }

  char* scratch(size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

  // Elements per chunk: at most `fit`, rounded down to a multiple of 16 when
  // larger than that so segments stay 64-byte aligned for fp32 and 32 for bf16.
  static int64_t chunk_elems(size_t fit) {
    const int64_t k = static_cast<int64_t>(fit);
    return k >= 32 ? k & ~int64_t{15} : std::max<int64_t>(k, 1);
  }

  // Local rank q's sequence flag, the 32-bit futex word holding its low
  // bits (stored after it, so that a waiter can sleep in the kernel) and the
  // count of ranks sleeping on that word, each in its own cache line (the
  // other ranks write the sleeper count).
  uint64_t* flag(int q) const { return reinterpret_cast<uint64_t*>(base_[static_cast<size_t>(q)]); }
  uint32_t* wake_word(int q) const { return reinterpret_cast<uint32_t*>(base_[static_cast<size_t>(q)] + 64); }
  uint32_t* sleepers(int q) const { return reinterpret_cast<uint32_t*>(base_[static_cast<size_t>(q)] + 128); }
  // 1 once local rank q's communicator has gone (Note [shm collectives: leaving]).
  uint32_t* departed(int q) const { return reinterpret_cast<uint32_t*>(base_[static_cast<size_t>(q)] + 192); }

  // Until every local rank has departed, as long as that takes (the barrier
  // it replaces had no limit either: freeing the window is collective, so
  // a rank that gave up would leave the others waiting in MPI_Win_free),
  // saying so on stderr after each comm.timeout_seconds.
  void wait_departed() const {
    timespec start{};
    clock_gettime(CLOCK_MONOTONIC, &start);
    double said = 0;
    for (int q = 0; q < local_size_; ++q) {
      while (__atomic_load_n(departed(q), __ATOMIC_ACQUIRE) == 0) {
        timespec nap{0, 1000000};  // 1 ms
        nanosleep(&nap, nullptr);
        if (const double waited = seconds_since(start); waited > said + timeout_s_) {
          said = waited;
          log_warn("rank " + std::to_string(rank()) + ": closing the shm communicator, waited " +
                   std::to_string(static_cast<int>(waited)) + " s for local rank " + std::to_string(q) + " (rank " +
                   std::to_string(rank() - local_rank_ + q) + ") to close its own (it is still working, or waits "
                   "for this rank elsewhere)");
        }
      }
    }
  }

  static double seconds_since(const timespec& start) {
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<double>(now.tv_sec - start.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec - start.tv_nsec);
  }

  char* slot(int q, int h) const {
    return base_[static_cast<size_t>(q)] + kControlBytes + static_cast<size_t>(h) * half_bytes_;
  }
  // Publishes this rank's next flag value (release) and wakes its sleepers.
  void post() {
    ++seq_;
    __atomic_store_n(flag(local_rank_), seq_, __ATOMIC_RELEASE);
    __atomic_store_n(wake_word(local_rank_), static_cast<uint32_t>(seq_), __ATOMIC_SEQ_CST);
    // Shared (not private) futex: the sleepers are other processes.
    if (__atomic_load_n(sleepers(local_rank_), __ATOMIC_SEQ_CST) != 0) {
      syscall(SYS_futex, wake_word(local_rank_), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    }
  }

  // The first post of a chunk in half h: this rank has stopped reading the
  // other half (Note [shm collectives: memory ordering]).
  void post_data(int h) {
    post();
    free_at_[h ^ 1] = seq_;
  }

  // Until every flag is >= v (Note [shm collectives: memory ordering]):
  // spin briefly; then, while a caller is blocked waiting for the collective,
  // poll, yielding the core; otherwise sleep on the owner's futex word until
  // it posts, so that the compute thread sharing the core runs. Throws
  // CommError after timeout_s_.
  void wait_all(uint64_t v) const {
    timespec start{};
    bool timed = false;  // the clock starts at the first wait, once for every rank waited for
    for (int q = 0; q < local_size_; ++q) {
      const uint64_t* f = flag(q);
      if (__atomic_load_n(f, __ATOMIC_ACQUIRE) >= v) continue;
      for (unsigned spins = 0; spins < 1000; ++spins) {
        __builtin_ia32_pause();
        if (__atomic_load_n(f, __ATOMIC_ACQUIRE) >= v) break;
      }
      if (!timed) clock_gettime(CLOCK_MONOTONIC, &start), timed = true;
      while (__atomic_load_n(f, __ATOMIC_ACQUIRE) < v) {
        // A rank that left stores its last flag before `departed`: seen
        // departed, its flag is final (Note [shm collectives: leaving]).
        if (__atomic_load_n(departed(q), __ATOMIC_ACQUIRE) != 0) {
          if (__atomic_load_n(f, __ATOMIC_ACQUIRE) >= v) break;
          throw comm_error(rank(), op_,
                           "local rank " + std::to_string(q) + " (rank " + std::to_string(rank() - local_rank_ + q) +
                               ") has closed its communicator (it ended, or is ending, after an error of its own "
                               "or without this collective): this rank cannot go on");
        }
        if (detail::blocked_callers() > 0) {
          // Somebody waits for this collective, so this rank has given up
          // a core: poll, yielding it to any other runnable thread.
          for (int i = 0; i < 64 && __atomic_load_n(f, __ATOMIC_ACQUIRE) < v; ++i) __builtin_ia32_pause();
          sched_yield();
        } else {
          uint32_t* word = wake_word(q);
          const uint32_t w = __atomic_load_n(word, __ATOMIC_ACQUIRE);
          __atomic_add_fetch(sleepers(q), 1u, __ATOMIC_SEQ_CST);
          if (__atomic_load_n(word, __ATOMIC_SEQ_CST) == w && __atomic_load_n(f, __ATOMIC_ACQUIRE) < v) {
            timespec nap{0, 2000000};  // 2 ms: then look again whether somebody waits, and at the timeout
            syscall(SYS_futex, word, FUTEX_WAIT, w, &nap, nullptr, 0);
          }
          __atomic_sub_fetch(sleepers(q), 1u, __ATOMIC_SEQ_CST);
        }
        const double waited = seconds_since(start);
        if (waited > timeout_s_ && __atomic_load_n(f, __ATOMIC_ACQUIRE) < v) {
          char msg[256];
          std::snprintf(msg, sizeof msg,
                        "waited %.0f s for local rank %d (rank %d) to reach the same point of the same collective; "
                        "it has stopped, died or issues different collectives (timeout: comm.timeout_seconds "
                        "or ZINC_COMM_TIMEOUT)",
                        waited, q, rank() - local_rank_ + q);
          throw comm_error(rank(), op_, msg);
        }
      }
    }
  }

  // The half for the next chunk, once no rank still reads it.
  int begin_chunk() {
    const int h = static_cast<int>(chunk_++ & 1);
    wait_all(free_at_[h]);
    return h;
  }

  void free_handles() {
    if (win_ != MPI_WIN_NULL) {
      if (locked_) MPI_Win_unlock_all(win_);
      MPI_Win_free(&win_);
    }
    if (bf16_sum_ != MPI_OP_NULL) MPI_Op_free(&bf16_sum_);
    if (f16_sum_ != MPI_OP_NULL) MPI_Op_free(&f16_sum_);
    if (bf16_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&bf16_type_);
    if (cross_ != MPI_COMM_NULL) MPI_Comm_free(&cross_);
    if (node_ != MPI_COMM_NULL) MPI_Comm_free(&node_);
    if (world_ != MPI_COMM_NULL) MPI_Comm_free(&world_);
  }

  std::unique_ptr<Communicator> mpi_;  // declared first: destroyed last (it may finalise MPI)
  const bool hierarchical_;
  const size_t slot_bytes_;     // as constructed (duplicate)
  const int fake_node_size_;    // as constructed (duplicate)
  MPI_Comm world_ = MPI_COMM_NULL, node_ = MPI_COMM_NULL, cross_ = MPI_COMM_NULL;
  MPI_Datatype bf16_type_ = MPI_DATATYPE_NULL;  // hierarchical only
  MPI_Op bf16_sum_ = MPI_OP_NULL;               // hierarchical only
  MPI_Op f16_sum_ = MPI_OP_NULL;                // hierarchical only
  MPI_Win win_ = MPI_WIN_NULL;
  bool locked_ = false;
  int local_rank_ = 0, local_size_ = 1, nodes_ = 1;
  size_t half_bytes_ = 0;
  std::vector<char*> base_;       // per local rank: its control line, then its two slot halves
  std::vector<char> scratch_;     // hierarchical: the node-level pieces / shard
  uint64_t seq_ = 0;              // this rank's flag value (Note [shm collectives: memory ordering])
  uint64_t chunk_ = 0;            // chunks run so far; chunk c uses half c % 2
  uint64_t free_at_[2] = {0, 0};  // flag value every rank reaches once it stopped reading half h
  const double timeout_s_;        // longest wait for a peer before CommError
  const char* op_ = "";           // the collective running (error messages)
  std::atomic<bool> busy_{false};  // a thread is inside a collective (OneThread)
};

}  // namespace

namespace detail {

std::unique_ptr<Communicator> make_shm_backend(std::unique_ptr<Communicator> mpi, size_t slot_bytes,
                                               int fake_node_size, bool hierarchical, double timeout_s) {
  return std::make_unique<ShmCommunicator>(std::move(mpi), slot_bytes, fake_node_size, hierarchical, timeout_s);
}

}  // namespace detail
}  // namespace zinc::comm
