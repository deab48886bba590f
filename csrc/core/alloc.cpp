#include "core/alloc.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace zinc {

void* aligned_alloc_bytes(size_t bytes, size_t align) {
  if (bytes == 0) return nullptr;
  if (align > kPageAlign || (align & (align - 1)) != 0) throw std::invalid_argument("aligned_alloc_bytes: alignment must be a power of two up to 4096");
  if (bytes >= kMapBytes) {
    void* p = ::mmap(nullptr, round_up(bytes, kPageAlign), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }
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
