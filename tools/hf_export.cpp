// Writing a zinc model in the Hugging Face layout (hf_model.h: export_hf),
// and the config.json of a model zinc built itself.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "tools/hf_model.h"
#include "tools/output_folder.h"
#include "tools/safetensors.h"

namespace zinc::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A tokenizer file is tens of MB at most; a bound keeps /dev/zero out.
constexpr int64_t kMaxSideFileBytes = int64_t{1} << 30;

const char* torch_dtype_name(DType t) {
  return t == DType::kF32 ? "float32" : t == DType::kBF16 ? "bfloat16" : "float16";
}

// The files of a model folder that are not its weights or config and that
// an export carries over unchanged: the tokenizer's and generation's.
const std::vector<std::string>& side_files() {
  static const std::vector<std::string> kFiles = {
      "tokenizer.json",  "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
      "vocab.json",      "merges.txt",            "added_tokens.json",       "generation_config.json",
      "chat_template.jinja", "chat_template.json"};
  return kFiles;
}

// A file copied whole into the staging folder (fsynced: the folder is
// swapped in after it).
void copy_side_file(const fs::path& from, const fs::path& to, const std::string& writer) {
  ckpt::write_file_atomic(to.string(), read_small_file(from.string(), kMaxSideFileBytes, "side file"), writer);
}

// The files of an earlier export that this one replaces even when it does
// not write them again (Note [export folders]): weights of the other layout
// (one file against shards and their index), which every reader would
// otherwise take over the new ones.
bool replaced_by_export(const std::string& name) {
  static const std::regex kShard("model-[0-9]{5}-of-[0-9]{5}\\.safetensors");
  return name == "model.safetensors" || name == "model.safetensors.index.json" || name == "config.json" ||
         std::regex_match(name, kShard);
}

}  // namespace

BlockReader export_reader(const Model& model, BlockReader full) {
  return [&model, full = std::move(full)](int b) {
    const BlockSpec& spec = model.blocks()[static_cast<size_t>(b)];
    if (spec.frozen) {
      const BlockLayout l = BlockLayout::from_spec(spec);
      std::vector<float> flat(static_cast<size_t>(l.numel), 0.0f);
      bool all = true;
      for (size_t p = 0; p < spec.params.size() && all; ++p)
        all = model.initial_values(b, static_cast<int>(p), 0, l.numels[p], flat.data() + l.offsets[p]);
      if (all) return flat;
      // No source (a model zinc built itself): the values it trained with.
      // Every rank takes this branch alike (the same model), so the
      // collective stays in step.
    }
    return full(b);
  };
}

HfConfig hf_config_of(const models::FamilyConfig& model) {
  HfConfig h;
  h.family = &model.family();
  h.model = model.clone();
  h.raw = model.config_json();
  h.architecture = h.raw["architectures"][0].get<std::string>();
  return h;
}

// A weight that is not finite in the written dtype (a merge whose
// lora_alpha / r times B A overflowed, or a value past fp16's 65504) would
// give a folder zinc itself refuses to load: the export stops naming the
// tensor, and the folder it would replace stays as it was. `half`: the
// 16-bit values written (null in fp32).
static void refuse_non_finite(const std::string& name, const std::vector<float>& v, const uint16_t* half, DType dtype) {
  const uint16_t exp16 = dtype == DType::kF16 ? 0x7c00 : 0x7f80;  // a 16-bit infinity's or NaN's exponent bits
  int64_t bad = 0;
  float largest = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const bool finite = half ? (half[i] & exp16) != exp16 : std::isfinite(v[i]);
    bad += !finite;
    if (std::isfinite(v[i])) largest = std::max(largest, std::fabs(v[i]));
  }
  if (bad == 0) return;
  const bool overflow = half && std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  char big[32];
  std::snprintf(big, sizeof big, "%g", static_cast<double>(largest));
  throw Error("export: tensor " + name + " would hold " + std::to_string(bad) + " non-finite value" +
              (bad == 1 ? "" : "s") + " in " + std::string(dtype_name(dtype)) +
              (overflow ? " (its largest magnitude is " + std::string(big) + ", past what " +
                              std::string(dtype_name(dtype)) + " holds; export in bf16 or fp32)"
                        : " (NaN or infinity in the weights: a merge whose adapters' scale overflowed, or a "
                          "diverged run)") +
              "; nothing was replaced");
}

