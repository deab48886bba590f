#include "tools/safetensors_read.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <filesystem>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"

// Note [safetensors reader]
// -------------------------
// The files come from elsewhere (a download, a hub cache), so the header is
// checked in full before a byte of data is read, and nothing in it is
// trusted to size an allocation or a read:
//  - the header length is capped at 100 MB (the Rust reference's limit) and
//    must fit in the file, so the one buffer sized by the file (the header's
//    text) is bounded by bytes that exist;
//  - the JSON must be an object without repeated keys (nlohmann keeps the
//    last of two silently, which would hide a second copy of a tensor);
//  - each entry must have a known dtype, a shape of non-negative integers
//    whose element count and byte size do not overflow int64, and
//    data_offsets [begin, end) of two non-negative integers inside the data
//    section, holding exactly numel * element size bytes; no two tensors may
//    share a byte. Gaps between tensors and bytes after the last are
//    allowed (the Rust reference rejects them; they are harmless to a
//    reader that only ever reads inside a tensor's own range);
//  - __metadata__ must map strings to strings.
// A dtype zinc cannot convert (F64, the integer types, the 8-, 6- and 4-bit
// floats) is listed like any other, so a folder with, say, an I64 buffer
// opens and its float tensors load; only read_f32 of that tensor refuses.
//
// The file stays open: the descriptor validated is the one read, and reads
// go through pread (no shared file position, so threads may read at once) in
// pieces of at most 4 MiB; fp32 lands straight in the caller's buffer, the
// 16-bit formats go through one piece buffer and the bulk converters. A read
// that meets the end of the file (truncated after opening) is an IoError,
// never a short result.
//
// A folder follows the transformers loader: model.safetensors if present,
// else model.safetensors.index.json and the shards its weight_map names,
// each a plain file name in the folder (no path can leave it). The index and
// the shards must agree (each mapped tensor is in its shard, no tensor in two
// files), since a loader that trusted either one alone would load the wrong
// bytes or miss some without a word.

namespace zinc::tools {
namespace fs = std::filesystem;
using nlohmann::json;

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian and read in place");

namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the Rust reference's MAX_HEADER_SIZE
constexpr int64_t kPieceBytes = int64_t{4} << 20;

struct DtypeInfo {
  const char* name;
  int bits;
  bool readable;
  DType dtype;
};
// Every dtype the safetensors format defines.
constexpr DtypeInfo kDtypes[] = {
    {"F32", 32, true, DType::kF32},     {"BF16", 16, true, DType::kBF16},   {"F16", 16, true, DType::kF16},
    {"F64", 64, false, DType::kF32},    {"C64", 64, false, DType::kF32},    {"I64", 64, false, DType::kF32},
    {"U64", 64, false, DType::kF32},    {"I32", 32, false, DType::kF32},    {"U32", 32, false, DType::kF32},
    {"I16", 16, false, DType::kF32},    {"U16", 16, false, DType::kF32},    {"I8", 8, false, DType::kF32},
    {"U8", 8, false, DType::kF32},      {"BOOL", 8, false, DType::kF32},    {"F8_E4M3", 8, false, DType::kF32},
    {"F8_E5M2", 8, false, DType::kF32}, {"F8_E8M0", 8, false, DType::kF32}, {"F6_E2M3", 6, false, DType::kF32},
    {"F6_E3M2", 6, false, DType::kF32}, {"F4", 4, false, DType::kF32},
};

const DtypeInfo* find_dtype(const std::string& s) {
  for (const DtypeInfo& d : kDtypes)
    if (s == d.name) return &d;
  return nullptr;
}

// A name as messages show it: as is when plain printable ASCII, else quoted
// with JSON escapes (a hostile name cannot break the message's line).
std::string show(const std::string& name) {
  const bool plain = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f;
  });
  return plain ? name : json(name).dump(-1, ' ', true, json::error_handler_t::replace);
}

