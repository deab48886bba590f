// The safetensors reader: round trips through the writer, the committed
// Hugging Face fixtures, hand-written F16, and every kind of hostile file
// (each failure one zinc::Error that starts with the file at fault and says
// what is wrong).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "tools/safetensors.h"
#include "tools/safetensors_read.h"

namespace zinc::tools {
namespace {
namespace fs = std::filesystem;

const std::string kFixtures = std::string(ZINC_SOURCE_DIR) + "/tests/fixtures/hf";

// A fresh, empty folder for one test.
std::string fresh_dir(const std::string& name) {
  const std::string dir = testing::TempDir() + "/st_read_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A safetensors file from a header's JSON text as given (lies included) and
// its data bytes.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// Runs fn, which must throw one zinc::Error whose message starts with
// `path` and contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::string& path, std::vector<std::string> parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(path, 0), 0u) << "message does not start with " << path << ": " << msg;
    for (char c : msg) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "not one line of printable text: " << msg;
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "no '" << p << "' in: " << msg;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a zinc::Error: " << e.what();
    return;
  }
  ADD_FAILURE() << "no error for " << path;
}

void expect_open_error(const std::string& path, std::vector<std::string> parts) {
  expect_error([&] { SafetensorsFile f(path); }, path, std::move(parts));
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 3.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(SafetensorsRead, RoundTripsWriterF32AndBf16WithPartialReadsAtOddOffsets) {
  const std::string path = fresh_dir("roundtrip") + "/m.safetensors";
  const std::vector<float> a = random_floats(3 * 5, 1);
  const std::vector<float> b32 = random_floats(7 * 3, 2);
  std::vector<bf16> b(b32.size());
  convert_f32_to_bf16(b32.data(), b.data(), b.size());
  const std::vector<float> c = {42.5f};
  {
    SafetensorsWriter w(path,
                        {{"a.weight", DType::kF32, {3, 5}},
                         {"b", DType::kBF16, {7, 3}},
                         {"empty", DType::kF32, {4, 0}},
                         {"scalar", DType::kF32, {}}},
                        {{"format", "pt"}, {"note", "x"}});
    w.append(a.data(), a.size() * 4);
    w.append(b.data(), b.size() * 2);
    w.append(c.data(), 4);
    w.finish();
  }
  const SafetensorsFile f(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "x"}}));
  ASSERT_EQ(f.tensors().size(), 4u);
  for (size_t i = 1; i < f.tensors().size(); ++i) EXPECT_LE(f.tensors()[i - 1].begin, f.tensors()[i].begin);
  EXPECT_EQ(f.find("missing"), nullptr);
  const StoredTensor* ta = f.find("a.weight");
  const StoredTensor* tb = f.find("b");
  ASSERT_TRUE(ta && tb);
  EXPECT_EQ(ta->dtype, DType::kF32);
  EXPECT_EQ(ta->stored_dtype, "F32");
  EXPECT_TRUE(ta->readable);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(ta->numel(), 15);
  EXPECT_EQ(ta->bytes(), 60);
  EXPECT_EQ(tb->dtype, DType::kBF16);
  EXPECT_EQ(tb->numel(), 21);
  EXPECT_EQ(tb->begin, ta->end);
  EXPECT_EQ(f.find("empty")->numel(), 0);
  EXPECT_EQ(f.find("scalar")->numel(), 1);

  // Every (first, count) of both tensors, bit for bit.
  for (const StoredTensor* t : {ta, tb}) {
    const int64_t n = t->numel();
    for (int64_t first = 0; first <= n; ++first) {
      for (int64_t count = 0; first + count <= n; ++count) {
        std::vector<float> out(static_cast<size_t>(count) + 1, -7.f);
        f.read_f32(*t, first, count, out.data());
        for (int64_t i = 0; i < count; ++i) {
          const float want =
              t == ta ? a[static_cast<size_t>(first + i)] : bf16_to_float(b[static_cast<size_t>(first + i)]);
          ASSERT_EQ(std::memcmp(&out[static_cast<size_t>(i)], &want, 4), 0) << t->name << " " << first << "+" << i;
        }
        ASSERT_EQ(out[static_cast<size_t>(count)], -7.f) << "wrote past count";
      }
    }
  }
  float s = 0;
  f.read_f32(*f.find("scalar"), 0, 1, &s);
  EXPECT_EQ(s, 42.5f);
  f.read_f32(*f.find("empty"), 0, 0, nullptr);
  // A copy of an entry reads like the entry.
  const StoredTensor copy = *tb;
  float x = 0;
  f.read_f32(copy, 20, 1, &x);
  EXPECT_EQ(x, bf16_to_float(b[20]));
}

