// zinc optim: the element loops of the 1-bit optimizers' compressed steps
// (Notes [1-bit Adam], [0/1 Adam] and [1-bit Lamb] in
// engine/update_onebit.cpp), beside the other vectorised optimizer kernels.
// Each is compiled at every ISA level (ZINC_ISA_VARIANTS) and dispatched at
// run time; plain loops with no a*b+c fused (-ffp-contract=off,
// optim/CMakeLists.txt), so every level gives the same bits. Any thread; no
// state.
#pragma once

#include <cstdint>

namespace zinc::optim {

// What onebit_lamb_elementwise returns for one tensor: the sums of squares
// of u = m / denom + wd w and of m / denom, and the largest
// denom / (sqrt(v_fresh) + eps).
struct OneBitLambSums {
  double u_sq, prelim_sq;
  float ratio_max;
};
struct OneBitLambConsts {
  float sc, b1, one_minus_b1, b2, one_minus_b2, eps, wd;
};
// Adam's constants as the compressed steps use them (decay = -lr wd).
struct OneBitConsts {
  float b1, one_minus_b1, lr, eps, wd, decay, grad_scale;
  bool decays;  // weight_decay > 0
};

// x = b1 m + (1 - b1) (g grad_scale) (x may be m).
void onebit_momentum_into(int64_t n, const float* m, const float* g, float* x, OneBitConsts c);
// The frozen-variance update in zinc's AdamW order: w = decay w + w (with
// weight decay), then w = -lr (m / (sqrt(v) + eps)) + w.
void onebit_frozen_update(int64_t n, float* w, const float* m, const float* v, OneBitConsts c);
// 0/1 Adam's local step: m = b1 m + (1 - b1) g, u = m / (sqrt(v) + eps) +
// wd w, w += -lr u, acc += -lr u.
void zero_one_local_step(int64_t n, float* m, const float* g, const float* v, float* w, float* acc, OneBitConsts c);
// A synchronising step's local step and undo in one pass: m, w move as in
// zero_one_local_step, then the local steps are undone, w -= acc + -lr u,
// and x = (acc + -lr u) (sqrt(v) + eps); acc is not written.
void zero_one_local_sync(int64_t n, float* m, const float* g, const float* v, float* w, const float* acc, float* x,
                         OneBitConsts c);
// 0/1 Adam's synchronisation, after the average: m = -(avg / lrs), w +=
// avg / (sqrt(v) + eps), acc = 0 (avg is acc).
void zero_one_sync_apply(int64_t n, float* m, float* w, float* acc, const float* v, float lrs, float eps);
// 1-bit Lamb: x = (b1 m + (1 - b1) (g grad_scale)) sc.
void onebit_lamb_momentum(int64_t n, const float* m, const float* g, float* x, float sc, OneBitConsts c);
// 1-bit Lamb's update: w = w + coeff (m / (sqrt(v) + eps) + wd w).
void onebit_lamb_apply(int64_t n, float* w, const float* m, const float* v, float coeff, float eps, float wd);
// 1-bit Lamb's elementwise pass over one tensor, one read of each array
// (onebit_kernels.cpp says how): the averaged momentum fl (scaled) unscaled
// into m, the gradient reconstructed from it and m's old value folded into
// the fresh variance vf, and the reductions the factor needs.
OneBitLambSums onebit_lamb_elementwise(int64_t n, const float* fl, float* m, float* vf, const float* v,
                                       const float* w, OneBitLambConsts c);

}  // namespace zinc::optim
