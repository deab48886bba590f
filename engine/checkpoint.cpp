#include "engine/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "engine/config.h"  // read_json_file

// Note [checkpoints]
// ------------------
// A checkpoint is a folder DIR/TAG written by every rank at once, with no
// gather:
//   rank00000.bin ...  one per rank: for each block, the rank's span of its
//                      optimizer state, fp32 master weights then Adam m then
//                      Adam v (the span is the whole padded block at stage
//                      0, the rank's shard otherwise; Note [ZeRO stages])
//   metadata.json      written last, by rank 0: the format version, the
//                      training state (step counters, the schedule's
//                      position, the caller's client_state with the data
//                      loader's position), the config, world size and stage,
//                      the model's blocks with each parameter's name, shape
//                      and offset in the flat block, and every rank's index:
//                      which elements of which block its file holds, at
//                      which byte offsets, with an XXH3-64 checksum per
//                      kChunkNumel elements.
// The compute parameters (the bf16 copy, or the stage 3 shards) are not
// saved: the engine writes them from the master weights in the same pass as
// every update (bf16 rounding or a copy), so a load rebuilds them exactly.
//
// Reading works in flat-block coordinates: a rank asks for the elements of
// its own new span and reads them from whichever saved spans overlap it, so
// a checkpoint loads at any world size and stage (padding, which differs
// with the world size, is zero on both sides).
//
// Every file is checksummed, and a load verifies the whole structure before
// it reads a shard: metadata.json carries the checksum of its own content
// (kSealKey) and, per rank index, its size and checksum; each index carries
// its shard file's size and a checksum per chunk of every span. So an edit
// of any byte of any file, a file from another checkpoint, or a cut file is
// an error naming the file before the engine's state is touched (a chunk
// that fails its checksum is found while reading; the engine then refuses
// to train until a load succeeds: Note [a failed load] in engine.cpp).
//
// Crash safety: the ranks write into DIR/.TAG.partial, fsync their files,
// agree that all succeeded, and rank 0 writes metadata.json, fsyncs the
// folder, renames it to DIR/TAG and fsyncs DIR; only then does it replace
// DIR/latest (temporary file, fsync, rename, fsync). A crash before the
// rename leaves a .partial folder that no load reads (and the next save of
// that tag removes); a crash between the renames leaves `latest` at the
// previous complete tag. A tag saved again replaces the old folder in one
// atomic exchange (renameat2 RENAME_EXCHANGE), so `latest` never names a
// missing folder even when it names the tag being replaced. Rank 0 holds
// DirLock on DIR while it saves (and zinc-train for its whole run), so two
// runs cannot write one folder.

