// zinc engine: training data sources and the data-parallel loader.
//
// Note [data order]
// A sample's identity is its global position p in the stream of all samples
// the loader will ever hand out (across ranks and epochs). Position p belongs
// to epoch e = p / N (N = source.num_samples()) and reads sample
// order_e[p % N], where order_e is a permutation of [0, N) drawn from
// Rng(mix_seed(shuffle_seed, e)). Global batch g covers positions
// [g*G, (g+1)*G), G = micro_batch * grad_accum * world_size; rank r owns the
// contiguous slice [g*G + r*G/W, g*G + (r+1)*G/W) and reads it in grad_accum
// micro-batches of micro_batch consecutive positions. Hence ranks never
// overlap, their union is the global batch, and the samples of a global batch
// do not depend on how it is split into (W, grad_accum, micro_batch).
// position() counts samples consumed by all ranks in lockstep:
// g*G + k*micro_batch*W after k micro-batches of global batch g.
//
// Permutations: Fisher-Yates, materialised, when N <= kMaxMaterialisedOrder;
// for larger N (the synthetic source's 2^40-sample epoch) a seeded bijection
// on the next power of two with cycle walking, computed per position, so no
// O(N) table is ever built.
#include "data/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <isa-l/crc.h>

#include "core/cpu.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/unique_fd.h"

namespace zinc {
namespace {

constexpr int64_t kSyntheticEpoch = int64_t{1} << 40;  // samples per synthetic "epoch"
// Synthetic evaluation samples are indexed from here: disjoint from training.
constexpr int64_t kSyntheticEvalBase = int64_t{1} << 41;
constexpr int64_t kMaxSyntheticTable = int64_t{1} << 26;  // V*V entries (256 MiB of int32)
constexpr int64_t kMaxMaterialisedOrder = int64_t{1} << 24;  // 128 MiB of int64 indices
constexpr int32_t kTokenFileMagic = 20240520;    // first int32 of the GPT-2 scripts' header: uint16, version 1
constexpr int32_t kTokenFileMagic32 = 20240801;  // the same scripts' Llama 3 files: uint32, version 7
constexpr int64_t kMaxTokenVocab = int64_t{1} << 24;  // the largest vocabulary a model takes
constexpr int64_t kTokenHeaderBytes = 256 * 4;
// Note [prepared sets]
// --------------------
// zinc.prepare writes PREFIX.bin, PREFIX.mask, PREFIX.docs and the manifest
// PREFIX.json as one set, renamed into place one file at a time: the mask,
// the documents, the token file, and the manifest (whose old version goes
// first) last. The token file is the data's commit point: its header
// (llm.c's 256 int32s: magic, version, token count) records
// the set in slots the llm.c readers leave at zero:
//   [3] kSetMarker ("ZINC" in file order), [4] kSetVersion,
//   [5] zlib's CRC-32 of PREFIX.mask, [6..7] its size in bytes (low, high),
//   [8] the CRC-32 of PREFIX.docs, [9..10] its size,
//   [11] the seq_len its examples were packed in rows of (zinc.prepare
//   --pack rows; 0 for a stream): another data.seq_len is said, since the
//   rows then no longer keep each example whole;
//   [12] kTokensCrcMarker ("TCRC" in file order), [13] the CRC-32 of the
//   tokens after the header (0 in both for sets of an earlier zinc.prepare:
//   not checked).
// A mask or documents file that sits beside the token file under its prefix
// must be the one its header records: a run killed between two renames
// leaves an old token file with a new mask (or the reverse when files are
// swapped by hand), which trains without error on targets that are not the
// tokens'. Such a set is refused naming the file. A mask or documents file
// under another name (made by hand for this token file) is not checked, and
// neither is a token file whose words 3-10 are all zero (llm.c's, an older
// zinc's). Other values there (a damaged marker) are refused.
// The token file's own CRC is checked in the pass over its tokens that
// every open makes (the largest token, the vocabulary): a .bin edited or
// damaged after zinc.prepare wrote it would otherwise train without a word
// on tokens that are not the data's. The CRC (ISA-L) adds about a sixth to
// that pass over page-cached data, which reads the file anyway; less where
// the disk is slower (`zinc-bench data-open`, bench/RESULTS.md "The token
// file's own CRC").
constexpr int32_t kSetMarker = 0x434E495A;
constexpr int32_t kSetVersion = 1;
constexpr int32_t kTokensCrcMarker = 0x43524354;

std::string fmt_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// ---------------------------------------------------------------------------
// Files.

// A data file opened for reading: a regular file, or an IoError naming it.
// open() uses O_NONBLOCK so that a FIFO (or a tty) cannot block it waiting
// for a writer; fstat on the open descriptor then refuses everything but a
// regular file (no race between the check and the file read). O_NONBLOCK
// has no effect on reads from a regular file.
struct DataFile {
  UniqueFd fd;
  int64_t size = 0;
  std::string key;  // the config key that named it (data.path, data.mask_path, ...), for errors
};

DataFile open_data_file(const std::string& path, const std::string& key = "data.path") {
  DataFile f;
  f.key = key;
  f.fd = UniqueFd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (f.fd.get() < 0) throw posix_error(key + ": cannot open " + path, errno);
  struct stat st;
  if (::fstat(f.fd.get(), &st) != 0) throw posix_error(key + ": stat " + path, errno);
  if (!S_ISREG(st.st_mode))
    throw IoError(key + ": " + path + " is " + file_kind(st.st_mode) +
                  "; a data file must be a regular file (it is read by offset, more than once)");
  f.size = static_cast<int64_t>(st.st_size);
  return f;
}

// Reads exactly `len` bytes at `offset`. The file may have shrunk since it
// was opened (truncated or rewritten under a running job): that is an
// IoError naming the file, the bytes wanted and its size now. This is why
// the data files are read with pread and not mapped: a mapped page past the
// new end of file is a SIGBUS, which no caller can catch, and the process
// dies with no message and no checkpoint.
void read_at(const DataFile& f, const std::string& path, int64_t offset, unsigned char* dst, int64_t len) {
  int64_t done = 0;
  while (done < len) {
    const ssize_t n = ::pread(f.fd.get(), dst + done, static_cast<size_t>(len - done),
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw posix_error(f.key + ": read " + path + " at offset " + std::to_string(offset + done), errno);
    }
    if (n == 0) {
      struct stat st;
      const std::string now =
          ::fstat(f.fd.get(), &st) == 0 ? std::to_string(st.st_size) + " bytes" : "unknown";
      throw IoError(f.key + ": " + path + " shrank while in use: reading bytes [" +
                    std::to_string(offset) + ", " + std::to_string(offset + len) +
                    ") but the file is now " + now + " (it was " + std::to_string(f.size) +
                    " when opened); was it truncated or rewritten during training?");
    }
    done += n;
  }
}

// Note [the open scan]
// An open reads the whole token file, and the mask, to check them (the
// largest token against the vocabulary, the CRC-32s zinc.prepare recorded,
// every mask byte 0 or 1). Reading and checking ran one after the other,
// so an open took the time of both: 0.45-0.53 of the read rate on a
// page-cached file (`zinc-bench data-open`). Two changes:
// - ChunkReader reads ahead on a thread of its own into a ring of buffers,
//   so that one chunk is checked while the next is read;
// - the checks' loops are compiled for the CPU's vector width
//   (ZINC_ISA_VARIANTS: the build's baseline is SSE2, which has no unsigned
//   16-bit maximum), and the mask's loop no longer stops to test each byte:
//   its largest byte and its zeros are counted per chunk, and only a chunk
//   whose largest byte is above 1 is searched for the first bad one.
// next() hands the chunks out in file order and rethrows a read's error
// (naming the file and offset) at the chunk that failed; a caller that
// stops early (a bad mask byte) stops the reader in the destructor. Where
// no thread can be started the chunks are read in the caller's thread.
class ChunkReader {
 public:
  static constexpr int kRing = 3;
  ChunkReader(const DataFile& f, const std::string& path, int64_t offset, int64_t bytes, int64_t chunk)
      : f_(f), path_(path), offset_(offset), bytes_(bytes), chunk_(chunk),
        chunks_(bytes > 0 ? (bytes + chunk - 1) / chunk : 0) {
    for (auto& b : ring_) b.resize(static_cast<size_t>(chunks_ > 1 ? chunk : std::max<int64_t>(bytes, 0)));
    if (chunks_ > 1) {
      try {
        reader_ = std::thread([this] { run(); });
      } catch (const std::system_error&) {
        // no thread: next() reads
      }
    }
  }
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;
  ~ChunkReader() {
    if (reader_.joinable()) {
      {
        std::scoped_lock lock(mu_);
        stop_ = true;
      }
      freed_cv_.notify_all();
      reader_.join();
    }
  }
  // The next chunk's bytes and its length; {nullptr, 0} after the last.
  std::pair<const unsigned char*, int64_t> next() {
    if (taken_ == chunks_) return {nullptr, 0};
    const int64_t k = taken_++;
    std::vector<unsigned char>& b = ring_[static_cast<size_t>(k % kRing)];
    if (!reader_.joinable()) {
      read_at(f_, path_, offset_ + k * chunk_, b.data(), length(k));
      return {b.data(), length(k)};
    }
    std::unique_lock lock(mu_);
    released_ = k;  // the chunks before k are done with
    freed_cv_.notify_all();
    filled_cv_.wait(lock, [&] { return filled_ > k || error_; });
    if (filled_ <= k) std::rethrow_exception(error_);
    return {b.data(), length(k)};
  }

