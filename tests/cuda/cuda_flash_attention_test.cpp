// Tests for the fused causal attention (csrc/kernels/flash_attention.cu,
// Note [fused attention]): forward and every gradient against the CPU's fp32
// attention on the same inputs, at sizes that leave partial tiles (T of 1,
// 17, 37, 65, 70, 100, 130 against tiles of 64), head dims that are padded
// (4, 12, 40, 80) and not (64, 96, 128), grouped-query heads read in place
// (groups of 1, 2, 3 and 2-to-1), packed documents, sliding windows, the
// score scale and the soft cap.
//
// Tolerances, and why. The reference is the CPU attention in fp32 (itself
// within 1e-4 of a double reference, kernels_test). The fused kernels round
// Q, K, V, dO and then P and dS to the compute dtype before each product, so
// each output element carries the rounding of a weighted sum of 16-bit
// values: about 2^-8 relative for bf16 and 2^-11 for fp16 per term, which a
// sum of up to T terms with weights in [0, 1] keeps at that order of the
// largest term. Measured at these sizes, abs + rel (|got - want| <= tol (1 +
// |want|)), the largest errors are ~6e-3 (bf16) and ~8e-4 (fp16). Allowed:
// 3e-2 and 4e-3, the CPU's own 16-bit distance from the double reference in
// kernels_test, and also at most twice the unfused GPU path's error on the
// same inputs (so the fused path is as exact as the one it replaces). An
// indexing or tile-bound bug gives O(1) errors in whole rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/cuda_util.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc::kernels {
namespace {

using zinc::cuda::DeviceBuffer;
using zinc::cuda::testing::download;
using zinc::cuda::testing::packed_positions;
using zinc::cuda::testing::randn;
using zinc::cuda::testing::upload;

struct Case {
  int64_t B, T, H, Hkv, D;
  bool packed = false;
  int64_t window = 0;
  float scale = 0.0f, softcap = 0.0f;
  std::vector<int32_t> positions;  // with packed: these instead of packed_positions
  int64_t width() const { return (H + 2 * Hkv) * D; }  // a q|k|v projection row
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " H=" + std::to_string(H) +
           " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D) + (packed ? " packed" : "") +
           (window ? " window " + std::to_string(window) : "") + (scale > 0 ? " scale " + std::to_string(scale) : "") +
           (softcap > 0 ? " softcap " + std::to_string(softcap) : "");
  }
};

// out (B*T, H*D) and the projection's gradient (B*T, (H + 2 Hkv) D).
struct Result {
  std::vector<float> out, dproj;
};

AttentionShape shape(const Case& c, const int32_t* positions) {
  AttentionShape s{c.B, c.T, c.H * c.D, c.H};
  s.positions = positions;
  s.window = c.window;
  s.scale = c.scale;
  s.softcap = c.softcap;
  return s;
}

// The CPU attention in fp32: kv heads repeated to H (gqa_expand), the
// multi-head kernel, the gradient summed back (gqa_reduce).
Result reference(const Case& c, const std::vector<float>& proj, const std::vector<float>& dout,
                 const std::vector<int32_t>& pos) {
  const int64_t N = c.B * c.T, C = c.H * c.D;
  std::vector<float> qkv(static_cast<size_t>(N * 3 * C)), dqkv(qkv.size());
  gqa_expand(qkv.data(), proj.data(), N, c.H, c.Hkv, c.D);
  Result r{std::vector<float>(static_cast<size_t>(N * C)), std::vector<float>(proj.size())};
  AttentionWorkspace* ws = attention_workspace_create();
  const AttentionShape s = shape(c, c.packed ? pos.data() : nullptr);
  attention_forward(ws, r.out.data(), qkv.data(), s, DType::kF32);
  attention_backward(ws, dqkv.data(), dout.data(), qkv.data(), s, DType::kF32);
  attention_workspace_destroy(ws);
  gqa_reduce(r.dproj.data(), dqkv.data(), N, c.H, c.Hkv, c.D);
  return r;
}

