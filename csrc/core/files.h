// zinc core: reading small files the user names, and telling whether two
// paths are the same file (Note [what a writer never touches] in files.cpp).
// Stateless; any thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zinc {

// The most a JSON document zinc reads whole may hold (a config, a Hugging
// Face config.json, a checkpoint's metadata): far above any real one, and
// a bound on what /dev/zero or a mistaken multi-GB file can cost.
constexpr int64_t kMaxJsonFileBytes = int64_t{256} << 20;

// The whole of `path`, which must be a regular file (after symlinks) of at
// most max_bytes. Opened non-blocking, so a FIFO is refused instead of
// waiting for a writer. Throws IoError naming `what` and the path: "cannot
// open", "is a directory", "is a FIFO, not a regular file", "is N bytes, over
// the limit of M". `shown`: the path as messages print it (default: path).
std::string read_small_file(const std::string& path, int64_t max_bytes, const std::string& what,
                            const std::string& shown = "");

// "a directory", "a FIFO", "a character device", ... for a stat mode that is
// not a regular file.
std::string file_kind(mode_t mode);

// A file's identity: device and inode, after symlinks.
struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId& o) const { return dev == o.dev && ino == o.ino; }
};
// nullopt when the path does not exist (or cannot be stat'ed).
std::optional<FileId> file_id(const std::string& path);
// Whether a and b name one existing file or folder (a symlink, "a/../a",
// a hard link and a bind mount all count), never by comparing strings.
bool same_file(const std::string& a, const std::string& b);
// The pid of a process holding a flock(2) on the file at `path`, from
// /proc/locks, without taking the lock (a probe that took it would make
// the holder's next non-blocking attempt fail); 0 where none holds one, the
// file does not exist, or /proc/locks cannot be read.
long flock_holder(const std::string& path);
// Whether `dir` is `path` or one of the folders that hold it (compared by
// identity, walking up from `path` after resolving it).
bool is_within(const std::string& path, const std::string& dir);

// What the symbolic links directly in `dir` lead to, each resolved through
// every link (a model folder of links: a hub cache's snapshot, or one made
// by hand): the files a reader of the folder reads. Dangling links and a
// `dir` that is no folder give nothing.
std::vector<std::string> link_targets(const std::string& dir);

}  // namespace zinc
