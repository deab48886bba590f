// offload: PinnedBuffer, the io_uring engine, the fault-injecting engine and
// NvmeStore (round trips over every aio setting, short transfers, injected
// EIO/ENOSPC, bad paths, the O_DIRECT fallback, cleanup).
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <malloc.h>

#include "core/error.h"
#include "offload/detail/io_detail.h"
#include "offload/offload.h"
#include "temp_dir.h"

namespace zinc::offload {
namespace {

namespace fs = std::filesystem;

#define EXPECT_CONTAINS(text, part)                                                        \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "\"" << (text) << "\"\n" \
                                                             << "does not contain \"" << (part) << "\""

void fill_random(const PinnedBuffer& b, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* p = b.as<uint64_t>();
  for (size_t i = 0; i < b.bytes() / 8; ++i) p[i] = rng();
}

bool same(const PinnedBuffer& a, const PinnedBuffer& b, size_t bytes) {
  return std::memcmp(a.data(), b.data(), bytes) == 0;
}

NvmeOptions small_options(const std::string& path) {
  NvmeOptions o;
  o.path = path;
  o.block_size = 64 << 10;  // several pieces per request at test sizes
  return o;
}

// Writes random data of each size into its own file, reads it back into
// zeroed buffers and compares.
void round_trip(NvmeStore& store, const std::vector<int64_t>& sizes, uint64_t seed) {
  std::vector<int> files;
  std::vector<PinnedBuffer> src, dst;
  for (size_t i = 0; i < sizes.size(); ++i) {
    files.push_back(store.create("rt" + std::to_string(i), sizes[i]));
    src.emplace_back(sizes[i]);
    dst.emplace_back(sizes[i]);
    fill_random(src.back(), seed + i);
  }
  std::vector<IoTicket> tickets;
  for (size_t i = 0; i < sizes.size(); ++i) tickets.push_back(store.write(files[i], 0, src[i].data(), sizes[i]));
  for (auto& t : tickets) t.wait();
  tickets.clear();
  for (size_t i = 0; i < sizes.size(); ++i) tickets.push_back(store.read(files[i], 0, dst[i].data(), sizes[i]));
  for (auto& t : tickets) t.wait();
  for (size_t i = 0; i < sizes.size(); ++i)
    EXPECT_TRUE(same(src[i], dst[i], static_cast<size_t>(sizes[i]))) << "size " << sizes[i];
}

// ---- PinnedBuffer ----

TEST(PinnedBuffer, IsPageAlignedAndZeroed) {
  for (size_t bytes : {size_t{1}, size_t{4096}, size_t{12345}, size_t{1} << 20}) {
    PinnedBuffer b(bytes);
    ASSERT_NE(b.data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4096, 0u);
    EXPECT_EQ(b.bytes(), bytes);
    const auto* p = b.as<unsigned char>();
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
    EXPECT_EQ(nonzero, 0u) << bytes;
  }
}

// Note [pinned buffers are mapped, not malloc'd]: malloc neither serves a
// buffer (its heap, or its own mmapped chunks) nor sees it freed, which
// would raise its mmap threshold and keep later buffers in the heap. Huge
// page buffers are 2 MiB-aligned.
TEST(PinnedBuffer, IsItsOwnMappingNotMallocs) {
  for (size_t bytes : {size_t{12345}, size_t{5} << 20, (size_t{5} << 20) + 3}) {
    const struct mallinfo2 before = mallinfo2();
    {
      PinnedBuffer b(bytes, false);
      const struct mallinfo2 during = mallinfo2();
      EXPECT_EQ(during.hblkhd, before.hblkhd) << bytes;
      EXPECT_LT(during.uordblks, before.uordblks + 4096) << bytes;
      if (bytes >= (size_t{2} << 20)) EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % (size_t{2} << 20), 0u);
      EXPECT_EQ(b.footprint(), bytes >= (size_t{2} << 20) ? size_t{6} << 20 : size_t{16384});
      b.as<unsigned char>()[bytes - 1] = 1;  // all of it writable
    }
    EXPECT_EQ(mallinfo2().hblkhd, before.hblkhd) << bytes;
  }
}

TEST(PinnedBuffer, LockIsOptionalAndMovesTransferOwnership) {
  PinnedBuffer unlocked(8192, false);
  EXPECT_FALSE(unlocked.locked());
  PinnedBuffer a(8192);
  void* p = a.data();
  const bool locked = a.locked();
  PinnedBuffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.locked(), locked);
  PinnedBuffer c(4096);
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.bytes(), 8192u);
  PinnedBuffer empty(0);
  EXPECT_EQ(empty.data(), nullptr);
}