TEST(SafetensorsRead, ReadsTensorsLargerThanOnePieceAcrossPieceBoundaries) {
  const std::string path = fresh_dir("large") + "/big.safetensors";
  const size_t n32 = (size_t{3} << 20) / 2 + 3, n16 = (size_t{5} << 20) / 2 + 1;  // 6 MiB and 5 MiB
  std::vector<float> a(n32), b32(n16);
  for (size_t i = 0; i < n32; ++i) a[i] = static_cast<float>(i) * 0.25f;
  for (size_t i = 0; i < n16; ++i) b32[i] = static_cast<float>(i % 256) - 128.f;  // exact in bf16
  std::vector<bf16> b(n16);
  convert_f32_to_bf16(b32.data(), b.data(), n16);
  {
    SafetensorsWriter w(
        path, {{"a", DType::kF32, {static_cast<int64_t>(n32)}}, {"b", DType::kBF16, {static_cast<int64_t>(n16)}}}, {});
    w.append(a.data(), n32 * 4);
    w.append(b.data(), n16 * 2);
    w.finish();
  }
  const SafetensorsFile f(path);
  std::vector<float> out(n16);
  f.read_f32(*f.find("a"), 0, static_cast<int64_t>(n32), out.data());
  EXPECT_EQ(std::memcmp(out.data(), a.data(), n32 * 4), 0);
  f.read_f32(*f.find("a"), 1000001, 520003, out.data());
  EXPECT_EQ(std::memcmp(out.data(), a.data() + 1000001, 520003 * 4), 0);
  f.read_f32(*f.find("b"), 3, static_cast<int64_t>(n16) - 3, out.data());
  for (size_t i = 3; i < n16; ++i) ASSERT_EQ(out[i - 3], b32[i]) << i;
}

TEST(SafetensorsRead, WidensHandWrittenF16Exactly) {
  const std::string path = fresh_dir("f16") + "/h.safetensors";
  // 1, -2, 65504 (largest), 2^-24 (smallest subnormal), -0, +Inf, a NaN, 0.333...
  const std::vector<uint16_t> bits = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x8000, 0x7c00, 0x7e01, 0x3555};
  std::string data(reinterpret_cast<const char*>(bits.data()), bits.size() * 2);
  const std::string header = R"({"h":{"dtype":"F16","shape":[2,4],"data_offsets":[0,16]}})";
  write_bytes(path, raw_file(header, data));
  const SafetensorsFile f(path);
  const StoredTensor* t = f.find("h");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::kF16);
  std::vector<float> out(8);
  f.read_f32(*t, 0, 8, out.data());
  EXPECT_EQ(out[0], 1.f);
  EXPECT_EQ(out[1], -2.f);
  EXPECT_EQ(out[2], 65504.f);
  EXPECT_EQ(out[3], std::ldexp(1.f, -24));
  EXPECT_TRUE(out[4] == 0.f && std::signbit(out[4]));
  EXPECT_TRUE(std::isinf(out[5]) && out[5] > 0);
  EXPECT_TRUE(std::isnan(out[6]));
  for (size_t i = 0; i < bits.size(); ++i) {
    const float want = f16_to_float(f16{bits[i]});
    EXPECT_EQ(std::memcmp(&out[i], &want, 4), 0) << i;
  }
  float one = 0;
  f.read_f32(*t, 7, 1, &one);
  EXPECT_EQ(one, f16_to_float(f16{0x3555}));
}

// The raw bytes of a fixture tensor, widened by hand, against read_f32.
void expect_matches_raw(const SafetensorsFile& f, const StoredTensor& t) {
  const std::string bytes = read_bytes(f.path()).substr(static_cast<size_t>(t.begin), static_cast<size_t>(t.bytes()));
  std::vector<float> want(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::kF32) {
    std::memcpy(want.data(), bytes.data(), bytes.size());
  } else {
    for (size_t i = 0; i < want.size(); ++i) {
      uint16_t v;
      std::memcpy(&v, bytes.data() + 2 * i, 2);
      want[i] = from_16(v, t.dtype);
    }
  }
  std::vector<float> got(want.size());
  f.read_f32(t, 0, t.numel(), got.data());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0) << t.name;
  bool nonzero = false;
  for (float v : got) nonzero = nonzero || v != 0.f;
  EXPECT_TRUE(nonzero) << t.name;
}

