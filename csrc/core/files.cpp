#include "core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/unique_fd.h"

// Note [what a writer never touches]
// ----------------------------------
// Every writer of a user's file (checkpoints, exports, prepared data,
// monitors) follows one rule: it never writes over what the run reads. Two
// paths are compared by what they name (device and inode, after symlinks),
// never as strings: "src", "src/", "./src", "src/../src", a symlink to src
// and a bind mount of it are all the same folder. A folder that a writer
// replaces as one unit (Note [export folders] in tools/output_folder.cpp)
// must also not hold anything the run reads: is_within asks that.

namespace zinc {

std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

std::string read_small_file(const std::string& path_arg, int64_t max_bytes, const std::string& what,
                            const std::string& shown) {
  const std::string& path = shown.empty() ? path_arg : shown;
  UniqueFd fd(::open(path_arg.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) throw posix_error("cannot open " + what + " " + path, errno);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) throw posix_error("cannot stat " + what + " " + path, errno);
  if (!S_ISREG(st.st_mode))
    throw IoError(what + " " + path + " is " + file_kind(st.st_mode) + ", not a regular file");
  if (st.st_size > max_bytes)
    throw IoError(what + " " + path + " is " + std::to_string(st.st_size) + " bytes, over the limit of " +
                  std::to_string(max_bytes) + " for " + what);
  std::string out;
  out.reserve(static_cast<size_t>(st.st_size));
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw posix_error("cannot read " + what + " " + path, errno);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (static_cast<int64_t>(out.size()) > max_bytes)  // a file that grows while it is read
      throw IoError(what + " " + path + " grew past the limit of " + std::to_string(max_bytes) +
                    " bytes while it was read");
  }
  return out;
}

std::optional<FileId> file_id(const std::string& path) {
  struct stat st;
  if (path.empty() || ::stat(path.c_str(), &st) != 0) return std::nullopt;
  return FileId{st.st_dev, st.st_ino};
}

bool same_file(const std::string& a, const std::string& b) {
  const std::optional<FileId> x = file_id(a), y = file_id(b);
  return x && y && *x == *y;
}

long flock_holder(const std::string& path) {
  const std::optional<FileId> id = file_id(path);
  if (!id) return 0;
  // Lines like "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF": the pid,
  // then the device as hex major:minor and the inode in decimal.
  std::ifstream locks("/proc/locks");
  std::string line;
  while (std::getline(locks, line)) {
    std::istringstream in(line);
    std::string n, kind, advisory, mode, device;
    long pid = 0;
    if (!(in >> n >> kind) || kind != "FLOCK") continue;
    if (!(in >> advisory >> mode >> pid >> device)) continue;
    unsigned maj = 0, min = 0;
    unsigned long ino = 0;
    if (std::sscanf(device.c_str(), "%x:%x:%lu", &maj, &min, &ino) != 3) continue;
    if (ino == id->ino && maj == major(id->dev) && min == minor(id->dev) && pid > 0) return pid;
  }
  return 0;
}

bool is_within(const std::string& path, const std::string& dir) {
  namespace fs = std::filesystem;
  const std::optional<FileId> d = file_id(dir);
  if (!d) return false;
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec) return false;
  for (;;) {
    const std::optional<FileId> id = file_id(p.string());
    if (id && *id == *d) return true;
    if (!p.has_relative_path()) return false;  // the root
    p = p.parent_path();
  }
}

std::vector<std::string> link_targets(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  if (dir.empty()) return out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    std::error_code entry_ec;
    if (!e.is_symlink(entry_ec)) continue;
    const fs::path target = fs::canonical(e.path(), entry_ec);
    if (!entry_ec) out.push_back(target.string());
  }
  return out;
}

}  // namespace zinc
