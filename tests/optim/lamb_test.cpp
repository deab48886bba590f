// Lamb (Note [Lamb arithmetic]): the kernels against a plain double-precision
// reference of DeepSpeed's FusedLamb formulas, every ISA path against the
// scalar path, thread-count independence, and the two-pass split that the
// engine uses over shards.
//
// Tolerances: the kernels compute in fp32 (the vector paths with fused
// multiply-adds) and the reference in double from the same fp32 inputs, so
// m, v and u agree to a few fp32 roundings (checked at 1e-5 relative), and
// each weight's change (step_size * ratio * u) to 1e-4 relative plus 2 ulps
// of the weight; the trust ratios, square roots of double sums, to 1e-5.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "optim/optim.h"
#include "tests/optim/isa_test_util.h"

namespace zinc::optim {
namespace {

using testing::kAll;
using testing::ulp;

struct LambState {
  std::vector<float> w, m, v, g;
  std::vector<bf16> g16, out;
};

// One tensor's initial values: weights ~ w_std * N(0,1), gradients ~ g_std *
// N(0,1), moments as after a few steps (or zero).
void fill(LambState& s, int64_t b, int64_t e, double w_std, double g_std, bool moments, Rng& rng) {
  for (int64_t i = b; i < e; ++i) {
    s.w[i] = static_cast<float>(rng.normal() * w_std);
    s.g[i] = static_cast<float>(rng.normal() * g_std);
    s.m[i] = moments ? static_cast<float>(rng.normal() * g_std * 0.3) : 0.0f;
    s.v[i] = moments ? static_cast<float>(rng.uniform() * g_std * g_std) : 0.0f;
  }
}

LambState make_state(int64_t n) {
  LambState s;
  s.w.assign(n, 0.0f);
  s.m.assign(n, 0.0f);
  s.v.assign(n, 0.0f);
  s.g.assign(n, 0.0f);
  s.out.assign(n, bf16{0});
  return s;
}

AdamSpan span_of(LambState& s, bool grad_bf16 = false, bool out = true) {
  if (grad_bf16) {
    s.g16.resize(s.g.size());
    for (size_t i = 0; i < s.g.size(); ++i) s.g16[i] = float_to_bf16(s.g[i]);
  }
  return AdamSpan{s.w.data(), grad_bf16 ? static_cast<const void*>(s.g16.data()) : s.g.data(),
                  grad_bf16 ? DType::kBF16 : DType::kF32, s.m.data(), s.v.data(), out ? s.out.data() : nullptr,
                  static_cast<int64_t>(s.w.size())};
}

// The reference: DeepSpeed's FusedLamb in double, from the same inputs
// (bf16 gradients as the values they hold). Returns the ratios.
std::vector<double> reference_step(const LambParams& p, int64_t step, double grad_scale, LambState& s,
                                   const std::vector<LambSegment>& segs, bool grad_bf16 = false) {
  const size_t n = s.w.size();
  std::vector<double> m(n), v(n), u(n);
  int tensors = 0;
  for (const LambSegment& g : segs) tensors = std::max(tensors, g.tensor + 1);
  std::vector<double> w_sq(tensors, 0.0), u_sq(tensors, 0.0);
  for (const LambSegment& sg : segs)
    for (int64_t i = sg.begin; i < sg.end; ++i) {
      const double g = (grad_bf16 ? static_cast<double>(bf16_to_float(float_to_bf16(s.g[i]))) : s.g[i]) * grad_scale;
      m[i] = p.beta1 * s.m[i] + (1 - p.beta1) * g;
      v[i] = p.beta2 * s.v[i] + (1 - p.beta2) * g * g;
      const double denom = p.eps_inside_sqrt ? std::sqrt(v[i] + p.eps) : std::sqrt(v[i]) + p.eps;
      u[i] = m[i] / denom + p.weight_decay * s.w[i];
      if (sg.tensor >= 0) {
        w_sq[sg.tensor] += static_cast<double>(s.w[i]) * s.w[i];
        u_sq[sg.tensor] += u[i] * u[i];
      }
    }
  std::vector<double> ratio(tensors, 1.0);
  for (int t = 0; t < tensors; ++t) {
    const double wn = std::sqrt(w_sq[t]), un = std::sqrt(u_sq[t]);
    if (wn != 0 && un != 0) ratio[t] = std::clamp(wn / un, p.min_coeff, p.max_coeff);
  }
  const double step_size = p.bias_correction ? p.lr * std::sqrt(1 - std::pow(p.beta2, step)) /
                                                   (1 - std::pow(p.beta1, step))
                                             : p.lr;
  for (const LambSegment& sg : segs)
    for (int64_t i = sg.begin; i < sg.end; ++i) {
      const double r = sg.tensor >= 0 ? ratio[sg.tensor] : 1.0;
      s.w[i] = static_cast<float>(s.w[i] - step_size * r * u[i]);
      s.m[i] = static_cast<float>(m[i]);
      s.v[i] = static_cast<float>(v[i]);
    }
  return ratio;
}

// m and v are checked against the magnitudes of the terms that make them
// (their sums can cancel); each weight's change against the largest change
// in its segment (u carries m's cancellation, so its error scales with the
// tensor's typical update, not with its own).
void expect_state_near(const LambState& got, const LambState& want, const LambState& before,
                       const std::vector<LambSegment>& segs, const char* what) {
  for (const LambSegment& sg : segs) {
    double max_delta = 0;
    for (int64_t i = sg.begin; i < sg.end; ++i)
      max_delta = std::max(max_delta, std::fabs(static_cast<double>(want.w[i]) - before.w[i]));
    for (int64_t i = sg.begin; i < sg.end; ++i) {
      const double g = std::fabs(before.g[i]);
      ASSERT_NEAR(got.w[i], want.w[i], 2e-5 * max_delta + 2 * ulp(want.w[i]) + 1e-30) << what << " w[" << i << "]";
      ASSERT_NEAR(got.m[i], want.m[i], 2e-6 * (std::fabs(before.m[i]) + g) + 1e-30) << what << " m[" << i << "]";
      ASSERT_NEAR(got.v[i], want.v[i], 2e-6 * (std::fabs(before.v[i]) + g * g) + 1e-30) << what << " v[" << i << "]";
    }
  }
}

// Five tensors and a padding gap, none of them SIMD-aligned in length or
// start: a ratio clamped at max_coeff (large weights), one at min_coeff
// (tiny weights), an all-zero tensor (||w|| = 0: ratio 1), an unclamped one,
// and one whose gradient and moments are zero (||u|| = 0 without weight
// decay: ratio 1).
struct LambCase {
  LambState s;
  std::vector<LambSegment> segs;
};
LambCase five_tensors(bool moments, uint64_t seed) {
  const int64_t len[] = {37, 50, 33, 11, 101, 19};
  const int tensor[] = {0, 1, 2, -1, 3, 4};
  LambCase c;
  int64_t n = 0;
  for (int64_t l : len) n += l;
  c.s = make_state(n);
  Rng rng(seed);
  int64_t at = 0;
  for (int k = 0; k < 6; ++k) {
    c.segs.push_back({at, at + len[k], tensor[k]});
    const int64_t e = at + len[k];
    switch (tensor[k]) {
      case 0: fill(c.s, at, e, 100.0, 0.01, moments, rng); break;   // ||w|| >> ||u||
      case 1: fill(c.s, at, e, 1e-4, 0.01, moments, rng); break;    // ||w|| << ||u||
      case 2: fill(c.s, at, e, 0.0, 0.01, moments, rng); break;     // w = 0
      case 3: fill(c.s, at, e, 2.0, 0.01, moments, rng); break;     // in range
      case 4: fill(c.s, at, e, 1.0, 0.0, false, rng); break;        // g = m = v = 0
      default: break;                                                 // padding: zeros
    }
    at = e;
  }
  return c;
}

TEST(Lamb, MatchesDoubleReferenceOverStepsWithEveryClampBranch) {
  struct Mode {
    double wd;
    bool bias_correction, eps_inside_sqrt, grad_bf16;
  };
  const Mode modes[] = {{0.0, true, false, false}, {0.01, true, false, false}, {0.01, false, false, true},
                        {0.0, false, true, false}, {0.05, true, true, true}};
  for (Isa isa : kAll) {
    if (!isa_supported(isa)) continue;
    for (const Mode& mode : modes) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " wd=" + std::to_string(mode.wd) +
                   " bc=" + std::to_string(mode.bias_correction) + " inside=" + std::to_string(mode.eps_inside_sqrt) +
                   " bf16grad=" + std::to_string(mode.grad_bf16));
      LambParams p;
      p.lr = 0.01;
      p.beta1 = 0.85;
      p.beta2 = 0.98;
      p.eps = 1e-6;
      p.weight_decay = mode.wd;
      p.bias_correction = mode.bias_correction;
      p.eps_inside_sqrt = mode.eps_inside_sqrt;
      LambCase c = five_tensors(true, 11);
      LambState ref = c.s;
      for (int64_t step = 1; step <= 4; ++step) {
        const LambState before = c.s;
        const std::vector<double> want = reference_step(p, step, 0.5, ref, c.segs, mode.grad_bf16);
        const std::vector<double> got = lamb_step(p, step, 0.5f, span_of(c.s, mode.grad_bf16), c.segs, isa);
        ASSERT_EQ(got.size(), want.size());
        for (size_t t = 0; t < got.size(); ++t) EXPECT_NEAR(got[t], want[t], 1e-5 * want[t]) << "tensor " << t;
        if (step == 1) {
          EXPECT_EQ(got[0], p.max_coeff);
          EXPECT_EQ(got[1], p.min_coeff);
          EXPECT_EQ(got[2], 1.0);  // ||w|| = 0
          EXPECT_GT(got[3], p.min_coeff);
          EXPECT_LT(got[3], p.max_coeff);
          if (mode.wd == 0) {
            EXPECT_EQ(got[4], 1.0);  // ||u|| = 0
          }
        }
        expect_state_near(c.s, ref, before, c.segs, "after step");
        for (size_t i = 0; i < c.s.w.size(); ++i) ASSERT_EQ(c.s.out[i].bits, float_to_bf16(c.s.w[i]).bits) << i;
        // Keep both sides on the kernel's state so errors do not compound.
        ref = c.s;
        // Fresh gradients for the next step.
        Rng rng(100 + step);
        for (const LambSegment& sg : c.segs) {
          if (sg.tensor < 0 || sg.tensor == 4) continue;
          for (int64_t i = sg.begin; i < sg.end; ++i) c.s.g[i] = ref.g[i] = static_cast<float>(rng.normal() * 0.01);
        }
      }
      // The padding gap stays zero, as Adam leaves it.
      for (int64_t i = c.segs[3].begin; i < c.segs[3].end; ++i) ASSERT_EQ(c.s.w[i], 0.0f);
    }
  }
}

