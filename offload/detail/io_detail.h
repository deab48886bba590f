// zinc offload, private: the owners of POSIX and io_uring resources and the
// one place each foreign error space is translated. Included by the offload
// sources and by tests/offload; nothing else should need it.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>

#include "core/error.h"
#include "core/unique_fd.h"

namespace zinc::offload::detail {

using ::zinc::UniqueFd;  // core/unique_fd.h

// io_uring's error space (negative errno from io_uring_queue_init,
// io_uring_submit, io_uring_wait_cqe) -> IoError, with a hint where the
// usual cause is a system setting. err is positive (pass -res).
IoError uring_error(const std::string& ctx, int err);

// Opens `path` (created if missing, mode 0600) read-write. With `direct`
// true it asks for O_DIRECT first; if the file system refuses it (EINVAL),
// the file is opened without O_DIRECT and `direct` becomes false (the caller
// warns). Other failures throw IoError naming the path. `open_fn` replaces
// ::open in tests (null means ::open).
using OpenFn = int (*)(const char* path, int flags, mode_t mode);
UniqueFd open_scratch(const std::string& path, bool& direct, OpenFn open_fn = nullptr);

}  // namespace zinc::offload::detail
