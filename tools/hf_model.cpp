// Hugging Face model folders as zinc models (hf_model.h).
//
// Note [Hugging Face names]
// zinc's parameters and transformers' tensors differ in fusion (zinc keeps
// some projections fused where the file keeps them apart), layout (GPT-2's
// Conv1D weights are transposed) and names; each family states its own map
// (FamilyConfig::pieces in models/<family>/family.cpp), used both to load
// and to export. A tied head has no tensor of its own in zinc, and
// transformers writes none either (a file that holds one with the
// embedding's values is accepted, unread). The folder's prefix ("model.",
// "transformer." or none) is found from the token embedding's name.
#include "tools/hf_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <optional>
#include <regex>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "engine/checkpoint.h"  // xxh3_hex
#include "engine/config.h"  // parse_json_text
#include "tools/peft_adapter.h"
#include "tools/safetensors_read.h"

namespace zinc::tools {
namespace {

using nlohmann::json;

using models::ConfigDoc;

std::optional<DType> parse_dtype(const ConfigDoc& f) {
  for (const char* k : {"torch_dtype", "dtype"}) {
    if (!f.has(k)) continue;
    const std::string s = f.get_string(k, "");
    if (s == "float32") return DType::kF32;
    if (s == "bfloat16") return DType::kBF16;
    if (s == "float16") return DType::kF16;
    f.fail(k, "\"" + s + "\" is not a dtype zinc writes (float32, bfloat16, float16)");
  }
  return std::nullopt;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// The model's parameters over a SafetensorsFolder (Model::initial_values);
// everything else is the inner model's.
class PretrainedModel final : public Model {
 public:
  // adapter: the PEFT adapter file the blocks marked in from_adapter read
  // (null: none; those blocks then have no pieces and start as PEFT does).
  PretrainedModel(std::shared_ptr<Model> inner, std::unique_ptr<SafetensorsFolder> folder, models::HfPieces pieces,
                  std::unique_ptr<SafetensorsFile> adapter = nullptr, std::vector<char> from_adapter = {})
      : inner_(std::move(inner)),
        folder_(std::move(folder)),
        pieces_(std::move(pieces)),
        adapter_(std::move(adapter)),
        from_adapter_(std::move(from_adapter)) {
    from_adapter_.resize(pieces_.size(), 0);
  }

  std::string name() const override { return inner_->name(); }
  const std::vector<BlockSpec>& blocks() const override { return inner_->blocks(); }
  Device device() const override { return inner_->device(); }
  float forward(StepContext& ctx, const Batch& batch) override { return inner_->forward(ctx, batch); }
  void backward(StepContext& ctx, float loss_scale) override { inner_->backward(ctx, loss_scale); }
  double flops_per_token(int64_t T) const override { return inner_->flops_per_token(T); }
  std::span<const float> logits() const override { return inner_->logits(); }
  std::optional<ActivationMemory> activation_memory(int64_t B, int64_t T, DType dt) const override {
    return inner_->activation_memory(B, T, dt);
  }
  // The file's values are the whole model's (blocks()), whatever part the
  // inner model computes: the engine cuts its part out of them.
  TensorPart tensor_part(int rank, int size, std::string* why) const override {
    return inner_->tensor_part(rank, size, why);
  }
  void use_tensor_part(int rank, int size) override { inner_->use_tensor_part(rank, size); }
  TensorPart expert_part(int rank, int size, std::string* why) const override {
    return inner_->expert_part(rank, size, why);
  }
  void use_expert_part(int rank, int size) override { inner_->use_expert_part(rank, size); }
  std::string sequence_split_error(int size) const override { return inner_->sequence_split_error(size); }
  std::optional<ActivationMemory> sequence_activation_memory(int64_t B, int64_t T, DType dt, int size,
                                                             int tensor_parts) const override {
    return inner_->sequence_activation_memory(B, T, dt, size, tensor_parts);
  }
  std::vector<PipelineLayer> pipeline_layers() const override { return inner_->pipeline_layers(); }
  std::string pipeline_split_error() const override { return inner_->pipeline_split_error(); }
  int64_t pipeline_width() const override { return inner_->pipeline_width(); }
  bool select_activations(int slot) override { return inner_->select_activations(slot); }
  std::optional<ActivationMemory> stage_activation_memory(int64_t B, int64_t T, DType dt, const PipelineStage& st,
                                                          int sets, int tensor_parts) const override {
    return inner_->stage_activation_memory(B, T, dt, st, sets, tensor_parts);
  }

  bool initial_values(int block, int param, int64_t first, int64_t count, float* out) const override {
    const std::vector<HfPiece>& pieces = pieces_.at(static_cast<size_t>(block)).at(static_cast<size_t>(param));
    if (pieces.empty()) return false;  // an adapter with no file: the model's own initialisation
    const bool adapter = from_adapter_[static_cast<size_t>(block)] != 0;
    const int64_t cols = inner_->blocks()[static_cast<size_t>(block)].params[static_cast<size_t>(param)].shape.numel() /
                         total_rows(pieces);
    int64_t at = 0;  // the piece's first element in the zinc parameter
    for (const HfPiece& pc : pieces) {
      const int64_t n = pc.rows * cols;
      const int64_t lo = std::max(first, at), hi = std::min(first + count, at + n);
      if (lo < hi) read_piece(pc, cols, lo - at, hi - lo, out + (lo - first), adapter);
      at += n;
    }
    return true;
  }

 private:
  static int64_t total_rows(const std::vector<HfPiece>& pieces) {
    int64_t r = 0;
    for (const HfPiece& p : pieces) r += p.rows;
    return std::max<int64_t>(r, 1);
  }
  // Elements [first, first + count) of the piece in zinc's (rows, cols) layout.
  void read_piece(const HfPiece& pc, int64_t cols, int64_t first, int64_t count, float* out, bool adapter) const {
    auto [file, t] = adapter ? std::pair<const SafetensorsFile*, const StoredTensor*>{adapter_.get(),
                                                                                     adapter_->find(pc.name)}
                             : folder_->find(pc.name);
    if (!pc.transposed) {
      const int64_t skip = pc.file_row < 0 ? 0 : pc.file_row * cols;  // a part of the tensor: its rows from file_row
      file->read_f32(*t, skip + first, count, out);
      check_finite(*file, *t, out, count);
      return;
    }
    // Conv1D (in = cols, out = rows) in the file: read it whole, transpose.
    std::vector<float> all(static_cast<size_t>(t->numel()));
    file->read_f32(*t, 0, t->numel(), all.data());
    check_finite(*file, *t, all.data(), t->numel());
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = first + i, r = e / cols, c = e % cols;
      out[i] = all[static_cast<size_t>(c * pc.rows + r)];
    }
  }
  // A NaN or an infinity in a pretrained weight makes every step's
  // gradients non-finite: each step would be skipped and the export would
  // carry the damage on. Refused naming the tensor and how many values are
  // bad (counted over the whole tensor, read again: this is the error path).
  static void check_finite(const SafetensorsFile& file, const StoredTensor& t, const float* v, int64_t n) {
    bool finite = true;
    for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(v[i]);
    if (finite) return;
    int64_t bad = 0, first_bad = -1;
    constexpr int64_t kPiece = int64_t{1} << 20;
    std::vector<float> buf(static_cast<size_t>(std::min(kPiece, t.numel())));
    for (int64_t at = 0; at < t.numel(); at += kPiece) {
      const int64_t m = std::min(kPiece, t.numel() - at);
      file.read_f32(t, at, m, buf.data());
      for (int64_t i = 0; i < m; ++i)
        if (!std::isfinite(buf[static_cast<size_t>(i)])) {
          if (first_bad < 0) first_bad = at + i;
          ++bad;
        }
    }
    throw Error(file.path() + ": tensor " + t.name + " holds " + std::to_string(bad) + " non-finite value" +
                (bad == 1 ? "" : "s") + " (NaN or infinity; the first at element " + std::to_string(first_bad) +
                " of " + std::to_string(t.numel()) + "): a damaged or diverged model; zinc does not train from it");
  }

  std::shared_ptr<Model> inner_;
  std::unique_ptr<SafetensorsFolder> folder_;
  models::HfPieces pieces_;
  std::unique_ptr<SafetensorsFile> adapter_;
  std::vector<char> from_adapter_;  // per block
};

// Whether two tensors of a folder hold the same values (read in pieces;
// the first difference ends it).
bool same_values(const SafetensorsFile& fa, const StoredTensor& a, const SafetensorsFile& fb, const StoredTensor& b) {
  if (a.shape != b.shape || !a.readable || !b.readable) return false;
  constexpr int64_t kPiece = int64_t{1} << 20;
  std::vector<float> x(static_cast<size_t>(std::min(kPiece, a.numel()))), y(x.size());
  for (int64_t at = 0; at < a.numel(); at += kPiece) {
    const int64_t n = std::min(kPiece, a.numel() - at);
    fa.read_f32(a, at, n, x.data());
    fb.read_f32(b, at, n, y.data());
    if (std::memcmp(x.data(), y.data(), static_cast<size_t>(n) * 4) != 0) return false;
  }
  return true;
}

// A head the file holds although config.json says tie_word_embeddings true
// (Note [Hugging Face names]): transformers 5 keeps it apart from the
// embedding when the two differ ("both are present in the checkpoints with
// different values, so we will NOT tie them"). zinc's llama does the same,
// and its exports say tie_word_embeddings false, which is what the model
// then is. zinc's gpt always ties its head, so such a GPT-2 folder is
// refused rather than loaded without the head the file holds.
void settle_tied_head(HfConfig& cfg, const SafetensorsFolder& folder) {
  if (!cfg.model->tied_head()) return;
  const auto [head_file, head] = folder.find("lm_head.weight");
  if (!head) return;
  const std::string& embed = cfg.family->embed_tensor;
  for (const char* prefix : {"transformer.", "model.", ""}) {
    const auto [embed_file, emb] = folder.find(prefix + embed);
    if (!emb) continue;
    if (same_values(*head_file, *head, *embed_file, *emb)) return;  // a tied head written out: the same model
    const std::string what = head_file->path() + ": tensor lm_head.weight differs from " + prefix + embed +
                             " although " + cfg.dir + "/config.json says tie_word_embeddings true";
    cfg.model->untie_head(what);  // a family whose head is the embedding throws here
    cfg.raw["tie_word_embeddings"] = false;
    log_warn(what + "; as transformers does, zinc keeps the head apart from the embedding (an export says "
                    "tie_word_embeddings false)");
    return;
  }
}

// A config.json that names more layers than its weights hold is refused
// from the files' headers, before a model of that many layers is built:
// a count of 1000000 (a typo) once took 10 GB and half a minute to report
// the first missing tensor, and 2^31 ran out of memory.
void check_layer_count(const HfConfig& cfg, const SafetensorsFolder& folder) {
  std::string key;
  for (const char* k : {"num_hidden_layers", "n_layer"})
    if (cfg.raw.contains(k) && cfg.raw[k].is_number_integer()) {
      key = k;
      break;
    }
  if (key.empty()) return;  // the family's reader says what is missing
  const int64_t said = cfg.raw[key].get<int64_t>();
  // A layer's tensors: "...layers.N." (the Llama families, GPT-NeoX) or "h.N." (GPT-2).
  static const std::regex layer_re(R"((^|\.)(layers|h)\.([0-9]{1,9})\.)");
  int64_t held = -1;
  for (const std::string& name : folder.names()) {
    std::smatch m;
    if (std::regex_search(name, m, layer_re)) held = std::max<int64_t>(held, std::stoll(m[3].str()));
  }
  if (held < 0 || said <= held + 1) return;  // no layer tensors: the load names the first one missing
  throw Error(cfg.dir + "/config.json: " + key + " is " + std::to_string(said) + ", but the weights (" +
              (folder.index().empty() ? folder.files().front() : folder.index()) + ") hold layers 0-" +
              std::to_string(held) + " only: a config.json of another model, or a damaged one");
}

}  // namespace

std::string hf_weights_fingerprint(const std::string& dir) {
  const SafetensorsFolder folder(dir);
  std::vector<std::string> paths = folder.files();
  std::sort(paths.begin(), paths.end(), [](const std::string& a, const std::string& b) {
    return std::filesystem::path(a).filename() < std::filesystem::path(b).filename();
  });
  std::vector<std::pair<std::string, std::string>> labelled;
  for (const std::string& path : paths) labelled.emplace_back(std::filesystem::path(path).filename().string(), path);
  return ckpt::sampled_files_digest(labelled, "the base model");
}


namespace {

// transformers trains with the dropout config.json sets (GPT-2's and
// Phi-3's resid_pdrop, embd_pdrop, attn_pdrop; attention_dropout,
// hidden_dropout elsewhere); zinc's models have none (LoRA's lora_dropout
// aside), so a fine-tune differs from the Trainer's there. Said once per
// load, naming the keys; a head zinc does not build (classifier_dropout,
// summary_first_dropout) is not this model's.
void warn_dropout_not_applied(const std::string& path, const nlohmann::json& raw) {
  std::string keys;
  for (auto it = raw.begin(); it != raw.end(); ++it) {
    const std::string& k = it.key();
    auto ends = [&](const std::string& tail) {
      return k.size() >= tail.size() && k.compare(k.size() - tail.size(), tail.size(), tail) == 0;
    };
    if (!(ends("dropout") || ends("pdrop")) || k.rfind("classifier", 0) == 0 || k.rfind("summary", 0) == 0) continue;
    if (!it.value().is_number() || !(it.value().get<double>() > 0)) continue;
    keys += (keys.empty() ? "" : ", ") + k + " " + it.value().dump();
  }
  if (!keys.empty())
    log_warn(path + ": dropout is not applied (" + keys +
             "): zinc's models train without dropout, as transformers' do in eval mode; a fine-tune differs from "
             "one with it (LoRA's lora_dropout is applied)");
}

}  // namespace

HfConfig read_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::string text;
  try {
    // A regular file of bounded size (a FIFO or /dev/zero is refused, not read without end).
    text = read_small_file(path, kMaxJsonFileBytes, "the model's config.json");
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + " (is " + dir + " a Hugging Face model folder?)");
  }
  // The config reader's parser: a number out of range (1e400), a duplicate
  // key or a runaway nesting is refused naming the file, line and column.
  HfConfig cfg = parse_hf_config(parse_json_text(text, path), path);
  cfg.dir = dir;
  std::optional<SafetensorsFolder> folder;
  try {
    folder.emplace(cfg.dir);
  } catch (const Error&) {
    return cfg;  // no readable weights: load_pretrained says so when it reads them
  }
  check_layer_count(cfg, *folder);
  settle_tied_head(cfg, *folder);
  return cfg;
}

