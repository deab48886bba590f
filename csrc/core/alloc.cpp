#include "core/alloc.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace zinc {

void* aligned_alloc_bytes(size_t bytes, size_t align) {
  if (bytes == 0) return nullptr;
  void* p = std::aligned_alloc(align, round_up(bytes, align));
  if (!p) throw std::bad_alloc();
  return p;
}

void aligned_free(void* p) { std::free(p); }

AlignedBuffer::AlignedBuffer(size_t bytes, size_t align)
    : data_(aligned_alloc_bytes(bytes, align)), bytes_(bytes) {
  if (data_) std::memset(data_, 0, round_up(bytes, align));
}

}  // namespace zinc
