// OptimizerSwapper on its own: sub-group layout, the pipelined round trip of
// master weights and moments through NVMe (a real file, io_uring, O_DIRECT
// where the file system allows it), and I/O failures surfacing as IoError.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "core/alloc.h"
#include "core/error.h"
#include "offload/offload.h"
#include "offload/swapper.h"
#include "temp_dir.h"

namespace zinc::offload {
namespace {

SwapperOptions options(const std::string& dir, int64_t sub_group, int64_t buffers) {
  SwapperOptions o;
  o.nvme.path = dir;
  o.nvme.block_size = 8192;
  o.sub_group_size = sub_group;
  o.buffer_count = buffers;
  return o;
}

// Spans are multiples of 1024 elements, as the engine's partitions are.
const std::vector<int64_t> kSpans = {3072, 1024, 5120};

std::vector<float> initial(int block, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(block * 100000 + i);
  return v;
}

TEST(Swapper, SubGroupsTileEverySpanInOrder) {
  TempDir dir;
  OptimizerSwapper s(options(dir.path(), 2500, 2), 0, kSpans);  // 2500 -> 2048 elements
  const auto& g = s.sub_groups();
  // block 0: 2048 + 1024; block 1: 1024; block 2: 2048 + 2048 + 1024.
  ASSERT_EQ(g.size(), 6u);
  int64_t file = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_EQ(g[i].file_offset, file) << i;
    EXPECT_EQ(g[i].count % 1024, 0) << i;
    file += 3 * g[i].count * 4;
  }
  for (int b = 0; b < 3; ++b) {
    int64_t covered = 0;
    for (const auto& sg : g)
      if (sg.block == b) {
        EXPECT_EQ(sg.offset, covered);
        covered += sg.count;
      }
    EXPECT_EQ(covered, kSpans[b]) << "block " << b;
  }
}

TEST(Swapper, UpdatesRoundTripThroughTheFileForAnyBufferCount) {
  for (int64_t buffers : {2, 3, 5}) {
    TempDir dir;
    OptimizerSwapper s(options(dir.path(), 2048, buffers), 0, kSpans);
    for (int b = 0; b < 3; ++b) s.init_block(b, initial(b, kSpans[b]).data());
    // First pass: the initial master, zero moments; write an update.
    int visited = 0;
    s.for_each([&](const OptimizerSwapper::SubGroup& g, float* master, float* m, float* v, const float*) {
      const std::vector<float> want = initial(g.block, kSpans[g.block]);
      for (int64_t i = 0; i < g.count; ++i) {
        ASSERT_EQ(master[i], want[g.offset + i]) << "block " << g.block << " element " << g.offset + i;
        ASSERT_EQ(m[i], 0.0f);
        ASSERT_EQ(v[i], 0.0f);
        master[i] += 0.5f;
        m[i] = static_cast<float>(g.offset + i);
        v[i] = -static_cast<float>(g.block);
      }
      ++visited;
    });
    EXPECT_EQ(visited, static_cast<int>(s.sub_groups().size()));
    // Second pass sees the update of the first.
    s.for_each([&](const OptimizerSwapper::SubGroup& g, float* master, float* m, float* v, const float*) {
      const std::vector<float> want = initial(g.block, kSpans[g.block]);
      for (int64_t i = 0; i < g.count; ++i) {
        ASSERT_EQ(master[i], want[g.offset + i] + 0.5f) << "buffers " << buffers;
        ASSERT_EQ(m[i], static_cast<float>(g.offset + i));
        ASSERT_EQ(v[i], -static_cast<float>(g.block));
      }
    });
    std::vector<float> out(static_cast<size_t>(kSpans[2]));
    s.read_master(2, out.data());
    const std::vector<float> want = initial(2, kSpans[2]);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], want[i] + 0.5f) << i;
    // Two full passes each read and write every sub-group once.
    const int64_t state_bytes = (3072 + 1024 + 5120) * 12;
    EXPECT_GE(s.bytes_written(), 3 * state_bytes);  // init + two passes
    EXPECT_GE(s.bytes_read(), 2 * state_bytes);
  }
}

