#include <cmath>

#include "core/parallel.h"
#include "optim/optim.h"

namespace zinc::optim {

void adam_step(const AdamParams& p, int64_t step, float grad_scale, float* param, const float* grad,
               float* m, float* v, int64_t n, bf16* bf16_out) {
  const float b1 = static_cast<float>(p.beta1), b2 = static_cast<float>(p.beta2);
  const float eps = static_cast<float>(p.eps);
  const float lr = static_cast<float>(p.lr);
  const float wd = static_cast<float>(p.weight_decay);
  const double bc1 = p.bias_correction ? 1.0 - std::pow(p.beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(p.beta2, static_cast<double>(step)) : 1.0;
  const float step_size = static_cast<float>(p.lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const bool adamw = p.adam_w_mode;
  parallel_for(static_cast<size_t>(n), 1 << 15, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      float g = grad[i] * grad_scale;
      float w = param[i];
      if (wd > 0 && !adamw) g += wd * w;
      float mi = b1 * m[i] + (1.0f - b1) * g;
      float vi = b2 * v[i] + (1.0f - b2) * g * g;
      m[i] = mi;
      v[i] = vi;
      float denom = std::sqrt(vi) * inv_sqrt_bc2 + eps;
      if (wd > 0 && adamw) w -= lr * wd * w;
      w -= step_size * (mi / denom);
      param[i] = w;
      if (bf16_out) bf16_out[i] = float_to_bf16(w);
    }
  });
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

}  // namespace zinc::optim
