// NvmeStore: the per-rank scratch folder, its files, and the worker threads
// that move pieces of requests through one IoEngine (ring) each.
//
// Note [NvmeStore pieces and rings]
// A read or write is cut into aio.block_size pieces. Pieces are dealt
// round-robin over the rings (aio.intra_op_parallelism), continuing where the
// previous request stopped, so that small requests spread too. Each ring
// belongs to one Worker thread, the only thread that touches that engine:
// it takes pieces from its queue into at most aio.queue_depth slots (the
// slot index is the request's tag) and reaps completions. With
// overlap_events it refills a slot as soon as one completes; without, it
// submits a batch of up to queue_depth pieces and drains all of it before
// taking the next (DeepSpeed's two modes). A piece that moved fewer bytes
// than asked stays in its slot and is resubmitted for the remainder, as is
// one that failed with EINTR or EAGAIN; any other failure is recorded in the
// piece's ticket, which counts down its pieces and wakes the waiter at zero.
#include <algorithm>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>

#include "core/alloc.h"
#include "core/error.h"
#include "core/exit_cleanup.h"
#include "core/log.h"
#include "offload/detail/io_detail.h"
#include "offload/offload.h"

namespace zinc::offload {

struct IoTicket::State {
  std::mutex mu;
  std::condition_variable cv;
  int64_t pieces_left = 0;
  std::string error;  // the first failure; empty while none
  int64_t more_errors = 0;