// The GPU's attention through cuda::attention_forward/backward on the
// expanded heads: the unfused path, or (fused) the fused kernels as the
// multi-head layers call them.
Result gpu_mha(const Case& c, const std::vector<float>& proj, const std::vector<float>& dout,
               const std::vector<int32_t>& pos, DType compute, bool fused) {
  cuda::set_unfused_attention_for_testing(!fused);
  const int64_t N = c.B * c.T, C = c.H * c.D;
  DeviceBuffer p = upload(proj), g = upload(dout), d_pos = upload(pos);
  DeviceBuffer qkv(static_cast<size_t>(N * 3 * C) * sizeof(float)), out(static_cast<size_t>(N * C) * sizeof(float));
  DeviceBuffer dqkv = upload(std::vector<float>(static_cast<size_t>(N * 3 * C), 123.0f));
  DeviceBuffer dp = upload(std::vector<float>(proj.size(), 123.0f));
  zinc::cuda::Stream stream;
  cuda::gqa_expand(qkv.as<float>(), p.as<float>(), N, c.H, c.Hkv, c.D, stream.get());
  cuda::CudaAttentionWorkspace* ws = cuda::attention_workspace_create();
  const AttentionShape s = shape(c, c.packed ? d_pos.as<int32_t>() : nullptr);
  cuda::attention_forward(ws, out.as<float>(), qkv.as<float>(), s, compute, stream.get());
  cuda::attention_backward(ws, dqkv.as<float>(), g.as<float>(), qkv.as<float>(), s, compute, stream.get());
  cuda::gqa_reduce(dp.as<float>(), dqkv.as<float>(), N, c.H, c.Hkv, c.D, stream.get());
  stream.synchronize();
  cuda::attention_workspace_destroy(ws);
  cuda::set_unfused_attention_for_testing(false);
  return {download<float>(out, static_cast<size_t>(N * C)), download<float>(dp, proj.size())};
}

// The fused kernels on the projection's rows as they are: kv heads read in
// place, never repeated. Every output starts as garbage (written, not added).
Result fused(const Case& c, const std::vector<float>& proj, const std::vector<float>& dout,
             const std::vector<int32_t>& pos, DType compute) {
  const int64_t N = c.B * c.T, C = c.H * c.D, W = c.width();
  DeviceBuffer p = upload(proj), g = upload(dout), d_pos = upload(pos);
  DeviceBuffer out = upload(std::vector<float>(static_cast<size_t>(N * C), 123.0f));
  DeviceBuffer lse(static_cast<size_t>(c.B * c.H * c.T) * sizeof(float)),
      di(static_cast<size_t>(c.B * c.H * c.T) * sizeof(float));
  DeviceBuffer dp = upload(std::vector<float>(proj.size(), 123.0f));
  cuda::FlashArgs a;
  a.q = p.as<float>();
  a.k = a.q + c.H * c.D;
  a.v = a.k + c.Hkv * c.D;
  a.q_stride = a.kv_stride = W;
  a.out = out.as<float>();
  a.out_stride = a.dout_stride = C;
  a.lse = lse.as<float>();
  a.dout = g.as<float>();
  a.di = di.as<float>();
  a.dq = dp.as<float>();
  a.dk = a.dq + c.H * c.D;
  a.dv = a.dk + c.Hkv * c.D;
  a.B = c.B, a.T = c.T, a.H = c.H, a.Hkv = c.Hkv, a.D = c.D;
  a.positions = c.packed ? d_pos.as<int32_t>() : nullptr;
  a.window = c.window;
  a.scale = shape(c, nullptr).score_scale();
  a.softcap = c.softcap;
  zinc::cuda::Stream stream;
  cuda::flash_attention_forward(a, compute, stream.get());
  cuda::flash_attention_backward(a, compute, stream.get());
  stream.synchronize();
  return {download<float>(out, static_cast<size_t>(N * C)), download<float>(dp, proj.size())};
}

// max |got - want| / (1 + |want|), and where.
struct Err {
  double err = 0.0;
  size_t at = 0;
};
Err max_err(const std::vector<float>& got, const std::vector<float>& want) {
  Err e;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]) / (1.0 + std::fabs(want[i]));
    if (!(d <= e.err)) e = {std::isnan(d) ? INFINITY : d, i};
  }
  return e;
}

double tolerance(DType t) { return t == DType::kBF16 ? 3e-2 : 4e-3; }

void check(const Case& c, DType compute, uint64_t seed) {
  const int64_t N = c.B * c.T;
  const auto proj = randn(N * c.width(), seed), dout = randn(N * c.H * c.D, seed + 1);
  const std::vector<int32_t> pos = c.positions.empty() ? packed_positions(c.B, c.T) : c.positions;
  const Result want = reference(c, proj, dout, pos);
  const Result got = fused(c, proj, dout, pos, compute);
  const Result old = gpu_mha(c, proj, dout, pos, compute, false);
  const std::string what = c.str() + " " + std::string(dtype_name(compute));
  for (int part = 0; part < 2; ++part) {
    const std::vector<float>& g = part ? got.dproj : got.out;
    const std::vector<float>& w = part ? want.dproj : want.out;
    const Err fe = max_err(g, w), ue = max_err(part ? old.dproj : old.out, w);
    const char* name = part ? "gradient" : "output";
    EXPECT_LE(fe.err, tolerance(compute)) << what << ": " << name << " element " << fe.at << " is " << g[fe.at]
                                          << ", the fp32 CPU's " << w[fe.at];
    EXPECT_LE(fe.err, std::max(2.0 * ue.err, 1e-3))
        << what << ": " << name << " is further from fp32 (" << fe.err << ") than twice the unfused path (" << ue.err
        << ")";
  }
}

