// tools/monitor.h: CRC-32C and TFRecord framing against their published
// check values (and the values of TensorBoard's own Python reader), and the
// TensorBoard writer's file: its name, its records decoded back with the
// protobuf library, and the refusal of a folder it cannot create; both
// monitors on a disk that refuses writes (a file size limit, as ulimit -f
// sets: EFBIG where a full disk gives ENOSPC, through the same checks).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <set>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/config.h"
#include "tools/monitor.h"
#include "tools/tb_event.pb.h"

namespace zinc::tools {
namespace {

namespace fs = std::filesystem;

// The little-endian integer of `bytes` bytes at `at`.
uint64_t le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s.at(at + static_cast<size_t>(i)));
  return v;
}
uint64_t le64(const std::string& s, size_t at) { return le(s, at, 8); }
uint32_t le32(const std::string& s, size_t at) { return static_cast<uint32_t>(le(s, at, 4)); }

// Splits a file's bytes into its records' data, checking the framing.
std::vector<std::string> split_records(const std::string& blob) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < blob.size()) {
    EXPECT_LE(at + 12, blob.size());
    const uint64_t n = le64(blob, at);
    EXPECT_EQ(le32(blob, at + 8), tfrecord_masked_crc(blob.data() + at, 8));
    EXPECT_LE(at + 16 + n, blob.size());
    std::string data = blob.substr(at + 12, n);
    EXPECT_EQ(le32(blob, at + 12 + n), tfrecord_masked_crc(data.data(), data.size()));
    out.push_back(std::move(data));
    at += 16 + n;
  }
  return out;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct TempDir {
  fs::path path;
  TempDir() {
    char tmpl[] = "/tmp/zinc_monitor_test_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

TEST(Crc32c, StandardCheckValue) {
  // The CRC-32C check value (RFC 3720, the iSCSI CRC): "123456789".
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  // 32 bytes of zeros, RFC 3720 B.4.
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
}

TEST(TfRecord, MaskedCrcMatchesTensorBoardsReader) {
  // Values of tensorboard's masked_crc32c (its Python record reader).
  EXPECT_EQ(tfrecord_masked_crc("123456789", 9), 0xC78AB0E5u);
  EXPECT_EQ(tfrecord_masked_crc("", 0), 0xA282EAD8u);
  EXPECT_EQ(tfrecord_masked_crc("abc", 3), 0x21F1576Eu);
}

TEST(TfRecord, FramingIsLengthCrcDataCrc) {
  std::string out = "x";  // appends after what is there
  tfrecord_append(out, "abc");
  ASSERT_EQ(out.size(), 1u + 8 + 4 + 3 + 4);
  EXPECT_EQ(le64(out, 1), 3u);
  EXPECT_EQ(le32(out, 9), 0x0E4999B0u);  // masked CRC of the 8 length bytes (tensorboard's value)
  EXPECT_EQ(out.substr(13, 3), "abc");
  EXPECT_EQ(le32(out, 16), 0x21F1576Eu);
}

TEST(TensorBoardWriter, WritesVersionThenOneEventPerScalar) {
  TempDir tmp;
  TensorBoardConfig c;
  c.enabled = true;
  c.output_path = (tmp.path / "tb").string();
  c.job_name = "job";
  std::string path;
  {
    TensorBoardWriter w(c);
    path = w.path();
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string name = fs::path(path).filename().string();
    const std::string prefix = "events.out.tfevents.";
    ASSERT_EQ(fs::path(path).parent_path(), tmp.path / "tb" / "job");
    ASSERT_EQ(name.rfind(prefix, 0), 0u) << name;
    EXPECT_EQ(name.substr(prefix.size() + 10), std::string(".") + host) << name;
    // The version record is on disk before any scalar.
    EXPECT_EQ(split_records(read_all(path)).size(), 1u);
    w.add_scalar("Train/Samples/train_loss", 2.5, 64);
    w.add_scalar("Train/Samples/lr", 0.0, 64);  // a zero is still a scalar
    EXPECT_EQ(split_records(read_all(path)).size(), 1u);  // encoded, not yet written
    w.flush();
    EXPECT_EQ(split_records(read_all(path)).size(), 3u);
    w.add_scalar("Train/Samples/train_loss", 1.25, 128);
  }  // the destructor writes what was pending
  const std::vector<std::string> recs = split_records(read_all(path));
  ASSERT_EQ(recs.size(), 4u);
  tb::Event ev;
  ASSERT_TRUE(ev.ParseFromString(recs[0]));
  EXPECT_EQ(ev.file_version(), "brain.Event:2");
  EXPECT_GT(ev.wall_time(), 1.6e9);
  const struct {
    const char* tag;
    float value;
    int64_t step;
  } want[] = {{"Train/Samples/train_loss", 2.5f, 64}, {"Train/Samples/lr", 0.0f, 64},
              {"Train/Samples/train_loss", 1.25f, 128}};
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(ev.ParseFromString(recs[i + 1]));
    ASSERT_TRUE(ev.has_summary());
    ASSERT_EQ(ev.summary().value_size(), 1);
    EXPECT_EQ(ev.step(), want[i].step);
    EXPECT_EQ(ev.summary().value(0).tag(), want[i].tag);
    EXPECT_TRUE(ev.summary().value(0).has_simple_value());
    EXPECT_EQ(ev.summary().value(0).simple_value(), want[i].value);
  }
  // Written on the wire even when 0 (a oneof member): field 2, fixed32.
  EXPECT_NE(recs[2].find(std::string("\x15\0\0\0\0", 5)), std::string::npos);
}

TEST(TensorBoardWriter, UncreatableFolderIsRefusedNamingIt) {
  TempDir tmp;
  std::ofstream(tmp.path / "file") << "x";
  TensorBoardConfig c;
  c.enabled = true;
  c.output_path = (tmp.path / "file" / "x").string();
  try {
    TensorBoardWriter w(c);
    FAIL() << "created " << w.path();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("tensorboard: cannot create " + c.output_path), std::string::npos)
        << e.what();
  }
}