 private:
  int64_t length(int64_t k) const { return std::min(chunk_, bytes_ - k * chunk_); }
  void run() {
    try {
      for (int64_t k = 0; k < chunks_; ++k) {
        {
          std::unique_lock lock(mu_);
          freed_cv_.wait(lock, [&] { return stop_ || k < released_ + kRing; });
          if (stop_) return;
        }
        read_at(f_, path_, offset_ + k * chunk_, ring_[static_cast<size_t>(k % kRing)].data(), length(k));
        {
          std::scoped_lock lock(mu_);
          filled_ = k + 1;
        }
        filled_cv_.notify_one();
      }
    } catch (...) {
      {
        std::scoped_lock lock(mu_);
        error_ = std::current_exception();
      }
      filled_cv_.notify_one();
    }
  }

  const DataFile& f_;
  const std::string& path_;
  const int64_t offset_, bytes_, chunk_, chunks_;
  std::vector<unsigned char> ring_[kRing];
  std::mutex mu_;
  std::condition_variable filled_cv_, freed_cv_;
  int64_t filled_ = 0;    // chunks read (under mu_)
  int64_t released_ = 0;  // chunks the caller is done with (under mu_)
  bool stop_ = false;
  std::exception_ptr error_;
  int64_t taken_ = 0;  // the caller's
  std::thread reader_;
};

// The largest of n little-endian tokens, and a mask chunk's largest byte and
// zeros (Note [the open scan]). On a little-endian host a load of the native
// integer; the loops are plain, for the vectoriser.
template <class T>
ZINC_ALWAYS_INLINE int64_t max_le_body(const unsigned char* __restrict b, int64_t n) {
  T m = 0;
  for (int64_t k = 0; k < n; ++k) {
    T v;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(&v, b + sizeof(T) * static_cast<size_t>(k), sizeof(T));
    } else {
      v = 0;
      for (size_t i = 0; i < sizeof(T); ++i) v = static_cast<T>(v | T{b[sizeof(T) * static_cast<size_t>(k) + i]} << (8 * i));
    }
    m = v > m ? v : m;
  }
  return m;
}
ZINC_ALWAYS_INLINE int64_t max_le16_body(const unsigned char* b, int64_t n) { return max_le_body<uint16_t>(b, n); }
ZINC_ALWAYS_INLINE int64_t max_le32_body(const unsigned char* b, int64_t n) { return max_le_body<uint32_t>(b, n); }
ZINC_ISA_VARIANTS(int64_t, max_le16, (const unsigned char* b, int64_t n), (b, n))
ZINC_ISA_VARIANTS(int64_t, max_le32, (const unsigned char* b, int64_t n), (b, n))

struct MaskChunk {
  int64_t zeros = 0;
  unsigned char largest = 0;
};
ZINC_ALWAYS_INLINE MaskChunk mask_chunk_body(const unsigned char* __restrict b, int64_t n) {
  // Zeros counted in 32-bit lanes per block of 2^16 bytes (no lane can
  // overflow), the largest byte alongside.
  MaskChunk out;
  unsigned char largest = 0;
  for (int64_t b0 = 0; b0 < n; b0 += 65536) {
    const int64_t len = std::min<int64_t>(65536, n - b0);
    uint32_t zeros = 0;
    for (int64_t k = 0; k < len; ++k) {
      const unsigned char v = b[b0 + k];
      zeros += v == 0;
      largest = v > largest ? v : largest;
    }
    out.zeros += zeros;
  }
  out.largest = largest;
  return out;
}
ZINC_ISA_VARIANTS(MaskChunk, mask_chunk, (const unsigned char* b, int64_t n), (b, n))

// Another descriptor of the same open file (Note [the held-out twin]).
DataFile duplicate_file(const DataFile& f, const std::string& path) {
  DataFile d;
  d.key = f.key;
  d.size = f.size;
  d.fd = UniqueFd(::fcntl(f.fd.get(), F_DUPFD_CLOEXEC, 0));
  if (d.fd.get() < 0) throw posix_error(f.key + ": duplicate the descriptor of " + path, errno);
  return d;
}

std::vector<unsigned char> read_whole_file(const std::string& path) {
  const DataFile f = open_data_file(path);
  std::vector<unsigned char> bytes(static_cast<size_t>(f.size));
  read_at(f, path, 0, bytes.data(), f.size);
  return bytes;
}

// ---------------------------------------------------------------------------
// Window sources: a flat token sequence cut into samples of T+1 tokens with
// stride T (target T of window i is input 0 of window i+1). Windows
// [first, first + count) of the file are this source's samples (the train
// head or the eval tail).

struct WindowRange {
  int64_t first = 0, count = 0;
};

// Splits `total` windows into train (head) and eval (tail) by eval_fraction.
WindowRange split_windows(int64_t total, double eval_fraction, bool eval) {
  int64_t n_eval = 0;
  if (eval_fraction > 0) {
    n_eval = std::max<int64_t>(1, static_cast<int64_t>(std::llround(total * eval_fraction)));
    if (n_eval >= total)
      throw ConfigError("data.eval_fraction",
                        "holds out " + std::to_string(n_eval) + " of " + std::to_string(total) +
                            " samples, leaving none to train on; lower it or use a longer file");
  }
  return eval ? WindowRange{total - n_eval, n_eval} : WindowRange{0, total - n_eval};
}

void check_window_file(const std::string& path, int64_t num_tokens, int64_t T,
                       const char* unit) {
  if (num_tokens < T + 1)
    throw ConfigError("data.path", path + " has " + std::to_string(num_tokens) + " " + unit +
                                       "; one sample of seq_len " + std::to_string(T) +
                                       " needs at least " + std::to_string(T + 1));
}

class TextSource final : public DataSource {
 public:
  TextSource(const DataConfig& cfg, bool eval)
      : path_(cfg.path), T_(cfg.seq_len),
        held_(std::make_shared<const std::vector<unsigned char>>(read_whole_file(path_))), bytes_(*held_) {
    check_window_file(path_, static_cast<int64_t>(bytes_.size()), T_, "bytes");
    range_ = split_windows((static_cast<int64_t>(bytes_.size()) - 1) / T_, cfg.eval_fraction, eval);
  }
  // The held-out twin of a training source made from the same config: the
  // same bytes, the tail's windows (Note [the held-out twin]).
  TextSource(const TextSource& train, const DataConfig& cfg)
      : path_(train.path_), T_(train.T_), held_(train.held_), bytes_(*held_),
        range_(split_windows((static_cast<int64_t>(bytes_.size()) - 1) / T_, cfg.eval_fraction, true)) {}
  bool made_from(const DataConfig& cfg) const { return cfg.path == path_ && cfg.seq_len == T_; }
  std::string describe() const override {
    return "text(" + path_ + ", " + std::to_string(bytes_.size()) + " bytes)";
  }
  int64_t vocab_size() const override { return 256; }
  int64_t seq_len() const override { return T_; }
  int64_t num_samples() const override { return range_.count; }
  void sample(int64_t index, int32_t* inputs, int32_t* targets) const override {
    ZINC_CHECK(index >= 0 && index < range_.count, "text sample index out of range");
    const unsigned char* w = bytes_.data() + (range_.first + index) * T_;
    for (int64_t t = 0; t < T_; ++t) inputs[t] = w[t];
    for (int64_t t = 0; t < T_; ++t) targets[t] = w[t + 1];
  }

