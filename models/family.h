// zinc models: model families and their registry (Note [model families] in
// models/registry.cpp; docs/adding-a-model.md for the steps).
//
// A family is everything zinc knows about one kind of Hugging Face model,
// in one folder, models/<family>/: reading its config.json (with the size
// rules), building the model, the map between transformers' tensor names
// and layouts and zinc's parameters (used both ways: load and export), and
// the config.json an export writes. tools/ (model folders, exports,
// zinc-train) and the Python module ask the registry
// (family_for_architecture) and the family's FamilyConfig; none of them
// switches on a family. The benches build their models through zinc-train's
// config (model.type) and choose only the sizes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/model.h"
#include "models/models.h"

namespace zinc::config {
class Reader;  // engine/config_reader.h
}

namespace zinc::models {

// A config document read with its path in every error:
// "DIR/config.json: KEY: what" (zinc::Error).
class ConfigDoc {
 public:
  ConfigDoc(std::string path, const nlohmann::json& j) : path_(std::move(path)), j_(j) {}
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const;
  bool has(const std::string& k) const { return j_.contains(k) && !j_[k].is_null(); }
  bool is_null(const std::string& k) const { return j_.contains(k) && j_[k].is_null(); }  // present as null
  int64_t get_int(const std::string& k) const;  // required: "missing" when absent
  int64_t get_int(const std::string& k, int64_t dflt) const;
  double get_number(const std::string& k, double dflt) const;
  bool get_bool(const std::string& k, bool dflt) const;
  std::string get_string(const std::string& k, const std::string& dflt) const;
  const nlohmann::json& at(const std::string& k) const { return j_[k]; }
  const std::string& path() const { return path_; }

 private:
  int64_t to_int(const nlohmann::json& v, const std::string& k) const;
  std::string path_;
  const nlohmann::json& j_;
};

// One transformers tensor that makes up rows of a zinc parameter: `rows`
// rows of the zinc parameter, stored in the file as `name` of `shape`
// (transposed: GPT-2's Conv1D keeps (in, out) where zinc keeps (out, in)).
// A piece may be part of a tensor: file rows [file_row, file_row + rows)
// of it (GPT-NeoX's query_key_value interleaves q, k and v per head; zinc's
// q rows are every head's first third). The pieces of one tensor together
// cover it and belong to one zinc parameter; transposed pieces are whole.
struct HfPiece {
  std::string name;
  std::vector<int64_t> shape;  // the whole tensor's, as in the file
  int64_t rows = 0;            // rows of the zinc parameter it fills
  bool transposed = false;
  int64_t file_row = -1;       // -1: the piece is the whole tensor
};
// Per block, per parameter (in the model's order), the pieces it is made of.
using HfPieces = std::vector<std::vector<std::vector<HfPiece>>>;

struct Family;

// One model of a family, as its config.json (or zinc's own sizes) describe
// it: what tools need to know of it without knowing the family.
class FamilyConfig {
 public:
  virtual ~FamilyConfig() = default;
  virtual const Family& family() const = 0;
  virtual std::unique_ptr<FamilyConfig> clone() const = 0;

  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_positions() const = 0;  // the longest sequence the model takes
  virtual int64_t hidden_size() const = 0;    // the Trainer's model.config.hidden_size
  virtual bool tied_head() const = 0;         // the head is the token embedding

  // A head in the file whose values differ from the embedding although
  // config.json says the two are tied: transformers 5 keeps them apart.
  // A family that can does the same (and its config_json says so from then
  // on); one that cannot throws, naming `where`.
  virtual void untie_head(const std::string& where) = 0;

  // The model, with the initial values of its specs (no weights read).
  virtual std::shared_ptr<Model> build(Device device, bool gradient_checkpointing) const = 0;

  // The pieces of every parameter of `model` (built by build()), with the
  // folder's tensor-name prefix ("model.", "transformer." or none).
  virtual HfPieces pieces(const Model& model, const std::string& prefix) const = 0;
  // Tensor names a file may hold that zinc never reads (a tied head,
  // attention-mask buffers, rotary inv_freq).
  virtual bool ignored_tensor(const std::string& name) const = 0;

  // config.json for an export of this model (transformers' keys; a folder's
  // own config.json is written back as it was read instead). Families with
  // no architecture throw.
  virtual nlohmann::json config_json() const = 0;

