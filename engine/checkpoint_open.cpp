// Opening a checkpoint tag for a load (Note [checkpoints] in
// checkpoint.cpp): every file of the tag is checked before anything is read
// into the engine: the metadata's and indexes' checksums, their structure,
// the regions against the shard files' sizes.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "engine/config.h"  // read_json_file

namespace zinc::ckpt {

// ---- opening ------------------------------------------------------------------------

namespace {

std::string escaped(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Checked reads of one checkpoint file's JSON: a missing key, a wrong type or
// a value out of range is an IoError naming the file and the JSON path.
class Fields {
 public:
  explicit Fields(std::string file) : file_(std::move(file)) {}
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw IoError("checkpoint: " + file_ + ": " + (path.empty() ? "" : path + ": ") + what +
                  " (edited or damaged; nothing was loaded)");
  }
  const nlohmann::json& at(const nlohmann::json& j, const std::string& path, const char* key) const {
    if (!j.is_object()) fail(path, "expected an object, got " + brief(j));
    auto it = j.find(key);
    if (it == j.end()) fail(join(path, key), "missing");
    return *it;
  }
  int64_t integer(const nlohmann::json& j, const std::string& path, int64_t lo, int64_t hi) const {
    if (!j.is_number_integer() || (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(hi)) ||
        j.get<int64_t>() < lo || j.get<int64_t>() > hi)
      fail(path, "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + brief(j));
    return j.get<int64_t>();
  }
  int64_t integer(const nlohmann::json& j, const std::string& path, const char* key, int64_t lo, int64_t hi) const {
    return integer(at(j, path, key), join(path, key), lo, hi);
  }
  void number_or_null(const nlohmann::json& j, const std::string& path, const char* key) const {
    const nlohmann::json& v = at(j, path, key);
    if (!v.is_number() && !v.is_null()) fail(join(path, key), "expected a number or null, got " + brief(v));
  }
  const std::string& string(const nlohmann::json& j, const std::string& path, const char* key) const {
    const nlohmann::json& v = at(j, path, key);
    if (!v.is_string()) fail(join(path, key), "expected a string, got " + brief(v));
    return v.get_ref<const std::string&>();
  }
  const nlohmann::json& array(const nlohmann::json& j, const std::string& path, const char* key) const {
    const nlohmann::json& v = at(j, path, key);
    if (!v.is_array()) fail(join(path, key), "expected an array, got " + brief(v));
    return v;
  }
  static std::string join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }
  static std::string item(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

 private:
  static std::string brief(const nlohmann::json& j) {
    std::string d = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return d.size() > 60 ? d.substr(0, 57) + "..." : d;
  }
  std::string file_;
};

// A checkpoint's JSON file: ours, so any parse error is damage.
nlohmann::json parse_file(const std::string& path, const std::string& text) {
  // The JSON parser ends its input at a NUL byte: whatever follows one
  // (bytes appended to the file) would pass unseen.
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    throw IoError("checkpoint: " + path + " is not valid JSON (edited or damaged): a NUL byte at offset " +
                  std::to_string(nul));
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw IoError("checkpoint: " + path + " is not valid JSON (edited or damaged): " + e.what());
  }
}

std::string rank_file(int r, const char* ext) {
  char name[32];
  std::snprintf(name, sizeof name, "rank%05d.%s", r, ext);
  return name;
}

// The structure of a tag, checked (the Note's list): `meta` is sealed-checked
// already; `ranks` are the parsed indexes.
void check_structure(const TagFiles& t) {
  namespace fs = std::filesystem;
  const std::string meta_path = t.dir + "/metadata.json";
  const Fields mf(meta_path);
  const nlohmann::json& meta = t.meta;
  const int64_t world = mf.integer(meta, "", "world_size", 1, int64_t{1} << 24);
  mf.integer(meta, "", "zero_stage", 0, 3);
  const nlohmann::json& blocks = mf.array(meta, "", "blocks");
  std::vector<int64_t> numel;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const std::string at = Fields::item("blocks", b);
    mf.string(blocks[b], at, "name");
    numel.push_back(mf.integer(blocks[b], at, "numel", 0, int64_t{1} << 50));
    const nlohmann::json& params = mf.array(blocks[b], at, "params");
    for (size_t p = 0; p < params.size(); ++p) {
      const std::string pa = Fields::item(at + ".params", p);
      mf.string(params[p], pa, "name");
      const nlohmann::json& shape = mf.array(params[p], pa, "shape");
      int64_t n = 1;  // elements, saturating past any block's size
      for (size_t d = 0; d < shape.size(); ++d) {
        const int64_t dim = mf.integer(shape[d], Fields::item(pa + ".shape", d), 0, int64_t{1} << 40);
        n = dim == 0 ? 0 : n > (int64_t{1} << 52) / dim ? int64_t{1} << 52 : n * dim;
      }
      const int64_t off = mf.integer(params[p], pa, "offset", 0, int64_t{1} << 50);
      if (off + n > numel.back())
        mf.fail(pa, "elements " + std::to_string(off) + ".." + std::to_string(off + n) + " lie past the block's " +
                        std::to_string(numel.back()));
    }
  }
  if (static_cast<int64_t>(t.ranks.size()) != world)
    mf.fail("rank_indexes", std::to_string(t.ranks.size()) + " indexes for world_size " + std::to_string(world));
  const nlohmann::json& tr = mf.at(meta, "", "training");
  for (const char* k : {"global_steps", "micro_steps", "skipped_steps", "optimizer_steps"})
    mf.integer(tr, "training", k, 0, int64_t{1} << 62);
  mf.number_or_null(tr, "training", "lr");
  if (!tr.at("lr").is_number()) mf.fail("training.lr", "expected a number, got null");
  mf.number_or_null(tr, "training", "grad_norm");
  mf.number_or_null(tr, "training", "last_loss");
  if (tr.contains("loss_scale")) {
    const nlohmann::json& ls = tr["loss_scale"];
    mf.number_or_null(ls, "training.loss_scale", "scale");
    if (!ls.at("scale").is_number()) mf.fail("training.loss_scale.scale", "expected a number, got null");
    for (const char* k : {"hysteresis", "iteration", "last_overflow"})
      mf.integer(ls, "training.loss_scale", k, -(int64_t{1} << 62), int64_t{1} << 62);
  }

