#include "tools/output_folder.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"

// Note [export folders]
// ---------------------
// A Hugging Face folder is a set: config.json, the weights (one file, or
// shards and the index naming them) and the tokenizer files. Written file by
// file over an earlier export, a kill part-way leaves a mix that loads
// without error (new shards under the old index, an old model.safetensors
// beside a new index, which every reader prefers). So an export is written
// whole into PARENT/.NAME.zinc-staging and swapped in with one
// renameat2(RENAME_EXCHANGE) (a plain rename when NAME does not exist yet):
// at every moment NAME is the old folder or the new one. Checkpoints commit
// their tags the same way (engine/checkpoint.cpp).
//
// The user's own files in the folder (a README, a LICENSE, .gitattributes)
// are kept: before the swap each one the new folder does not have is
// hard-linked into it (no copy, the same file). A folder inside is refused
// up front (a hard link cannot keep it), and so is a destination that is,
// or holds, anything the run reads: the model's own folder, its data, the
// current folder (Note [what a writer never touches] in core/files.cpp).
//
// The lock that keeps two writers apart is a file beside the folder
// (PARENT/.NAME.zinc.lock): one inside would be swapped away with it.
// Under that lock nothing else writes the staging folder, so whatever an
// earlier writer killed part-way left there is removed at the next export:
// before the swap it holds only new files and links to the old folder's,
// after it only the old folder's, whose files the new one links. Removal
// unlinks files one by one and never descends into a folder: nothing the
// user made can be lost. A file system without RENAME_EXCHANGE moves the
// old folder aside to PARENT/.NAME.zinc-old first; a kill between the two
// renames is undone at the next export (the old folder is renamed back).

namespace zinc::tools {
namespace {

namespace fs = std::filesystem;

std::string shown(const std::string& path) {
  std::string s;
  for (char c : path) s += c == '\0' ? std::string("\\0") : std::string(1, c);
  return s;
}

// `dir` made absolute and normal, without a trailing separator, symlinks of
// existing components resolved: the folder a swap must replace (a symlink
// to a folder is followed, never replaced by a folder).
fs::path resolved(const std::string& dir, const std::string& what) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (ec) throw IoError(what + ": cannot resolve the path: " + ec.message());
  p = p.lexically_normal();
  if (!p.has_filename() && p.has_relative_path()) p = p.parent_path();
  if (!p.has_relative_path()) throw Error(what + ": the root folder cannot be an export folder");
  return p;
}

// Removes a folder a writer left: files and links one by one, then the
// folder; anything else inside stays, with a warning, and so does the folder.
void remove_flat(const fs::path& folder) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(folder, ec))) return;
  std::vector<std::string> kept;
  for (const fs::directory_entry& e : fs::directory_iterator(folder, ec)) {
    std::error_code entry_ec;
    const fs::file_status st = e.symlink_status(entry_ec);
    if (fs::is_directory(st)) {
      kept.push_back(e.path().filename().string());
      continue;
    }
    if (::unlink(e.path().c_str()) != 0 && errno != ENOENT) kept.push_back(e.path().filename().string());
  }
  if (kept.empty() && ::rmdir(folder.c_str()) == 0) return;
  std::string list;
  for (const std::string& k : kept) list += (list.empty() ? "" : ", ") + k;
  log_warn("left " + folder.string() + " in place" + (list.empty() ? std::string() : " (it holds " + list + ")") +
           ": an earlier export's leftover that zinc removes only file by file; remove it by hand");
}

}  // namespace

namespace {
std::atomic<int> g_stop_signal{0};
}  // namespace

void stop_writers(int signal) noexcept { g_stop_signal.store(signal); }
int writers_stopped_by() { return g_stop_signal.load(); }
std::string signal_text(int signal) {
  const char* abbrev = sigabbrev_np(signal);
  return abbrev ? "SIG" + std::string(abbrev) : "signal " + std::to_string(signal);
}