// ---- engines ----

TEST(UringEngine, MovesBytesAndReportsCompletions) {
  TempDir dir;
  const std::string path = dir.path() + "/f";
  bool direct = true;
  detail::UniqueFd fd = detail::open_scratch(path, direct);
  NvmeOptions o;
  o.queue_depth = 4;
  auto e = make_uring_engine(o);
  PinnedBuffer src(4 * 4096), dst(4 * 4096);
  fill_random(src, 7);
  for (int i = 0; i < 4; ++i) e->submit_write(fd.get(), src.as<char>() + i * 4096, 4096, i * 4096, 100 + i);
  EXPECT_EQ(e->in_flight(), 4);
  e->flush();
  std::vector<bool> seen(4);
  for (int i = 0; i < 4; ++i) {
    const auto c = e->wait();
    ASSERT_GE(c.tag, 100u);
    ASSERT_LT(c.tag, 104u);
    EXPECT_EQ(c.result, 4096);
    seen[c.tag - 100] = true;
  }
  EXPECT_EQ(e->in_flight(), 0);
  EXPECT_EQ(std::count(seen.begin(), seen.end(), true), 4);
  e->submit_read(fd.get(), dst.data(), 4 * 4096, 0, 9);
  const auto c = e->wait();  // wait() submits what is still queued
  EXPECT_EQ(c.tag, 9u);
  EXPECT_EQ(c.result, 4 * 4096);
  EXPECT_TRUE(same(src, dst, 4 * 4096));
  // A bad descriptor comes back as -errno in the completion, not as an exception.
  e->submit_read(-1, dst.data(), 4096, 0, 1);
  EXPECT_EQ(e->wait().result, -EBADF);
}

TEST(UringEngine, InvalidQueueDepthIsAConfigError) {
  NvmeOptions o;
  o.queue_depth = 0;
  EXPECT_THROW(make_uring_engine(o), ConfigError);
}

TEST(FaultyEngine, FailsEveryOperationAfterOkOps) {
  TempDir dir;
  bool direct = true;
  detail::UniqueFd fd = detail::open_scratch(dir.path() + "/f", direct);
  auto e = make_faulty_engine(make_uring_engine(NvmeOptions{}), 2, EIO);
  PinnedBuffer b(4096);
  for (int i = 0; i < 4; ++i) e->submit_write(fd.get(), b.data(), 4096, 0, i);
  e->flush();
  std::vector<int64_t> result(4);
  for (int i = 0; i < 4; ++i) {
    const auto c = e->wait();
    result[c.tag] = c.result;
  }
  EXPECT_EQ(result, (std::vector<int64_t>{4096, 4096, -EIO, -EIO}));
  EXPECT_EQ(e->in_flight(), 0);
}

TEST(FaultyEngine, ShortTransferMovesHalfOnceThenPassesThrough) {
  TempDir dir;
  bool direct = true;
  detail::UniqueFd fd = detail::open_scratch(dir.path() + "/f", direct);
  auto e = make_faulty_engine(make_uring_engine(NvmeOptions{}), 1, 0);
  PinnedBuffer b(4 * 4096);
  std::vector<int64_t> result;
  for (int i = 0; i < 3; ++i) {
    e->submit_write(fd.get(), b.data(), 4 * 4096, 0, i);
    result.push_back(e->wait().result);
  }
  EXPECT_EQ(result, (std::vector<int64_t>{4 * 4096, 2 * 4096, 4 * 4096}));
}

// ---- NvmeStore round trips over the aio settings ----

// (threads, queue_depth, single_submit, overlap_events)
class StoreSettings : public ::testing::TestWithParam<std::tuple<int, int, bool, bool>> {};

TEST_P(StoreSettings, RoundTripsRandomDataOfAwkwardSizes) {
  TempDir dir;
  NvmeOptions o = small_options(dir.path());
  std::tie(o.threads, o.queue_depth, o.single_submit, o.overlap_events) = GetParam();
  NvmeStore store(o, 0);
  EXPECT_TRUE(store.direct_io());  // /tmp is a disk file system here
  // One page; odd multiples of a page; not a multiple of block_size (64 KiB);
  // exactly one and several blocks; several files in flight at once.
  const std::vector<int64_t> sizes = {4096, 3 * 4096, 257 * 4096, 64 << 10, 5 * (64 << 10) + 3 * 4096};
  round_trip(store, sizes, 42);
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  EXPECT_EQ(store.bytes_written(), total);
  EXPECT_EQ(store.bytes_read(), total);
}