 private:
  std::string path_;
  int64_t T_;
  std::shared_ptr<const std::vector<unsigned char>> held_;  // shared with a held-out twin
  const std::vector<unsigned char>& bytes_;
  WindowRange range_;
};

// Tokens are read with pread (read_at says why not mmap): one read of the
// sample's T+1 tokens per sample, into a buffer on the stack, so sample()
// allocates nothing and may run on several threads at once.
class TokenSource final : public DataSource {
 public:
  // Note [the held-out twin]
  // The evaluation source of a training source made from the same config:
  // the same open files (descriptors duplicated: the inodes the training
  // source checked, even if a path has since been replaced), the facts its
  // open learnt, and the tail's windows. An open reads the whole token
  // file and mask to check them; with data.eval_fraction > 0 a second open
  // read them again, doubling the time to start.
  TokenSource(const TokenSource& train, const DataConfig& cfg)
      : path_(train.path_), T_(train.T_), file_(duplicate_file(train.file_, path_)), set_(train.set_),
        mask_path_(train.mask_path_),
        mask_(train.mask_ ? std::make_unique<DataFile>(duplicate_file(*train.mask_, mask_path_)) : nullptr),
        masked_share_(train.masked_share_), has_docs_(train.has_docs_), doc_starts_(train.doc_starts_),
        header_(train.header_), w_(train.w_), offset_(train.offset_), num_tokens_(train.num_tokens_), V_(train.V_),
        range_(split_windows((num_tokens_ - 1) / T_, cfg.eval_fraction, true)), made_from_(train.made_from_) {}
  bool made_from(const DataConfig& cfg) const {
    const DataConfig& m = made_from_;
    return cfg.path == m.path && cfg.seq_len == m.seq_len && cfg.vocab_size == m.vocab_size &&
           cfg.token_bytes == m.token_bytes && cfg.mask_path == m.mask_path &&
           cfg.documents_path == m.documents_path;
  }

