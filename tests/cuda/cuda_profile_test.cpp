// The GPU profile (Note [the GPU profile] in csrc/kernels/gpu_profile.cu):
// each kernel call counted once under its kind, a call inside another
// counted as its own kind (the outer one's time without it), a stream's
// span split exactly into time inside calls and outside them, streams and
// threads kept apart, and nothing recorded while it is off.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>
#include <vector>

#include "kernels/gpu_profile.h"
#include "kernels/kernels_cuda.h"
#include "tests/cuda/cuda_test_util.h"

namespace zinc::kernels::cuda {
namespace {

using zinc::cuda::DeviceBuffer;
using zinc::cuda::testing::randn;
using zinc::cuda::testing::upload;

// The profile is process-wide: each test starts it empty and leaves it off.
struct ProfileOn {
  explicit ProfileOn(bool on = true) {
    ZINC_CUDA_CHECK(cudaDeviceSynchronize(), "test: sync");
    gpu_profile_enable(false);
    gpu_profile_reset();
    gpu_profile_enable(on);
  }
  ~ProfileOn() {
    gpu_profile_enable(false);
    cudaDeviceSynchronize();
    gpu_profile_reset();
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { ZINC_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "test: stream"); }
  ~Stream() { cudaStreamDestroy(s); }
};

double total_gpu_s(const GpuProfileTotals& t) {
  double s = 0;
  for (double x : t.gpu_s) s += x;
  return s;
}

void expect_spans_add_up(const GpuProfileTotals& t) {
  double scoped = 0;
  for (const GpuStreamProfile& sp : t.streams) {
    EXPECT_NEAR(sp.span_s, sp.scoped_s + sp.outside_s, 1e-9 + 1e-6 * sp.span_s);
    EXPECT_GE(sp.scoped_s, 0);
    EXPECT_GE(sp.outside_s, 0);
    scoped += sp.scoped_s;
  }
  EXPECT_NEAR(total_gpu_s(t), scoped, 1e-9 + 1e-6 * scoped);
}

TEST(CudaProfile, OffRecordsNothing) {
  ZINC_REQUIRE_GPU();
  ProfileOn profile(false);
  Stream st;
  DeviceBuffer x = upload(randn(1000, 1));
  add(x.as<float>(), x.as<float>(), x.as<float>(), 1000, st.s);
  const GpuProfileTotals t = gpu_profile_read();
  for (int i = 0; i < kNumOps; ++i) EXPECT_EQ(t.calls[i], 0) << op_name(static_cast<Op>(i));
  EXPECT_TRUE(t.streams.empty());
}

TEST(CudaProfile, EachCallCountsOnceUnderItsKind) {
  ZINC_REQUIRE_GPU();
  ProfileOn profile;
  Stream st;
  const int64_t N = 37, C = 24;
  DeviceBuffer x = upload(randn(N * C, 2)), out(N * C * 4), mean(N * 4), rstd(N * 4);
  DeviceBuffer w = upload(randn(C, 3)), b = upload(randn(C, 4));
  for (int i = 0; i < 2; ++i)
    layernorm_forward(out.as<float>(), mean.as<float>(), rstd.as<float>(), x.as<float>(), {w.data(), DType::kF32},
                      {b.data(), DType::kF32}, N, C, st.s);
  for (int i = 0; i < 3; ++i) add(out.as<float>(), out.as<float>(), x.as<float>(), N * C, st.s);
  gelu_forward(out.as<float>(), x.as<float>(), N * C, st.s);
  const GpuProfileTotals t = gpu_profile_read();
  EXPECT_EQ(t.calls[static_cast<int>(Op::kLayerNorm)], 2);
  EXPECT_EQ(t.calls[static_cast<int>(Op::kVector)], 3);
  EXPECT_EQ(t.calls[static_cast<int>(Op::kGelu)], 1);
  EXPECT_EQ(t.calls[static_cast<int>(Op::kMatmul)], 0);
  ASSERT_EQ(t.streams.size(), 1u);
  EXPECT_EQ(t.streams[0].stream, st.s);
  EXPECT_EQ(t.streams[0].events, 12);  // an event where each call opens and one where it closes
  EXPECT_EQ(t.gpu_s[static_cast<int>(Op::kMatmul)], 0.0);
  for (Op op : {Op::kLayerNorm, Op::kVector, Op::kGelu}) {
    EXPECT_GT(t.gpu_s[static_cast<int>(op)], 0.0) << op_name(op);
    EXPECT_GT(t.host_s[static_cast<int>(op)], 0.0) << op_name(op);
  }
  expect_spans_add_up(t);
  // Read again: the same marks, the same totals.
  const GpuProfileTotals again = gpu_profile_read();
  EXPECT_EQ(again.calls[static_cast<int>(Op::kLayerNorm)], 2);
  EXPECT_DOUBLE_EQ(total_gpu_s(again), total_gpu_s(t));
  // A reset drops them.
  gpu_profile_reset();
  EXPECT_TRUE(gpu_profile_read().streams.empty());
}

// A call inside another (a matmul inside attention, here inside a scope of
// attention's kind opened by hand) counts as its own kind, and the outer
// one keeps only the time outside it: counted inclusively, attention
// would get at least the matmul's time.
TEST(CudaProfile, ANestedCallIsTheInnerKindsTime) {
  ZINC_REQUIRE_GPU();
  ProfileOn profile;
  Stream st;
#if defined(ZINC_CUDA_EMU)
  const int64_t n = 96;  // emulated: milliseconds
#else
  const int64_t n = 4096;  // about 0.2 ms on an H100, far above the host's microseconds between the marks
#endif
  std::vector<uint16_t> ones(static_cast<size_t>(n * n), float_to_16(1.0f, DType::kBF16));
  DeviceBuffer a = upload(ones), c(static_cast<size_t>(n * n) * 4);
  MatmulDesc d;
  d.M = d.N = d.K = n;
  d.compute = DType::kBF16;
  {
    GpuProfileScope outer(Op::kAttention, st.s);
    matmul(d, {a.data(), DType::kBF16}, {a.data(), DType::kBF16}, c.as<float>(), st.s);
  }
  const GpuProfileTotals t = gpu_profile_read();
  EXPECT_EQ(t.calls[static_cast<int>(Op::kAttention)], 1);
  EXPECT_EQ(t.calls[static_cast<int>(Op::kMatmul)], 1);
  const double att = t.gpu_s[static_cast<int>(Op::kAttention)], mm = t.gpu_s[static_cast<int>(Op::kMatmul)];
  EXPECT_GT(mm, 0.0);
  EXPECT_LT(att, mm) << "attention's scope holds the matmul's time";
  ASSERT_EQ(t.streams.size(), 1u);
  EXPECT_EQ(t.streams[0].events, 4);
  expect_spans_add_up(t);
  // And the product ran: every element is n.
  std::vector<float> h(static_cast<size_t>(n * n));
  ZINC_CUDA_CHECK(cudaStreamSynchronize(st.s), "test: sync");
  zinc::cuda::copy_to_host(h.data(), c.data(), h.size() * 4);
  EXPECT_EQ(h.front(), static_cast<float>(n));
  EXPECT_EQ(h.back(), static_cast<float>(n));
}

// Each stream's timeline is its own (two streams' events are never timed
// against each other), calls from another thread count, and a stream's
// time between calls is "outside".
TEST(CudaProfile, StreamsAndThreadsAreKeptApart) {
  ZINC_REQUIRE_GPU();
  ProfileOn profile;
  Stream s1, s2;
  DeviceBuffer x = upload(randn(4096, 5));
  float* p = x.as<float>();
  add(p, p, p, 4096, s1.s);
  scale(p, 0.5f, 4096, s1.s);
  std::thread other([&] { axpy(p, 2.0f, p, 4096, s1.s); });
  other.join();
  ZINC_CUDA_CHECK(cudaStreamSynchronize(s1.s), "test: sync");
  add(p, p, p, 4096, s2.s);
  const GpuProfileTotals t = gpu_profile_read();
  EXPECT_EQ(t.calls[static_cast<int>(Op::kVector)], 4);
  ASSERT_EQ(t.streams.size(), 2u);
  EXPECT_EQ(t.streams[0].stream, s1.s);
  EXPECT_EQ(t.streams[0].events, 6);  // this thread's 4 and the other's 2: two timelines of one stream
  EXPECT_EQ(t.streams[1].stream, s2.s);
  EXPECT_EQ(t.streams[1].events, 2);
  EXPECT_EQ(t.streams[1].outside_s, 0.0);  // one call: nothing between calls
  expect_spans_add_up(t);
}

// What the profile relies on, as CUDA documents it and the emulation does
// it: events made without timing refuse cudaEventElapsedTime, and a
// stream's events are timed in the order they run.
TEST(CudaProfile, EventTimesFollowTheStream) {
  ZINC_REQUIRE_GPU();
  Stream st;
  cudaEvent_t untimed = nullptr, e0 = nullptr, e1 = nullptr;
  ZINC_CUDA_CHECK(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming), "test: event");
  ZINC_CUDA_CHECK(cudaEventCreate(&e0), "test: event");
  ZINC_CUDA_CHECK(cudaEventCreate(&e1), "test: event");
  DeviceBuffer x = upload(randn(1 << 16, 6));
  ZINC_CUDA_CHECK(cudaEventRecord(untimed, st.s), "test: record");
  ZINC_CUDA_CHECK(cudaEventRecord(e0, st.s), "test: record");
  for (int i = 0; i < 4; ++i) add(x.as<float>(), x.as<float>(), x.as<float>(), 1 << 16, st.s);
  ZINC_CUDA_CHECK(cudaEventRecord(e1, st.s), "test: record");
  ZINC_CUDA_CHECK(cudaEventSynchronize(e1), "test: sync");
  float ms = -1;
  EXPECT_EQ(cudaEventElapsedTime(&ms, untimed, e1), cudaErrorInvalidResourceHandle);
  cudaGetLastError();  // clear it
  ASSERT_EQ(cudaEventElapsedTime(&ms, e0, e1), cudaSuccess);
  EXPECT_GT(ms, 0.0f);
  for (cudaEvent_t e : {untimed, e0, e1}) cudaEventDestroy(e);
}

}  // namespace
}  // namespace zinc::kernels::cuda
