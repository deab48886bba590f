// The GPU AdamW's arithmetic, run on the host: optim/detail/adam_update.h
// instantiated with VecHD (one rounding per fma, IEEE division and square
// root) is what adam_cuda.cu runs per element. On the host it must give the
// bits of every FMA path of the CPU AdamW (AVX2, AVX-512, AVX-512 BF16), which
// is what makes ZeRO-Offload's weights equal to GPU-resident AdamW's.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/rng.h"
#include "optim/detail/adam_args.h"
#include "optim/optim.h"

namespace zinc::optim {
namespace {

struct Case {
  AdamParams p;
  int64_t step;
  float grad_scale;
  bool grad_bf16;
};

TEST(AdamSharedMath, VecHDEqualsEveryFmaPathBitForBit) {
  const Isa fma_paths[] = {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};
  std::vector<Case> cases;
  for (bool adamw : {true, false})
    for (double wd : {0.0, 0.01})
      for (bool bc : {true, false})
        for (bool g16 : {false, true}) {
          AdamParams p;
          p.lr = 3e-3;
          p.weight_decay = wd;
          p.adam_w_mode = adamw;
          p.bias_correction = bc;
          cases.push_back({p, 7, 0.37f, g16});
        }
  int ran = 0;
  for (Isa isa : fma_paths) {
    if (!isa_supported(isa)) continue;
    for (const Case& c : cases) {
      const int64_t n = 1037;  // whole vectors and a scalar tail
      Rng rng(42);
      std::vector<float> w(n), m(n), v(n), g(n);
      std::vector<bf16> g16(n), out(n);
      for (int64_t i = 0; i < n; ++i) {
        w[i] = static_cast<float>(rng.normal());
        m[i] = static_cast<float>(rng.normal() * 0.01);
        v[i] = static_cast<float>(rng.uniform() * 1e-4);
        g[i] = static_cast<float>(rng.normal() * 0.01);
        g16[i] = float_to_bf16(g[i]);
      }
      std::vector<float> w2 = w, m2 = m, v2 = v;
      // The CPU path.
      adam_step(c.p, c.step, c.grad_scale,
                AdamSpan{w.data(), c.grad_bf16 ? static_cast<const void*>(g16.data()) : g.data(),
                         c.grad_bf16 ? DType::kBF16 : DType::kF32, m.data(), v.data(), out.data(), n},
                isa);
      // The GPU kernel's per-element body, on the host.
      const detail::AdamArgs a = detail::make_adam_args(c.p, c.step, c.grad_scale);
      for (int64_t i = 0; i < n; ++i) {
        const float gi = c.grad_bf16 ? bf16_to_float(g16[i]) : g[i];
        switch (detail::adam_decay(c.p)) {
          case detail::Decay::kNone: detail::adam_update<detail::VecHD, detail::Decay::kNone>(a, w2[i], gi, m2[i], v2[i]); break;
          case detail::Decay::kAdamW: detail::adam_update<detail::VecHD, detail::Decay::kAdamW>(a, w2[i], gi, m2[i], v2[i]); break;
          case detail::Decay::kL2: detail::adam_update<detail::VecHD, detail::Decay::kL2>(a, w2[i], gi, m2[i], v2[i]); break;
        }
      }
      ASSERT_EQ(0, std::memcmp(w.data(), w2.data(), n * 4)) << isa_name(isa) << " weights";
      ASSERT_EQ(0, std::memcmp(m.data(), m2.data(), n * 4)) << isa_name(isa) << " m";
      ASSERT_EQ(0, std::memcmp(v.data(), v2.data(), n * 4)) << isa_name(isa) << " v";
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i].bits, float_to_bf16(w2[i]).bits) << isa_name(isa) << " bf16 at " << i;
      ++ran;
    }
  }
  if (ran == 0) GTEST_SKIP() << "this CPU has no FMA path (AVX2+FMA) to compare with";
}

// The scalar path without FMA rounds twice and must NOT agree everywhere:
// shows the comparison above can fail.
TEST(AdamSharedMath, TheNonFmaScalarPathDiffers) {
  const int64_t n = 4096;
  Rng rng(7);
  std::vector<float> w(n), m(n), v(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    w[i] = static_cast<float>(rng.normal());
    m[i] = static_cast<float>(rng.normal() * 0.01);
    v[i] = static_cast<float>(rng.uniform() * 1e-4);
    g[i] = static_cast<float>(rng.normal() * 0.01);
  }
  std::vector<float> w2 = w, m2 = m, v2 = v;
  AdamParams p;
  p.weight_decay = 0.01;
  adam_step(p, 3, 1.0f, AdamSpan{w.data(), g.data(), DType::kF32, m.data(), v.data(), nullptr, n}, Isa::kScalar);
  const detail::AdamArgs a = detail::make_adam_args(p, 3, 1.0f);
  for (int64_t i = 0; i < n; ++i) detail::adam_update<detail::VecHD, detail::Decay::kAdamW>(a, w2[i], g[i], m2[i], v2[i]);
  EXPECT_NE(0, std::memcmp(w.data(), w2.data(), n * 4));
}

}  // namespace
}  // namespace zinc::optim
