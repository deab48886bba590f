// zinc tools: reading the safetensors format (tools/safetensors.h describes
// it) and Hugging Face weights folders, for loading their checkpoints. The
// header is validated in full before anything is read (Note [safetensors
// reader] in safetensors_read.cpp): every failure is one zinc::Error whose
// message starts with the path of the file at fault and says what is wrong;
// a lying length or offset never makes an out-of-bounds read or a large
// allocation.
//
// Ownership and threads: a SafetensorsFile owns one read-only descriptor for
// its lifetime (what was validated is what is read, even if the path is
// replaced); a SafetensorsFolder owns its files. Both are immutable after
// construction, movable and not copyable; read_f32 uses pread only, so any
// number of threads may read one file at once.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/unique_fd.h"

namespace zinc::tools {

// One tensor of a file.
struct StoredTensor {
  std::string name;
  DType dtype = DType::kF32;  // meaningful only when readable
  std::string stored_dtype;   // as the header spells it: "F32", "BF16", "F16", "F64", "I64", ...
  bool readable = false;      // F32, BF16 or F16: read_f32 converts it
  std::vector<int64_t> shape;
  int64_t begin = 0, end = 0;  // absolute byte offsets [begin, end) of its data in the file
  int64_t numel() const;
  int64_t bytes() const { return end - begin; }
};

// One safetensors file, its header parsed and checked at construction.
class SafetensorsFile {
 public:
  // Opens PATH, reads and validates the header; throws zinc::Error (IoError
  // when the system refuses the file) starting with PATH.
  explicit SafetensorsFile(std::string path);
  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<StoredTensor>& tensors() const { return tensors_; }  // in data-offset order
  const StoredTensor* find(const std::string& name) const;               // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  int64_t file_bytes() const { return file_bytes_; }

  // Elements [first, first + count) of `t` (an entry of this file, or a
  // copy of one) in flat row-major order, converted to fp32 (bf16 and f16
  // widen exactly). Reads only those bytes, through pread in pieces of at
  // most 4 MiB, retrying short reads. Throws zinc::Error for a dtype zinc
  // cannot convert ("PATH: tensor NAME is F64; ..."), a range outside the
  // tensor or a tensor of another file (caller bugs), and IoError when the
  // read fails or the file shrank since it was opened.
  void read_f32(const StoredTensor& t, int64_t first, int64_t count, float* out) const;

 private:
  std::string path_;
  UniqueFd fd_;
  int64_t file_bytes_ = 0;
  std::vector<StoredTensor> tensors_;
  std::map<std::string, size_t> by_name_;  // index into tensors_
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face weights folder: DIR/model.safetensors (taken first, as the
// transformers loader does, when both are present), or
// DIR/model.safetensors.index.json ({"metadata": {...}, "weight_map":
// {tensor name: shard file name}}) and the shards it names. The index must
// agree with the shards: each tensor it maps is in the shard it names, and
// no tensor is in two files. A tensor a shard holds that the index does not
// list is still found (the loaders read whole shards).
class SafetensorsFolder {
 public:
  // Throws zinc::Error naming the file at fault (the folder when it holds
  // neither file).
  explicit SafetensorsFolder(std::string dir);

  const std::string& dir() const { return dir_; }
  std::vector<std::string> names() const;  // every tensor name, sorted
  // The file holding `name` and its entry; {nullptr, nullptr} if absent.
  std::pair<const SafetensorsFile*, const StoredTensor*> find(const std::string& name) const;
  const std::vector<std::string>& files() const { return paths_; }  // the safetensors files, as opened
  const std::string& index() const { return index_; }               // the index file; empty without one

 private:
  std::string dir_, index_;
  std::vector<SafetensorsFile> files_;  // not resized after construction: where_ points into it
  std::vector<std::string> paths_;
  std::map<std::string, std::pair<const SafetensorsFile*, const StoredTensor*>> where_;
};

}  // namespace zinc::tools