namespace zinc::ckpt {
namespace {

std::string hex64(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, h);
  return buf;
}

std::shared_ptr<void> new_state() {
  XXH3_state_t* s = XXH3_createState();
  if (!s) throw std::bad_alloc();
  XXH3_64bits_reset(s);
  return std::shared_ptr<void>(s, [](void* p) { XXH3_freeState(static_cast<XXH3_state_t*>(p)); });
}

[[noreturn]] void throw_errno(const std::string& what, int err) {
  throw IoError(what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
}

void write_all(int fd, const void* data, size_t bytes, off_t offset, const std::string& path,
               const std::string& writer = "checkpoint") {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(writer + ": write of " + path + " at offset " + std::to_string(offset) + " failed", errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += n;
  }
}

void fsync_fd(int fd, const std::string& path, const std::string& writer = "checkpoint") {
  if (::fsync(fd) != 0) throw_errno(writer + ": fsync of " + path + " failed", errno);
}

int g_saves = 0;

}  // namespace

void count_save() { ++g_saves; }

void fault_point(const char* phase) {
  const char* spec = std::getenv("ZINC_CHECKPOINT_FAULT");
  if (!spec) return;
  const char* colon = std::strchr(spec, ':');
  const std::string name = colon ? std::string(spec, colon) : std::string(spec);
  const int n = colon ? std::atoi(colon + 1) : 1;
  if (name == phase && n == g_saves) ::kill(::getpid(), SIGKILL);
}

const char* kind_name(int k) {
  switch (k) {
    case kMaster: return "fp32 master weights";
    case kM: return "Adam m";
    case kV: return "Adam v";
  }
  return "?";
}

// ---- writing ------------------------------------------------------------------------

RankWriter::RankWriter(std::string path, std::vector<Span> spans) : path_(std::move(path)), spans_(std::move(spans)) {
  // O_DIRECT where the file system has it (a checkpoint is written once and
  // not read back soon: the page cache would only hold it and throttle the
  // writer); plain buffered writes otherwise (tmpfs).
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  fd_ = UniqueFd(::open(path_.c_str(), flags | O_DIRECT, 0644));
  if (!fd_ && errno == EINVAL) fd_ = UniqueFd(::open(path_.c_str(), flags, 0644));
  if (!fd_) throw_errno("checkpoint: cannot create " + path_, errno);
  int64_t at = 0;
  for (size_t i = 0; i < spans_.size(); ++i) {
    index_[spans_[i].block] = i;
    file_offset_.push_back(at);
    region_bytes_.push_back((spans_[i].count * 4 + 4095) / 4096 * 4096);
    for (int k = 0; k < kKinds; ++k) {
      Stream st;
      st.state = new_state();
      st.region = at + k * region_bytes_.back();
      streams_.push_back(std::move(st));
    }
    at += kKinds * region_bytes_.back();
  }
  // The whole file is allocated first: a full disk fails here, before any
  // data is written, and the writes then stay inside the file (on ext4, O_DIRECT
  // writes that extend a file are serialised, and the queue would drain).
  file_bytes_ = at;
  if (at > 0) {
    const int err = ::posix_fallocate(fd_.get(), 0, static_cast<off_t>(at));
    if (err != 0) throw_errno("checkpoint: cannot allocate " + std::to_string(at) + " bytes for " + path_, err);
  }
  offload::NvmeOptions o;
  o.queue_depth = kWriteBuffers;
  io_ = offload::make_uring_engine(o);
  for (int b = 0; b < kWriteBuffers; ++b) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, static_cast<size_t>(kWriteBytes)) != 0) throw std::bad_alloc();
    buffers_.emplace_back(p, [](void* q) { std::free(q); });
    free_.push_back(b);
  }
}

RankWriter::~RankWriter() {
  // The kernel may still be reading our buffers: let every write end.
  while (io_ && io_->in_flight() > 0) io_->wait();
}

RankWriter::Stream& RankWriter::stream(int block, int kind) {
  return streams_[index_.at(block) * kKinds + static_cast<size_t>(kind)];
}

void RankWriter::reap_one() {
  const offload::IoEngine::Completion c = io_->wait();
  Pending& p = pending_.at(c.tag);
  if (c.result < 0)
    throw_errno("checkpoint: write of " + path_ + " at offset " + std::to_string(p.offset) + " failed",
                static_cast<int>(-c.result));
  if (c.result < p.bytes) {  // a short write: the rest goes again
    p.offset += c.result;
    p.data += c.result;
    p.bytes -= c.result;
    io_->submit_write(fd_.get(), p.data, p.bytes, p.offset, c.tag);
    io_->flush();
    return;
  }
  pending_.erase(c.tag);
  if (c.tag < static_cast<uint64_t>(kWriteBuffers)) free_.push_back(static_cast<int>(c.tag));
}

int RankWriter::take_buffer() {
  while (free_.empty()) reap_one();
  const int b = free_.back();
  free_.pop_back();
  return b;
}

void RankWriter::submit(Stream& st) {
  char* buf = static_cast<char*>(buffers_[static_cast<size_t>(st.buffer)].get());
  const int64_t bytes = (st.fill + 4095) / 4096 * 4096;  // the region's padding past its data is zeros
  std::memset(buf + st.fill, 0, static_cast<size_t>(bytes - st.fill));
  const int64_t offset = st.region + st.flushed;
  pending_[static_cast<uint64_t>(st.buffer)] = {offset, bytes, buf};
  io_->submit_write(fd_.get(), buf, bytes, offset, static_cast<uint64_t>(st.buffer));
  io_->flush();
  st.flushed += st.fill;
  st.buffer = -1;
  st.fill = 0;
}