const Case kCases[] = {
    {2, 37, 4, 4, 64}, {1, 130, 2, 2, 128}, {2, 17, 3, 3, 12}, {1, 1, 1, 1, 4},
    {1, 100, 4, 2, 80}, {2, 70, 6, 2, 96},  {1, 65, 2, 1, 40},
};

TEST(CudaFlashAttention, Bf16AgreesWithTheCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 7000;
  for (const Case& c : kCases) check(c, DType::kBF16, seed += 2);
}

TEST(CudaFlashAttention, Fp16AgreesWithTheCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 7100;
  for (const Case& c : kCases) check(c, DType::kF16, seed += 2);
}

// Packed documents, windows (of 1, inside a tile, across tiles, longer than
// the sequence), Granite's score scale and Gemma 2's soft cap, alone and
// together.
TEST(CudaFlashAttention, MasksScalesAndCapsAgreeWithTheCpu) {
  ZINC_REQUIRE_GPU();
  uint64_t seed = 7200;
  for (Case c : {Case{2, 37, 4, 2, 64}, Case{1, 130, 2, 2, 128}, Case{1, 100, 3, 1, 80}}) {
    for (int64_t w : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{70}, int64_t{500}})
      for (bool packed : {false, true}) {
        c.window = w;
        c.packed = packed;
        check(c, DType::kBF16, seed += 2);
      }
    c.window = 0;
    c.packed = false;
    c.scale = 0.2f;
    check(c, DType::kF16, seed += 2);
    c.softcap = 0.7f;
    check(c, DType::kBF16, seed += 2);
    c.packed = true;
    c.window = 5;
    check(c, DType::kF16, seed += 2);
    c.scale = 0.0f;
    c.softcap = 0.0f;
  }
  // Documents that start at the last key of a tile (63, 127) and one key
  // past it (64, 129): the first key tile a query tile sees, and the query
  // tiles a key tile skips, at their edges.
  for (int64_t start : {int64_t{63}, int64_t{64}}) {
    Case c{2, 150, 2, 1, 64};
    c.packed = true;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t = 0; t < c.T; ++t) {
        const int64_t s2 = start + 64 + b;  // the next document: at 127 or 128, 128 or 129
        c.positions.push_back(static_cast<int32_t>(t >= s2 ? t - s2 : t >= start ? t - start : t));
      }
    check(c, DType::kBF16, seed += 2);
  }
}

// cuda::attention_forward/backward take the fused kernels for 16-bit
// compute: the same bits as the kernels called directly on the expanded
// heads' layout, and the workspace carries lse and the output to backward.
TEST(CudaFlashAttention, TheMultiHeadLayersRunTheFusedKernels) {
  ZINC_REQUIRE_GPU();
  const Case c{2, 70, 4, 4, 64};
  const int64_t N = c.B * c.T;
  const auto proj = randn(N * c.width(), 7300), dout = randn(N * c.H * c.D, 7301);
  const std::vector<int32_t> pos = packed_positions(c.B, c.T);
  for (DType t : {DType::kBF16, DType::kF16}) {
    const Result direct = fused(c, proj, dout, pos, t);
    const Result layers = gpu_mha(c, proj, dout, pos, t, true);
    EXPECT_EQ(direct.out, layers.out) << dtype_name(t);
    EXPECT_EQ(direct.dproj, layers.dproj) << dtype_name(t);
    const Result unfused = gpu_mha(c, proj, dout, pos, t, false);
    EXPECT_NE(direct.out, unfused.out) << "the unfused path rounds elsewhere: equal bits mean one path ran twice";
  }
}