HfConfig parse_hf_config(const nlohmann::json& raw, const std::string& path) {
  HfConfig cfg;
  cfg.raw = raw;
  if (!cfg.raw.is_object()) throw Error(path + ": expected a JSON object");
  ConfigDoc f(path, cfg.raw);
  if (!f.has("architectures") || !cfg.raw["architectures"].is_array() || cfg.raw["architectures"].empty() ||
      !cfg.raw["architectures"][0].is_string()) {
    f.fail("architectures", "missing; zinc loads " + models::supported_architectures_text());
  }
  cfg.architecture = cfg.raw["architectures"][0].get<std::string>();
  cfg.family = models::family_for_architecture(cfg.architecture);
  if (!cfg.family)
    f.fail("architectures",
           "\"" + cfg.architecture + "\" is not supported; zinc loads " + models::supported_architectures_text());
  cfg.dtype = parse_dtype(f);
  cfg.model = cfg.family->read(f, cfg.architecture);
  // transformers builds the model from model_type (AutoConfig), zinc from
  // architectures: a folder whose two disagree is another model there,
  // and an export copies its config.json. Said, naming both.
  static const std::map<std::string, std::vector<std::string>> kModelTypes = {
      {"GPT2LMHeadModel", {"gpt2"}},         {"GPTNeoXForCausalLM", {"gpt_neox"}},
      {"GemmaForCausalLM", {"gemma"}},       {"Gemma2ForCausalLM", {"gemma2"}},
      {"Gemma3ForCausalLM", {"gemma3_text", "gemma3"}},
      {"GraniteForCausalLM", {"granite"}},   {"LlamaForCausalLM", {"llama"}},
      {"MistralForCausalLM", {"mistral"}},   {"MixtralForCausalLM", {"mixtral"}},
      {"Olmo2ForCausalLM", {"olmo2"}},       {"Phi3ForCausalLM", {"phi3"}},
      {"Qwen2ForCausalLM", {"qwen2"}},       {"Qwen3ForCausalLM", {"qwen3"}},
      {"Qwen3MoeForCausalLM", {"qwen3_moe"}}, {"SmolLM3ForCausalLM", {"smollm3"}}};
  const auto known = kModelTypes.find(cfg.architecture);
  if (known != kModelTypes.end() && cfg.raw.contains("model_type") && cfg.raw["model_type"].is_string()) {
    const std::string type = cfg.raw["model_type"].get<std::string>();
    if (std::find(known->second.begin(), known->second.end(), type) == known->second.end())
      log_warn(path + ": model_type \"" + type + "\" is not " + cfg.architecture + "'s (\"" + known->second.front() +
               "\"): zinc reads the folder as its architectures entry says, a " + cfg.architecture +
               ", but transformers builds the model from model_type, so this folder (and an export of it, which "
               "keeps its config.json) loads as another model there");
  }
  warn_dropout_not_applied(path, cfg.raw);
  return cfg;
}

