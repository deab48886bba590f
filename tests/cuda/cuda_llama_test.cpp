// The GPU Llama-family kernels (kernels/llama_layers.cu) against the CPU
// kernels (kernels/llama_layers.cpp) on the same inputs, bit for bit: they
// share kernels/math.h, RMSNorm's row sums follow Note [lane order] and its
// weight gradient Note [column sums]. Skipped without a GPU; run on the CPU
// by kernel emulation (tests/cuda_emu) on every build.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "core/rng.h"
#include "kernels/kernels.h"
#include "kernels/kernels_cuda.h"
#include "kernels/math.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc::kernels {
namespace {

using zinc::cuda::DeviceBuffer;
using zinc::cuda::testing::download;
using zinc::cuda::testing::upload;
using zinc::cuda::testing::Param;
using zinc::cuda::testing::randn;
using zinc::cuda::testing::filled16;
using zinc::cuda::testing::rounded16;

void expect_same_bits(const std::vector<float>& cpu, const std::vector<float>& gpu, const std::string& what) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what;
  for (size_t i = 0; i < cpu.size(); ++i)
    ASSERT_EQ(float_bits(cpu[i]), float_bits(gpu[i])) << what << " at " << i << ": cpu " << cpu[i] << " gpu " << gpu[i];
}

// C: one element, under, at and over the 16 lanes, a width that is no
// multiple of them, a model's; N: under one block of rows, and more chunks
// of rows than a wave of the dw kernel's threads takes (Note [column sums]).
TEST(CudaLlama, RmsNormMatchesTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (int64_t C : {1, 15, 16, 17, 133, 768})
  for (int64_t N : {29, 2113})
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16})
  for (float off : {0.0f, 1.0f}) {  // the Llama's norm and Gemma's (1 + w)
    const std::string at = "C=" + std::to_string(C) + " N=" + std::to_string(N) + " " + std::string(dtype_name(t)) +
                           " offset " + std::to_string(off);
    const float eps = C == 133 ? 1e-6f : 1e-5f;
    std::vector<float> x = randn(N * C, 101, 2.0), w = randn(C, 102, 0.5), dout = randn(N * C, 103);
    for (float& v : w) v += 1.0f;
    Param pw(w, t);
    std::vector<float> out(N * C), rstd(N);
    rmsnorm_forward(out.data(), rstd.data(), x.data(), pw.host(), N, C, eps, off);
    DeviceBuffer d_x = upload(x), d_out(N * C * 4), d_rstd(N * 4);
    cuda::rmsnorm_forward(d_out.as<float>(), d_rstd.as<float>(), d_x.as<float>(), pw.dev(), N, C, eps, nullptr, off);
    expect_same_bits(out, download<float>(d_out, out.size()), "rmsnorm out " + at);
    expect_same_bits(rstd, download<float>(d_rstd, rstd.size()), "rmsnorm rstd " + at);
    {
      // The residual and the norm in one kernel: the CPU's add, then its norm.
      const std::vector<float> res = randn(N * C, 106);
      std::vector<float> sum(N * C), out2(N * C), rstd2(N);
      add(sum.data(), x.data(), res.data(), N * C);
      rmsnorm_forward(out2.data(), rstd2.data(), sum.data(), pw.host(), N, C, eps, off);
      DeviceBuffer d_sum = upload(x), d_res = upload(res), d_out2(N * C * 4), d_rstd2(N * 4);
      cuda::add_rmsnorm_forward(d_out2.as<float>(), d_rstd2.as<float>(), d_sum.as<float>(), d_res.as<float>(), pw.dev(),
                                N, C, eps, nullptr, off);
      expect_same_bits(sum, download<float>(d_sum, sum.size()), "add_rmsnorm sum " + at);
      expect_same_bits(out2, download<float>(d_out2, out2.size()), "add_rmsnorm out " + at);
      expect_same_bits(rstd2, download<float>(d_rstd2, rstd2.size()), "add_rmsnorm rstd " + at);
    }

    std::vector<float> dx = randn(N * C, 104), dw = randn(C, 105);  // accumulated into
    DeviceBuffer d_dx = upload(dx), d_dw = upload(dw), d_dout = upload(dout);
    rmsnorm_backward(dx.data(), dw.data(), dout.data(), x.data(), pw.host(), rstd.data(), N, C, off);
    cuda::rmsnorm_backward(d_dx.as<float>(), d_dw.as<float>(), d_dout.as<float>(), d_x.as<float>(), pw.dev(),
                           d_rstd.as<float>(), N, C, nullptr, off);
    expect_same_bits(dx, download<float>(d_dx, dx.size()), "rmsnorm dx " + at);
    expect_same_bits(dw, download<float>(d_dw, dw.size()), "rmsnorm dw " + at);
  }
}

