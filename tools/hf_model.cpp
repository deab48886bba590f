// Hugging Face model folders as zinc models (hf_model.h).
//
// Note [Hugging Face names]
// zinc's parameters and transformers' tensors differ in three ways, all
// handled by the piece lists of hf_pieces:
// - Fusion. zinc's llama keeps q|k|v as one projection (self_attn.qkv_proj,
//   rows q then k then v) and gate|up as another (mlp.gate_up_proj); the
//   file keeps q_proj, k_proj, v_proj, gate_proj, up_proj. A zinc parameter
//   is then several pieces, each a run of whole rows.
// - Layout. GPT-2 stores its linear weights as Conv1D, (in, out); zinc keeps
//   every weight (out, in) as torch.nn.Linear does. Those pieces are
//   transposed.
// - Names. zinc's block "layers.3" with parameter "mlp.down_proj.weight" is
//   transformers' "model.layers.3.mlp.down_proj.weight"; the GPT's
//   "h.3.attn.c_attn.weight" is "transformer.h.3.attn.c_attn.weight" (some
//   GPT-2 files have no "transformer." prefix; the prefix is found from the
//   embedding's name). A tied head has no tensor of its own in zinc, and
//   transformers writes none either (a file that holds one anyway is
//   accepted, unread).
#include "tools/hf_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "engine/config.h"  // parse_json_text
#include "tools/safetensors_read.h"

namespace zinc::tools {
namespace {

using nlohmann::json;

// Errors in config.json: "DIR/config.json: KEY: what".
class ConfigFile {
 public:
  ConfigFile(std::string path, const json& j) : path_(std::move(path)), j_(j) {}
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    throw Error(path_ + ": " + (key.empty() ? "" : key + ": ") + msg);
  }
  bool has(const std::string& k) const { return j_.contains(k) && !j_[k].is_null(); }
  int64_t get_int(const std::string& k) const {
    if (!has(k)) fail(k, "missing (zinc needs it to size the model)");
    return to_int(j_[k], k);
  }
  int64_t get_int(const std::string& k, int64_t dflt) const { return has(k) ? to_int(j_[k], k) : dflt; }
  double get_number(const std::string& k, double dflt) const {
    if (!has(k)) return dflt;
    if (!j_[k].is_number()) fail(k, "expected a number, got " + j_[k].dump());
    return j_[k].get<double>();
  }
  bool get_bool(const std::string& k, bool dflt) const {
    if (!has(k)) return dflt;
    if (!j_[k].is_boolean()) fail(k, "expected true or false, got " + j_[k].dump());
    return j_[k].get<bool>();
  }
  std::string get_string(const std::string& k, const std::string& dflt) const {
    if (!has(k)) return dflt;
    if (!j_[k].is_string()) fail(k, "expected a string, got " + j_[k].dump());
    return j_[k].get<std::string>();
  }
  const json& at(const std::string& k) const { return j_[k]; }
  const std::string& path() const { return path_; }

 private:
  int64_t to_int(const json& v, const std::string& k) const {
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float() && v.get<double>() == static_cast<double>(static_cast<int64_t>(v.get<double>())))
      return static_cast<int64_t>(v.get<double>());
    fail(k, "expected an integer, got " + v.dump());
  }
  std::string path_;
  const json& j_;
};