TEST(SafetensorsRead, ReadsFixtureLlamaGqaFp32) {
  const SafetensorsFile f(kFixtures + "/llama_gqa/model.safetensors");
  const StoredTensor* k = f.find("model.layers.0.self_attn.k_proj.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->shape, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(k->stored_dtype, "F32");
  EXPECT_EQ(f.find("model.embed_tokens.weight")->shape, (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.tensors().back().end, f.file_bytes());
  expect_matches_raw(f, *k);
  const SafetensorsFolder folder(kFixtures + "/llama_gqa");
  ASSERT_EQ(folder.files().size(), 1u);
  EXPECT_TRUE(folder.index().empty());
  EXPECT_EQ(folder.names().size(), f.tensors().size());
  EXPECT_EQ(folder.find("model.layers.0.self_attn.k_proj.weight").second->shape, k->shape);
}

TEST(SafetensorsRead, ReadsFixtureQwen2TiedBf16) {
  const SafetensorsFile f(kFixtures + "/qwen2_tied/model.safetensors");
  ASSERT_FALSE(f.tensors().empty());
  for (const StoredTensor& t : f.tensors()) {
    EXPECT_EQ(t.dtype, DType::kBF16) << t.name;
    EXPECT_TRUE(t.readable);
  }
  const StoredTensor* e = f.find("model.embed_tokens.weight");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->shape, (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(f.find("lm_head.weight"), nullptr);  // tied: the embedding only
  expect_matches_raw(f, *e);
  expect_matches_raw(f, f.tensors().back());
}

TEST(SafetensorsRead, ReadsFixtureGpt2ShardedFolder) {
  const std::string dir = kFixtures + "/gpt2";
  const SafetensorsFolder folder(dir);
  EXPECT_EQ(folder.index(), dir + "/model.safetensors.index.json");
  ASSERT_EQ(folder.files().size(), 4u);
  EXPECT_EQ(folder.files()[0], dir + "/model-00001-of-00004.safetensors");
  const nlohmann::json index = nlohmann::json::parse(read_bytes(folder.index()));
  std::vector<std::string> want;
  for (const auto& [name, shard] : index.at("weight_map").items()) want.push_back(name);
  EXPECT_EQ(folder.names(), want);  // sorted, as nlohmann's object is
  auto [file, t] = folder.find("transformer.h.0.attn.c_attn.weight");
  ASSERT_TRUE(file && t);
  EXPECT_EQ(file->path(), dir + "/model-00001-of-00004.safetensors");
  EXPECT_EQ(t->shape, (std::vector<int64_t>{32, 96}));
  expect_matches_raw(*file, *t);
  auto [file4, t4] = folder.find("transformer.h.1.mlp.c_proj.weight");
  ASSERT_TRUE(file4 && t4);
  EXPECT_EQ(file4->path(), dir + "/model-00004-of-00004.safetensors");
  EXPECT_EQ(folder.find("nope").first, nullptr);
  EXPECT_EQ(folder.find("nope").second, nullptr);
}

TEST(SafetensorsRead, UnreadableDtypesListButRefuseToRead) {
  // The fixtures' reference file holds I32 token ids next to F32 values.
  const std::string ref = kFixtures + "/gpt2/reference.safetensors";
  const SafetensorsFile r(ref);
  const StoredTensor* ids = nullptr;
  for (const StoredTensor& t : r.tensors())
    if (t.stored_dtype == "I32") ids = &t;
  ASSERT_NE(ids, nullptr);
  EXPECT_FALSE(ids->readable);
  std::vector<float> out(static_cast<size_t>(ids->numel()));
  expect_error([&] { r.read_f32(*ids, 0, 1, out.data()); }, ref,
               {"tensor " + ids->name + " is I32; zinc reads F32, BF16 and F16"});

  const std::string path = fresh_dir("dtypes") + "/d.safetensors";
  nlohmann::json h = nlohmann::json::object();
  int64_t at = 0;
  for (auto [name, size] : std::vector<std::pair<std::string, int>>{
           {"F64", 8}, {"I64", 8}, {"I32", 4}, {"I8", 1}, {"U8", 1}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}}) {
    h["t_" + name] = {{"dtype", name}, {"shape", {3}}, {"data_offsets", {at, at + 3 * size}}};
    at += 3 * size;
  }
  write_bytes(path, raw_file(h.dump(), std::string(static_cast<size_t>(at), '\0')));
  const SafetensorsFile f(path);
  EXPECT_EQ(f.tensors().size(), 8u);
  float x[3];
  expect_error([&] { f.read_f32(*f.find("t_F64"), 0, 3, x); }, path,
               {"tensor t_F64 is F64; zinc reads F32, BF16 and F16"});
  expect_error([&] { f.read_f32(*f.find("t_BOOL"), 0, 3, x); }, path, {"is BOOL;"});
}

TEST(SafetensorsRead, ReadsOutsideTheTensorAreCallerBugs) {
  const std::string path = fresh_dir("bounds") + "/b.safetensors";
  const float v[4] = {1, 2, 3, 4};
  write_bytes(path, raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                             std::string(reinterpret_cast<const char*>(v), 16)));
  const SafetensorsFile f(path);
  const StoredTensor& a = *f.find("a");
  float out[8];
  expect_error([&] { f.read_f32(a, 1, 2, out); }, path, {"tensor a", "outside its 2 elements", "caller bug"});
  expect_error([&] { f.read_f32(a, -1, 1, out); }, path, {"outside", "caller bug"});
  expect_error([&] { f.read_f32(a, 0, -1, out); }, path, {"outside", "caller bug"});
  expect_error([&] { f.read_f32(a, 1, std::numeric_limits<int64_t>::max(), out); }, path, {"outside"});
  StoredTensor foreign = a;
  foreign.begin += 4;
  foreign.end += 4;
  expect_error([&] { f.read_f32(foreign, 0, 1, out); }, path, {"not an entry of this file"});
  f.read_f32(a, 1, 1, out);
  EXPECT_EQ(out[0], 2.f);
}

TEST(SafetensorsRead, RejectsShortAndTruncatedFiles) {
  const std::string dir = fresh_dir("truncated");
  write_bytes(dir + "/empty.safetensors", "");
  expect_open_error(dir + "/empty.safetensors", {"0 bytes, shorter than the 8-byte header length"});
  write_bytes(dir + "/five.safetensors", "abcde");
  expect_open_error(dir + "/five.safetensors", {"5 bytes, shorter than the 8-byte header length"});

  const std::string good = dir + "/good.safetensors";
  const std::vector<float> a = random_floats(64, 3);
  {
    SafetensorsWriter w(good, {{"a", DType::kF32, {8, 8}}}, {{"format", "pt"}});
    w.append(a.data(), a.size() * 4);
    w.finish();
  }
  const std::string bytes = read_bytes(good);
  const size_t data_start = bytes.size() - 256;
  write_bytes(dir + "/cut_header.safetensors", bytes.substr(0, 30));
  expect_open_error(
      dir + "/cut_header.safetensors",
      {"header length " + std::to_string(data_start - 8) + " is more than the 22 bytes after it", "truncated"});
  write_bytes(dir + "/cut_data.safetensors", bytes.substr(0, bytes.size() - 5));
  expect_open_error(dir + "/cut_data.safetensors",
                    {"tensor a", "data_offsets [0, 256] end past the data section's 251 bytes", "truncated"});
  write_bytes(dir + "/cut_all_data.safetensors", bytes.substr(0, data_start));
  expect_open_error(dir + "/cut_all_data.safetensors", {"end past the data section's 0 bytes"});

  // Truncated after it was opened: the read fails, it never returns short.
  const std::string later = dir + "/later.safetensors";
  write_bytes(later, bytes);
  const SafetensorsFile f(later);
  ASSERT_EQ(::truncate(later.c_str(), static_cast<off_t>(data_start + 100)), 0);
  std::vector<float> out(64);
  expect_error([&] { f.read_f32(*f.find("a"), 0, 64, out.data()); }, later,
               {"the file ends at byte " + std::to_string(data_start + 100)});
  f.read_f32(*f.find("a"), 0, 25, out.data());  // the part still there reads
  EXPECT_EQ(out[24], a[24]);
}

TEST(SafetensorsRead, RejectsAbsurdHeaderLengthsWithoutAllocating) {
  const std::string dir = fresh_dir("huge");
  for (uint64_t n : {uint64_t{100'000'001}, uint64_t{1} << 40, ~uint64_t{0}}) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
    bytes += "{}";
    const std::string path = dir + "/h" + std::to_string(n) + ".safetensors";
    write_bytes(path, bytes);
    expect_open_error(path, {"header length " + std::to_string(n) + " is over the limit of 100000000 bytes"});
  }
}