TEST(Lamb, EveryPathAgreesWithScalarOnOddLengthsAndUnalignedBoundaries) {
  // Tensors cut at odd places, long enough to span several 16384-element
  // pieces, plus a streamed copy-out (non-temporal stores after an unaligned head).
  const std::vector<int64_t> cuts = {0, 1, 18, 33, 16384 + 7, 40000, 40001, 70003};
  for (bool grad_bf16 : {false, true})
    for (int64_t stream_min : {int64_t{64} << 20, int64_t{1}}) {
      set_stream_min_bytes(stream_min);
      std::vector<LambSegment> segs;
      for (size_t k = 0; k + 1 < cuts.size(); ++k) segs.push_back({cuts[k], cuts[k + 1], static_cast<int>(k)});
      LambState base = make_state(cuts.back());
      Rng rng(5);
      for (size_t k = 0; k + 1 < cuts.size(); ++k) fill(base, cuts[k], cuts[k + 1], 0.5 + k, 0.02, true, rng);
      LambParams p;
      p.weight_decay = 0.02;
      LambState scalar = base;
      const std::vector<double> r0 = lamb_step(p, 3, 0.9f, span_of(scalar, grad_bf16), segs, Isa::kScalar);
      for (Isa isa : kAll) {
        if (isa == Isa::kScalar || !isa_supported(isa)) continue;
        SCOPED_TRACE(std::string(isa_name(isa)) + " bf16grad=" + std::to_string(grad_bf16) +
                     " stream=" + std::to_string(stream_min == 1));
        LambState s = base;
        const std::vector<double> r = lamb_step(p, 3, 0.9f, span_of(s, grad_bf16), segs, isa);
        for (size_t t = 0; t < r.size(); ++t) EXPECT_NEAR(r[t], r0[t], 1e-6 * r0[t]);
        expect_state_near(s, scalar, base, segs, "vs scalar");
        for (size_t i = 0; i < s.w.size(); ++i) ASSERT_EQ(s.out[i].bits, float_to_bf16(s.w[i]).bits) << i;
      }
    }
  set_stream_min_bytes(kStreamMinBytes);
}