// Gradients (ZeRO-3 with the optimizer on NVMe): each block's gradient,
// written from an aligned or a heap (64-byte aligned) buffer, comes back
// beside its sub-group's states; a pass that does not ask for them gets
// none, and the states are unaffected.
TEST(Swapper, GradientsComeBackWithTheirSubGroups) {
  for (int64_t buffers : {2, 4}) {
    TempDir dir;
    SwapperOptions o = options(dir.path(), 2048, buffers);
    o.gradients = true;
    OptimizerSwapper s(o, 0, kSpans);
    ASSERT_TRUE(s.keeps_gradients());
    EXPECT_EQ(OptimizerSwapper::plan(o, kSpans).grad_file_bytes, (3072 + 1024 + 5120) * 4);
    for (int b = 0; b < 3; ++b) s.init_block(b, initial(b, kSpans[b]).data());
    auto grad_of = [](int block, int64_t i) { return 0.25f * static_cast<float>(i) - static_cast<float>(block); };
    for (int b = 0; b < 3; ++b) {
      const int64_t n = kSpans[b];
      // Block 1 from a page-aligned buffer, the others one float past an
      // aligned start (not 4 KiB-aligned: copied through a staging page).
      const int64_t shift = b == 1 ? 0 : 1;
      AlignedBuffer buf(static_cast<size_t>(n + 1024) * 4, kPageAlign);
      float* g = buf.as<float>() + shift;
      for (int64_t i = 0; i < n; ++i) g[i] = grad_of(b, i);
      s.write_gradients(b, g);
    }
    int visited = 0;
    s.for_each(
        [&](const OptimizerSwapper::SubGroup& g, float* master, float*, float*, const float* grad) {
          ASSERT_NE(grad, nullptr);
          const std::vector<float> want = initial(g.block, kSpans[g.block]);
          for (int64_t i = 0; i < g.count; ++i) {
            ASSERT_EQ(grad[i], grad_of(g.block, g.offset + i)) << "block " << g.block << " element " << g.offset + i;
            ASSERT_EQ(master[i], want[g.offset + i]);
            master[i] -= grad[i];
          }
          ++visited;
        },
        /*write_back=*/true, /*read=*/true, /*grads=*/true);
    EXPECT_EQ(visited, static_cast<int>(s.sub_groups().size()));
    s.for_each(
        [&](const OptimizerSwapper::SubGroup& g, float* master, float*, float*, const float* grad) {
          EXPECT_EQ(grad, nullptr);
          const std::vector<float> want = initial(g.block, kSpans[g.block]);
          for (int64_t i = 0; i < g.count; ++i)
            ASSERT_EQ(master[i], want[g.offset + i] - grad_of(g.block, g.offset + i)) << "buffers " << buffers;
        },
        /*write_back=*/false);
  }
}

TEST(Swapper, WithoutGradientsThereAreNone) {
  TempDir dir;
  OptimizerSwapper s(options(dir.path(), 2048, 2), 0, kSpans);
  EXPECT_FALSE(s.keeps_gradients());
  EXPECT_EQ(OptimizerSwapper::plan(options(dir.path(), 2048, 2), kSpans).grad_file_bytes, 0);
  s.for_each([](const OptimizerSwapper::SubGroup&, float*, float*, float*, const float* grad) { EXPECT_EQ(grad, nullptr); },
             /*write_back=*/false, /*read=*/true, /*grads=*/true);
}

// A gradient write that fails (the disk is full) is an IoError naming the
// gradients file, on the thread that wrote, and the states are untouched.
TEST(Swapper, FailedGradientWriteIsAnIoErrorNamingTheFile) {
  TempDir dir;
  SwapperOptions o = options(dir.path(), 2048, 2);
  o.gradients = true;
  // The gradient store is the one without registered buffers.
  o.engine_factory = [](const NvmeOptions& opt) {
    std::unique_ptr<IoEngine> e = make_uring_engine(opt);
    return opt.fixed_buffers.empty() ? make_faulty_engine(std::move(e), 0, ENOSPC) : std::move(e);
  };
  OptimizerSwapper s(o, 0, kSpans);
  for (int b = 0; b < 3; ++b) s.init_block(b, initial(b, kSpans[b]).data());
  AlignedBuffer g(static_cast<size_t>(kSpans[0]) * 4, kPageAlign);
  try {
    s.write_gradients(0, g.as<float>());
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("gradients"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  std::vector<float> out(static_cast<size_t>(kSpans[2]));
  s.read_master(2, out.data());
  EXPECT_EQ(out, initial(2, kSpans[2]));
}

TEST(Swapper, FailedReadEndsThePassWithIoError) {
  TempDir dir;
  SwapperOptions o = options(dir.path(), 1024, 2);
  // 9 sub-groups of 1024 elements, 12 KiB each, in 8 KiB requests: the init
  // writes take 18 operations of the one ring; the 19th, the first read of
  // the pass, fails with EIO.
  o.engine_factory = [](const NvmeOptions& opt) { return make_faulty_engine(make_uring_engine(opt), 18, EIO); };
  OptimizerSwapper s(o, 0, kSpans);
  for (int b = 0; b < 3; ++b) s.init_block(b, initial(b, kSpans[b]).data());
  try {
    s.for_each([](const OptimizerSwapper::SubGroup&, float*, float*, float*, const float*) {});
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("read of "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("optimizer_states"), std::string::npos) << e.what();
  }
}

TEST(Swapper, MissingFolderIsAnErrorNamingIt) {
  try {
    OptimizerSwapper s(options("/nonexistent/zinc-nvme", 1024, 2), 0, kSpans);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/zinc-nvme"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zinc::offload