struct BadHeader {
  const char* what;
  std::string header;
  size_t data_bytes;
  std::vector<std::string> parts;
};

TEST(SafetensorsRead, RejectsEveryKindOfBadHeader) {
  const std::string dir = fresh_dir("bad_headers");
  const std::string ok_b = R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]})";
  const std::vector<BadHeader> cases = {
      {"not_json", "{\"a\": ", 0, {"the header is not valid JSON", "parse error"}},
      {"garbage", "\xff\xfe\x00garbage", 0, {"the header is not valid JSON"}},
      {"empty_header", "", 0, {"the header is not valid JSON"}},
      {"array", "[1,2,3]", 0, {"the header is a JSON array, not an object"}},
      {"duplicate",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       4,
       {"the header has the key a twice"}},
      {"entry_not_object", R"({"a":[1,2]})", 0, {"tensor a: the entry is a JSON array, not an object"}},
      {"no_dtype", R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4, {"tensor a: the entry has no dtype"}},
      {"no_shape", R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4, {"tensor a: the entry has no shape"}},
      {"no_offsets", R"({"a":{"dtype":"F32","shape":[1]}})", 4, {"tensor a: the entry has no data_offsets"}},
      {"dtype_number",
       R"({"a":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})",
       4,
       {"tensor a: dtype is a JSON number, not a string"}},
      {"unknown_dtype",
       R"({"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})",
       4,
       {"tensor a: unknown dtype F31", "F32, BF16"}},
      {"shape_string",
       R"({"a":{"dtype":"F32","shape":"2x2","data_offsets":[0,16]}})",
       16,
       {"tensor a: shape is a JSON string, not an array"}},
      {"shape_float",
       R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,16]}})",
       16,
       {"tensor a: shape [2.5] holds a value that is not an integer"}},
      {"negative_dim",
       R"({"a":{"dtype":"F32","shape":[4,-1],"data_offsets":[0,16]}})",
       16,
       {"tensor a: shape [4, -1] has a negative dimension"}},
      {"huge_dim",
       R"({"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,16]}})",
       16,
       {"has a dimension beyond int64"}},
      {"numel_overflow",
       R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})",
       16,
       {"tensor a: shape [4294967296, 4294967296] of F32 overflows int64"}},
      {"bytes_overflow",
       R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,16]}})",
       16,
       {"overflows int64"}},
      {"subbyte",
       R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})",
       2,
       {"tensor a: shape [3] of F4 is not a whole number of bytes"}},
      {"offsets_one",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4]}})",
       4,
       {"tensor a: data_offsets [4] is not two non-negative integers"}},
      {"offsets_three",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})",
       8,
       {"data_offsets [0, 4, 8] is not two"}},
      {"offsets_negative",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})",
       4,
       {"data_offsets [-4, 0] is not two non-negative integers"}},
      {"offsets_float",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})",
       4,
       {"is not two non-negative integers"}},
      {"offsets_string",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":"0:4"}})",
       4,
       {"is not two non-negative integers"}},
      {"offsets_huge",
       R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})",
       4,
       {"is not two non-negative integers"}},
      {"offsets_reversed",
       R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})",
       4,
       {"tensor a: data_offsets [4, 0] end before they begin"}},
      {"past_end",
       "{" + ok_b + R"(,"a":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}})",
       24,
       {"tensor a: data_offsets [16, 32] end past the data section's 24 bytes"}},
      {"wrong_size",
       R"({"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,16]}})",
       16,
       {"tensor a: data_offsets [0, 16] hold 16 bytes, but shape [2, 3] of BF16 needs 12"}},
      {"overlap",
       "{" + ok_b + R"(,"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})",
       16,
       {"tensors a [0, 12) and b [8, 16) overlap"}},
      {"overlap_inside",
       R"({"big":{"dtype":"F32","shape":[8],"data_offsets":[0,32]},)"
       R"("small":{"dtype":"F32","shape":[1],"data_offsets":[28,32]}})",
       32,
       {"tensors big [0, 32) and small [28, 32) overlap"}},
      {"same_bytes",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8,
       {"tensors a [0, 8) and b [0, 8) overlap"}},
      {"metadata_array", R"({"__metadata__":["pt"]})", 0, {"__metadata__ is a JSON array, not an object of strings"}},
      {"metadata_number",
       R"({"__metadata__":{"format":"pt","steps":12}})",
       0,
       {"__metadata__ entry steps is a JSON number, not a string"}},
      {"odd_name",
       R"({"a\nb":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})",
       8,
       {R"(tensor "a\nb": data_offsets)"}},
  };
  for (const BadHeader& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string path = dir + "/" + c.what + ".safetensors";
    write_bytes(path, raw_file(c.header, std::string(c.data_bytes, '\x11')));
    expect_open_error(path, c.parts);
  }
}

