// zinc core: non-owning views. A View is a pointer, an element type and a
// shape (row-major, contiguous). It never owns memory; whoever made the view
// keeps the buffer alive. Views are plain values and thread-compatible.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace zinc {

constexpr int kMaxDims = 4;

struct Shape {
  std::array<int64_t, kMaxDims> dims{};
  int ndim = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d) {
    ZINC_CHECK(d.size() <= kMaxDims, "too many dims");
    for (int64_t x : d) dims[ndim++] = x;
  }
  int64_t operator[](int i) const { return dims[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= dims[i];
    return n;
  }
  bool operator==(const Shape& o) const {
    if (ndim != o.ndim) return false;
    for (int i = 0; i < ndim; ++i)
      if (dims[i] != o.dims[i]) return false;
    return true;
  }
  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < ndim; ++i) s += (i ? "," : "") + std::to_string(dims[i]);
    return s + ")";
  }
};

struct View {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_bytes(dtype); }
  float* f32() const {
    ZINC_CHECK(dtype == DType::kF32, "view is not fp32");
    return static_cast<float*>(data);
  }
  bf16* b16() const {
    ZINC_CHECK(dtype == DType::kBF16, "view is not bf16");
    return static_cast<bf16*>(data);
  }
};

}  // namespace zinc