  TokenSource(const DataConfig& cfg, bool eval)
      : path_(cfg.path), T_(cfg.seq_len), file_(open_data_file(cfg.path)), mask_path_(cfg.mask_path),
        made_from_(cfg) {
    const int64_t size = file_.size;
    if (cfg.token_bytes != 0 && cfg.token_bytes != 2 && cfg.token_bytes != 4)
      throw ConfigError("data.token_dtype", "must be uint16 or uint32");
    unsigned char header[kTokenHeaderBytes];
    if (size >= kTokenHeaderBytes) read_at(file_, path_, 0, header, kTokenHeaderBytes);
    const int32_t magic = size >= kTokenHeaderBytes ? le_i32(header) : 0;
    w_ = cfg.token_bytes > 0 ? cfg.token_bytes : 2;
    if (magic == kTokenFileMagic || magic == kTokenFileMagic32) {
      header_ = true;
      const bool wide = magic == kTokenFileMagic32;
      const int32_t version = le_i32(header + 4), want = wide ? 7 : 1;
      const int64_t count = le_i32(header + 8);
      if (version != want)
        throw ConfigError("data.path", path_ + ": token file header (magic " + std::to_string(magic) + ") version " +
                                           std::to_string(version) + " is not supported (only version " +
                                           std::to_string(want) + (wide ? ": uint32 tokens)" : ": uint16 tokens)"));
      const int64_t hw = wide ? 4 : 2;
      if (cfg.token_bytes > 0 && cfg.token_bytes != hw)
        throw ConfigError("data.token_dtype", std::string("is ") + (cfg.token_bytes == 4 ? "uint32" : "uint16") +
                                                  " but the header of " + path_ + " says " +
                                                  (wide ? "uint32" : "uint16") + " tokens");
      w_ = hw;
      const int64_t body = size - kTokenHeaderBytes;
      if (body % w_ != 0 || count != body / w_)
        throw ConfigError("data.path", path_ + ": header says " + std::to_string(count) +
                                           " tokens but the file holds " + std::to_string(body) +
                                           " bytes after the 1024-byte header (" + std::to_string(body / w_) +
                                           (w_ == 4 ? " uint32" : " uint16") +
                                           " tokens); the file is truncated or corrupt");
      offset_ = kTokenHeaderBytes;
      if (le_i32(header + 12) == kSetMarker && le_i32(header + 16) == kSetVersion) {
        auto u32 = [&](int slot) { return static_cast<uint32_t>(le_i32(header + 4 * slot)); };
        set_ = PreparedSet{u32(5), static_cast<int64_t>(uint64_t{u32(7)} << 32 | u32(6)), u32(8),
                           static_cast<int64_t>(uint64_t{u32(10)} << 32 | u32(9)), std::nullopt};
        if (le_i32(header + 48) == kTokensCrcMarker) {
          set_->tokens_crc = u32(13);
        } else if (le_i32(header + 48) != 0 || le_i32(header + 52) != 0) {
          throw ConfigError("data.path", path_ + ": header words 12 and 13 are " + std::to_string(le_i32(header + 48)) +
                                             " and " + std::to_string(le_i32(header + 52)) +
                                             ", neither zinc.prepare's record of the tokens' CRC-32 (word 12 " +
                                             std::to_string(kTokensCrcMarker) +
                                             ") nor an earlier zinc.prepare's zeros; the header is damaged: prepare "
                                             "the set again");
        }
        if (const int64_t rows = u32(11); rows > 0 && rows != T_ && !eval)
          log_warn_rank0("config: data.seq_len: " + std::to_string(T_) + ", but " + path_ +
                         " was packed in rows of " + std::to_string(rows) +
                         " tokens (zinc.prepare --pack rows): at another length its examples cross rows, a "
                         "response then training without its prompt in view; set data.seq_len " +
                         std::to_string(rows) + " or prepare the data again");
      } else {
        // llm.c's writers leave slots 3-10 at zero; a damaged record is
        // refused rather than read as "no set" (which would skip the check).
        bool zeros = true;
        for (int slot = 3; slot <= 10; ++slot) zeros = zeros && le_i32(header + 4 * slot) == 0;
        if (!zeros)
          throw ConfigError("data.path", path_ + ": header words 3 and 4 are " + std::to_string(le_i32(header + 12)) +
                                             " and " + std::to_string(le_i32(header + 16)) +
                                             ", neither zinc.prepare's set record (" + std::to_string(kSetMarker) +
                                             " and " + std::to_string(kSetVersion) +
                                             ") nor llm.c's zeros in words 3-10; the header is damaged: prepare the "
                                             "set again");
      }
    } else if (size % w_ != 0) {
      throw ConfigError("data.path", path_ + " is " + std::to_string(size) + " bytes, not a multiple of " +
                                         std::to_string(w_) + "; a token file holds " +
                                         (w_ == 4 ? "uint32" : "uint16") +
                                         " tokens (data.token_dtype; optionally after a 1024-byte header)");
    }
    num_tokens_ = (size - offset_) / w_;
    check_window_file(path_, num_tokens_, T_, "tokens");

    // One pass over the file in large reads: the largest token, and the
    // first one outside the vocabulary (the config's, else the largest a
    // model takes).
    const int64_t limit = cfg.vocab_size > 0 ? cfg.vocab_size : kMaxTokenVocab;
    int64_t max_token = 0;
    int64_t first_bad = -1;
    const bool check_crc = set_ && set_->tokens_crc;
    uint32_t crc = 0;
    ChunkReader chunks(file_, path_, offset_, w_ * num_tokens_, kScanBytes);  // Note [the open scan]
    for (int64_t i0 = 0;;) {
      const auto [buf, bytes] = chunks.next();
      if (bytes == 0) break;
      const int64_t n = bytes / w_;
      if (check_crc) crc = crc32_gzip_refl(crc, buf, static_cast<uint64_t>(bytes));
      // The search below runs once at most.
      const int64_t chunk_max = w_ == 2 ? max_le16(buf, n) : max_le32(buf, n);
      if (first_bad < 0 && chunk_max >= limit) {
        int64_t k = 0;
        while (token_at(buf, k) < limit) ++k;
        first_bad = i0 + k;
      }
      max_token = std::max(max_token, chunk_max);
      i0 += n;
    }
    // Before the vocabulary: a damaged token is named as damage.
    if (check_crc && crc != *set_->tokens_crc) {
      char got[16], want[16];
      std::snprintf(got, sizeof got, "%08x", crc);
      std::snprintf(want, sizeof want, "%08x", *set_->tokens_crc);
      throw ConfigError("data.path", path_ + ": the CRC-32 of its " + std::to_string(num_tokens_) + " tokens is " +
                                         got + " but its header records " + want +
                                         " (zinc.prepare's): the file was changed or damaged after it was written; "
                                         "prepare the set again");
    }
    if (first_bad >= 0) {
      unsigned char b[4];
      read_at(file_, path_, offset_ + w_ * first_bad, b, w_);
      const std::string where = path_ + " token " + std::to_string(first_bad) + " is " +
                                std::to_string(token_at(b, 0)) + " (byte offset " +
                                std::to_string(offset_ + w_ * first_bad) + ", max token " +
                                std::to_string(max_token) + ")";
      if (cfg.vocab_size > 0)
        throw ConfigError("data.vocab_size", "is " + std::to_string(cfg.vocab_size) + " but " + where +
                                                 "; raise vocab_size, or leave it out to take max token + 1");
      throw ConfigError("data.path", where + ", beyond the largest vocabulary a model takes (" +
                                         std::to_string(kMaxTokenVocab) + "); is data.token_dtype right?");
    }
    V_ = cfg.vocab_size > 0 ? cfg.vocab_size : max_token + 1;
    range_ = split_windows((num_tokens_ - 1) / T_, cfg.eval_fraction, eval);
    if (!cfg.mask_path.empty()) open_mask();
    if (!cfg.documents_path.empty()) read_documents(cfg.documents_path);
  }
  std::string describe() const override {
    std::string extra;
    if (mask_) extra += ", mask " + fmt_percent(masked_share_) + " masked";
    if (has_docs_) extra += ", " + std::to_string(doc_starts_.size()) + " documents";
    return "tokens(" + path_ + ", " + std::to_string(num_tokens_) + (w_ == 4 ? " uint32" : "") + " tokens, V=" +
           std::to_string(V_) + (header_ ? ", header" : "") + extra + ")";
  }
  bool has_positions() const override { return has_docs_; }
  void positions(int64_t index, int32_t* out) const override {
    const int64_t start = (range_.first + index) * T_;
    // Documents beginning at tokens start+1 .. start+T-1 restart the count.
    auto it = std::upper_bound(doc_starts_.begin(), doc_starts_.end(), static_cast<uint64_t>(start));
    int32_t p = 0;
    for (int64_t j = 0; j < T_; ++j, ++p) {
      if (it != doc_starts_.end() && static_cast<int64_t>(*it) == start + j) {
        p = 0;
        ++it;
      }
      out[j] = p;
    }
  }
  int64_t vocab_size() const override { return V_; }
  int64_t seq_len() const override { return T_; }
  int64_t num_samples() const override { return range_.count; }
  // Throws IoError when the file has shrunk since it was opened.
  void sample(int64_t index, int32_t* inputs, int32_t* targets) const override {
    ZINC_CHECK(index >= 0 && index < range_.count, "token sample index out of range");
    const int64_t start = (range_.first + index) * T_;
    // Tokens start .. start+T: token j is inputs[j] (j < T) and targets[j-1]
    // (j >= 1). One read for T < kSampleTokens, the usual case.
    unsigned char buf[4 * kSampleTokens];
    for (int64_t j0 = 0; j0 <= T_; j0 += kSampleTokens) {
      const int64_t n = std::min(kSampleTokens, T_ + 1 - j0);
      read_at(file_, path_, offset_ + w_ * (start + j0), buf, w_ * n);
      for (int64_t k = 0; k < n; ++k) {
        const int64_t j = j0 + k;
        const int32_t t = static_cast<int32_t>(token_at(buf, k));
        if (j < T_) inputs[j] = t;
        if (j >= 1) targets[j - 1] = t;
      }
    }
    if (mask_) {
      unsigned char m[kSampleTokens];
      for (int64_t j0 = 1; j0 <= T_; j0 += kSampleTokens) {
        const int64_t n = std::min(kSampleTokens, T_ + 1 - j0);
        read_at(*mask_, mask_path_, start + j0, m, n);
        for (int64_t k = 0; k < n; ++k)
          if (m[k] == 0) targets[j0 + k - 1] = kIgnoreTarget;
      }
    }
    if (has_docs_) {  // the target that is the first token of a document
      auto it = std::upper_bound(doc_starts_.begin(), doc_starts_.end(), static_cast<uint64_t>(start));
      for (; it != doc_starts_.end() && static_cast<int64_t>(*it) <= start + T_; ++it)
        targets[static_cast<int64_t>(*it) - start - 1] = kIgnoreTarget;
    }
  }