// The data section holds the tensors back to back and nothing else, as the
// safetensors library requires: it refuses a hole before a tensor
// ("invalid offset for tensor `b`") and bytes after the last ("incomplete
// metadata, file not fully covered"); an empty tensor may share an offset.
TEST(SafetensorsRead, RefusesHolesAndTrailingBytesAndReadsEmptyTensorsAndDeepJsonSafely) {
  const std::string dir = fresh_dir("odd_but_fine");
  const float v[4] = {1, 2, 3, 4};
  const std::string path = dir + "/empty.safetensors";
  write_bytes(path, raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]},)"
                             R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                             std::string(reinterpret_cast<const char*>(v), 16)));
  const SafetensorsFile f(path);
  ASSERT_EQ(f.tensors().size(), 3u);
  float out[2];
  f.read_f32(*f.find("b"), 0, 2, out);
  EXPECT_EQ(out[0], 3.f);
  EXPECT_EQ(out[1], 4.f);
  const std::string gap = dir + "/gap.safetensors";
  write_bytes(gap, raw_file(R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                            std::string(reinterpret_cast<const char*>(v), 16)));
  expect_open_error(gap, {"tensor b begins at byte 8", "bytes no tensor covers"});
  const std::string trailing = dir + "/trailing.safetensors";
  write_bytes(trailing, raw_file(R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                                 std::string(reinterpret_cast<const char*>(v), 8) + "trailing"));
  expect_open_error(trailing, {"8 bytes after the last tensor's data", "bytes appended"});
  // A deeply nested header is an error, not a stack overflow.
  const std::string deep = dir + "/deep.safetensors";
  write_bytes(deep, raw_file(R"({"a":{"dtype":"F32","data_offsets":[0,0],"shape":)" + std::string(200000, '[') +
                                 std::string(200000, ']') + "}}",
                             ""));
  expect_open_error(deep, {"tensor a: shape", "holds a value that is not an integer"});
  // Not a regular file.
  expect_open_error(dir, {"not a regular file"});
  expect_error([&] { SafetensorsFile f2(dir + "/absent.safetensors"); }, dir + "/absent.safetensors",
               {"cannot open", "No such file"});
}