// Both monitors on, writing under tmp/tb and tmp/csv.
Config both_monitors(const TempDir& tmp) {
  Config c;
  c.tensorboard.enabled = true;
  c.tensorboard.output_path = (tmp.path / "tb").string();
  c.csv_monitor.enabled = true;
  c.csv_monitor.output_path = (tmp.path / "csv").string();
  return c;
}

TEST(Monitors, OnlyRankZeroWrites) {
  TempDir tmp;
  const Config c = both_monitors(tmp);
  {
    Monitors other(c, 1);
    EXPECT_FALSE(other.enabled());
    other.write("Train/Samples/lr", 1.0, 8);
    other.flush();
  }
  EXPECT_FALSE(fs::exists(tmp.path / "tb"));
  EXPECT_FALSE(fs::exists(tmp.path / "csv"));
  Monitors zero(c, 0);
  EXPECT_TRUE(zero.enabled());
  zero.write("Train/Samples/lr", 1.0, 8);
  zero.flush();
  EXPECT_EQ(read_all(tmp.path / "csv" / "DeepSpeedJobName" / "Train_Samples_lr.csv"), "step,lr\n8,1\n");
  int files = 0;
  for (const auto& e : fs::directory_iterator(tmp.path / "tb" / "DeepSpeedJobName")) {
    ++files;
    EXPECT_EQ(split_records(read_all(e.path())).size(), 2u);
  }
  EXPECT_EQ(files, 1);
}

// A norm that is NaN (an fp16 overflow step's) is written "nan", as
// DeepSpeed's monitor writes Python's str(), whatever its sign bit: printf
// wrote "-nan" for the negative NaN an overflow gives. Infinities keep
// their sign.
TEST(Monitors, ANonFiniteValueIsWrittenAsPythonWritesIt) {
  TempDir tmp;
  const Config c = both_monitors(tmp);
  Monitors m(c, 0);
  m.write("Train/Samples/grad_norm", -std::numeric_limits<double>::quiet_NaN(), 1);
  m.write("Train/Samples/grad_norm", std::numeric_limits<double>::quiet_NaN(), 2);
  m.write("Train/Samples/grad_norm", -std::numeric_limits<double>::infinity(), 3);
  m.write("Train/Samples/grad_norm", 0.5, 4);
  m.flush();
  EXPECT_EQ(read_all(tmp.path / "csv" / "DeepSpeedJobName" / "Train_Samples_grad_norm.csv"),
            "step,grad_norm\n1,nan\n2,nan\n3,-inf\n4,0.5\n");
}

