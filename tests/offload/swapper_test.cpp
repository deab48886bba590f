// OptimizerSwapper on its own: sub-group layout, the pipelined round trip of
// master weights and moments through NVMe (a real file, io_uring, O_DIRECT
// where the file system allows it), and I/O failures surfacing as IoError.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

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
    s.for_each([&](const OptimizerSwapper::SubGroup& g, float* master, float* m, float* v) {
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
    s.for_each([&](const OptimizerSwapper::SubGroup& g, float* master, float* m, float* v) {
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
    s.for_each([](const OptimizerSwapper::SubGroup&, float*, float*, float*) {});
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
