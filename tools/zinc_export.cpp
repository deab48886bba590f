// zinc-export: a checkpoint's weights as safetensors (Note [safetensors] in
// tools/safetensors.cpp).
//
//   zinc-export CHECKPOINT_DIR [--tag T] --out model.safetensors
//               [--dtype fp32|bf16] [--max-shard-size 5GB]
//   zinc-export CHECKPOINT_DIR [--tag T] --format hf --out DIR [--dtype fp32|bf16|fp16]
//   zinc-export CHECKPOINT_DIR [--tag T] --format peft --out DIR   (a LoRA run's adapters)
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "core/error.h"
#include "tools/cli_errors.h"
#include "tools/hf_model.h"
#include "tools/output_folder.h"
#include "tools/peft_adapter.h"
#include "tools/safetensors.h"

namespace {
// SIGINT, SIGTERM and SIGHUP ended an export at once, its temporaries left
// beside --out. Now the first one stops the writers (stop_writers in
// tools/output_folder.h): the export unwinds, removing what it wrote, and
// --out keeps what it held; a second one ends the process at once (what it
// leaves is hidden, and the next export of --out removes it). As in
// zinc-train, the signals are taken by one thread that waits for them.
void start_signal_thread() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread([set] {
    for (bool again = false;; again = true) {
      int sig = 0;
      while (sigwait(&set, &sig) != 0) {
      }
      if (again) {
        std::fprintf(stderr, "zinc-export: %s again: stopping now\n", zinc::tools::signal_text(sig).c_str());
        std::_Exit(128 + sig);
      }
      zinc::tools::stop_writers(sig);
      std::fprintf(stderr, "zinc-export: %s: stopping at the next write; what this export wrote is removed (again to stop now)\n",
                   zinc::tools::signal_text(sig).c_str());
    }
  }).detach();
}

int export_main(int argc, char** argv) {
  start_signal_thread();
  std::signal(SIGXFSZ, SIG_IGN);  // a write past ulimit -f: EFBIG, reported naming the file (not a silent death)
  CLI::App app{"zinc-export: write a zinc checkpoint's weights (the fp32 master weights, consolidated over "
               "every rank's shards) as safetensors, one tensor per model parameter"};
  zinc::tools::ExportOptions opts;
  std::string dtype, max_shard = zinc::tools::kDefaultMaxShardSize, format = "safetensors";
  app.add_option("checkpoint_dir", opts.checkpoint_dir, "checkpoint folder (holds `latest` and the tags)")->required();
  app.add_option("--tag", opts.tag, "the tag to export (default: the one `latest` names)");
  app.add_option("--out", opts.out, "output file, NAME.safetensors (sharded: NAME-0000k-of-0000n.safetensors "
                                    "and NAME.safetensors.index.json beside it)")
      ->required();
  app.add_option("--format", format, "safetensors (zinc's names, one file or shards; the default), hf (a Hugging "
                                     "Face model folder at --out: config.json, transformers' names and layouts, the "
                                     "source folder's tokenizer files; for checkpoints of Hugging Face models) or "
                                     "peft (a LoRA checkpoint's adapters as a PEFT adapter folder at --out: "
                                     "adapter_config.json and adapter_model.safetensors, fp32)")
      ->check(CLI::IsMember({"safetensors", "hf", "peft"}));
  app.add_option("--dtype", dtype, "fp32 (the master weights as trained), bf16 (rounded to nearest even) or fp16 "
                                   "(hf only); default fp32, with --format hf the source folder's torch_dtype "
                                   "else bf16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--max-shard-size", max_shard, "largest file before sharding: bytes or with a unit (KB, MB, GB, "
                                                "KiB, MiB, GiB; GB = 10^9 bytes as the Hugging Face tools count)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return zinc::tools::usage_error(app, e, "zinc-export");
  }
  try {
    auto progress = [](const std::string& line) { std::printf("zinc-export: %s\n", line.c_str()); };
    if (format == "peft") {
      if (!dtype.empty() && dtype != "fp32")
        throw zinc::Error("--dtype " + dtype + ": --format peft writes fp32, as PEFT's save_pretrained does");
      if (app.count("--max-shard-size") > 0)
        throw zinc::Error("--max-shard-size: --format peft writes one adapter_model.safetensors, as PEFT does");
      zinc::tools::PeftExportOptions po;
      po.out_dir = opts.out;
      po.what = "--out";
      const zinc::tools::PeftExportResult r = zinc::tools::export_checkpoint_peft(opts.checkpoint_dir, opts.tag, po);
      std::printf("zinc-export: %s: %lld LoRA tensors, %.2f MiB of fp32 (PEFT's %s and %s)\n", opts.out.c_str(),
                  static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / (1 << 20),
                  zinc::tools::kAdapterConfigFile, zinc::tools::kAdapterWeightsFile);
      return 0;
    }
    if (format == "hf") {
      zinc::tools::HfExportOptions ho;
      ho.out_dir = opts.out;
      ho.what = "--out";
      if (!dtype.empty())
        ho.dtype = dtype == "fp32" ? zinc::DType::kF32 : dtype == "bf16" ? zinc::DType::kBF16 : zinc::DType::kF16;
      ho.max_shard_bytes = zinc::tools::parse_size(max_shard, "--max-shard-size");
      const zinc::tools::HfExportResult r =
          zinc::tools::export_checkpoint_hf(opts.checkpoint_dir, opts.tag, ho, progress);
      std::printf("zinc-export: %s: %lld tensors, %.1f MiB of %s in %zu file%s, %zu tokenizer/generation files copied\n",
                  opts.out.c_str(), static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / (1 << 20),
                  std::string(zinc::dtype_name(r.dtype)).c_str(), r.files.size(), r.files.size() == 1 ? "" : "s",
                  r.copied.size());
      return 0;
    }
    if (dtype.empty()) dtype = "fp32";
    if (dtype == "fp16") throw zinc::Error("--dtype fp16: only with --format hf");
    opts.dtype = dtype == "bf16" ? zinc::DType::kBF16 : zinc::DType::kF32;
    opts.max_shard_bytes = zinc::tools::parse_size(max_shard, "--max-shard-size");
    const zinc::tools::ExportResult r =
        zinc::tools::export_safetensors(opts, progress);
    std::printf("zinc-export: %s/%s: %lld tensors, %.1f MiB of %s in %zu file%s\n", opts.checkpoint_dir.c_str(),
                r.tag.c_str(), static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / (1 << 20),
                dtype.c_str(), r.files.size(), r.files.size() == 1 ? "" : "s");
    return 0;
  } catch (const std::exception& e) {
    std::string what = e.what();  // the writers' messages name the program already
    if (what.rfind("zinc-export: ", 0) == 0) what.erase(0, 13);
    if (const int sig = zinc::tools::writers_stopped_by(); sig != 0) {
      std::fprintf(stderr, "zinc-export: %s; nothing was written to %s (what it held before is as it was)\n",
                   what.c_str(), opts.out.c_str());
      return 128 + sig;
    }
    std::fprintf(stderr, "zinc-export: error: %s\n", what.c_str());
    return 1;
  }
}
}  // namespace

int main(int argc, char** argv) {
  zinc::tools::standard_streams();
  const int rc = export_main(argc, argv);
  if (rc == 0 && zinc::tools::writers_stopped_by() != 0)
    std::fprintf(stderr, "zinc-export: the %s came after the last write: the export is complete\n",
                 zinc::tools::signal_text(zinc::tools::writers_stopped_by()).c_str());
  return zinc::tools::output_checked(rc, "zinc-export");
}