// Note [a monitor is a side output]: a monitor whose folder goes away in
// the run (a clean-up) is dropped with a warning naming its file, and the
// run goes on (csv_monitor's error ended it with no checkpoint; tensorboard
// wrote on into a removed file without a word).
TEST(Monitors, AFolderRemovedMidRunDropsItsMonitorWithAWarning) {
  TempDir tmp;
  const Config c = both_monitors(tmp);
  Monitors m(c, 0);
  m.write("Train/Samples/lr", 1.0, 8);
  m.flush();
  fs::remove_all(tmp.path / "tb");
  fs::remove_all(tmp.path / "csv");
  LogCapture capture(LogLevel::kWarn);
  EXPECT_NO_THROW(m.write("Train/Samples/lr", 0.5, 16));
  EXPECT_NO_THROW(m.flush());
  const std::vector<std::string> got = capture.messages();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_NE(got[0].find("csv_monitor: cannot write " + (tmp.path / "csv").string()), std::string::npos) << got[0];
  EXPECT_NE(got[0].find("the run goes on without csv_monitor"), std::string::npos) << got[0];
  EXPECT_NE(got[1].find("was removed while the run wrote it; the run goes on without tensorboard"), std::string::npos)
      << got[1];
  EXPECT_FALSE(m.enabled());
  m.write("Train/Samples/lr", 0.25, 24);  // dropped: nothing more is said or written
  m.flush();
  EXPECT_EQ(capture.messages().size(), 2u);
  EXPECT_FALSE(fs::exists(tmp.path / "csv"));
}

// A resumed run's curves: the CSV rows a crashed run wrote past the
// resumed step go (each file replaced whole), the run's rows follow
// without a second header, and the TensorBoard file starts with a
// SessionLog START at step + 1, from which TensorBoard's reader drops the
// earlier files' later steps. (Both showed those steps twice.)
TEST(Monitors, AResumedRunDropsTheCrashedRunsLaterStepsFromItsCurves) {
  TempDir tmp;
  const Config c = both_monitors(tmp);
  const fs::path csv = tmp.path / "csv" / "DeepSpeedJobName" / "Train_Samples_lr.csv";
  {
    Monitors crashed(c, 0);
    for (int64_t step : {8, 16, 24, 32}) crashed.write("Train/Samples/lr", static_cast<double>(step), step);
    crashed.flush();
  }
  std::string resumed_tb;
  {
    Monitors resumed(c, 0);
    resumed.resumed(16);
    EXPECT_EQ(read_all(csv), "step,lr\n8,8\n16,16\n");
    resumed.write("Train/Samples/lr", 2.0, 24);
    resumed.flush();
    for (const auto& e : fs::directory_iterator(tmp.path / "tb" / "DeepSpeedJobName"))
      if (split_records(read_all(e.path())).size() == 3) resumed_tb = e.path().string();
  }
  EXPECT_EQ(read_all(csv), "step,lr\n8,8\n16,16\n24,2\n");
  ASSERT_FALSE(resumed_tb.empty());
  const std::vector<std::string> recs = split_records(read_all(resumed_tb));
  tb::Event ev;
  ASSERT_TRUE(ev.ParseFromString(recs[1]));
  ASSERT_TRUE(ev.has_session_log());
  EXPECT_EQ(ev.session_log().status(), tb::SessionLog::START);
  EXPECT_EQ(ev.step(), 17);
  // On the wire after wall_time (field 1, 9 bytes): step 17 (field 2), then
  // session_log as field 7, length-delimited (0x3a), holding status START:
  // TensorBoard's numbers. (Searching the record for the step's tag byte
  // could land inside wall_time's 8 bytes.)
  ASSERT_EQ(recs[1].size(), 15u);
  EXPECT_EQ(recs[1].substr(9), std::string("\x10\x11\x3a\x02\x08\x01", 6))
      << "TensorBoard's Event.session_log is field 7";
  ASSERT_TRUE(ev.ParseFromString(recs[2]));
  EXPECT_EQ(ev.step(), 24);
}

