#include "tools/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "engine/checkpoint.h"
#include "tools/output_folder.h"

// Note [safetensors]
// ------------------
// zinc-export turns a checkpoint into the weights a user takes elsewhere:
// the fp32 master weights (the exact values the engine trains; a bf16 export
// rounds them to nearest-even, the same rounding that makes the engine's
// bf16 compute weights, so a bf16 export equals them bit for bit). Nothing
// is gathered in RAM: the checkpoint's reader returns any range of a block's
// flat vector from whichever rank files hold it (verifying the checksums of
// what it reads), and each tensor is copied through one buffer of at most a
// checksum chunk (4 MiB of fp32), so the peak is that buffer, whatever the
// model's size.
//
// Sharding follows the Hugging Face tools: tensors fill a file in model order
// until the next would pass the limit (a tensor larger than the limit gets a
// file to itself), files are named NAME-0000k-of-0000n.safetensors, and
// NAME.safetensors.index.json maps each tensor to its file
// ({"metadata": {"total_size": bytes}, "weight_map": {...}}). Every file is
// written as a temporary (.NAME.zinc-tmp beside it), fsynced and renamed;
// the index comes last, so an export that fails midway leaves no file under
// a final name that a loader would take for complete (files of an earlier
// export of the same name are replaced only by complete ones).
//
// "__metadata__" carries {"format": "pt"}, which the Hugging Face loaders
// require (it says the layout is PyTorch's: row-major, which zinc's is), and
// where the weights came from (zinc_checkpoint, zinc_global_steps, zinc_model).

namespace zinc::tools {
namespace fs = std::filesystem;

namespace {
// The file names a safetensors index's weight_map maps tensors to; nullopt
// where `path` is no such index (absent, unreadable, not a JSON object with
// a weight_map object).
std::optional<std::set<std::string>> read_index_files(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  const nlohmann::json index = nlohmann::json::parse(in, nullptr, false);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) return std::nullopt;
  std::set<std::string> out;
  for (const auto& [tensor, file] : index["weight_map"].items())
    if (file.is_string()) out.insert(file.get<std::string>());
  return out;
}
std::set<std::string> index_files(const std::string& index_path) {
  return read_index_files(index_path).value_or(std::set<std::string>{});
}

// Calls f with the name of each entry of `folder` (listed first, so f may
// remove entries).
void for_each_in(const fs::path& folder, const std::function<void(const std::string&)>& f) {
  std::error_code ec;
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(folder, ec)) names.push_back(e.path().filename().string());
  for (const std::string& n : names) f(n);
}
}  // namespace

int64_t SafeTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
int64_t SafeTensor::bytes() const { return numel() * static_cast<int64_t>(dtype_bytes(dtype)); }

std::string safetensors_header(const std::vector<SafeTensor>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::json h = nlohmann::json::object();
  int64_t at = 0;
  for (const SafeTensor& t : tensors) {
    if (h.contains(t.name)) throw Error("safetensors: tensor name '" + t.name + "' appears twice");
    h[t.name] = {{"dtype", t.dtype == DType::kF32 ? "F32" : t.dtype == DType::kBF16 ? "BF16" : "F16"},
                 {"shape", t.shape},
                 {"data_offsets", {at, at + t.bytes()}}};
    at += t.bytes();
  }
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::string json = h.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);  // little-endian
  return out + json;
}

namespace {

[[noreturn]] void fail(const std::string& what, int err) {
  throw IoError(what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
}

}  // namespace

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafeTensor> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tmp_(ckpt::temp_path(path_)) {
  const std::string header = safetensors_header(tensors, metadata);
  for (const SafeTensor& t : tensors) data_bytes_ += t.bytes();
  fd_ = UniqueFd(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd_) fail("zinc-export: cannot create " + tmp_, errno);
  buffer_.reserve(size_t{4} << 20);
  buffer_ = header;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (committed_) return;
  fd_.reset();
  ::unlink(tmp_.c_str());
}

void SafetensorsWriter::flush() {
  const char* p = buffer_.data();
  size_t left = buffer_.size();
  while (left > 0) {
    const ssize_t n = ::pwrite(fd_.get(), p, left, static_cast<off_t>(file_offset_));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("zinc-export: write of " + tmp_ + " at byte " + std::to_string(file_offset_) + " failed", errno);
    }
    p += n;
    left -= static_cast<size_t>(n);
    file_offset_ += n;
  }
  buffer_.clear();
}