void check_side_files(const std::string& source, const std::string& what) {
  if (source.empty()) return;
  for (const std::string& f : side_files()) {
    const fs::path from = fs::path(source) / f;
    std::error_code ec;
    const fs::file_status link = fs::symlink_status(from, ec);
    if (!fs::exists(link)) continue;  // not there: nothing to copy
    const fs::file_status st = fs::status(from, ec);
    std::string kind;
    if (!fs::exists(st)) kind = "a symbolic link to " + fs::read_symlink(from, ec).string() + ", which does not exist";
    else if (fs::is_directory(st)) kind = "a folder";
    else if (!fs::is_regular_file(st)) kind = "not a regular file (a FIFO, a device or a socket)";
    else if (const auto size = fs::file_size(from, ec); !ec && size > static_cast<uintmax_t>(kMaxSideFileBytes))
      kind = std::to_string(size) + " bytes, over the " + std::to_string(kMaxSideFileBytes) + " an export copies";
    if (!kind.empty())
      throw Error(what + ": " + from.string() + " is " + kind + "; an export copies the model folder's tokenizer "
                  "and generation files: fix it, or remove it from the folder");
  }
}

HfExportResult export_hf(const HfConfig& cfg, const Model& model, const BlockReader& read, const HfExportOptions& opts,
                         const std::function<void(const std::string&)>& progress) {
  HfExportResult result;
  result.dtype = opts.dtype ? *opts.dtype : cfg.dtype ? *cfg.dtype : DType::kBF16;
  const std::string& prefix = cfg.family->export_prefix;
  auto pieces = hf_pieces(cfg, model, prefix);
  // LoRA: each layer block's adapter block, merged into it (the adapter
  // blocks themselves have no tensor in the folder).
  std::vector<int> adapter_of(pieces.size(), -1);
  for (size_t a = 0; a < pieces.size(); ++a) {
    const std::string& name = model.blocks()[a].name;
    if (!models::is_adapter_block(name)) continue;
    if (!opts.merge_adapters)
      throw Error(opts.what + ": the model has LoRA adapters: write them in PEFT's format (zinc-train "
                              "--save-adapter), or merged into the weights (--merge)");
    const std::string layer = name.substr(0, name.size() - std::strlen(models::kAdapterBlockSuffix));
    for (size_t b = 0; b < pieces.size(); ++b)
      if (model.blocks()[b].name == layer) adapter_of[b] = static_cast<int>(a);
    pieces[a].clear();
  }
  const fs::path out(opts.out_dir);
  const bool writer = opts.rank == 0;
  // The folder is written whole beside its place and swapped in at the end
  // (Note [export folders]); it must not be, or hold, what the run reads.
  std::optional<OutputFolder> folder;
  if (writer) {
    std::vector<std::string> inputs = opts.inputs;
    if (!opts.copy_from.empty()) inputs.push_back(opts.copy_from);
    folder.emplace(opts.out_dir, opts.what, inputs);
    check_model_kind(opts.out_dir, opts.what, false);
  }
  const fs::path stage = writer ? fs::path(folder->staging()) : fs::path();

  // Every tensor in model order, then shards: a new file when the next
  // tensor would pass the limit.
  // A tensor made of several pieces (file_row >= 0) is written once, where
  // a piece first names it.
  std::vector<SafeTensor> tensors;
  std::set<std::string> listed;
  for (const auto& block : pieces)
    for (const auto& param : block)
      for (const HfPiece& pc : param)
        if (listed.insert(pc.name).second) tensors.push_back({pc.name, result.dtype, pc.shape});
  std::vector<size_t> shard_of(tensors.size());
  std::vector<std::vector<SafeTensor>> shards(1);
  int64_t in_shard = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!shards.back().empty() && in_shard + tensors[i].bytes() > opts.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(tensors[i]);
    shard_of[i] = shards.size() - 1;
    in_shard += tensors[i].bytes();
  }
  auto shard_name = [&](size_t k) {
    if (shards.size() == 1) return std::string("model.safetensors");
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    return std::string(name);
  };

  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::unique_ptr<SafetensorsWriter> w;
  size_t open_shard = 0, t = 0;
  json weight_map = json::object();
  std::vector<uint16_t> half;
  auto finish_shard = [&] {
    if (!w) return;
    w->finish();
    result.bytes += w->data_bytes();
    result.files.push_back((out / shard_name(open_shard)).string());
    if (progress) {  // in the staging folder: in place when the folder is (the summary line says so)
      char line[160];
      std::snprintf(line, sizeof line, "staged %s: %.1f MiB", shard_name(open_shard).c_str(),
                    static_cast<double>(w->data_bytes()) / (1 << 20));
      progress(line);
    }
    w.reset();
    export_fault_point("shard");
  };
  for (size_t b = 0; b < pieces.size(); ++b) {
    if (models::is_adapter_block(model.blocks()[b].name)) continue;  // merged into its layer
    std::vector<float> flat = read(static_cast<int>(b));
    if (adapter_of[b] >= 0) {
      const std::vector<float> adapter = read(adapter_of[b]);  // every rank: a collective read
      if (writer) cfg.model->merge_lora(model, static_cast<int>(b), flat, adapter_of[b], adapter);
    }
    if (!writer) continue;
    const BlockSpec& spec = model.blocks()[b];
    const BlockLayout layout = BlockLayout::from_spec(spec);
    for (size_t p = 0; p < pieces[b].size(); ++p) {
      const float* src = flat.data() + layout.offsets[p];
      int64_t rows = 0;
      for (const HfPiece& pc : pieces[b][p]) rows += pc.rows;
      const int64_t cols = layout.numels[p] / std::max<int64_t>(rows, 1);
      // Each file tensor of this parameter in the file's layout, in the
      // order the pieces first name them (parts of a tensor filled in place).
      std::vector<std::pair<std::string, std::vector<float>>> files;
      int64_t r0 = 0;
      for (const HfPiece& pc : pieces[b][p]) {
        auto it = std::find_if(files.begin(), files.end(), [&](const auto& f) { return f.first == pc.name; });
        if (it == files.end()) {
          const int64_t file_rows = pc.file_row < 0 ? pc.rows : pc.shape.empty() ? 1 : pc.shape[0];
          files.emplace_back(pc.name, std::vector<float>(static_cast<size_t>(file_rows * cols)));
          it = files.end() - 1;
        }
        std::vector<float>& v = it->second;
        if (pc.transposed) {
          for (int64_t r = 0; r < pc.rows; ++r)
            for (int64_t c = 0; c < cols; ++c) v[static_cast<size_t>(c * pc.rows + r)] = src[(r0 + r) * cols + c];
        } else {
          const int64_t at = pc.file_row < 0 ? 0 : pc.file_row;
          if ((at + pc.rows) * cols > static_cast<int64_t>(v.size()) || (r0 + pc.rows) * cols > layout.numels[p])
            throw Error("export: " + pc.name + ": the family's tensor map puts rows outside the tensor (a bug)");
          std::copy(src + r0 * cols, src + (r0 + pc.rows) * cols, v.begin() + at * cols);
        }
        r0 += pc.rows;
      }
      for (auto& [name, v] : files) {
        if (!w || shard_of[t] != open_shard) {
          finish_shard();
          open_shard = shard_of[t];
          w = std::make_unique<SafetensorsWriter>((stage / shard_name(open_shard)).string(), shards[open_shard], metadata);
        }
        if (result.dtype == DType::kF32) {
          refuse_non_finite(name, v, nullptr, result.dtype);
          w->append(v.data(), v.size() * 4);
        } else {
          half.resize(v.size());
          convert_f32_to_16(v.data(), half.data(), v.size(), result.dtype);
          refuse_non_finite(name, v, half.data(), result.dtype);
          w->append(half.data(), half.size() * 2);
        }
        weight_map[name] = shard_name(open_shard);
        ++t;
        ++result.tensors;
      }
    }
  }
  if (!writer) return result;
  finish_shard();
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", result.bytes}}}, {"weight_map", weight_map}};
    result.index = (out / "model.safetensors.index.json").string();
    ckpt::write_file_atomic((stage / "model.safetensors.index.json").string(), index.dump(2) + "\n", opts.what);
  }
  json config = cfg.raw;
  config.erase("dtype");
  config["torch_dtype"] = torch_dtype_name(result.dtype);
  ckpt::write_file_atomic((stage / "config.json").string(), config.dump(2) + "\n", opts.what);
  if (!opts.copy_from.empty()) {
    check_side_files(opts.copy_from, opts.what);
    for (const std::string& f : side_files()) {
      const fs::path from = fs::path(opts.copy_from) / f;
      if (!fs::is_regular_file(from)) continue;
      copy_side_file(from, stage / f, opts.what);
      result.copied.push_back(f);
    }
  }
  folder->commit(replaced_by_export);
  if (progress) progress("wrote " + (out / "config.json").string());
  return result;
}

