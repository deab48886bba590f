// zinc core: errors. One policy: typed exceptions at module boundaries that
// carry their context (JSON path, file path and errno text, rank and
// collective); ZINC_CHECK for broken invariants, which prints file and line
// and aborts. Worker threads store exceptions in their handles; they never let
// one escape.
#pragma once

#include <stdexcept>
#include <string>

namespace zinc {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A config value that is wrong. what() starts with the JSON path.
class ConfigError : public Error {
 public:
  ConfigError(const std::string& path, const std::string& msg)
      : Error(path.empty() ? msg : path + ": " + msg), path_(path) {}
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A file or device operation that failed; what() names the file and the error.
class IoError : public Error {
 public:
  using Error::Error;
};

// A collective that failed; what() names the rank and the operation.
class CommError : public Error {
 public:
  using Error::Error;
};

// Translate an errno value into "ctx: strerror (errno N)".
IoError posix_error(const std::string& ctx, int err);

[[noreturn]] void check_failed(const char* cond, const char* file, int line, const std::string& msg);

}  // namespace zinc

#define ZINC_CHECK(cond, msg)                                            \
  do {                                                                   \
    if (!(cond)) ::zinc::check_failed(#cond, __FILE__, __LINE__, (msg)); \
  } while (0)