void SafetensorsWriter::append(const void* data, size_t bytes) {
  if (appended_ == 0) export_fault_point("append");  // the test hook (tools/output_folder.h)
  if (const int sig = writers_stopped_by(); sig != 0)
    throw Error("zinc-export: stopped by " + signal_text(sig) + " while writing " + path_);
  if (appended_ + static_cast<int64_t>(bytes) > data_bytes_)
    throw Error("safetensors: " + path_ + ": more data than the header's tensors hold");
  appended_ += static_cast<int64_t>(bytes);
  if (buffer_.size() + bytes > buffer_.capacity()) flush();
  if (bytes >= buffer_.capacity()) {
    buffer_.assign(static_cast<const char*>(data), bytes);
    flush();
    return;
  }
  buffer_.append(static_cast<const char*>(data), bytes);
}

void SafetensorsWriter::finish_staged() {
  if (appended_ != data_bytes_)
    throw Error("safetensors: " + path_ + ": " + std::to_string(appended_) + " of " + std::to_string(data_bytes_) +
                " data bytes written");
  flush();
  std::string().swap(buffer_);  // a staged file waits for its set: no buffer meanwhile
  if (::fsync(fd_.get()) != 0) fail("zinc-export: fsync of " + tmp_ + " failed", errno);
  if (::close(fd_.release()) != 0) fail("zinc-export: close of " + tmp_ + " failed", errno);
}

void SafetensorsWriter::commit() {
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    fail("zinc-export: cannot rename " + tmp_ + " to " + path_, err);
  }
  committed_ = true;
}

void SafetensorsWriter::finish() {
  finish_staged();
  commit();
}

