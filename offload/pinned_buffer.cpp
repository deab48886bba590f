#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "core/alloc.h"
#include "core/log.h"
#include "offload/offload.h"

namespace zinc::offload {
namespace {

std::atomic<bool> g_lock_warned{false};

// Buffers of at least one huge page are aligned to it and advised to use
// transparent huge pages: a 1 MiB O_DIRECT request from physically
// contiguous memory is one DMA segment instead of up to 256, which on a
// virtio disk is one host operation instead of many (see Note [buffer layout
// on a virtual disk] in bench/nvme_bench.cpp: reads 2.5x faster there), and
// the optimizer sweeping the buffer takes fewer TLB misses. The kernel may
// ignore the advice (THP "never"); the buffer is correct either way.
constexpr size_t kHugePage = size_t{2} << 20;

size_t alignment_for(size_t bytes) { return bytes >= kHugePage ? kHugePage : kPageAlign; }
size_t padded_bytes(size_t bytes) { return round_up(bytes, alignment_for(bytes)); }

void warn_lock_refused(size_t bytes, int err) {
  if (g_lock_warned.exchange(true)) return;
  log_warn("pinned memory refused (RLIMIT_MEMLOCK, mlock of " + std::to_string(bytes) +
           " bytes: " + std::strerror(err) +
           "); using ordinary memory. Raise the limit (ulimit -l unlimited, or memlock in "
           "/etc/security/limits.conf) to page-lock offload buffers");
}

}  // namespace

PinnedBuffer::PinnedBuffer(size_t bytes, bool lock) : bytes_(bytes) {
  if (bytes == 0) return;
  const size_t padded = padded_bytes(bytes);
  data_ = std::aligned_alloc(alignment_for(bytes), padded);
  if (!data_) throw std::bad_alloc();
  if (alignment_for(bytes) == kHugePage) ::madvise(data_, padded, MADV_HUGEPAGE);  // before the first touch
  std::memset(data_, 0, padded);
  if (lock) {
    if (::mlock(data_, padded) == 0)
      locked_ = true;
    else
      warn_lock_refused(padded, errno);
  }
}

size_t PinnedBuffer::footprint(size_t bytes) { return bytes == 0 ? 0 : padded_bytes(bytes); }

PinnedBuffer::~PinnedBuffer() {
  if (locked_) ::munlock(data_, padded_bytes(bytes_));
  std::free(data_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      locked_(std::exchange(o.locked_, false)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    PinnedBuffer old(std::move(*this));  // released at the end of this scope
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    locked_ = std::exchange(o.locked_, false);
  }
  return *this;
}

}  // namespace zinc::offload
