// zinc engine: config files and command-line overrides: reading a JSON file
// with the place of every error and bounded nesting (Note [reading config
// JSON]), `--set json.path=value`, and the "did you mean" suggestion every
// unknown-key error uses.
#include <algorithm>
#include <charconv>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "engine/config.h"
#include "engine/config_reader.h"
#include "core/files.h"

namespace zinc {

using namespace config;

namespace {

// Line and column (1-based) of a byte offset in `text`.
std::pair<size_t, size_t> line_col(const std::string& text, size_t byte) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < byte && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

std::string at_line_col(const std::string& text, size_t byte) {
  auto [line, col] = line_col(text, byte);
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

// The byte offset of the bracket that opens nesting level `level` + 1 (the
// first one past the limit), found again in the text because the SAX events
// carry no positions. Strings are skipped; the text up to there parsed.
size_t deep_bracket(const std::string& text, int level) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > level) return i;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return text.size();
}

// Whether `s` is UTF-8 (a JSON document can hold only UTF-8 text: dumping
// one with other bytes throws nlohmann's type_error.316 wherever it is
// printed or saved).
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1f : n == 3 ? c & 0x0f : c & 0x07;
    for (size_t k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    // Overlong forms, surrogates and code points past U+10FFFF.
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
        (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
      return false;
    i += n;
  }
  return true;
}

// A file name (or an override) as messages show it: control characters
// escaped as in keys, and where it is not UTF-8 (a Linux file name may be
// any bytes) each byte past ASCII as \xNN, so that the message stays one
// line of text that Python can decode.
std::string printable(const std::string& text) {
  if (valid_utf8(text)) return key_text(text);
  std::string out;
  for (char ch : key_text(text)) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x80) {
      out += ch;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

// A JSON syntax error, which apply_override takes as "a bare word" and
// every other caller reports as it is.
class SyntaxError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// Note [reading config JSON]
// --------------------------
// Config text is read by nlohmann's SAX parser into a document this class
// builds, rather than by json::parse, for four reasons, each a defect that
// json::parse let through:
//   - depth: a document nested deeper than kMaxConfigDepth is refused at the
//     bracket that passes the limit. nlohmann's parser is iterative, but
//     copying, comparing and dumping a document recurse, so a 100,000-deep
//     one overflowed the stack later, far from the file;
//   - numbers that do not fit in a double (1e400) are refused with their
//     line, column and JSON path, where json::parse threw a bare
//     out_of_range.406;
//   - duplicate keys are refused with their JSON path (DeepSpeed refuses
//     them; nlohmann keeps the last one silently);
//   - the JSON path of every error is known, escaped for messages
//     (config::key_text).
class DocumentBuilder {
 public:
  // `origin`: the file (or "--set key") errors name. `max_depth`: the
  // nesting allowed below the text's own root.
  DocumentBuilder(const std::string& text, std::string origin, int max_depth, std::string base)
      : text_(text), origin_(std::move(origin)), max_depth_(max_depth), base_(std::move(base)) {}

  json take() { return std::move(root_); }

  bool null() { return place(nullptr); }
  bool boolean(bool v) { return place(v); }
  bool number_integer(json::number_integer_t v) { return place(v); }
  bool number_unsigned(json::number_unsigned_t v) { return place(v); }
  bool number_float(json::number_float_t v, const std::string&) { return place(v); }
  bool string(std::string& v) { return place(std::move(v)); }
  bool binary(json::binary_t&) { return place(nullptr); }  // not produced by JSON text
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(std::string& k) {
    Frame& f = stack_.back();
    if (!f.keys.insert(k).second) {
      throw ConfigError(origin_, join_path(f.path, k) + ": duplicate key '" + key_text(k) +
                                     "' (DeepSpeed rejects duplicate keys too)");
    }
    key_ = std::move(k);
    return true;
  }

  bool parse_error(std::size_t position, const std::string& token, const json::exception& e) {
    const size_t byte = position > 0 ? position - 1 : 0;
    if (e.id == 406) {
      // A number past the double's range: its start is the token's.
      const size_t start = byte >= token.size() ? byte + 1 - token.size() : 0;
      throw ConfigError(origin_, at_line_col(text_, start) + ": " + shown(next_path()) + "number " + token +
                                     " is out of range (a JSON number in a config must fit in a double, "
                                     "magnitude below 1.8e308)");
    }
    std::string what = e.what();
    // nlohmann's text starts with "[json.exception.parse_error.101] parse error at line L, column C: ".
    if (auto pos = what.find(": "); pos != std::string::npos && what.find("parse error") < pos) {
      what = what.substr(pos + 2);
    }
    throw SyntaxError(origin_, "JSON syntax error at " + at_line_col(text_, byte) + ": " + what);
  }

 private:
  struct Frame {
    json* value;
    std::string path;  // shown (escaped), base_ included
    std::set<std::string> keys;
  };

  // The path of the value about to be placed.
  std::string next_path() const {
    if (stack_.empty()) return base_;
    const Frame& f = stack_.back();
    if (f.value->is_array()) return f.path + "[" + std::to_string(f.value->size()) + "]";
    return join_path(f.path, key_);
  }
  static std::string shown(const std::string& path) { return path.empty() ? "" : path + ": "; }

  json* slot() {
    if (stack_.empty()) return &root_;
    Frame& f = stack_.back();
    if (f.value->is_array()) {
      f.value->push_back(nullptr);
      return &f.value->back();
    }
    return &(*f.value)[key_];
  }
  bool place(json&& v) {
    *slot() = std::move(v);
    return true;
  }
  bool open(json&& container) {
    if (static_cast<int>(stack_.size()) >= max_depth_) {
      const size_t at = deep_bracket(text_, max_depth_);
      throw ConfigError(origin_, at_line_col(text_, at) + ": " + shown(next_path()) + "nested deeper than " +
                                     std::to_string(kMaxConfigDepth) +
                                     " levels of objects and lists (the limit for a config; DeepSpeed's "
                                     "need a handful)");
    }
    std::string path = next_path();
    json* s = slot();
    *s = std::move(container);
    stack_.push_back({s, std::move(path), {}});
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  const std::string& text_;
  std::string origin_;
  int max_depth_;
  std::string base_;
  json root_;
  std::vector<Frame> stack_;
  std::string key_;
};

// `text` as JSON, read as Note [reading config JSON] says. `max_depth`
// levels of nesting are allowed; `base`: the JSON path of the text's root.
json parse_text(const std::string& text, const std::string& origin, int max_depth = kMaxConfigDepth,
                const std::string& base = "") {
  // The parser ends its input at a NUL byte, so text after one was ignored.
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    throw ConfigError(base, origin + ": a NUL byte at offset " + std::to_string(nul) +
                                " (a JSON document is text; nothing may follow it)");
  DocumentBuilder builder(text, origin, max_depth, base);
  json::sax_parse(text, &builder);  // errors throw from the builder
  return builder.take();
}

}  // namespace

json parse_json_text(const std::string& text, const std::string& origin) { return parse_text(text, origin); }

json read_json_file(const std::string& path) {
  // A regular file of bounded size: /dev/zero or a FIFO named as a config
  // would otherwise be read without end (or wait for a writer).
  const std::string shown = printable(path);
  return parse_text(read_small_file(path, kMaxJsonFileBytes, "config file", shown), shown);
}

Config Config::load(const std::string& path, int world_size, const std::vector<std::string>& caller_sections) {
  return parse(read_json_file(path), world_size, caller_sections);
}

void apply_override(json& j, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos) {
    throw ConfigError(printable(assignment),
                      "an override must look like key.path=value (e.g. optimizer.params.lr=3e-4)");
  }
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  const std::string shown_key = printable(key);
  if (!valid_utf8(key)) throw ConfigError(shown_key, "the override's path is not UTF-8 text");
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (const auto& p : parts) {
    if (p.empty()) throw ConfigError(shown_key, "empty component in override path '" + shown_key + "'");
  }
  // The value sits inside one object or list per path component: the path
  // and the value's own nesting share kMaxConfigDepth.
  const int depth = static_cast<int>(std::min<size_t>(parts.size(), kMaxConfigDepth + 1));
  if (depth > kMaxConfigDepth) {
    throw ConfigError(shown_key.substr(0, 200) + (shown_key.size() > 200 ? "..." : ""),
                      "the override's path has " + std::to_string(parts.size()) + " components, more than the " +
                          std::to_string(kMaxConfigDepth) + " levels of nesting a config may have");
  }
  json value;
  try {
    const std::string shown = printable(assignment);
    value = parse_text(text, "--set " + (shown.size() > 120 ? shown.substr(0, 117) + "..." : shown),
                       kMaxConfigDepth - depth, shown_key);
  } catch (const SyntaxError&) {
    // A bare word: `--set optimizer.type=AdamW`.
    if (!valid_utf8(text)) throw ConfigError(shown_key, "the override's value is not UTF-8 text");
    value = text;
  }

  if (j.is_null()) j = json::object();
  json* cur = &j;
  std::string at;  // the path walked so far
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& p = parts[i];
    const bool last = i + 1 == parts.size();
    std::string here = join_path(at, p);
    if (cur->is_array()) {
      bool numeric = std::all_of(p.begin(), p.end(),
                                 [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); });
      if (!numeric) {
        throw ConfigError(
            here, "'" + (at.empty() ? std::string("<root>") : at) + "' is a list; index it with a number");
      }
      // Digits only, but maybe more than a size_t holds (99999999999999999999):
      // out of range like any index past the end.
      size_t idx = 0;
      const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), idx);
      if (ec != std::errc() || end != p.data() + p.size() || idx > cur->size() ||
          (!last && idx == cur->size())) {
        throw ConfigError(here, "index " + p + " is out of range for a list of " + std::to_string(cur->size()) +
                                    " (an override may replace an element or append one at index " +
                                    std::to_string(cur->size()) + ")");
      }
      if (idx == cur->size()) {
        cur->push_back(value);  // appending one past the end
        return;
      }
      cur = &(*cur)[idx];
    } else if (cur->is_object()) {
      cur = &(*cur)[p];
    } else {
      throw ConfigError(here,
                        "cannot set a key inside '" + at + "', which is " + show(*cur) + ", not an object");
    }
    if (last) {
      *cur = value;
    } else if (cur->is_null()) {
      *cur = json::object();
    }
    at = here;
  }
}

