#include "tools/monitor.h"

#include <fcntl.h>
#include <isa-l/crc.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <system_error>

#include "core/error.h"
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

CsvMonitor::CsvMonitor(const CsvMonitorConfig& c) : dir_(create_folder("csv_monitor", c)) {}

void CsvMonitor::write(const std::string& tag, double value, int64_t step) {
  std::string file = tag;
  for (char& ch : file)
    if (ch == '/' || ch == ' ') ch = '_';
  fs::path path = dir_ / (file + ".csv");
  // DeepSpeed's csv_monitor appends, with a header the first time a process
  // writes the file. Here the header goes only into an empty file, so that a
  // resumed run's rows follow the earlier ones without a second header row,
  // and a row a kill cut short ends before the next one starts.
  bool header = false, newline = false;
  if (!written_[file]) {
    written_[file] = true;
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    header = ec || size == 0;
    if (!header) {
      std::ifstream last(path, std::ios::binary);
      last.seekg(-1, std::ios::end);
      newline = last.get() != '\n';
    }
  }
  std::ofstream out(path, std::ios::app);
  if (!out) throw IoError("csv_monitor: cannot write " + path.string());
  if (newline) out << "\n";
  if (header) out << "step," << tag.substr(tag.rfind('/') + 1) << "\n";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", value);
  out << step << "," << buf << "\n";
  if (!out) throw IoError("csv_monitor: write failed on " + path.string());
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
  // its pid rather than writing into the first one's file.
  int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EEXIST) {
    path_ += "." + std::to_string(::getpid());
    fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  }
  if (fd < 0) throw posix_error("tensorboard: cannot create " + path_, errno);
  fd_ = UniqueFd(fd);
  tb::Event ev;
  ev.set_wall_time(now);
  ev.set_file_version("brain.Event:2");
  tfrecord_append(pending_, ev.SerializeAsString());
  flush();
}

// Scalars encoded but not flushed (an error ended the step's work after
// them) still go out: they are whole values of a trained step.
TensorBoardWriter::~TensorBoardWriter() {
  try {
    flush();
  } catch (const IoError&) {
    // the run is ending with an error already, or the disk refuses: nothing to add
  }
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  tb::Event ev;
  ev.set_wall_time(unix_seconds());
  ev.set_step(step);
  tb::Summary::Value* v = ev.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  tfrecord_append(pending_, ev.SerializeAsString());
}

void TensorBoardWriter::flush() {
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

void Monitors::write(const std::string& tag, double value, int64_t step) {
  if (csv_) csv_->write(tag, value, step);
  if (tb_) tb_->add_scalar(tag, value, step);
}

void Monitors::flush() {
  if (tb_) tb_->flush();
}

}  // namespace zinc::tools