void RankWriter::write(int block, int kind, int64_t offset_in_span, const float* data, int64_t count, bool stable) {
  const size_t i = index_.at(block);
  const Span& sp = spans_[i];
  Stream& st = stream(block, kind);
  if (offset_in_span != st.written || offset_in_span + count > sp.count)
    throw Error("checkpoint: block " + std::to_string(block) + " " + kind_name(kind) + ": piece at " +
                std::to_string(offset_in_span) + " out of order (expected " + std::to_string(st.written) + ")");
  const char* p = reinterpret_cast<const char*>(data);
  int64_t left = count * 4;
  if (stable && st.buffer < 0 && reinterpret_cast<uintptr_t>(p) % 4096 == 0) {
    // Nothing staged (the region's next byte is 4 KiB aligned) and the
    // caller's memory aligned: its whole 4 KiB pages go from where they are.
    for (int64_t direct = left / 4096 * 4096; direct > 0;) {
      while (io_->in_flight() >= kWriteBuffers) reap_one();
      const int64_t n = std::min(direct, kDirectWriteBytes);
      const uint64_t tag = next_tag_++;
      pending_[tag] = {st.region + st.flushed, n, p};
      io_->submit_write(fd_.get(), p, n, st.region + st.flushed, tag);
      io_->flush();
      st.flushed += n;
      p += n;
      left -= n;
      direct -= n;
    }
  }
  while (left > 0) {
    if (st.buffer < 0) st.buffer = take_buffer();
    const int64_t n = std::min(left, kWriteBytes - st.fill);
    std::memcpy(static_cast<char*>(buffers_[static_cast<size_t>(st.buffer)].get()) + st.fill, p, static_cast<size_t>(n));
    st.fill += n;
    p += n;
    left -= n;
    if (st.fill == kWriteBytes) submit(st);
  }
  fault_point("shards");
  // Checksums per chunk of the span, the piece split at chunk boundaries.
  auto* s = static_cast<XXH3_state_t*>(st.state.get());
  int64_t done = 0;
  while (done < count) {
    const int64_t pos = st.written + done;
    const int64_t take = std::min(count - done, kChunkNumel - pos % kChunkNumel);
    XXH3_64bits_update(s, data + done, static_cast<size_t>(take) * 4);
    done += take;
    const int64_t end = pos + take;
    if (end % kChunkNumel == 0 || end == sp.count) {
      st.chunks.push_back(hex64(XXH3_64bits_digest(s)));
      XXH3_64bits_reset(s);
    }
  }
  st.written += count;
  if (st.written == sp.count && st.buffer >= 0) submit(st);  // the region's tail: its buffer is free again soon
}

nlohmann::json RankWriter::finish() {
  nlohmann::json blocks = nlohmann::json::array();
  for (size_t i = 0; i < spans_.size(); ++i) {
    const Span& sp = spans_[i];
    nlohmann::json b = {{"block", sp.block}, {"flat_offset", sp.flat_offset}, {"count", sp.count}};
    for (int k = 0; k < kKinds; ++k) {
      const Stream& st = streams_[i * kKinds + static_cast<size_t>(k)];
      if (st.written != sp.count)
        throw Error("checkpoint: block " + std::to_string(sp.block) + " " + kind_name(k) + ": wrote " +
                    std::to_string(st.written) + " of " + std::to_string(sp.count) + " elements");
      b[k == kMaster ? "master" : k == kM ? "m" : "v"] = {
          {"file_offset", file_offset_[i] + k * region_bytes_[i]}, {"xxh3_64_per_chunk", st.chunks}};
    }
    blocks.push_back(b);
  }
  for (Stream& st : streams_)
    if (st.buffer >= 0) submit(st);
  while (io_->in_flight() > 0) reap_one();
  fsync_fd(fd_.get(), path_);
  if (::close(fd_.release()) != 0) throw_errno("checkpoint: close of " + path_ + " failed", errno);
  return {{"file", std::filesystem::path(path_).filename().string()},
          {"file_bytes", file_bytes_},
          {"chunk_elements", kChunkNumel},
          {"blocks", blocks}};
}

// ---- reading ------------------------------------------------------------------------

CheckpointReader::CheckpointReader(std::string dir, const nlohmann::json& ranks, std::vector<std::string> block_names)
    : dir_(std::move(dir)), names_(std::move(block_names)) {
  int r = 0;
  for (const nlohmann::json& rk : ranks) {
    if (rk.at("chunk_elements").get<int64_t>() != kChunkNumel)
      throw IoError("checkpoint " + dir_ + ": chunk size " + rk.at("chunk_elements").dump() + " is not zinc's");
    for (const nlohmann::json& b : rk.at("blocks")) {
      Saved s;
      s.block = b.at("block").get<int>();
      s.rank = r;
      s.file = rk.at("file").get<std::string>();
      s.flat_offset = b.at("flat_offset").get<int64_t>();
      s.count = b.at("count").get<int64_t>();
      int k = 0;
      for (const char* key : {"master", "m", "v"}) {
        s.file_offset[k] = b.at(key).at("file_offset").get<int64_t>();
        s.chunks[k] = b.at(key).at("xxh3_64_per_chunk").get<std::vector<std::string>>();
        ++k;
      }
      saved_[s.block].push_back(std::move(s));
    }
    ++r;
  }
}