// A resumed run's rewrite touches only the saved run's rows: those after the
// file's last header row. An earlier run's rows before it were removed when
// their steps lay past the resume's (another run's curve lost). A row a kill
// cut short goes too, at the end of the file or ended by a later write.
TEST(Monitors, AResumedRunKeepsEarlierRunsRowsAndDropsRowsCutShort) {
  TempDir tmp;
  const Config c = both_monitors(tmp);
  const fs::path dir = tmp.path / "csv" / "DeepSpeedJobName";
  fs::create_directories(dir);
  const std::string earlier = "step,lr\n8,8\n16,16\n24,24\n32,32\n";
  {
    std::ofstream(dir / "Train_Samples_lr.csv") << earlier << "step,lr\n8,1\n16,2\n3\n24,3\n32,4";
    std::ofstream(dir / "Train_Samples_train_loss.csv") << earlier << "step,train_loss\n8,1\n16,2\n24,";
  }
  {
    Monitors resumed(c, 0);
    resumed.resumed(16);
  }
  EXPECT_EQ(read_all(dir / "Train_Samples_lr.csv"), earlier + "step,lr\n8,1\n16,2\n");
  EXPECT_EQ(read_all(dir / "Train_Samples_train_loss.csv"), earlier + "step,train_loss\n8,1\n16,2\n");
}

// A fresh run in a folder an earlier run wrote: its rows start under a
// header row of their own, and it says so once, as for TensorBoard's files.
TEST(Monitors, AFreshRunBesideAnEarlierOneSaysSo) {
  TempDir tmp;
  const Config c = both_monitors(tmp);
  const fs::path csv = tmp.path / "csv" / "DeepSpeedJobName" / "Train_Samples_lr.csv";
  {
    Monitors first(c, 0);
    first.write("Train/Samples/lr", 1.0, 8);
    first.flush();
  }
  ::sleep(1);  // another second: another event file name
  LogCapture capture(LogLevel::kWarn);
  Monitors second(c, 0);
  second.write("Train/Samples/lr", 3.0, 8);
  second.write("Train/Samples/train_loss", 4.0, 8);
  second.flush();
  EXPECT_EQ(read_all(csv), "step,lr\n8,1\nstep,lr\n8,3\n");
  const std::vector<std::string> got = capture.messages();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_NE(got[0].find("holds an earlier run's rows; this run's follow under a header row of their own"),
            std::string::npos)
      << got[0];
  EXPECT_NE(got[1].find("holds 1 event file(s) of earlier runs"), std::string::npos) << got[1];
}

// csv_monitor alone, and its learning-rate curve's file.
Config csv_only(const TempDir& tmp) {
  Config c = both_monitors(tmp);
  c.tensorboard.enabled = false;
  return c;
}
fs::path lr_csv(const TempDir& tmp) { return tmp.path / "csv" / "DeepSpeedJobName" / "Train_Samples_lr.csv"; }

// A file size limit (setrlimit RLIMIT_FSIZE, as `ulimit -f`) for the
// scope: writes past `bytes` fail with EFBIG (SIGXFSZ ignored, as zinc-train
// ignores it), as a full disk's fail with ENOSPC.
struct FileSizeLimit {
  rlimit old{};
  void (*old_handler)(int) = nullptr;
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old);
    old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit now = old;
    now.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &now);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
  }
};

// A resumed run that cannot rewrite a CSV on a full disk keeps the saved
// run's rows as they were (an unchecked stream renamed an empty file over
// them, and said it had removed two rows), and drops the monitor naming
// the file.
TEST(Monitors, ADiskThatRefusesTheResumedRewriteKeepsTheSavedRows) {
  TempDir tmp;
  const Config c = csv_only(tmp);
  const fs::path csv = lr_csv(tmp);
  {
    Monitors crashed(c, 0);
    for (int64_t step : {8, 16, 24, 32}) crashed.write("Train/Samples/lr", static_cast<double>(step), step);
    crashed.flush();
  }
  const std::string saved = read_all(csv);
  ASSERT_EQ(saved, "step,lr\n8,8\n16,16\n24,24\n32,32\n");
  Monitors resumed(c, 0);
  LogCapture capture(LogLevel::kWarn);
  {
    FileSizeLimit limit(8);  // the rows kept are 19 bytes
    resumed.resumed(16);
  }
  EXPECT_EQ(read_all(csv), saved);
  const fs::path temporary = csv.parent_path() / ("." + csv.filename().string() + ".zinc-tmp");
  EXPECT_FALSE(fs::exists(temporary));
  const std::vector<std::string> got = capture.messages();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_NE(got[0].find("csv_monitor: write of " + temporary.string()), std::string::npos) << got[0];
  EXPECT_NE(got[0].find("File too large"), std::string::npos) << got[0];
  EXPECT_NE(got[0].find("the run goes on without csv_monitor"), std::string::npos) << got[0];
}

