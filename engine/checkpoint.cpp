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
#include <mutex>
#include <set>

#include "core/error.h"
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

void write_all(int fd, const void* data, size_t bytes, off_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("checkpoint: write of " + path + " at offset " + std::to_string(offset) + " failed", errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += n;
  }
}

void fsync_fd(int fd, const std::string& path) {
  if (::fsync(fd) != 0) throw_errno("checkpoint: fsync of " + path + " failed", errno);
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
  if (!fd) throw_errno("checkpoint: cannot open " + path, errno);
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

// ---- opening ------------------------------------------------------------------------

namespace {

std::string escaped(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Checked reads of one checkpoint file's JSON: a missing key, a wrong type or
// a value out of range is an IoError naming the file and the JSON path.
class Fields {
 public:
  explicit Fields(std::string file) : file_(std::move(file)) {}
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw IoError("checkpoint: " + file_ + ": " + (path.empty() ? "" : path + ": ") + what +
                  " (edited or damaged; nothing was loaded)");
  }
  const nlohmann::json& at(const nlohmann::json& j, const std::string& path, const char* key) const {
    if (!j.is_object()) fail(path, "expected an object, got " + brief(j));
    auto it = j.find(key);
    if (it == j.end()) fail(join(path, key), "missing");
    return *it;
  }
  int64_t integer(const nlohmann::json& j, const std::string& path, int64_t lo, int64_t hi) const {
    if (!j.is_number_integer() || (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(hi)) ||
        j.get<int64_t>() < lo || j.get<int64_t>() > hi)
      fail(path, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + brief(j));
    return j.get<int64_t>();
  }
  int64_t integer(const nlohmann::json& j, const std::string& path, const char* key, int64_t lo, int64_t hi) const {
    return integer(at(j, path, key), join(path, key), lo, hi);
  }
  void number_or_null(const nlohmann::json& j, const std::string& path, const char* key) const {
    const nlohmann::json& v = at(j, path, key);
    if (!v.is_number() && !v.is_null()) fail(join(path, key), "expected a number or null, got " + brief(v));
  }
  const std::string& string(const nlohmann::json& j, const std::string& path, const char* key) const {
    const nlohmann::json& v = at(j, path, key);
    if (!v.is_string()) fail(join(path, key), "expected a string, got " + brief(v));
    return v.get_ref<const std::string&>();
  }
  const nlohmann::json& array(const nlohmann::json& j, const std::string& path, const char* key) const {
    const nlohmann::json& v = at(j, path, key);
    if (!v.is_array()) fail(join(path, key), "expected an array, got " + brief(v));
    return v;
  }
  static std::string join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }
  static std::string item(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

 private:
  static std::string brief(const nlohmann::json& j) {
    std::string d = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return d.size() > 60 ? d.substr(0, 57) + "..." : d;
  }
  std::string file_;
};

std::string read_bytes(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) throw_errno("checkpoint: cannot open " + path, errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw_errno("checkpoint: cannot stat " + path, errno);
  if (!S_ISREG(st.st_mode)) throw IoError("checkpoint: " + path + " is not a regular file");
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("checkpoint: read of " + path + " failed", errno);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// A checkpoint's JSON file: ours, so any parse error is damage.
nlohmann::json parse_file(const std::string& path, const std::string& text) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw IoError("checkpoint: " + path + " is not valid JSON (edited or damaged): " + e.what());
  }
}

std::string rank_file(int r, const char* ext) {
  char name[32];
  std::snprintf(name, sizeof name, "rank%05d.%s", r, ext);
  return name;
}

// The structure of a tag, checked (the Note's list): `meta` is sealed-checked
// already; `ranks` are the parsed indexes.
void check_structure(const TagFiles& t) {
  namespace fs = std::filesystem;
  const std::string meta_path = t.dir + "/metadata.json";
  const Fields mf(meta_path);
  const nlohmann::json& meta = t.meta;
  const int64_t world = mf.integer(meta, "", "world_size", 1, int64_t{1} << 24);
  mf.integer(meta, "", "zero_stage", 0, 3);
  const nlohmann::json& blocks = mf.array(meta, "", "blocks");
  std::vector<int64_t> numel;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const std::string at = Fields::item("blocks", b);
    mf.string(blocks[b], at, "name");
    numel.push_back(mf.integer(blocks[b], at, "numel", 0, int64_t{1} << 50));
    const nlohmann::json& params = mf.array(blocks[b], at, "params");
    for (size_t p = 0; p < params.size(); ++p) {
      const std::string pa = Fields::item(at + ".params", p);
      mf.string(params[p], pa, "name");
      const nlohmann::json& shape = mf.array(params[p], pa, "shape");
      int64_t n = 1;  // elements, saturating past any block's size
      for (size_t d = 0; d < shape.size(); ++d) {
        const int64_t dim = mf.integer(shape[d], Fields::item(pa + ".shape", d), 0, int64_t{1} << 40);
        n = dim == 0 ? 0 : n > (int64_t{1} << 52) / dim ? int64_t{1} << 52 : n * dim;
      }
      const int64_t off = mf.integer(params[p], pa, "offset", 0, int64_t{1} << 50);
      if (off + n > numel.back())
        mf.fail(pa, "elements " + std::to_string(off) + ".." + std::to_string(off + n) + " lie past the block's " +
                        std::to_string(numel.back()));
    }
  }
  if (static_cast<int64_t>(t.ranks.size()) != world)
    mf.fail("rank_indexes", std::to_string(t.ranks.size()) + " indexes for world_size " + std::to_string(world));
  const nlohmann::json& tr = mf.at(meta, "", "training");
  for (const char* k : {"global_steps", "micro_steps", "skipped_steps", "optimizer_steps"})
    mf.integer(tr, "training", k, 0, int64_t{1} << 62);
  mf.number_or_null(tr, "training", "lr");
  if (!tr.at("lr").is_number()) mf.fail("training.lr", "expected a number, got null");
  mf.number_or_null(tr, "training", "grad_norm");
  mf.number_or_null(tr, "training", "last_loss");
  if (tr.contains("loss_scale")) {
    const nlohmann::json& ls = tr["loss_scale"];
    mf.number_or_null(ls, "training.loss_scale", "scale");
    if (!ls.at("scale").is_number()) mf.fail("training.loss_scale.scale", "expected a number, got null");
    for (const char* k : {"hysteresis", "iteration", "last_overflow"})
      mf.integer(ls, "training.loss_scale", k, -(int64_t{1} << 62), int64_t{1} << 62);
  }

  // Spans per block, for the coverage check: (flat_offset, count) -> ranks.
  std::vector<std::map<std::pair<int64_t, int64_t>, int>> spans(blocks.size());
  for (size_t r = 0; r < t.ranks.size(); ++r) {
    const nlohmann::json& rk = t.ranks[r];
    const std::string index_path = t.dir + "/" + rank_file(static_cast<int>(r), "json");
    const Fields f(index_path);
    if (f.integer(rk, "", "rank", 0, world - 1) != static_cast<int64_t>(r))
      f.fail("rank", "is " + rk.at("rank").dump() + ", not " + std::to_string(r));
    const std::string bin = rank_file(static_cast<int>(r), "bin");
    if (f.string(rk, "", "file") != bin) f.fail("file", "is " + escaped(rk.at("file").get<std::string>()) + ", not \"" + bin + "\"");
    if (f.integer(rk, "", "chunk_elements", 1, int64_t{1} << 40) != kChunkNumel)
      f.fail("chunk_elements", "is " + rk.at("chunk_elements").dump() + ", not zinc's " + std::to_string(kChunkNumel));
    const std::string bin_path = t.dir + "/" + bin;
    struct stat st;
    if (::stat(bin_path.c_str(), &st) != 0) throw_errno("checkpoint: cannot open " + bin_path, errno);
    if (!S_ISREG(st.st_mode)) throw IoError("checkpoint: " + bin_path + " is not a regular file");
    const int64_t size_now = st.st_size;
    // Written by this version: the size the writer allocated. Version 1
    // indexes have none; their regions are checked against the file alone.
    const bool sized = rk.contains("file_bytes");
    const int64_t file_bytes = sized ? f.integer(rk, "", "file_bytes", 0, int64_t{1} << 56) : INT64_MAX;
    const nlohmann::json& bl = f.array(rk, "", "blocks");
    std::set<int64_t> seen;
    std::vector<std::pair<int64_t, int64_t>> regions;  // [begin, end) in the file
    std::string past_end;  // the first region past the file's end now
    int64_t past_at = -1;
    for (size_t i = 0; i < bl.size(); ++i) {
      const std::string at = Fields::item("blocks", i);
      const int64_t b = f.integer(bl[i], at, "block", 0, static_cast<int64_t>(blocks.size()) - 1);
      if (!seen.insert(b).second) f.fail(at + ".block", "block " + std::to_string(b) + " appears twice");
      const int64_t off = f.integer(bl[i], at, "flat_offset", 0, int64_t{1} << 50);
      const int64_t count = f.integer(bl[i], at, "count", 0, int64_t{1} << 50);
      const int64_t chunks = (count + kChunkNumel - 1) / kChunkNumel;
      int k = 0;
      for (const char* key : {"master", "m", "v"}) {
        const std::string ka = at + "." + key;
        const nlohmann::json& kind = f.at(bl[i], at, key);
        const int64_t fo = f.integer(kind, ka, "file_offset", 0, int64_t{1} << 56);
        const nlohmann::json& sums = f.array(kind, ka, "xxh3_64_per_chunk");
        if (static_cast<int64_t>(sums.size()) != chunks)
          f.fail(ka + ".xxh3_64_per_chunk", std::to_string(sums.size()) + " checksums for " + std::to_string(count) +
                                                " elements (" + std::to_string(chunks) + " chunks)");
        for (size_t c = 0; c < sums.size(); ++c)
          if (!sums[c].is_string() || sums[c].get_ref<const std::string&>().size() != 16)
            f.fail(Fields::item(ka + ".xxh3_64_per_chunk", c), "expected 16 hex digits");
        const int64_t end = fo + count * 4;
        if (end > file_bytes)
          f.fail(ka, "bytes " + std::to_string(fo) + ".." + std::to_string(end) + " lie past the file's " +
                         std::to_string(file_bytes));
        if (count > 0) regions.emplace_back(fo, end);
        if (end > size_now && (past_at < 0 || fo < past_at)) {
          past_at = fo;
          const std::string name = blocks[static_cast<size_t>(b)].at("name").get<std::string>();
          past_end = "block '" + name + "' " + kind_name(k) + " (elements " + std::to_string(off) + ".." +
                     std::to_string(off + count) + ") is saved at bytes " + std::to_string(fo) + ".." +
                     std::to_string(end);
        }
        ++k;
      }
      if (count > 0) ++spans[static_cast<size_t>(b)][{off, count}];
    }
    if ((sized && size_now < file_bytes) || !past_end.empty())
      throw IoError("checkpoint: " + bin_path + " is truncated: it has " + std::to_string(size_now) +
                    " bytes" + (past_end.empty() ? ", its index says " + std::to_string(file_bytes) : ", and " + past_end) +
                    " (nothing was loaded)");
    std::sort(regions.begin(), regions.end());
    for (size_t i = 1; i < regions.size(); ++i)
      if (regions[i].first < regions[i - 1].second)
        f.fail("blocks", "two regions overlap at byte " + std::to_string(regions[i].first) + " of " + bin);
  }
  // Every element of every block saved: the distinct spans tile the block
  // from 0 past its last element (the last shard's padding may follow), and
  // spans that repeat (stage 0: every rank saves the whole block) are equal.
  for (size_t b = 0; b < blocks.size(); ++b) {
    const std::string name = blocks[b].at("name").get<std::string>();
    int64_t end = 0;
    for (const auto& [span, ranks] : spans[b]) {
      if (span.first != end)
        mf.fail("rank_indexes",
                "block '" + name + "' " +
                    (span.first > end ? "has no saved elements " + std::to_string(end) + ".." + std::to_string(span.first)
                                      : "has elements from " + std::to_string(span.first) + " saved twice") +
                    " in the rank indexes");
      end = span.first + span.second;
    }
    if (end < numel[b])
      mf.fail("rank_indexes", "block '" + name + "' has " + std::to_string(numel[b]) + " elements but the rank indexes save " +
                                  (end == 0 ? "none" : "only 0.." + std::to_string(end)));
  }
}

}  // namespace