void export_fault_point(const char* phase) {
  const char* spec = std::getenv("ZINC_EXPORT_FAULT");
  if (!spec) return;
  if (std::strcmp(spec, phase) == 0) ::kill(::getpid(), SIGKILL);
  // PHASE:stop: the process stops there until SIGCONT (a test writes into
  // the folder meanwhile, as another process would).
  const size_t n = std::strlen(phase);
  if (std::strncmp(spec, phase, n) == 0 && std::strcmp(spec + n, ":stop") == 0) ::raise(SIGSTOP);
  // PHASE:term: a SIGTERM to itself there (zinc-export's stop on a signal).
  // To the process, not this thread, where zinc-export blocks it: its
  // signal thread takes it.
  if (std::strncmp(spec, phase, n) == 0 && std::strcmp(spec + n, ":term") == 0) {
    ::kill(::getpid(), SIGTERM);
    for (int i = 0; i < 1000 && writers_stopped_by() == 0; ++i) ::usleep(10'000);
  }
}

std::string tag_holding(const std::string& path, const std::string& checkpoint_dir) {
  if (checkpoint_dir.empty()) return "";
  // By resolved path, not identity: the checkpoint folder (and the path) may
  // not exist yet when a run starts.
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  const fs::path ck = fs::weakly_canonical(fs::absolute(checkpoint_dir, ec), ec);
  const fs::path rel = p.lexically_relative(ck);
  if (rel.empty() || *rel.begin() == ".." || *rel.begin() == ".") return "";
  const std::string first = rel.begin()->string();
  const bool tag = first.rfind("global_step", 0) == 0 || first.front() == '.' || first == "latest";
  return tag ? first : "";
}

std::string enclosing_checkpoint_tag(const std::string& path) {
  std::error_code ec;
  const fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  for (fs::path up = p.parent_path(); !up.empty() && up != up.parent_path(); up = up.parent_path())
    if (fs::is_regular_file(up / "metadata.json", ec) && fs::exists(up.parent_path() / "latest", ec))
      return up.string();
  return "";
}

std::string protected_by(const std::string& path, const std::string& in) {
  std::error_code ec;
  if (in.empty() || !fs::is_directory(in, ec) || same_file(path, in) || !is_within(path, in)) return "";
  const fs::path dir(in);
  if (fs::exists(dir / "config.json", ec) || fs::exists(dir / "adapter_config.json", ec))
    return "the model folder " + in;
  if (fs::exists(dir / "metadata.json", ec)) return "the checkpoint tag " + in;
  const std::string tag = tag_holding(path, in);
  return tag.empty() ? "" : "the checkpoint tag " + tag + " of " + in;
}

void check_output_folder(const std::string& dir, const std::string& what_arg, const std::vector<std::string>& inputs) {
  const std::string what = what_arg + " " + shown(dir);
  if (dir.empty()) throw Error(what_arg + ": an empty path names no folder");
  if (dir.find('\0') != std::string::npos) throw Error(what + ": the path holds a NUL byte");
  const fs::path p = resolved(dir, what);
  std::error_code ec;
  const bool exists = fs::exists(p, ec);
  // A dangling link passed as a new folder here and failed the write after
  // training ("cannot list the folder").
  if (!exists && fs::is_symlink(fs::symlink_status(p, ec)))
    throw Error(what + " is a symbolic link to " + fs::read_symlink(p, ec).string() +
                ", which does not exist: point it at a folder, or remove it and let the export create one");
  if (exists && !fs::is_directory(p, ec)) throw Error(what + ": exists and is not a folder");
  for (const std::string& in : inputs) {
    if (in.empty()) continue;
    if (same_file(in, p.string()))
      throw Error(what + " is " + in + ", which this run reads: writing there would replace it; "
                  "export into another folder");
    if (is_within(in, p.string()))
      throw Error(what + " holds " + in + ", which this run reads: an export replaces its folder as a "
                  "whole; export into another folder");
    if (const std::string why = protected_by(p.string(), in); !why.empty())
      throw Error(what + " lies inside " + why + ", which this run reads: an export there would replace or "
                  "mix with its files (and a checkpoint save or pruning would remove a tag's); export elsewhere");
  }
  if (const std::string tag = enclosing_checkpoint_tag(p.string()); !tag.empty())
    throw Error(what + " lies inside the checkpoint tag " + tag + ", which a save of that tag replaces whole and "
                "pruning removes; export elsewhere");
  if (is_within(".", p.string()))
    throw Error(what + " is the current folder or holds it: an export replaces its folder as a whole; "
                "export into a folder of its own");
  if (!exists) return;
  struct stat here, up;
  if (::stat(p.c_str(), &here) == 0 && ::stat(p.parent_path().c_str(), &up) == 0 && here.st_dev != up.st_dev)
    throw Error(what + " is a mount point, which cannot be replaced by a rename; export into a folder inside it");
  for (const fs::directory_entry& e : fs::directory_iterator(p, ec)) {
    std::error_code entry_ec;
    if (fs::is_directory(e.symlink_status(entry_ec)))
      throw Error(what + " holds the folder " + e.path().filename().string() +
                  ": an export replaces its folder as a whole and keeps the files in it, not folders; "
                  "move it out or export into another folder");
  }
  if (ec) throw IoError(what + ": cannot list the folder: " + ec.message());
}

void check_model_kind(const std::string& dir, const std::string& what, bool adapter) {
  std::error_code ec;
  auto has = [&](const char* name) { return fs::is_regular_file(fs::path(dir) / name, ec); };
  if (!adapter && has("adapter_config.json"))
    throw Error(what + " " + dir + " holds adapter_config.json, a PEFT adapter's: transformers would load the "
                "folder as that adapter over its base model, not the model this export writes; move the adapter's "
                "files out, or export into another folder");
  if (adapter && has("config.json") &&
      (has("model.safetensors") || has("model.safetensors.index.json") || has("pytorch_model.bin")))
    throw Error(what + " " + dir + " holds a full model (config.json and its weights): transformers would load "
                "the folder as this adapter over its base model and ignore that model; write the adapter into "
                "another folder");
}

CheckpointSource checkpoint_source(const std::string& hf_source, const std::string& checkpoint_dir) {
  CheckpointSource out;
  if (hf_source.empty()) return out;
  std::vector<std::string> places;
  if (fs::path(hf_source).is_absolute()) {
    out.dir = hf_source;
    places.push_back(hf_source);
  } else {
    out.relative = hf_source;
    places.push_back(hf_source);
    std::error_code ec;
    const fs::path parent = fs::absolute(checkpoint_dir, ec).lexically_normal().parent_path();
    if (!ec) places.push_back((parent / hf_source).string());
  }
  for (const std::string& p : places) {
    out.protect.push_back(p);
    for (std::string& t : link_targets(p)) out.protect.push_back(std::move(t));
  }
  return out;
}

std::unique_ptr<ckpt::DirLock> lock_output_folder(const std::string& path, const std::string& what,
                                                  const std::string& kind, ckpt::LockUse use) {
  if (path.empty() || path.find('\0') != std::string::npos) check_output_folder(path, what, {});  // throws
  const fs::path p = resolved(path, what + " " + path);
  // The longest name written beside it, checked before any work (a run
  // would train and then fail to export): the lock file (.NAME.zinc.lock);
  // an export folder's staging folder (.NAME.zinc-staging); a safetensors
  // file's shards' temporaries (.STEM-00001-of-00001-b.safetensors.zinc-tmp).
  const std::string name = p.filename().string();
  size_t longest = name.size() + 11;
  if (kind == "export folder") longest = name.size() + 14;
  if (kind == "export file") {
    const std::string ext = ".safetensors";
    const bool has_ext = name.size() > ext.size() && name.compare(name.size() - ext.size(), ext.size(), ext) == 0;
    longest = std::max(longest, (has_ext ? name.size() - ext.size() : name.size()) + 40);
  }
  if (longest > NAME_MAX)
    throw Error(what + " " + path + ": its name is " + std::to_string(name.size()) + " bytes, and the " + kind +
                " writes names up to " + std::to_string(longest) + " bytes beside it (its lock, temporaries" +
                (kind == "export file" ? std::string(" and shards") : std::string()) + "), past the file system's " +
                std::to_string(NAME_MAX) + "; choose a name of at most " +
                std::to_string(name.size() - (longest - NAME_MAX)) + " bytes");
  return std::make_unique<ckpt::DirLock>(
      p.string(), kind, (p.parent_path() / ("." + p.filename().string() + ".zinc.lock")).string(), use);
}

OutputFolder::OutputFolder(std::string dir, std::string what, const std::vector<std::string>& inputs)
    : dir_(std::move(dir)), what_(std::move(what)) {
  lock_ = lock_output_folder(dir_, what_);
  const fs::path p = resolved(dir_, what_ + " " + dir_);
  parent_ = p.parent_path().string();
  name_ = p.filename().string();
  staging_ = (p.parent_path() / ("." + name_ + ".zinc-staging")).string();
  old_ = (p.parent_path() / ("." + name_ + ".zinc-old")).string();
  // What an earlier export killed part-way left (we hold the lock: nobody
  // is writing these now).
  std::error_code ec;
  if (fs::exists(fs::symlink_status(old_, ec))) {
    if (!fs::exists(fs::symlink_status(p, ec)) && ::rename(old_.c_str(), p.c_str()) == 0) {
      log_warn(what_ + " " + dir_ + ": an earlier export was stopped between its two renames; the folder "
               "it was replacing is back in place");
      ckpt::fsync_dir(parent_);
    } else {
      remove_flat(old_);
    }
  }
  remove_flat(staging_);
  check_output_folder(dir_, what_, inputs);
  if (::mkdir(staging_.c_str(), 0755) != 0)
    throw posix_error(what_ + " " + dir_ + ": cannot create the staging folder " + staging_, errno);
}

OutputFolder::~OutputFolder() {
  if (committed_) return;
  try {
    remove_flat(staging_);
  } catch (...) {
  }
}

void OutputFolder::commit(const std::function<bool(const std::string&)>& replaced) {
  const fs::path dest = fs::path(parent_) / name_;
  export_fault_point("staged");
  std::error_code ec;
  // The new folder's own files (written into the staging folder), which no
  // file of the old folder replaces.
  std::set<std::string> own;
  for (const fs::directory_entry& e : fs::directory_iterator(staging_, ec)) own.insert(e.path().filename().string());
  if (ec) throw IoError(what_ + " " + dir_ + ": cannot list the staging folder " + staging_ + ": " + ec.message());
  const bool existed = fs::exists(fs::symlink_status(dest, ec));
  if (existed) {
    // `ec` is the listing's alone: a per-entry query that fails (a name the
    // new folder does not have) must not read as a failed listing.
    for (const fs::directory_entry& e : fs::directory_iterator(dest, ec)) {
      const std::string name = e.path().filename().string();
      const fs::path to = fs::path(staging_) / name;
      std::error_code entry_ec;
      if (fs::exists(fs::symlink_status(to, entry_ec)) || replaced(name)) continue;
      if (fs::is_directory(e.symlink_status(entry_ec)))
        throw Error(what_ + " " + dir_ + " holds the folder " + name + " (made during the export): an export "
                    "keeps the files of its folder, not folders; the folder is left as it was");
      if (::linkat(AT_FDCWD, e.path().c_str(), AT_FDCWD, to.c_str(), 0) != 0)
        throw posix_error(what_ + " " + dir_ + ": cannot keep " + name + " (a hard link into the new folder)", errno);
    }
    if (ec) throw IoError(what_ + " " + dir_ + ": cannot list the folder: " + ec.message());
  }
  export_fault_point("linked");
  ckpt::fsync_dir(staging_);
  std::string leftover;  // the old folder after the swap
  if (!existed) {
    if (::rename(staging_.c_str(), dest.c_str()) != 0)
      throw posix_error(what_ + " " + dir_ + ": cannot rename " + staging_ + " to it", errno);
  } else if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, dest.c_str(), RENAME_EXCHANGE) == 0) {
    leftover = staging_;
  } else {
    const int err = errno;
    if (err != EINVAL && err != ENOSYS)
      throw posix_error(what_ + " " + dir_ + ": cannot swap the new folder " + staging_ + " in", err);
    // No RENAME_EXCHANGE on this file system: the old folder aside first.
    if (::rename(dest.c_str(), old_.c_str()) != 0)
      throw posix_error(what_ + " " + dir_ + ": cannot move the old folder aside to " + old_, errno);
    if (::rename(staging_.c_str(), dest.c_str()) != 0) {
      const int e2 = errno;
      ::rename(old_.c_str(), dest.c_str());
      throw posix_error(what_ + " " + dir_ + ": cannot rename " + staging_ + " to it", e2);
    }
    leftover = old_;
  }
  ckpt::fsync_dir(parent_);
  committed_ = true;
  export_fault_point("swapped");
  if (!leftover.empty()) {
    keep_late_files(leftover, dest.string(), [&](const std::string& name) { return own.count(name) > 0 || replaced(name); });
    remove_flat(leftover);
  }
}

