// GPU-resident AdamW and Lamb against the CPU's: the same bits
// (optim_cuda.h). Skipped without a GPU; tests/optim/adam_shared_math_test.cpp
// checks the same per-element code on the host on every machine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/rng.h"
#include "optim/detail/lamb_update.h"
#include "optim/optim.h"
#include "optim/optim_cuda.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc::optim {
namespace {

using zinc::cuda::DeviceBuffer;
using zinc::cuda::testing::download;
using zinc::cuda::testing::upload;

TEST(CudaAdam, SameBitsAsTheCpuFmaPaths) {
  ZINC_REQUIRE_GPU();
  Isa isa = detect_isa();
  if (isa == Isa::kScalar) GTEST_SKIP() << "this CPU has no FMA path";
  const int64_t n = 100003;
  for (bool bf16_grad : {false, true})
    for (double wd : {0.0, 0.1})
      for (bool adamw : {true, false}) {
        Rng rng(3);
        std::vector<float> w(n), m(n), v(n), g(n);
        std::vector<bf16> g16(n), out(n);
        for (int64_t i = 0; i < n; ++i) {
          w[i] = static_cast<float>(rng.normal());
          m[i] = static_cast<float>(rng.normal() * 0.01);
          v[i] = static_cast<float>(rng.uniform() * 1e-4);
          g[i] = static_cast<float>(rng.normal() * 0.01);
          g16[i] = float_to_bf16(g[i]);
        }
        DeviceBuffer dw = upload(w), dm = upload(m), dv = upload(v), dg = upload(g), dg16 = upload(g16), dout(n * 2);
        AdamParams p;
        p.lr = 1e-3;
        p.weight_decay = wd;
        p.adam_w_mode = adamw;
        for (int64_t step = 1; step <= 3; ++step) {
          adam_step(p, step, 0.5f,
                    AdamSpan{w.data(), bf16_grad ? static_cast<const void*>(g16.data()) : g.data(),
                             bf16_grad ? DType::kBF16 : DType::kF32, m.data(), v.data(), out.data(), n},
                    isa);
          adam_step_cuda(p, step, 0.5f,
                         AdamSpan{dw.as<float>(), bf16_grad ? dg16.data() : dg.data(),
                                  bf16_grad ? DType::kBF16 : DType::kF32, dm.as<float>(), dv.as<float>(),
                                  dout.as<bf16>(), n},
                         nullptr);
        }
        std::vector<float> gw = download<float>(dw, n), gm = download<float>(dm, n), gv = download<float>(dv, n);
        std::vector<bf16> gout = download<bf16>(dout, n);
        EXPECT_EQ(0, std::memcmp(w.data(), gw.data(), n * 4)) << "weights";
        EXPECT_EQ(0, std::memcmp(m.data(), gm.data(), n * 4)) << "m";
        EXPECT_EQ(0, std::memcmp(v.data(), gv.data(), n * 4)) << "v";
        EXPECT_EQ(0, std::memcmp(out.data(), gout.data(), n * 2)) << "bf16 copy";
      }
}


// Lamb's two passes on the GPU against the CPU's (Note [Lamb arithmetic]):
// segments of whole tensors, a one-element tensor, padding between them,
// and tensors of several 16384-element pieces with a ragged last one.
// - The sums: the same pieces, each summed in another order, so equal to
//   1e-12 relative (double rounding);
// - the trust ratios, rounded to the float coefficients the update uses,
//   the same (optim_cuda.h says when they could part);
// - w, m, v and the 16-bit copy after three steps: the same bits. An
//   element a piece's bound leaves out, in either pass, fails them.
TEST(CudaLamb, SameBitsAsTheCpuFmaPaths) {
  ZINC_REQUIRE_GPU();
  Isa isa = detect_isa();
  if (isa == Isa::kScalar) GTEST_SKIP() << "this CPU has no FMA path";
  const std::vector<LambSegment> segs = {
      {0, 1, 0}, {1, 40000, 1}, {40000, 40037, -1}, {40037, 40038, 2}, {40038, 89191, 3}, {89191, 100003, -1}};
  const int64_t n = 100003;
  const int tensors = 4;
  for (bool bf16_grad : {false, true})
    for (bool eps_inside : {false, true})
      for (DType out_dt : {DType::kBF16, DType::kF16}) {
        const std::string what = std::string(bf16_grad ? "bf16" : "fp32") + " grad, eps " +
                                 (eps_inside ? "inside" : "outside") + ", " + std::string(dtype_name(out_dt)) + " copy";
        Rng rng(5);
        std::vector<float> w(n), m(n), v(n), g(n);
        std::vector<bf16> g16(n), out(n);
        for (int64_t i = 0; i < n; ++i) {
          w[i] = static_cast<float>(rng.normal() * (i < 40000 ? 1.0 : 0.02));
          m[i] = static_cast<float>(rng.normal() * 0.01);
          v[i] = static_cast<float>(rng.uniform() * 1e-4);
          g[i] = static_cast<float>(rng.normal() * 0.01);
          g16[i] = float_to_bf16(g[i]);
        }
        DeviceBuffer dw = upload(w), dm = upload(m), dv = upload(v), dg = upload(g), dg16 = upload(g16), dout(n * 2);
        LambParams p;
        p.lr = 2e-3;
        p.weight_decay = 0.01;
        p.eps_inside_sqrt = eps_inside;
        p.bias_correction = !eps_inside;
        LambCuda gpu;
        const AdamSpan host{w.data(), bf16_grad ? static_cast<const void*>(g16.data()) : g.data(),
                            bf16_grad ? DType::kBF16 : DType::kF32, m.data(), v.data(), out.data(), n};
        for (int64_t step = 1; step <= 3; ++step) {
          std::vector<double> cs(2 * tensors, 0.0), gs(2 * tensors, 0.0), cr(tensors), gr(tensors);
          lamb_norms(p, 0.5f, host, segs, cs.data(), isa);
          gpu.norms(p, 0.5f, dw.as<float>(), bf16_grad ? dg16.data() : dg.data(), host.grad_dtype, dm.as<float>(),
                    dv.as<float>(), n, segs, gs.data(), nullptr);
          for (int t = 0; t < tensors; ++t) {
            for (int k : {0, 1})
              EXPECT_NEAR(gs[2 * t + k], cs[2 * t + k], 1e-12 * cs[2 * t + k]) << what << ", tensor " << t;
            cr[t] = lamb_trust_ratio(cs[2 * t], cs[2 * t + 1], p.min_coeff, p.max_coeff);
            gr[t] = lamb_trust_ratio(gs[2 * t], gs[2 * t + 1], p.min_coeff, p.max_coeff);
          }
          EXPECT_NE(cr[1], 1.0) << "a ratio that is not clamped or 1";
          EXPECT_EQ(detail::lamb_coefficients(p, step, segs, cr.data()),
                    detail::lamb_coefficients(p, step, segs, gr.data()))
              << what << ", step " << step;
          lamb_apply(p, step, 0.5f, host, segs, cr.data(), isa);
          gpu.apply(p, step, 0.5f, dw.as<float>(), bf16_grad ? dg16.data() : dg.data(), host.grad_dtype,
                    dm.as<float>(), dv.as<float>(), dout.data(), out_dt, n, segs, gr.data(), nullptr);
        }
        std::vector<float> gw = download<float>(dw, n), gm = download<float>(dm, n), gv = download<float>(dv, n);
        std::vector<uint16_t> gout = download<uint16_t>(dout, n);
        EXPECT_EQ(0, std::memcmp(w.data(), gw.data(), n * 4)) << what << ": weights";
        EXPECT_EQ(0, std::memcmp(m.data(), gm.data(), n * 4)) << what << ": m";
        EXPECT_EQ(0, std::memcmp(v.data(), gv.data(), n * 4)) << what << ": v";
        int64_t copy_off = 0;
        for (int64_t i = 0; i < n; ++i)
          copy_off += gout[i] != (out_dt == DType::kBF16 ? out[i].bits : float_to_16(w[i], out_dt));
        EXPECT_EQ(copy_off, 0) << what << ": 16-bit copies that are not the weights'";
      }
}

// Segments that do not cover the span, or leave a gap, are refused naming
// the pass and the segment, before anything is written.
TEST(CudaLamb, BadSegmentsAreRefused) {
  ZINC_REQUIRE_GPU();
  const int64_t n = 100;
  std::vector<float> w(n, 1.0f), z(n, 0.0f);
  DeviceBuffer dw = upload(w), dz = upload(z), dm = upload(z), dv = upload(z);
  LambCuda gpu;
  LambParams p;
  std::vector<double> sums(2, 0.0), ratios(1, 1.0);
  const std::vector<LambSegment> short_segs = {{0, 60, 0}};
  const std::vector<LambSegment> gap = {{0, 60, 0}, {61, 100, 0}};
  auto message = [&](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] {
              gpu.norms(p, 1.0f, dw.as<float>(), dz.data(), DType::kF32, dm.as<float>(), dv.as<float>(), n,
                        short_segs, sums.data(), nullptr);
            }).find("lamb_norms (GPU): the segments cover 60 of the span's 100 elements"),
            std::string::npos);
  EXPECT_NE(message([&] {
              gpu.apply(p, 1, 1.0f, dw.as<float>(), dz.data(), DType::kF32, dm.as<float>(), dv.as<float>(), nullptr,
                        DType::kBF16, n, gap, ratios.data(), nullptr);
            }).find("lamb_apply (GPU): segment 1 [61, 100) tensor 0 does not continue"),
            std::string::npos);
  EXPECT_EQ(download<float>(dw, n), w) << "a refused update wrote the weights";
}

}  // namespace
}  // namespace zinc::optim