int64_t parse_size(const std::string& text, const std::string& what) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  size_t j = i;
  if (j < text.size() && text[j] == '.') {
    ++j;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
  }
  std::string unit = text.substr(j);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> kUnits = {
      {"", 1},       {"B", 1},        {"KB", 1e3},        {"MB", 1e6},        {"GB", 1e9},
      {"TB", 1e12},  {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  auto u = kUnits.find(unit);
  if (i == 0 || u == kUnits.end())
    throw Error(what + ": '" + text + "' is not a size (a number of bytes, or with a unit: KB, MB, GB, KiB, MiB, GiB)");
  // strtod: a number past a double's range is inf (std::stod threw).
  const double v = std::strtod(text.substr(0, j).c_str(), nullptr) * u->second;
  if (v < 1) throw Error(what + ": '" + text + "' is less than 1 byte");
  if (!(v <= 9.0e18)) throw Error(what + ": '" + text + "' is more than the largest size taken (9e18 bytes)");
  return static_cast<int64_t>(v);
}

ExportResult export_safetensors(const ExportOptions& opts, const std::function<void(const std::string&)>& progress) {
  if (opts.out.size() < 12 || opts.out.compare(opts.out.size() - 12, 12, ".safetensors") != 0)
    throw Error("zinc-export: --out " + opts.out + ": must name a .safetensors file");
  const ckpt::TagFiles files = ckpt::open_tag(opts.checkpoint_dir, opts.tag);
  ckpt::CheckpointReader reader(files.dir, files.ranks, files.block_names);

  struct Source {
    int block;
    int64_t flat_offset;
  };
  std::vector<SafeTensor> tensors;
  std::vector<Source> sources;
  const nlohmann::json& blocks = files.meta.at("blocks");
  int64_t frozen = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    // A frozen block (LoRA's base) is not in the checkpoint: its values are
    // the source model's, never zeros written in their place.
    if (blocks[b].value("frozen", false)) {
      frozen += static_cast<int64_t>(blocks[b].at("params").size());
      continue;
    }
    for (const nlohmann::json& p : blocks[b].at("params")) {
      SafeTensor t;
      t.name = blocks[b].at("name").get<std::string>() + "." + p.at("name").get<std::string>();
      t.dtype = opts.dtype;
      t.shape = p.at("shape").get<std::vector<int64_t>>();
      tensors.push_back(t);
      sources.push_back({static_cast<int>(b), p.at("offset").get<int64_t>()});
    }
  }

  if (tensors.empty())
    throw Error(files.dir + ": the checkpoint holds no trained parameters (every block is frozen)");
  if (frozen > 0 && progress)
    progress("the checkpoint trained LoRA adapters on a frozen base: its " + std::to_string(frozen) +
             " frozen tensors are not in it and not written (they are model.from_pretrained's; "
             "zinc-train --save-adapter or --save-pretrained --merge write the adapters with them)");
  // Shards: tensors in model order, a new file when the next would pass the limit.
  std::vector<std::vector<size_t>> shards(1);
  int64_t in_shard = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t b = tensors[i].bytes();
    if (!shards.back().empty() && in_shard + b > opts.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += b;
  }

  const fs::path out(opts.out);
  const std::string stem = out.filename().string().substr(0, out.filename().string().size() - 12);
  const std::string index_path = out.string() + ".index.json";
  // Note [a set replaced as one]: the new shards never take a name the
  // current index (an earlier export's set) maps a tensor to, so that set
  // stays whole until the new index replaces the old one in one rename.
  // Where the Hugging Face names (NAME-0000k-of-0000n) are the current
  // set's, the new set is NAME-0000k-of-0000n-b, and the next export takes
  // the plain names again.
  const std::set<std::string> current = index_files(index_path);
  auto shard_name = [&](size_t k, bool alternate) {
    char name[64];
    std::snprintf(name, sizeof name, "-%05zu-of-%05zu%s.safetensors", k + 1, shards.size(), alternate ? "-b" : "");
    return stem + name;
  };
  bool alternate = false;
  for (size_t k = 0; k < shards.size() && shards.size() > 1; ++k) alternate = alternate || current.count(shard_name(k, false));
  auto shard_path = [&](size_t k) {
    if (shards.size() == 1) return out.string();
    return (out.parent_path() / shard_name(k, alternate)).string();
  };
  {  // Note [another set's files]
    std::set<std::string> names;
    for (size_t k = 0; k < shards.size(); ++k) names.insert(fs::path(shard_path(k)).filename().string());
    check_apart_from_other_sets(opts.out, names, "zinc-export: --out");
  }
  if (!out.parent_path().empty() && !fs::is_directory(out.parent_path()))
    throw IoError("zinc-export: --out " + opts.out + ": the folder " + out.parent_path().string() + " does not exist");
  // A write never touches what it reads: not into the checkpoint's tag
  // folder (which a later save of the tag replaces whole, too).
  if (is_within(out.parent_path().empty() ? "." : out.parent_path().string(), files.dir))
    throw Error("zinc-export: --out " + opts.out + " is inside the checkpoint " + files.dir +
                " it reads; write it elsewhere");
  // Nor into the pretrained model's folder the run was trained from (the
  // checkpoint's client_state.hf_source): its weights would be replaced.
  const nlohmann::json client = files.meta.value("client_state", nlohmann::json::object());
  if (client.is_object() && client.contains("hf_source") && client["hf_source"].is_string()) {
    const std::string out_dir = out.parent_path().empty() ? "." : out.parent_path().string();
    for (const std::string& source :
         checkpoint_source(client["hf_source"].get<std::string>(), opts.checkpoint_dir).protect)
      if (!source.empty() && (is_within(out_dir, source) || same_file(out.string(), source)))
        throw Error("zinc-export: --out " + opts.out + " is inside or is " + source +
                    ", (a file of) the pretrained model this checkpoint was trained from; write it elsewhere");
  }
  // Nor into a tag of the checkpoint's folder (the next save of the tag
  // replaces it whole, and pruning removes it): the checkpoint folder
  // itself, beside its tags, is fine.
  if (const std::string why = protected_by(out.parent_path().empty() ? "." : out.parent_path().string(),
                                           fs::path(files.dir).parent_path().string());
      !why.empty())
    throw Error("zinc-export: --out " + opts.out + " lies inside " + why +
                ", which a checkpoint save replaces whole and pruning removes; write it elsewhere");
  // Two exports of one NAME would mix their files: the set's lock, beside it.
  const std::unique_ptr<ckpt::DirLock> lock = lock_output_folder(opts.out, "--out", "export file");
  std::string stem_re;  // the stem, its regex characters escaped
  for (char c : stem) stem_re += std::strchr(".^$|()[]{}*+?\\", c) && c ? std::string("\\") + c : std::string(1, c);
  const std::regex shard_re(stem_re + "-[0-9]{5}-of-[0-9]{5}(-b)?\\.safetensors");
  const fs::path folder = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  // Under the lock every temporary of this NAME is an earlier export's,
  // killed part-way: removed.
  // (.NAME.zinc-tmp: see ckpt::temp_path. A NAME.tmp is a user's file.)
  static const std::string kTail = ".zinc-tmp";
  for_each_in(folder, [&](const std::string& name) {
    const size_t n = name.size();
    if (n > kTail.size() + 1 && name[0] == '.' && name.compare(n - kTail.size(), kTail.size(), kTail) == 0) {
      const std::string base = name.substr(1, n - kTail.size() - 1);
      if (base == out.filename().string() || base == out.filename().string() + ".index.json" ||
          std::regex_match(base, shard_re))
        ::unlink((folder / name).c_str());
    }
  });

  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"zinc_model", files.meta.value("model", "")},
      {"zinc_checkpoint", files.tag},
      {"zinc_global_steps", std::to_string(files.meta.at("training").at("global_steps").get<int64_t>())}};
  ExportResult result;
  result.tag = files.tag;
  std::vector<float> piece(static_cast<size_t>(ckpt::kChunkNumel));
  std::vector<bf16> piece16(opts.dtype == DType::kBF16 ? piece.size() : 0);
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<std::unique_ptr<SafetensorsWriter>> staged;  // every file of the set, committed together
  for (size_t k = 0; k < shards.size(); ++k) {
    std::vector<SafeTensor> mine;
    for (size_t i : shards[k]) mine.push_back(tensors[i]);
    const std::string path = shard_path(k);
    staged.push_back(std::make_unique<SafetensorsWriter>(path, mine, metadata));
    SafetensorsWriter& w = *staged.back();
    for (size_t i : shards[k]) {
      const int64_t n = tensors[i].numel();
      for (int64_t done = 0; done < n;) {
        const int64_t take = std::min<int64_t>(n - done, ckpt::kChunkNumel);
        try {
          reader.read(sources[i].block, ckpt::kMaster, sources[i].flat_offset + done, take, piece.data());
        } catch (const IoError& e) {
          throw IoError(std::string(e.what()) + " (tensor " + tensors[i].name + "; nothing was written to " + path +
                        ")");
        }
        if (opts.dtype == DType::kBF16) {
          convert_f32_to_bf16(piece.data(), piece16.data(), static_cast<size_t>(take));
          w.append(piece16.data(), static_cast<size_t>(take) * 2);
        } else {
          w.append(piece.data(), static_cast<size_t>(take) * 4);
        }
        done += take;
      }
      weight_map[tensors[i].name] = fs::path(path).filename().string();
    }
    w.finish_staged();
    result.files.push_back(path);
    result.tensors += static_cast<int64_t>(mine.size());
    result.bytes += w.data_bytes();
    if (progress) {
      char line[512];
      std::snprintf(line, sizeof line, "staged %s: %zu tensors, %.1f MiB", path.c_str(), mine.size(),
                    static_cast<double>(w.data_bytes()) / (1 << 20));
      progress(line);
    }
  }
  // The set in place (Note [a set replaced as one]): the new files under
  // names no reader takes yet (a single file renames over the old single
  // file, which readers take before any index), then the switch, then the
  // earlier export's files that the new set does not name. A kill at any
  // moment leaves a folder whose reader finds the old export whole or the
  // new one whole: the old set until the new index (or single file) is in,
  // and while a single file and an index are both there, the single file.
  // A failure before the switch (a full disk under the index) removes the
  // new set's files already in: no reader takes them, and the earlier set
  // stays whole.
  ckpt::fsync_dir(folder.string());
  size_t committed = 0;
  try {
    for (auto& w : staged) {
      w->commit();
      ++committed;
    }
    ckpt::fsync_dir(folder.string());
    export_fault_point("set_committed");  // the test hook (tools/output_folder.h): the new files in, the switch not yet
    if (shards.size() > 1) {
      const nlohmann::json index = {{"metadata", {{"total_size", result.bytes}}}, {"weight_map", weight_map}};
      result.index = index_path;
      ckpt::write_file_atomic(result.index, index.dump(2) + "\n", "zinc-export");
    }
  } catch (...) {
    if (shards.size() > 1)
      for (size_t k = 0; k < committed; ++k) ::unlink(result.files[k].c_str());
    throw;
  }
  std::set<std::string> mine;
  for (const std::string& f : result.files) mine.insert(fs::path(f).filename().string());
  if (shards.size() > 1) {
    if (progress) progress("wrote " + result.index);
    ::unlink(out.c_str());  // an earlier single file, which a reader would take instead
  } else {
    ::unlink(index_path.c_str());
  }
  for_each_in(folder, [&](const std::string& name) {
    if (std::regex_match(name, shard_re) && !mine.count(name)) ::unlink((folder / name).c_str());
  });
  ckpt::fsync_dir(folder.string());
  return result;
}

