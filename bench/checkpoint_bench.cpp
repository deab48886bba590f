// zinc-bench checkpoint: Engine::save_checkpoint and load_checkpoint
// bandwidth over fio's on the same disk, in the same run.
//
// A 101M-parameter GPT (fp32, one rank, stage 0: 1.2 GB of master weights
// and Adam m, v per checkpoint) is saved and loaded in alternating rounds
// with fio's sequential write and read of a file of the same size in the same
// folder (io_uring, O_DIRECT, queue depth 8, the better of 1 MiB and 4 MiB
// blocks: the disk's own rate without the page cache). figure = checkpoint bytes / seconds of the
// whole call (shards, checksums, fsyncs, metadata, the commit; a load also
// verifies every checksum and rebuilds the compute weights). Between a save
// and its load the checkpoint's pages are dropped from the page cache
// (posix_fadvise DONTNEED after the save's fsyncs), so a load reads the disk,
// as it does after a restart.
//
// A second case has the optimizer states offloaded to NVMe in the same
// folder (stage 1, one rank): a save streams them from the store through the
// swapper's buffers into the checkpoint, a load the other way.
//
// Folder: ZINC_BENCH_NVME_PATH (default /tmp).
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "bench/benches.h"
#include "data/data.h"
#include "engine/engine.h"

namespace zinc::bench {
namespace {
namespace fs = std::filesystem;

int64_t folder_bytes(const fs::path& dir) {
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) n += static_cast<int64_t>(e.file_size());
  return n;
}

void drop_from_page_cache(const fs::path& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

}  // namespace

int bench_checkpoint(const BenchOptions& o) {
  require_fio();
  const char* env = std::getenv("ZINC_BENCH_NVME_PATH");
  const fs::path base = fs::path(env ? env : "/tmp") / ("zinc-ckpt-bench-" + std::to_string(::getpid()));
  fs::create_directories(base);
  const int rounds = std::min(o.rounds, 3);  // each round moves about 5 GB
  const int64_t L = 8, C = 1024, H = 16, V = 256, T = 256;
  nlohmann::json doc = {
      {"train_micro_batch_size_per_gpu", 1},
      {"gradient_accumulation_steps", 1},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-4}}}}},
      {"model", {{"type", "gpt"}, {"n_layer", L}, {"n_head", H}, {"n_embd", C}, {"vocab_size", V}}},
      {"data", {{"type", "synthetic"}, {"vocab_size", V}, {"seq_len", T}}},
  };
  try {
    // "ram": the states in memory; "nvme": offloaded to the same disk, so a
    // save also reads them from the store and a load writes them there: the
    // disk moves every byte twice, and the bound is the two transfers one
    // after the other at fio's rates.
    for (const char* where : {"ram", "nvme"}) {
      const bool nvme = std::string(where) == "nvme";
      nlohmann::json d = doc;
      if (nvme) {
        fs::create_directories(base / "store");
        d["zero_optimization"] = {{"stage", 1},
                                  {"sub_group_size", 4194304},
                                  {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", (base / "store").string()},
                                                         {"buffer_count", 4}, {"pin_memory", true}}}};
      }
      std::vector<double> save_bw, load_bw, fio_w, fio_r;
      int64_t bytes = 0, params = 0;
      zinc::tools::Experiment ex = zinc::tools::build_experiment(d, 1);
      zinc::Engine engine = zinc::Engine::initialize(ex.model, ex.config);
      for (const BlockSpec& b : ex.model->blocks())
        for (const ParamSpec& p : b.params) params += p.shape.numel();
      zinc::DataLoader loader(ex.data, 1, 1, 1, 0, 1);
      engine.train_batch(loader);  // moments that are not zero
      const fs::path ckpt = base / "checkpoints", fio_file = base / "fio.dat";
      for (int r = 0; r < rounds; ++r) {
        fs::remove_all(ckpt);
        double t0 = now_s();
        engine.save_checkpoint(ckpt.string(), "bench");
        const double save_s = now_s() - t0;
        bytes = folder_bytes(ckpt / "bench");
        drop_from_page_cache(ckpt / "bench");
        t0 = now_s();
        engine.load_checkpoint(ckpt.string());
        const double load_s = now_s() - t0;
        save_bw.push_back(static_cast<double>(bytes) / save_s);
        load_bw.push_back(static_cast<double>(bytes) / load_s);
        fs::remove_all(ckpt);  // the disk as the save found it, for fio
        // The disk's best of 1 MiB and 4 MiB requests (zinc writes 2 MiB and
        // reads 4 MiB pieces).
        const double w = std::max(fio_bw(fio_file.string(), bytes, true), fio_bw(fio_file.string(), bytes, true, "4M"));
        const double rd =
            std::max(fio_bw(fio_file.string(), bytes, false), fio_bw(fio_file.string(), bytes, false, "4M"));
        ::unlink(fio_file.c_str());
        // With the states on the same disk: the store's read then the
        // checkpoint's write (a save), the checkpoint's read then the
        // store's write (a load); both are 1 / (1/w + 1/r).
        fio_w.push_back(nvme ? 1 / (1 / w + 1 / rd) : w);
        fio_r.push_back(nvme ? 1 / (1 / w + 1 / rd) : rd);
        if (!o.json)
          std::printf("%s round %d: save %.2f GB/s, load %.2f GB/s | fio write %.2f GB/s, read %.2f GB/s\n", where,
                      r + 1, save_bw.back() / 1e9, load_bw.back() / 1e9, w / 1e9, rd / 1e9);
      }
      struct Case {
        std::string name;
        double figure, bound;
      };
      for (const Case& c : {Case{std::string("save/") + where, median(save_bw), median(fio_w)},
                            Case{std::string("load/") + where, median(load_bw), median(fio_r)}}) {
        const bool save = c.name.rfind("save", 0) == 0;
        const std::string bound_name = nvme ? "fio write and read in turn" : save ? "fio write" : "fio read";
        char human[320];
        std::snprintf(human, sizeof human,
                      "checkpoint %s: %.2f GB/s (%.2f GB, %lld params) | bound %s %.2f GB/s | ratio %.3f",
                      c.name.c_str(), c.figure / 1e9, static_cast<double>(bytes) / 1e9,
                      static_cast<long long>(params), bound_name.c_str(), c.bound / 1e9, c.figure / c.bound);
        emit(o.json,
             {{"bench", "checkpoint"}, {"case", c.name}, {"figure", c.figure / 1e9}, {"unit", "GB/s"},
              {"bound", c.bound / 1e9}, {"bound_kind", bound_name}, {"ratio", c.figure / c.bound},
              {"bytes", bytes}, {"params", params}, {"rounds", rounds}, {"folder", base.parent_path().string()}},
             human);
      }
    }
  } catch (...) {
    std::error_code ec;
    fs::remove_all(base, ec);
    throw;
  }
  std::error_code ec;
  fs::remove_all(base, ec);
  return 0;
}

}  // namespace zinc::bench