TEST(CudaLlama, SwiGluMatchesTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (int64_t I : {1, 77, 1000})
  for (int64_t N : {1, 13, 37}) {
    const std::string at = "I=" + std::to_string(I) + " N=" + std::to_string(N);
    std::vector<float> gu = randn(N * 2 * I, 111, 4.0), dout = randn(N * I, 112);
    gu[0] = 40.0f;  // sigmoid saturates at 1 (gate 0 of row 0) ...
    gu[N * 2 * I - 1] = -40.0f;  // ... and an up value far out
    if (I > 1) gu[1] = -95.0f;   // exp_f's clamp
    std::vector<float> out(N * I), dgu(gu.size());
    swiglu_forward(out.data(), gu.data(), N, I);
    swiglu_backward(dgu.data(), dout.data(), gu.data(), N, I);
    DeviceBuffer d_gu = upload(gu), d_dout = upload(dout), d_out(N * I * 4), d_dgu(gu.size() * 4);
    cuda::swiglu_forward(d_out.as<float>(), d_gu.as<float>(), N, I, nullptr);
    cuda::swiglu_backward(d_dgu.as<float>(), d_dout.as<float>(), d_gu.as<float>(), N, I, nullptr);
    expect_same_bits(out, download<float>(d_out, out.size()), "swiglu " + at);
    expect_same_bits(dgu, download<float>(d_dgu, dgu.size()), "swiglu backward " + at);
  }
}

TEST(CudaLlama, GeGluExactGeluAndSoftcapMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (int64_t I : {1, 77, 1000})
  for (int64_t N : {1, 13, 37}) {
    const std::string at = "I=" + std::to_string(I) + " N=" + std::to_string(N);
    std::vector<float> gu = randn(N * 2 * I, 121, 4.0), dout = randn(N * I, 122);
    gu[0] = 40.0f;                // tanh saturates ...
    if (I > 1) gu[1] = -95.0f;    // ... and exp_f's clamp
    std::vector<float> out(N * I), dgu(gu.size());
    geglu_forward(out.data(), gu.data(), N, I);
    geglu_backward(dgu.data(), dout.data(), gu.data(), N, I);
    DeviceBuffer d_gu = upload(gu), d_dout = upload(dout), d_out(N * I * 4), d_dgu(gu.size() * 4);
    cuda::geglu_forward(d_out.as<float>(), d_gu.as<float>(), N, I, nullptr);
    cuda::geglu_backward(d_dgu.as<float>(), d_dout.as<float>(), d_gu.as<float>(), N, I, nullptr);
    expect_same_bits(out, download<float>(d_out, out.size()), "geglu " + at);
    expect_same_bits(dgu, download<float>(d_dgu, dgu.size()), "geglu backward " + at);
    // Exact GELU (GPT-NeoX) of the same values.
    std::vector<float> ge(gu.size()), dge(gu.size());
    gelu_erf_forward(ge.data(), gu.data(), static_cast<int64_t>(gu.size()));
    gelu_erf_backward(dge.data(), gu.data(), gu.data(), static_cast<int64_t>(gu.size()));
    DeviceBuffer d_ge(gu.size() * 4), d_dge(gu.size() * 4);
    cuda::gelu_erf_forward(d_ge.as<float>(), d_gu.as<float>(), static_cast<int64_t>(gu.size()), nullptr);
    cuda::gelu_erf_backward(d_dge.as<float>(), d_gu.as<float>(), d_gu.as<float>(), static_cast<int64_t>(gu.size()),
                            nullptr);
    expect_same_bits(ge, download<float>(d_ge, ge.size()), "gelu_erf " + at);
    expect_same_bits(dge, download<float>(d_dge, dge.size()), "gelu_erf backward " + at);
    // Soft-capping of the same values (30: Gemma 2's final cap; 0.5: bites hard).
    for (float cap : {30.0f, 0.5f}) {
      std::vector<float> y = gu, dy = gu;
      softcap_forward(y.data(), cap, static_cast<int64_t>(y.size()));
      softcap_backward(dy.data(), y.data(), cap, static_cast<int64_t>(y.size()));
      DeviceBuffer d_y = upload(gu), d_dy = upload(gu);
      cuda::softcap_forward(d_y.as<float>(), cap, static_cast<int64_t>(y.size()), nullptr);
      cuda::softcap_backward(d_dy.as<float>(), d_y.as<float>(), cap, static_cast<int64_t>(y.size()), nullptr);
      expect_same_bits(y, download<float>(d_y, y.size()), "softcap " + at);
      expect_same_bits(dy, download<float>(d_dy, dy.size()), "softcap backward " + at);
    }
  }
}

