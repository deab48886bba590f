// zinc engine, private: the files of a checkpoint (Note [checkpoints] in
// checkpoint.cpp). RankWriter writes one rank's shard file and says what is
// where in it; CheckpointReader reads any range of any block's optimizer
// state back, from whichever ranks' files hold it, verifying checksums.
// Threading: the training thread only.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
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
  // file; the rank's index (spans, file offsets, checksums, the file's size)
  // for the metadata.
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
  int64_t file_bytes_ = 0;                // the whole file, allocated up front
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

// A complete tag's files: DIR/TAG/metadata.json and every rank's index,
// verified (open_tag) before anything is read from the shard files.
struct TagFiles {
  std::string dir;  // DIR/TAG
  std::string tag;
  nlohmann::json meta;
  nlohmann::json ranks;                  // the rank indexes, in rank order
  std::vector<std::string> block_names;  // from the metadata, for messages
};
// A tag is one path component that every file system and shell takes as it
// is: 1 to kMaxTagBytes characters from [A-Za-z0-9._+-], the first a letter,
// a digit or '_' (partial and old folders start with '.'), and not "latest"
// (the file naming the newest tag). Throws zinc::Error naming the tag
// (escaped) and the rule otherwise.
constexpr size_t kMaxTagBytes = 200;
void check_tag(const std::string& tag);
// Opens DIR/TAG; an empty tag means the one DIR/latest names. Verifies,
// before anything is loaded: metadata.json's own checksum (every key but the
// checksum, as compact JSON), each rank index against the checksum and size
// the metadata holds for it, the type and range of every field, that the
// rank files' regions lie inside the files as they are now and do not
// overlap, and that every element of every block is saved (spans that tile
// the block; identical spans on several ranks are stage 0's copies). Throws
// IoError naming the file (and the JSON path) otherwise.
TagFiles open_tag(const std::string& dir, std::string tag);

// The text of a JSON document sealed with its own checksum (the XXH3-64 of
// its compact dump without the key kSealKey, stored under that key), dumped
// with `indent`; verify_seal checks and removes it, throwing IoError naming
// `path` when it does not match.
constexpr const char* kSealKey = "xxh3_64_of_the_rest";
std::string sealed_dump(nlohmann::json doc, int indent);
void verify_seal(nlohmann::json& doc, const std::string& path);
// XXH3-64 of bytes, as 16 hex digits.
std::string xxh3_hex(const void* data, size_t bytes);
// A sampled digest of files too large to read whole at each save or resume:
// the XXH3-64 of each file's label, size, first MiB and 64 pieces of 4 KiB
// spread evenly over it, in the order given. It tells a replaced or edited
// file from the one a checkpoint was saved over (a base model's weights,
// the training data) almost always, not always: an edit that keeps the
// size and lies wholly between the pieces goes unseen. Throws IoError
// naming the file and `what` it was read for.
std::string sampled_files_digest(const std::vector<std::pair<std::string, std::string>>& labelled_paths,
                                 const std::string& what);

// An exclusive lock on a checkpoint folder (flock on DIR/.zinc.lock, which
// holds the owner's pid and host), for as long as the object lives: two runs
// writing one folder would replace each other's tags. Throws IoError naming
// the folder and the holder's pid when another process holds it, or when
// the folder cannot be created or written. `what` names the folder in those
// messages. `lock_file`: where the lock lives instead of DIR/.zinc.lock (an
// export folder, which is replaced as a whole, is locked by a file beside
// it: tools/output_folder.h); its folder is created, DIR is not, and the
// file is removed when the lock is released.
// Within one process (Note [two writers in one process] in checkpoint.cpp):
// a kRun lock (a run's, for its whole length: zinc-train's, zinc.train's)
// is refused while another kRun lock of this process holds the folder; a
// kWrite lock (one save or export) shares the process's hold, so a run's
// own saves pass, and waits while another thread of the process writes
// the folder, so two writers never interleave their files.
enum class LockUse { kWrite, kRun };
class DirLock {
 public:
  explicit DirLock(const std::string& dir, const std::string& what = "checkpoint folder",
                   const std::string& lock_file = "", LockUse use = LockUse::kWrite);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  // Another lock held as long as this one (released after it).
  void also_hold(std::unique_ptr<DirLock> other) { also_ = std::move(other); }

