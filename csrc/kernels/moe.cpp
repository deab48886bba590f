// Mixture-of-experts kernels (kernels.h, "mixture of experts"): the
// router's softmax and top-k, the grouping of (token, slot) pairs by
// expert, and the gather and weighted combine around the experts' GEMMs.
//
// Note [expert routing order]
// Everything per token runs in one fixed serial order so that the CUDA
// twins (moe.cu: a thread per token, or per (row, column)) give the same
// bits: the softmax over E in index order (max, exp_f, the sum in float,
// 1 / sum, times), the top k by repeated selection of the largest
// probability not yet chosen (a tie goes to the lower expert: the choice is
// deterministic), the renormalising sum over the k slots in slot order,
// and a combine adding a token's k slots in slot order. E and k are small
// (8 to 128 experts, 1 to 8 slots); the cost is in the experts' GEMMs, which
// run on each expert's grouped rows (moe_group), not in these loops.
#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/kernels.h"
#include "kernels/math.h"
#include "kernels/profile.h"

namespace zinc::kernels {
namespace {

void check_route(const char* fn, int64_t E, int64_t k) {
  if (E <= 0 || k <= 0 || k > E)
    throw Error(std::string(fn) + ": need 0 < k <= E, got k=" + std::to_string(k) + " E=" + std::to_string(E));
}

}  // namespace

void moe_route(const float* logits, int64_t N, int64_t E, int64_t k, bool renormalize, float* probs, int32_t* expert,
               float* weight) {
  ProfileScope profile_scope(Op::kVector);
  check_route("moe_route", E, k);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), 64, [&](size_t lo, size_t hi) {
    for (size_t t = lo; t < hi; ++t) {
      math::moe_route_row(logits + t * E, E, k, renormalize, probs + t * E, expert + t * k, weight + t * k);
    }
  });
}

void moe_route_backward(const float* probs, const int32_t* expert, const float* weight, const float* dweight,
                        const float* dprobs, int64_t N, int64_t E, int64_t k, bool renormalize, float* dlogits) {
  ProfileScope profile_scope(Op::kVector);
  check_route("moe_route_backward", E, k);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), 64, [&](size_t lo, size_t hi) {
    for (size_t t = lo; t < hi; ++t)
      math::moe_route_row_backward(probs + t * E, expert + t * k, weight + t * k, dweight + t * k,
                                   dprobs, E, k, renormalize, dlogits + t * E);
  });
}

void moe_group(const int32_t* expert, int64_t N, int64_t k, int64_t E, int64_t* offsets, int32_t* token_of_row,
               int32_t* row_of_slot) {
  check_route("moe_group", E, k);
  std::fill(offsets, offsets + E + 1, int64_t{0});
  for (int64_t i = 0; i < N * k; ++i) {
    const int32_t e = expert[i];
    if (e < 0 || e >= E)
      throw Error("moe_group: expert " + std::to_string(e) + " of token " + std::to_string(i / k) +
                  " is outside [0, " + std::to_string(E) + ")");
    ++offsets[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets, offsets + E);
  // Tokens in order within each expert (a stable counting sort).
  for (int64_t i = 0; i < N * k; ++i) {
    const int64_t r = next[static_cast<size_t>(expert[i])]++;
    token_of_row[r] = static_cast<int32_t>(i / k);
    row_of_slot[i] = static_cast<int32_t>(r);
  }
}

void moe_gather(float* xg, const float* x, const int32_t* token_of_row, int64_t M, int64_t C) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(std::max<int64_t>(M, 0)), std::max<size_t>(1, 16384 / std::max<int64_t>(C, 1)),
               [&](size_t lo, size_t hi) {
                 for (size_t r = lo; r < hi; ++r)
                   std::copy(x + token_of_row[r] * C, x + (token_of_row[r] + 1) * C, xg + r * C);
               });
}

void moe_combine(float* out, const float* y, const float* weight, const int32_t* row_of_slot, int64_t N, int64_t k,
                 int64_t C) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), std::max<size_t>(1, 16384 / std::max<int64_t>(C * k, 1)),
               [&](size_t lo, size_t hi) {
                 for (size_t t = lo; t < hi; ++t)
                   for (int64_t c = 0; c < C; ++c) {
                     float acc = 0.0f;
                     for (int64_t s = 0; s < k; ++s)
                       acc += weight[t * k + s] * y[static_cast<int64_t>(row_of_slot[t * k + s]) * C + c];
                     out[t * C + c] = acc;
                   }
               });
}

void moe_combine_backward(float* dy, float* dweight, const float* dout, const float* y, const float* weight,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), std::max<size_t>(1, 16384 / std::max<int64_t>(C * k, 1)),
               [&](size_t lo, size_t hi) {
                 for (size_t t = lo; t < hi; ++t)
                   for (int64_t s = 0; s < k; ++s) {
                     const int64_t r = row_of_slot[t * k + s];
                     const float w = weight[t * k + s];
                     float dot = 0.0f;
                     for (int64_t c = 0; c < C; ++c) {
                       dy[r * C + c] = w * dout[t * C + c];
                       dot += dout[t * C + c] * y[r * C + c];
                     }
                     dweight[t * k + s] = dot;
                   }
               });
}

void moe_gather_backward(float* dx, const float* dxg, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
  ProfileScope profile_scope(Op::kVector);
  parallel_for(static_cast<size_t>(std::max<int64_t>(N, 0)), std::max<size_t>(1, 16384 / std::max<int64_t>(C * k, 1)),
               [&](size_t lo, size_t hi) {
                 for (size_t t = lo; t < hi; ++t)
                   for (int64_t c = 0; c < C; ++c) {
                     float acc = dx[t * C + c];
                     for (int64_t s = 0; s < k; ++s) acc += dxg[static_cast<int64_t>(row_of_slot[t * k + s]) * C + c];
                     dx[t * C + c] = acc;
                   }
               });
}

}  // namespace zinc::kernels
