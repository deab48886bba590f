#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "offload/detail/io_detail.h"

namespace zinc::offload::detail {

UniqueFd open_scratch(const std::string& path, bool& direct, OpenFn open_fn) {
  if (!open_fn) open_fn = [](const char* p, int flags, mode_t mode) { return ::open(p, flags, mode); };
  const int base = O_RDWR | O_CREAT | O_CLOEXEC;
  auto open_retrying = [&](int flags) {
    int fd;
    do fd = open_fn(path.c_str(), flags, 0600);
    while (fd < 0 && errno == EINTR);
    return fd;
  };
  if (direct) {
    const int fd = open_retrying(base | O_DIRECT);
    if (fd >= 0) return UniqueFd(fd);
    if (errno != EINVAL) throw posix_error("cannot open " + path, errno);
    direct = false;  // the file system has no O_DIRECT (e.g. an old tmpfs)
  }
  const int fd = open_retrying(base);
  if (fd < 0) throw posix_error("cannot open " + path, errno);
  return UniqueFd(fd);
}

}  // namespace zinc::offload::detail