  // Spans per block, for the coverage check: (flat_offset, count) -> ranks.
  std::vector<std::map<std::pair<int64_t, int64_t>, int>> spans(blocks.size());
  for (size_t r = 0; r < t.ranks.size(); ++r) {
    const nlohmann::json& rk = t.ranks[r];
    const std::string index_path = t.dir + "/" + rank_file(static_cast<int>(r), "json");
    const Fields f(index_path);
    if (f.integer(rk, "", "rank", 0, world - 1) != static_cast<int64_t>(r))
      f.fail("rank", "is " + rk.at("rank").dump() + ", not " + std::to_string(r));
    const std::string bin = rank_file(static_cast<int>(r), "bin");
    if (f.string(rk, "", "file") != bin) f.fail("file", "is " + escaped(rk.at("file").get<std::string>()) + ", not \"" + bin + "\"");
    if (f.integer(rk, "", "chunk_elements", 1, int64_t{1} << 40) != kChunkNumel)
      f.fail("chunk_elements", "is " + rk.at("chunk_elements").dump() + ", not zinc's " + std::to_string(kChunkNumel));
    const std::string bin_path = t.dir + "/" + bin;
    struct stat st;
    if (::stat(bin_path.c_str(), &st) != 0) {
      const int err = errno;
      struct stat tag_st;
      if (err == ENOENT && ::stat(t.dir.c_str(), &tag_st) != 0)  // the whole tag went while it was read
        throw posix_error("checkpoint: cannot open " + bin_path + " (the tag " + t.dir + " was removed while it was "
                          "read: a run's run.keep_last pruning it? read another tag)", err);
      throw posix_error("checkpoint: cannot open " + bin_path, err);
    }
    if (!S_ISREG(st.st_mode)) throw IoError("checkpoint: " + bin_path + " is not a regular file");
    const int64_t size_now = st.st_size;
    // Written by this version: the size the writer allocated. Version 1
    // indexes have none; their regions are checked against the file alone.
    const bool sized = rk.contains("file_bytes");
    const int64_t file_bytes = sized ? f.integer(rk, "", "file_bytes", 0, int64_t{1} << 56) : INT64_MAX;
    const nlohmann::json& bl = f.array(rk, "", "blocks");
    std::set<int64_t> seen;
    std::vector<std::pair<int64_t, int64_t>> regions;  // [begin, end) in the file
    std::string past_end;  // the first region past the file's end now
    int64_t past_at = -1;
    for (size_t i = 0; i < bl.size(); ++i) {
      const std::string at = Fields::item("blocks", i);
      const int64_t b = f.integer(bl[i], at, "block", 0, static_cast<int64_t>(blocks.size()) - 1);
      if (!seen.insert(b).second) f.fail(at + ".block", "block " + std::to_string(b) + " appears twice");
      const int64_t off = f.integer(bl[i], at, "flat_offset", 0, int64_t{1} << 50);
      const int64_t count = f.integer(bl[i], at, "count", 0, int64_t{1} << 50);
      const int64_t chunks = (count + kChunkNumel - 1) / kChunkNumel;
      int k = 0;
      for (const char* key : {"master", "m", "v"}) {
        const std::string ka = at + "." + key;
        const nlohmann::json& kind = f.at(bl[i], at, key);
        const int64_t fo = f.integer(kind, ka, "file_offset", 0, int64_t{1} << 56);
        const nlohmann::json& sums = f.array(kind, ka, "xxh3_64_per_chunk");
        if (static_cast<int64_t>(sums.size()) != chunks)
          f.fail(ka + ".xxh3_64_per_chunk", std::to_string(sums.size()) + " checksums for " + std::to_string(count) +
                                                " elements (" + std::to_string(chunks) + " chunks)");
        for (size_t c = 0; c < sums.size(); ++c)
          if (!sums[c].is_string() || sums[c].get_ref<const std::string&>().size() != 16)
            f.fail(Fields::item(ka + ".xxh3_64_per_chunk", c), "expected 16 hex digits");
        const int64_t end = fo + count * 4;
        if (end > file_bytes)
          f.fail(ka, "bytes " + std::to_string(fo) + ".." + std::to_string(end) + " lie past the file's " +
                         std::to_string(file_bytes));
        if (count > 0) regions.emplace_back(fo, end);
        if (end > size_now && (past_at < 0 || fo < past_at)) {
          past_at = fo;
          const std::string name = blocks[static_cast<size_t>(b)].at("name").get<std::string>();
          past_end = "block '" + name + "' " + kind_name(k) + " (elements " + std::to_string(off) + ".." +
                     std::to_string(off + count) + ") is saved at bytes " + std::to_string(fo) + ".." +
                     std::to_string(end);
        }
        ++k;
      }
      if (count > 0) ++spans[static_cast<size_t>(b)][{off, count}];
    }
    if ((sized && size_now < file_bytes) || !past_end.empty())
      throw IoError("checkpoint: " + bin_path + " is truncated: it has " + std::to_string(size_now) +
                    " bytes" + (past_end.empty() ? ", its index says " + std::to_string(file_bytes) : ", and " + past_end) +
                    " (nothing was loaded)");
    // Longer than written: bytes appended, or another file put in its place.
    if (sized && size_now > file_bytes)
      throw IoError("checkpoint: " + bin_path + " has " + std::to_string(size_now) + " bytes where its index says " +
                    std::to_string(file_bytes) + ": it was changed after the save (bytes appended, or another "
                    "file put in its place); nothing was loaded");
    std::sort(regions.begin(), regions.end());
    for (size_t i = 1; i < regions.size(); ++i)
      if (regions[i].first < regions[i - 1].second)
        f.fail("blocks", "two regions overlap at byte " + std::to_string(regions[i].first) + " of " + bin);
  }
  // Every element of every block saved: the distinct spans tile the block
  // from 0 past its last element (the last shard's padding may follow), and
  // spans that repeat (stage 0: every rank saves the whole block) are equal.
  for (size_t b = 0; b < blocks.size(); ++b) {
    const std::string name = blocks[b].at("name").get<std::string>();
    if (blocks[b].contains("frozen")) {
      // BlockSpec::frozen: the checkpoint holds none of it.
      if (!blocks[b]["frozen"].is_boolean() || !blocks[b]["frozen"].get<bool>())
        mf.fail(Fields::item("blocks", b) + ".frozen", "expected true where present");
      if (!spans[b].empty())
        mf.fail("rank_indexes", "block '" + name + "' is frozen (not saved) but the rank indexes save some of it");
      continue;
    }
    int64_t end = 0;
    for (const auto& [span, ranks] : spans[b]) {
      if (span.first != end)
        mf.fail("rank_indexes",
                "block '" + name + "' " +
                    (span.first > end ? "has no saved elements " + std::to_string(end) + ".." + std::to_string(span.first)
                                      : "has elements from " + std::to_string(span.first) + " saved twice") +
                    " in the rank indexes");
      end = span.first + span.second;
    }
    if (end < numel[b])
      mf.fail("rank_indexes", "block '" + name + "' has " + std::to_string(numel[b]) + " elements but the rank indexes save " +
                                  (end == 0 ? "none" : "only 0.." + std::to_string(end)));
  }
}

}  // namespace