 private:
  static constexpr int64_t kScanBytes = int64_t{1} << 21;  // the scan's reads at open (Note [the open scan])
  static constexpr int64_t kSampleTokens = 4096;            // 16 KiB at most on the stack per sample()

  // Little-endian decoding byte by byte: correct on any host, and cheap.
  static int32_t le_i32(const unsigned char* b) {
    return static_cast<int32_t>(uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 |
                                uint32_t{b[3]} << 24);
  }
  static int32_t le_u16(const unsigned char* b) {
    return static_cast<int32_t>(b[0]) | static_cast<int32_t>(b[1]) << 8;
  }
  static int64_t le_u32(const unsigned char* b) {
    return static_cast<int64_t>(uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24);
  }
  // Token k of a buffer of this file's tokens (checked < 2^24 at open, so it
  // fits an int32).
  int64_t token_at(const unsigned char* b, int64_t k) const { return w_ == 2 ? le_u16(b + 2 * k) : le_u32(b + 4 * k); }

  static std::string fmt_percent(double f) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f%%", 100.0 * f);
    return b;
  }

  // The mask: one byte per token, each 0 or 1 (checked here in one pass).
  void open_mask() {
    DataFile f = open_data_file(mask_path_, "data.mask_path");
    if (f.size != num_tokens_)
      throw ConfigError("data.mask_path", mask_path_ + " is " + std::to_string(f.size) + " bytes but " + path_ +
                                              " holds " + std::to_string(num_tokens_) +
                                              " tokens; a mask has one byte per token (is it another file's?)");
    int64_t masked = 0;
    uint32_t crc = 0;
    ChunkReader chunks(f, mask_path_, 0, num_tokens_, kScanBytes);  // Note [the open scan]
    for (int64_t i0 = 0;;) {
      const auto [buf, n] = chunks.next();
      if (n == 0) break;
      crc = crc32_gzip_refl(crc, buf, static_cast<uint64_t>(n));
      const MaskChunk c = mask_chunk(buf, n);
      if (c.largest > 1) {
        int64_t k = 0;
        while (buf[k] <= 1) ++k;
        throw ConfigError("data.mask_path", mask_path_ + " byte " + std::to_string(i0 + k) + " is " +
                                                std::to_string(buf[k]) +
                                                "; a mask byte is 1 (a target) or 0 (not one)");
      }
      masked += c.zeros;
      i0 += n;
    }
    if (set_) check_member("data.mask_path", mask_path_, ".mask", f.size, crc, set_->mask_bytes, set_->mask_crc);
    // Not one target anywhere: no step could update (--check said ok, and the
    // run exited 1 after its steps).
    if (num_tokens_ > 0 && masked == num_tokens_)
      throw ConfigError("data.mask_path", mask_path_ + " masks every one of its " + std::to_string(num_tokens_) +
                                              " tokens (every byte 0): there is no target to train on");
    masked_share_ = num_tokens_ > 0 ? static_cast<double>(masked) / static_cast<double>(num_tokens_) : 0.0;
    mask_ = std::make_unique<DataFile>(std::move(f));
  }

