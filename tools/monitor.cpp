#include "tools/monitor.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <isa-l/crc.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <system_error>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "tools/tb_event.pb.h"

namespace zinc::tools {

namespace fs = std::filesystem;

uint32_t crc32c(const void* data, size_t n) {
  // ISA-L's crc32_iscsi neither inverts the initial value nor the result:
  // the standard CRC-32C starts from all ones and inverts at the end. Its
  // length is an int: longer buffers go in pieces, the CRC carried over.
  uint32_t crc = 0xFFFFFFFFu;
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  while (n > 0) {
    const size_t piece = n < static_cast<size_t>(INT_MAX) ? n : static_cast<size_t>(INT_MAX);
    crc = crc32_iscsi(p, static_cast<int>(piece), crc);
    p += piece;
    n -= piece;
  }
  return crc ^ 0xFFFFFFFFu;
}

uint32_t tfrecord_masked_crc(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace {

void append_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

fs::path create_folder(const char* section, const MonitorConfig& c) {
  fs::path dir = fs::path(c.output_path) / c.job_name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(std::string(section) + ": cannot create " + dir.string() + ": " + ec.message());
  return dir;
}

}  // namespace

void tfrecord_append(std::string& out, std::string_view data) {
  const size_t at = out.size();
  append_le(out, data.size(), 8);
  append_le(out, tfrecord_masked_crc(out.data() + at, 8), 4);
  out.append(data);
  append_le(out, tfrecord_masked_crc(data.data(), data.size()), 4);
}

// The monitor appends to its files, and a resumed run rewrites them without
// the rows past its step: a file of its folder that is not a monitor's CSV
// (a config or data file of the run's, a user's file with a .csv name) is
// refused before the run starts rather than written into. A monitor's file
// (DeepSpeed's or zinc's) begins with the header row "step,NAME".
CsvMonitor::CsvMonitor(const CsvMonitorConfig& c) : dir_(create_folder("csv_monitor", c)) {
  try {
    lock_ = std::make_unique<ckpt::DirLock>(dir_.string(), "csv_monitor folder", (dir_ / ".zinc.lock").string(),
                                            ckpt::LockUse::kRun);
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + " (set csv_monitor.job_name per run)");
  }
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_, ec)) {
    if (e.path().extension() != ".csv") continue;
    std::error_code ec2;
    const fs::file_status st = e.symlink_status(ec2);
    std::string first;
    bool ours = fs::is_regular_file(st);
    if (ours && fs::file_size(e.path(), ec2) > 0) {
      std::ifstream in(e.path(), std::ios::binary);
      char head[5] = {};
      in.read(head, 5);
      ours = in.gcount() == 5 && std::string(head, 5) == "step,";
    }
    if (!ours)
      throw IoError("csv_monitor: " + e.path().string() + " is not a csv_monitor file (" +
                    (fs::is_regular_file(st) ? std::string("its first row is not \"step,NAME\"")
                                              : std::string(fs::is_symlink(st) ? "a symbolic link" : "not a file")) +
                    "), and the monitor appends to the .csv files of its folder: a file of yours? Move it, or set "
                    "another csv_monitor.output_path or job_name");
  }
}

void CsvMonitor::write(const std::string& tag, double value, int64_t step) {
  std::string file = tag;
  for (char& ch : file)
    if (ch == '/' || ch == ' ') ch = '_';
  fs::path path = dir_ / (file + ".csv");
  // DeepSpeed's csv_monitor appends, with a header the first time a process
  // writes the file. A resumed run's rows follow the saved run's without a
  // second header row; a fresh run's start under their own, said once. A
  // row a kill cut short ends before the next one starts.
  bool header = false, newline = false;
  if (!written_[file]) {
    written_[file] = true;
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    const bool empty = ec || size == 0;
    header = empty || !resumed_;
    if (!empty) {
      std::ifstream last(path, std::ios::binary);
      last.seekg(-1, std::ios::end);
      newline = last.get() != '\n';
      if (!resumed_ && !warned_) {
        warned_ = true;
        log_warn("csv_monitor: " + path.string() + " holds an earlier run's rows; this run's follow under a header "
                 "row of their own (set csv_monitor.job_name per run to keep runs apart)");
      }
    }
  }
  std::string text;
  if (newline) text += "\n";
  if (header) text += "step," + tag.substr(tag.rfind('/') + 1) + "\n";
  // NaN as "nan" whatever its sign bit (printf gives "-nan" for an fp16
  // overflow step's norm), as DeepSpeed's monitor writes Python's str().
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", std::isnan(value) ? std::fabs(value) : value);
  text += std::to_string(step) + "," + buf + "\n";
  // write(2) and close(2) checked: a stream's buffered row fails at its
  // close, where an ofstream says nothing (a full disk left empty files and
  // no warning).
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644));
  if (!fd) throw posix_error("csv_monitor: cannot write " + path.string(), errno);
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw posix_error("csv_monitor: write failed on " + path.string(), errno);
    done += static_cast<size_t>(n);
  }
  if (::close(fd.release()) != 0) throw posix_error("csv_monitor: write failed on " + path.string(), errno);
}