// A JSON value from the file, shortened for a message, without recursion (a
// hostile header may nest a million arrays; dump() would recurse through them).
std::string brief(const json& v) {
  auto atom = [](const json& x) {
    if (x.is_array()) return std::string(x.empty() ? "[]" : "[...]");
    if (x.is_object()) return std::string(x.empty() ? "{}" : "{...}");
    std::string s = x.dump(-1, ' ', true, json::error_handler_t::replace);
    return s.size() > 40 ? s.substr(0, 37) + "..." : s;
  };
  if (!v.is_array()) return atom(v);
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < 8; ++i) s += (i ? ", " : "") + atom(v[i]);
  return s + (v.size() > 8 ? ", ...]" : "]");
}

std::string show_shape(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Opens PATH read-only; O_NONBLOCK so that a FIFO under the name cannot hang
// the open (it has no effect on the regular file required).
UniqueFd open_regular(const std::string& path, int64_t* bytes) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (!fd) throw posix_error(path + ": cannot open", errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw posix_error(path + ": cannot stat", errno);
  if (!S_ISREG(st.st_mode)) throw IoError(path + ": not a regular file");
  *bytes = static_cast<int64_t>(st.st_size);
  return fd;
}

// Exactly `bytes` at `offset`, retrying short reads and EINTR.
void pread_full(int fd, void* dst, int64_t bytes, int64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, static_cast<size_t>(bytes), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw posix_error(
          path + ": read of " + std::to_string(bytes) + " bytes at byte " + std::to_string(offset) + " failed", errno);
    }
    if (n == 0)
      throw IoError(path + ": the file ends at byte " + std::to_string(offset) +
                    ", before data its header promised (truncated or replaced after it was opened?)");
    p += n;
    bytes -= n;
    offset += n;
  }
}

// Parses JSON text, rejecting a key repeated within one object.
json parse_unique(const std::string& text, const std::string& path, const std::string& what) {
  std::vector<std::set<std::string>> open;  // the keys of each object being parsed
  std::string repeated;
  json j;
  try {
    j = json::parse(text, [&](int, json::parse_event_t ev, json& parsed) {
      if (ev == json::parse_event_t::object_start) {
        open.emplace_back();
      } else if (ev == json::parse_event_t::object_end) {
        if (!open.empty()) open.pop_back();
      } else if (ev == json::parse_event_t::key && !open.empty() && repeated.empty()) {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!open.back().insert(k).second) repeated = k;
      }
      return true;
    });
  } catch (const json::exception& e) {
    // The parser quotes the bytes it last read: keep the message one line of
    // printable text, and short.
    std::string why = e.what();
    if (why.size() > 300) why = why.substr(0, 300) + "...";
    for (char& c : why)
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
    throw Error(path + ": " + what + " is not valid JSON (" + why + ")");
  }
  if (!repeated.empty()) throw Error(path + ": " + what + " has the key " + show(repeated) + " twice in one object");
  if (!j.is_object()) throw Error(path + ": " + what + " is a JSON " + j.type_name() + ", not an object");
  return j;
}

// A non-negative integer of int64 range, or nullopt.
bool as_nonneg_int64(const json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(u);
    return true;
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return *out >= 0;
  }
  return false;
}