  void finish_piece(const std::string& err) {
    bool done;
    {
      std::scoped_lock lk(mu);
      if (!err.empty()) {
        if (error.empty())
          error = err;
        else
          ++more_errors;
      }
      done = --pieces_left == 0;
    }
    if (done) cv.notify_all();
  }
};

namespace {

// EINTR/EAGAIN resubmissions of one piece in a row before it counts as failed
// (a device that keeps saying "again" would otherwise hang the ticket).
constexpr int kMaxRetries = 10000;

struct Piece {
  std::shared_ptr<IoTicket::State> ticket;
  const std::string* path = nullptr;  // the file's path, for messages (owned by the store)
  int fd = -1;
  bool write = false;
  char* buf = nullptr;
  int64_t offset = 0;  // file offset of the next byte to move
  int64_t bytes = 0;   // bytes still to move
  int retries = 0;     // EINTR/EAGAIN in a row
};

struct Counters {
  std::atomic<int64_t> read{0};
  std::atomic<int64_t> written{0};
};

// One ring and the thread that owns it. enqueue() from the submitting
// thread; everything else runs on the worker thread. The destructor lets the
// thread finish every queued and in-flight piece, then joins it.
class Worker {
 public:
  Worker(std::unique_ptr<IoEngine> engine, const NvmeOptions& o, Counters& counters)
      : engine_(std::move(engine)),
        depth_(o.queue_depth),
        overlap_(o.overlap_events),
        counters_(counters),
        slots_(static_cast<size_t>(o.queue_depth)) {
    for (int i = depth_ - 1; i >= 0; --i) free_.push_back(i);
    thread_ = std::thread([this] { run(); });
  }
  ~Worker() {
    {
      std::scoped_lock lk(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void enqueue(std::vector<Piece>& pieces) {
    if (pieces.empty()) return;
    {
      std::scoped_lock lk(mu_);
      for (Piece& p : pieces) queue_.push_back(std::move(p));
    }
    pieces.clear();
    cv_.notify_one();
  }

 private:
  void run() {
    std::vector<Piece> batch;
    for (;;) {
      batch.clear();
      {
        std::unique_lock lk(mu_);
        if (active_ == 0) cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (active_ == 0 && queue_.empty()) return;  // stopping, and nothing left
        if (overlap_ || active_ == 0) {
          while (!queue_.empty() && active_ + static_cast<int>(batch.size()) < depth_) {
            batch.push_back(std::move(queue_.front()));
            queue_.pop_front();
          }
        }
      }
      // Engine failures (io_uring_submit, io_uring_wait_cqe) are not
      // per-request: they fail every piece this ring holds, and the ring
      // takes no more work. Nothing escapes the thread.
      try {
        for (Piece& p : batch) {
          const int slot = free_.back();
          free_.pop_back();
          slots_[slot] = std::move(p);
          ++active_;
          if (broken_.empty())
            start(slot);
          else
            finish(slot, broken_);
        }
        if (!batch.empty() && broken_.empty()) engine_->flush();  // single_submit: already submitted
        do {
          if (active_ > 0 && broken_.empty()) complete(engine_->wait());
        } while (!overlap_ && active_ > 0 && broken_.empty());
      } catch (const std::exception& e) {
        broken_ = std::string("NvmeStore ring failed: ") + e.what();
        for (int slot = 0; slot < depth_; ++slot)
          if (slots_[slot].ticket) finish(slot, broken_);
        for (Piece& p : batch)  // taken from the queue but not yet in a slot
          if (p.ticket) p.ticket->finish_piece(broken_);
      }
    }
  }

  void start(int slot) {
    Piece& p = slots_[slot];
    if (p.write)
      engine_->submit_write(p.fd, p.buf, p.bytes, p.offset, static_cast<uint64_t>(slot));
    else
      engine_->submit_read(p.fd, p.buf, p.bytes, p.offset, static_cast<uint64_t>(slot));
  }

  void complete(const IoEngine::Completion& c) {
    ZINC_CHECK(c.tag < slots_.size() && slots_[c.tag].ticket, "IoEngine returned an unknown tag");
    const int slot = static_cast<int>(c.tag);
    Piece& p = slots_[slot];
    if (c.result > 0) {
      const int64_t moved = std::min(c.result, p.bytes);
      (p.write ? counters_.written : counters_.read).fetch_add(moved, std::memory_order_relaxed);
      p.buf += moved;
      p.offset += moved;
      p.bytes -= moved;
      p.retries = 0;
      if (p.bytes == 0) return finish(slot, "");
      // A short transfer: resubmit the remainder at once.
      start(slot);
      engine_->flush();
      return;
    }
    if ((c.result == -EINTR || c.result == -EAGAIN) && ++p.retries <= kMaxRetries) {
      start(slot);
      engine_->flush();
      return;
    }
    const std::string what = std::string(p.write ? "write" : "read") + " of " + *p.path + " at offset " +
                             std::to_string(p.offset) + " (" + std::to_string(p.bytes) + " bytes)";
    if (c.result == 0)
      finish(slot, "NvmeStore: " + what + ": no bytes moved (end of file or device)");
    else
      finish(slot, posix_error("NvmeStore: " + what, static_cast<int>(-c.result)).what());
  }

  void finish(int slot, const std::string& err) {
    Piece& p = slots_[slot];
    p.ticket->finish_piece(err);
    p.ticket.reset();
    free_.push_back(slot);
    --active_;
  }

  std::unique_ptr<IoEngine> engine_;
  const int depth_;
  const bool overlap_;
  Counters& counters_;

  std::mutex mu_;  // guards queue_ and stop_
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  bool stop_ = false;

  // Worker thread only.
  std::vector<Piece> slots_;  // queue_depth slots; a slot's index is its tag
  std::vector<int> free_;
  int active_ = 0;      // occupied slots
  std::string broken_;  // set when the engine itself failed
  std::thread thread_;
};

std::string join_path(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

// A file name that is safe inside the folder, still recognisable in messages.
std::string file_name_for(int id, const std::string& name) {
  std::string s = std::to_string(id) + "-";
  for (char c : name.substr(0, 200)) s += (c == '/' || c == '\0') ? '_' : c;
  return s;
}

void validate(const NvmeOptions& o) {
  if (o.block_size < 4096 || o.block_size % 4096 != 0 || o.block_size > (int64_t{1} << 30))
    throw ConfigError("aio.block_size", "must be a multiple of 4096 between 4096 and 1 GiB, got " +
                                            std::to_string(o.block_size));
  if (o.queue_depth < 1 || o.queue_depth > 4096)
    throw ConfigError("aio.queue_depth", "must be between 1 and 4096, got " + std::to_string(o.queue_depth));
  if (o.threads < 1 || o.threads > 256)
    throw ConfigError("aio.intra_op_parallelism", "must be between 1 and 256, got " + std::to_string(o.threads));
  if (o.path.empty()) throw IoError("NvmeStore: no nvme_path given (zero_optimization.offload_*.nvme_path)");
}

// Scratch folders zinc-rank<R>-<pid>[-<n>] under `path` whose process is no
// longer running (killed with -9, or ended by MPI_Abort before it could
// remove them) are removed, each with a line saying so. A pid that is alive
// may be another process that reuses it: its folder stays.
void remove_stale_folders(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("zinc-rank", 0) != 0) continue;
    const size_t dash = n.find('-', 9);
    if (dash == std::string::npos || dash == 9 || n.find_first_not_of("0123456789", 9) != dash) continue;
    const size_t end = n.find_first_not_of("0123456789", dash + 1);
    if (end == dash + 1 || (end != std::string::npos && n[end] != '-')) continue;
    const long pid = std::strtol(n.c_str() + dash + 1, nullptr, 10);
    if (pid <= 0 || pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    // Its owner holds a lock on the folder while it lives (a path shared
    // between machines may hold a live process of another host, whose pid
    // means nothing here).
    detail::UniqueFd dfd(::open(e.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!dfd || ::flock(dfd.get(), LOCK_EX | LOCK_NB) != 0) continue;
    // Only a folder that holds nothing but zinc's scratch (files named
    // <id>-<name>, and the probe) is removed: a folder of the user's with a
    // name of this form kept its files with it.
    std::string other;
    std::error_code list;
    for (const fs::directory_entry& f : fs::directory_iterator(e.path(), list)) {
      const std::string name = f.path().filename().string();
      std::error_code fe;
      const size_t digits = name.find_first_not_of("0123456789");
      const bool scratch = f.is_regular_file(fe) && !f.is_symlink(fe) &&
                           (name == "probe" || (digits > 0 && digits != std::string::npos && name[digits] == '-'));
      if (!scratch) {
        other = name;
        break;
      }
    }
    if (list || !other.empty()) {
      log_warn("NvmeStore: kept " + e.path().string() + " (its process " + std::to_string(pid) +
               " is gone): it holds " + (other.empty() ? std::string("what cannot be listed") : other) +
               ", which is not zinc's scratch; remove it yourself");
      continue;
    }
    std::error_code rm;
    const uintmax_t removed = fs::remove_all(e.path(), rm);
    if (!rm && removed > 0)
      log_warn("NvmeStore: removed " + e.path().string() + ", scratch left by process " + std::to_string(pid) +
               ", which is no longer running");
  }
}

// mkdir <path>/zinc-rank<R>-<pid>, or with a -<n> suffix if that exists (a
// second store of this rank in this process, or scratch a crashed process
// with a recycled pid left behind).
std::string make_folder(const std::string& path, int rank) {
  remove_stale_folders(path);
  const std::string base = join_path(path, "zinc-rank" + std::to_string(rank) + "-" + std::to_string(::getpid()));
  for (int n = 0;; ++n) {
    const std::string folder = n == 0 ? base : base + "-" + std::to_string(n);
    if (::mkdir(folder.c_str(), 0700) == 0) return folder;
    const int err = errno;
    if (err == EEXIST && n < 1000) continue;
    std::string why;
    switch (err) {
      case ENOENT:  // a folder that takes none (/proc) says ENOENT too
        why = std::filesystem::is_directory(path) ? " takes no new folders (a virtual file system?)" : " does not exist";
        break;
      case ENOTDIR:
        why = " is not a folder";
        break;
      case EACCES:
      case EPERM:
      case EROFS:
        why = " is not writable";
        break;
      default:
        break;
    }
    throw posix_error("nvme_path " + path + why + ": cannot create " + folder, err);
  }
}

}  // namespace

struct NvmeStore::Impl {
  int registered = 0;  // fixed buffers registered with every ring
  struct File {
    std::string path;
    detail::UniqueFd fd;
    int64_t bytes = 0;  // rounded up to 4096
  };

  NvmeOptions options;
  std::string folder;  // empty until created
  detail::UniqueFd folder_lock;  // flock on the folder, for remove_stale_folders
  bool direct = true;
  std::deque<File> files;  // deque: Piece::path points into it while files are added
  Counters counters;
  std::vector<std::unique_ptr<Worker>> workers;
  size_t next_ring = 0;

  ~Impl() {
    workers.clear();  // finishes everything queued and in flight, joins the threads
    for (File& f : files) {
      f.fd.reset();
      if (::unlink(f.path.c_str()) != 0)
        log_warn("NvmeStore: cannot remove " + f.path + ": " + std::strerror(errno));
    }
    if (!folder.empty() && ::rmdir(folder.c_str()) != 0)
      log_warn("NvmeStore: cannot remove " + folder + ": " + std::strerror(errno));
    if (!folder.empty()) unregister_exit_folder(folder);
  }

  void fell_back_to_buffered(const std::string& path) {
    if (!direct) return;
    direct = false;
    log_warn("NvmeStore: the file system under " + options.path + " refuses O_DIRECT (" + path +
             "); continuing through the page cache, which is correct but slower and uses host memory");
  }

  // Creates and writes one page to a probe file: proves the folder writable
  // and finds out whether O_DIRECT works here (some file systems accept it
  // at open and refuse it at the first transfer).
  void probe() {
    const std::string path = join_path(folder, "probe");
    AlignedBuffer page(4096, kPageAlign);
    bool d = direct;
    detail::UniqueFd fd = detail::open_scratch(path, d);
    if (!d) fell_back_to_buffered(path);
    ssize_t n;
    do n = ::pwrite(fd.get(), page.data(), 4096, 0);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EINVAL && direct) {
      fd.reset();
      fell_back_to_buffered(path);
      d = false;
      fd = detail::open_scratch(path, d);
      do n = ::pwrite(fd.get(), page.data(), 4096, 0);
      while (n < 0 && errno == EINTR);
    }
    const int err = errno;
    fd.reset();
    ::unlink(path.c_str());
    if (n < 0) throw posix_error("nvme_path " + options.path + " is not writable: cannot write " + path, err);
  }

  std::shared_ptr<IoTicket::State> submit(bool write, int file, int64_t offset, char* buf, int64_t bytes) {
    ZINC_CHECK(file >= 0 && static_cast<size_t>(file) < files.size(),
               "NvmeStore: unknown file id " + std::to_string(file));
    const File& f = files[static_cast<size_t>(file)];
    ZINC_CHECK(offset >= 0 && bytes >= 0 && offset + bytes <= f.bytes,
               "NvmeStore: [" + std::to_string(offset) + ", +" + std::to_string(bytes) + ") is outside " + f.path +
                   " (" + std::to_string(f.bytes) + " bytes)");
    ZINC_CHECK(offset % 4096 == 0 && bytes % 4096 == 0 && reinterpret_cast<uintptr_t>(buf) % 4096 == 0,
               "NvmeStore: offset, bytes and buffer address must be multiples of 4096");
    auto state = std::make_shared<IoTicket::State>();
    const int64_t block = options.block_size;
    const int64_t pieces = (bytes + block - 1) / block;
    state->pieces_left = pieces;
    if (pieces == 0) return state;
    std::vector<std::vector<Piece>> per_ring(workers.size());
    for (int64_t i = 0; i < pieces; ++i) {
      Piece p;
      p.ticket = state;
      p.path = &f.path;
      p.fd = f.fd.get();
      p.write = write;
      p.buf = buf + i * block;
      p.offset = offset + i * block;
      p.bytes = std::min(block, bytes - i * block);
      per_ring[next_ring++ % workers.size()].push_back(std::move(p));
    }
    for (size_t r = 0; r < workers.size(); ++r) workers[r]->enqueue(per_ring[r]);
    return state;
  }
};

NvmeStore::NvmeStore(const NvmeOptions& options, int rank,
                     std::function<std::unique_ptr<IoEngine>(const NvmeOptions&)> engine_factory)
    : impl_(std::make_unique<Impl>()) {
  validate(options);
  impl_->options = options;
  impl_->folder = make_folder(options.path, rank);  // from here on ~Impl removes it
  register_exit_folder(impl_->folder);                // and an exit that skips destructors
  // Locked while this process lives: remove_stale_folders leaves it alone.
  impl_->folder_lock = detail::UniqueFd(::open(impl_->folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (impl_->folder_lock) ::flock(impl_->folder_lock.get(), LOCK_EX | LOCK_NB);
  impl_->probe();
  std::vector<std::unique_ptr<IoEngine>> engines;
  for (int i = 0; i < options.threads; ++i)
    engines.push_back(engine_factory ? engine_factory(options) : make_uring_engine(options));
  impl_->registered = options.fixed_buffers.empty() ? 0 : static_cast<int>(options.fixed_buffers.size());
  for (auto& e : engines) {
    ZINC_CHECK(e != nullptr, "NvmeStore: the engine factory returned null");
    impl_->registered = std::min(impl_->registered, e->registered_buffers());
    impl_->workers.push_back(std::make_unique<Worker>(std::move(e), options, impl_->counters));
  }
}

NvmeStore::~NvmeStore() = default;

int NvmeStore::create(const std::string& name, int64_t bytes) {
  ZINC_CHECK(bytes >= 0, "NvmeStore::create: negative size for " + name);
  Impl& s = *impl_;
  const int id = static_cast<int>(s.files.size());
  Impl::File f;
  f.path = join_path(s.folder, file_name_for(id, name));
  f.bytes = static_cast<int64_t>(round_up(static_cast<size_t>(bytes), kPageAlign));
  bool d = s.direct;
  f.fd = detail::open_scratch(f.path, d);
  if (!d) s.fell_back_to_buffered(f.path);
  if (f.bytes > 0) {
    // Preallocated so that a full disk shows up here, not in the middle of a
    // training step, and so that writes do not allocate.
    int err;
    do err = ::posix_fallocate(f.fd.get(), 0, f.bytes);
    while (err == EINTR);
    if (err != 0) {
      f.fd.reset();
      ::unlink(f.path.c_str());
      throw posix_error("NvmeStore: cannot preallocate " + std::to_string(f.bytes) + " bytes for " + f.path, err);
    }
  }
  s.files.push_back(std::move(f));
  return id;
}

IoTicket NvmeStore::write(int file, int64_t offset, const void* buf, int64_t bytes) {
  IoTicket t;
  // The buffer is only read: the cast lets one Piece type carry both directions.
  t.state_ = impl_->submit(true, file, offset, static_cast<char*>(const_cast<void*>(buf)), bytes);
  return t;
}

IoTicket NvmeStore::read(int file, int64_t offset, void* buf, int64_t bytes) {
  IoTicket t;
  t.state_ = impl_->submit(false, file, offset, static_cast<char*>(buf), bytes);
  return t;
}

const std::string& NvmeStore::folder() const { return impl_->folder; }
bool NvmeStore::direct_io() const { return impl_->direct; }
int NvmeStore::registered_buffers() const { return impl_->registered; }
int64_t NvmeStore::bytes_read() const { return impl_->counters.read.load(); }
int64_t NvmeStore::bytes_written() const { return impl_->counters.written.load(); }

IoTicket::IoTicket(IoTicket&& o) noexcept : state_(std::move(o.state_)) {}

IoTicket& IoTicket::operator=(IoTicket&& o) noexcept {
  if (this != &o) {
    IoTicket old(std::move(*this));  // waits for the ticket being replaced
    state_ = std::move(o.state_);
  }
  return *this;
}

IoTicket::~IoTicket() {
  if (!state_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    // Nobody is left to receive it: say so rather than lose it.
    log_error(std::string("I/O ticket destroyed without wait(): ") + e.what());
  }
}

void IoTicket::wait() {
  if (!state_) return;
  const std::shared_ptr<State> s = std::move(state_);
  std::unique_lock lk(s->mu);
  s->cv.wait(lk, [&] { return s->pieces_left == 0; });
  if (s->error.empty()) return;
  std::string msg = s->error;
  if (s->more_errors > 0) msg += " (and " + std::to_string(s->more_errors) + " more failed pieces)";
  throw IoError(msg);
}

}  // namespace zinc::offload