// With a 16-bit output (Note [fused 16-bit operands]) attention writes the
// rounding of the output it would have written, on both paths, and the
// backward after it is the same; the fused path then leaves the fp32
// output alone (it starts as 123 here), the unfused one writes both.
TEST(CudaFlashAttention, TheSixteenBitOutputIsTheOutputRounded) {
  ZINC_REQUIRE_GPU();
  const Case c{2, 70, 4, 4, 64};
  const int64_t N = c.B * c.T, C = c.H * c.D;
  const auto qkv_h = randn(N * 3 * C, 7400), dout_h = randn(N * C, 7401);
  const std::vector<int32_t> pos = packed_positions(c.B, c.T);
  DeviceBuffer qkv = upload(qkv_h), g = upload(dout_h), d_pos = upload(pos);
  const AttentionShape s = shape(c, d_pos.as<int32_t>());
  zinc::cuda::Stream stream;
  for (bool fused : {true, false})
    for (DType t : {DType::kBF16, DType::kF16}) {
      cuda::set_unfused_attention_for_testing(!fused);
      std::vector<float> plain, plain_dqkv;
      for (bool with16 : {false, true}) {
        DeviceBuffer out = upload(std::vector<float>(static_cast<size_t>(N * C), 123.0f));
        DeviceBuffer out16 = zinc::cuda::testing::filled16(N * C), dqkv(static_cast<size_t>(N * 3 * C) * 4);
        cuda::CudaAttentionWorkspace* ws = cuda::attention_workspace_create();
        cuda::attention_forward(ws, out.as<float>(), qkv.as<float>(), s, t, stream.get(),
                                with16 ? out16.data() : nullptr);
        cuda::attention_backward(ws, dqkv.as<float>(), g.as<float>(), qkv.as<float>(), s, t, stream.get());
        stream.synchronize();
        cuda::attention_workspace_destroy(ws);
        const auto o = download<float>(out, static_cast<size_t>(N * C));
        const auto d = download<float>(dqkv, static_cast<size_t>(N * 3 * C));
        if (!with16) {
          plain = o;
          plain_dqkv = d;
          continue;
        }
        const std::string at = std::string(fused ? "fused " : "unfused ") + std::string(dtype_name(t));
        EXPECT_EQ(zinc::cuda::testing::rounded16(plain, t), download<uint16_t>(out16, static_cast<size_t>(N * C)))
            << at;
        EXPECT_EQ(plain_dqkv, d) << at;
        if (fused)
          EXPECT_EQ(o, std::vector<float>(static_cast<size_t>(N * C), 123.0f)) << at;
        else
          EXPECT_EQ(o, plain) << at;
        // And without an fp32 output at all (a model that keeps none).
        DeviceBuffer alone16 = zinc::cuda::testing::filled16(N * C);
        ws = cuda::attention_workspace_create();
        cuda::attention_forward(ws, nullptr, qkv.as<float>(), s, t, stream.get(), alone16.data());
        cuda::attention_backward(ws, dqkv.as<float>(), g.as<float>(), qkv.as<float>(), s, t, stream.get());
        stream.synchronize();
        cuda::attention_workspace_destroy(ws);
        EXPECT_EQ(download<uint16_t>(out16, static_cast<size_t>(N * C)),
                  download<uint16_t>(alone16, static_cast<size_t>(N * C)))
            << at << " without out";
        EXPECT_EQ(plain_dqkv, download<float>(dqkv, static_cast<size_t>(N * 3 * C))) << at << " without out";
      }
    }
  cuda::set_unfused_attention_for_testing(false);
  DeviceBuffer any(64);
  cuda::CudaAttentionWorkspace* ws = cuda::attention_workspace_create();
  EXPECT_THROW(cuda::attention_forward(ws, nullptr, qkv.as<float>(), s, DType::kF32, stream.get(), any.data()),
               zinc::Error);
  cuda::attention_workspace_destroy(ws);
}

TEST(CudaFlashAttention, BadArgumentsThrow) {
  EXPECT_TRUE(cuda::flash_attention_applies(128, DType::kBF16));
  EXPECT_TRUE(cuda::flash_attention_applies(80, DType::kF16));
  EXPECT_FALSE(cuda::flash_attention_applies(129, DType::kBF16));
  EXPECT_FALSE(cuda::flash_attention_applies(64, DType::kF32));
  cuda::FlashArgs a;
  a.B = 1, a.T = 4, a.H = 3, a.Hkv = 2, a.D = 64;
  EXPECT_THROW(cuda::flash_attention_forward(a, DType::kBF16, nullptr), zinc::Error);  // H not a multiple of Hkv
  a.Hkv = 3;
  a.D = 160;
  EXPECT_THROW(cuda::flash_attention_forward(a, DType::kBF16, nullptr), zinc::Error);  // head dim over 128
  a.D = 64;
  EXPECT_THROW(cuda::flash_attention_backward(a, DType::kF32, nullptr), zinc::Error);  // fp32 compute
}

}  // namespace
}  // namespace zinc::kernels