  // The document starts, read whole (8 bytes per document).
  void read_documents(const std::string& path) {
    const DataFile f = open_data_file(path, "data.documents_path");
    if (f.size % 8 != 0)
      throw ConfigError("data.documents_path", path + " is " + std::to_string(f.size) +
                                                   " bytes, not a multiple of 8; it holds little-endian uint64 "
                                                   "token indices");
    std::vector<unsigned char> bytes(static_cast<size_t>(f.size));
    read_at(f, path, 0, bytes.data(), f.size);
    if (set_)
      check_member("data.documents_path", path, ".docs", f.size, crc32_gzip_refl(0, bytes.data(), bytes.size()),
                   set_->docs_bytes, set_->docs_crc);
    doc_starts_.resize(bytes.size() / 8);
    for (size_t i = 0; i < doc_starts_.size(); ++i) {
      uint64_t v = 0;
      for (int k = 7; k >= 0; --k) v = v << 8 | bytes[i * 8 + static_cast<size_t>(k)];
      if (v >= static_cast<uint64_t>(num_tokens_) || (i > 0 && v <= doc_starts_[i - 1]))
        throw ConfigError("data.documents_path",
                          path + " entry " + std::to_string(i) + " (byte offset " + std::to_string(i * 8) + ") is " +
                              std::to_string(v) + "; entries are token indices below " +
                              std::to_string(num_tokens_) + " (" + path_ + "), strictly increasing");
      doc_starts_[i] = v;
    }
    has_docs_ = true;
  }

  // A mask or documents file beside the token file under its prefix against
  // the size and CRC-32 its header records (Note [prepared sets]).
  void check_member(const char* key, const std::string& path, const char* ext, int64_t bytes, uint32_t crc,
                    int64_t want_bytes, uint32_t want_crc) const {
    if (!same_file(path, std::filesystem::path(path_).replace_extension(ext).string())) return;
    if (bytes == want_bytes && crc == want_crc) return;
    throw ConfigError(key, path + " is not the file zinc.prepare wrote with " + path_ + " (" +
                               (bytes != want_bytes ? std::to_string(bytes) + " bytes where the token file's header "
                                                      "records " + std::to_string(want_bytes)
                                                    : std::string("its CRC-32 differs from the one the token file's "
                                                                  "header records")) +
                               "): the set is mixed" + mixed_set_cause());
  }
  // Why a set's files disagree: a zinc.prepare that holds the prefix's lock
  // (FOLDER/.BASENAME.lock) is replacing them now; otherwise one stopped
  // while it did.
  std::string mixed_set_cause() const {
    const std::filesystem::path prefix = std::filesystem::path(path_).replace_extension();
    const std::string lock = (prefix.parent_path() / ("." + prefix.filename().string() + ".lock")).string();
    if (const long pid = flock_holder(lock))
      return ": zinc.prepare (pid " + std::to_string(pid) + ", holding " + lock +
             ") is replacing its files now; start the run again once it has finished";
    return ", e.g. by a zinc.prepare run stopped while it replaced the files; run zinc.prepare again";
  }

  struct PreparedSet {
    uint32_t mask_crc;
    int64_t mask_bytes;
    uint32_t docs_crc;
    int64_t docs_bytes;
    std::optional<uint32_t> tokens_crc;  // words 12-13; absent in sets of an earlier zinc.prepare
  };

