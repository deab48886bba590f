// zinc offload: page-locked host buffers and NvmeStore, the io_uring store
// that keeps optimizer state (and later parameters) on NVMe (public header of
// offload/).
//
// NvmeStore keeps one folder per rank under the configured path
// (<path>/zinc-rank<R>-<pid>), holds fixed-size files in it, and moves bytes
// between them and 4 KiB-aligned host buffers with O_DIRECT through
// io_uring: requests are split into aio.block_size pieces, up to
// aio.queue_depth in flight per ring, over aio.intra_op_parallelism rings
// (each with its own thread). Short transfers are resumed, EINTR/EAGAIN
// retried; every other failure becomes a zinc::IoError naming the file, the
// offset and the system's error text. The folder and its files are removed
// when the store is destroyed (a clean exit); a crash leaves only scratch
// that a new store never reads.
//
// Threading: submit (read/write) from one thread at a time; IoTicket::wait
// from the submitting thread. Completions are reaped by the store's threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace zinc::offload {

// Page-locked (mlock), 4 KiB-aligned, zero-initialised host memory, an
// anonymous mapping of its own (not malloc's: Note [pinned buffers are
// mapped, not malloc'd] in pinned_buffer.cpp). If the
// lock is refused (RLIMIT_MEMLOCK), the buffer is ordinary memory and a
// warning is logged once per process. Movable, not copyable.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes, bool lock = true);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // The RAM it takes: bytes rounded up to its alignment (a page; 2 MiB, a
  // huge page, from 2 MiB up), all of it touched.
  size_t footprint() const { return footprint(bytes_); }
  static size_t footprint(size_t bytes);
  bool locked() const { return locked_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool locked_ = false;
};

struct NvmeOptions {
  std::string path;              // existing, writable folder (zero_optimization.offload_*.nvme_path)
  int64_t block_size = 1 << 20;  // aio.block_size: bytes per I/O request (multiple of 4096)
  int queue_depth = 8;           // aio.queue_depth: requests in flight per ring
  int threads = 1;               // aio.intra_op_parallelism: rings, one thread each
  bool single_submit = false;    // aio.single_submit: one io_uring_submit per request instead of batching
  bool overlap_events = true;    // aio.overlap_events: reap completions while still submitting
  // Host buffers to register with every ring (io_uring_register_buffers):
  // transfers that lie inside one of them use the fixed-buffer operations,
  // which skip pinning and mapping the pages on every request. If the kernel
  // refuses the registration (memlock limit), a warning and plain requests.
  std::vector<std::pair<void*, size_t>> fixed_buffers;
};

// The low-level I/O engine under NvmeStore: the io_uring implementation, or a
// test double that fails, short-transfers or fills up on demand. Each call
// moves at most `bytes` at `offset` of an open file descriptor and returns
// the byte count moved or -errno, like pread/pwrite. Batching, queue depth
// and completion are the implementation's business: submit() queues, wait()
// returns one completion.
class IoEngine {
 public:
  struct Completion {
    uint64_t tag;
    int64_t result;  // bytes moved, or -errno
  };
  virtual ~IoEngine() = default;
  virtual void submit_read(int fd, void* buf, int64_t bytes, int64_t offset, uint64_t tag) = 0;
  virtual void submit_write(int fd, const void* buf, int64_t bytes, int64_t offset, uint64_t tag) = 0;
  virtual void flush() = 0;               // hand queued requests to the kernel
  virtual Completion wait() = 0;          // next completion (blocks)
  virtual int in_flight() const = 0;
  // Buffers registered with the kernel (0: none, or not an io_uring engine).
  virtual int registered_buffers() const { return 0; }
};
// Options of one ring: queue_depth entries, single_submit.
std::unique_ptr<IoEngine> make_uring_engine(const NvmeOptions& options);
// Test double around a real engine: after `ok_ops` successful operations, the
// next operation fails with -err (err = 0: the next operation moves only half
// of its bytes, and later ones succeed), so tests can inject EIO, ENOSPC and
// short transfers.
std::unique_ptr<IoEngine> make_faulty_engine(std::unique_ptr<IoEngine> inner, int64_t ok_ops, int err);

class IoTicket;

class NvmeStore {
 public:
  // Creates <options.path>/zinc-rank<rank>-<pid>. Throws IoError naming the
  // path if it is missing, not a folder or not writable. If the file system
  // refuses O_DIRECT, warns once and continues without it (correct, slower:
  // the page cache is in the way). engine_factory (tests) makes the engine of
  // each ring; null means io_uring.
  NvmeStore(const NvmeOptions& options, int rank,
            std::function<std::unique_ptr<IoEngine>(const NvmeOptions&)> engine_factory = nullptr);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  // A new file of `bytes` (rounded up to 4096) named for error messages.
  // Returns its id. Throws IoError (e.g. ENOSPC when preallocating).
  int create(const std::string& name, int64_t bytes);
  // Asynchronous transfers between a 4 KiB-aligned host buffer and a file;
  // offset and bytes are multiples of 4096. The buffer must stay alive and
  // untouched until the ticket is waited on.
  IoTicket write(int file, int64_t offset, const void* buf, int64_t bytes);
  IoTicket read(int file, int64_t offset, void* buf, int64_t bytes);

  const std::string& folder() const;
  bool direct_io() const;  // false after the O_DIRECT fallback
  // Buffers of options.fixed_buffers registered with every ring (the
  // smallest count over the rings).
  int registered_buffers() const;
  // Totals since construction.
  int64_t bytes_read() const;
  int64_t bytes_written() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Completion of one read or write. wait() blocks until every piece is done
// and throws IoError (file, offset, error text) if any failed. Destroying a
// ticket that was not waited on waits (the buffer may not be released while
// the kernel writes into it).
class IoTicket {
 public:
  IoTicket() = default;
  IoTicket(IoTicket&&) noexcept;
  IoTicket& operator=(IoTicket&&) noexcept;
  ~IoTicket();
  void wait();
  bool valid() const { return state_ != nullptr; }
  struct State;

 private:
  friend class NvmeStore;
  std::shared_ptr<State> state_;
};

}  // namespace zinc::offload