int CheckpointReader::file(const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return it->second.get();
  const std::string path = dir_ + "/" + name;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    const int err = errno;
    struct stat st;
    if (err == ENOENT && ::stat(dir_.c_str(), &st) != 0)  // the whole tag went while it was read
      throw_errno("checkpoint: cannot open " + path + " (the tag " + dir_ + " was removed while it was read: a run's "
                  "run.keep_last pruning it? read another tag)", err);
    throw_errno("checkpoint: cannot open " + path, err);
  }
  const int raw = fd.get();
  files_.emplace(name, std::move(fd));
  // Whole chunks at 4 KiB-aligned offsets (zinc's own writer aligns every
  // region) are read with O_DIRECT: a load reads each byte once, and the page
  // cache would only add a copy.
  direct_.emplace(name, UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT)));
  return raw;
}

const float* CheckpointReader::chunk(const Saved& s, int kind, int64_t c) {
  const int64_t begin = c * kChunkNumel, n = std::min(kChunkNumel, s.count - begin);
  const int64_t at = s.file_offset[kind] + begin * 4;
  const std::string key = s.file + "#" + std::to_string(kind);
  if (!cached_) {
    void* p = nullptr;
    if (::posix_memalign(&p, 4096, static_cast<size_t>(kChunkNumel) * 4) != 0) throw std::bad_alloc();
    cached_.reset(p, [](void* q) { std::free(q); });
  }
  float* buf = static_cast<float*>(cached_.get());
  if (cached_file_ == key && cached_at_ == at) return buf;
  cached_file_.clear();
  const std::string path = dir_ + "/" + s.file;
  int fd = file(s.file);
  const UniqueFd& direct = direct_.at(s.file);
  size_t want = static_cast<size_t>(n) * 4;
  if (direct && at % 4096 == 0) {
    fd = direct.get();
    want = (want + 4095) / 4096 * 4096;  // the region's padding (or the file's end) follows
  }
  auto where = [&] {
    const std::string name =
        static_cast<size_t>(s.block) < names_.size() ? names_[static_cast<size_t>(s.block)] : std::to_string(s.block);
    return "block '" + name + "' " + kind_name(kind) + ", elements " + std::to_string(s.flat_offset + begin) +
           ".." + std::to_string(s.flat_offset + begin + n) + " (bytes " + std::to_string(at) + ".." +
           std::to_string(at + n * 4) + ")";
  };
  char* p = reinterpret_cast<char*>(buf);
  size_t got_total = 0;
  while (got_total < want) {
    const ssize_t got = ::pread(fd, p + got_total, want - got_total, static_cast<off_t>(at) + static_cast<off_t>(got_total));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw_errno("checkpoint: read of " + path + " failed for " + where(), errno);
    }
    if (got == 0) break;
    got_total += static_cast<size_t>(got);
  }
  if (got_total < static_cast<size_t>(n) * 4)
    throw IoError("checkpoint: " + path + " is truncated: it ends before " + where());
  bytes_read_ += n * 4;
  const std::string h = hex64(XXH3_64bits(buf, static_cast<size_t>(n) * 4));
  if (static_cast<size_t>(c) >= s.chunks[kind].size() || h != s.chunks[kind][static_cast<size_t>(c)])
    throw IoError("checkpoint: " + path + " is corrupted: the checksum of " + where() + " does not match");
  cached_file_ = key;
  cached_at_ = at;
  return buf;
}

void CheckpointReader::read(int block, int kind, int64_t flat_offset, int64_t count, float* out) {
  std::fill(out, out + count, 0.0f);
  auto it = saved_.find(block);
  if (it == saved_.end()) return;
  const int64_t a = flat_offset, b = flat_offset + count;
  for (const Saved& s : it->second) {
    const int64_t lo = std::max(a, s.flat_offset), hi = std::min(b, s.flat_offset + s.count);
    for (int64_t x = lo; x < hi;) {
      const int64_t in_span = x - s.flat_offset;
      const int64_t c = in_span / kChunkNumel;
      const float* data = chunk(s, kind, c);
      const int64_t chunk_end = std::min((c + 1) * kChunkNumel, s.count) + s.flat_offset;
      const int64_t upto = std::min(hi, chunk_end);
      std::memcpy(out + (x - a), data + (in_span - c * kChunkNumel), static_cast<size_t>(upto - x) * 4);
      x = upto;
    }
  }
}