// The kernels take the (T, hd/2) cos and sin tables and know nothing of rope
// scaling: the model folds it into the inverse frequencies. These tables
// follow models/llama/model.cpp's rope_inv_freq for each rope_scaling type (none,
// "linear" and "llama3"), so the kernels see the angles a scaled model gives them.
enum class Scaling { kNone, kLinear, kLlama3 };

void rope_tables(int64_t T, int64_t hd, Scaling scaling, std::vector<float>& c, std::vector<float>& s) {
  const int64_t h = hd / 2;
  std::vector<float> inv(static_cast<size_t>(h));
  for (int64_t i = 0; i < h; ++i)
    inv[i] = 1.0f / std::pow(500000.0f, static_cast<float>(2 * i) / static_cast<float>(hd));
  const float factor = 8.0f, old_len = 16.0f, lo = 1.0f, hi = 4.0f;  // a context short enough to reach the bands
  for (float& f : inv) {
    if (scaling == Scaling::kLinear) {
      f = f / factor;
    } else if (scaling == Scaling::kLlama3) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      const float g = wavelen > old_len / lo ? f / factor : f;
      const float smooth = (old_len / wavelen - lo) / (hi - lo);
      const bool medium = !(wavelen < old_len / hi) && !(wavelen > old_len / lo);
      f = medium ? (1.0f - smooth) * g / factor + smooth * g : g;
    }
  }
  c.resize(static_cast<size_t>(T * h));
  s.resize(c.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < h; ++i) {
      const float angle = static_cast<float>(t) * inv[i];
      c[t * h + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      s[t * h + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
}

// A fused projection row [q (H heads) | k (Hkv) | v (Hkv)], rotated as the
// model does: q, k, and q and k together; forward and inverse. head_dim 2
// and 38 and 10 leave the last lanes of a warp partly idle (h = 1, 19, 5).
// Note [fused 16-bit operands]: RMSNorm (alone and after the residual) and
// the gated activations writing the next matmul's 16-bit operand give the
// CPU kernel's output rounded by convert_f32_to_16, every element written
// (the buffers start as a pattern no rounding gives).
TEST(CudaLlama, FusedSixteenBitOperandsMatchTheKernelThenTheConversion) {
  ZINC_REQUIRE_GPU();
  for (DType t : {DType::kBF16, DType::kF16}) {
    for (int64_t C : {1, 17, 133})
    for (int64_t N : {29, 2113})
    for (float off : {0.0f, 1.0f}) {
      const std::string at = "C=" + std::to_string(C) + " N=" + std::to_string(N) + " " + std::string(dtype_name(t));
      std::vector<float> x = randn(N * C, 121, 2.0), w = randn(C, 122, 0.5), res = randn(N * C, 123);
      Param pw(w, DType::kBF16);
      std::vector<float> out(N * C), rstd(N), sum(N * C);
      rmsnorm_forward(out.data(), rstd.data(), x.data(), pw.host(), N, C, 1e-6f, off);
      DeviceBuffer d_x = upload(x), d16 = filled16(N * C), d_rstd(N * 4);
      cuda::rmsnorm_forward_16(d16.data(), t, d_rstd.as<float>(), d_x.as<float>(), nullptr, pw.dev(), N, C, 1e-6f,
                               nullptr, off);
      ASSERT_EQ(rounded16(out, t), download<uint16_t>(d16, out.size())) << "rmsnorm_forward_16 " << at;
      expect_same_bits(rstd, download<float>(d_rstd, N), "rmsnorm_forward_16 rstd " + at);
      expect_same_bits(x, download<float>(d_x, x.size()), "rmsnorm_forward_16 leaves x " + at);
      add(sum.data(), x.data(), res.data(), N * C);
      rmsnorm_forward(out.data(), rstd.data(), sum.data(), pw.host(), N, C, 1e-6f, off);
      DeviceBuffer d_res = upload(res), e16 = filled16(N * C);
      cuda::rmsnorm_forward_16(e16.data(), t, d_rstd.as<float>(), d_x.as<float>(), d_res.as<float>(), pw.dev(), N, C,
                               1e-6f, nullptr, off);
      expect_same_bits(sum, download<float>(d_x, sum.size()), "add_rmsnorm_forward_16 x " + at);
      ASSERT_EQ(rounded16(out, t), download<uint16_t>(e16, out.size())) << "add_rmsnorm_forward_16 " << at;
      expect_same_bits(rstd, download<float>(d_rstd, N), "add_rmsnorm_forward_16 rstd " + at);
    }
    for (int64_t I : {1, 77, 1000})
    for (int64_t N : {1, 37})
    for (bool gelu : {false, true}) {
      std::vector<float> gu = randn(N * 2 * I, 124, 4.0), out(N * I);
      if (gelu)
        geglu_forward(out.data(), gu.data(), N, I);
      else
        swiglu_forward(out.data(), gu.data(), N, I);
      DeviceBuffer d_gu = upload(gu), d16 = filled16(N * I);
      cuda::gated_forward_16(d16.data(), t, d_gu.as<float>(), N, I, gelu, nullptr);
      ASSERT_EQ(rounded16(out, t), download<uint16_t>(d16, out.size()))
          << (gelu ? "geglu" : "swiglu") << " I=" << I << " N=" << N << " " << dtype_name(t);
    }
  }
}

TEST(CudaLlama, RopeMatchesTheCpuBits) {
  ZINC_REQUIRE_GPU();
  struct Case {
    int64_t B, T, H, Hkv, hd;
  };
  for (Case k : {Case{1, 1, 1, 1, 2}, Case{2, 7, 3, 1, 10}, Case{3, 33, 4, 2, 38}, Case{1, 40, 8, 2, 64}})
  for (Scaling scaling : {Scaling::kNone, Scaling::kLinear, Scaling::kLlama3}) {
    std::vector<float> c, s;
    rope_tables(k.T, k.hd, scaling, c, s);
    DeviceBuffer d_c = upload(c), d_s = upload(s);
    const int64_t W = (k.H + 2 * k.Hkv) * k.hd;
    // ... and partial rotary embeddings (both sides read the tables as (T, rotary_dim/2)).
    for (RopeShape sh : {RopeShape{k.B, k.T, W, 0, k.H, k.hd}, RopeShape{k.B, k.T, W, k.H * k.hd, k.Hkv, k.hd},
                         RopeShape{k.B, k.T, W, 0, k.H + k.Hkv, k.hd},
                         RopeShape{k.B, k.T, W, 0, k.H + k.Hkv, k.hd, nullptr, k.hd / 2 + (k.hd / 2) % 2}})
    for (bool inverse : {false, true}) {
      const std::string at = "B=" + std::to_string(k.B) + " T=" + std::to_string(k.T) + " hd=" + std::to_string(k.hd) +
                             " col=" + std::to_string(sh.col) + " heads=" + std::to_string(sh.heads) +
                             " scaling=" + std::to_string(static_cast<int>(scaling)) + (inverse ? " inverse" : "");
      std::vector<float> x = randn(k.B * k.T * W, 121, 3.0);
      DeviceBuffer d_x = upload(x);
      rope(x.data(), c.data(), s.data(), sh, inverse);
      cuda::rope(d_x.as<float>(), d_c.as<float>(), d_s.as<float>(), sh, inverse, nullptr);
      expect_same_bits(x, download<float>(d_x, x.size()), "rope " + at);  // untouched columns included
    }
  }
  float* none = nullptr;
  EXPECT_THROW(cuda::rope(none, none, none, RopeShape{1, 1, 10, 0, 1, 9}, false, nullptr), Error);
  EXPECT_THROW(cuda::rope(none, none, none, RopeShape{1, 1, 10, 2, 1, 10}, false, nullptr), Error);
  cuda::rope(none, none, none, RopeShape{0, 5, 10, 0, 1, 10}, false, nullptr);  // no rows: nothing launched
}

// Packed documents: each token rotated by its position in its document
// (documents of length 1 and longer than a warp, different in each row).
TEST(CudaLlama, RopeWithPositionsMatchesTheCpuBits) {
  ZINC_REQUIRE_GPU();
  struct Case {
    int64_t B, T, H, Hkv, hd;
  };
  for (Case k : {Case{1, 1, 1, 1, 2}, Case{2, 7, 3, 1, 10}, Case{3, 41, 4, 2, 38}})
  for (Scaling scaling : {Scaling::kNone, Scaling::kLlama3}) {
    std::vector<float> c, s;
    rope_tables(k.T, k.hd, scaling, c, s);
    const std::vector<int32_t> pos = zinc::cuda::testing::packed_positions(k.B, k.T);
    DeviceBuffer d_c = upload(c), d_s = upload(s), d_pos = upload(pos);
    const int64_t W = (k.H + 2 * k.Hkv) * k.hd;
    for (bool inverse : {false, true}) {
      const std::string at = "B=" + std::to_string(k.B) + " T=" + std::to_string(k.T) + " hd=" + std::to_string(k.hd) +
                             " scaling=" + std::to_string(static_cast<int>(scaling)) + (inverse ? " inverse" : "");
      std::vector<float> x = randn(k.B * k.T * W, 122, 3.0);
      DeviceBuffer d_x = upload(x);
      RopeShape sh{k.B, k.T, W, 0, k.H + k.Hkv, k.hd, pos.data()};
      rope(x.data(), c.data(), s.data(), sh, inverse);
      sh.positions = d_pos.as<int32_t>();
      cuda::rope(d_x.as<float>(), d_c.as<float>(), d_s.as<float>(), sh, inverse, nullptr);
      expect_same_bits(x, download<float>(d_x, x.size()), "rope with positions " + at);
    }
  }
}

// GQA ratios 1, 2 and 4 (and 3), head_dim under, over and not a multiple of
// the lane width. The outputs start as NaN on the device and 7 on the host:
// every element is written on both sides.
TEST(CudaLlama, GroupedQueryHeadsMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (auto [H, Hkv] : {std::pair<int64_t, int64_t>{4, 4}, {4, 2}, {8, 2}, {6, 2}, {4, 1}})
  for (int64_t hd : {1, 6, 38, 64})
  for (int64_t N : {1, 31}) {
    const std::string at = "H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) + " hd=" + std::to_string(hd) +
                           " N=" + std::to_string(N);
    std::vector<float> in = randn(N * (H + 2 * Hkv) * hd, 131), d = randn(N * 3 * H * hd, 132);
    std::vector<float> out(d.size(), 7.0f), red(in.size(), 7.0f);
    gqa_expand(out.data(), in.data(), N, H, Hkv, hd);
    gqa_reduce(red.data(), d.data(), N, H, Hkv, hd);
    DeviceBuffer d_in = upload(in), d_d = upload(d), d_out(d.size() * 4), d_red(in.size() * 4);
    std::vector<float> nan(d.size(), std::nanf(""));
    zinc::cuda::copy_to_device(d_out.data(), nan.data(), nan.size() * 4);
    zinc::cuda::copy_to_device(d_red.data(), nan.data(), in.size() * 4);
    cuda::gqa_expand(d_out.as<float>(), d_in.as<float>(), N, H, Hkv, hd, nullptr);
    cuda::gqa_reduce(d_red.as<float>(), d_d.as<float>(), N, H, Hkv, hd, nullptr);
    expect_same_bits(out, download<float>(d_out, out.size()), "gqa_expand " + at);
    expect_same_bits(red, download<float>(d_red, red.size()), "gqa_reduce " + at);
  }
  float* none = nullptr;
  EXPECT_THROW(cuda::gqa_expand(none, none, 1, 3, 2, 2, nullptr), Error);
  EXPECT_THROW(cuda::gqa_reduce(none, none, 1, 4, 0, 2, nullptr), Error);
}

// The column block copy the Qwen3 graph moves heads with (copy_columns).
TEST(CudaLlama, CopyColumnsMatchesTheCpu) {
  ZINC_REQUIRE_GPU();
  for (auto [N, width, src_W, dst_W] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 1, 1, 1}, {7, 12, 60, 12},
                                         {33, 24, 24, 40}, {5, 17, 19, 23}}) {
    const std::string at = "N=" + std::to_string(N) + " width=" + std::to_string(width);
    const std::vector<float> src = randn(N * src_W, 141);
    std::vector<float> dst(static_cast<size_t>(N * dst_W), 7.0f);
    copy_columns(dst.data() + 1 % dst_W, dst_W, src.data() + (src_W - width), src_W, N,
                 std::min(width, dst_W - 1 % dst_W));
    DeviceBuffer d_src = upload(src), d_dst = upload(std::vector<float>(dst.size(), 7.0f));
    cuda::copy_columns(d_dst.as<float>() + 1 % dst_W, dst_W, d_src.as<float>() + (src_W - width), src_W, N,
                       std::min(width, dst_W - 1 % dst_W), nullptr);
    expect_same_bits(dst, download<float>(d_dst, dst.size()), "copy_columns " + at);
  }
}

