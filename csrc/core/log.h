// zinc core: logging to stderr with the rank in front. Thread-safe (one
// fprintf per message). Level from ZINC_LOG_LEVEL (debug, info, warn, error;
// default info).
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

namespace zinc {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_log_rank(int rank);
int log_rank();
void set_log_level(LogLevel level);
LogLevel log_level();

void log(LogLevel level, const std::string& msg);
inline void log_debug(const std::string& m) { log(LogLevel::kDebug, m); }
inline void log_info(const std::string& m) { log(LogLevel::kInfo, m); }
inline void log_warn(const std::string& m) { log(LogLevel::kWarn, m); }
// A warning every rank would give alike (a config's, which every rank
// parses): said by rank 0 only, as DeepSpeed's logger says it.
inline void log_warn_rank0(const std::string& m) {
  if (log_rank() == 0) log_warn(m);
}
inline void log_error(const std::string& m) { log(LogLevel::kError, m); }

// A switch from the environment with a few known values: the variable's
// value when it is one of `known`, "" when it is unset or empty; any other
// value (a misspelling) is warned about, naming the variable and what it
// takes, and read as unset.
std::string env_choice(const char* var, std::initializer_list<const char*> known);

// While a LogCapture lives, every message at `min` or above is also kept in
// messages(), whatever the level printed (zinc-train --check reports the
// warnings a parse logged, even one that then failed). At most one at a
// time; not copyable; messages may come from any thread.
class LogCapture {
 public:
  explicit LogCapture(LogLevel min);
  ~LogCapture();
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::vector<std::string> messages() const;

 private:
  friend void log(LogLevel level, const std::string& msg);
  LogLevel min_;
  std::vector<std::string> messages_;  // guarded by the log's capture mutex
};

}  // namespace zinc