void check_tag(const std::string& tag) {
  bool ok = !tag.empty() && tag.size() <= kMaxTagBytes && tag != "latest" &&
            (std::isalnum(static_cast<unsigned char>(tag[0])) || tag[0] == '_');
  for (char c : tag)
    ok = ok && c > 0 && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == '+');
  if (!ok)
    throw Error("checkpoint tag " + escaped(tag) + ": a tag is one folder name of 1 to " + std::to_string(kMaxTagBytes) +
                " characters from A-Z a-z 0-9 . _ - +, starting with a letter, a digit or '_', and not \"latest\"");
}

TagFiles open_tag(const std::string& dir, std::string tag) {
  namespace fs = std::filesystem;
  const bool from_latest = tag.empty();
  if (from_latest) {
    const std::string latest = (fs::path(dir) / "latest").string();
    if (!fs::exists(latest)) throw IoError("checkpoint: " + latest + " not found (no complete checkpoint in " + dir + ")");
    tag = read_bytes(latest);
    if (tag.size() > kMaxTagBytes + 1) tag.resize(kMaxTagBytes + 1);
    if (!tag.empty() && tag.back() == '\n') tag.pop_back();
    try {
      check_tag(tag);
    } catch (const Error& e) {
      throw IoError("checkpoint: " + latest + " does not name a tag (edited or damaged): " + e.what());
    }
  }
  check_tag(tag);
  TagFiles t;
  t.tag = tag;
  t.dir = (fs::path(dir) / tag).string();
  const std::string meta_path = (fs::path(t.dir) / "metadata.json").string();
  if (from_latest && !fs::exists(t.dir))  // `latest` is only ever written naming a complete tag
    throw IoError("checkpoint: " + (fs::path(dir) / "latest").string() + " names " + escaped(tag) +
                  ", which is not a checkpoint in " + dir + " (the file was edited or damaged, or the tag removed)");
  if (!fs::exists(meta_path))
    throw IoError("checkpoint " + t.dir + ": " + meta_path + " not found (not a complete zinc checkpoint)");
  t.meta = parse_file(meta_path, read_bytes(meta_path));
  if (!t.meta.is_object() || t.meta.value("format", "") != "zinc-checkpoint")
    throw IoError("checkpoint " + t.dir + ": " + meta_path + " is not a zinc checkpoint's metadata");
  const nlohmann::json version = t.meta.value("version", nlohmann::json());
  if (version == 2 || t.meta.contains(kSealKey)) {
    verify_seal(t.meta, meta_path);
  } else if (version == 1) {
    static std::once_flag once;
    std::call_once(once, [&] {
      log_warn("checkpoint " + t.dir + " was written by a zinc before checksummed metadata: its indexes are checked "
               "for consistency but an edit that keeps them consistent would go unnoticed");
    });
  }
  if (version != 1 && version != 2)
    throw IoError("checkpoint " + t.dir + ": format version " + version.dump() + " is not one this zinc reads (1, 2)");
  const Fields mf(meta_path);
  const nlohmann::json& indexes = mf.array(t.meta, "", "rank_indexes");
  t.ranks = nlohmann::json::array();
  for (size_t r = 0; r < indexes.size(); ++r) {
    const std::string at = Fields::item("rank_indexes", r);
    const std::string want = rank_file(static_cast<int>(r), "json");
    const nlohmann::json& entry = indexes[r];
    const bool v2 = version == 2;
    const std::string name = v2 ? mf.string(entry, at, "file") : entry.is_string() ? entry.get<std::string>() : "";
    if (name != want) mf.fail(v2 ? at + ".file" : at, "expected \"" + want + "\"");
    const std::string path = (fs::path(t.dir) / name).string();
    if (!fs::exists(path)) throw IoError("checkpoint " + t.dir + ": " + path + " not found (the checkpoint is incomplete)");
    const std::string text = read_bytes(path);
    if (v2) {
      const int64_t bytes = mf.integer(entry, at, "bytes", 0, int64_t{1} << 40);
      if (static_cast<int64_t>(text.size()) != bytes || xxh3_hex(text.data(), text.size()) != mf.string(entry, at, "xxh3_64"))
        throw IoError("checkpoint: " + path + " is corrupted: its size or checksum is not the one " + meta_path +
                      " holds (edited, damaged or from another checkpoint; nothing was loaded)");
    }
    t.ranks.push_back(parse_file(path, text));
  }
  check_structure(t);
  for (const nlohmann::json& b : t.meta.at("blocks")) t.block_names.push_back(b.at("name").get<std::string>());
  return t;
}

