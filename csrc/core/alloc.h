// zinc core: aligned host memory. AlignedBuffer owns one 64-byte aligned
// (optionally 4 KiB aligned, for O_DIRECT) zero-initialised allocation
// (from kMapBytes up a mapping of its own, see below); it is
// movable, not copyable. Not thread-safe to resize; the contents may be used
// from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

namespace zinc {

constexpr size_t kSimdAlign = 64;
constexpr size_t kPageAlign = 4096;

// From this size an allocation is a mapping of its own (mmap), page-aligned
// and zero-filled by the kernel, and freeing it returns it to the system at
// once. Below it the C heap serves it. Why: glibc raises its mmap threshold
// to the size of each mapped block freed, after which the engine's large
// buffers that come and go every step (stage 2's full gradients, stage 3's
// gathered blocks) land on the heap, stay resident after they are freed and
// fragment it, so the process's RSS would drift above what it holds (by
// 10-15% in a stage 2 run) and no estimate could predict it.
constexpr size_t kMapBytes = size_t{1} << 20;

void* aligned_alloc_bytes(size_t bytes, size_t align = kSimdAlign);  // throws std::bad_alloc
// `bytes` as allocated.
void aligned_free(void* p, size_t bytes);

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes, size_t align = kSimdAlign);
  ~AlignedBuffer() { aligned_free(data_, bytes_); }
  AlignedBuffer(AlignedBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept {
    if (this != &o) {
      aligned_free(data_, bytes_);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  bool empty() const { return bytes_ == 0; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  template <class T>
  std::span<T> span() const {
    return {static_cast<T*>(data_), bytes_ / sizeof(T)};
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Typed convenience: n elements of T.
template <class T>
AlignedBuffer make_buffer(size_t n, size_t align = kSimdAlign) {
  return AlignedBuffer(n * sizeof(T), align);
}

inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// Scratch that only grows: the bytes a scratch buffer holds for a request
// (whole 4 KiB pages; the memory estimate's ScratchTally counts with the same
// rule), and the buffer grown to hold at least `bytes`. Growing reallocates
// and loses the contents.
inline size_t scratch_bytes(size_t bytes) { return round_up(bytes, 4096); }
inline void* grow_scratch(AlignedBuffer& b, size_t bytes) {
  if (b.bytes() < bytes) b = AlignedBuffer(scratch_bytes(bytes));
  return b.data();
}

}  // namespace zinc