// A sharded folder of two files, written with the writer, and its index.
void write_shards(const std::string& dir, const nlohmann::json& weight_map) {
  const float v[6] = {1, 2, 3, 4, 5, 6};
  for (const char* name : {"s1.safetensors", "s2.safetensors"}) {
    const bool first = name[1] == '1';
    SafetensorsWriter w(dir + "/" + name,
                        first ? std::vector<SafeTensor>{{"x", DType::kF32, {2}}, {"y", DType::kF32, {1}}}
                              : std::vector<SafeTensor>{{"z", DType::kF32, {3}}},
                        {{"format", "pt"}});
    w.append(v, 12);
    w.finish();
  }
  write_bytes(dir + "/model.safetensors.index.json",
              nlohmann::json({{"metadata", {{"total_size", 24}}}, {"weight_map", weight_map}}).dump());
}

TEST(SafetensorsRead, FolderReadsShardsItsIndexNames) {
  const std::string dir = fresh_dir("folder_ok");
  write_shards(dir, {{"x", "s1.safetensors"}, {"y", "s1.safetensors"}, {"z", "s2.safetensors"}});
  const SafetensorsFolder f(dir);
  EXPECT_EQ(f.names(), (std::vector<std::string>{"x", "y", "z"}));
  EXPECT_EQ(f.files(), (std::vector<std::string>{dir + "/s1.safetensors", dir + "/s2.safetensors"}));
  auto [file, t] = f.find("z");
  ASSERT_TRUE(file && t);
  float out[3];
  file->read_f32(*t, 0, 3, out);
  EXPECT_EQ(out[2], 3.f);
}

