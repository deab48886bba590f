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

namespace zinc::ckpt {

// What each block's optimizer span holds, in this order in a shard file.
enum Kind { kMaster = 0, kM = 1, kV = 2 };
constexpr int kKinds = 3;
const char* kind_name(int k);  // "fp32 master weights" | "Adam m" | "Adam v"

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
  void write(int block, int kind, int64_t offset_in_span, const float* data, int64_t count);
  // fsyncs and closes the file; the rank's index (spans, file offsets,
  // checksums) for the metadata.
  nlohmann::json finish();
  const std::string& path() const { return path_; }

 private:
  struct Stream {
    int64_t written = 0;  // elements so far
    std::shared_ptr<void> state;  // XXH3_state_t of the chunk being hashed
    std::vector<std::string> chunks;
  };
  Stream& stream(int block, int kind);
  std::string path_;
  UniqueFd fd_;
  std::vector<Span> spans_;
  std::map<int, size_t> index_;           // block -> position in spans_
  std::vector<int64_t> file_offset_;      // per span, bytes of its master; m and v follow
  std::vector<Stream> streams_;           // per span and kind
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
  // The last chunk read and verified (pieces come in order).
  std::string cached_file_;
  int64_t cached_at_ = -1;
  std::vector<float> cached_;
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