TEST(Lamb, ResultDoesNotDependOnTheThreadCount) {
  const std::vector<LambSegment> segs = {{0, 50001, 0}, {50001, 50040, -1}, {50040, 123457, 1}};
  LambState base = make_state(123457);
  Rng rng(9);
  fill(base, 0, 50001, 1.0, 0.01, true, rng);
  fill(base, 50040, 123457, 0.3, 0.02, true, rng);
  LambParams p;
  p.weight_decay = 0.01;
  const int saved = omp_get_max_threads();
  std::vector<LambState> results;
  std::vector<std::vector<double>> ratios;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    LambState s = base;
    ratios.push_back(lamb_step(p, 2, 1.0f, span_of(s), segs));
    results.push_back(s);
  }
  omp_set_num_threads(saved);
  for (size_t k = 1; k < results.size(); ++k) {
    EXPECT_EQ(ratios[k], ratios[0]);
    EXPECT_EQ(results[k].w, results[0].w);
    EXPECT_EQ(results[k].m, results[0].m);
    EXPECT_EQ(results[k].v, results[0].v);
  }
}

TEST(Lamb, NormsSummedOverTwoSpansGiveTheOneSpanUpdate) {
  // A tensor split between two spans (two ranks' shards, or two NVMe
  // sub-groups): each span's pass-1 sums added, then each span applied.
  LambCase c = five_tensors(true, 3);
  LambParams p;
  p.weight_decay = 0.01;
  LambState whole = c.s;
  lamb_step(p, 1, 1.0f, span_of(whole), c.segs);
  const int64_t cut = 60;  // inside tensor 1
  LambState a = c.s;
  AdamSpan full = span_of(a);
  AdamSpan left = full, right = full;
  left.n = cut;
  right.param += cut;
  right.grad = static_cast<const float*>(right.grad) + cut;
  right.exp_avg += cut;
  right.exp_avg_sq += cut;
  right.bf16_out += cut;
  right.n -= cut;
  std::vector<LambSegment> ls, rs;
  for (const LambSegment& g : c.segs) {
    if (g.begin < cut) ls.push_back({g.begin, std::min(g.end, cut), g.tensor});
    if (g.end > cut) rs.push_back({std::max(g.begin, cut) - cut, g.end - cut, g.tensor});
  }
  std::vector<double> sums(10, 0.0), ratios(5);
  lamb_norms(p, 1.0f, right, rs, sums.data());  // order does not matter beyond rounding
  lamb_norms(p, 1.0f, left, ls, sums.data());
  for (int t = 0; t < 5; ++t) ratios[t] = lamb_trust_ratio(sums[2 * t], sums[2 * t + 1], p.min_coeff, p.max_coeff);
  lamb_apply(p, 1, 1.0f, left, ls, ratios.data());
  lamb_apply(p, 1, 1.0f, right, rs, ratios.data());
  expect_state_near(a, whole, c.s, c.segs, "split");
}