INSTANTIATE_TEST_SUITE_P(Aio, StoreSettings,
                         ::testing::Combine(::testing::Values(1, 2), ::testing::Values(1, 8), ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "threads" + std::to_string(std::get<0>(info.param)) + "_qd" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_single" : "_batched") +
                                  (std::get<3>(info.param) ? "_overlap" : "_nooverlap");
                         });

TEST(NvmeStore, RegisteredBuffersUseFixedIoAndRoundTrip) {
  TempDir dir;
  NvmeOptions o = small_options(dir.path());
  o.threads = 2;
  PinnedBuffer src(257 * 4096), dst(257 * 4096), other(8192);
  o.fixed_buffers = {{src.data(), src.bytes()}, {dst.data(), dst.bytes()}};
  NvmeStore store(o, 0);
  if (geteuid() == 0) {
    EXPECT_EQ(store.registered_buffers(), 2);  // root: no memlock limit stands in the way
  } else if (store.registered_buffers() == 0) {
    GTEST_SKIP() << "the kernel refused buffer registration (memlock limit)";
  }
  fill_random(src, 77);
  fill_random(other, 78);
  const int f = store.create("fixed", 257 * 4096 + 8192);
  store.write(f, 0, src.data(), 257 * 4096).wait();     // inside a registered buffer
  store.write(f, 257 * 4096, other.data(), 8192).wait();  // not registered: plain request
  store.read(f, 0, dst.data(), 257 * 4096).wait();
  EXPECT_TRUE(same(src, dst, 257 * 4096));
  PinnedBuffer back(8192);
  store.read(f, 257 * 4096, back.data(), 8192).wait();
  EXPECT_TRUE(same(other, back, 8192));
}

TEST(NvmeStore, ManyConcurrentTicketsAtOffsetsRoundTrip) {
  TempDir dir;
  NvmeOptions o = small_options(dir.path());
  o.threads = 2;
  o.queue_depth = 4;
  NvmeStore store(o, 0);
  constexpr int kFiles = 3, kChunks = 40;
  constexpr int64_t kChunk = 3 * 4096;  // not a multiple of block_size
  std::vector<int> files;
  std::vector<PinnedBuffer> src, dst;
  for (int f = 0; f < kFiles; ++f) {
    files.push_back(store.create("many" + std::to_string(f), kChunks * kChunk));
    src.emplace_back(kChunks * kChunk);
    dst.emplace_back(kChunks * kChunk);
    fill_random(src.back(), 100 + f);
  }
  std::vector<IoTicket> tickets;  // 120 tickets in flight before the first wait
  for (int c = kChunks - 1; c >= 0; --c)
    for (int f = 0; f < kFiles; ++f)
      tickets.push_back(store.write(files[f], c * kChunk, src[f].as<char>() + c * kChunk, kChunk));
  for (auto& t : tickets) t.wait();
  tickets.clear();
  for (int f = 0; f < kFiles; ++f)
    for (int c = 0; c < kChunks; ++c)
      tickets.push_back(store.read(files[f], c * kChunk, dst[f].as<char>() + c * kChunk, kChunk));
  for (auto& t : tickets) t.wait();
  for (int f = 0; f < kFiles; ++f) EXPECT_TRUE(same(src[f], dst[f], kChunks * kChunk)) << f;
}

TEST(NvmeStore, DroppedTicketWaitsAndZeroBytesCompletes) {
  TempDir dir;
  NvmeStore store(small_options(dir.path()), 0);
  const int f = store.create("drop", 1 << 20);
  PinnedBuffer src(1 << 20), dst(1 << 20);
  fill_random(src, 5);
  { IoTicket t = store.write(f, 0, src.data(), 1 << 20); }  // destroyed without wait(): waits
  EXPECT_EQ(store.bytes_written(), 1 << 20);
  IoTicket r = store.read(f, 0, dst.data(), 1 << 20);
  IoTicket moved = std::move(r);
  EXPECT_FALSE(r.valid());
  EXPECT_TRUE(moved.valid());
  moved.wait();
  EXPECT_FALSE(moved.valid());
  moved.wait();  // no-op once waited
  EXPECT_TRUE(same(src, dst, 1 << 20));
  IoTicket none = store.write(f, 4096, src.data(), 0);
  EXPECT_TRUE(none.valid());
  none.wait();
}

