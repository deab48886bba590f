// zinc tools: writing the safetensors format, and zinc-export's conversion of
// a checkpoint into it (Note [safetensors] in safetensors.cpp).
//
// The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
// ({"NAME": {"dtype", "shape", "data_offsets": [begin, end)}, ...,
// "__metadata__": {string: string}}, offsets relative to the data, tensors
// contiguous), padded with spaces so that the data starts 8-byte aligned,
// then the tensors' bytes, little-endian, row-major.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/unique_fd.h"

namespace zinc::tools {

struct SafeTensor {
  std::string name;
  DType dtype = DType::kF32;  // F32, BF16 or F16
  std::vector<int64_t> shape;
  int64_t numel() const;
  int64_t bytes() const;
};

// The header's bytes (length prefix, JSON, padding) for these tensors, laid
// out in the given order.
std::string safetensors_header(const std::vector<SafeTensor>& tensors,
                               const std::map<std::string, std::string>& metadata);

// Writes one file: the header at construction, then the tensors' bytes in
// order through append(); finish() checks that every byte came, fsyncs and
// renames its temporary (ckpt::temp_path: .NAME.zinc-tmp) to PATH. A file of
// a set (shards) is finished in two parts: finish_staged() (checked and
// fsynced, still the temporary) and, once every file of the set is,
// commit() (the rename). Destroyed uncommitted, it removes the temporary
// (an export that fails leaves no half-written file under the final name).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafeTensor> tensors, const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void append(const void* data, size_t bytes);
  void finish();
  void finish_staged();
  void commit();
  int64_t data_bytes() const { return data_bytes_; }

 private:
  void flush();
  std::string path_, tmp_;
  UniqueFd fd_;
  int64_t data_bytes_ = 0, appended_ = 0, file_offset_ = 0;
  std::string buffer_;
  bool committed_ = false;
};

// The largest safetensors file before an export shards, as the Hugging Face
// tools default it (--max-shard-size, save_pretrained's max_shard_size).
constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;
constexpr const char* kDefaultMaxShardSize = "5GB";  // the same, as text (a test checks they agree)

// "5GB", "500MB", "2GiB", "123456" (bytes): the decimal units as the Hugging
// Face tools read them (1 GB = 10^9 bytes), binary ones with an i. Throws
// zinc::Error naming `what` for anything else.
int64_t parse_size(const std::string& text, const std::string& what);

struct ExportOptions {
  std::string checkpoint_dir;
  std::string tag;          // empty: the one `latest` names
  std::string out;          // PATH.safetensors
  DType dtype = DType::kF32;
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
};

struct ExportResult {
  std::string tag;
  std::vector<std::string> files;  // the safetensors files written
  std::string index;               // the index file, when sharded
  int64_t tensors = 0, bytes = 0;  // tensor data bytes in all files
};

// Streams the checkpoint's fp32 master weights, tensor by tensor in pieces
// of at most a checksum chunk, into safetensors files named by the model's
// parameters ("h.0.attn.c_attn.weight"): one file at opts.out, or, when the
// tensors exceed max_shard_bytes, NAME-0000k-of-0000n.safetensors beside it
// with NAME.safetensors.index.json. `progress` gets one line per file.
ExportResult export_safetensors(const ExportOptions& opts,
                                const std::function<void(const std::string&)>& progress = nullptr);

// After a single file was written at `out` (NAME.safetensors): removes an
// earlier sharded export of NAME beside it (its index, then the shards),
// which the single file replaces (readers take the single file first).
void drop_sharded_set(const std::string& out);

// Refuses (Error starting with `what` and `out`) to write the files `names`
// (file names in out's folder) of the set at `out` (NAME.safetensors) where
// another set's index in that folder names one of them, or where
// NAME.safetensors.index.json is not a safetensors index (Note [another
// set's files] in safetensors.cpp).
void check_apart_from_other_sets(const std::string& out, const std::set<std::string>& names, const std::string& what);

}  // namespace zinc::tools