// LoRA's dropout (Note [dropout masks] in math.h): the same mask and values
// as the CPU's, written and accumulated.
TEST(CudaLlama, DropoutMatchesTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (auto [n, p] : {std::pair<int64_t, float>{1, 0.5f}, {1000, 0.1f}, {4099, 0.3f}}) {
    const std::string at = "n=" + std::to_string(n) + " p=" + std::to_string(p);
    const std::vector<float> x = randn(n, 151);
    for (bool acc : {false, true}) {
      std::vector<float> out = randn(n, 152);
      DeviceBuffer d_x = upload(x), d_out = upload(out);
      dropout(out.data(), x.data(), n, p, 0x1234567890abcdefULL, acc);
      cuda::dropout(d_out.as<float>(), d_x.as<float>(), n, p, 0x1234567890abcdefULL, acc, nullptr);
      expect_same_bits(out, download<float>(d_out, out.size()), "dropout " + at);
    }
  }
  // A tensor part's column window of a wider input's mask (DropoutColumns).
  const int64_t rows = 33, cols = 40;
  const std::vector<float> x = randn(rows * cols, 153);
  for (bool acc : {false, true}) {
    std::vector<float> out = randn(rows * cols, 154);
    DeviceBuffer d_x = upload(x), d_out = upload(out);
    const DropoutColumns w{cols, 3 * cols, cols};
    dropout(out.data(), x.data(), rows * cols, 0.2f, 99, acc, w);
    cuda::dropout(d_out.as<float>(), d_x.as<float>(), rows * cols, 0.2f, 99, acc, nullptr, w);
    expect_same_bits(out, download<float>(d_out, out.size()), "dropout's column window");
  }
}

}  // namespace
}  // namespace zinc::kernels

