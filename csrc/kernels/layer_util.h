// zinc kernels, private: helpers of the row-wise layer kernels (layers.cpp,
// llama_layers.cpp): parameter widening, row grains, column-parallel sums.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/parallel.h"
#include "kernels/kernels.h"

namespace zinc::kernels::detail {

inline float load(float v) { return v; }
inline float load(bf16 v) { return bf16_to_float(v); }
inline float load(f16 v) { return f16_to_float(v); }

// Calls fn(T{}) with T = float, bf16 or f16 according to `t`.
template <class Fn>
void dispatch(DType t, Fn&& fn) {
  if (t == DType::kF32) {
    fn(float{});
  } else if (t == DType::kBF16) {
    fn(bf16{});
  } else {
    fn(f16{});
  }
}

// fp32 pointer to a small parameter vector, widening bf16 (fp16) into one of
// two thread-local slots.
inline const float* param_f32(CView v, int64_t n, int slot) {
  if (v.dtype == DType::kF32) return static_cast<const float*>(v.data);
  thread_local std::vector<float> bufs[2];
  auto& buf = bufs[slot];
  buf.resize(static_cast<size_t>(n));
  convert_16_to_f32(v.data, buf.data(), static_cast<size_t>(n), v.dtype);
  return buf.data();
}

// Rows per parallel chunk so that a chunk holds >= ~16K elements.
inline size_t row_grain(int64_t cols) {
  return static_cast<size_t>(std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)));
}

// Column-parallel sum over rows: fn(c0, c1, acc) with acc(c1-c0) doubles
// zeroed; the callee adds rows in order. Columns are split in blocks of >= 16.
template <class Fn>
void for_column_blocks(int64_t N, Fn&& fn) {
  parallel_for(static_cast<size_t>(N), 16, [&](size_t c0, size_t c1) {
    std::vector<double> acc(c1 - c0, 0.0);
    fn(static_cast<int64_t>(c0), static_cast<int64_t>(c1), acc.data());
  });
}

}  // namespace zinc::kernels::detail