bool hf_ignored_tensor(const HfConfig& cfg, const std::string& name) { return cfg.model->ignored_tensor(name); }

models::HfPieces hf_pieces(const HfConfig& cfg, const Model& model, const std::string& prefix) {
  return cfg.model->pieces(model, prefix);
}

std::shared_ptr<Model> make_hf_model(const HfConfig& cfg, Device device, bool gradient_checkpointing) {
  return cfg.model->build(device, gradient_checkpointing);
}

std::shared_ptr<Model> load_pretrained(const HfConfig& cfg, Device device, bool gradient_checkpointing,
                                       const models::LoraConfig& lora, const std::string& adapter_dir) {
  std::shared_ptr<Model> inner;
  if (lora.enabled()) {
    std::unique_ptr<models::FamilyConfig> fc = cfg.model->clone();
    fc->set_lora(lora);  // a family without LoRA throws at model.lora
    if (auto bad = fc->size_error()) {
      // An adapter folder's configuration is its adapter_config.json's (PEFT's key names).
      if (!adapter_dir.empty() && bad->field.rfind("lora.", 0) == 0)
        throw Error(adapter_dir + "/" + kAdapterConfigFile + ": " + bad->field.substr(5) + ": " + bad->message);
      throw ConfigError("model." + bad->field, bad->message);
    }
    inner = fc->build(device, gradient_checkpointing);
  } else {
    ZINC_CHECK(adapter_dir.empty(), "load_pretrained: an adapter folder needs its LoRA configuration");
    inner = make_hf_model(cfg, device, gradient_checkpointing);
  }
  auto folder = std::make_unique<SafetensorsFolder>(cfg.dir);
  // The prefix from the token embedding's name: the family's own (what an
  // export writes), or one of the usual, or none.
  const std::string& embed = cfg.family->embed_tensor;
  std::string prefix;
  bool found = false;
  for (const std::string& p : {cfg.family->export_prefix, std::string("transformer."), std::string("model."),
                               std::string()}) {
    if (folder->find(p + embed).first) {
      prefix = p;
      found = true;
      break;
    }
  }
  if (!found) {
    std::vector<std::string> prefixes;
    for (const std::string& p : {cfg.family->export_prefix, std::string("transformer."), std::string("model.")})
      if (!p.empty() && std::find(prefixes.begin(), prefixes.end(), p) == prefixes.end()) prefixes.push_back(p);
    const std::string where = folder->files().empty() ? folder->index() + ", whose weight_map names no file"
                                                      : joined(folder->files());
    throw Error(cfg.dir + ": no tensor " + embed + " (nor with a " + joined(prefixes) + " prefix) in " + where);
  }
  auto pieces = hf_pieces(cfg, *inner, prefix);
  // LoRA's adapter blocks: PEFT's names in the adapter file, or no pieces
  // (the model's own initialisation, PEFT's) without one.
  std::unique_ptr<SafetensorsFile> adapter;
  if (!adapter_dir.empty()) {
    const std::string weights = adapter_dir + "/" + kAdapterWeightsFile;
    if (!std::filesystem::exists(weights) && std::filesystem::exists(adapter_dir + "/adapter_model.bin"))
      throw Error(adapter_dir + ": holds adapter_model.bin (PEFT's older pickle format, which zinc does not read: "
                                "loading a pickle runs code) and no " + kAdapterWeightsFile +
                  "; save the adapter again with PEFT's save_pretrained(..., safe_serialization=True)");
    adapter = std::make_unique<SafetensorsFile>(weights);
  }
  std::vector<char> from_adapter(pieces.size(), 0);
  std::map<std::string, bool> adapter_used;
  if (adapter)
    for (const StoredTensor& t : adapter->tensors()) adapter_used[t.name] = false;
  for (size_t b = 0; b < pieces.size(); ++b) {
    const BlockSpec& spec = inner->blocks()[b];
    if (!models::is_adapter_block(spec.name)) continue;
    from_adapter[b] = 1;
    const std::string layer = spec.name.substr(0, spec.name.size() - std::strlen(models::kAdapterBlockSuffix));
    for (size_t p = 0; p < spec.params.size(); ++p) {
      pieces[b][p].clear();
      if (!adapter) continue;
      const ParamSpec& ps = spec.params[p];
      const std::vector<int64_t> shape(ps.shape.dims.begin(), ps.shape.dims.begin() + ps.shape.ndim);
      const std::string name = std::string(kPeftPrefix) + cfg.family->export_prefix + layer + "." + ps.name;
      const StoredTensor* t = adapter->find(name);
      if (!t)
        throw Error(adapter->path() + ": tensor " + name + " " + shape_text(shape) + " is missing (" +
                    kAdapterConfigFile + " names its module in target_modules)");
      if (t->shape != shape)
        throw Error(adapter->path() + ": tensor " + name + " has shape " + shape_text(t->shape) + "; r " +
                    std::to_string(lora.r) + " of " + kAdapterConfigFile + " on this model needs " + shape_text(shape));
      if (!t->readable)
        throw Error(adapter->path() + ": tensor " + name + " is " + t->stored_dtype + "; zinc reads F32, BF16 and F16");
      pieces[b][p] = cfg.model->adapter_pieces(*inner, static_cast<int>(b), static_cast<int>(p), name);
      adapter_used[name] = true;
    }
  }
  // modules_to_save: whole modules trained beside the adapters (blocks not
  // frozen in a LoRA model). An adapter folder holds their trained values
  // under PEFT's names (the base's name as the model names it); without
  // one they start as the base's.
  std::set<std::string> saved_in_base;  // the base's own tensors of those modules: in the file, not read
  if (adapter && lora.enabled()) {
    const auto named = hf_pieces(cfg, *inner, cfg.family->export_prefix);
    for (size_t b = 0; b < pieces.size(); ++b) {
      const BlockSpec& spec = inner->blocks()[b];
      if (spec.frozen || models::is_adapter_block(spec.name)) continue;
      from_adapter[b] = 1;
      for (size_t p = 0; p < spec.params.size(); ++p) {
        ZINC_CHECK(named[b][p].size() == 1, "load_pretrained: a module to save is one tensor in the file");
        const HfPiece& want = named[b][p][0];
        const std::string name = std::string(kPeftPrefix) + want.name;
        const StoredTensor* t = adapter->find(name);
        if (!t)
          throw Error(adapter->path() + ": tensor " + name + " " + shape_text(want.shape) + " is missing (" +
                      kAdapterConfigFile + " names its module in modules_to_save)");
        if (t->shape != want.shape)
          throw Error(adapter->path() + ": tensor " + name + " has shape " + shape_text(t->shape) + "; this model's " +
                      "is " + shape_text(want.shape));
        if (!t->readable)
          throw Error(adapter->path() + ": tensor " + name + " is " + t->stored_dtype + "; zinc reads F32, BF16 and F16");
        for (const HfPiece& pc : pieces[b][p]) saved_in_base.insert(pc.name);
        pieces[b][p] = {HfPiece{name, want.shape, want.rows, false}};
        adapter_used[name] = true;
      }
    }
  }
  for (const auto& [n, u] : adapter_used)
    if (!u)
      throw Error(adapter->path() + ": tensor " + n + " is not an adapter this model has (a module outside " +
                  kAdapterConfigFile + "'s target_modules and modules_to_save, or another architecture's)");
  // Every tensor zinc needs, with its shape and a readable dtype; no other.
  std::map<std::string, bool> used;
  for (const std::string& n : folder->names()) used[n] = false;
  for (size_t b = 0; b < pieces.size(); ++b)
    for (const auto& param : pieces[b])
      for (const HfPiece& pc : param) {
        if (from_adapter[b]) continue;
        auto [file, t] = folder->find(pc.name);
        if (!file) throw Error(cfg.dir + ": tensor " + pc.name + " " + shape_text(pc.shape) + " is missing (looked in " + joined(folder->files()) + ")");
        if (t->shape != pc.shape)
          throw Error(file->path() + ": tensor " + pc.name + " has shape " + shape_text(t->shape) + "; " +
                      cfg.architecture + " of this config.json needs " + shape_text(pc.shape));
        if (!t->readable)
          throw Error(file->path() + ": tensor " + pc.name + " is " + t->stored_dtype + "; zinc reads F32, BF16 and F16");
        if (pc.file_row >= 0 && (t->shape.empty() || pc.file_row + pc.rows > t->shape[0]))
          throw Error(file->path() + ": tensor " + pc.name + ": the family's tensor map reads rows past its end (a bug)");
        used[pc.name] = true;
      }
  for (const auto& [n, u] : used) {
    if (u || hf_ignored_tensor(cfg, n) || saved_in_base.count(n)) continue;
    throw Error(folder->find(n).first->path() + ": tensor " + n + " is not a parameter of " + cfg.architecture +
                " as its config.json describes it (unexpected tensor)");
  }
  return std::make_shared<PretrainedModel>(std::move(inner), std::move(folder), std::move(pieces), std::move(adapter),
                                           std::move(from_adapter));
}

}  // namespace zinc::tools
