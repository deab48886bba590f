// Lamb dispatch: checks the segments, cuts them into fixed pieces, picks the
// ISA path and splits the pieces between threads (Note [Lamb arithmetic]).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "optim/detail/lamb_math.h"
#include "optim/optim.h"

namespace zinc::optim {
namespace {

const detail::LambKernels& lamb_kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return detail::scalar_lamb_kernels();
    case Isa::kAvx2: return detail::avx2_lamb_kernels();
    case Isa::kAvx512: return detail::avx512_lamb_kernels();
    case Isa::kAvx512Bf16: return detail::avx512_bf16_lamb_kernels();
  }
  throw Error("unknown optimizer ISA");
}

}  // namespace

namespace detail {

std::vector<LambPiece> lamb_pieces(int64_t n, std::span<const LambSegment> segs, const char* who) {
  std::vector<LambPiece> pieces;
  int64_t at = 0;
  for (size_t k = 0; k < segs.size(); ++k) {
    const LambSegment& g = segs[k];
    if (g.begin != at || g.end < g.begin || g.tensor < -1)
      throw Error(std::string(who) + ": segment " + std::to_string(k) + " [" + std::to_string(g.begin) + ", " +
                  std::to_string(g.end) + ") tensor " + std::to_string(g.tensor) +
                  " does not continue the segments before it at element " + std::to_string(at));
    for (int64_t b = g.begin; b < g.end; b += kLambPiece)
      pieces.push_back({b, std::min(g.end, b + kLambPiece), static_cast<int>(k)});
    at = g.end;
  }
  if (at != n)
    throw Error(std::string(who) + ": the segments cover " + std::to_string(at) + " of the span's " +
                std::to_string(n) + " elements");
  return pieces;
}

LambArgs make_lamb_args(const LambParams& p, float grad_scale) {
  LambArgs a{};
  a.grad_scale = grad_scale;
  a.beta1 = static_cast<float>(p.beta1);
  a.one_minus_beta1 = 1.0f - a.beta1;
  a.beta2 = static_cast<float>(p.beta2);
  a.one_minus_beta2 = 1.0f - a.beta2;
  a.eps = static_cast<float>(p.eps);
  a.wd = static_cast<float>(p.weight_decay);
  return a;
}

std::vector<float> lamb_coefficients(const LambParams& p, int64_t step, std::span<const LambSegment> segs,
                                     const double* ratios) {
  double step_size = p.lr;
  if (p.bias_correction) {
    // The fp32 betas' corrections, as the moments decay by them (adam.cpp).
    const double bc1 = 1.0 - std::pow(static_cast<double>(static_cast<float>(p.beta1)), static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(static_cast<double>(static_cast<float>(p.beta2)), static_cast<double>(step));
    step_size = p.lr * std::sqrt(bc2) / bc1;
  }
  std::vector<float> neg_coef(segs.size());
  for (size_t k = 0; k < segs.size(); ++k)
    neg_coef[k] = static_cast<float>(-step_size * (segs[k].tensor < 0 ? 1.0 : ratios[segs[k].tensor]));
  return neg_coef;
}

}  // namespace detail

void lamb_norms(const LambParams& p, float grad_scale, const AdamSpan& s, std::span<const LambSegment> segs,
                double* sums) {
  lamb_norms(p, grad_scale, s, segs, sums, active_isa());
}

void lamb_norms(const LambParams& p, float grad_scale, const AdamSpan& s, std::span<const LambSegment> segs,
                double* sums, Isa isa) {
  const std::vector<detail::LambPiece> pieces = detail::lamb_pieces(s.n, segs, "lamb_norms");
  const detail::LambArgs a = detail::make_lamb_args(p, grad_scale);
  detail::LambNormsFn fn = lamb_kernels_for(isa).norms[p.eps_inside_sqrt][s.grad_dtype == DType::kBF16];
  std::vector<std::pair<double, double>> partial(pieces.size());
  parallel_for(pieces.size(), 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      if (segs[static_cast<size_t>(pieces[i].seg)].tensor < 0) continue;
      partial[i] = fn(a, s.param, s.grad, s.exp_avg, s.exp_avg_sq, pieces[i].begin, pieces[i].end);
    }
  });
  // Each segment's pieces in order, then the segment into its tensor's sums.
  size_t i = 0;
  for (size_t k = 0; k < segs.size(); ++k) {
    double w = 0, u = 0;
    for (; i < pieces.size() && pieces[i].seg == static_cast<int>(k); ++i) {
      w += partial[i].first;
      u += partial[i].second;
    }
    if (segs[k].tensor < 0) continue;
    sums[2 * segs[k].tensor] += w;
    sums[2 * segs[k].tensor + 1] += u;
  }
}

double lamb_trust_ratio(double w_sq, double u_sq, double min_coeff, double max_coeff) {
  const double w = std::sqrt(w_sq), u = std::sqrt(u_sq);
  if (w == 0 || u == 0) return 1.0;
  return std::min(max_coeff, std::max(min_coeff, w / u));
}

void lamb_apply(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& s,
                std::span<const LambSegment> segs, const double* ratios) {
  lamb_apply(p, step, grad_scale, s, segs, ratios, active_isa());
}

void lamb_apply(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& s,
                std::span<const LambSegment> segs, const double* ratios, Isa isa) {
  if (step < 1) throw Error("lamb_apply: step must be >= 1, got " + std::to_string(step));
  const std::vector<detail::LambPiece> pieces = detail::lamb_pieces(s.n, segs, "lamb_apply");
  const detail::LambArgs a = detail::make_lamb_args(p, grad_scale);
  const std::vector<float> neg_coef = detail::lamb_coefficients(p, step, segs, ratios);
  const bool stream = s.bf16_out && s.n * 2 >= detail::stream_min_bytes();
  detail::LambApplyFn fn = lamb_kernels_for(isa).apply[p.eps_inside_sqrt][s.grad_dtype == DType::kBF16]
                                                      [!s.bf16_out ? 0 : stream ? 2 : 1];
  parallel_for(pieces.size(), 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i)
      fn(a, neg_coef[static_cast<size_t>(pieces[i].seg)], s.param, s.grad, s.exp_avg, s.exp_avg_sq, s.bf16_out,
         pieces[i].begin, pieces[i].end);
  });
}

std::vector<double> lamb_step(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& s,
                              std::span<const LambSegment> segs) {
  return lamb_step(p, step, grad_scale, s, segs, active_isa());
}

std::vector<double> lamb_step(const LambParams& p, int64_t step, float grad_scale, const AdamSpan& s,
                              std::span<const LambSegment> segs, Isa isa) {
  int tensors = 0;
  for (const LambSegment& g : segs) tensors = std::max(tensors, g.tensor + 1);
  std::vector<double> sums(static_cast<size_t>(2 * tensors), 0.0), ratios(static_cast<size_t>(tensors));
  lamb_norms(p, grad_scale, s, segs, sums.data(), isa);
  for (int t = 0; t < tensors; ++t)
    ratios[static_cast<size_t>(t)] = lamb_trust_ratio(sums[2 * t], sums[2 * t + 1], p.min_coeff, p.max_coeff);
  lamb_apply(p, step, grad_scale, s, segs, ratios.data(), isa);
  return ratios;
}

}  // namespace zinc::optim
