// zinc-bench nvme: NvmeStore write and read bandwidth on one large file
// against fio with the same block size, queue depth and O_DIRECT through
// io_uring, on a file of the same size in the same folder, measured in
// alternating rounds in the same process. The settings are DeepSpeed's aio
// defaults (block_size 1 MiB, queue_depth 8, one ring).
//
// Note [buffer layout on a virtual disk]
// On this machine (a Firecracker guest, virtio-blk with max_segments 254)
// the cost is per guest-physical segment of the host buffer: a 1 MiB request
// from physically contiguous pages is one host operation, from scattered
// pages up to 256. Bandwidth then depends on the buffer as much as on the
// disk: a large fresh allocation (the store's PinnedBuffer) is mostly
// contiguous and reads about 2.5x faster than fio's own buffers. So each
// direction is measured twice: from a PinnedBuffer (how the engine's swapper
// uses the store) and from a buffer whose pages were faulted in shuffled
// order (no two neighbours contiguous: the worst case, close to fio's).
//
// Environment: ZINC_BENCH_NVME_PATH (default: the current folder; must be on
// the disk, not tmpfs), ZINC_BENCH_NVME_BYTES (default 1 GiB, rounded up to
// 1 MiB).
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <linux/magic.h>

#include "bench/benches.h"
#include "offload/offload.h"

namespace zinc::bench {
namespace {

constexpr int64_t kBlock = 1 << 20;
constexpr int kDepth = 8;

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs a command and returns its standard output; throws if it cannot run or
// exits non-zero.
std::string run(const std::string& cmd) {
  FILE* p = ::popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) throw Error("nvme bench: cannot run " + cmd + ": " + std::strerror(errno));
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  if (status != 0) throw Error("nvme bench: `" + cmd + "` failed (status " + std::to_string(status) + ")");
  return out;
}

}  // namespace

void require_fio() {
  try {
    run("fio --version");
  } catch (const Error&) {
    throw Error("nvme bench: fio not found; it measures the bound (install it: apt-get install fio)");
  }
}

// One fio job with the store's settings; returns bytes per second.
double fio_bw(const std::string& file, int64_t bytes, bool write, const std::string& block) {
  const std::string rw = write ? "write" : "read";
  const std::string out =
      run("fio --name=zinc-nvme --filename=" + shell_quote(file) + " --size=" + std::to_string(bytes) +
          " --ioengine=io_uring --direct=1 --bs=" + block + " --iodepth=" + std::to_string(kDepth) + " --rw=" + rw +
          " --numjobs=1 --output-format=json");
  const size_t start = out.find('{');  // fio may print notes before the JSON
  if (start == std::string::npos) throw Error("nvme bench: no JSON from fio: " + out);
  const nlohmann::json j = nlohmann::json::parse(out.substr(start));
  const double bw = j.at("jobs").at(0).at(rw).at("bw_bytes").get<double>();
  if (bw <= 0) throw Error("nvme bench: fio reported no " + rw + " bandwidth");
  return bw;
}

namespace {

// Anonymous memory whose 4 KiB pages are faulted in a shuffled order, so that
// virtually adjacent pages are (almost) never physically adjacent. Owns the
// mapping.
class ScatteredBuffer {
 public:
  explicit ScatteredBuffer(size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw posix_error("nvme bench: mmap of " + std::to_string(bytes) + " bytes", errno);
    data_ = static_cast<char*>(p);
    ::madvise(data_, bytes, MADV_NOHUGEPAGE);  // a huge page would be one contiguous segment
    std::vector<size_t> pages(bytes / 4096);
    std::iota(pages.begin(), pages.end(), size_t{0});
    std::shuffle(pages.begin(), pages.end(), std::mt19937_64(1));
    for (size_t page : pages) data_[page * 4096] = 1;
  }
  ~ScatteredBuffer() { ::munmap(data_, bytes_); }
  ScatteredBuffer(const ScatteredBuffer&) = delete;
  ScatteredBuffer& operator=(const ScatteredBuffer&) = delete;
  char* data() const { return data_; }

 private:
  char* data_ = nullptr;
  size_t bytes_;
};

void fill(void* buf, int64_t bytes, uint64_t seed) {
  auto* p = static_cast<uint64_t*>(buf);
  for (size_t i = 0; i < static_cast<size_t>(bytes) / 8; ++i) p[i] = (i + seed) * 0x9E3779B97F4A7C15ull;
}

bool check(const void* buf, int64_t bytes, uint64_t seed) {
  const auto* p = static_cast<const uint64_t*>(buf);
  for (size_t i = 0; i < static_cast<size_t>(bytes) / 8; ++i)
    if (p[i] != (i + seed) * 0x9E3779B97F4A7C15ull) return false;
  return true;
}

}  // namespace