StoredTensor parse_entry(const std::string& name, const json& v, int64_t data_start, int64_t data_bytes,
                         const std::string& path) {
  const std::string where = path + ": tensor " + show(name);
  if (!v.is_object())
    throw Error(where + ": the entry is a JSON " + std::string(v.type_name()) +
                ", not an object with dtype, shape and data_offsets");
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) throw Error(where + ": the entry has no " + key);
  StoredTensor t;
  t.name = name;

  const json& dt = v.at("dtype");
  if (!dt.is_string()) throw Error(where + ": dtype is a JSON " + std::string(dt.type_name()) + ", not a string");
  t.stored_dtype = dt.get<std::string>();
  const DtypeInfo* info = find_dtype(t.stored_dtype);
  if (info == nullptr) {
    std::string known;
    for (const DtypeInfo& d : kDtypes) known += std::string(known.empty() ? "" : ", ") + d.name;
    throw Error(where + ": unknown dtype " + show(t.stored_dtype) + " (safetensors defines " + known + ")");
  }
  t.readable = info->readable;
  t.dtype = info->dtype;

  const json& sh = v.at("shape");
  if (!sh.is_array()) throw Error(where + ": shape is a JSON " + std::string(sh.type_name()) + ", not an array");
  int64_t numel = 1;
  bool overflow = false;
  for (const json& d : sh) {
    if (!d.is_number_integer()) throw Error(where + ": shape " + brief(sh) + " holds a value that is not an integer");
    if (d.is_number_unsigned() && d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw Error(where + ": shape " + brief(sh) + " has a dimension beyond int64");
    const int64_t n = d.get<int64_t>();
    if (n < 0) throw Error(where + ": shape " + brief(sh) + " has a negative dimension");
    t.shape.push_back(n);
    overflow = overflow || __builtin_mul_overflow(numel, n, &numel);
  }
  int64_t bits = 0;
  if (overflow || __builtin_mul_overflow(numel, int64_t{info->bits}, &bits))
    throw Error(where + ": shape " + show_shape(t.shape) + " of " + t.stored_dtype + " overflows int64 in size");
  if (bits % 8 != 0)
    throw Error(where + ": shape " + show_shape(t.shape) + " of " + t.stored_dtype + " is not a whole number of bytes");

  const json& off = v.at("data_offsets");
  int64_t b = 0, e = 0;
  if (!off.is_array() || off.size() != 2 || !as_nonneg_int64(off[0], &b) || !as_nonneg_int64(off[1], &e))
    throw Error(where + ": data_offsets " + brief(off) + " is not two non-negative integers");
  if (b > e)
    throw Error(where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] end before they begin");
  if (e > data_bytes)
    throw Error(where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                "] end past the data section's " + std::to_string(data_bytes) +
                " bytes (the file is truncated, or the header is wrong)");
  if (e - b != bits / 8)
    throw Error(where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] hold " +
                std::to_string(e - b) + " bytes, but shape " + show_shape(t.shape) + " of " + t.stored_dtype +
                " needs " + std::to_string(bits / 8));
  t.begin = data_start + b;  // no overflow: both are at most the file's size
  t.end = data_start + e;
  return t;
}

}  // namespace