// ---- sealing ------------------------------------------------------------------------

std::string xxh3_hex(const void* data, size_t bytes) { return hex64(XXH3_64bits(data, bytes)); }

std::string sampled_files_digest(const std::vector<std::pair<std::string, std::string>>& labelled_paths,
                                 const std::string& what) {
  std::string sampled;
  constexpr int kPieces = 64;
  constexpr int64_t kPiece = 4096, kHead = int64_t{1} << 20;
  std::vector<char> buf(static_cast<size_t>(std::max(kPiece, kHead)));
  for (const auto& [label, path] : labelled_paths) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw IoError(path + ": cannot open (for " + what + "'s digest)");
    in.seekg(0, std::ios::end);
    const int64_t size = static_cast<int64_t>(in.tellg());
    sampled += label + ":" + std::to_string(size) + ";";
    auto take = [&](int64_t at, int64_t n) {
      n = std::max<int64_t>(0, std::min(n, size - at));
      in.seekg(at);
      in.read(buf.data(), n);
      if (in.gcount() != n) throw IoError(path + ": a short read (for " + what + "'s digest)");
      sampled.append(buf.data(), static_cast<size_t>(n));
    };
    take(0, kHead);  // for weights: the header (names, shapes, offsets) and the first tensors
    for (int k = 0; k < kPieces; ++k) take(size / kPieces * k + size / (2 * kPieces), kPiece);
  }
  return xxh3_hex(sampled.data(), sampled.size());
}

std::string sealed_dump(nlohmann::json doc, int indent) {
  doc.erase(kSealKey);
  const std::string body = doc.dump();
  doc[kSealKey] = xxh3_hex(body.data(), body.size());
  return doc.dump(indent);
}

void verify_seal(nlohmann::json& doc, const std::string& path) {
  auto it = doc.is_object() ? doc.find(kSealKey) : doc.end();
  if (it == doc.end() || !it->is_string())
    throw IoError("checkpoint: " + path + " has no checksum (key \"" + kSealKey + "\"): edited or damaged");
  const std::string want = it->get<std::string>();
  doc.erase(it);
  const std::string body = doc.dump();
  if (xxh3_hex(body.data(), body.size()) != want)
    throw IoError("checkpoint: " + path + " is corrupted: its checksum does not match its content (edited or damaged)");
}

// ---- small files ------------------------------------------------------------------

std::string read_bytes(const std::string& path) {
  // No size bound: a 1-bit optimizer's file holds a model-sized error feedback.
  return read_small_file(path, std::numeric_limits<int64_t>::max(), "checkpoint file");
}

// ---- locking ------------------------------------------------------------------------

namespace {
// Note [two writers in one process]
// flock guards a folder against other processes only: a second DirLock of
// the same process on the same file takes it again. Two engines of one
// Python process saving into one folder at once (a sweep in threads) then
// shared DIR/.TAG.partial and left `latest` naming a tag without its
// metadata; two zinc.train runs there replaced each other's tags. So the
// process keeps, per lock file, how many runs hold it (a second run is
// refused as another process would be) and a writer mutex, recursive so
// that a save nested in a write of the same thread passes, which kWrite
// locks hold for their whole length: writers of one folder take turns.
// The mutexes live as long as the process (one per folder ever locked).
struct HeldLock {
  UniqueFd fd;
  int users = 0;
  int runs = 0;
  bool remove = false;  // a lock file beside an export: unlinked on release (it is no part of the output)
};
std::mutex g_locks_mutex;
std::map<std::string, HeldLock>& held_locks() {
  static std::map<std::string, HeldLock> m;
  return m;
}
std::recursive_mutex& writer_mutex(const std::string& key) {
  static std::map<std::string, std::unique_ptr<std::recursive_mutex>> m;  // under g_locks_mutex
  std::unique_ptr<std::recursive_mutex>& p = m[key];
  if (!p) p = std::make_unique<std::recursive_mutex>();
  return *p;
}
}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& what, const std::string& lock_file, LockUse use)
    : use_(use) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path lock_dir = lock_file.empty() ? fs::path(dir) : fs::path(lock_file).parent_path();
  fs::create_directories(lock_dir, ec);
  if (ec) throw IoError(what + " " + dir + " cannot be created: " + ec.message());
  const fs::path canonical = fs::canonical(lock_dir, ec);
  if (ec) throw IoError(what + " " + dir + ": " + ec.message());
  key_ = (canonical / (lock_file.empty() ? ".zinc.lock" : fs::path(lock_file).filename().string())).string();
  if (use == LockUse::kWrite) {  // Note [two writers in one process]: after another thread's write
    {
      std::lock_guard<std::mutex> g(g_locks_mutex);
      writing_ = &writer_mutex(key_);
    }
    writing_->lock();
  }
  try {
    take(dir, what, lock_file);
  } catch (...) {
    if (writing_) writing_->unlock();
    throw;
  }
}