void CsvMonitor::resumed(int64_t step) {
  resumed_ = true;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_, ec)) {
    if (e.path().extension() != ".csv" || !e.is_regular_file(ec)) continue;
    // The saved run's rows are those after the file's last header row:
    // rows before it are earlier runs' (a fresh run in the folder starts
    // under a header of its own), kept whatever their steps (a resume
    // removed them). In the saved run's part, a row past the step is
    // dropped, and so is a line that is no row (a row a kill cut short,
    // which the next write ended with a newline, or that still ends the
    // file).
    std::ifstream in(e.path(), std::ios::binary);
    std::vector<std::string> lines;
    std::string line;
    size_t saved_from = 0;  // the first line of the saved run's part
    while (std::getline(in, line)) {
      if (line.rfind("step,", 0) == 0) saved_from = lines.size() + 1;
      lines.push_back(line);
    }
    if (in.bad()) throw IoError("csv_monitor: cannot read " + e.path().string());
    std::string kept;
    int64_t dropped = 0, torn = 0;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i >= saved_from) {
        const size_t comma = lines[i].find(',');
        char* end = nullptr;
        const long long x = comma == std::string::npos ? 0 : std::strtoll(lines[i].c_str(), &end, 10);
        char* value_end = nullptr;
        const bool row = comma != std::string::npos && comma > 0 && end == lines[i].c_str() + comma &&
                         comma + 1 < lines[i].size() &&
                         (std::strtod(lines[i].c_str() + comma + 1, &value_end), *value_end == '\0');
        if (!row || x > step) {
          ++(row ? dropped : torn);
          continue;
        }
      }
      kept += lines[i] + "\n";
    }
    if (dropped + torn == 0) continue;
    // Through a temporary, fsynced, renamed over the file: a full disk
    // leaves the saved run's rows as they were (an unchecked stream once
    // renamed an empty file over them).
    ckpt::write_file_atomic(e.path().string(), kept, "csv_monitor");
    log_info("csv_monitor: " + e.path().string() + ": removed " + std::to_string(dropped) +
             " rows past step " + std::to_string(step) + ", where this run resumes (the saved run's, after its "
             "checkpoint)" + (torn > 0 ? " and " + std::to_string(torn) + " cut short by a kill" : std::string()));
  }
}

TensorBoardWriter::TensorBoardWriter(const TensorBoardConfig& c) {
  const fs::path dir = create_folder("tensorboard", c);
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') std::snprintf(host, sizeof host, "localhost");
  const double now = unix_seconds();
  char name[400];
  std::snprintf(name, sizeof name, "events.out.tfevents.%010lld.%s", static_cast<long long>(now), host);
  path_ = (dir / name).string();
  // O_EXCL: a second run that starts in the same second on this host adds
  // its pid rather than writing into the first one's file, and a third in
  // one process (zinc.train in a loop) a count after it.
  const std::string base = path_;
  int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  for (int n = 0; fd < 0 && errno == EEXIST && n < 10000; ++n) {
    path_ = base + "." + std::to_string(::getpid()) + (n > 0 ? "." + std::to_string(n) : std::string());
    fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  }
  if (fd < 0) throw posix_error("tensorboard: cannot create " + path_, errno);
  fd_ = UniqueFd(fd);
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0 && e.path().string() != path_)
      ++earlier_files_;
  tb::Event ev;
  ev.set_wall_time(now);
  ev.set_file_version("brain.Event:2");
  tfrecord_append(pending_, ev.SerializeAsString());
  try {
    flush();
  } catch (const IoError&) {  // a full disk: no empty event file left behind
    ::unlink(path_.c_str());
    throw;
  }
}