std::string did_you_mean(const std::string& key, const std::vector<std::string>& candidates) {
  const std::string k = lower(key);
  const size_t limit = std::max<size_t>(2, k.size() / 3);
  std::string best;
  size_t best_dist = limit + 1;
  std::vector<size_t> row;
  for (const auto& cand : candidates) {
    const std::string c = lower(cand);
    // Levenshtein distance, one row at a time.
    row.resize(c.size() + 1);
    for (size_t x = 0; x <= c.size(); ++x) row[x] = x;
    for (size_t y = 1; y <= k.size(); ++y) {
      size_t diag = row[0];
      row[0] = y;
      for (size_t x = 1; x <= c.size(); ++x) {
        size_t up = row[x];
        row[x] = std::min({row[x] + 1, row[x - 1] + 1, diag + (k[y - 1] == c[x - 1] ? 0 : 1)});
        diag = up;
      }
    }
    if (row[c.size()] < best_dist) {
      best_dist = row[c.size()];
      best = cand;
    }
  }
  return best;
}

std::string one_edit_from(const std::string& key, const std::vector<std::string>& candidates) {
  const std::string k = lower(key);
  auto one_edit = [](const std::string& a, const std::string& b) {
    if (a == b) return true;
    if (a.size() == b.size()) {
      size_t i = 0;
      while (a[i] == b[i]) ++i;  // a != b: stops inside
      if (a.compare(i + 1, std::string::npos, b, i + 1, std::string::npos) == 0) return true;  // replaced
      return i + 1 < a.size() && a[i] == b[i + 1] && a[i + 1] == b[i] &&
             a.compare(i + 2, std::string::npos, b, i + 2, std::string::npos) == 0;  // swapped
    }
    const std::string& longer = a.size() > b.size() ? a : b;
    const std::string& shorter = a.size() > b.size() ? b : a;
    if (longer.size() != shorter.size() + 1) return false;
    size_t i = 0;
    while (i < shorter.size() && shorter[i] == longer[i]) ++i;
    return shorter.compare(i, std::string::npos, longer, i + 1, std::string::npos) == 0;  // inserted
  };
  for (const auto& cand : candidates)
    if (one_edit(k, lower(cand))) return cand;
  return "";
}

}  // namespace zinc