TEST(SafetensorsRead, FolderRejectsBadIndexesAndShards) {
  {
    const std::string dir = fresh_dir("folder_empty");
    expect_error([&] { SafetensorsFolder f(dir); }, dir,
                 {"neither model.safetensors nor model.safetensors.index.json"});
    expect_error([&] { SafetensorsFolder f(dir + "/nope"); }, dir + "/nope", {"not a folder"});
  }
  {
    const std::string dir = fresh_dir("folder_bad_json");
    write_bytes(dir + "/model.safetensors.index.json", "{\"weight_map\": {");
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
                 {"the index is not valid JSON"});
    write_bytes(dir + "/model.safetensors.index.json", R"({"metadata": {}})");
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
                 {"the index has no weight_map"});
    write_bytes(dir + "/model.safetensors.index.json", R"({"weight_map": ["a"]})");
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
                 {"weight_map is a JSON array, not an object"});
    write_bytes(dir + "/model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
                 {"maps tensor a to a JSON number, not a file name"});
    write_bytes(dir + "/model.safetensors.index.json",
                R"({"weight_map": {"a": "s.safetensors", "a": "t.safetensors"}})");
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
                 {"the index has the key a twice"});
  }
  {
    const std::string dir = fresh_dir("folder_missing_shard");
    write_shards(dir, {{"x", "s1.safetensors"}, {"y", "s1.safetensors"}, {"z", "s3.safetensors"}});
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/s3.safetensors",
                 {"no such file", dir + "/model.safetensors.index.json", "for 1 tensors (z)"});
  }
  for (const char* shard : {"../s1.safetensors", "..", "sub/s1.safetensors", "/etc/passwd", ""}) {
    const std::string dir = fresh_dir("folder_escape");
    write_shards(dir, {{"x", "s1.safetensors"}, {"y", shard}, {"z", "s2.safetensors"}});
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
                 {"maps tensor y to", "not a plain file name in the folder"});
  }
  {
    const std::string dir = fresh_dir("folder_not_in_shard");
    write_shards(dir, {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}, {"z", "s2.safetensors"}});
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
                 {"maps tensor y to " + dir + "/s2.safetensors, which does not contain it",
                  "(it is in " + dir + "/s1.safetensors)"});
    write_shards(dir, {{"x", "s1.safetensors"}, {"w", "s2.safetensors"}, {"z", "s2.safetensors"}});
    expect_error(
        [&] { SafetensorsFolder f(dir); }, dir + "/model.safetensors.index.json",
        {"maps tensor w to " + dir + "/s2.safetensors, which does not contain it (no file of the folder does)"});
  }
  {
    const std::string dir = fresh_dir("folder_twice");
    write_shards(dir, {{"x", "s1.safetensors"}, {"y", "s1.safetensors"}, {"z", "s2.safetensors"}});
    const float v[1] = {9};
    SafetensorsWriter w(dir + "/s2.safetensors", {{"x", DType::kF32, {1}}}, {});  // x again, in s2
    w.append(v, 4);
    w.finish();
    write_bytes(
        dir + "/model.safetensors.index.json",
        nlohmann::json({{"weight_map", {{"x", "s1.safetensors"}, {"y", "s1.safetensors"}, {"x2", "s2.safetensors"}}}})
            .dump());
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/s2.safetensors",
                 {"tensor x is also in " + dir + "/s1.safetensors", "two files"});
  }
  {
    // A bad shard's own error names the shard.
    const std::string dir = fresh_dir("folder_bad_shard");
    write_shards(dir, {{"x", "s1.safetensors"}, {"y", "s1.safetensors"}, {"z", "s2.safetensors"}});
    write_bytes(dir + "/s2.safetensors", "short");
    expect_error([&] { SafetensorsFolder f(dir); }, dir + "/s2.safetensors", {"shorter than the 8-byte header"});
  }
}

}  // namespace
}  // namespace zinc::tools