 private:
  void take(const std::string& dir, const std::string& what, const std::string& lock_file);
  std::unique_ptr<DirLock> also_;
  std::string key_;
  LockUse use_ = LockUse::kWrite;
  std::recursive_mutex* writing_ = nullptr;  // kWrite: the folder's in-process writer lock, held
};

// run.keep_last: after the save of `saved` (a global_step<N> tag, now
// `latest`), keeps it and the newest keep - 1 older global_step<M> tags
// (M < N) and removes the older ones. Tags with a higher step (another run's,
// or ones this run resumed before) and the tag `latest` names are never
// removed; only complete zinc checkpoints are (a folder is renamed to
// .TAG.pruned first, so a crash mid-removal leaves no half tag under its
// name), and a tag holding what zinc did not write is kept, with a warning
// (Note [what a tag holds]). Returns the tags removed.
std::vector<std::string> prune(const std::string& dir, int64_t keep, const std::string& saved);

// Test hook: ZINC_CHECKPOINT_FAULT=PHASE:N kills this process (SIGKILL, as
// kill -9 would) at PHASE of its N-th save: "shards" (after the first piece
// of its shard file is written), "index" (its shard file and index are
// written), "metadata" (metadata.json written, the folder not yet fsynced),
// "before_rename" (the partial folder is complete and fsynced, not yet
// renamed), "old_aside" (a previous folder of the same tag moved aside),
// "before_latest" (the tag is in place, `latest` not yet moved),
// "after_latest" (`latest` moved, nothing pruned), "prune" (a pruned tag
// renamed, not yet removed). Nothing when unset or another phase.
void fault_point(const char* phase);
// Counts a save (for fault_point's N).
void count_save();

// Crash-safe commit of a folder written as `tmp` to `final` (a previous
// `final` is replaced) and of the file `latest` naming `tag`: fsync of the
// files inside (done by their writers), of `tmp`, rename, fsync of the
// parent; then `latest` through a temporary file, fsync, rename, fsync.
void commit_tag(const std::string& parent, const std::string& tmp, const std::string& tag);
// Refuses (IoError naming it) a `dir/tag` that exists and is not a zinc
// checkpoint tag (a folder whose metadata.json says "zinc-checkpoint"): a
// save of the tag would replace it, and with it a DeepSpeed checkpoint of
// the same name, or a user's folder or file. Nothing there: returns.
// Also refused: a tag that holds anything a zinc save does not write
// (Note [what a tag holds]), which the save would remove with the folder.
void check_replaceable_tag(const std::string& dir, const std::string& tag);
// The first entry of a tag folder that a zinc save does not write, or "".
std::string foreign_entry(const std::string& tag_dir);
// Refuses (IoError naming it) a `dir/latest` that a save could not replace
// without loss: not a regular file, or not one line naming a tag of the
// folder (a user's file, a config or data file of that name). Nothing
// there: returns.
void check_replaceable_latest(const std::string& dir);
// N of "global_stepN" (digits only), or -1.
int64_t tag_step(const std::string& name);
// fsync of a folder (its entries).
void fsync_dir(const std::string& dir);
// The temporary a writer of `path` fills before renaming it over `path`:
// .NAME.zinc-tmp beside it. Hidden and zinc's own: a user's NAME.tmp is
// never overwritten, and a killed writer's leftover stays out of sight
// (the next writer of NAME, under its lock, removes it).
std::string temp_path(const std::string& path);
// Writes `text` to `path` through temp_path(path), fsync, rename. An IoError
// names the file, after `writer` (what writes it: "checkpoint", an export's
// flag, "csv_monitor").
void write_file_atomic(const std::string& path, const std::string& text, const std::string& writer = "checkpoint");
// The whole of a small regular file (metadata, an index, `latest`); an
// IoError names the file.
std::string read_bytes(const std::string& path);

}  // namespace zinc::ckpt