int bench_nvme(const BenchOptions& o) {
  const char* env_path = std::getenv("ZINC_BENCH_NVME_PATH");
  const char* env_bytes = std::getenv("ZINC_BENCH_NVME_BYTES");
  const std::string path = env_path && *env_path ? env_path : ".";
  int64_t bytes = env_bytes && *env_bytes ? std::strtoll(env_bytes, nullptr, 10) : int64_t{1} << 30;
  if (bytes <= 0) throw Error("nvme bench: ZINC_BENCH_NVME_BYTES must be a positive byte count");
  bytes = (bytes + kBlock - 1) / kBlock * kBlock;
  struct statfs sfs {};
  if (::statfs(path.c_str(), &sfs) != 0) throw posix_error("nvme bench: " + path, errno);
  if (sfs.f_type == TMPFS_MAGIC || sfs.f_type == RAMFS_MAGIC)
    throw Error("nvme bench: " + path + " is in memory (tmpfs); set ZINC_BENCH_NVME_PATH to a folder on the disk");
  require_fio();
  const int rounds = std::max(1, o.rounds);

  offload::NvmeOptions opt;
  opt.path = path;
  opt.block_size = kBlock;
  opt.queue_depth = kDepth;
  offload::NvmeStore store(opt, 0);
  if (!store.direct_io()) throw Error("nvme bench: " + path + " refuses O_DIRECT; the comparison would be unfair");
  const int file = store.create("bench", bytes);
  const std::string fio_file = store.folder() + "/fio.dat";  // removed below; the folder goes with the store
  offload::PinnedBuffer pinned(static_cast<size_t>(bytes));
  ScatteredBuffer scattered(static_cast<size_t>(bytes));
  void* const bufs[2] = {pinned.data(), scattered.data()};

  // Bytes per second, per buffer kind [pinned, scattered] and for fio.
  std::vector<double> store_w[2], store_r[2], fio_w, fio_r;
  bool verified = true;
  for (int r = 0; r < rounds; ++r) {
    const bool store_first = r % 2 == 0;  // alternate the order so that neither always runs on a warmer disk
    const auto seed = static_cast<uint64_t>(r);
    auto store_writes = [&] {
      for (int k = 0; k < 2; ++k) {
        fill(bufs[k], bytes, seed);
        const double t0 = now_s();
        store.write(file, 0, bufs[k], bytes).wait();
        store_w[k].push_back(static_cast<double>(bytes) / (now_s() - t0));
      }
    };
    auto store_reads = [&] {
      for (int k = 0; k < 2; ++k) {
        std::memset(bufs[k], 0, static_cast<size_t>(bytes));
        const double t0 = now_s();
        store.read(file, 0, bufs[k], bytes).wait();
        store_r[k].push_back(static_cast<double>(bytes) / (now_s() - t0));
        verified = verified && check(bufs[k], bytes, seed);
      }
    };
    if (store_first) store_writes();
    fio_w.push_back(fio_bw(fio_file, bytes, true));
    if (!store_first) store_writes();
    if (store_first) store_reads();
    fio_r.push_back(fio_bw(fio_file, bytes, false));
    if (!store_first) store_reads();
  }
  ::unlink(fio_file.c_str());
  if (!verified) throw Error("nvme bench: the data read back differs from the data written");

  struct Case {
    std::string name;
    const char* buffer;
    double figure, bound;
  };
  const char* kinds[2] = {"pinned", "scattered"};
  std::vector<Case> cases;
  for (int k = 0; k < 2; ++k)
    cases.push_back({std::string("write/1MiB-qd8") + (k ? "-scattered" : ""), kinds[k], median(store_w[k]), median(fio_w)});
  for (int k = 0; k < 2; ++k)
    cases.push_back({std::string("read/1MiB-qd8") + (k ? "-scattered" : ""), kinds[k], median(store_r[k]), median(fio_r)});
  for (const Case& c : cases) {
    const double ratio = c.figure / c.bound;
    nlohmann::json line = {{"bench", "nvme"},  {"case", c.name},        {"figure", c.figure / 1e9},
                           {"unit", "GB/s"},   {"bound", c.bound / 1e9}, {"ratio", ratio},
                           {"buffer", c.buffer}, {"bytes", bytes},       {"rounds", rounds},
                           {"path", path}};
    char h[512];
    std::snprintf(h, sizeof h,
                  "nvme %-24s %lld MiB, O_DIRECT io_uring, 1 ring, %s buffer, %d rounds: NvmeStore %.2f GB/s | "
                  "bound fio %.2f GB/s | ratio %.3f",
                  c.name.c_str(), static_cast<long long>(bytes >> 20), c.buffer, rounds, c.figure / 1e9,
                  c.bound / 1e9, ratio);
    emit(o.json, line, h);
  }
  return 0;
}

}  // namespace zinc::bench