// Scalars encoded but not flushed (an error ended the step's work after
// them) still go out: they are whole values of a trained step.
// A run that wrote no scalar (a resume with nothing left to train, --steps
// 0, an error before the first step) removes its file: it held only its
// header, and the next fresh run in the folder counted it as an earlier
// run's.
TensorBoardWriter::~TensorBoardWriter() {
  if (!scalars_) {
    fd_.reset();
    ::unlink(path_.c_str());
    return;
  }
  try {
    flush();
  } catch (const IoError&) {
    // the run is ending with an error already, or the disk refuses: nothing to add
  }
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  if (earlier_files_ > 0 && !resumed_ && !warned_) {  // a fresh run beside earlier ones
    warned_ = true;
    log_warn("tensorboard: " + fs::path(path_).parent_path().string() + " holds " + std::to_string(earlier_files_) +
             " event file(s) of earlier runs, which TensorBoard shows with this run's as one run, the same steps "
             "twice (set tensorboard.job_name per run to keep runs apart)");
  }
  scalars_ = true;
  tb::Event ev;
  ev.set_wall_time(unix_seconds());
  ev.set_step(step);
  tb::Summary::Value* v = ev.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  tfrecord_append(pending_, ev.SerializeAsString());
}

void TensorBoardWriter::resumed(int64_t step) {
  resumed_ = true;
  tb::Event ev;
  ev.set_wall_time(unix_seconds());
  ev.set_step(step + 1);
  ev.mutable_session_log()->set_status(tb::SessionLog::START);
  tfrecord_append(pending_, ev.SerializeAsString());
}

void TensorBoardWriter::flush() {
  if (pending_.empty()) return;
  struct stat st;
  if (::fstat(fd_.get(), &st) == 0 && st.st_nlink == 0) {
    pending_.clear();
    throw IoError("tensorboard: " + path_ + " was removed while the run wrote it");
  }
  size_t done = 0;
  while (done < pending_.size()) {
    const ssize_t n = ::write(fd_.get(), pending_.data() + done, pending_.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      // What was written stays; the rest is dropped so that a later flush
      // does not write half a record after a whole one.
      pending_.clear();
      throw posix_error("tensorboard: write failed on " + path_, err);
    }
    done += static_cast<size_t>(n);
  }
  pending_.clear();
}

Monitors::Monitors(const Config& c, int rank) {
  if (rank != 0) return;  // one writer
  if (c.csv_monitor.enabled) csv_ = std::make_unique<CsvMonitor>(c.csv_monitor);
  if (c.tensorboard.enabled) tb_ = std::make_unique<TensorBoardWriter>(c.tensorboard);
}

Monitors::~Monitors() = default;

// Note [a monitor is a side output]
// A monitor whose file cannot be written (its folder removed by a clean-up,
// a full disk) ended the run with an error and no checkpoint, losing every
// step since the last one for a log line. So a failure drops that monitor,
// with a warning naming the file, and training goes on; a TensorBoard file
// removed under the run is seen at the next flush, where its writes would
// have gone into a file no one can open.
template <class Monitor, class F>
void guarded(std::unique_ptr<Monitor>& m, const char* name, F&& f) {
  if (!m) return;
  try {
    f(*m);
  } catch (const std::exception& e) {
    log_warn(std::string(e.what()) + "; the run goes on without " + name);
    m.reset();
  }
}

void Monitors::write(const std::string& tag, double value, int64_t step) {
  guarded(csv_, "csv_monitor", [&](CsvMonitor& m) { m.write(tag, value, step); });
  guarded(tb_, "tensorboard", [&](TensorBoardWriter& m) { m.add_scalar(tag, value, step); });
}

void Monitors::flush() {
  guarded(tb_, "tensorboard", [&](TensorBoardWriter& m) { m.flush(); });
}

void Monitors::resumed(int64_t step) {
  guarded(csv_, "csv_monitor", [&](CsvMonitor& m) { m.resumed(step); });
  guarded(tb_, "tensorboard", [&](TensorBoardWriter& m) {
    m.resumed(step);
    m.flush();
  });
}

}  // namespace zinc::tools
