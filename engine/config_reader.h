// zinc engine: the path-keeping JSON reader behind every config parser: the
// engine's DeepSpeed sections (config.cpp) and the sections other modules
// own, such as zinc-train's experiment sections (tools/experiment_config.cpp).
//
// A Reader walks one JSON object at a known path: it converts and
// range-checks values, and remembers which keys it was asked about, so that
// finish() turns every other key into an "unknown key" error with the
// nearest known key suggested. Every error is a zinc::ConfigError naming the
// JSON path, the value and the rule; warnings are logged and appended to the
// caller's list. The converters (to_int, to_choice, ...) and message helpers
// (show, num) below serve parsers that read a value outside a Reader.
//
// A Reader refers to the JSON and the warning list it was given: both must
// outlive it. Single-threaded use.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "engine/config_text.h"

namespace zinc::config {

using nlohmann::json;

// ---------------------------------------------------------------------------
// Small helpers

inline std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The offending value as it appeared in the JSON, shortened for messages.
// Never throws: bytes that are not UTF-8 show as U+FFFD instead of ending
// the message with nlohmann's type_error.316. A NaN or an infinity (a Python
// dict can hold them; JSON text cannot) shows as Python writes it, not as
// the "null" dump() writes.
inline std::string show(const json& v) {
  if (v.is_number_float() && !std::isfinite(v.get<double>())) {
    const double d = v.get<double>();
    return std::isnan(d) ? "nan" : d > 0 ? "inf" : "-inf";
  }
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// A number for a message: integral values without exponent or ".0".
inline std::string num(double v) {
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    return std::to_string(static_cast<int64_t>(v));
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

inline std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

// `path` is already shown (escaped); `key` is a raw key.
inline std::string join_path(const std::string& path, std::string_view key) {
  return path.empty() ? key_text(key) : path + "." + key_text(key);
}

// Type errors say what was expected and show the value; "auto" gets a hint
// because configs written for the Hugging Face integration are full of it.
[[noreturn]] inline void type_error(const std::string& path, const char* expected, const json& v) {
  std::string msg = std::string("expected ") + expected + ", got " + show(v);
  if (v.is_string() && v.get_ref<const std::string&>() == "auto") {
    msg += " (\"auto\" is a placeholder the Hugging Face Trainer fills in; zinc needs a concrete value)";
  }
  throw ConfigError(path, msg);
}

// An allowed interval of numbers, described the way error messages state it.
struct Range {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false, hi_open = false;

  bool contains(double v) const { return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi); }
  std::string describe() const {
    bool has_lo = std::isfinite(lo), has_hi = std::isfinite(hi);
    if (has_lo && has_hi) {
      return std::string("in ") + (lo_open ? "(" : "[") + num(lo) + ", " + num(hi) + (hi_open ? ")" : "]");
    }
    if (has_lo) return std::string(lo_open ? "> " : ">= ") + num(lo);
    if (has_hi) return std::string(hi_open ? "< " : "<= ") + num(hi);
    return "a number";
  }
};
inline Range any() { return {}; }
inline Range at_least(double lo) { return {lo, std::numeric_limits<double>::infinity(), false, false}; }
inline Range above(double lo) { return {lo, std::numeric_limits<double>::infinity(), true, false}; }
inline Range closed(double lo, double hi) { return {lo, hi, false, false}; }
inline Range lo_closed(double lo, double hi) { return {lo, hi, false, true}; }  // [lo, hi)
inline Range hi_closed(double lo, double hi) { return {lo, hi, true, false}; }  // (lo, hi]

inline void check_range(const std::string& path, double v, const Range& r, const json& shown) {
  if (!r.contains(v)) throw ConfigError(path, "must be " + r.describe() + ", got " + show(shown));
}

// JSON value -> C++ value, with the path for errors. Integers also accept
// integral floats, since DeepSpeed configs write sizes as 5e8.
inline int64_t to_int(const json& v, const std::string& path, const Range& r) {
  int64_t out = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      throw ConfigError(path, "does not fit in a 64-bit integer, got " + show(v));
    }
    out = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    out = v.get<int64_t>();
  } else if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) type_error(path, "an integer", v);
    if (std::fabs(d) >= 9.2e18) throw ConfigError(path, "does not fit in a 64-bit integer, got " + show(v));
    out = static_cast<int64_t>(d);
  } else {
    type_error(path, "an integer", v);
  }
  check_range(path, static_cast<double>(out), r, v);
  return out;
}

inline uint64_t to_u64(const json& v, const std::string& path) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() < 0) {
    throw ConfigError(path, "must be >= 0, got " + show(v));
  }
  return static_cast<uint64_t>(to_int(v, path, at_least(0)));
}

inline double to_number(const json& v, const std::string& path, const Range& r) {
  if (!v.is_number()) type_error(path, "a number", v);
  double d = v.get<double>();
  if (!std::isfinite(d)) throw ConfigError(path, "must be a finite number, got " + show(v));
  check_range(path, d, r, v);
  return d;
}

