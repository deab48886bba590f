// zinc-bench data-open: what opening a prepared token file costs, with and
// without the check of its tokens' CRC-32 (Note [prepared sets] in
// data/data.cpp), against reading the file's bytes once (the bound: every
// open reads the whole file for the largest token anyway).
//
// One file of 256M uint16 tokens (512 MiB) in ZINC_BENCH_DATA_PATH (default
// /tmp), page-cached by a first read, opened as a token source with the
// header's tokens' CRC record and with words 12-13 zero (an earlier
// zinc.prepare's set: no CRC), alternately, over --rounds rounds; the bound
// is a plain pread of the same bytes in the same 1 MiB reads. Reported: each
// open's rate, its time over the read's, and the CRC's share of the open.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <isa-l/crc.h>

#include "bench/benches.h"
#include "core/unique_fd.h"
#include "data/data.h"

namespace zinc::bench {
namespace {

void put_i32(std::vector<unsigned char>& b, size_t word, uint32_t v) {
  for (int k = 0; k < 4; ++k) b[4 * word + static_cast<size_t>(k)] = static_cast<unsigned char>(v >> (8 * k));
}

// Writes the file: a zinc.prepare header (with or without the tokens' CRC
// record) and `tokens` uint16 tokens below 50000.
void write_file(const std::string& path, int64_t tokens, bool with_crc, uint32_t* crc_out) {
  std::vector<unsigned char> body(static_cast<size_t>(tokens) * 2);
  uint32_t x = 12345;
  for (int64_t i = 0; i < tokens; ++i) {
    x = x * 1664525u + 1013904223u;
    const uint32_t t = (x >> 8) % 50000;
    body[2 * static_cast<size_t>(i)] = static_cast<unsigned char>(t);
    body[2 * static_cast<size_t>(i) + 1] = static_cast<unsigned char>(t >> 8);
  }
  const uint32_t crc = crc32_gzip_refl(0, body.data(), body.size());
  if (crc_out) *crc_out = crc;
  std::vector<unsigned char> header(1024, 0);
  put_i32(header, 0, 20240520);
  put_i32(header, 1, 1);
  put_i32(header, 2, static_cast<uint32_t>(tokens));
  put_i32(header, 3, 0x434E495A);
  put_i32(header, 4, 1);
  if (with_crc) {
    put_i32(header, 12, 0x43524354);
    put_i32(header, 13, crc);
  }
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw Error("data-open bench: cannot create " + path);
  const bool ok = std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
                  std::fwrite(body.data(), 1, body.size(), f) == body.size();
  if (std::fclose(f) != 0 || !ok) throw Error("data-open bench: cannot write " + path);
}

// Seconds to read `path` once in 1 MiB preads.
double read_once(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw Error("data-open bench: cannot open " + path);
  std::vector<char> buf(size_t{1} << 20);
  const double t0 = now_s();
  int64_t off = 0;
  for (;;) {
    const ssize_t n = ::pread(fd.get(), buf.data(), buf.size(), off);
    if (n < 0) throw Error("data-open bench: read " + path);
    if (n == 0) break;
    off += n;
  }
  return now_s() - t0;
}

double open_once(const std::string& path) {
  DataConfig c;
  c.type = DataType::kTokens;
  c.path = path;
  c.seq_len = 1024;
  c.vocab_size = 0;  // the largest token + 1
  const double t0 = now_s();
  std::shared_ptr<const DataSource> s = make_data_source(c);
  const double t = now_s() - t0;
  if (s->num_samples() <= 0) throw Error("data-open bench: no samples");
  return t;
}

}  // namespace

int bench_data_open(const BenchOptions& o) {
  const char* env = std::getenv("ZINC_BENCH_DATA_PATH");
  const std::string folder = env && *env ? env : "/tmp";
  const int64_t tokens = int64_t{1} << 28;
  const std::string with = folder + "/zinc-bench-data-crc.bin", without = folder + "/zinc-bench-data-nocrc.bin";
  write_file(with, tokens, true, nullptr);
  write_file(without, tokens, false, nullptr);
  const double bytes = static_cast<double>(tokens) * 2 + 1024;
  read_once(with);  // page-cached
  read_once(without);
  std::vector<double> t_read, t_crc, t_plain;
  for (int r = 0; r < o.rounds; ++r) {
    t_read.push_back(read_once(with));
    t_crc.push_back(open_once(with));
    t_plain.push_back(open_once(without));
  }
  ::unlink(with.c_str());
  ::unlink(without.c_str());
  const double read = median(t_read), crc = median(t_crc), plain = median(t_plain);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  for (const bool checked : {true, false}) {
    const double t = checked ? crc : plain;
    char human[384];
    std::snprintf(human, sizeof human,
                  "data-open %-8s 512 MiB of tokens, page-cached: %.2f GiB/s, bound (a read of the same bytes) "
                  "%.2f GiB/s, ratio %.2f%s",
                  checked ? "crc" : "no-crc", bytes / t / gib, bytes / read / gib, read / t,
                  checked ? ("; the check adds " + std::to_string(static_cast<int>(100.0 * (crc - plain) / plain + 0.5)) +
                             "% to an open").c_str()
                          : "");
    emit(o.json, {{"bench", "data-open"}, {"case", checked ? "crc" : "no-crc"}, {"figure", bytes / t / gib},
                  {"unit", "GiB/s"}, {"bound", bytes / read / gib}, {"ratio", read / t},
                  {"crc_share", (crc - plain) / plain}},
         human);
  }
  return 0;
}

}  // namespace zinc::bench
