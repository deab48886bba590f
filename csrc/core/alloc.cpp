#include "core/alloc.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace zinc {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// A fresh mapping of `len` bytes (a multiple of the page size). From 2 MiB up
// it starts on a 2 MiB boundary and asks for transparent huge pages: a
// buffer that comes and goes every step (stage 2's gradients, stage 3's
// gathered blocks) then costs one page fault per 2 MiB instead of 512 (the
// kernel may decline; the tail past the last boundary takes small pages).
void* map_bytes(size_t len) {
  // Test hook: ZINC_FAULT_ALLOC_BYTES=N fails every mapping of N bytes or
  // more, as an exhausted address space or memory limit would (read at each
  // mapping: the large, rare allocations).
  if (const char* f = std::getenv("ZINC_FAULT_ALLOC_BYTES"); f && *f && len >= std::strtoull(f, nullptr, 10))
    throw std::bad_alloc();
  const bool huge = len >= kHugePage;
  const size_t span = huge ? len + kHugePage : len;
  void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  if (!huge) return raw;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) ::munmap(raw, aligned - start);
  const uintptr_t end = start + span, used_end = aligned + len;
  if (end > used_end) ::munmap(reinterpret_cast<void*>(used_end), end - used_end);
  void* p = reinterpret_cast<void*>(aligned);
  ::madvise(p, len, MADV_HUGEPAGE);
  return p;
}

}  // namespace

void* aligned_alloc_bytes(size_t bytes, size_t align) {
  if (bytes == 0) return nullptr;
  if (align > kPageAlign || (align & (align - 1)) != 0) throw std::invalid_argument("aligned_alloc_bytes: alignment must be a power of two up to 4096");
  if (bytes >= kMapBytes) return map_bytes(round_up(bytes, kPageAlign));
  void* p = std::aligned_alloc(align, round_up(bytes, align));
  if (!p) throw std::bad_alloc();
  return p;
}

void aligned_free(void* p, size_t bytes) {
  if (!p) return;
  if (bytes >= kMapBytes) ::munmap(p, round_up(bytes, kPageAlign));
  else std::free(p);
}

AlignedBuffer::AlignedBuffer(size_t bytes, size_t align)
    : data_(aligned_alloc_bytes(bytes, align)), bytes_(bytes) {
  // A mapping comes zero-filled; a heap block is cleared here.
  if (data_ && bytes < kMapBytes) std::memset(data_, 0, round_up(bytes, align));
}

}  // namespace zinc
