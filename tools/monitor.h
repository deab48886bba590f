// zinc tools: the monitors of a run, DeepSpeed's csv_monitor and tensorboard
// sections: rank 0 writes the run's scalars (loss, learning rate, ...) as
// curves against the samples trained, to files people open in a spreadsheet
// or in TensorBoard. tools/run_loop.h feeds them, for zinc-train and
// zinc.train alike.
//
// Each class owns its files; one thread (the run loop's) calls it. A write
// that fails throws IoError naming the file; Monitors then drops that
// monitor with a warning (Note [a monitor is a side output]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "core/unique_fd.h"
#include "engine/checkpoint.h"
#include "engine/config.h"

namespace zinc::tools {

// CRC-32C (Castagnoli), the standard form (crc32c("123456789") ==
// 0xE3069283), computed by ISA-L.
uint32_t crc32c(const void* data, size_t n);
// TFRecord's masked CRC-32C of data: rotated right by 15 bits plus
// 0xa282ead8, so that a CRC of data that holds CRCs stays well spread.
uint32_t tfrecord_masked_crc(const void* data, size_t n);
// Appends data to out as one TFRecord: its length (uint64, little-endian),
// the masked CRC of those 8 bytes, data, the masked CRC of data.
void tfrecord_append(std::string& out, std::string_view data);

// DeepSpeed's csv_monitor layout: <output_path>/<job_name>/<tag with '/'
// and ' ' replaced by '_'>.csv, rows "step,value" under a "step,<last part of
// the tag>" header written the first time this process writes a file, as
// DeepSpeed's does (so a fresh run's rows after an earlier run's start with
// a header row of their own, and the run says so once). A resumed run
// (resumed()) writes no second header: its rows follow the saved run's,
// whose rows past the resumed step (a crashed run's, written after its last
// checkpoint) it removes first. Each write opens, appends and closes its
// file.
class CsvMonitor {
 public:
  // Creates the folder (IoError if it cannot) and holds its lock for the
  // monitor's life: two runs appending to one folder's files interleaved
  // their rows, and a resumed one removed the other's rows past its step
  // (IoError naming the holder's pid).
  explicit CsvMonitor(const CsvMonitorConfig& c);
  void write(const std::string& tag, double value, int64_t step);
  // Before the first write of a resumed run: every CSV of the folder keeps
  // its rows up to `step` (each file rewritten as one unit where it drops any).
  void resumed(int64_t step);

 private:
  std::filesystem::path dir_;
  std::unique_ptr<ckpt::DirLock> lock_;
  std::map<std::string, bool> written_;
  bool resumed_ = false, warned_ = false;
};

// Note [TensorBoard event file]
// -----------------------------
// The file TensorBoard reads: <output_path>/<job_name>/
// events.out.tfevents.<unix seconds>.<hostname> (".<pid>" added if a file
// of that name exists), as TensorBoard's own writers name it. It is a
// sequence of TFRecords (tfrecord_append), each an Event protobuf message
// (tools/tb_event.proto, encoded by the protobuf library): first one whose
// file_version is "brain.Event:2", then one Event per scalar with its tag,
// its step (the samples trained, the x DeepSpeed's monitor uses) and the
// wall time, as PyTorch's SummaryWriter (DeepSpeed's writer) writes them.
//
// Cost: add_scalar encodes into a buffer in memory; flush() hands the
// buffer to the kernel with one write(2), once per step. A few hundred
// bytes and one system call per step are far below a step's time, so the
// writes stay on the training thread (no queue, no thread). After flush()
// the records are in the kernel's page cache: a run that crashes, or is
// killed, leaves a file readable up to its last flushed step (a crash of the
// machine itself may lose what the kernel had not written yet; no fsync, as
// TensorBoard's writers do none per step either). A reader that meets a
// record cut short, or a damaged CRC, stops there, keeping what came before.
class TensorBoardWriter {
 public:
  // Creates the folder and the file, and writes the file_version record.
  // IoError naming the folder or the file if it cannot.
  explicit TensorBoardWriter(const TensorBoardConfig& c);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  const std::string& path() const { return path_; }
  // Encodes one scalar's Event into the pending buffer (nothing is written).
  void add_scalar(const std::string& tag, double value, int64_t step);
  // A resumed run: a SessionLog START event at step + 1, from which
  // TensorBoard's reader drops what the folder's earlier files hold past
  // `step` (a crashed run's steps after its last checkpoint), as it does
  // for TensorFlow's own restarts. Encoded into the pending buffer.
  void resumed(int64_t step);
  // Writes what add_scalar encoded since the last flush, in one write(2)
  // (retried on a short write). IoError naming the file if it fails, or if
  // the file was removed while the run wrote it (its curve would go into a
  // file no one can open).
  void flush();

 private:
  std::string path_;
  UniqueFd fd_;
  std::string pending_;  // TFRecords not yet written
  int earlier_files_ = 0;  // other event files in the folder when this one was made
  bool resumed_ = false, warned_ = false;
  bool scalars_ = false;  // a scalar was added: without one the file is removed at the end
};

// Every monitor the config enables, for rank `rank`: only rank 0 writes
// (DeepSpeed's rule), elsewhere every call does nothing. write() goes to
// each enabled monitor; flush() ends a step (csv_monitor's rows are already
// in their files; tensorboard's go out then).
class Monitors {
 public:
  Monitors(const Config& c, int rank);
  ~Monitors();
  bool enabled() const { return csv_ != nullptr || tb_ != nullptr; }
  void write(const std::string& tag, double value, int64_t step);
  void flush();
  // A resumed run, before its first write: x of the last step saved.
  void resumed(int64_t step);

 private:
  std::unique_ptr<CsvMonitor> csv_;
  std::unique_ptr<TensorBoardWriter> tb_;
};

}  // namespace zinc::tools
