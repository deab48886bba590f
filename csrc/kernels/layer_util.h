// zinc kernels, private: helpers of the row-wise layer kernels (layers.cpp,
// llama_layers.cpp): parameter widening, row grains, column-parallel sums.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/parallel.h"
#include "kernels/kernels.h"
#include "kernels/math.h"

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

// Note [column sums by row chunks]
// A row-parallel pass that also sums K columns-wide quantities over the
// rows in Note [column sums]'s order (kernels/math.h), bit for bit: each
// 64-row chunk's sums in doubles from 0, row by row; the chunks' sums added
// in order from 0; then added to the fp32 output. bias_backward splits the
// columns between the threads instead (for_column_blocks); here
// the threads split the chunks, so that each row is read once, for its
// own output and the sums together, while it is in cache. The chunk sums
// meet in a (K, chunks, N) table that finish(j, sums) adds up per column.
// row(i, parts) handles row i, where parts[k] is the chunk's row of table k.
template <int K, class RowFn, class FinishFn>
void rows_with_column_sums(int64_t M, int64_t N, RowFn&& row, FinishFn&& finish) {
  if (M <= 0 || N <= 0) return;
  const int64_t chunks = (M + math::kColumnChunk - 1) / math::kColumnChunk;
  const size_t per_table = static_cast<size_t>(chunks * N);
  thread_local std::vector<double> table;
  table.assign(K * per_table, 0.0);
  double* sums = table.data();
  parallel_for(static_cast<size_t>(chunks), 1, [&](size_t c_lo, size_t c_hi) {
    for (size_t c = c_lo; c < c_hi; ++c) {
      double* parts[K];
      for (int k = 0; k < K; ++k) parts[k] = sums + k * per_table + c * static_cast<size_t>(N);
      const int64_t r0 = static_cast<int64_t>(c) * math::kColumnChunk;
      const int64_t r1 = std::min(M, r0 + math::kColumnChunk);
      for (int64_t i = r0; i < r1; ++i) row(i, parts);
    }
  });
  parallel_for(static_cast<size_t>(N), 16, [&](size_t j0, size_t j1) {
    for (size_t j = j0; j < j1; ++j) {
      double acc[K];
      for (int k = 0; k < K; ++k) {
        acc[k] = 0.0;
        for (int64_t c = 0; c < chunks; ++c) acc[k] += sums[k * per_table + static_cast<size_t>(c * N) + j];
      }
      finish(j, acc);
    }
  });
}

}  // namespace zinc::kernels::detail
