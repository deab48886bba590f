#include "core/error.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/log.h"

namespace zinc {

IoError posix_error(const std::string& ctx, int err) {
  return IoError(ctx + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
}

void check_failed(const char* cond, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "zinc: [rank %d] internal check failed at %s:%d: %s (%s)\n", log_rank(), file,
               line, msg.c_str(), cond);
  std::fflush(stderr);
  std::abort();
}

}  // namespace zinc
