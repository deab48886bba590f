// zinc engine, private: the files of a checkpoint (Note [checkpoints] in
// checkpoint.cpp). RankWriter writes one rank's shard file and says what is
// where in it; CheckpointReader reads any range of any block's optimizer
// state back, from whichever ranks' files hold it, verifying checksums.
// Threading: the training thread only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/unique_fd.h"
#include "offload/offload.h"

namespace zinc::ckpt {

// What each block's optimizer span holds, in this order in a shard file.
enum Kind { kMaster = 0, kM = 1, kV = 2 };
constexpr int kKinds = 3;
const char* kind_name(int k);  // "fp32 master weights" | "Adam m" | "Adam v"

// Shard files are written in pieces of this many bytes (staging buffers, up
// to kWriteBuffers of them, written with O_DIRECT through io_uring).
constexpr int64_t kWriteBytes = int64_t{2} << 20;
constexpr int kWriteBuffers = 16;
// Memory that stays put (states in RAM) is written in pieces of this size.
constexpr int64_t kDirectWriteBytes = int64_t{8} << 20;

// Checksums cover chunks of this many elements of a span (4 MiB of fp32),
// so that a reader that needs part of a span verifies only what it reads.
constexpr int64_t kChunkNumel = int64_t{1} << 20;

// Writes `path` (created, truncated). A span is the part of a block one rank
// keeps: elements [flat_offset, flat_offset + count) of the block's flat
// vector. Pieces of each (block, kind) arrive in ascending order, without
// gaps, and together cover the span.
class RankWriter {
 public:
  struct Span {
    int block;
    int64_t flat_offset, count;
  };
  RankWriter(std::string path, std::vector<Span> spans);
  ~RankWriter();  // waits for writes in flight (their buffers are ours)
  RankWriter(const RankWriter&) = delete;
  RankWriter& operator=(const RankWriter&) = delete;
  // `stable`: data stays valid and unchanged until finish() (states in RAM):
  // its 4 KiB-aligned part is written from where it is, not copied.
  void write(int block, int kind, int64_t offset_in_span, const float* data, int64_t count, bool stable = false);
  // Writes what is staged, waits for every write, fsyncs and closes the
  // file; the rank's index (spans, file offsets, checksums) for the metadata.
  nlohmann::json finish();
  const std::string& path() const { return path_; }

 private:
  struct Stream {
    int64_t written = 0;  // elements so far
    std::shared_ptr<void> state;  // XXH3_state_t of the chunk being hashed
    std::vector<std::string> chunks;
    int buffer = -1;      // staging buffer being filled, -1: none
    int64_t fill = 0;     // bytes in it
    int64_t flushed = 0;  // bytes of the region handed to the kernel
    int64_t region = 0;   // the region's first byte in the file (4 KiB aligned)
  };
  struct Pending {
    int64_t offset, bytes;
    const char* data;
  };
  Stream& stream(int block, int kind);
  void submit(Stream& st);
  int take_buffer();
  void reap_one();
  std::string path_;
  UniqueFd fd_;
  std::vector<Span> spans_;
  std::map<int, size_t> index_;           // block -> position in spans_
  std::vector<int64_t> file_offset_;      // per span, bytes of its master; m and v follow
  std::vector<int64_t> region_bytes_;     // per span: each kind's region, rounded up to 4 KiB
  std::vector<Stream> streams_;           // per span and kind
  // Staging buffers, written with O_DIRECT through io_uring.
  std::unique_ptr<offload::IoEngine> io_;
  std::vector<std::shared_ptr<void>> buffers_;
  std::vector<int> free_;
  std::map<uint64_t, Pending> pending_;   // by buffer (writes from the caller's memory: tags from kWriteBuffers)
  uint64_t next_tag_ = kWriteBuffers;
};

class CheckpointReader {
 public:
  // `dir`: the tag's folder; `ranks`: the metadata's per-rank indexes;
  // `block_names`: for messages.
  CheckpointReader(std::string dir, const nlohmann::json& ranks, std::vector<std::string> block_names);
  // Elements [flat_offset, flat_offset + count) of `block`'s state `kind`
  // into out; what no saved span covers (padding) is zero. Throws
  // zinc::IoError naming the file and the block for a short file or a
  // checksum that does not match.
  void read(int block, int kind, int64_t flat_offset, int64_t count, float* out);
  int64_t bytes_read() const { return bytes_read_; }

 private:
  struct Saved {
    int block;
    int rank;
    std::string file;
    int64_t flat_offset, count;
    int64_t file_offset[kKinds];
    std::vector<std::string> chunks[kKinds];
  };
  const float* chunk(const Saved& s, int kind, int64_t c);
  int file(const std::string& name);
  std::string dir_;
  std::vector<std::string> names_;
  std::map<int, std::vector<Saved>> saved_;  // block -> spans
  std::map<std::string, UniqueFd> files_;
  std::map<std::string, UniqueFd> direct_;  // O_DIRECT, where the file system has it
  // The last chunk read and verified (pieces come in order).
  std::string cached_file_;
  int64_t cached_at_ = -1;
  std::shared_ptr<void> cached_;  // kChunkNumel floats, 4 KiB aligned (O_DIRECT reads)
  int64_t bytes_read_ = 0;
};

// A complete tag's files: DIR/TAG/metadata.json and every rank's index.
struct TagFiles {
  std::string dir;  // DIR/TAG
  std::string tag;
  nlohmann::json meta;
  nlohmann::json ranks;                  // the rank indexes, in rank order
  std::vector<std::string> block_names;  // from the metadata, for messages
};
// Throws zinc::Error unless `tag` is a plain folder name (not empty, no '/',
// no leading '.', which partial and old folders use).
constexpr size_t kMaxTagBytes = 200;
void check_tag(const std::string& tag);
// Opens DIR/TAG; an empty tag means the one DIR/latest names. Throws IoError
// naming the file when `latest`, the metadata or an index is missing or the
// folder is not a zinc checkpoint of this format version.
TagFiles open_tag(const std::string& dir, std::string tag);

// Test hook: ZINC_CHECKPOINT_FAULT=PHASE:N kills this process (SIGKILL, as
// kill -9 would) at PHASE of its N-th save: "shards" (after the first piece
// of its shard file is written), "before_rename" (the partial folder is
// complete, metadata included, not yet renamed), "before_latest" (the tag is
// in place, `latest` not yet moved). Nothing when unset or another phase.
void fault_point(const char* phase);
// Counts a save (for fault_point's N).
void count_save();

// Crash-safe commit of a folder written as `tmp` to `final` (a previous
// `final` is replaced) and of the file `latest` naming `tag`: fsync of the
// files inside (done by their writers), of `tmp`, rename, fsync of the
// parent; then `latest` through a temporary file, fsync, rename, fsync.
void commit_tag(const std::string& parent, const std::string& tmp, const std::string& tag);
// fsync of a folder (its entries).
void fsync_dir(const std::string& dir);
// Writes `text` to `path` through path + ".tmp", fsync, rename.
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace zinc::ckpt