inline bool to_bool(const json& v, const std::string& path) {
  if (!v.is_boolean()) type_error(path, "true or false", v);
  return v.get<bool>();
}

inline std::string to_string(const json& v, const std::string& path) {
  if (!v.is_string()) type_error(path, "a string", v);
  return v.get<std::string>();
}

// A string that names a file or folder. A NUL byte would end the name where
// the system reads it (open, mkdir), so that another file than the one
// shown would be used.
inline std::string to_file_name(const json& v, const std::string& path) {
  std::string s = to_string(v, path);
  if (s.find('\0') != std::string::npos) {
    throw ConfigError(path, "a file or folder name cannot contain a NUL byte, got " + show(v));
  }
  return s;
}

// A string that must be one of `choices`; returns the choice's spelling.
inline std::string to_choice(const json& v, const std::string& path, const std::vector<std::string>& choices,
                      bool case_insensitive) {
  std::string s = to_string(v, path);
  for (const auto& c : choices) {
    if (case_insensitive ? lower(c) == lower(s) : c == s) return c;
  }
  std::string msg = "must be one of " + join(choices) + ", got " + show(v);
  std::string near = did_you_mean(s, choices);
  if (!near.empty()) msg += " (did you mean '" + near + "'?)";
  throw ConfigError(path, msg);
}

// ---------------------------------------------------------------------------
// Reader: one JSON object at a known path.

// A key and an optional alias spelling (DeepSpeed's pydantic aliases, e.g.
// prefetch_bucket_size / stage3_prefetch_bucket_size).
struct Name {
  std::string_view key, alias;
  Name(const char* k) : key(k) {}  // NOLINT: implicit on purpose
  Name(const char* k, const char* a) : key(k), alias(a) {}
};

class Reader {
 public:
  Reader(const json& j, std::string path, std::vector<std::string>& warnings, bool given = true)
      : j_(j), path_(std::move(path)), warnings_(warnings), given_(given) {
    if (!j_.is_object()) {
      if (path_.empty()) {
        throw ConfigError("", "the top level of the config must be a JSON object, got " + show(j_));
      }
      type_error(path_, "an object", j_);
    }
  }

  const std::string& path() const { return path_; }
  // False for a section that was absent or null (read as {}).
  bool given() const { return given_; }
  std::string path_of(std::string_view key) const { return join_path(path_, key); }