TEST(Lamb, RejectsSegmentsThatDoNotTileTheSpan) {
  LambState s = make_state(10);
  LambParams p;
  const std::vector<LambSegment> gap = {{0, 4, 0}, {5, 10, 1}};
  const std::vector<LambSegment> short_cover = {{0, 4, 0}};
  EXPECT_THROW(lamb_step(p, 1, 1.0f, span_of(s), gap), Error);
  EXPECT_THROW(lamb_step(p, 1, 1.0f, span_of(s), short_cover), Error);
  const std::vector<LambSegment> ok = {{0, 10, 0}};
  std::vector<double> r{1.0};
  EXPECT_THROW(lamb_apply(p, 0, 1.0f, span_of(s), ok, r.data()), Error);  // step counts from 1
}

TEST(Lamb, TrustRatioClampsAndFallsBackToOne) {
  EXPECT_EQ(lamb_trust_ratio(400.0, 1.0, 0.01, 10.0), 10.0);
  EXPECT_EQ(lamb_trust_ratio(1e-8, 1.0, 0.01, 10.0), 0.01);
  EXPECT_DOUBLE_EQ(lamb_trust_ratio(4.0, 1.0, 0.01, 10.0), 2.0);
  EXPECT_EQ(lamb_trust_ratio(0.0, 1.0, 0.01, 10.0), 1.0);
  EXPECT_EQ(lamb_trust_ratio(1.0, 0.0, 0.01, 10.0), 1.0);
}

}  // namespace
}  // namespace zinc::optim
