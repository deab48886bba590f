// zinc engine: config files and command-line overrides: reading a JSON file
// with the line and column of a syntax error, `--set json.path=value`, and
// the "did you mean" suggestion every unknown-key error uses.
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "engine/config.h"
#include "engine/config_reader.h"

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

}  // namespace

json read_json_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw posix_error("cannot open config file " + path, errno);
  std::string text;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  bool failed = std::ferror(f);
  int err = errno;
  std::fclose(f);
  if (failed) throw posix_error("cannot read config file " + path, err);

  // DeepSpeed rejects duplicate keys (dict_raise_error_on_duplicate_keys);
  // nlohmann would keep the last one silently. Track the keys per object.
  std::vector<std::set<std::string>> seen;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        seen.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!seen.empty()) seen.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!seen.empty() && !seen.back().insert(key).second) {
          throw ConfigError(path, "duplicate key '" + key + "' (DeepSpeed rejects duplicate keys too)");
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, callback);
  } catch (const json::parse_error& e) {
    auto [line, col] = line_col(text, e.byte > 0 ? e.byte - 1 : 0);
    std::string what = e.what();
    // nlohmann's text starts with "[json.exception.parse_error.101] parse error at line L, column C: ".
    if (auto pos = what.find(": "); pos != std::string::npos && what.find("parse error") < pos) {
      what = what.substr(pos + 2);
    }
    throw ConfigError(path, "JSON syntax error at line " + std::to_string(line) + ", column " +
                                std::to_string(col) + ": " + what);
  }
  return j;
}

Config Config::load(const std::string& path, int world_size, const std::vector<std::string>& caller_sections) {
  return parse(read_json_file(path), world_size, caller_sections);
}

void apply_override(json& j, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos) {
    throw ConfigError(assignment,
                      "an override must look like key.path=value (e.g. optimizer.params.lr=3e-4)");
  }
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  for (const auto& p : parts) {
    if (p.empty()) throw ConfigError(key, "empty component in override path '" + key + "'");
  }
  json value;
  try {
    value = json::parse(text);
  } catch (const json::parse_error&) {
    value = text;  // a bare word: `--set optimizer.type=AdamW`
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
      size_t idx = std::stoul(p);
      if (idx > cur->size() || (!last && idx == cur->size())) {
        throw ConfigError(here,
                          "index " + p + " is out of range for a list of " + std::to_string(cur->size()));
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

}  // namespace zinc