int64_t StoredTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated against overflow when parsed
  return n;
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  fd_ = open_regular(path_, &file_bytes_);
  if (file_bytes_ < 8)
    throw Error(path_ + ": " + std::to_string(file_bytes_) +
                " bytes, shorter than the 8-byte header length (not a safetensors file, or truncated)");
  unsigned char len[8];
  pread_full(fd_.get(), len, 8, 0, path_);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];  // little-endian
  if (n > kMaxHeaderBytes)
    throw Error(path_ + ": header length " + std::to_string(n) + " is over the limit of " +
                std::to_string(kMaxHeaderBytes) + " bytes (not a safetensors file, or corrupt)");
  if (n > static_cast<uint64_t>(file_bytes_ - 8))
    throw Error(path_ + ": header length " + std::to_string(n) + " is more than the " +
                std::to_string(file_bytes_ - 8) + " bytes after it (truncated, or not a safetensors file)");
  std::string text(n, '\0');
  pread_full(fd_.get(), text.data(), static_cast<int64_t>(n), 8, path_);
  const json h = parse_unique(text, path_, "the header");

  const int64_t data_start = 8 + static_cast<int64_t>(n);
  const int64_t data_bytes = file_bytes_ - data_start;
  for (const auto& [key, v] : h.items()) {
    if (key == "__metadata__") {
      if (!v.is_object())
        throw Error(path_ + ": __metadata__ is a JSON " + std::string(v.type_name()) + ", not an object of strings");
      for (const auto& [mk, mv] : v.items()) {
        if (!mv.is_string())
          throw Error(path_ + ": __metadata__ entry " + show(mk) + " is a JSON " + std::string(mv.type_name()) +
                      ", not a string");
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    tensors_.push_back(parse_entry(key, v, data_start, data_bytes, path_));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const StoredTensor& a, const StoredTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end != b.end ? a.end < b.end : a.name < b.name;
  });
  // Sorted by begin, a tensor overlaps an earlier one exactly when it begins
  // before the furthest end so far; empty tensors hold no byte.
  const StoredTensor* furthest = nullptr;
  for (const StoredTensor& t : tensors_) {
    if (t.begin == t.end) continue;
    if (furthest != nullptr && t.begin < furthest->end)
      throw Error(path_ + ": tensors " + show(furthest->name) + " [" + std::to_string(furthest->begin - data_start) +
                  ", " + std::to_string(furthest->end - data_start) + ") and " + show(t.name) + " [" +
                  std::to_string(t.begin - data_start) + ", " + std::to_string(t.end - data_start) +
                  ") overlap in the data section");
    // The data section holds the tensors back to back, as the safetensors
    // library writes them and requires on reading: a hole is bytes no
    // tensor names (a damaged or hand-edited header).
    const int64_t expected = furthest ? furthest->end : data_start;
    if (t.begin != expected)
      throw Error(path_ + ": tensor " + show(t.name) + " begins at byte " + std::to_string(t.begin - data_start) +
                  " of the data section, where " +
                  (furthest ? "tensor " + show(furthest->name) + " ends at " : std::string("the section starts at ")) +
                  std::to_string(expected - data_start) +
                  ": bytes no tensor covers (the safetensors library refuses such a file too)");
    if (furthest == nullptr || t.end > furthest->end) furthest = &t;
  }
  const int64_t used = furthest ? furthest->end : data_start;
  if (used != file_bytes_)
    throw Error(path_ + ": " + std::to_string(file_bytes_ - used) + " bytes after the last tensor's data (the data "
                "section is " + std::to_string(data_bytes) + " bytes, the tensors cover " +
                std::to_string(used - data_start) + "): a file with bytes appended, or a damaged header (the "
                "safetensors library refuses such a file too)");
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

const StoredTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::read_f32(const StoredTensor& t, int64_t first, int64_t count, float* out) const {
  const StoredTensor* mine = find(t.name);
  if (mine == nullptr || mine->begin != t.begin || mine->end != t.end || mine->stored_dtype != t.stored_dtype)
    throw Error(path_ + ": read_f32 of tensor " + show(t.name) + ", which is not an entry of this file (a caller bug)");
  if (!mine->readable)
    throw Error(path_ + ": tensor " + show(t.name) + " is " + mine->stored_dtype + "; zinc reads F32, BF16 and F16");
  const int64_t numel = mine->numel();
  if (first < 0 || count < 0 || first > numel || count > numel - first)
    throw Error(path_ + ": read_f32 of tensor " + show(t.name) + ": " + std::to_string(count) +
                " elements from element " + std::to_string(first) + " are outside its " + std::to_string(numel) +
                " elements (a caller bug)");
  const int64_t esize = static_cast<int64_t>(dtype_bytes(mine->dtype));
  const int64_t piece = kPieceBytes / esize;
  std::vector<uint16_t> buf(mine->dtype == DType::kF32 ? 0 : static_cast<size_t>(std::min(count, piece)));
  for (int64_t done = 0; done < count;) {
    const int64_t take = std::min(count - done, piece);
    const int64_t at = mine->begin + (first + done) * esize;
    if (mine->dtype == DType::kF32) {
      pread_full(fd_.get(), out + done, take * esize, at, path_);
    } else {
      pread_full(fd_.get(), buf.data(), take * esize, at, path_);
      convert_16_to_f32(buf.data(), out + done, static_cast<size_t>(take), mine->dtype);
    }
    done += take;
  }
}

SafetensorsFolder::SafetensorsFolder(std::string dir) : dir_(std::move(dir)) {
  const fs::path d(dir_);
  const fs::path single = d / "model.safetensors", index = d / "model.safetensors.index.json";
  std::map<std::string, std::vector<std::string>> shards;  // the index's shard file names -> their tensors
  std::error_code ec;
  if (!fs::is_directory(d, ec))
    throw IoError(dir_ + ": not a folder (looked in it for model.safetensors or model.safetensors.index.json)");
  // symlink_status: a dangling link (a hub cache missing its blob) is
  // reported by the open, not taken for an absent file.
  if (fs::exists(fs::symlink_status(single, ec))) {
    files_.emplace_back(single.string());
  } else if (fs::exists(fs::symlink_status(index, ec))) {
    index_ = index.string();
    int64_t bytes = 0;
    const UniqueFd fd = open_regular(index_, &bytes);
    if (bytes > static_cast<int64_t>(kMaxHeaderBytes))
      throw Error(index_ + ": " + std::to_string(bytes) + " bytes, over the limit of " +
                  std::to_string(kMaxHeaderBytes) + " for an index");
    std::string text(static_cast<size_t>(bytes), '\0');
    pread_full(fd.get(), text.data(), bytes, 0, index_);
    const json j = parse_unique(text, index_, "the index");
    if (!j.contains("weight_map")) throw Error(index_ + ": the index has no weight_map");
    const json& map = j.at("weight_map");
    if (!map.is_object())
      throw Error(index_ + ": weight_map is a JSON " + std::string(map.type_name()) +
                  ", not an object of tensor name: shard file name");
    if (j.contains("metadata") && !j.at("metadata").is_object())
      throw Error(index_ + ": metadata is a JSON " + std::string(j.at("metadata").type_name()) + ", not an object");

    for (const auto& [tensor, shard] : map.items()) {
      if (!shard.is_string())
        throw Error(index_ + ": weight_map maps tensor " + show(tensor) + " to a JSON " +
                    std::string(shard.type_name()) + ", not a file name");
      const std::string& s = shard.get_ref<const std::string&>();
      if (s.empty() || s == "." || s == ".." || s.find('/') != std::string::npos || s.find('\0') != std::string::npos)
        throw Error(index_ + ": weight_map maps tensor " + show(tensor) + " to " + show(s) +
                    ", which is not a plain file name in the folder (no '/', '.' or '..')");
      shards[s].push_back(tensor);
    }
    for (const auto& [shard, tensors] : shards) {
      const fs::path p = d / shard;
      if (!fs::exists(p, ec))
        throw IoError(p.string() + ": no such file, but " + index_ + " names it for " + std::to_string(tensors.size()) +
                      " tensors (" + show(tensors.front()) + (tensors.size() > 1 ? ", ..." : "") +
                      "); the download is incomplete?");
    }
    files_.reserve(shards.size());
    for (const auto& [shard, tensors] : shards) files_.emplace_back((d / shard).string());
  } else {
    throw Error(dir_ +
                ": holds neither model.safetensors nor model.safetensors.index.json "
                "(not a Hugging Face weights folder, or an incomplete download)");
  }

  for (const SafetensorsFile& f : files_) {
    paths_.push_back(f.path());
    for (const StoredTensor& t : f.tensors()) {
      auto [it, fresh] = where_.emplace(t.name, std::make_pair(&f, &t));
      if (!fresh)
        throw Error(f.path() + ": tensor " + show(t.name) + " is also in " + it->second.first->path() +
                    " (one tensor in two files)");
    }
  }
  for (const auto& [shard, tensors] : shards) {
    const std::string path = (d / shard).string();
    for (const std::string& tensor : tensors) {
      auto it = where_.find(tensor);
      if (it == where_.end() || it->second.first->path() != path)
        throw Error(index_ + ": maps tensor " + show(tensor) + " to " + path + ", which does not contain it" +
                    (it == where_.end() ? std::string(" (no file of the folder does)")
                                        : " (it is in " + it->second.first->path() + ")"));
    }
  }
}

std::vector<std::string> SafetensorsFolder::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, at] : where_) out.push_back(name);
  return out;
}

std::pair<const SafetensorsFile*, const StoredTensor*> SafetensorsFolder::find(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? std::make_pair(nullptr, nullptr) : it->second;
}

}  // namespace zinc::tools