// Rows that stop fitting are said once, naming the file (a full disk left
// empty or cut files and no word: the stream's error came at its close),
// and the run goes on without the monitor; TensorBoard's file that cannot
// take its first record is not left behind empty.
TEST(Monitors, RowsThatDoNotFitAreSaidNamingTheFile) {
  TempDir tmp;
  const Config c = csv_only(tmp);
  const fs::path csv = lr_csv(tmp);
  Monitors m(c, 0);
  LogCapture capture(LogLevel::kWarn);
  {
    FileSizeLimit limit(40);
    for (int64_t step = 8; step <= 200; step += 8) m.write("Train/Samples/lr", 0.5, step);
  }
  EXPECT_FALSE(m.enabled());
  const std::vector<std::string> got = capture.messages();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_NE(got[0].find("csv_monitor: write failed on " + csv.string() + ": File too large"), std::string::npos)
      << got[0];
  EXPECT_EQ(fs::file_size(csv), 40u);
  TensorBoardConfig t;
  t.enabled = true;
  t.output_path = (tmp.path / "tb").string();
  {
    FileSizeLimit limit(4);
    EXPECT_THROW(TensorBoardWriter w(t), IoError);
  }
  EXPECT_TRUE(fs::is_empty(tmp.path / "tb" / "DeepSpeedJobName"));
}

// Two runs on one csv_monitor folder (found by a sweep of two writers,
// 2026-12-03): their rows interleaved, and a resumed one removed the other's
// rows past its step. The second is refused naming the folder; once the
// first is gone the folder is free.
TEST(Monitors, TwoRunsOnOneCsvFolderAreRefused) {
  TempDir tmp;
  const Config c = csv_only(tmp);
  auto first = std::make_unique<Monitors>(c, 0);
  first->write("Train/Samples/lr", 1.0, 8);
  try {
    Monitors second(c, 0);
    FAIL() << "a second run on the folder was not refused";
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("csv_monitor folder " + (tmp.path / "csv" / "DeepSpeedJobName").string() + " is in use by "
                        "another run"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("set csv_monitor.job_name per run"), std::string::npos) << what;
  }
  first.reset();
  EXPECT_NO_THROW(Monitors again(c, 0));
  EXPECT_FALSE(fs::exists(tmp.path / "csv" / "DeepSpeedJobName" / ".zinc.lock"));
}

// Runs started in one second by one process (zinc.train in a loop) each get
// a file of their own: the third found the pid's name taken, and failed.
// A run that wrote no scalar (a resume with nothing left to train) leaves
// no event file: the next fresh run in the folder counted it as an earlier
// run's and warned.
TEST(TensorBoardWriter, AWriterWithoutScalarsLeavesNoFile) {
  TempDir tmp;
  TensorBoardConfig c;
  c.enabled = true;
  c.output_path = tmp.path.string();
  std::string kept, dropped;
  {
    TensorBoardWriter none(c);
    none.resumed(16);
    none.flush();
    dropped = none.path();
    EXPECT_TRUE(fs::exists(dropped));
  }
  EXPECT_FALSE(fs::exists(dropped));
  {
    TensorBoardWriter one(c);
    one.add_scalar("Train/Samples/lr", 1.0, 8);
    kept = one.path();
  }
  EXPECT_TRUE(fs::exists(kept));
  EXPECT_GT(fs::file_size(kept), 0u);
}

TEST(TensorBoardWriter, RunsInOneSecondInOneProcessGetFilesOfTheirOwn) {
  TempDir tmp;
  TensorBoardConfig c;
  c.enabled = true;
  c.output_path = tmp.path.string();
  for (int attempt = 0; attempt < 5; ++attempt) {
    fs::remove_all(tmp.path / "DeepSpeedJobName");
    std::vector<std::unique_ptr<TensorBoardWriter>> w;
    std::set<std::string> names, seconds;
    for (int i = 0; i < 4; ++i) {
      ASSERT_NO_THROW(w.push_back(std::make_unique<TensorBoardWriter>(c))) << "writer " << i;
      const std::string name = fs::path(w.back()->path()).filename().string();
      names.insert(name);
      seconds.insert(name.substr(0, std::string("events.out.tfevents.").size() + 10));
    }
    EXPECT_EQ(names.size(), 4u);
    if (seconds.size() == 1) return;  // the four in one second: the names had to differ past it
  }
  FAIL() << "four writers never started within one second";
}

}  // namespace
}  // namespace zinc::tools