  // The value under `name` (either spelling), or nullptr. Marks the name
  // known. After a hit, last_path() is the path of the spelling used.
  const json* find(const Name& name) {
    remember(name.key);
    if (!name.alias.empty()) remember(name.alias);
    auto a = j_.find(std::string(name.key));
    auto b = name.alias.empty() ? j_.end() : j_.find(std::string(name.alias));
    if (a != j_.end() && b != j_.end()) {
      throw ConfigError(path_of(name.key), "set twice, as '" + std::string(name.key) +
                                               "' and as its alias '" + std::string(name.alias) +
                                               "'; keep one");
    }
    if (a != j_.end()) {
      last_path_ = path_of(name.key);
      return &*a;
    }
    if (b != j_.end()) {
      last_path_ = path_of(name.alias);
      return &*b;
    }
    return nullptr;
  }
  const std::string& last_path() const { return last_path_; }
  bool has(const Name& name) { return find(name) != nullptr; }
  // The keys the section holds, in order (none is marked known).
  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    for (auto it = j_.begin(); it != j_.end(); ++it) out.push_back(it.key());
    return out;
  }
  // A key another parser reads (a section the caller owns): not read here,
  // but known, so finish() accepts it and offers it for "did you mean".
  void skip(std::string_view key) { remember(key); }

  // Typed getters: if present, convert and check, store in `out`, return true.
  bool get_int(const Name& n, int64_t& out, const Range& r = any()) {
    const json* v = find(n);
    if (v) out = to_int(*v, last_path_, r);
    return v;
  }
  bool get_int(const Name& n, int& out, const Range& r) {
    int64_t x = out;
    bool got = get_int(n, x, r);
    out = static_cast<int>(x);
    return got;
  }
  bool get_u64(const Name& n, uint64_t& out) {
    const json* v = find(n);
    if (v) out = to_u64(*v, last_path_);
    return v;
  }
  bool get_number(const Name& n, double& out, const Range& r = any()) {
    const json* v = find(n);
    if (v) out = to_number(*v, last_path_, r);
    return v;
  }
  bool get_bool(const Name& n, bool& out) {
    const json* v = find(n);
    if (v) out = to_bool(*v, last_path_);
    return v;
  }
  bool get_string(const Name& n, std::string& out) {
    const json* v = find(n);
    if (v) out = to_string(*v, last_path_);
    return v;
  }
  bool get_file_name(const Name& n, std::string& out) {
    const json* v = find(n);
    if (v) out = to_file_name(*v, last_path_);
    return v;
  }
  bool get_choice(const Name& n, std::string& out, const std::vector<std::string>& choices,
                  bool case_insensitive = false) {
    const json* v = find(n);
    if (v) out = to_choice(*v, last_path_, choices, case_insensitive);
    return v;
  }

  // A choice kept as an enum: `names` pairs each spelling with its value.
  template <typename E>
  bool get_enum(const Name& n, E& out, const std::vector<std::pair<std::string, E>>& names,
                bool case_insensitive = false) {
    std::vector<std::string> choices;
    for (const auto& nv : names) choices.push_back(nv.first);
    std::string s;
    if (!get_choice(n, s, choices, case_insensitive)) return false;
    for (const auto& nv : names)
      if (nv.first == s) out = nv.second;
    return true;
  }

  // A nested object; absent or null gives an empty object (the defaults).
  Reader section(const Name& n) {
    const json* v = find(n);
    if (!v || v->is_null()) return Reader(empty_object(), path_of(n.key), warnings_, false);
    return Reader(*v, last_path_, warnings_, true);
  }

  // Known DeepSpeed keys that zinc does not implement. A value equal to
  // DeepSpeed's default is what zinc does anyway and passes silently;
  // anything else is a warning (harmless to ignore) or an error (ignoring it
  // would change the result).
  void ignore_bool(const Name& n, bool deflt, const char* why = nullptr) {
    bool v = deflt;
    if (get_bool(n, v) && v != deflt) warn_ignored(last_path_, why);
  }
  void ignore_int(const Name& n, int64_t deflt, const char* why = nullptr) {
    int64_t v = deflt;
    if (get_int(n, v) && v != deflt) warn_ignored(last_path_, why);
  }
  void refuse_bool(const Name& n, bool deflt, const char* why) {
    bool v = deflt;
    if (get_bool(n, v) && v != deflt) refuse(last_path_, why);
  }
  void refuse_int(const Name& n, int64_t deflt, const char* why) {
    int64_t v = deflt;
    if (get_int(n, v) && v != deflt) refuse(last_path_, why);
  }
  // Any value other than null / {} / false.
  void refuse_present(const Name& n, const char* why) {
    const json* v = find(n);
    if (v && !v->is_null() && !(v->is_object() && v->empty()) && !(v->is_boolean() && !v->get<bool>())) {
      refuse(last_path_, why);
    }
  }
  // Known, no effect in zinc, but must be a string or null (DeepSpeed's Optional[str]).
  void accept_string(const Name& n) {
    const json* v = find(n);
    if (v && !v->is_null() && !v->is_string()) type_error(last_path_, "a string", *v);
  }

  void warn(const std::string& path, const std::string& msg) {
    std::string w = path.empty() ? msg : path + ": " + msg;
    log_warn_rank0("config: " + w);
    warnings_.push_back(w);
  }
  void warn_ignored(const std::string& path, const char* why = nullptr) {
    warn(path, std::string("ignored: not implemented in zinc") + (why ? std::string("; ") + why : ""));
  }
  [[noreturn]] static void refuse(const std::string& path, const char* why) {
    throw ConfigError(path, std::string("not implemented in zinc; ") + why);
  }

  // The top level of a ds_config, where DeepSpeed reads the keys it knows
  // and ignores the rest (other tools' keys: `_comment`, Accelerate's `fp8`,
  // Megatron-DeepSpeed's `dynamic_train`): a key nobody asked about is
  // warned about and ignored, unless it is one edit from a known key (a
  // typo, which would silently drop a setting: an error with "did you
  // mean") or holds a control character (a damaged file, not a key anyone
  // typed).
  void finish_top_level() {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      const std::string& key = it.key();
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      const std::string near = one_edit_from(key, known_);
      const bool damaged = std::any_of(key.begin(), key.end(), [](char ch) {
        return static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f;
      });
      if (!near.empty() || damaged) {
        throw ConfigError(path_of(key), "unknown key" + (near.empty() ? std::string() : " (did you mean '" + near + "'?)"));
      }
      std::string msg = "not a DeepSpeed key; ignored";
      if (std::string nearest = did_you_mean(key, known_); !nearest.empty())
        msg += " (if you meant '" + nearest + "', correct it)";
      warn(path_of(key), msg);
    }
  }

  // Every key nobody asked about is an error, with the nearest known key.
  void finish() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (std::find(known_.begin(), known_.end(), it.key()) != known_.end()) continue;
      std::string msg = "unknown key";
      std::string near = did_you_mean(it.key(), known_);
      if (!near.empty()) {
        msg += " (did you mean '" + near + "'?)";
      } else if (known_.size() <= 12) {
        std::vector<std::string> sorted = known_;
        std::sort(sorted.begin(), sorted.end());
        msg += "; known keys here: " + join(sorted);
      }
      throw ConfigError(path_of(it.key()), msg);
    }
  }

 private:
  void remember(std::string_view key) {
    if (std::find(known_.begin(), known_.end(), key) == known_.end()) known_.emplace_back(key);
  }
  static const json& empty_object() {
    static const json kEmpty = json::object();
    return kEmpty;
  }

  const json& j_;
  std::string path_;
  std::vector<std::string>& warnings_;
  bool given_;
  std::vector<std::string> known_;
  std::string last_path_;
};

}  // namespace zinc::config
