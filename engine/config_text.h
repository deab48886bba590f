// zinc engine: how config keys appear in messages, shared by the config
// structs (config.h) and the reader that parses into them (config_reader.h)
// without either including the other.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace zinc {

namespace config {
// A key as a JSON path or a message shows it: control characters as JSON
// escapes (\u0000). A NUL would end the C string that what() hands to
// printf or to Python and cut the message short; a newline would break the
// one-line error.
inline std::string key_text(std::string_view key) {
  std::string out;
  out.reserve(key.size());
  for (char ch : key) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}
}  // namespace config

// The nearest of `candidates` to `key` by edit distance, or "" if none is close.
std::string did_you_mean(const std::string& key, const std::vector<std::string>& candidates);

// The first of `candidates` at most one edit from `key` (ignoring case; an
// edit is one character inserted, deleted or replaced, or two neighbours
// swapped), or "".
std::string one_edit_from(const std::string& key, const std::vector<std::string>& candidates);

}  // namespace zinc