// Note [another set's files]: a file set's names are another set's where
// --out names one of its shards (zinc-export --out a-00001-of-00003.safetensors
// beside the set a, --save-weights DIR/model-00001-of-00002.safetensors into
// a sharded model folder), and NAME.safetensors.index.json is a zinc.prepare
// manifest where a data set's prefix ends in .safetensors.index. Either
// write replaced the other set's file without a word, leaving it broken.
void check_apart_from_other_sets(const std::string& out_path, const std::set<std::string>& names,
                                 const std::string& what) {
  const fs::path out(out_path);
  const fs::path folder = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  if (const std::string tag = enclosing_checkpoint_tag(out_path); !tag.empty())
    throw Error(what + " " + out_path + " lies inside the checkpoint tag " + tag + ", which a save of that tag "
                "replaces whole and pruning removes; write it elsewhere");
  const std::string own_index = out.filename().string() + ".index.json";
  std::error_code ec;
  if (fs::is_regular_file(folder / own_index, ec) && !read_index_files((folder / own_index).string()))
    throw Error(what + " " + out_path + ": " + (folder / own_index).string() + " is not a safetensors index (a file "
                "of yours, or another tool's: a zinc.prepare manifest?), and the export's index replaces it; write "
                "the export elsewhere or under another name");
  const std::string suffix = ".safetensors.index.json";
  for_each_in(folder, [&](const std::string& name) {
    if (name == own_index || name.size() <= suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      return;
    for (const std::string& f : index_files((folder / name).string()))
      if (names.count(f))
        throw Error(what + " " + out_path + ": " + f + " is a file of the set " + (folder / name).string() +
                    " names, which a write of it would break; write the export elsewhere or under another name");
  });
}

void drop_sharded_set(const std::string& out_path) {
  const fs::path out(out_path);
  const std::string name = out.filename().string();
  if (name.size() <= 12) return;
  const std::string stem = name.substr(0, name.size() - 12);
  std::string stem_re;
  for (char c : stem) stem_re += std::strchr(".^$|()[]{}*+?\\", c) && c ? std::string("\\") + c : std::string(1, c);
  const std::regex shard_re(stem_re + "-[0-9]{5}-of-[0-9]{5}(-b)?\\.safetensors");
  const fs::path folder = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  ::unlink((out.string() + ".index.json").c_str());
  for_each_in(folder, [&](const std::string& n) {
    if (std::regex_match(n, shard_re)) ::unlink((folder / n).c_str());
  });
  ckpt::fsync_dir(folder.string());
}

}  // namespace zinc::tools