void check_tag(const std::string& tag) {
  bool ok = !tag.empty() && tag.size() <= kMaxTagBytes && tag != "latest" &&
            (std::isalnum(static_cast<unsigned char>(tag[0])) || tag[0] == '_');
  for (char c : tag)
    ok = ok && c > 0 && (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == '+');
  if (!ok)
    throw Error("checkpoint tag " + escaped(tag) + ": a tag is one folder name of 1 to " + std::to_string(kMaxTagBytes) +
                " characters from A-Z a-z 0-9 . _ - +, starting with a letter, a digit or '_', and not \"latest\"");
}

TagFiles open_tag(const std::string& dir, std::string tag) {
  namespace fs = std::filesystem;
  const bool from_latest = tag.empty();
  if (from_latest) {
    const std::string latest = (fs::path(dir) / "latest").string();
    if (!fs::exists(latest)) throw IoError("checkpoint: " + latest + " not found (no complete checkpoint in " + dir + ")");
    tag = read_bytes(latest);
    if (tag.size() > kMaxTagBytes + 1) tag.resize(kMaxTagBytes + 1);
    if (!tag.empty() && tag.back() == '\n') tag.pop_back();
    try {
      check_tag(tag);
    } catch (const Error& e) {
      throw IoError("checkpoint: " + latest + " does not name a tag (edited or damaged): " + e.what());
    }
  }
  check_tag(tag);
  TagFiles t;
  t.tag = tag;
  t.dir = (fs::path(dir) / tag).string();
  // A file system without RENAME_EXCHANGE (NFSv3, CIFS) re-saves a tag with
  // two renames, the old folder aside to .TAG.old first (commit_tag): a
  // kill between them leaves `latest` naming no folder, and the tag's
  // previous copy, whole, at .TAG.old. That copy is read.
  if (from_latest && !fs::exists(t.dir)) {
    const fs::path aside = fs::path(dir) / ("." + tag + ".old");
    std::error_code ec;
    if (fs::is_regular_file(aside / "metadata.json", ec)) {
      log_warn("checkpoint: " + t.dir + " is missing and " + aside.string() + " holds its previous copy (a save of "
               "the tag stopped between its two renames, on a file system without RENAME_EXCHANGE): reading that");
      t.dir = aside.string();
    }
  }
  const std::string meta_path = (fs::path(t.dir) / "metadata.json").string();
  if (from_latest && !fs::exists(t.dir))  // `latest` is only ever written naming a complete tag
    throw IoError("checkpoint: " + (fs::path(dir) / "latest").string() + " names " + escaped(tag) +
                  ", which is not a checkpoint in " + dir + " (the file was edited or damaged, or the tag removed)");
  if (!fs::exists(meta_path))
    throw IoError("checkpoint " + t.dir + ": " + meta_path + " not found (not a complete zinc checkpoint)");
  t.meta = parse_file(meta_path, read_bytes(meta_path));
  if (!t.meta.is_object() || t.meta.value("format", "") != "zinc-checkpoint")
    throw IoError("checkpoint " + t.dir + ": " + meta_path + " is not a zinc checkpoint's metadata");
  const nlohmann::json version = t.meta.value("version", nlohmann::json());
  if (version == 2 || t.meta.contains(kSealKey)) {
    verify_seal(t.meta, meta_path);
  } else if (version == 1) {
    static std::once_flag once;
    std::call_once(once, [&] {
      log_warn("checkpoint " + t.dir + " was written by a zinc before checksummed metadata: its indexes are checked "
               "for consistency but an edit that keeps them consistent would go unnoticed");
    });
  }
  if (version != 1 && version != 2)
    throw IoError("checkpoint " + t.dir + ": format version " + version.dump() + " is not one this zinc reads (1, 2)");
  const Fields mf(meta_path);
  const nlohmann::json& indexes = mf.array(t.meta, "", "rank_indexes");
  t.ranks = nlohmann::json::array();
  for (size_t r = 0; r < indexes.size(); ++r) {
    const std::string at = Fields::item("rank_indexes", r);
    const std::string want = rank_file(static_cast<int>(r), "json");
    const nlohmann::json& entry = indexes[r];
    const bool v2 = version == 2;
    const std::string name = v2 ? mf.string(entry, at, "file") : entry.is_string() ? entry.get<std::string>() : "";
    if (name != want) mf.fail(v2 ? at + ".file" : at, "expected \"" + want + "\"");
    const std::string path = (fs::path(t.dir) / name).string();
    if (!fs::exists(path)) throw IoError("checkpoint " + t.dir + ": " + path + " not found (the checkpoint is incomplete)");
    const std::string text = read_bytes(path);
    if (v2) {
      const int64_t bytes = mf.integer(entry, at, "bytes", 0, int64_t{1} << 40);
      if (static_cast<int64_t>(text.size()) != bytes || xxh3_hex(text.data(), text.size()) != mf.string(entry, at, "xxh3_64"))
        throw IoError("checkpoint: " + path + " is corrupted: its size or checksum is not the one " + meta_path +
                      " holds (edited, damaged or from another checkpoint; nothing was loaded)");
    }
    t.ranks.push_back(parse_file(path, text));
  }
  check_structure(t);
  for (const nlohmann::json& b : t.meta.at("blocks")) t.block_names.push_back(b.at("name").get<std::string>());
  return t;
}

}  // namespace zinc::ckpt