// Note [files made during an export]: another process writing into the
// folder between the link pass and the swap (zinc.prepare's set, a user's
// editor saving a README through a new file) made or replaced files the new
// folder does not have, and the swap took them away with the old folder.
// Each file of the old folder that is not the export's own (written by it,
// or of the kind it replaces) and that the new folder lacks, or holds as another file (replaced by a rename
// since the link), is moved over: a rename keeps the file itself, so a
// writer's open descriptor and its lock stay valid. Until a pass moves
// nothing (a writer may still be renaming in the old folder).
void OutputFolder::keep_late_files(const std::string& old_dir, const std::string& dest,
                                   const std::function<bool(const std::string&)>& replaced) {
  for (int pass = 0; pass < 100; ++pass) {
    int moved = 0;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(old_dir, ec)) {
      const std::string name = e.path().filename().string();
      if (replaced(name)) continue;
      std::error_code entry_ec;
      if (fs::is_directory(e.symlink_status(entry_ec))) continue;  // never made by a writer zinc knows: left
      struct stat old_st {}, new_st {};
      if (::lstat(e.path().c_str(), &old_st) != 0) continue;
      const std::string to = (fs::path(dest) / name).string();
      if (::lstat(to.c_str(), &new_st) == 0 && new_st.st_ino == old_st.st_ino && new_st.st_dev == old_st.st_dev)
        continue;  // linked before the swap: the same file
      if (::rename(e.path().c_str(), to.c_str()) == 0) {
        ++moved;
        log_warn(what_ + " " + dir_ + ": " + name + " was made or replaced in the folder during the export; it is "
                 "kept in the new folder");
      } else {
        log_warn(what_ + " " + dir_ + ": " + name + " was made during the export and could not be moved into the "
                 "new folder (" + std::strerror(errno) + "); it is left in " + old_dir);
        return;  // the old folder stays, with it
      }
    }
    if (moved == 0) return;
    ckpt::fsync_dir(dest);
  }
}

}  // namespace zinc::tools