void DirLock::take(const std::string& dir, const std::string& what, const std::string& lock_file) {
  std::lock_guard<std::mutex> g(g_locks_mutex);
  HeldLock& h = held_locks()[key_];
  if (use_ == LockUse::kRun && h.runs > 0)
    throw IoError(what + " " + dir + " is in use by another run of this process (pid " + std::to_string(::getpid()) +
                  " holds " + key_ + "): two runs writing one folder would replace each other's files (one that is done "
                  "with it, an engine or a zinc.train generator left open, frees it when closed)");
  if (use_ == LockUse::kRun) h.runs += 1;
  if (h.users++ > 0) return;
  const std::string& path = key_;
  // A lock file that is removed on release (lock_file given) may be
  // unlinked between our open and our flock: then the lock we hold is on a
  // file nobody else will open, and we try again on the path's new file.
  UniqueFd fd;
  for (int attempt = 0;; ++attempt) {
    fd = UniqueFd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (!fd || lock_file.empty() || attempt == 100) break;
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) break;  // held: reported below
    struct stat mine, now;
    if (::fstat(fd.get(), &mine) == 0 && ::stat(path.c_str(), &now) == 0 && mine.st_ino == now.st_ino &&
        mine.st_dev == now.st_dev)
      break;
  }
  if (!fd) {
    const int err = errno;
    held_locks().erase(key_);
    throw IoError(what + " " + dir + " is not writable: cannot create " + path + ": " + std::strerror(err));
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == ENOLCK || err == EOPNOTSUPP) {
      // A file system without locks: the run goes on, unguarded, and says so.
      log_warn(what + " " + dir + ": its file system cannot lock " + path + " (" + std::strerror(err) +
               "); a second run on this folder would not be refused");
    } else {
      held_locks().erase(key_);
      if (err != EWOULDBLOCK) throw_errno(what + " " + dir + ": cannot lock " + path, err);
      // The holder writes its pid just after taking the lock: an empty file
      // is read again for a moment (the refusal named "a process").
      std::string holder;
      for (int tries = 0; tries < 20 && holder.empty(); ++tries) {
        if (tries > 0) ::usleep(10000);
        char buf[256] = {};
        const ssize_t n = ::pread(fd.get(), buf, sizeof buf - 1, 0);
        holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
      }
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      throw IoError(what + " " + dir + " is in use by another run (" +
                    (holder.empty() ? std::string("a process") : holder) + " holds " + path +
                    "): two runs writing one folder would replace each other's files");
    }
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string who = "pid " + std::to_string(::getpid()) + " on " + host + "\n";
  if (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), who.data(), who.size(), 0) != static_cast<ssize_t>(who.size())) {
    const int err = errno;
    held_locks().erase(key_);
    throw IoError(what + " " + dir + " is not writable: cannot write " + path + ": " + std::strerror(err));
  }
  h.fd = std::move(fd);
  h.remove = !lock_file.empty();
}

DirLock::~DirLock() {
  {
    std::lock_guard<std::mutex> g(g_locks_mutex);
    auto it = held_locks().find(key_);
    if (it != held_locks().end() && use_ == LockUse::kRun) it->second.runs -= 1;
    if (it != held_locks().end() && --it->second.users == 0) {
      if (it->second.remove) ::unlink(key_.c_str());  // while still held: see the constructor
      held_locks().erase(it);  // closing the fd unlocks
    }
  }
  if (writing_) writing_->unlock();
}

// ---- committing ---------------------------------------------------------------------

void fsync_dir(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw_errno("checkpoint: cannot open folder " + dir, errno);
  fsync_fd(fd.get(), dir);
}

