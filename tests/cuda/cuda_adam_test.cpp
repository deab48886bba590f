// GPU-resident AdamW against the CPU AdamW: the same bits (optim_cuda.h).
// Skipped without a GPU; tests/optim/adam_shared_math_test.cpp checks the
// same per-element code on the host on every machine.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/rng.h"
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

}  // namespace
}  // namespace zinc::optim
