// zinc tools: Hugging Face model folders (config.json + safetensors) as
// zinc models, and the map between zinc's parameters and transformers'
// tensors (Note [Hugging Face names] in hf_model.cpp).
//
// The architectures are those of the registry's families (models/family.h);
// anything else is refused with one line naming the architecture.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "engine/model.h"
#include "models/family.h"
#include "models/models.h"
#include "tools/safetensors.h"

namespace zinc::ckpt {
class CheckpointReader;
}

namespace zinc::tools {

// A folder's config.json as zinc reads it: its family (models/family.h)
// and the family's reading of it.
struct HfConfig {
  std::string dir;
  std::string architecture;  // architectures[0], e.g. "LlamaForCausalLM"
  const models::Family* family = nullptr;
  std::shared_ptr<models::FamilyConfig> model;  // the family's reading of it
  // The weights' dtype as config.json states it ("torch_dtype", or "dtype"
  // since transformers 5): the default dtype of an export.
  std::optional<DType> dtype;
  nlohmann::json raw;  // the document itself
};

// Reads and checks DIR/config.json. Throws zinc::Error naming the file and
// the key: an unsupported architecture, activation or rope scaling, a size
// that breaks the model's rules.
HfConfig read_hf_config(const std::string& dir);
// The same checks on a config.json document already read; `path` names it
// in errors. HfConfig::dir is left empty.
HfConfig parse_hf_config(const nlohmann::json& raw, const std::string& path);
// The model of `cfg` with the specs' initial values (no weights read).
std::shared_ptr<Model> make_hf_model(const HfConfig& cfg, Device device = Device::kCpu,
                                     bool gradient_checkpointing = false);

using models::HfPiece;

// The pieces of every parameter of a zinc model built from `cfg`, per block
// and parameter in the model's order, with the prefix the folder uses
// ("transformer." / "model." or none). Tensor names zinc never reads (a tied
// lm_head.weight, GPT-2's attention-mask buffers, rotary inv_freq) are
// listed by hf_ignored_tensor.
models::HfPieces hf_pieces(const HfConfig& cfg, const Model& model, const std::string& prefix);
bool hf_ignored_tensor(const HfConfig& cfg, const std::string& name);

// The model of `cfg` with the folder's weights as its initial values
// (Model::initial_values), checked up front: every tensor present with its
// shape and a readable dtype, and no tensor left over. `device` and
// `gradient_checkpointing` as the models' configs take them.
// With lora enabled, the model carries LoRA adapters (its base frozen):
// from adapter_dir (a PEFT adapter folder; its adapter_model.safetensors
// checked as the weights are: every adapter tensor present with its shape,
// none left over), or initialised as PEFT does when adapter_dir is empty.
std::shared_ptr<Model> load_pretrained(const HfConfig& cfg, Device device = Device::kCpu,
                                       bool gradient_checkpointing = false, const models::LoraConfig& lora = {},
                                       const std::string& adapter_dir = "");

// A digest of the weights in the Hugging Face folder `dir` (xxh3, hex),
// from each safetensors file's size, header and 64 pieces of 4 KiB spread
// over it: the same files give the same digest wherever they lie, and a
// folder of other weights (another checkpoint, a retrained model) another
// one, at the cost of reading a few MiB. A LoRA checkpoint records it
// (client_state.hf_fingerprint): its frozen base is not saved in it.
std::string hf_weights_fingerprint(const std::string& dir);

}  // namespace zinc::tools

namespace zinc::tools {

// The HfConfig of a model zinc built itself (no folder): config.json as its
// family writes it (FamilyConfig::config_json).
HfConfig hf_config_of(const models::FamilyConfig& model);

// Reads block `block` whole: its flat fp32 vector in the BlockLayout (as
// Engine::full_params returns it).
using BlockReader = std::function<std::vector<float>(int block)>;

// An engine's BlockReader for exports (Engine::full_params, a collective:
// every rank calls it in the same order), except for a frozen block
// (LoRA's base) whose values the model's initial_values give: the source
// folder's, exact, where the engine keeps only their compute copy (bf16 in
// a bf16 run). `full` reads the engine.
BlockReader export_reader(const Model& model, BlockReader full);

struct HfExportOptions {
  std::string out_dir;             // created if missing
  std::optional<DType> dtype;      // default: cfg.dtype, else bf16
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
  std::string copy_from;           // a source folder whose tokenizer and generation files are copied unchanged
  int rank = 0;                    // only rank 0 writes
  // What the run reads (folders and files besides copy_from): out_dir must
  // not be, nor hold, any of them (tools/output_folder.h).
  std::vector<std::string> inputs;
  std::string what = "export folder";  // how messages name out_dir ("--save-pretrained", ...)
  // A model with LoRA adapters is written with each adapter merged into
  // the weight it adapts (PEFT's merge_and_unload); without this it is
  // refused (the adapters alone go to a PEFT folder: export_peft_adapter).
  bool merge_adapters = false;
};

struct HfExportResult {
  std::vector<std::string> files;  // the safetensors files
  std::string index;               // model.safetensors.index.json when sharded
  std::vector<std::string> copied; // files copied from copy_from
  int64_t tensors = 0, bytes = 0;
  DType dtype = DType::kBF16;
};

// Writes `model`'s weights, read through `read`, into out_dir in the Hugging
// Face layout that transformers' from_pretrained reads: config.json
// (cfg.raw with the dtype updated), model.safetensors (or
// model-0000k-of-0000n.safetensors and model.safetensors.index.json above
// max_shard_bytes) with transformers' names and layouts (Note [Hugging Face
// names]), and the tokenizer and generation files of copy_from. The folder
// is replaced as one unit (tools/output_folder.h: written beside its place
// and swapped in; the user's other files in it kept, stale weights of the
// other layout dropped), so a kill at any moment leaves the old folder or
// the new one. Refused before anything is written when out_dir is, or
// holds, copy_from or one of opts.inputs. `read` is
// called once per block in model order (a collective read, e.g.
// Engine::full_params, may be behind it; with rank != 0 every block is
// read and nothing written, so that all ranks take part).
// Refuses (Error) a tokenizer or generation file of the model folder
// `source` that an export would copy but cannot: a dangling link, a FIFO,
// a folder, or a file past the side files' size limit. Dropped without a
// word, the export had no tokenizer; refused at the export, the run had
// trained first. zinc-train checks at its start; export_hf again.
void check_side_files(const std::string& source, const std::string& what);
HfExportResult export_hf(const HfConfig& cfg, const Model& model, const BlockReader& read, const HfExportOptions& opts,
                         const std::function<void(const std::string&)>& progress = nullptr);

// zinc-export --format hf: a zinc-train checkpoint (which stores the model's
// config.json and source folder in its client_state) as export_hf writes
// it, from the checkpoint's fp32 master weights. Throws zinc::Error naming
// the checkpoint when it holds no such config or its parameters differ.
// A BlockReader of a checkpoint's fp32 master weights (reader and model
// must outlive it).
BlockReader checkpoint_master_reader(ckpt::CheckpointReader& reader, const Model& model);
// Throws zinc::Error naming `dir` unless a checkpoint's metadata `blocks`
// are `model`'s, block for block and parameter for parameter (names, shapes,
// which are frozen).
void check_checkpoint_blocks(const std::string& dir, const nlohmann::json& blocks, const Model& model,
                             const std::string& architecture);
HfExportResult export_checkpoint_hf(const std::string& checkpoint_dir, const std::string& tag, HfExportOptions opts,
                                    const std::function<void(const std::string&)>& progress = nullptr);

}  // namespace zinc::tools
