// OptimizerState on its own, for every place the state can live (RAM, pinned
// RAM, NVMe through the swapper): the visitor covers every block's span once,
// in block order, with the initial master and zero moments; what it leaves is
// kept; read_master returns it; and the memory it holds is accounted.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <vector>

#include "engine/optimizer_state.h"

namespace zinc {
namespace {

const std::vector<int64_t> kSpans = {2048, 1024, 4096};

float init_value(int block, int64_t i) { return static_cast<float>(block) * 10000.0f + static_cast<float>(i); }

class OptimizerStatePlaces : public testing::TestWithParam<OffloadDevice> {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "zinc-optstate-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string dir_;
};

TEST_P(OptimizerStatePlaces, VisitorSeesEverySpanAndKeepsWhatItLeaves) {
  offload::SwapperOptions nvme;
  nvme.nvme.path = dir_;
  nvme.sub_group_size = 1024;  // several sub-groups per block on NVMe
  nvme.buffer_count = 3;
  StateMemory memory;
  auto state = make_optimizer_state(GetParam(), kSpans, false, nvme, 0, memory);
  EXPECT_GT(memory.bytes(), 0);
  for (int b = 0; b < 3; ++b) {
    std::vector<float> w(static_cast<size_t>(kSpans[b]));
    for (int64_t i = 0; i < kSpans[b]; ++i) w[i] = init_value(b, i);
    state->init_block(b, w.data());
    EXPECT_EQ(state->master_in_memory(b) == nullptr, GetParam() == OffloadDevice::kNvme);
  }
  std::vector<int64_t> covered(3, 0);
  int last_block = 0;
  state->for_each([&](const StateSpan& sp) {
    EXPECT_GE(sp.block, last_block);  // block order
    last_block = sp.block;
    EXPECT_EQ(sp.offset, covered[sp.block]);  // contiguous, no overlap
    covered[sp.block] += sp.count;
    for (int64_t i = 0; i < sp.count; ++i) {
      ASSERT_EQ(sp.master[i], init_value(sp.block, sp.offset + i));
      ASSERT_EQ(sp.m[i], 0.0f);
      ASSERT_EQ(sp.v[i], 0.0f);
      sp.master[i] = -sp.master[i];
      sp.m[i] = 1.0f;
      sp.v[i] = 2.0f;
    }
  });
  EXPECT_EQ(covered, kSpans);
  state->for_each([&](const StateSpan& sp) {
    for (int64_t i = 0; i < sp.count; ++i) {
      ASSERT_EQ(sp.master[i], -init_value(sp.block, sp.offset + i));
      ASSERT_EQ(sp.m[i], 1.0f);
      ASSERT_EQ(sp.v[i], 2.0f);
    }
  });
  std::vector<float> out(static_cast<size_t>(kSpans[2]));
  state->read_master(2, out.data());
  for (int64_t i = 0; i < kSpans[2]; ++i) ASSERT_EQ(out[i], -init_value(2, i));
  EXPECT_EQ(state->bytes_read() > 0, GetParam() == OffloadDevice::kNvme);
}

INSTANTIATE_TEST_SUITE_P(Engine, OptimizerStatePlaces,
                         testing::Values(OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme),
                         [](const testing::TestParamInfo<OffloadDevice>& i) {
                           return std::string(offload_device_name(i.param));
                         });

}  // namespace
}  // namespace zinc