std::string temp_path(const std::string& path) {
  const size_t slash = path.rfind('/');
  const size_t name = slash == std::string::npos ? 0 : slash + 1;
  return path.substr(0, name) + "." + path.substr(name) + ".zinc-tmp";
}

void write_file_atomic(const std::string& path, const std::string& text, const std::string& writer) {
  const std::string tmp = temp_path(path);
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) throw_errno(writer + ": cannot create " + tmp, errno);
    try {
      write_all(fd.get(), text.data(), text.size(), 0, tmp, writer);
      fsync_fd(fd.get(), tmp, writer);
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw_errno(writer + ": cannot rename " + tmp + " to " + path, err);
  }
}

// Note [what a tag holds]
// A save replaces a tag folder as a whole and pruning removes one, so a tag
// that holds anything a zinc save does not write (a model folder moved in,
// a data file, another run's checkpoint folder) would lose it. A zinc tag
// holds metadata.json, rank<R>.bin and rank<R>.json per rank, and
// onebit<R>.bin with the compressed optimizers (R: five digits or more).
// Returns the first other entry of `tag_dir`, or "".
std::string foreign_entry(const std::string& tag_dir) {
  namespace fs = std::filesystem;
  auto numbered = [](const std::string& name, const std::string& head, const std::string& tail) {
    if (name.size() < head.size() + 5 + tail.size() || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
      return false;
    for (size_t i = head.size(); i < name.size() - tail.size(); ++i)
      if (name[i] < '0' || name[i] > '9') return false;
    return true;
  };
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(tag_dir, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code ec2;
    const bool file = fs::is_regular_file(e.symlink_status(ec2));
    if (file && (name == "metadata.json" || numbered(name, "rank", ".bin") || numbered(name, "rank", ".json") ||
                 numbered(name, "onebit", ".bin")))
      continue;
    return name;
  }
  return "";
}

void check_replaceable_latest(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path p = fs::path(dir) / "latest";
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(p, ec);
  if (!fs::exists(st)) return;
  const std::string advice = "; every save replaces it: move it away, or save into another checkpoint folder";
  if (!fs::is_regular_file(st))
    throw IoError("checkpoint: " + p.string() + " is not a file (" +
                  (fs::is_symlink(st) ? "a symbolic link" : fs::is_directory(st) ? "a folder" : "not a regular file") +
                  ")" + advice);
  // A pointer a save wrote: one line naming a tag of the folder (or a
  // global_step<N> whose folder was removed by hand).
  std::string text;
  bool ours = fs::file_size(p, ec) <= 4096 && !ec;
  if (ours) {
    std::ifstream in(p, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (!text.empty() && text.back() == '\n') text.pop_back();
    ours = !text.empty() && text.find_first_of(std::string("\n\r/\0", 4)) == std::string::npos && text != "." &&
           text != "..";
    ours = ours && (tag_step(text) >= 0 || fs::is_directory(fs::symlink_status(fs::path(dir) / text, ec)));
  }
  if (!ours)
    throw IoError("checkpoint: " + p.string() +
                  " is not a checkpoint pointer (a save writes one line there naming a tag of the folder; a file "
                  "of yours?)" + advice);
}

void check_replaceable_tag(const std::string& dir, const std::string& tag) {
  namespace fs = std::filesystem;
  const fs::path p = fs::path(dir) / tag;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(p, ec);
  if (!fs::exists(st)) return;
  const std::string advice = ": a save of the tag " + tag + " would replace it; move it away, or save into another "
                             "checkpoint folder";
  if (!fs::is_directory(st))
    throw IoError("checkpoint: " + p.string() + " exists and is not a zinc checkpoint tag (" +
                  (fs::is_symlink(st) ? "a symbolic link" : "a file") + ")" + advice);
  // The format key, anywhere in the metadata (its keys are sorted).
  const fs::path meta = p / "metadata.json";
  bool zinc = false;
  if (fs::is_regular_file(fs::symlink_status(meta, ec))) {
    std::ifstream in(meta, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    zinc = text.find("\"format\": \"zinc-checkpoint\"") != std::string::npos ||
           text.find("\"format\":\"zinc-checkpoint\"") != std::string::npos;
  }
  if (!zinc)
    throw IoError("checkpoint: " + p.string() + " exists and is not a zinc checkpoint tag (no zinc metadata.json: "
                  "another tool's checkpoint, or a folder of yours)" + advice);
  if (const std::string other = foreign_entry(p.string()); !other.empty())
    throw IoError("checkpoint: " + p.string() + " holds " + other + ", which a zinc save does not write (yours?)" +
                  advice);
}

void commit_tag(const std::string& parent, const std::string& tmp, const std::string& tag) {
  namespace fs = std::filesystem;
  fsync_dir(tmp);
  fault_point("before_rename");
  const fs::path final_dir = fs::path(parent) / tag;
  std::error_code ec;
  if (fs::exists(final_dir)) {
    // The tag is saved again: swap the new folder in atomically (the old
    // one ends up at `tmp`), so no moment leaves the tag missing while
    // `latest` may name it.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ENOSYS)
        throw_errno("checkpoint: cannot exchange " + tmp + " with " + final_dir.string(), err);
      // A file system without the exchange: the old folder aside first.
      const fs::path old = fs::path(parent) / ("." + tag + ".old");
      fs::remove_all(old, ec);
      if (::rename(final_dir.c_str(), old.c_str()) != 0)
        throw_errno("checkpoint: cannot move the previous " + final_dir.string() + " aside", errno);
      fault_point("old_aside");
      if (::rename(tmp.c_str(), final_dir.c_str()) != 0)
        throw_errno("checkpoint: cannot rename " + tmp + " to " + final_dir.string(), errno);
      fsync_dir(parent);
      fs::remove_all(old, ec);
    } else {
      fsync_dir(parent);
      fault_point("old_aside");
      fs::remove_all(tmp, ec);  // the previous folder of the tag
    }
  } else {
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0)
      throw_errno("checkpoint: cannot rename " + tmp + " to " + final_dir.string(), errno);
    fsync_dir(parent);
    // The tag's copy a fallback save left aside when it was stopped between
    // its renames (open_tag reads it while the tag is missing): superseded.
    fs::remove_all(fs::path(parent) / ("." + tag + ".old"), ec);
  }
  fault_point("before_latest");
  write_file_atomic((fs::path(parent) / "latest").string(), tag + "\n");
  fsync_dir(parent);
  fault_point("after_latest");
}

// ---- pruning ------------------------------------------------------------------------

namespace {
}  // namespace

int64_t tag_step(const std::string& name) {
  if (name.rfind("global_step", 0) != 0 || name.size() == 11 || name.size() > 11 + 18) return -1;
  int64_t n = 0;
  for (size_t i = 11; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

std::vector<std::string> prune(const std::string& dir, int64_t keep, const std::string& saved) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  const int64_t newest = tag_step(saved);
  if (keep <= 0 || newest < 0) return removed;
  std::string latest;
  try {
    latest = read_bytes((fs::path(dir) / "latest").string());
  } catch (const IoError&) {
  }
  if (!latest.empty() && latest.back() == '\n') latest.pop_back();
  std::vector<std::pair<int64_t, std::string>> older;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 8 && n[0] == '.' && n.compare(n.size() - 7, 7, ".pruned") == 0 &&
        tag_step(n.substr(1, n.size() - 8)) >= 0) {
      fs::remove_all(e.path(), ec);  // .global_step<M>.pruned: a removal a crash interrupted
      continue;
    }
    const int64_t step = tag_step(n);
    std::error_code ec2;
    if (step < 0 || step >= newest || n == latest || n == saved || !e.is_directory(ec2) ||
        !fs::exists(e.path() / "metadata.json", ec2))
      continue;
    older.emplace_back(step, n);
  }
  std::sort(older.rbegin(), older.rend());  // newest first
  for (size_t i = static_cast<size_t>(keep - 1); i < older.size(); ++i) {
    const fs::path from = fs::path(dir) / older[i].second;
    const fs::path to = fs::path(dir) / ("." + older[i].second + ".pruned");
    if (const std::string other = foreign_entry(from.string()); !other.empty()) {
      log_warn("run.keep_last: kept " + from.string() + ": it holds " + other +
               ", which a zinc save does not write (yours?); remove the tag yourself once that is moved out");
      continue;
    }
    fs::remove_all(to, ec);
    if (::rename(from.c_str(), to.c_str()) != 0) {
      log_warn("run.keep_last: could not remove " + from.string() + ": " + std::strerror(errno));
      continue;
    }
    fault_point("prune");
    fs::remove_all(to, ec);
    removed.push_back(older[i].second);
  }
  return removed;
}

}  // namespace zinc::ckpt