std::optional<DType> parse_dtype(const ConfigFile& f) {
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

// Rope settings: transformers < 5 writes rope_theta and rope_scaling;
// transformers 5 writes one rope_parameters object holding both.
void parse_rope(const ConfigFile& f, models::LlamaConfig& c) {
  json params;
  std::string where;
  if (f.has("rope_parameters")) {
    params = f.at("rope_parameters");
    where = "rope_parameters";
  } else if (f.has("rope_scaling")) {
    params = f.at("rope_scaling");
    where = "rope_scaling";
  }
  c.rope_theta = f.get_number("rope_theta", models::LlamaConfig{}.rope_theta);  // transformers defaults to the same 10000
  if (params.is_null()) return;
  if (!params.is_object()) f.fail(where, "expected an object, got " + params.dump());
  ConfigFile p(f.path(), params);
  auto key = [&](const char* k) { return where + "." + k; };
  if (p.has("rope_theta")) c.rope_theta = p.get_number("rope_theta", c.rope_theta);
  std::string type = p.get_string("rope_type", p.get_string("type", "default"));
  models::RopeScaling& s = c.rope_scaling;
  if (type == "default") {
    s.type = models::RopeScaling::Type::kNone;
    return;
  }
  if (type != "linear" && type != "llama3") {
    f.fail(key("rope_type"), "\"" + type + "\" is not supported; zinc implements default, linear and llama3");
  }
  if (!p.has("factor")) f.fail(key("factor"), "missing (required for rope_type " + type + ")");
  s.factor = p.get_number("factor", 1.0);
  if (type == "linear") {
    s.type = models::RopeScaling::Type::kLinear;
    return;
  }
  s.type = models::RopeScaling::Type::kLlama3;
  for (const char* k : {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
    if (!p.has(k)) f.fail(key(k), "missing (required for rope_type llama3)");
  s.low_freq_factor = p.get_number("low_freq_factor", 1.0);
  s.high_freq_factor = p.get_number("high_freq_factor", 4.0);
  s.original_max_position_embeddings = p.get_int("original_max_position_embeddings");
}

void parse_llama(const ConfigFile& f, const std::string& arch, models::LlamaConfig& c) {
  c.vocab_size = f.get_int("vocab_size");
  c.hidden_size = f.get_int("hidden_size");
  c.intermediate_size = f.get_int("intermediate_size");
  c.num_hidden_layers = f.get_int("num_hidden_layers");
  c.num_attention_heads = f.get_int("num_attention_heads");
  c.num_key_value_heads = f.get_int("num_key_value_heads", c.num_attention_heads);
  c.head_dim = f.get_int("head_dim", 0);
  c.max_position_embeddings = f.get_int("max_position_embeddings");
  c.rms_norm_eps = f.get_number("rms_norm_eps", models::LlamaConfig{}.rms_norm_eps);  // transformers: 1e-6 too
  parse_rope(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; zinc's llama MLP is SiLU-gated (silu)");
  if (arch == "Qwen2ForCausalLM") {
    c.qkv_bias = true;  // Qwen2 always puts biases on q, k and v, and none on o
    if (f.get_bool("use_sliding_window", false)) c.sliding_window = f.get_int("sliding_window", 0);
  } else {
    c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
  }
  c.mlp_bias = f.get_bool("mlp_bias", false);
  if (arch == "MistralForCausalLM") c.sliding_window = f.get_int("sliding_window", 0);
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", false);
  if (auto bad = models::size_error(c)) f.fail(bad->field, bad->message);
}

void parse_gpt2(const ConfigFile& f, models::GptConfig& c) {
  c.vocab_size = f.get_int("vocab_size");
  c.block_size = f.get_int("n_positions");
  c.n_embd = f.get_int("n_embd");
  c.n_layer = f.get_int("n_layer");
  c.n_head = f.get_int("n_head");
  const int64_t inner = f.get_int("n_inner", 4 * c.n_embd);
  if (inner != 4 * c.n_embd)
    f.fail("n_inner", std::to_string(inner) + " is not supported; zinc's gpt MLP is 4 * n_embd = " +
                          std::to_string(4 * c.n_embd) + " wide");
  const std::string act = f.get_string("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    f.fail("activation_function", "\"" + act + "\" is not supported; zinc's gpt uses the tanh GELU (gelu_new)");
  const double eps = f.get_number("layer_norm_epsilon", 1e-5);
  if (eps != 1e-5) f.fail("layer_norm_epsilon", "zinc's gpt uses 1e-05, got " + json(eps).dump());
  for (const char* k : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
    if (f.get_bool(k, false)) f.fail(k, "true is not supported (zinc's gpt is GPT-2's plain attention)");
  if (!f.get_bool("scale_attn_weights", true)) f.fail("scale_attn_weights", "false is not supported");
  if (!f.get_bool("tie_word_embeddings", true)) f.fail("tie_word_embeddings", "false is not supported (zinc's gpt ties its head)");
  if (auto bad = models::size_error(c)) f.fail(bad->field, bad->message);
}

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> kArch = {"GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM",
                                                 "Qwen2ForCausalLM"};
  return kArch;
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
  PretrainedModel(std::shared_ptr<Model> inner, std::unique_ptr<SafetensorsFolder> folder,
                  std::vector<std::vector<std::vector<HfPiece>>> pieces)
      : inner_(std::move(inner)), folder_(std::move(folder)), pieces_(std::move(pieces)) {}

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

  bool initial_values(int block, int param, int64_t first, int64_t count, float* out) const override {
    const std::vector<HfPiece>& pieces = pieces_.at(static_cast<size_t>(block)).at(static_cast<size_t>(param));
    const int64_t cols = inner_->blocks()[static_cast<size_t>(block)].params[static_cast<size_t>(param)].shape.numel() /
                         total_rows(pieces);
    int64_t at = 0;  // the piece's first element in the zinc parameter
    for (const HfPiece& pc : pieces) {
      const int64_t n = pc.rows * cols;
      const int64_t lo = std::max(first, at), hi = std::min(first + count, at + n);
      if (lo < hi) read_piece(pc, cols, lo - at, hi - lo, out + (lo - first));
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
  void read_piece(const HfPiece& pc, int64_t cols, int64_t first, int64_t count, float* out) const {
    auto [file, t] = folder_->find(pc.name);
    if (!pc.transposed) {
      file->read_f32(*t, first, count, out);
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
  std::vector<std::vector<std::vector<HfPiece>>> pieces_;
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
void settle_tied_head(HfConfig& cfg) {
  if (cfg.kind == HfKind::kLlama && !cfg.llama.tie_word_embeddings) return;
  std::optional<SafetensorsFolder> opened;
  try {
    opened.emplace(cfg.dir);
  } catch (const Error&) {
    return;  // no readable weights: load_pretrained says so when it reads them
  }
  const SafetensorsFolder& folder = *opened;
  const auto [head_file, head] = folder.find("lm_head.weight");
  if (!head) return;
  const std::string embed = cfg.kind == HfKind::kGpt ? "wte.weight" : "embed_tokens.weight";
  for (const char* prefix : {"transformer.", "model.", ""}) {
    const auto [embed_file, emb] = folder.find(prefix + embed);
    if (!emb) continue;
    if (same_values(*head_file, *head, *embed_file, *emb)) return;  // a tied head written out: the same model
    if (cfg.kind == HfKind::kGpt)
      throw Error(head_file->path() + ": tensor lm_head.weight differs from " + prefix + embed + " while " + cfg.dir +
                  "/config.json says tie_word_embeddings true: transformers keeps such a head apart from the "
                  "embedding, and zinc's gpt cannot (its head is the embedding); refusing rather than dropping it");
    cfg.llama.tie_word_embeddings = false;
    cfg.raw["tie_word_embeddings"] = false;
    log_warn(head_file->path() + ": tensor lm_head.weight differs from " + prefix + embed + " although " + cfg.dir +
             "/config.json says tie_word_embeddings true; as transformers does, zinc keeps the head apart from the "
             "embedding (an export says tie_word_embeddings false)");
    return;
  }
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
  settle_tied_head(cfg);
  return cfg;
}

HfConfig parse_hf_config(const nlohmann::json& raw, const std::string& path) {
  HfConfig cfg;
  cfg.raw = raw;
  if (!cfg.raw.is_object()) throw Error(path + ": expected a JSON object");
  ConfigFile f(path, cfg.raw);
  if (!f.has("architectures") || !cfg.raw["architectures"].is_array() || cfg.raw["architectures"].empty() ||
      !cfg.raw["architectures"][0].is_string()) {
    f.fail("architectures", "missing; zinc loads " + joined(supported_architectures()));
  }
  cfg.architecture = cfg.raw["architectures"][0].get<std::string>();
  const auto& sup = supported_architectures();
  if (std::find(sup.begin(), sup.end(), cfg.architecture) == sup.end()) {
    f.fail("architectures", "\"" + cfg.architecture + "\" is not supported; zinc loads " + joined(sup));
  }
  cfg.dtype = parse_dtype(f);
  if (cfg.architecture == "GPT2LMHeadModel") {
    cfg.kind = HfKind::kGpt;
    parse_gpt2(f, cfg.gpt);
  } else {
    cfg.kind = HfKind::kLlama;
    parse_llama(f, cfg.architecture, cfg.llama);
  }
  return cfg;
}

bool hf_ignored_tensor(const HfConfig& cfg, const std::string& name) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (name == "lm_head.weight") return cfg.kind == HfKind::kGpt || cfg.llama.tie_word_embeddings;
  if (cfg.kind == HfKind::kGpt) return ends_with(".attn.bias") || ends_with(".attn.masked_bias");
  return ends_with(".rotary_emb.inv_freq");
}

std::vector<std::vector<std::vector<HfPiece>>> hf_pieces(const HfConfig& cfg, const Model& model,
                                                        const std::string& prefix) {
  std::vector<std::vector<std::vector<HfPiece>>> out;
  for (const BlockSpec& b : model.blocks()) {
    std::vector<std::vector<HfPiece>> block;
    for (const ParamSpec& p : b.params) {
      const std::vector<int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
      const int64_t rows = shape.empty() ? 1 : shape[0];
      std::vector<HfPiece> pieces;
      if (cfg.kind == HfKind::kGpt) {
        // embed.wte -> wte.weight; h.3.attn.c_attn.weight -> h.3.attn.c_attn.weight; ln_f.weight.
        std::string name = b.name == "embed" ? p.name + ".weight" : b.name + "." + p.name;
        const bool conv1d = p.name.find("attn.c_") == 0 || p.name.find("mlp.c_") == 0;
        if (conv1d && shape.size() == 2) {
          pieces.push_back({prefix + name, {shape[1], shape[0]}, rows, true});
        } else {
          pieces.push_back({prefix + name, shape, rows, false});
        }
      } else {
        const models::LlamaConfig& c = cfg.llama;
        const int64_t D = c.head_size(), H = c.num_attention_heads, K = c.kv_heads(), I = c.intermediate_size;
        const std::string base = b.name == "embed" || b.name == "final" ? "" : b.name + ".";
        std::string name = base + p.name;
        auto piece = [&](const std::string& n, int64_t r) {
          std::vector<int64_t> s = shape;
          if (!s.empty()) s[0] = r;
          return HfPiece{n, s, r, false};
        };
        auto replace = [&](const std::string& from, const std::string& to) {
          std::string s = name;
          s.replace(s.find(from), from.size(), to);
          return prefix + s;
        };
        if (p.name.find("self_attn.qkv_proj.") == 0) {
          pieces.push_back(piece(replace("qkv_proj", "q_proj"), H * D));
          pieces.push_back(piece(replace("qkv_proj", "k_proj"), K * D));
          pieces.push_back(piece(replace("qkv_proj", "v_proj"), K * D));
        } else if (p.name.find("mlp.gate_up_proj.") == 0) {
          pieces.push_back(piece(replace("gate_up_proj", "gate_proj"), I));
          pieces.push_back(piece(replace("gate_up_proj", "up_proj"), I));
        } else if (p.name == "lm_head.weight") {
          pieces.push_back({"lm_head.weight", shape, rows, false});
        } else {
          pieces.push_back({prefix + name, shape, rows, false});
        }
      }
      block.push_back(std::move(pieces));
    }
    out.push_back(std::move(block));
  }
  return out;
}

std::shared_ptr<Model> make_hf_model(const HfConfig& cfg, Device device, bool gradient_checkpointing) {
  if (cfg.kind == HfKind::kGpt) {
    models::GptConfig g = cfg.gpt;
    g.device = device;
    g.gradient_checkpointing = gradient_checkpointing;
    return models::make_gpt(g);
  }
  models::LlamaConfig l = cfg.llama;
  l.device = device;
  l.gradient_checkpointing = gradient_checkpointing;
  return models::make_llama(l);
}

std::shared_ptr<Model> load_pretrained(const HfConfig& cfg, Device device, bool gradient_checkpointing) {
  std::shared_ptr<Model> inner = make_hf_model(cfg, device, gradient_checkpointing);
  auto folder = std::make_unique<SafetensorsFolder>(cfg.dir);
  // The prefix from the token embedding's name.
  const std::string embed = cfg.kind == HfKind::kGpt ? "wte.weight" : "embed_tokens.weight";
  std::string prefix;
  for (const char* p : {"transformer.", "model.", ""}) {
    if (folder->find(p + embed).first) {
      prefix = p;
      break;
    }
    if (*p == '\0')
      throw Error(cfg.dir + ": no tensor " + embed + " (nor with a transformer. or model. prefix) in " +
                  joined(folder->files()));
  }
  auto pieces = hf_pieces(cfg, *inner, prefix);
  // Every tensor zinc needs, with its shape and a readable dtype; no other.
  std::map<std::string, bool> used;
  for (const std::string& n : folder->names()) used[n] = false;
  for (const auto& block : pieces)
    for (const auto& param : block)
      for (const HfPiece& pc : param) {
        auto [file, t] = folder->find(pc.name);
        if (!file) throw Error(cfg.dir + ": tensor " + pc.name + " " + shape_text(pc.shape) + " is missing (looked in " + joined(folder->files()) + ")");
        if (t->shape != pc.shape)
          throw Error(file->path() + ": tensor " + pc.name + " has shape " + shape_text(t->shape) + "; " +
                      cfg.architecture + " of this config.json needs " + shape_text(pc.shape));
        if (!t->readable)
          throw Error(file->path() + ": tensor " + pc.name + " is " + t->stored_dtype + "; zinc reads F32, BF16 and F16");
        used[pc.name] = true;
      }
  for (const auto& [n, u] : used) {
    if (u || hf_ignored_tensor(cfg, n)) continue;
    throw Error(folder->find(n).first->path() + ": tensor " + n + " is not a parameter of " + cfg.architecture +
                " as its config.json describes it (unexpected tensor)");
  }
  return std::make_shared<PretrainedModel>(std::move(inner), std::move(folder), std::move(pieces));
}

}  // namespace zinc::tools
