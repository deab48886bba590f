// zinc-export: a checkpoint's weights as safetensors (Note [safetensors] in
// tools/safetensors.cpp).
//
//   zinc-export CHECKPOINT_DIR [--tag T] --out model.safetensors
//               [--dtype fp32|bf16] [--max-shard-size 5GB]
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "core/error.h"
#include "tools/safetensors.h"

int main(int argc, char** argv) {
  CLI::App app{"zinc-export: write a zinc checkpoint's weights (the fp32 master weights, consolidated over "
               "every rank's shards) as safetensors, one tensor per model parameter"};
  zinc::tools::ExportOptions opts;
  std::string dtype = "fp32", max_shard = "5GB";
  app.add_option("checkpoint_dir", opts.checkpoint_dir, "checkpoint folder (holds `latest` and the tags)")->required();
  app.add_option("--tag", opts.tag, "the tag to export (default: the one `latest` names)");
  app.add_option("--out", opts.out, "output file, NAME.safetensors (sharded: NAME-0000k-of-0000n.safetensors "
                                    "and NAME.safetensors.index.json beside it)")
      ->required();
  app.add_option("--dtype", dtype, "fp32 (the master weights as trained) or bf16 (rounded to nearest even)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--max-shard-size", max_shard, "largest file before sharding: bytes or with a unit (KB, MB, GB, "
                                                "KiB, MiB, GiB; GB = 10^9 bytes as the Hugging Face tools count)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    opts.dtype = dtype == "bf16" ? zinc::DType::kBF16 : zinc::DType::kF32;
    opts.max_shard_bytes = zinc::tools::parse_size(max_shard, "--max-shard-size");
    const zinc::tools::ExportResult r =
        zinc::tools::export_safetensors(opts, [](const std::string& line) { std::printf("zinc-export: %s\n", line.c_str()); });
    std::printf("zinc-export: %s/%s: %lld tensors, %.1f MiB of %s in %zu file%s\n", opts.checkpoint_dir.c_str(),
                r.tag.c_str(), static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / (1 << 20),
                dtype.c_str(), r.files.size(), r.files.size() == 1 ? "" : "s");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zinc-export: error: %s\n", e.what());
    return 1;
  }
}