TEST(NvmeStore, FolderIsPerRankAndPidAndRemovedOnDestruction) {
  TempDir dir;
  std::string folder, second;
  {
    NvmeStore a(small_options(dir.path()), 3);
    folder = a.folder();
    EXPECT_EQ(fs::path(folder).parent_path(), fs::path(dir.path()));
    EXPECT_EQ(fs::path(folder).filename().string(), "zinc-rank3-" + std::to_string(::getpid()));
    EXPECT_TRUE(fs::is_directory(folder));
    NvmeStore b(small_options(dir.path()), 3);  // same rank, same process: its own folder
    second = b.folder();
    EXPECT_NE(second, folder);
    const int f = a.create("state", 12345);
    PinnedBuffer buf(16384);
    a.write(f, 0, buf.data(), 16384).wait();
    EXPECT_EQ(std::distance(fs::directory_iterator(folder), fs::directory_iterator()), 1);
    EXPECT_EQ(fs::file_size(fs::directory_iterator(folder)->path()), 16384u);  // rounded up to 4096
  }
  EXPECT_FALSE(fs::exists(folder));
  EXPECT_FALSE(fs::exists(second));
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

// ---- injected faults ----

std::function<std::unique_ptr<IoEngine>(const NvmeOptions&)> faulty(int64_t ok_ops, int err) {
  return [=](const NvmeOptions& o) { return make_faulty_engine(make_uring_engine(o), ok_ops, err); };
}

TEST(NvmeStore, ShortTransfersAreResumed) {
  for (int64_t ok_ops : {0, 3}) {
    for (bool overlap : {true, false}) {
      TempDir dir;
      NvmeOptions o = small_options(dir.path());
      o.threads = 2;
      o.overlap_events = overlap;
      NvmeStore store(o, 0, faulty(ok_ops, 0));
      round_trip(store, {4096, 8192, 257 * 4096, 5 * (64 << 10) + 3 * 4096}, 9);
    }
  }
}

TEST(NvmeStore, EintrAndEagainAreRetried) {
  for (int err : {EINTR, EAGAIN}) {
    TempDir dir;
    NvmeStore store(small_options(dir.path()), 0, faulty(2, err));
    round_trip(store, {4096, 257 * 4096}, 11);
  }
}

void expect_write_error(int err, const std::string& text) {
  TempDir dir;
  NvmeStore store(small_options(dir.path()), 0, faulty(2, err));
  const int f = store.create("adam.exp_avg", 1 << 20);
  PinnedBuffer buf(1 << 20);
  IoTicket t = store.write(f, 0, buf.data(), 1 << 20);  // 16 pieces; the third one fails
  try {
    t.wait();
    ADD_FAILURE() << "no IoError for " << text;
  } catch (const IoError& e) {
    const std::string what = e.what();
    EXPECT_CONTAINS(what, "adam.exp_avg");
    EXPECT_CONTAINS(what, store.folder());
    EXPECT_CONTAINS(what, text);
    EXPECT_CONTAINS(what, "write of");
    EXPECT_CONTAINS(what, "at offset 131072");  // the third 64 KiB piece
  }
  // Reads through the same (failed) ring fail the same way instead of hanging.
  EXPECT_THROW(store.read(f, 0, buf.data(), 4096).wait(), IoError);
}

TEST(NvmeStore, InjectedEioOnWriteThrowsIoErrorNamingFileAndOffset) {
  expect_write_error(EIO, "Input/output error");
}

TEST(NvmeStore, InjectedEnospcOnWriteThrowsIoError) { expect_write_error(ENOSPC, "No space left on device"); }

TEST(NvmeStore, DroppedFailedTicketDoesNotThrow) {
  TempDir dir;
  NvmeStore store(small_options(dir.path()), 0, faulty(0, EIO));
  const int f = store.create("dropped", 4096);
  PinnedBuffer buf(4096);
  { IoTicket t = store.write(f, 0, buf.data(), 4096); }  // logs the error, does not throw
  SUCCEED();
}

// ---- paths ----

std::string construction_error(const std::string& path) {
  try {
    NvmeStore store(small_options(path), 0);
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

TEST(NvmeStore, MissingPathIsAnIoErrorNamingIt) {
  TempDir dir;
  const std::string path = dir.path() + "/no/such/folder";
  const std::string what = construction_error(path);
  EXPECT_CONTAINS(what, path);
  EXPECT_CONTAINS(what, "does not exist");
  EXPECT_CONTAINS(what, "No such file or directory");
}

TEST(NvmeStore, RegularFileAsPathIsAnIoError) {
  TempDir dir;
  const std::string path = dir.path() + "/a-file";
  std::ofstream(path) << "x";
  const std::string what = construction_error(path);
  EXPECT_CONTAINS(what, path);
  EXPECT_CONTAINS(what, "Not a directory");
}

TEST(NvmeStore, ReadOnlyPathIsAnIoError) {
  TempDir dir;
  std::string path;
  if (::geteuid() != 0) {
    path = dir.path() + "/ro";
    ASSERT_EQ(::mkdir(path.c_str(), 0555), 0);
  } else {
    // Permission bits do not stop root; sysfs refuses new folders to anyone.
    path = "/sys";
    if (::access("/sys/kernel", F_OK) != 0) GTEST_SKIP() << "no /sys here";
  }
  const std::string what = construction_error(path);
  EXPECT_CONTAINS(what, "nvme_path " + path);
  EXPECT_CONTAINS(what, "is not writable");
}

TEST(NvmeStore, InvalidOptionsAreConfigErrors) {
  TempDir dir;
  NvmeOptions o = small_options(dir.path());
  o.block_size = 1000;
  EXPECT_THROW(NvmeStore(o, 0), ConfigError);
  o = small_options(dir.path());
  o.threads = 0;
  EXPECT_THROW(NvmeStore(o, 0), ConfigError);
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(NvmeStore, FailedPreallocationNamesTheFile) {
  TempDir dir;
  NvmeStore store(small_options(dir.path()), 0);
  // RLIMIT_FSIZE makes the preallocation fail (EFBIG) without filling a disk.
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string what;
  try {
    store.create("too.big", 4 << 20);
  } catch (const IoError& e) {
    what = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_CONTAINS(what, "too.big");
  EXPECT_CONTAINS(what, "File too large");
  // The failed file is gone; the store still works.
  EXPECT_TRUE(fs::is_empty(store.folder()));
  round_trip(store, {8192}, 3);
}

// ---- O_DIRECT fallback ----

TEST(OpenScratch, FallsBackWithoutODirectOnEinval) {
  TempDir dir;
  const std::string path = dir.path() + "/f";
  bool direct = true;
  detail::UniqueFd fd = detail::open_scratch(path, direct, [](const char* p, int flags, mode_t mode) {
    if (flags & O_DIRECT) {
      errno = EINVAL;
      return -1;
    }
    return ::open(p, flags, mode);
  });
  EXPECT_TRUE(fd);
  EXPECT_FALSE(direct);
  EXPECT_EQ(::fcntl(fd.get(), F_GETFL) & O_DIRECT, 0);
}

TEST(OpenScratch, OtherOpenErrorsNameThePath) {
  bool direct = true;
  try {
    detail::open_scratch("/nonexistent-zinc/f", direct);
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_CONTAINS(std::string(e.what()), "/nonexistent-zinc/f");
    EXPECT_CONTAINS(std::string(e.what()), "No such file or directory");
  }
  EXPECT_TRUE(direct);
}

TEST(NvmeStore, TmpfsRoundTripsWithOrWithoutODirect) {
  if (!fs::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  // tmpfs refused O_DIRECT before Linux 6.6 and accepts it since: the store
  // must say which one it got and work either way.
  const std::string probe = "/dev/shm/zinc-offload-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  const bool tmpfs_direct = fd >= 0;
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  NvmeOptions o = small_options("/dev/shm");
  NvmeStore store(o, 0);
  EXPECT_EQ(store.direct_io(), tmpfs_direct);
  round_trip(store, {4096, 257 * 4096}, 17);
}

// ---- misuse ----

TEST(NvmeStoreDeathTest, MisalignedTransferAborts) {
  TempDir dir;
  EXPECT_DEATH(
      {
        NvmeStore store(small_options(dir.path()), 0);
        const int f = store.create("x", 8192);
        PinnedBuffer buf(8192);
        store.write(f, 100, buf.data(), 4096).wait();
      },
      "multiples of 4096");
}

}  // namespace
}  // namespace zinc::offload