  // zinc's `model` section: every key the family reads there, with its
  // value (--check and the config event echo it; read back, it gives the
  // same model).
  virtual nlohmann::json section_json() const = 0;
  // The first size rule the model breaks (the field named as its section
  // key), or nothing.
  virtual std::optional<SizeError> size_error() const = 0;
  // What the data decides: the vocabulary (vocab_size > 0 sets it) and the
  // positions a section left at 0 (from seq_len). Throws ConfigError at
  // model.KEY when the data does not fit the model.
  virtual void fit_data(int64_t vocab_size, int64_t seq_len) = 0;
  // Whether the model can recompute its layers in backward.
  virtual bool supports_checkpointing() const { return true; }
  // LoRA adapters on the model built from now on (LoraConfig: the base
  // frozen, one adapter block per layer named "<layer block>.lora" with
  // PEFT's tensor names). Families that take none throw ConfigError at
  // model.lora naming why.
  // set_lora resolves target_modules (all-linear, PEFT's default for an
  // empty list) into the family's module names in model order.
  virtual void set_lora(const LoraConfig& lora);
  virtual const LoraConfig& lora() const;
  // Whether PEFT's adapter_config.json says fan_in_fan_out (Conv1D layers).
  virtual bool lora_fan_in_fan_out() const { return false; }
  // PEFT's merge_and_unload: block `block`'s flat fp32 weights (`flat`, in
  // its BlockLayout) plus scale * B A of each adapter in `adapter_flat`,
  // the flat weights of its adapter block `adapter` (both blocks of
  // `model`, built by build()).
  virtual void merge_lora(const Model& model, int block, std::vector<float>& flat, int adapter,
                          const std::vector<float>& adapter_flat) const;
  // The pieces of LoRA adapter parameter `param` of adapter block `block`
  // in a PEFT adapter file, where it is named `name`: the whole tensor, or
  // where the family keeps the adapted weight's rows in another order than
  // its files (GPT-NeoX's query_key_value), B's rows in the same pieces.
  virtual std::vector<HfPiece> adapter_pieces(const Model& model, int block, int param, const std::string& name) const;
};

// `lora` with its target_modules resolved for a family whose linear
// modules are `modules` (in model order) and whose PEFT default is
// `defaults`: all-linear is every module, an empty list the defaults, any
// other list ordered as the model orders it (names the family lacks kept at
// the end, for its size rules to name).
LoraConfig resolve_lora_targets(LoraConfig lora, const std::vector<std::string>& modules,
                                const std::vector<std::string>& defaults);

// PEFT's merge of one adapter: w (rows, in) += scale * (B @ A), B (rows, r)
// and A (r, in), the product summed in fp32 as PEFT's get_delta_weight does.
void add_lora_delta(float* w, const float* A, const float* B, int64_t rows, int64_t in, int64_t r, float scale);
// The adapter at `path` ("self_attn.q_proj") of the adapter block `adapter`
// merged into the rows from `row` of parameter `weight` of block `block`
// (flat vectors in their BlockLayouts); false where the adapter block has
// no such adapter (not a target).
bool merge_lora_module(const Model& model, int block, std::vector<float>& flat, int adapter,
                       const std::vector<float>& adapter_flat, const std::string& weight, const std::string& path,
                       int64_t row, float scale);

// The suffix of an adapter block's name: "layers.3.lora" adapts "layers.3",
// whose tensors PEFT names "base_model.model." + the module's path.
inline constexpr const char* kAdapterBlockSuffix = ".lora";
inline bool is_adapter_block(const std::string& block_name) {
  const std::string s = kAdapterBlockSuffix;
  return block_name.size() > s.size() && block_name.compare(block_name.size() - s.size(), s.size(), s) == 0;
}

// A family's fixed description; the registry holds one per family.
struct Family {
  std::string name;                        // zinc's model.type: "gpt", "llama"
  std::vector<std::string> architectures;  // config.json architectures[0] values it reads
  std::string embed_tensor;                // the token embedding's name, without prefix: finds a folder's prefix
  std::string export_prefix;               // the prefix an export writes: "model.", "transformer."
  std::string max_positions_key;           // config.json's name for max_positions()
  std::string hidden_size_key;             // the `model` section's (and config.json's) name for hidden_size()
  // config.json (its document, `doc` naming the file) for `architecture`,
  // checked: throws zinc::Error naming the file and the key.
  std::unique_ptr<FamilyConfig> (*read)(const ConfigDoc& doc, const std::string& architecture) = nullptr;
  // zinc's `model` section for model.type `name`: the keys it takes besides
  // the common ones (type, vocab_size, from_pretrained,
  // gradient_checkpointing), each with its config.json name where that
  // differs ({"block_size", "n_positions"}; empty: the same), and the
  // reader of those keys (defaults: the family's config struct's; throws
  // ConfigError at the key's path).
  std::vector<std::pair<std::string, std::string>> section_keys;
  std::unique_ptr<FamilyConfig> (*from_section)(config::Reader& section) = nullptr;
};

// Every family, in the registry's order (models/registry.cpp).
const std::vector<const Family*>& families();
// The family of model.type `name`, or nullptr.
const Family* family_named(const std::string& name);
// The family that reads `architecture`, or nullptr.
const Family* family_for_architecture(const std::string& architecture);
// The model a family's `model` section gives with no keys (its defaults).
std::shared_ptr<const FamilyConfig> section_defaults(const Family& family);
// Every architecture the registry reads, comma-separated (for messages).
std::string supported_architectures_text();

}  // namespace zinc::models
