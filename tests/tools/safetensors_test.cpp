// The safetensors writer's pieces that the Python round trip does not pin
// down one by one: the header's bytes, sizes with units, a short write.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tools/safetensors.h"

namespace zinc::tools {
namespace {

TEST(Safetensors, HeaderIsLengthPrefixedJsonPaddedToEightBytes) {
  const std::vector<SafeTensor> ts = {{"a", DType::kF32, {2, 3}}, {"b.weight", DType::kBF16, {5}}};
  const std::string h = safetensors_header(ts, {{"format", "pt"}});
  ASSERT_GE(h.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(h[static_cast<size_t>(i)]);
  EXPECT_EQ(n + 8, h.size());
  EXPECT_EQ(h.size() % 8, 0u);
  const nlohmann::json j = nlohmann::json::parse(h.substr(8));
  EXPECT_EQ(j["a"]["dtype"], "F32");
  EXPECT_EQ(j["a"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::json({0, 24}));
  EXPECT_EQ(j["b.weight"]["dtype"], "BF16");
  EXPECT_EQ(j["b.weight"]["data_offsets"], nlohmann::json({24, 34}));
  EXPECT_EQ(j["__metadata__"]["format"], "pt");
  EXPECT_THROW(safetensors_header({ts[0], ts[0]}, {}), Error);
}

TEST(Safetensors, WriterRenamesOnlyWhenEveryByteCame) {
  const std::string dir = testing::TempDir() + "/st_writer";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/x.safetensors";
  const float data[4] = {1, 2, 3, 4};
  {
    SafetensorsWriter w(path, {{"x", DType::kF32, {4}}}, {});
    w.append(data, 8);
    EXPECT_THROW(w.finish(), Error);  // 8 of 16 bytes
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(dir + "/.x.safetensors.zinc-tmp"));
  {
    SafetensorsWriter w(path, {{"x", DType::kF32, {4}}}, {});
    EXPECT_THROW(w.append(data, 20), Error);  // more than the header holds
    w.append(data, 16);
    w.finish();
  }
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_EQ(bytes.size() % 8, 0u);
  EXPECT_EQ(bytes.substr(bytes.size() - 16), std::string(reinterpret_cast<const char*>(data), 16));
}

TEST(Safetensors, SizesWithUnits) {
  EXPECT_EQ(parse_size("5GB", "s"), 5'000'000'000);
  // The default in its two spellings, the text --help shows and the bytes.
  EXPECT_EQ(parse_size(kDefaultMaxShardSize, "default"), kDefaultMaxShardBytes);
  EXPECT_EQ(parse_size("500MB", "s"), 500'000'000);
  EXPECT_EQ(parse_size("2GiB", "s"), int64_t{2} << 30);
  EXPECT_EQ(parse_size("1.5kb", "s"), 1500);
  EXPECT_EQ(parse_size("4096", "s"), 4096);
  for (const char* bad : {"", "GB", "5 parsecs", "-1GB", "0"}) {
    try {
      parse_size(bad, "--max-shard-size");
      ADD_FAILURE() << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--max-shard-size"), std::string::npos) << e.what();
    }
  }
  // Too large is said as too large, however many digits (400 of them
  // overflowed std::stod, an exception of another kind).
  const std::string digits400(400, '9');
  for (const std::string& big : {std::string("9223372036854775807"), std::string("18446744073709551615"), digits400,
                                 std::string("10000000TB")}) {
    try {
      parse_size(big, "--max-shard-size");
      ADD_FAILURE() << big;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is more than the largest size taken"), std::string::npos) << e.what();
    }
  }
  try {
    parse_size("0.5", "--max-shard-size");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'0.5' is less than 1 byte"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zinc::tools