void check_checkpoint_blocks(const std::string& dir, const json& blocks, const Model& model,
                             const std::string& architecture) {
  const auto& specs = model.blocks();
  bool same = blocks.size() == specs.size();
  for (size_t b = 0; same && b < specs.size(); ++b) {
    same = blocks[b].at("name") == specs[b].name && blocks[b].at("params").size() == specs[b].params.size() &&
           blocks[b].value("frozen", false) == specs[b].frozen;
    for (size_t p = 0; same && p < specs[b].params.size(); ++p) {
      const Shape& sh = specs[b].params[p].shape;
      same = blocks[b]["params"][p].at("name") == specs[b].params[p].name &&
             blocks[b]["params"][p].at("shape").get<std::vector<int64_t>>() ==
                 std::vector<int64_t>(sh.dims.begin(), sh.dims.begin() + sh.ndim);
    }
  }
  if (!same)
    throw Error(dir + ": the checkpoint's parameters are not those of the " + architecture +
                " its client_state describes");
}

HfExportResult export_checkpoint_hf(const std::string& checkpoint_dir, const std::string& tag, HfExportOptions opts,
                                    const std::function<void(const std::string&)>& progress) {
  const ckpt::TagFiles files = ckpt::open_tag(checkpoint_dir, tag);
  const json client = files.meta.value("client_state", json::object());
  if (!client.is_object() || !client.contains("hf_config"))
    throw Error(files.dir + ": the checkpoint holds no Hugging Face config (zinc-train stores one for a gpt or llama "
                            "model; this one is model \"" + files.meta.value("model", std::string("?")) +
                "\" or was saved before it did); use the default --format safetensors");
  const HfConfig cfg = parse_hf_config(client.at("hf_config"), files.dir + ": client_state.hf_config");
  const std::shared_ptr<Model> model = make_hf_model(cfg);
  // The checkpoint's blocks must be this model's, parameter for parameter.
  const json& blocks = files.meta.at("blocks");
  for (const json& b : blocks)
    if (b.value("frozen", false))
      throw Error(files.dir + ": a LoRA checkpoint (its base frozen, not saved in it): --format hf needs the base; "
                              "zinc-train --save-adapter writes the adapters in PEFT's format and --save-pretrained "
                              "--merge the merged model, and the default --format safetensors writes the adapters");
  check_checkpoint_blocks(files.dir, blocks, *model, cfg.architecture);
  // The source folder's tokenizer files, and no export into it.
  const CheckpointSource source = checkpoint_source(
      client.contains("hf_source") && client["hf_source"].is_string() ? client["hf_source"].get<std::string>() : "",
      checkpoint_dir);
  if (opts.copy_from.empty() && !source.dir.empty() && fs::is_directory(source.dir)) opts.copy_from = source.dir;
  if (!source.relative.empty() && opts.copy_from.empty())
    log_warn(opts.what + ": " + files.dir + " names its source model by the relative path " + source.relative +
             " (an earlier zinc-train wrote it so), which is not known from here: no tokenizer files are copied; "
             "copy them from that folder");
  opts.inputs.insert(opts.inputs.end(), source.protect.begin(), source.protect.end());
  // The checkpoint being read (and the folder that holds its tags) is not
  // an export folder either.
  opts.inputs.push_back(files.dir);
  opts.inputs.push_back(checkpoint_dir);
  ckpt::CheckpointReader reader(files.dir, files.ranks, files.block_names);
  return export_hf(cfg, *model, checkpoint_master_reader(reader, *model), opts, progress);
}

BlockReader checkpoint_master_reader(ckpt::CheckpointReader& reader, const Model& model) {
  return [&reader, &model](int b) {
    const BlockLayout layout = BlockLayout::from_spec(model.blocks()[static_cast<size_t>(b)]);
    std::vector<float> flat(static_cast<size_t>(layout.numel));
    reader.read(b, ckpt::kMaster, 0, layout.numel, flat.data());
    return flat;
  };
}

}  // namespace zinc::tools
