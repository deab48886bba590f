#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstdint>
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

// Note [pinned buffers are mapped, not malloc'd]: a buffer is its own
// anonymous mapping, returned to the kernel whole when it goes. Through
// malloc, the first free of a large (mmapped) chunk raises glibc's dynamic
// mmap threshold to its size, and from then on buffers of that size come
// from the heap, whose freed holes the kernel never gets back: ZeRO-3 with
// offload_param on NVMe, which makes and frees a page-locked shard per block
// each step, grew by 10-25% over its first steps at 2 ranks (the estimate's
// figure reached with the threshold fixed, and now without).
void* map_aligned(size_t padded, size_t align) {
  const size_t extra = align > kPageAlign ? align : 0;
  void* raw = ::mmap(nullptr, padded + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  if (extra == 0) return raw;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + align - 1) / align * align;
  if (aligned > start) ::munmap(raw, aligned - start);  // the head before the alignment
  const uintptr_t end = start + padded + extra;
  if (end > aligned + padded) ::munmap(reinterpret_cast<void*>(aligned + padded), end - (aligned + padded));
  return reinterpret_cast<void*>(aligned);
}

}  // namespace

PinnedBuffer::PinnedBuffer(size_t bytes, bool lock) : bytes_(bytes) {
  if (bytes == 0) return;
  const size_t padded = padded_bytes(bytes);
  data_ = map_aligned(padded, alignment_for(bytes));
  if (alignment_for(bytes) == kHugePage) ::madvise(data_, padded, MADV_HUGEPAGE);  // before the first touch
  std::memset(data_, 0, padded);  // every page resident now, as footprint() counts it
  if (lock) {
    if (::mlock(data_, padded) == 0)
      locked_ = true;
    else
      warn_lock_refused(padded, errno);
  }
}

size_t PinnedBuffer::footprint(size_t bytes) { return bytes == 0 ? 0 : padded_bytes(bytes); }

PinnedBuffer::~PinnedBuffer() {
  if (!data_) return;
  if (locked_) ::munlock(data_, padded_bytes(bytes_));
  ::munmap(data_, padded_bytes(bytes_));
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
