// Shared by the config tests (engine/config_test.cpp, and the experiment
// sections' tools/experiment_config_test.cpp): a minimal document, patches
// of it, and checks on the ConfigError a parse throws.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/config.h"

namespace zinc::testing_config {

using nlohmann::json;

// A minimal valid config: one micro-batch of 8 per rank.
inline json base() { return json{{"train_micro_batch_size_per_gpu", 8}}; }

// base() with `patch` merged in (RFC 7396: nested objects merge).
inline json with(const json& patch) {
  json j = base();
  j.merge_patch(patch);
  return j;
}

// The ConfigError message of parse(j), or a test failure if it parses.
template <typename Parse>
std::string error_of_parse(Parse&& parse, const json& j) {
  try {
    parse(j);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ConfigError for " << j.dump();
  return "";
}

// Every part occurs in `text`.
inline void expect_parts(const std::string& text, const std::vector<std::string>& parts) {
  for (const auto& p : parts)
    EXPECT_NE(text.find(p), std::string::npos) << "missing \"" << p << "\" in: " << text;
}

// Whether any of a parse's warnings contains `part`.
template <typename Parsed>
bool any_warning_has(const Parsed& c, const std::string& part) {
  for (const auto& w : c.warnings) {
    if (w.find(part) != std::string::npos) return true;
  }
  return false;
}

// The ConfigError message of Config::parse(j), or a test failure if it parses.
inline std::string config_error(const json& j, int world_size = 1) {
  return error_of_parse([world_size](const json& d) { Config::parse(d, world_size); }, j);
}

inline std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/zinc_config_test_" + name;
}

inline void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

}  // namespace zinc::testing_config

// The ConfigError of config_error(j) contains every part (config_error is
// the test file's own parse).
#define EXPECT_CONFIG_ERROR(j, ...) ::zinc::testing_config::expect_parts(config_error(j), {__VA_ARGS__})