  std::string path_;
  int64_t T_;
  DataFile file_;
  std::optional<PreparedSet> set_;  // the set the token file's header records (zinc.prepare's), if any
  std::string mask_path_;
  std::unique_ptr<DataFile> mask_;  // null without a mask
  double masked_share_ = 0;
  bool has_docs_ = false;
  std::vector<uint64_t> doc_starts_;
  bool header_ = false;
  int64_t w_ = 2;       // bytes per token: 2 (uint16) or 4 (uint32)
  int64_t offset_ = 0;  // bytes before the first token (the header)
  int64_t num_tokens_ = 0;
  int64_t V_ = 0;
  WindowRange range_;
  DataConfig made_from_;  // the config this source (or its training twin) was opened with
};

// ---------------------------------------------------------------------------
// Synthetic source. The table f and sample `index` come from independent
// streams of the seed: the table from mix_seed(seed, UINT64_MAX), sample i
// from mix_seed(seed, i) (indices stay below 2^42).

class SyntheticSource final : public DataSource {
 public:
  SyntheticSource(const DataConfig& cfg, bool eval)
      : V_(cfg.vocab_size), T_(cfg.seq_len), p_(cfg.determinism), seed_(cfg.seed),
        base_(eval ? kSyntheticEvalBase : 0) {
    if (V_ < 2) throw ConfigError("data.vocab_size", "must be >= 2, got " + std::to_string(V_));
    if (V_ * V_ > kMaxSyntheticTable)
      throw ConfigError("data.vocab_size",
                        "must be <= 8192 for the synthetic source (its table has V*V entries), got " +
                            std::to_string(V_));
    if (!(p_ >= 0.0 && p_ <= 1.0))
      throw ConfigError("data.determinism", "must be in [0, 1], got " + fmt_double(p_));
    table_.resize(static_cast<size_t>(V_ * V_));
    Rng rng(mix_seed(seed_, ~uint64_t{0}));
    for (auto& v : table_) v = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V_)));
  }
  std::string describe() const override {
    return "synthetic(V=" + std::to_string(V_) + ", T=" + std::to_string(T_) +
           ", p=" + fmt_double(p_) + ", seed=" + std::to_string(seed_) + ")";
  }
  int64_t vocab_size() const override { return V_; }
  int64_t seq_len() const override { return T_; }
  int64_t num_samples() const override { return kSyntheticEpoch; }
  void sample(int64_t index, int32_t* inputs, int32_t* targets) const override {
    ZINC_CHECK(index >= 0 && index < kSyntheticEpoch, "synthetic sample index out of range");
    Rng rng(mix_seed(seed_, static_cast<uint64_t>(base_ + index)));
    const uint64_t V = static_cast<uint64_t>(V_);
    // x_t for t = 0..T; x_t lands in inputs[t] (t < T) and targets[t-1] (t >= 1).
    int32_t prev2 = static_cast<int32_t>(rng.below(V));
    int32_t prev1 = static_cast<int32_t>(rng.below(V));
    inputs[0] = prev2;
    targets[0] = prev1;
    if (T_ > 1) inputs[1] = prev1;
    for (int64_t t = 2; t <= T_; ++t) {
      // Always draw the coin, then the token only if needed: the stream layout
      // is fixed by t alone, never by earlier outcomes' values.
      const bool det = rng.uniform() < p_;
      const int32_t x = det ? table_[static_cast<size_t>(prev2 * V_ + prev1)]
                            : static_cast<int32_t>(rng.below(V));
      targets[t - 1] = x;
      if (t < T_) inputs[t] = x;
      prev2 = prev1;
      prev1 = x;
    }
  }
  // Exact floor of the mean per-position loss. Target 0 (x_1) is uniform:
  // log V. Every later target x_t, given x_{t-2} and x_{t-1}, is f(...) with
  // probability q = p + (1-p)/V and each of the other V-1 tokens with
  // r = (1-p)/V: H_c = -q log q - (V-1) r log r (0 log 0 = 0).
  // Floor = (log V + (T-1) H_c) / T.
  std::optional<double> loss_floor() const override {
    const double V = static_cast<double>(V_), T = static_cast<double>(T_);
    const double logV = std::log(V);
    const double r = (1.0 - p_) / V;
    const double q = p_ + r;
    auto xlogx = [](double x) { return x > 0 ? x * std::log(x) : 0.0; };
    const double h_c = -xlogx(q) - (V - 1) * xlogx(r);
    return (logV + (T - 1) * h_c) / T;
  }

 private:
  int64_t V_, T_;
  double p_;
  uint64_t seed_;
  int64_t base_;
  std::vector<int32_t> table_;  // (V,V): f(a,b) = table_[a*V + b]
};

std::unique_ptr<DataSource> make_source(const DataConfig& cfg, bool eval) {
  if (cfg.seq_len < 1)
    throw ConfigError("data.seq_len", "must be >= 1, got " + std::to_string(cfg.seq_len));
  if (!(cfg.eval_fraction >= 0.0 && cfg.eval_fraction < 1.0))
    throw ConfigError("data.eval_fraction", "must be in [0, 1), got " + fmt_double(cfg.eval_fraction));
  if (cfg.type == DataType::kSynthetic) return std::make_unique<SyntheticSource>(cfg, eval);
  if (cfg.type == DataType::kText || cfg.type == DataType::kTokens) {
    if (cfg.path.empty())
      throw ConfigError("data.path",
                        "is required for data type \"" + std::string(data_type_name(cfg.type)) + "\"");
    if (cfg.type == DataType::kText) {
      if (!cfg.mask_path.empty() || !cfg.documents_path.empty())
        throw ConfigError(cfg.mask_path.empty() ? "data.documents_path" : "data.mask_path",
                          "is for type \"tokens\" only");
      return std::make_unique<TextSource>(cfg, eval);
    }
    return std::make_unique<TokenSource>(cfg, eval);
  }
  // Only reachable with a value cast from outside the enum.
  throw ConfigError("data.type", "must be \"synthetic\", \"text\" or \"tokens\", got \"" +
                                     std::string(data_type_name(cfg.type)) + "\"");
}

