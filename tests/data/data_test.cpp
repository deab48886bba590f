// Tests for data/: the synthetic, text and token sources (the loader:
// loader_test.cpp).
#include "data/data.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace zinc {
namespace {

// ---------------------------------------------------------------------------
// Helpers.

// A file under the test temp dir, removed on destruction.
class TempFile {
 public:
  explicit TempFile(const std::string& name, const std::string& bytes = {})
      : path_(testing::TempDir() + "zinc_data_test_" + std::to_string(::getpid()) + "_" + name) {
    FILE* f = std::fopen(path_.c_str(), "wb");
    EXPECT_NE(f, nullptr) << path_;
    if (!f) return;
    if (!bytes.empty()) {
      EXPECT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    }
    std::fclose(f);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void put_u16(std::string& s, uint32_t v) {
  s.push_back(static_cast<char>(v & 0xff));
  s.push_back(static_cast<char>((v >> 8) & 0xff));
}
void put_i32(std::string& s, int32_t v) {
  auto u = static_cast<uint32_t>(v);
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
// The 1024-byte header of the GPT-2 training scripts' token files.
std::string token_header(int32_t version, int32_t count) {
  std::string s;
  put_i32(s, 20240520);
  put_i32(s, version);
  put_i32(s, count);
  s.resize(1024, '\0');
  return s;
}

// A token file (with a mask when `mask` is not empty) at seq_len T, the
// vocabulary its largest token + 1.
DataConfig tokens_cfg(const std::string& path, const std::string& mask, int64_t T) {
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = path;
  c.mask_path = mask;
  c.seq_len = T;
  c.vocab_size = 0;
  return c;
}

// The ConfigError opening `c` raises: its JSON path and message ("" when
// the open succeeds).
std::pair<std::string, std::string> open_error(const DataConfig& c) {
  try {
    make_data_source(c);
  } catch (const ConfigError& e) {
    return {e.path(), e.what()};
  }
  return {"", ""};
}

// n bytes of the alphabet over and over, and a text source's config.
std::string alphabet(int n) {
  std::string bytes;
  for (int i = 0; i < n; ++i) bytes.push_back(static_cast<char>('a' + i % 26));
  return bytes;
}
DataConfig text_cfg(const std::string& path, int64_t T, double eval_fraction) {
  DataConfig c;
  c.type = DataType::kText;
  c.path = path;
  c.seq_len = T;
  c.eval_fraction = eval_fraction;
  return c;
}

DataConfig synthetic_cfg(int64_t V, int64_t T, double p, uint64_t seed) {
  DataConfig c;
  c.type = DataType::kSynthetic;
  c.vocab_size = V;
  c.seq_len = T;
  c.determinism = p;
  c.seed = seed;
  return c;
}

struct Sample {
  std::vector<int32_t> inputs, targets;
};
Sample get_sample(const DataSource& s, int64_t index) {
  Sample out{std::vector<int32_t>(s.seq_len()), std::vector<int32_t>(s.seq_len())};
  s.sample(index, out.inputs.data(), out.targets.data());
  return out;
}

// ---------------------------------------------------------------------------
// Synthetic source.

TEST(SyntheticSource, SameSeedGivesSameSamples) {
  auto a = make_data_source(synthetic_cfg(16, 32, 0.8, 7));
  auto b = make_data_source(synthetic_cfg(16, 32, 0.8, 7));
  for (int64_t i : {0, 1, 5, 123456789}) {
    Sample x = get_sample(*a, i), y = get_sample(*b, i);
    EXPECT_EQ(x.inputs, y.inputs) << i;
    EXPECT_EQ(x.targets, y.targets) << i;
  }
  // Reading a sample twice (and out of order) gives the same tokens.
  EXPECT_EQ(get_sample(*a, 5).inputs, get_sample(*a, 5).inputs);
}

TEST(SyntheticSource, DifferentSeedOrIndexGivesDifferentSamples) {
  auto a = make_data_source(synthetic_cfg(16, 32, 0.8, 7));
  auto b = make_data_source(synthetic_cfg(16, 32, 0.8, 8));
  EXPECT_NE(get_sample(*a, 0).inputs, get_sample(*b, 0).inputs);
  EXPECT_NE(get_sample(*a, 0).inputs, get_sample(*a, 1).inputs);
}

TEST(SyntheticSource, TargetsAreInputsShiftedByOneAndInVocabulary) {
  auto s = make_data_source(synthetic_cfg(16, 32, 0.5, 3));
  for (int64_t i = 0; i < 20; ++i) {
    Sample x = get_sample(*s, i);
    for (int64_t t = 0; t + 1 < 32; ++t) EXPECT_EQ(x.targets[t], x.inputs[t + 1]);
    for (int64_t t = 0; t < 32; ++t) {
      EXPECT_GE(x.inputs[t], 0);
      EXPECT_LT(x.inputs[t], 16);
      EXPECT_GE(x.targets[t], 0);
      EXPECT_LT(x.targets[t], 16);
    }
  }
}

TEST(SyntheticSource, SeqLenOneHasOneTarget) {
  auto s = make_data_source(synthetic_cfg(8, 1, 0.9, 1));
  Sample x = get_sample(*s, 0);
  EXPECT_EQ(x.inputs.size(), 1u);
  EXPECT_NEAR(*s->loss_floor(), std::log(8.0), 1e-12);
}

TEST(SyntheticSource, DescribeNamesItsParameters) {
  auto s = make_data_source(synthetic_cfg(64, 256, 0.8, 1234));
  EXPECT_EQ(s->describe(), "synthetic(V=64, T=256, p=0.8, seed=1234)");
  EXPECT_EQ(s->vocab_size(), 64);
  EXPECT_EQ(s->seq_len(), 256);
  EXPECT_GE(s->num_samples(), int64_t{1} << 40);
}

TEST(SyntheticSource, FloorIsLogVWhenNothingIsDeterministic) {
  auto s = make_data_source(synthetic_cfg(64, 256, 0.0, 1));
  EXPECT_NEAR(*s->loss_floor(), std::log(64.0), 1e-12);
}

TEST(SyntheticSource, FloorIsOnlyTheFirstTargetWhenFullyDeterministic) {
  auto s = make_data_source(synthetic_cfg(64, 256, 1.0, 1));
  EXPECT_NEAR(*s->loss_floor(), std::log(64.0) / 256.0, 1e-12);
  EXPECT_TRUE(std::isfinite(*s->loss_floor()));
}

TEST(SyntheticSource, FloorMatchesClosedForm) {
  const double V = 64, T = 256, p = 0.8;
  const double q = p + (1 - p) / V, r = (1 - p) / V;
  const double h_c = -q * std::log(q) - (V - 1) * r * std::log(r);
  auto s = make_data_source(synthetic_cfg(64, 256, 0.8, 1));
  EXPECT_NEAR(*s->loss_floor(), (std::log(V) + (T - 1) * h_c) / T, 1e-12);
  EXPECT_LT(*s->loss_floor(), std::log(V));
}

// The empirical conditional entropy of x_t given (x_{t-2}, x_{t-1}) and the
// oracle's mean loss over all positions match the formula within sampling
// error.
TEST(SyntheticSource, EmpiricalEntropyMatchesFloor) {
  constexpr int V = 8;
  constexpr int64_t T = 32, kSamples = 16000;  // ~500k transitions
  const double p = 0.6;
  auto s = make_data_source(synthetic_cfg(V, T, p, 99));
  std::vector<std::array<int64_t, V>> counts(V * V);  // (context a*V+b) -> next-token counts
  for (auto& c : counts) c.fill(0);
  std::vector<Sample> samples;
  for (int64_t i = 0; i < kSamples; ++i) {
    Sample x = get_sample(*s, i);
    for (int64_t t = 1; t < T; ++t) counts[x.inputs[t - 1] * V + x.inputs[t]][x.targets[t]]++;
    samples.push_back(std::move(x));
  }
  // Plug-in conditional entropy (bias ~ contexts*(V-1)/(2n) ~ 5e-4 nats).
  const double r = (1 - p) / V, q = p + r;
  const double h_c = -q * std::log(q) - (V - 1) * r * std::log(r);
  double total = 0, h = 0;
  for (const auto& c : counts)
    for (int64_t n : c) total += static_cast<double>(n);
  std::vector<int> f(V * V);  // the table, recovered as the most frequent successor
  for (int ctx = 0; ctx < V * V; ++ctx) {
    double n_ctx = 0;
    for (int64_t n : counts[ctx]) n_ctx += static_cast<double>(n);
    ASSERT_GT(n_ctx, 1000);
    for (int64_t n : counts[ctx])
      if (n > 0) h -= (static_cast<double>(n) / total) * std::log(static_cast<double>(n) / n_ctx);
    f[ctx] = static_cast<int>(std::max_element(counts[ctx].begin(), counts[ctx].end()) -
                              counts[ctx].begin());
  }
  EXPECT_NEAR(h, h_c, 0.01);

  // The oracle's loss (uniform first target, then q on f / r elsewhere) over
  // samples it was not fitted on estimates the floor without bias.
  double loss = 0;
  int64_t positions = 0;
  for (int64_t i = kSamples; i < kSamples + 8000; ++i) {
    Sample x = get_sample(*s, i);
    loss += std::log(static_cast<double>(V));
    for (int64_t t = 1; t < T; ++t)
      loss -= std::log(x.targets[t] == f[x.inputs[t - 1] * V + x.inputs[t]] ? q : r);
    positions += T;
  }
  EXPECT_NEAR(loss / static_cast<double>(positions), *s->loss_floor(), 0.01);
}

TEST(SyntheticSource, RejectsBadParameters) {
  EXPECT_THROW(make_data_source(synthetic_cfg(1, 8, 0.5, 1)), ConfigError);
  EXPECT_THROW(make_data_source(synthetic_cfg(100000, 8, 0.5, 1)), ConfigError);
  EXPECT_THROW(make_data_source(synthetic_cfg(8, 8, 1.5, 1)), ConfigError);
  EXPECT_THROW(make_data_source(synthetic_cfg(8, 0, 0.5, 1)), ConfigError);
}

TEST(SyntheticSource, EvalSamplesAreDisjointFromTraining) {
  DataConfig c = synthetic_cfg(16, 32, 0.8, 7);
  auto train = make_data_source(c);
  auto eval = make_eval_data_source(c);
  ASSERT_NE(eval, nullptr);
  EXPECT_NE(get_sample(*train, 0).inputs, get_sample(*eval, 0).inputs);
  EXPECT_EQ(*train->loss_floor(), *eval->loss_floor());
}

// ---------------------------------------------------------------------------
// Text source.

TEST(TextSource, WindowsOverlapByOneByte) {
  TempFile f("text_windows.txt", "abcdefghij");  // 10 bytes, T = 3: (10-1)/3 = 3 samples
  DataConfig c;
  c.type = DataType::kText;
  c.path = f.path();
  c.seq_len = 3;
  auto s = make_data_source(c);
  EXPECT_EQ(s->vocab_size(), 256);
  ASSERT_EQ(s->num_samples(), 3);
  EXPECT_EQ(s->describe(), "text(" + f.path() + ", 10 bytes)");
  const char* in[] = {"abc", "def", "ghi"};
  const char* tg[] = {"bcd", "efg", "hij"};
  for (int i = 0; i < 3; ++i) {
    Sample x = get_sample(*s, i);
    for (int t = 0; t < 3; ++t) {
      EXPECT_EQ(x.inputs[t], in[i][t]) << i << "," << t;
      EXPECT_EQ(x.targets[t], tg[i][t]) << i << "," << t;
    }
  }
}

TEST(TextSource, TooShortFileIsConfigErrorSayingBytesNeeded) {
  TempFile f("text_short.txt", "abc");
  DataConfig c;
  c.type = DataType::kText;
  c.path = f.path();
  c.seq_len = 3;
  try {
    make_data_source(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "data.path");
    EXPECT_NE(std::string(e.what()).find("at least 4"), std::string::npos) << e.what();
  }
}

TEST(TextSource, MissingFileIsIoErrorNamingPathAndErrno) {
  DataConfig c;
  c.type = DataType::kText;
  c.path = testing::TempDir() + "zinc_data_test_does_not_exist.txt";
  try {
    make_data_source(c);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(c.path), std::string::npos) << msg;
    EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
  }
}

TEST(TextSource, EvalFractionHoldsOutTheTail) {
  const std::string bytes = alphabet(41);
  TempFile f("text_eval.txt", bytes);  // T = 4: 10 windows
  DataConfig c = text_cfg(f.path(), 4, 0.2);
  auto train = make_data_source(c);
  auto eval = make_eval_data_source(c);
  ASSERT_NE(eval, nullptr);
  EXPECT_EQ(train->num_samples(), 8);
  EXPECT_EQ(eval->num_samples(), 2);
  EXPECT_EQ(get_sample(*eval, 0).inputs[0], bytes[32]);  // window 8
  c.eval_fraction = 0;
  EXPECT_EQ(make_eval_data_source(c), nullptr);
}

// Note [the held-out twin]: the evaluation source made beside the training
// one shares its open files and what its open checked. It reads the files
// the training source opened even when their paths have since been
// replaced (a separate open would read the new ones, and check them again).
TEST(EvalSource, TheHeldOutTwinReadsTheFilesTheTrainingSourceOpened) {
  std::string toks, other, mask, docs;
  for (uint32_t t = 0; t < 401; ++t) put_u16(toks, (t * 37) % 300);
  for (uint32_t t = 0; t < 401; ++t) put_u16(other, (t * 11) % 300);
  for (int t = 0; t < 401; ++t) mask.push_back(t % 3 == 0 ? '\0' : '\1');
  for (uint64_t d : {0ull, 17ull, 250ull, 390ull})
    for (int k = 0; k < 8; ++k) docs.push_back(static_cast<char>((d >> (8 * k)) & 0xff));
  TempFile ft("twin.bin", toks), fm("twin.mask", mask), fd("twin.docs", docs), fo("twin_other.bin", other);
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = ft.path();
  c.mask_path = fm.path();
  c.documents_path = fd.path();
  c.seq_len = 8;
  c.vocab_size = 0;
  c.eval_fraction = 0.25;
  auto train = make_data_source(c);
  auto alone = make_eval_data_source(c);  // opened on its own, before the replacement
  ASSERT_EQ(std::rename(fo.path().c_str(), ft.path().c_str()), 0);  // another set's tokens at the path now
  auto twin = make_eval_data_source(c, *train);
  auto fresh = make_eval_data_source(c);
  ASSERT_NE(twin, nullptr);
  EXPECT_EQ(twin->num_samples(), alone->num_samples());
  EXPECT_EQ(twin->num_samples(), 13);  // 50 windows, a quarter held out (12.5, rounded)
  EXPECT_EQ(train->num_samples(), 37);
  EXPECT_EQ(twin->describe(), alone->describe());
  EXPECT_EQ(twin->vocab_size(), alone->vocab_size());
  ASSERT_TRUE(twin->has_positions());
  bool fresh_differs = false;
  for (int64_t i = 0; i < twin->num_samples(); ++i) {
    const Sample a = get_sample(*alone, i), b = get_sample(*twin, i), f = get_sample(*fresh, i);
    EXPECT_EQ(b.inputs, a.inputs) << i;
    EXPECT_EQ(b.targets, a.targets) << i;  // the mask's and the documents' ignored targets included
    std::vector<int32_t> pa(8), pb(8);
    alone->positions(i, pa.data());
    twin->positions(i, pb.data());
    EXPECT_EQ(pb, pa) << i;
    fresh_differs = fresh_differs || f.inputs != a.inputs;
  }
  EXPECT_TRUE(fresh_differs);  // the path was replaced: a separate open reads the other file
  // A training source made from another config is not shared: the
  // evaluation is opened on its own, at its own config.
  DataConfig c16 = c;
  c16.seq_len = 16;
  auto own = make_eval_data_source(c16, *train);
  EXPECT_EQ(own->seq_len(), 16);
  EXPECT_EQ(get_sample(*own, 0).inputs, get_sample(*make_eval_data_source(c16), 0).inputs);
  c.eval_fraction = 0;
  EXPECT_EQ(make_eval_data_source(c, *train), nullptr);
}

TEST(EvalSource, TheHeldOutTwinOfATextSourceSharesItsBytes) {
  const std::string bytes = alphabet(41);
  TempFile f("text_twin.txt", bytes), g("text_twin_other.txt", std::string(41, 'z'));
  DataConfig c = text_cfg(f.path(), 4, 0.2);
  auto train = make_data_source(c);
  ASSERT_EQ(std::rename(g.path().c_str(), f.path().c_str()), 0);
  auto twin = make_eval_data_source(c, *train);
  ASSERT_NE(twin, nullptr);
  EXPECT_EQ(twin->num_samples(), 2);
  EXPECT_EQ(get_sample(*twin, 0).inputs[0], bytes[32]);  // window 8, of the bytes the training source read
  EXPECT_EQ(get_sample(*make_eval_data_source(c), 0).inputs[0], 'z');
}

// ---------------------------------------------------------------------------
// Token source.

TEST(TokenSource, ReadsHeaderlessLittleEndianTokens) {
  std::string bytes;
  const std::vector<uint32_t> toks = {1, 300, 2, 65535, 4, 5, 6};
  for (uint32_t t : toks) put_u16(bytes, t);
  TempFile f("tokens_plain.bin", bytes);
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = f.path();
  c.seq_len = 2;
  c.vocab_size = 0;  // infer
  auto s = make_data_source(c);
  EXPECT_EQ(s->vocab_size(), 65536);
  ASSERT_EQ(s->num_samples(), 3);  // (7-1)/2
  for (int i = 0; i < 3; ++i) {
    Sample x = get_sample(*s, i);
    for (int t = 0; t < 2; ++t) {
      EXPECT_EQ(x.inputs[t], static_cast<int32_t>(toks[2 * i + t]));
      EXPECT_EQ(x.targets[t], static_cast<int32_t>(toks[2 * i + t + 1]));
    }
  }
}

TEST(TokenSource, SkipsTheGpt2ScriptHeader) {
  std::string bytes = token_header(1, 5);
  for (uint32_t t : {10, 11, 12, 13, 14}) put_u16(bytes, t);
  TempFile f("tokens_header.bin", bytes);
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = f.path();
  c.seq_len = 2;
  c.vocab_size = 50257;
  auto s = make_data_source(c);
  EXPECT_EQ(s->vocab_size(), 50257);
  ASSERT_EQ(s->num_samples(), 2);
  Sample x = get_sample(*s, 1);
  EXPECT_EQ(x.inputs, (std::vector<int32_t>{12, 13}));
  EXPECT_EQ(x.targets, (std::vector<int32_t>{13, 14}));
  EXPECT_NE(s->describe().find("header"), std::string::npos);
}

TEST(TokenSource, HeaderCountMismatchIsAnError) {
  std::string bytes = token_header(1, 6);  // says 6, holds 5
  for (uint32_t t : {10, 11, 12, 13, 14}) put_u16(bytes, t);
  TempFile f("tokens_badcount.bin", bytes);
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = f.path();
  c.seq_len = 2;
  try {
    make_data_source(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "data.path");
    EXPECT_NE(std::string(e.what()).find(f.path()), std::string::npos) << e.what();
  }
}

TEST(TokenSource, OddSizeIsAnError) {
  TempFile f("tokens_odd.bin", std::string(7, '\1'));
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = f.path();
  c.seq_len = 2;
  EXPECT_THROW(make_data_source(c), ConfigError);
}

TEST(TokenSource, TokenOutsideVocabularyIsNamed) {
  std::string bytes;
  for (uint32_t t : {1, 2, 3, 70, 4, 99}) put_u16(bytes, t);
  TempFile f("tokens_vocab.bin", bytes);
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = f.path();
  c.seq_len = 2;
  c.vocab_size = 64;
  try {
    make_data_source(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "data.vocab_size");
    EXPECT_NE(std::string(e.what()).find("token 3 is 70"), std::string::npos) << e.what();
  }
  c.vocab_size = 100;
  EXPECT_EQ(make_data_source(c)->vocab_size(), 100);
  c.vocab_size = 0;
  EXPECT_EQ(make_data_source(c)->vocab_size(), 100);  // max token + 1
}

void put_u32(std::string& s, uint32_t v) {
  for (int k = 0; k < 4; ++k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

// uint32 token files (Llama 3's and Qwen's vocabularies pass 65,536): with
// the Llama 3 scripts' header (magic 20240801, version 7) the width comes
// from the file; without one, from data.token_dtype. A width the header
// contradicts, a size that is no multiple of it, and a token past the
// vocabulary are errors naming the file (and the token's byte offset).
TEST(TokenSource, ReadsUint32TokensWithAndWithoutTheHeader) {
  const std::vector<uint32_t> toks = {1, 128000, 2, 151642, 70000, 5, 6};
  std::string plain;
  for (uint32_t t : toks) put_u32(plain, t);
  std::string headed;
  put_i32(headed, 20240801);
  put_i32(headed, 7);
  put_i32(headed, static_cast<int32_t>(toks.size()));
  headed.resize(1024, '\0');
  headed += plain;
  for (const bool header : {false, true}) {
    TempFile f(header ? "tokens32_header.bin" : "tokens32_plain.bin", header ? headed : plain);
    DataConfig c;
    c.type = DataType::kTokens;
    c.path = f.path();
    c.seq_len = 2;
    c.vocab_size = 0;
    if (!header) c.token_bytes = 4;
    auto s = make_data_source(c);
    EXPECT_EQ(s->vocab_size(), 151643);
    ASSERT_EQ(s->num_samples(), 3);
    for (int i = 0; i < 3; ++i) {
      Sample x = get_sample(*s, i);
      for (int t = 0; t < 2; ++t) {
        EXPECT_EQ(x.inputs[t], static_cast<int32_t>(toks[2 * i + t])) << header;
        EXPECT_EQ(x.targets[t], static_cast<int32_t>(toks[2 * i + t + 1])) << header;
      }
    }
    EXPECT_NE(s->describe().find("uint32"), std::string::npos) << s->describe();
    // A token past the stated vocabulary, by index and byte offset.
    c.vocab_size = 151642;
    try {
      make_data_source(c);
      FAIL() << "expected ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.path(), "data.vocab_size");
      const std::string want = "token 3 is 151642 (byte offset " + std::to_string(header ? 1024 + 12 : 12);
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
    if (header) {
      c.vocab_size = 0;
      c.token_bytes = 2;  // the header says uint32
      try {
        make_data_source(c);
        FAIL() << "expected ConfigError";
      } catch (const ConfigError& e) {
        EXPECT_EQ(e.path(), "data.token_dtype");
        EXPECT_NE(std::string(e.what()).find("says uint32"), std::string::npos) << e.what();
      }
    }
  }
  // Read as uint16, the same bytes hold 14 tokens; as uint32 a 6-byte file is refused.
  TempFile six("tokens32_six.bin", std::string(6, '\1'));
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = six.path();
  c.seq_len = 1;
  c.token_bytes = 4;
  try {
    make_data_source(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not a multiple of 4"), std::string::npos) << e.what();
  }
  // A uint32 token beyond any vocabulary a model takes (2^24), with none stated.
  std::string huge;
  for (uint32_t t : {1u, 2u, 0x7fffffffu, 3u}) put_u32(huge, t);
  TempFile h("tokens32_huge.bin", huge);
  c.path = h.path();
  c.vocab_size = 0;
  try {
    make_data_source(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "data.path");
    EXPECT_NE(std::string(e.what()).find("token 2 is 2147483647"), std::string::npos) << e.what();
  }
}

// A mask and document starts beside the token file, as zinc.prepare
// writes them: a target whose token has mask 0 and the target crossing into
// a document are kIgnoreTarget; positions restart at each document inside
// a sample (and at 0 at every sample's start).
TEST(TokenSource, MaskAndDocumentsMaskTargetsAndRestartPositions) {
  // 13 tokens 0..12; documents start at 0, 4, 6; tokens 1, 2 and 7 are prompt.
  std::string toks;
  for (uint32_t t = 0; t < 13; ++t) put_u16(toks, t);
  std::string mask(13, '\1');
  mask[1] = mask[2] = mask[7] = '\0';
  std::string docs;
  for (uint64_t d : {0ull, 4ull, 6ull})
    for (int k = 0; k < 8; ++k) docs.push_back(static_cast<char>((d >> (8 * k)) & 0xff));
  TempFile ft("md_tokens.bin", toks), fm("md_tokens.mask", mask), fd("md_tokens.docs", docs);
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = ft.path();
  c.seq_len = 4;
  c.mask_path = fm.path();
  c.documents_path = fd.path();
  auto s = make_data_source(c);
  EXPECT_TRUE(s->has_positions());
  EXPECT_NE(s->describe().find("3 documents"), std::string::npos) << s->describe();
  EXPECT_NE(s->describe().find("23.1% masked"), std::string::npos) << s->describe();
  ASSERT_EQ(s->num_samples(), 3);  // windows [0,4], [4,8], [8,12]
  const int32_t I = kIgnoreTarget;
  const std::vector<std::vector<int32_t>> want_targets = {{I, I, 3, I}, {5, I, I, 8}, {9, 10, 11, 12}};
  const std::vector<std::vector<int32_t>> want_pos = {{0, 1, 2, 3}, {0, 1, 0, 1}, {0, 1, 2, 3}};
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> in(4), tg(4), pos(4);
    s->sample(i, in.data(), tg.data());
    s->positions(i, pos.data());
    EXPECT_EQ(tg, want_targets[static_cast<size_t>(i)]) << "sample " << i;
    EXPECT_EQ(pos, want_pos[static_cast<size_t>(i)]) << "sample " << i;
    for (int t = 0; t < 4; ++t) EXPECT_EQ(in[static_cast<size_t>(t)], 4 * i + t);
  }
  // The loader fills Batch::positions.
  DataLoader loader(std::shared_ptr<const DataSource>(std::move(s)), 3, 1, 1, 0, 1);
  Batch b = loader.next();
  EXPECT_EQ(b.positions.size(), 12u);
}

// Note [the open scan]: files of several of the scan's chunks (2 MiB),
// read ahead on the reader's thread. What the scan finds is placed at the
// chunks' edges: the largest token, the first token past the vocabulary,
// a bad mask byte, so that a chunk read at the wrong offset or counted
// twice is named at the wrong place.
TEST(TokenSource, AScanOfManyChunksFindsWhatIsAtTheirEdges) {
  const int64_t n = 5 * (int64_t{1} << 20) + 77;  // tokens: 10 MiB and change, 6 chunks; the mask 3
  std::string toks, mask(static_cast<size_t>(n), '\1');
  toks.reserve(static_cast<size_t>(2 * n));
  for (int64_t t = 0; t < n; ++t) put_u16(toks, static_cast<uint32_t>(t % 1000));
  const int64_t edge = int64_t{1} << 20;  // token 2^20 opens the tokens' second chunk
  auto set_token = [&](std::string& b, int64_t at, uint32_t v) {
    b[static_cast<size_t>(2 * at)] = static_cast<char>(v & 0xff);
    b[static_cast<size_t>(2 * at + 1)] = static_cast<char>(v >> 8);
  };
  set_token(toks, edge - 1, 60000);  // the largest, last of the first chunk
  int64_t zeros = 0;
  for (int64_t at : {int64_t{0}, int64_t{2} << 20, (int64_t{2} << 20) - 1, n - 1, int64_t{12345}}) {
    mask[static_cast<size_t>(at)] = '\0';
    ++zeros;
  }
  TempFile ft("many.bin", toks), fm("many.mask", mask);
  DataConfig c = tokens_cfg(ft.path(), fm.path(), 64);
  auto s = make_data_source(c);
  EXPECT_EQ(s->vocab_size(), 60001);
  char share[32];
  std::snprintf(share, sizeof share, "%.1f%% masked", 100.0 * static_cast<double>(zeros) / static_cast<double>(n));
  EXPECT_NE(s->describe().find(share), std::string::npos) << s->describe();
  // The first token past a vocabulary of 50000, at the first chunk's end;
  // then, past 60001, one at the third chunk's start.
  c.vocab_size = 50000;
  const std::string first = open_error(c).second;
  EXPECT_NE(first.find("token " + std::to_string(edge - 1) + " is 60000"), std::string::npos) << first;
  std::string wider = toks;
  set_token(wider, 2 * edge, 61000);
  TempFile fw("many_wider.bin", wider);
  c.path = fw.path();
  c.vocab_size = 60001;
  const std::string third = open_error(c).second;
  EXPECT_NE(third.find("token " + std::to_string(2 * edge) + " is 61000"), std::string::npos) << third;
  // A bad mask byte in the mask's second chunk, after a good first chunk,
  // and one at the very end.
  c.path = ft.path();
  for (int64_t at : {(int64_t{2} << 20) + 5, n - 1}) {
    std::string bad = mask;
    bad[static_cast<size_t>(at)] = '\7';
    TempFile fb("many_bad.mask", bad);
    c.mask_path = fb.path();
    const auto [key, what] = open_error(c);
    EXPECT_EQ(key, "data.mask_path") << at;
    EXPECT_NE(what.find("byte " + std::to_string(at) + " is 7"), std::string::npos) << what;
  }
}

TEST(TokenSource, BadMaskAndDocumentFilesAreNamed) {
  std::string toks;
  for (uint32_t t = 0; t < 9; ++t) put_u16(toks, t);
  TempFile ft("bad_md.bin", toks);
  auto error_of = [&](const std::string& mask, const std::string& docs) -> std::pair<std::string, std::string> {
    TempFile fm("bad_md.mask", mask), fd("bad_md.docs", docs);
    DataConfig c;
    c.type = DataType::kTokens;
    c.path = ft.path();
    c.seq_len = 4;
    if (!mask.empty()) c.mask_path = fm.path();
    if (!docs.empty()) c.documents_path = fd.path();
    try {
      make_data_source(c);
    } catch (const ConfigError& e) {
      return {e.path(), e.what()};
    }
    return {"", ""};
  };
  auto u64s = [](std::vector<uint64_t> v) {
    std::string s;
    for (uint64_t d : v)
      for (int k = 0; k < 8; ++k) s.push_back(static_cast<char>((d >> (8 * k)) & 0xff));
    return s;
  };
  auto [p1, m1] = error_of(std::string(8, '\1'), "");
  EXPECT_EQ(p1, "data.mask_path");
  EXPECT_NE(m1.find("is 8 bytes but"), std::string::npos) << m1;
  EXPECT_NE(m1.find("holds 9 tokens"), std::string::npos) << m1;
  std::string m = std::string(9, '\1');
  m[5] = '\2';
  auto [p2, m2] = error_of(m, "");
  EXPECT_EQ(p2, "data.mask_path");
  EXPECT_NE(m2.find("byte 5 is 2"), std::string::npos) << m2;
  auto [p3, m3] = error_of("", u64s({0, 5, 5}));
  EXPECT_EQ(p3, "data.documents_path");
  EXPECT_NE(m3.find("entry 2 (byte offset 16) is 5"), std::string::npos) << m3;
  auto [p4, m4] = error_of("", u64s({0, 9}));
  EXPECT_NE(m4.find("entry 1 (byte offset 8) is 9"), std::string::npos) << m4;
  auto [p5, m5] = error_of("", u64s({0}) + "abc");
  EXPECT_EQ(p5, "data.documents_path");
  EXPECT_NE(m5.find("not a multiple of 8"), std::string::npos) << m5;
  std::string some = std::string(9, '\0');
  some[4] = '\1';
  EXPECT_EQ(error_of(some, u64s({0, 3})).first, "");  // good files
  // A mask without one target leaves nothing to train on.
  auto [p6, m6] = error_of(std::string(9, '\0'), "");
  EXPECT_EQ(p6, "data.mask_path");
  EXPECT_NE(m6.find("masks every one of its 9 tokens"), std::string::npos) << m6;
  // A text source takes neither.
  DataConfig c;
  c.type = DataType::kText;
  c.path = ft.path();
  c.seq_len = 4;
  c.mask_path = ft.path();
  try {
    make_data_source(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.path(), "data.mask_path");
  }
}

// zlib's CRC-32, bit by bit (the reference the reader's ISA-L must agree with).
uint32_t crc32_reference(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return c ^ 0xFFFFFFFFu;
}

// Note [prepared sets]: zinc.prepare's token file records the CRC-32 and
// size of the mask and documents files written with it. One of another run
// beside it (a kill between the renames left the set mixed) is refused
// naming the file; the set's own files, files under other names, and token
// files without the record load.
TEST(TokenSource, AMaskOrDocumentsFileOfAnotherPreparedSetIsRefused) {
  std::string toks;
  for (uint32_t t = 0; t < 9; ++t) put_u16(toks, t);
  std::string mask(9, '\1');
  mask[2] = '\0';
  std::string docs;
  for (uint64_t d : {0ull, 5ull})
    for (int k = 0; k < 8; ++k) docs.push_back(static_cast<char>((d >> (8 * k)) & 0xff));
  auto with_record = [&](const std::string& m, const std::string& d) {
    std::string h;
    put_i32(h, 20240520);
    put_i32(h, 1);
    put_i32(h, 9);
    put_i32(h, 0x434E495A);
    put_i32(h, 1);
    put_i32(h, static_cast<int32_t>(crc32_reference(m)));
    put_i32(h, static_cast<int32_t>(m.size()));
    put_i32(h, 0);
    put_i32(h, static_cast<int32_t>(crc32_reference(d)));
    put_i32(h, static_cast<int32_t>(d.size()));
    put_i32(h, 0);
    h.resize(1024, '\0');
    return h + toks;
  };
  auto error_of = [&](const std::string& bin, const std::string& m, const std::string& d,
                      const std::string& mask_name = "set.mask") -> std::pair<std::string, std::string> {
    TempFile ft("set.bin", bin), fm(mask_name, m), fd("set.docs", d);
    DataConfig c;
    c.type = DataType::kTokens;
    c.path = ft.path();
    c.seq_len = 4;
    c.mask_path = fm.path();
    c.documents_path = fd.path();
    try {
      make_data_source(c);
    } catch (const ConfigError& e) {
      return {e.path(), e.what()};
    }
    return {"", ""};
  };
  EXPECT_EQ(error_of(with_record(mask, docs), mask, docs).first, "");
  std::string other_mask = mask;
  other_mask[6] = '\0';  // the same size, another run's
  auto [p1, m1] = error_of(with_record(mask, docs), other_mask, docs);
  EXPECT_EQ(p1, "data.mask_path");
  EXPECT_NE(m1.find("set.mask is not the file zinc.prepare wrote with"), std::string::npos) << m1;
  EXPECT_NE(m1.find("CRC-32 differs"), std::string::npos) << m1;
  EXPECT_NE(m1.find("stopped while it replaced the files"), std::string::npos) << m1;
  {
    // A zinc.prepare replacing the set's files now holds the prefix's lock,
    // FOLDER/.BASENAME.lock: the error names it (the holder here is this
    // process), and it is not called stopped.
    const std::string lock = testing::TempDir() + ".zinc_data_test_" + std::to_string(::getpid()) + "_set.lock";
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0) << lock;
    ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
    auto [pl, ml] = error_of(with_record(mask, docs), other_mask, docs);
    EXPECT_EQ(pl, "data.mask_path");
    EXPECT_NE(ml.find("zinc.prepare (pid " + std::to_string(::getpid()) + ", holding " + lock +
                      ") is replacing its files now"), std::string::npos) << ml;
    EXPECT_EQ(ml.find("stopped"), std::string::npos) << ml;
    ::close(fd);  // released: an unheld lock file (a killed run's) is not a live one
    auto [pu, mu] = error_of(with_record(mask, docs), other_mask, docs);
    EXPECT_NE(mu.find("stopped while it replaced the files"), std::string::npos) << mu;
    std::remove(lock.c_str());
  }
  std::string other_docs;
  for (uint64_t d : {0ull, 3ull, 6ull})
    for (int k = 0; k < 8; ++k) other_docs.push_back(static_cast<char>((d >> (8 * k)) & 0xff));
  auto [p2, m2] = error_of(with_record(mask, docs), mask, other_docs);
  EXPECT_EQ(p2, "data.documents_path");
  EXPECT_NE(m2.find("24 bytes where the token file's header records 16"), std::string::npos) << m2;
  // A mask made by hand under another name is the user's: not checked.
  EXPECT_EQ(error_of(with_record(mask, docs), other_mask, docs, "mine.mask").first, "");
  // A token file without the record (llm.c's, an older zinc's): nothing to check.
  EXPECT_EQ(error_of(token_header(1, 9) + toks, other_mask, other_docs).first, "");
  // A damaged record is not read as "no record" (which would skip the check):
  // a marker or version word edited, with the rest of the record intact.
  for (int slot : {3, 4}) {
    std::string bin = with_record(mask, docs);
    bin[4 * slot] = static_cast<char>(bin[4 * slot] ^ 0x01);
    auto [p3, m3] = error_of(bin, other_mask, docs);
    EXPECT_EQ(p3, "data.path") << slot;
    EXPECT_NE(m3.find("header words 3 and 4 are"), std::string::npos) << m3;
    EXPECT_NE(m3.find("the header is damaged"), std::string::npos) << m3;
  }
}

// Note [prepared sets]: zinc.prepare's header records the CRC-32 of the
// tokens after it (words 12-13), checked in the pass every open makes over
// the tokens. A token edited after the set was written (to a value inside
// the vocabulary, which nothing else would notice) is refused naming the
// file, before the vocabulary check (damage is named as damage); a header
// without the record (an earlier zinc.prepare's) loads unchecked; a damaged
// record word is refused.
TEST(TokenSource, ATokenFileChangedAfterZincPrepareWroteItIsRefused) {
  std::string toks;
  for (uint32_t t = 0; t < 3000000; ++t) put_u16(toks, (t * 7919) % 50000);  // 6 MB: several of the scan's reads
  auto bin = [&](const std::string& body, int32_t marker, uint32_t crc) {
    std::string h;
    for (int32_t v : {20240520, 1, 3000000, 0x434E495A, 1}) put_i32(h, v);
    for (int k = 0; k < 7; ++k) put_i32(h, 0);  // an empty mask and documents file; a stream
    put_i32(h, marker);
    put_i32(h, static_cast<int32_t>(crc));
    h.resize(1024, '\0');
    return h + body;
  };
  auto error_of = [&](const std::string& file, int64_t vocab = 0) -> std::pair<std::string, std::string> {
    TempFile ft("crc.bin", file);
    DataConfig c;
    c.type = DataType::kTokens;
    c.path = ft.path();
    c.seq_len = 16;
    c.vocab_size = vocab;
    try {
      make_data_source(c);
    } catch (const ConfigError& e) {
      return {e.path(), e.what()};
    }
    return {"", ""};
  };
  const uint32_t crc = crc32_reference(toks);
  EXPECT_EQ(error_of(bin(toks, 0x43524354, crc)).first, "");
  for (size_t at : {size_t{0}, size_t{1}, toks.size() / 2, toks.size() - 1}) {  // first, middle and last reads
    std::string edited = toks;
    edited[at] = static_cast<char>(edited[at] ^ 0x01);
    auto [p, m] = error_of(bin(edited, 0x43524354, crc));
    EXPECT_EQ(p, "data.path") << at;
    EXPECT_NE(m.find("crc.bin: the CRC-32 of its 3000000 tokens is "), std::string::npos) << at << ": " << m;
    EXPECT_NE(m.find("changed or damaged after it was written"), std::string::npos) << m;
  }
  // Damage that also leaves the vocabulary is named as damage.
  std::string wild = toks;
  wild[2 * 1234 + 1] = static_cast<char>(0xff);
  EXPECT_NE(error_of(bin(wild, 0x43524354, crc), 50000).second.find("the CRC-32 of its"), std::string::npos);
  // An earlier zinc.prepare's header (words 12-13 zero): not checked.
  EXPECT_EQ(error_of(bin(toks, 0, 0)).first, "");
  std::string edited = toks;
  edited[10] = static_cast<char>(edited[10] ^ 0x01);
  EXPECT_EQ(error_of(bin(edited, 0, 0)).first, "");
  // A damaged marker word is not read as "no record".
  auto [p, m] = error_of(bin(toks, 0x43524354 ^ 0x100, crc));
  EXPECT_EQ(p, "data.path");
  EXPECT_NE(m.find("header words 12 and 13 are"), std::string::npos) << m;
  EXPECT_NE(m.find("the header is damaged"), std::string::npos) << m;
}

TEST(TokenSource, MissingFileIsIoErrorNamingPath) {
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = testing::TempDir() + "zinc_data_test_missing.bin";
  try {
    make_data_source(c);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(c.path), std::string::npos) << e.what();
  }
}

// A token file cut short under a running job (rewritten by a preprocessing
// script, a full disk, a truncate): the next read is an IoError naming the
// file, the bytes it wanted and the size now. With the file mmap'ed this
// test died of SIGBUS: the pages past the new end of file fault.
TEST(TokenSource, FileTruncatedAfterOpenIsIoErrorNamingItNotASignal) {
  std::string bytes;
  for (uint32_t i = 0; i < 65536; ++i) put_u16(bytes, i % 50000);  // 128 KiB: 32 pages
  TempFile f("tokens_truncated.bin", bytes);
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = f.path();
  c.seq_len = 16;
  c.vocab_size = 0;
  std::shared_ptr<const DataSource> s = make_data_source(c);
  const int64_t last = s->num_samples() - 1;
  ASSERT_EQ(last, 4094);  // (65536 - 1) / 16 windows; the last reads tokens 65504..65520
  EXPECT_EQ(get_sample(*s, last).inputs[0], 65504 % 50000);
  DataLoader loader(s, s->num_samples(), 1, 1, 0, 7);  // one micro-batch reads every sample

  ASSERT_EQ(::truncate(f.path().c_str(), 4096), 0) << f.path();
  try {
    get_sample(*s, last);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("data.path"), std::string::npos) << msg;
    EXPECT_NE(msg.find(f.path()), std::string::npos) << msg;
    EXPECT_NE(msg.find("bytes [131008, 131042)"), std::string::npos) << msg;  // 2 * 65504, 17 tokens
    EXPECT_NE(msg.find("now 4096 bytes"), std::string::npos) << msg;
  }
  try {
    loader.next();
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(f.path()), std::string::npos) << e.what();
  }
  // Samples still inside the file read as before.
  EXPECT_EQ(get_sample(*s, 0).inputs[5], 5);
}

// The mask cut short under a running job: the same IoError, naming the
// mask's key and file, not data.path (the token file is whole).
TEST(TokenSource, MaskTruncatedAfterOpenIsIoErrorNamingTheMask) {
  std::string toks, mask;
  for (uint32_t i = 0; i < 8192; ++i) {
    put_u16(toks, i % 1000);
    mask.push_back(i % 3 == 0 ? '\0' : '\1');
  }
  TempFile ft("mask_truncated.bin", toks), fm("mask_truncated.mask", mask);
  DataConfig c = tokens_cfg(ft.path(), fm.path(), 16);
  std::shared_ptr<const DataSource> s = make_data_source(c);
  const int64_t last = s->num_samples() - 1;  // 510: tokens 8160..8176, targets 8161..8176
  ASSERT_EQ(last, 510);
  EXPECT_EQ(get_sample(*s, last).targets[2], kIgnoreTarget);  // token 8163 = 3 * 2721: mask 0
  EXPECT_EQ(get_sample(*s, last).targets[1], 162);            // token 8162: mask 1

  ASSERT_EQ(::truncate(fm.path().c_str(), 1024), 0) << fm.path();
  try {
    get_sample(*s, last);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("data.mask_path: ", 0), 0u) << msg;
    EXPECT_NE(msg.find(fm.path()), std::string::npos) << msg;
    EXPECT_NE(msg.find("now 1024 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("it was 8192"), std::string::npos) << msg;
  }
  // Samples whose mask bytes are still there read as before.
  EXPECT_EQ(get_sample(*s, 0).targets[2], kIgnoreTarget);  // token 3
  EXPECT_EQ(get_sample(*s, 0).targets[0], 1);
}

// make_data_source on `path` from another thread; the error it threw, or
// an empty string. A blocked open fails the test and is released (a writer
// opens the FIFO), so a regression fails instead of hanging the suite.
std::string open_error_within_seconds(DataType type, const std::string& path, int seconds) {
  auto result = std::make_shared<std::promise<std::string>>();
  std::future<std::string> done = result->get_future();
  std::thread t([type, path, result] {
    DataConfig c;
    c.type = type;
    c.path = path;
    c.seq_len = 4;
    c.vocab_size = 0;
    try {
      make_data_source(c);
      result->set_value("");
    } catch (const IoError& e) {
      result->set_value(e.what());
    } catch (const std::exception& e) {
      result->set_value(std::string("not an IoError: ") + e.what());
    }
  });
  if (done.wait_for(std::chrono::seconds(seconds)) != std::future_status::ready) {
    ADD_FAILURE() << "opening " << path << " blocked for " << seconds << " s";
    const int w = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);  // lets the reader's open return
    if (w >= 0) ::close(w);
  }
  t.join();
  return done.get();
}

TEST(DataFiles, FifoIsRefusedAtOnceNamingIt) {
  const std::string path =
      testing::TempDir() + "zinc_data_test_" + std::to_string(::getpid()) + "_fifo";
  ::unlink(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0) << path;
  for (DataType type : {DataType::kTokens, DataType::kText}) {
    const std::string msg = open_error_within_seconds(type, path, 5);
    EXPECT_NE(msg.find("data.path"), std::string::npos) << data_type_name(type) << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("is a FIFO"), std::string::npos) << msg;
  }
  ::unlink(path.c_str());
}

TEST(DataFiles, DirectoryIsRefusedNamingIt) {
  const std::string msg = open_error_within_seconds(DataType::kTokens, testing::TempDir(), 5);
  EXPECT_NE(msg.find(testing::TempDir()), std::string::npos) << msg;
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
}

}  // namespace
}  // namespace zinc