namespace zinc::kernels {
namespace {

using zinc::cuda::DeviceBuffer;

// The mixture-of-experts kernels (moe.cu) against the CPU's bits: the
// router and its backward (with and without renormalising, with an
// aux-loss gradient), the gather, the combine and both backward maps, on
// the CPU's grouping (kernels::moe_group, host code on either backend).
TEST(CudaMoe, RouterGatherAndCombineMatchTheCpuBits) {
  ZINC_REQUIRE_GPU();
  for (auto [N, E, k, C] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{1, 4, 2, 3}, {37, 8, 2, 33},
                            {130, 64, 6, 17}}) {
    for (bool renorm : {true, false}) {
      const std::string at = "N=" + std::to_string(N) + " E=" + std::to_string(E) + " k=" + std::to_string(k) +
                             (renorm ? " renormalised" : "");
      auto logits = randn(N * E, 131, 3.0), dw = randn(N * k, 132), dp = randn(E, 133);
      std::vector<float> probs(N * E), weight(N * k), dl(N * E);
      std::vector<int32_t> expert(N * k);
      moe_route(logits.data(), N, E, k, renorm, probs.data(), expert.data(), weight.data());
      moe_route_backward(probs.data(), expert.data(), weight.data(), dw.data(), dp.data(), N, E, k, renorm, dl.data());
      DeviceBuffer d_l = upload(logits), d_p(N * E * 4), d_e(N * k * 4), d_w(N * k * 4), d_dw = upload(dw),
                   d_dp = upload(dp), d_dl(N * E * 4);
      cuda::moe_route(d_l.as<float>(), N, E, k, renorm, d_p.as<float>(), d_e.as<int32_t>(), d_w.as<float>(), nullptr);
      cuda::moe_route_backward(d_p.as<float>(), d_e.as<int32_t>(), d_w.as<float>(), d_dw.as<float>(),
                               d_dp.as<float>(), N, E, k, renorm, d_dl.as<float>(), nullptr);
      expect_same_bits(probs, download<float>(d_p, probs.size()), "moe probs " + at);
      expect_same_bits(weight, download<float>(d_w, weight.size()), "moe weights " + at);
      EXPECT_EQ(expert, download<int32_t>(d_e, expert.size())) << "moe experts " + at;
      expect_same_bits(dl, download<float>(d_dl, dl.size()), "moe dlogits " + at);
    }
    std::vector<float> probs(N * E), weight(N * k);
    std::vector<int32_t> expert(N * k), token_of_row(N * k), row_of_slot(N * k);
    auto logits = randn(N * E, 134, 3.0);
    moe_route(logits.data(), N, E, k, true, probs.data(), expert.data(), weight.data());
    std::vector<int64_t> offsets(E + 1);
    moe_group(expert.data(), N, k, E, offsets.data(), token_of_row.data(), row_of_slot.data());
    const int64_t M = N * k;
    auto x = randn(N * C, 135), y = randn(M * C, 136), dout = randn(N * C, 137), dxg = randn(M * C, 138);
    std::vector<float> xg(M * C), out(N * C), dy(M * C), dwt(N * k), dx = randn(N * C, 139);
    moe_gather(xg.data(), x.data(), token_of_row.data(), M, C);
    moe_combine(out.data(), y.data(), weight.data(), row_of_slot.data(), N, k, C);
    moe_combine_backward(dy.data(), dwt.data(), dout.data(), y.data(), weight.data(), row_of_slot.data(), N, k, C);
    DeviceBuffer d_x = upload(x), d_y = upload(y), d_dout = upload(dout), d_dxg = upload(dxg), d_dx = upload(dx),
                 d_w = upload(weight), d_tor = upload(token_of_row), d_ros = upload(row_of_slot), d_xg(M * C * 4),
                 d_out(N * C * 4), d_dy(M * C * 4), d_dwt(N * k * 4);
    moe_gather_backward(dx.data(), dxg.data(), row_of_slot.data(), N, k, C);
    cuda::moe_gather(d_xg.as<float>(), d_x.as<float>(), d_tor.as<int32_t>(), M, C, nullptr);
    cuda::moe_combine(d_out.as<float>(), d_y.as<float>(), d_w.as<float>(), d_ros.as<int32_t>(), N, k, C, nullptr);
    cuda::moe_combine_backward(d_dy.as<float>(), d_dwt.as<float>(), d_dout.as<float>(), d_y.as<float>(),
                               d_w.as<float>(), d_ros.as<int32_t>(), N, k, C, nullptr);
    cuda::moe_gather_backward(d_dx.as<float>(), d_dxg.as<float>(), d_ros.as<int32_t>(), N, k, C, nullptr);
    const std::string at = "N=" + std::to_string(N) + " E=" + std::to_string(E);
    expect_same_bits(xg, download<float>(d_xg, xg.size()), "moe gather " + at);
    expect_same_bits(out, download<float>(d_out, out.size()), "moe combine " + at);
    expect_same_bits(dy, download<float>(d_dy, dy.size()), "moe combine dy " + at);
    expect_same_bits(dwt, download<float>(d_dwt, dwt.size()), "moe combine dweight " + at);
    expect_same_bits(dx, download<float>(d_dx, dx.size()), "moe gather backward " + at);
  }
}

}  // namespace
}  // namespace zinc::kernels