// ---- locking ------------------------------------------------------------------------

namespace {
struct HeldLock {
  UniqueFd fd;
  int users = 0;
};
std::mutex g_locks_mutex;
std::map<std::string, HeldLock>& held_locks() {
  static std::map<std::string, HeldLock> m;
  return m;
}
}  // namespace

DirLock::DirLock(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError("checkpoint folder " + dir + " cannot be created: " + ec.message());
  key_ = fs::canonical(dir, ec).string();
  if (ec) throw IoError("checkpoint folder " + dir + ": " + ec.message());
  std::lock_guard<std::mutex> g(g_locks_mutex);
  HeldLock& h = held_locks()[key_];
  if (h.users++ > 0) return;
  const std::string path = key_ + "/.zinc.lock";
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) {
    const int err = errno;
    held_locks().erase(key_);
    throw IoError("checkpoint folder " + dir + " is not writable: cannot create " + path + ": " + std::strerror(err));
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == ENOLCK || err == EOPNOTSUPP) {
      // A file system without locks: the run goes on, unguarded, and says so.
      log_warn("checkpoint folder " + dir + ": its file system cannot lock " + path + " (" + std::strerror(err) +
               "); a second run on this folder would not be refused");
    } else {
      held_locks().erase(key_);
      if (err != EWOULDBLOCK) throw_errno("checkpoint folder " + dir + ": cannot lock " + path, err);
      char buf[256] = {};
      const ssize_t n = ::pread(fd.get(), buf, sizeof buf - 1, 0);
      std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
      throw IoError("checkpoint folder " + dir + " is in use by another run (" +
                    (holder.empty() ? std::string("a process") : holder) + " holds " + path +
                    "): two runs writing one folder would replace each other's checkpoints");
    }
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string who = "pid " + std::to_string(::getpid()) + " on " + host + "\n";
  if (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), who.data(), who.size(), 0) != static_cast<ssize_t>(who.size())) {
    const int err = errno;
    held_locks().erase(key_);
    throw IoError("checkpoint folder " + dir + " is not writable: cannot write " + path + ": " + std::strerror(err));
  }
  h.fd = std::move(fd);
}

DirLock::~DirLock() {
  std::lock_guard<std::mutex> g(g_locks_mutex);
  auto it = held_locks().find(key_);
  if (it != held_locks().end() && --it->second.users == 0) held_locks().erase(it);  // closing the fd unlocks
}

// ---- committing ---------------------------------------------------------------------

void fsync_dir(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw_errno("checkpoint: cannot open folder " + dir, errno);
  fsync_fd(fd.get(), dir);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) throw_errno("checkpoint: cannot create " + tmp, errno);
    try {
      write_all(fd.get(), text.data(), text.size(), 0, tmp);
      fsync_fd(fd.get(), tmp);
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw_errno("checkpoint: cannot rename " + tmp + " to " + path, err);
  }
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
  }
  fault_point("before_latest");
  write_file_atomic((fs::path(parent) / "latest").string(), tag + "\n");
  fsync_dir(parent);
  fault_point("after_latest");
}

// ---- pruning ------------------------------------------------------------------------

namespace {
// N of "global_stepN" (digits only), or -1.
int64_t tag_step(const std::string& name) {
  if (name.rfind("global_step", 0) != 0 || name.size() == 11 || name.size() > 11 + 18) return -1;
  int64_t n = 0;
  for (size_t i = 11; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}
}  // namespace

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