// Seeded bijection of [0, n) for large n: three rounds of (odd multiply,
// xorshift, add) on ceil(log2 n) bits, repeated until the value is < n
// (cycle walking: the walk stays on x's cycle, which contains x < n, so it
// ends; expected < 2 walks).
int64_t permute_large(int64_t x, int64_t n, uint64_t key_seed) {
  int bits = 1;
  while ((int64_t{1} << bits) < n) ++bits;
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  const int shift = bits / 2 + 1;
  Rng rng(key_seed);
  uint64_t mul[3], add[3];
  for (int i = 0; i < 3; ++i) {
    mul[i] = rng.next_u64() | 1;
    add[i] = rng.next_u64();
  }
  uint64_t v = static_cast<uint64_t>(x);
  do {
    for (int i = 0; i < 3; ++i) {
      v = (v * mul[i]) & mask;
      v ^= v >> shift;
      v = (v + add[i]) & mask;
    }
  } while (v >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(v);
}

}  // namespace

const char* data_type_name(DataType t) {
  switch (t) {
    case DataType::kSynthetic: return "synthetic";
    case DataType::kText: return "text";
    case DataType::kTokens: return "tokens";
  }
  return "?";
}

std::unique_ptr<DataSource> make_data_source(const DataConfig& cfg) { return make_source(cfg, false); }

void read_sample(const DataSource& source, int64_t index, Batch& batch, int64_t b) {
  const int64_t T = batch.T;
  source.sample(index, batch.inputs.data() + b * T, batch.targets.data() + b * T);
  if (!batch.positions.empty()) source.positions(index, batch.positions.data() + b * T);
}

std::unique_ptr<DataSource> make_eval_data_source(const DataConfig& cfg) {
  if (cfg.type != DataType::kSynthetic && cfg.eval_fraction <= 0.0) return nullptr;
  return make_source(cfg, true);
}

std::unique_ptr<DataSource> make_eval_data_source(const DataConfig& cfg, const DataSource& train) {
  if (cfg.type != DataType::kSynthetic && cfg.eval_fraction <= 0.0) return nullptr;
  if (cfg.type == DataType::kTokens)
    if (const auto* t = dynamic_cast<const TokenSource*>(&train); t && t->made_from(cfg))
      return std::make_unique<TokenSource>(*t, cfg);
  if (cfg.type == DataType::kText)
    if (const auto* t = dynamic_cast<const TextSource*>(&train); t && t->made_from(cfg))
      return std::make_unique<TextSource>(*t, cfg);
  return make_source(cfg, true);
}

// ---------------------------------------------------------------------------
// DataLoader (Note [data order]).

DataLoader::DataLoader(std::shared_ptr<const DataSource> source, int64_t micro_batch,
                       int64_t grad_accum, int world_size, int rank, uint64_t shuffle_seed)
    : source_(std::move(source)), micro_batch_(micro_batch), grad_accum_(grad_accum),
      world_size_(world_size), rank_(rank), shuffle_seed_(shuffle_seed) {
  ZINC_CHECK(source_ != nullptr, "DataLoader needs a source");
  ZINC_CHECK(micro_batch_ >= 1 && grad_accum_ >= 1 && world_size_ >= 1, "DataLoader batch sizes must be >= 1");
  ZINC_CHECK(rank_ >= 0 && rank_ < world_size_, "DataLoader rank out of range");
  ZINC_CHECK(source_->num_samples() >= 1, "DataLoader source has no samples");
  set_position(0);
}

void DataLoader::reshuffle() {
  const int64_t n = source_->num_samples();
  order_.clear();
  if (n > kMaxMaterialisedOrder) return;  // computed per position (permute_large)
  order_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order_[static_cast<size_t>(i)] = i;
  Rng rng(mix_seed(shuffle_seed_, static_cast<uint64_t>(epoch_)));
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
    std::swap(order_[static_cast<size_t>(i)], order_[static_cast<size_t>(j)]);
  }
}

void DataLoader::check_position(int64_t samples) const {
  const int64_t step = micro_batch_ * world_size_;
  if (samples < 0 || samples % step != 0)
    throw Error("data position " + std::to_string(samples) + " (the samples the saved run has read) is not a "
                "multiple of this run's micro_batch * data-parallel ranks = " + std::to_string(micro_batch_) +
                " * " + std::to_string(world_size_) + " = " + std::to_string(step) +
                ", so its next micro-batch would not start there: resume with a micro-batch size and rank count "
                "whose product divides " + std::to_string(samples) + " (the saved run's do)");
}

void DataLoader::set_position(int64_t samples) {
  check_position(samples);
  position_ = samples;
  const int64_t e = samples / source_->num_samples();
  if (e != epoch_) {
    epoch_ = e;
    reshuffle();
  }
}

Batch DataLoader::next() {
  const int64_t n = source_->num_samples();
  const int64_t T = source_->seq_len();
  const int64_t G = micro_batch_ * grad_accum_ * world_size_;
  const int64_t g = position_ / G;
  const int64_t k = (position_ % G) / (micro_batch_ * world_size_);  // micro-step in this global batch
  const int64_t first = g * G + rank_ * (G / world_size_) + k * micro_batch_;

  Batch batch;
  batch.B = micro_batch_;
  batch.T = T;
  batch.inputs.resize(static_cast<size_t>(micro_batch_ * T));
  batch.targets.resize(static_cast<size_t>(micro_batch_ * T));
  if (source_->has_positions()) batch.positions.resize(static_cast<size_t>(micro_batch_ * T));
  for (int64_t b = 0; b < micro_batch_; ++b) {
    const int64_t pos = first + b;
    const int64_t e = pos / n;
    if (e != epoch_) {
      epoch_ = e;
      reshuffle();
    }
    const int64_t slot = pos % n;
    const int64_t index =
        order_.empty() ? permute_large(slot, n, mix_seed(shuffle_seed_, static_cast<uint64_t>(e)))
                       : order_[static_cast<size_t>(slot)];
    read_sample(*source_, index, batch, b);
  }
  position_ += micro_batch_ * world_size_;
  return batch;
}

}  // namespace zinc
