// Kernel emulation (Note [kernel emulation] in ../cuda_emu.h): the WMMA
// API (nvcuda::wmma) at the one shape zinc's kernels use, m16n16k16 with
// 16-bit inputs (bf16, fp16) and fp32 accumulators.
//
// A fragment holds 8 of its 16x16 tile's elements in each of the warp's 32
// lanes: lane l holds elements 8l .. 8l + 7 of the tile in row-major order
// (row (8l + i) / 16, column (8l + i) % 16). CUDA leaves the real layout
// unspecified, so a kernel may only use x[] for what is the same in every
// layout (fill, scale every element). The loads and stores are the lane's own
// elements; mma_sync gathers the warp's A and B through the warp's scratch
// between two __syncwarp()s and each lane computes its 8 results, the sum
// over k in order in fp32 from the accumulator. Loads and stores check what
// CUDA requires: a 256-bit aligned pointer and ldm a multiple of 8 (16-bit
// elements) or 4 (float); a missing __syncwarp before a load of what other
// lanes wrote reads their NaN bytes, in one of the two thread orders.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "kernel emulation: WMMA m16n16k16 only");
  static constexpr int num_elements = 8;
  T x[8];
};

namespace detail {
inline float value(float v) { return v; }
inline float value(__nv_bfloat16 v) { return v.to_float(); }
inline float value(__half v) { return v.to_float(); }

template <class T>
void check(const T* p, unsigned ldm, const char* fn) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) ::zinc_emu::fail((std::string(fn) + ": the pointer is not 256-bit aligned").c_str());
  const unsigned step = sizeof(T) == 2 ? 8 : 4;
  if (ldm % step != 0)
    ::zinc_emu::fail((std::string(fn) + ": ldm " + std::to_string(ldm) + " is not a multiple of " +
                      std::to_string(step)).c_str());
}
// Element (r, c) of the logical 16x16 tile: row-major in memory at
// p[r * ldm + c], column-major at p[c * ldm + r].
template <class T>
T at(const T* p, unsigned ldm, bool row, int r, int c) {
  return row ? p[r * ldm + c] : p[c * ldm + r];
}
inline int lane() { return ::zinc_emu::lane_id(); }
}  // namespace detail

template <class Use, class L>
void fill_fragment(fragment<Use, 16, 16, 16, float, L>& f, float v) {
  for (int i = 0; i < 8; ++i) f.x[i] = v;
}

template <class Use, class T, class L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_void_v<L>, "load_matrix_sync: an input fragment has a layout");
  detail::check(p, ldm, "wmma::load_matrix_sync");
  constexpr bool row = std::is_same_v<L, row_major>;
  const int l = detail::lane();
  for (int i = 0; i < 8; ++i) f.x[i] = detail::at(p, ldm, row, (8 * l + i) / 16, (8 * l + i) % 16);
  ::zinc_emu::syncwarp();
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm,
                             layout_t layout) {
  detail::check(p, ldm, "wmma::load_matrix_sync");
  const int l = detail::lane();
  for (int i = 0; i < 8; ++i) f.x[i] = detail::at(p, ldm, layout == mem_row_major, (8 * l + i) / 16, (8 * l + i) % 16);
  ::zinc_emu::syncwarp();
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  detail::check(p, ldm, "wmma::store_matrix_sync");
  const int l = detail::lane();
  for (int i = 0; i < 8; ++i) {
    const int r = (8 * l + i) / 16, c = (8 * l + i) % 16;
    (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[i];
  }
  ::zinc_emu::syncwarp();
}

// d = a b + c (d may be c).
template <class T, class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float* s = ::zinc_emu::warp_scratch();  // A at s[0..256), B at s[256..512), row-major
  const int l = detail::lane();
  for (int i = 0; i < 8; ++i) {
    s[8 * l + i] = detail::value(a.x[i]);
    s[256 + 8 * l + i] = detail::value(b.x[i]);
  }
  ::zinc_emu::syncwarp();
  // The lane's 8 results are row l / 2, columns 8 (l % 2) .. + 7: the eight
  // sums advance together over k (so they vectorise), each in k order.
  const float* arow = s + (l / 2) * 16;
  const float* bcols = s + 256 + (l % 2) * 8;
  float out[8];
  for (int i = 0; i < 8; ++i) out[i] = c.x[i];
  for (int k = 0; k < 16; ++k)
    for (int i = 0; i < 8; ++i) out[i] += arow[k] * bcols[k * 16 + i];
  ::zinc_emu::syncwarp();  // every lane has read the scratch before the next operation writes it
  for (int i = 0; i < 8; ++i) d.x[i] = out[i];
}

}  // namespace wmma
}  // namespace nvcuda
