#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace zinc {
namespace {

std::atomic<int> g_rank{0};

LogLevel level_from_env() {
  const char* s = std::getenv("ZINC_LOG_LEVEL");
  if (!s) return LogLevel::kInfo;
  if (!std::strcmp(s, "debug")) return LogLevel::kDebug;
  if (!std::strcmp(s, "warn")) return LogLevel::kWarn;
  if (!std::strcmp(s, "error")) return LogLevel::kError;
  // A misspelt level was once taken as info without a word.
  if (std::strcmp(s, "info") != 0 && *s)
    std::fprintf(stderr, "[zinc] warning: ZINC_LOG_LEVEL=\"%s\" is none of debug, info, warn, error: logging at info\n",
                 s);
  return LogLevel::kInfo;
}

std::atomic<int> g_level{static_cast<int>(level_from_env())};

std::mutex g_capture_mu;
LogCapture* g_capture = nullptr;  // guarded by g_capture_mu

}  // namespace

std::string env_choice(const char* var, std::initializer_list<const char*> known) {
  const char* v = std::getenv(var);
  if (!v || !*v) return "";
  std::string takes;
  for (const char* k : known) {
    if (!std::strcmp(v, k)) return v;
    takes += std::string(takes.empty() ? "" : ", ") + k;
  }
  log_warn(std::string(var) + "=\"" + v + "\" is none of the values it takes (" + takes + "): ignored");
  return "";
}

void set_log_rank(int rank) { g_rank = rank; }
int log_rank() { return g_rank; }
void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

LogCapture::LogCapture(LogLevel min) : min_(min) {
  std::scoped_lock lock(g_capture_mu);
  g_capture = this;
}

LogCapture::~LogCapture() {
  std::scoped_lock lock(g_capture_mu);
  if (g_capture == this) g_capture = nullptr;
}

std::vector<std::string> LogCapture::messages() const {
  std::scoped_lock lock(g_capture_mu);
  return messages_;
}

void log(LogLevel level, const std::string& msg) {
  {
    std::scoped_lock lock(g_capture_mu);
    if (g_capture && level >= g_capture->min_) g_capture->messages_.push_back(msg);
  }
  if (static_cast<int>(level) < g_level) return;
  static const char* names[] = {"debug", "info", "warning", "error"};
  std::fprintf(stderr, "zinc[%d] %s: %s\n", g_rank.load(), names[static_cast<int>(level)], msg.c_str());
}

}  // namespace zinc
