// The Llama family (model.type "llama"): transformers' LlamaForCausalLM,
// MistralForCausalLM and Qwen2ForCausalLM, one graph with options (Note
// [model families] in models/registry.cpp). The graph is model.cpp's.
//
// The tensor map: zinc keeps q|k|v as one projection (self_attn.qkv_proj,
// rows q then k then v) and gate|up as another (mlp.gate_up_proj); the file
// keeps q_proj, k_proj, v_proj, gate_proj and up_proj, each a run of whole
// rows of zinc's. zinc's block "layers.3" with "mlp.down_proj.weight" is
// "model.layers.3.mlp.down_proj.weight"; the embedding and the final norm
// have no block name in the file ("model.embed_tokens.weight",
// "model.norm.weight"); the untied head is "lm_head.weight", never prefixed.
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "core/error.h"
#include "engine/config_reader.h"
#include "models/llama/llama.h"

namespace zinc::models::llama {
namespace {

using nlohmann::json;

class Config final : public FamilyConfig {
 public:
  Config(const LlamaConfig& c, const Family& family, json (*writer)(const LlamaConfig&), TensorMap map)
      : c_(c), family_(&family), writer_(writer), map_(map) {}
  const Family& family() const override { return *family_; }
  std::unique_ptr<FamilyConfig> clone() const override { return std::make_unique<Config>(*this); }
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t max_positions() const override { return c_.max_position_embeddings; }
  int64_t hidden_size() const override { return c_.hidden_size; }
  bool tied_head() const override { return c_.tie_word_embeddings; }
  void untie_head(const std::string&) override { c_.tie_word_embeddings = false; }
  void set_lora(const LoraConfig& lora) override {
    if (c_.num_experts > 0 && lora.targets.size() == 1 && lora.targets[0] == kAllLinear)
      throw ConfigError("model.lora.target_modules",
                        "\"all-linear\" on a mixture of experts: PEFT adapts the experts and the router too "
                        "(target_parameters), which zinc does not implement; name the attention's modules (q_proj, "
                        "k_proj, v_proj, o_proj)");
    // PEFT's default for the Llama family: q_proj and v_proj; for GPT-NeoX
    // query_key_value; none for Phi-3 (fused in its files).
    c_.lora = resolve_lora_targets(lora, lora_modules(c_),
                                   c_.fused_in_file ? std::vector<std::string>{}
                                   : neox_names(c_) ? std::vector<std::string>{"query_key_value"}
                                                    : std::vector<std::string>{"q_proj", "v_proj"});
  }
  const LoraConfig& lora() const override { return c_.lora; }
  void merge_lora(const Model& model, int block, std::vector<float>& flat, int adapter,
                  const std::vector<float>& adapter_flat) const override {
    for (const std::string& m : c_.lora.targets) {
      const LoraSite site = lora_site(c_, m);
      if (site.rows > 0)
        merge_lora_module(model, block, flat, adapter, adapter_flat, site.weight, site.path, site.row, c_.lora.scale());
    }
  }
  std::shared_ptr<Model> build(Device device, bool gradient_checkpointing) const override {
    LlamaConfig l = c_;
    l.name = family_->name;
    l.device = device;
    l.gradient_checkpointing = gradient_checkpointing;
    return make_llama(l);
  }
  HfPieces pieces(const Model& model, const std::string& prefix) const override {
    if (map_.pieces) return map_.pieces(c_, model, prefix);
    const int64_t D = c_.head_size(), H = c_.num_attention_heads, K = c_.kv_heads(), I = c_.intermediate_size;
    HfPieces out;
    for (const BlockSpec& b : model.blocks()) {
      std::vector<std::vector<HfPiece>> block;
      for (const ParamSpec& p : b.params) {
        const std::vector<int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
        const int64_t rows = shape.empty() ? 1 : shape[0];
        const std::string name = (b.name == "embed" || b.name == "final" ? "" : b.name + ".") + p.name;
        auto piece = [&](const std::string& from, const std::string& to, int64_t r) {
          std::string n = name;
          n.replace(n.find(from), from.size(), to);
          std::vector<int64_t> s = shape;
          if (!s.empty()) s[0] = r;
          return HfPiece{prefix + n, s, r, false};
        };
        if (p.name.rfind("mlp.gate.", 0) == 0 || p.name.rfind("mlp.experts.", 0) == 0)
          block.push_back(expert_pieces(prefix + b.name + ".", p.name, shape));
        else if (c_.fused_in_file)
          block.push_back({{p.name == "lm_head.weight" ? p.name : prefix + name, shape, rows, false}});
        else if (p.name.find("self_attn.qkv_proj.") == 0)
          block.push_back({piece("qkv_proj", "q_proj", H * D), piece("qkv_proj", "k_proj", K * D),
                           piece("qkv_proj", "v_proj", K * D)});
        else if (p.name.find("mlp.gate_up_proj.") == 0)
          block.push_back({piece("gate_up_proj", "gate_proj", I), piece("gate_up_proj", "up_proj", I)});
        else if (p.name == "lm_head.weight")
          block.push_back({{"lm_head.weight", shape, rows, false}});
        else
          block.push_back({{prefix + name, shape, rows, false}});
      }
      out.push_back(std::move(block));
    }
    return out;
  }
  std::vector<HfPiece> adapter_pieces(const Model& model, int block, int param,
                                      const std::string& name) const override {
    if (!map_.adapter_pieces) return FamilyConfig::adapter_pieces(model, block, param, name);
    return map_.adapter_pieces(c_, model.blocks()[static_cast<size_t>(block)].params[static_cast<size_t>(param)], name);
  }
  bool ignored_tensor(const std::string& name) const override {
    if (map_.ignored) return map_.ignored(c_, name);
    if (name == "lm_head.weight") return c_.tie_word_embeddings;
    const std::string suffix = ".rotary_emb.inv_freq";
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  }
  json config_json() const override { return writer_(c_); }
  json section_json() const override {
    json j = {{"hidden_size", c_.hidden_size},
            {"intermediate_size", c_.intermediate_size},
            {"num_hidden_layers", c_.num_hidden_layers},
            {"num_attention_heads", c_.num_attention_heads},
            {"num_key_value_heads", c_.num_key_value_heads},
            {"head_dim", c_.head_dim},
            {"max_position_embeddings", section_max_positions_},
            {"rms_norm_eps", c_.rms_norm_eps},
            {"rope_theta", c_.rope_theta},
            {"tie_word_embeddings", c_.tie_word_embeddings}};
    if (c_.num_experts > 0) {
      j["num_experts"] = c_.num_experts;
      j["num_experts_per_tok"] = c_.num_experts_per_tok;
      j["moe_intermediate_size"] = c_.moe_intermediate_size;
      j["router_aux_loss_coef"] = c_.router_aux_loss_coef;
    }
    return j;
  }
  std::optional<SizeError> size_error() const override { return models::size_error(c_); }
  void fit_data(int64_t vocab_size, int64_t seq_len) override {
    if (vocab_size > 0) c_.vocab_size = vocab_size;
    if (section_max_positions_ == 0) c_.max_position_embeddings = std::max<int64_t>(seq_len, 1);
    if (c_.max_position_embeddings < seq_len)
      throw ConfigError("model.max_position_embeddings", "must be >= data.seq_len " + std::to_string(seq_len) +
                                                             ", got " + std::to_string(c_.max_position_embeddings));
  }
  const LlamaConfig& llama() const { return c_; }
  // A sparse layer's router and experts in the file, per expert, named the
  // Mixtral way (block_sparse_moe.gate, block_sparse_moe.experts.E.w1 gate,
  // w3 up, w2 down) or the Qwen way (mlp.gate, mlp.experts.E.gate_proj,
  // up_proj, down_proj); zinc stacks the experts' gate|up rows (expert by
  // expert) and their down rows.
  std::vector<HfPiece> expert_pieces(const std::string& layer, const std::string& param,
                                     const std::vector<int64_t>& shape) const {
    const bool mixtral = c_.expert_names == LlamaConfig::ExpertNames::kMixtral;
    const std::string moe = layer + (mixtral ? "block_sparse_moe." : "mlp.");
    const int64_t E = c_.num_experts, Ie = c_.expert_size(), C = c_.hidden_size;
    if (param == "mlp.gate.weight") return {{moe + "gate.weight", shape, shape[0], false}};
    std::vector<HfPiece> out;
    for (int64_t e = 0; e < E; ++e) {
      const std::string ex = moe + "experts." + std::to_string(e) + ".";
      if (param == "mlp.experts.gate_up_proj") {
        out.push_back({ex + (mixtral ? "w1" : "gate_proj") + ".weight", {Ie, C}, Ie, false});
        out.push_back({ex + (mixtral ? "w3" : "up_proj") + ".weight", {Ie, C}, Ie, false});
      } else {
        out.push_back({ex + (mixtral ? "w2" : "down_proj") + ".weight", {C, Ie}, C, false});
      }
    }
    return out;
  }
  // The section's max_position_embeddings: 0 takes data.seq_len (fit_data).
  int64_t section_max_positions_ = -1;

 private:
  LlamaConfig c_;
  const Family* family_;
  json (*writer_)(const LlamaConfig&);
  TensorMap map_;
};

// config.json of a LlamaForCausalLM built from zinc's `model` section.
json llama_json(const LlamaConfig& c) {
  if (c.qkv_bias != c.o_bias)
    throw Error("export: a llama with biases on q, k, v but not on o is a Qwen2; zinc writes it only from a Qwen2 "
                "folder");
  json j = decoder_json(c);
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["attention_bias"] = c.qkv_bias;
  j["mlp_bias"] = c.mlp_bias;
  return j;
}

std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  return decoder_from_section(r, LlamaConfig{}, family(), &llama_json);
}

// Rope settings: transformers < 5 writes rope_theta and rope_scaling;
// transformers 5 writes one rope_parameters object holding both.
void read_rope(const ConfigDoc& f, LlamaConfig& c) {
  json params;
  std::string where;
  if (f.has("rope_parameters")) {
    params = f.at("rope_parameters");
    where = "rope_parameters";
  } else if (f.has("rope_scaling")) {
    params = f.at("rope_scaling");
    where = "rope_scaling";
  }
  c.rope_theta = f.get_number("rope_theta", c.rope_theta);  // the family's default (the Llama's: 10000, as transformers')
  if (params.is_null()) return;
  read_rope_params(f, params, where, c);
}

}  // namespace

namespace {

// original_max_position_embeddings of llama3, longrope and yarn, as
// transformers' standardize_rope_params resolves it: in a flat rope object
// the key beside it (Phi-3's configs keep it there) wins over the one
// inside; in Gemma 3's objects per layer type only the one inside counts;
// without either, max_position_embeddings.
int64_t original_positions(const ConfigDoc& f, const ConfigDoc& p, const std::string& where, bool nested,
                           const LlamaConfig& c) {
  const char* k = "original_max_position_embeddings";
  const bool top = !nested && f.has(k);
  const int64_t n = top ? f.get_int(k) : p.has(k) ? p.get_int(k) : c.max_position_embeddings;
  if (n < 1) f.fail(top ? std::string(k) : where + "." + k, "must be >= 1");
  return n;
}

// longrope (Phi-3): its two factor lists, original_max_position_embeddings
// (in the object or, in Phi-3's configs, beside it), and the attention
// factor: given, or from factor (default max_position_embeddings /
// original_max_position_embeddings) as transformers derives it.
void read_longrope(const ConfigDoc& f, const ConfigDoc& p, const std::string& where, bool nested, LlamaConfig& c) {
  RopeScaling& s = c.rope_scaling;
  s.type = RopeScaling::Type::kLongrope;
  for (auto [name, out] : {std::pair<const char*, std::vector<double>*>{"short_factor", &s.short_factor},
                           {"long_factor", &s.long_factor}}) {
    if (!p.has(name)) f.fail(where + "." + name, "missing (required for rope_type longrope)");
    const json& v = p.at(name);
    if (!v.is_array()) f.fail(where + "." + name, "expected a list of numbers, got " + v.dump());
    out->clear();
    for (const json& x : v) {
      if (!x.is_number()) f.fail(where + "." + name, "expected a list of numbers, got " + v.dump());
      out->push_back(x.get<double>());
    }
  }
  s.original_max_position_embeddings = original_positions(f, p, where, nested, c);
  s.factor = p.get_number("factor", static_cast<double>(c.max_position_embeddings) /
                                        static_cast<double>(s.original_max_position_embeddings));
  if (p.has("attention_factor")) {
    s.attention_factor = p.get_number("attention_factor", 1.0);
  } else {
    const double orig = static_cast<double>(s.original_max_position_embeddings);
    s.attention_factor = s.factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(s.factor) / std::log(orig));
  }
  if (!(s.attention_factor > 0) || !std::isfinite(s.attention_factor))
    f.fail(where + ".attention_factor", "must be a finite number > 0");
}

// yarn (Qwen2.5, DeepSeek-style configs): factor (default
// max_position_embeddings / original_max_position_embeddings),
// original_max_position_embeddings (in the object, beside it, or
// max_position_embeddings), beta_fast, beta_slow, truncate, and the
// attention factor: given, or from mscale and mscale_all_dim, or
// 0.1 ln(factor) + 1, as transformers derives it.
void read_yarn(const ConfigDoc& f, const ConfigDoc& p, const std::string& where, bool nested, LlamaConfig& c) {
  RopeScaling& s = c.rope_scaling;
  s.type = RopeScaling::Type::kYarn;
  s.original_max_position_embeddings = original_positions(f, p, where, nested, c);
  s.factor = p.get_number("factor", static_cast<double>(c.max_position_embeddings) /
                                        static_cast<double>(s.original_max_position_embeddings));
  if (!(s.factor > 0) || !std::isfinite(s.factor)) f.fail(where + ".factor", "must be a finite number > 0");
  s.beta_fast = p.get_number("beta_fast", 32.0);
  s.beta_slow = p.get_number("beta_slow", 1.0);
  if (!(s.beta_fast > 0) || !(s.beta_slow > 0)) f.fail(where + ".beta_fast", "beta_fast and beta_slow must be > 0");
  s.truncate = p.get_bool("truncate", true);
  auto mscale = [](double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  if (p.has("attention_factor")) {
    s.attention_factor = p.get_number("attention_factor", 1.0);
  } else if (p.has("mscale") && p.has("mscale_all_dim") && p.get_number("mscale", 0) != 0 &&
             p.get_number("mscale_all_dim", 0) != 0) {
    s.attention_factor =
        mscale(s.factor, p.get_number("mscale", 1.0)) / mscale(s.factor, p.get_number("mscale_all_dim", 1.0));
  } else {
    s.attention_factor = mscale(s.factor, 1.0);
  }
  if (!(s.attention_factor > 0) || !std::isfinite(s.attention_factor))
    f.fail(where + ".attention_factor", "must be a finite number > 0");
}

}  // namespace

void read_rope_params(const ConfigDoc& f, const json& params, const std::string& where, LlamaConfig& c, bool nested) {
  if (!params.is_object()) f.fail(where, "expected an object, got " + params.dump());
  ConfigDoc p(f.path(), params);
  auto key = [&](const char* k) { return where + "." + k; };
  if (p.has("rope_theta")) c.rope_theta = p.get_number("rope_theta", c.rope_theta);
  if (p.has("partial_rotary_factor")) c.partial_rotary_factor = p.get_number("partial_rotary_factor", 1.0);
  std::string type = p.get_string("rope_type", p.get_string("type", "default"));
  RopeScaling& s = c.rope_scaling;
  if (type == "default") {
    s.type = RopeScaling::Type::kNone;
    return;
  }
  if (type == "dynamic")
    f.fail(key("rope_type"), "\"dynamic\" is not supported: it is an inference-time rule (the frequencies change "
                             "with the length being generated); training at a fixed length wants linear, llama3, "
                             "longrope or yarn");
  if (type == "longrope" || type == "su") {  // "su": the name of Phi-3's first configs
    read_longrope(f, p, where, nested, c);
    return;
  }
  if (type == "yarn") {
    read_yarn(f, p, where, nested, c);
    return;
  }
  if (type != "linear" && type != "llama3")
    f.fail(key("rope_type"),
           "\"" + type + "\" is not supported; zinc implements default, linear, llama3, longrope and yarn");
  if (!p.has("factor")) f.fail(key("factor"), "missing (required for rope_type " + type + ")");
  s.factor = p.get_number("factor", 1.0);
  if (type == "linear") {
    s.type = RopeScaling::Type::kLinear;
    return;
  }
  s.type = RopeScaling::Type::kLlama3;
  for (const char* k : {"low_freq_factor", "high_freq_factor"})
    if (!p.has(k)) f.fail(key(k), "missing (required for rope_type llama3)");
  s.low_freq_factor = p.get_number("low_freq_factor", 1.0);
  s.high_freq_factor = p.get_number("high_freq_factor", 4.0);
  s.original_max_position_embeddings = original_positions(f, p, where, nested, c);
}

namespace {

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& arch) {
  LlamaConfig c;
  read_decoder(f, c);
  const std::string act = f.get_string("hidden_act", "silu");
  if (act != "silu") f.fail("hidden_act", "\"" + act + "\" is not supported; zinc's llama MLP is SiLU-gated (silu)");
  if (arch == "Qwen2ForCausalLM") {
    c.qkv_bias = true;  // Qwen2 always puts biases on q, k and v, and none on o
    const int64_t from = f.get_int("max_window_layers", 28);
    read_window_layers(f, c, [&](int64_t l) { return l >= from; });
  } else {
    c.qkv_bias = c.o_bias = f.get_bool("attention_bias", false);
  }
  c.mlp_bias = f.get_bool("mlp_bias", false);
  if (arch == "MistralForCausalLM") c.sliding_window = f.get_int("sliding_window", 0);  // every layer
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return std::make_unique<Config>(c, family(), &llama_json, TensorMap{});
}

}  // namespace

// ---- the Llama-style decoder, for every family that shares its graph -------------------

void read_decoder(const ConfigDoc& f, LlamaConfig& c) {
  c.vocab_size = f.get_int("vocab_size");
  c.hidden_size = f.get_int("hidden_size");
  c.intermediate_size = f.get_int("intermediate_size");
  c.num_hidden_layers = f.get_int("num_hidden_layers");
  c.num_attention_heads = f.get_int("num_attention_heads");
  c.num_key_value_heads = f.get_int("num_key_value_heads", c.num_attention_heads);
  c.head_dim = f.get_int("head_dim", c.head_dim);
  c.max_position_embeddings = f.get_int("max_position_embeddings");
  c.rms_norm_eps = f.get_number("rms_norm_eps", c.rms_norm_eps);  // the family's default (the Llama's 1e-6, as transformers')
  c.partial_rotary_factor = f.get_number("partial_rotary_factor", c.partial_rotary_factor);
  read_rope(f, c);
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", false);
}

void read_window_layers(const ConfigDoc& f, LlamaConfig& c, const std::function<bool(int64_t)>& default_layer) {
  if (!f.get_bool("use_sliding_window", false) || !f.has("sliding_window")) return;  // transformers: no window
  c.sliding_window = f.get_int("sliding_window");
  if (!f.has("layer_types")) {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) c.window_layers.push_back(default_layer(l) ? 1 : 0);
    return;
  }
  const json& types = f.at("layer_types");
  if (!types.is_array()) f.fail("layer_types", "expected a list, got " + types.dump());
  for (const json& t : types) {
    if (t != "sliding_attention" && t != "full_attention")
      f.fail("layer_types", t.dump() + " is not supported (sliding_attention or full_attention)");
    c.window_layers.push_back(t == "sliding_attention" ? 1 : 0);
  }
}

json decoder_json(const LlamaConfig& c) {
  json rope = nullptr;
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScaling::Type::kLinear) rope = {{"rope_type", "linear"}, {"factor", s.factor}};
  if (s.type == RopeScaling::Type::kLongrope)
    rope = {{"rope_type", "longrope"},
            {"short_factor", s.short_factor},
            {"long_factor", s.long_factor},
            {"factor", s.factor},
            {"attention_factor", s.attention_factor},
            {"original_max_position_embeddings", s.original_max_position_embeddings}};
  if (s.type == RopeScaling::Type::kYarn)
    rope = {{"rope_type", "yarn"},
            {"factor", s.factor},
            {"original_max_position_embeddings", s.original_max_position_embeddings},
            {"beta_fast", s.beta_fast},
            {"beta_slow", s.beta_slow},
            {"truncate", s.truncate},
            {"attention_factor", s.attention_factor}};
  if (s.type == RopeScaling::Type::kLlama3)
    rope = {{"rope_type", "llama3"},
            {"factor", s.factor},
            {"low_freq_factor", s.low_freq_factor},
            {"high_freq_factor", s.high_freq_factor},
            {"original_max_position_embeddings", s.original_max_position_embeddings}};
  json j = {{"vocab_size", c.vocab_size},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.kv_heads()},
          {"head_dim", c.head_size()},
          {"max_position_embeddings", c.max_position_embeddings},
          {"rms_norm_eps", c.rms_norm_eps},
          {"rope_theta", c.rope_theta},
          {"rope_scaling", rope},
          {"hidden_act", "silu"},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"initializer_range", c.init_std},
          // No padding id: a family's default (SmolLM3's 128004) can lie
          // outside a small vocabulary, and transformers' embedding refuses it.
          {"pad_token_id", nullptr}};
  if (c.partial_rotary_factor != 1.0) j["partial_rotary_factor"] = c.partial_rotary_factor;
  return j;
}

const std::vector<std::pair<std::string, std::string>>& decoder_section_keys() {
  static const std::vector<std::pair<std::string, std::string>> kKeys = {
      {"hidden_size", ""},         {"intermediate_size", ""}, {"num_hidden_layers", ""},
      {"num_attention_heads", ""}, {"num_key_value_heads", ""}, {"head_dim", ""},
      {"max_position_embeddings", ""}, {"rms_norm_eps", ""}, {"rope_theta", ""},
      {"tie_word_embeddings", ""}};
  return kKeys;
}

const std::vector<std::pair<std::string, std::string>>& moe_section_keys() {
  static const std::vector<std::pair<std::string, std::string>> kKeys = [] {
    std::vector<std::pair<std::string, std::string>> k = decoder_section_keys();
    for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef"})
      k.emplace_back(key, "");
    return k;
  }();
  return kKeys;
}

std::unique_ptr<FamilyConfig> decoder_config(const LlamaConfig& c, const Family& family,
                                             json (*config_json)(const LlamaConfig&), TensorMap map) {
  return std::make_unique<Config>(c, family, config_json, map);
}

std::unique_ptr<FamilyConfig> decoder_from_section(config::Reader& r, LlamaConfig c, const Family& family,
                                                   json (*config_json)(const LlamaConfig&), TensorMap map) {
  using config::above;
  using config::at_least;
  int64_t max_positions = 0;
  r.get_int("hidden_size", c.hidden_size, at_least(1));
  r.get_int("intermediate_size", c.intermediate_size, at_least(1));
  r.get_int("num_hidden_layers", c.num_hidden_layers, at_least(1));
  r.get_int("num_attention_heads", c.num_attention_heads, at_least(1));
  r.get_int("num_key_value_heads", c.num_key_value_heads, at_least(1));
  r.get_int("head_dim", c.head_dim, at_least(0));
  r.get_int("max_position_embeddings", max_positions, at_least(0));
  r.get_number("rms_norm_eps", c.rms_norm_eps, above(0));
  r.get_number("rope_theta", c.rope_theta, above(0));
  r.get_bool("tie_word_embeddings", c.tie_word_embeddings);
  if (c.num_experts > 0) {
    r.get_int("num_experts", c.num_experts, at_least(1));
    r.get_int("num_experts_per_tok", c.num_experts_per_tok, at_least(1));
    r.get_int("moe_intermediate_size", c.moe_intermediate_size, at_least(0));
    r.get_number("router_aux_loss_coef", c.router_aux_loss_coef, at_least(0.0));
    if (c.num_experts_per_tok > c.num_experts)
      throw ConfigError("model.num_experts_per_tok", "must be at most num_experts " + std::to_string(c.num_experts) +
                                                         ", got " + std::to_string(c.num_experts_per_tok));
  }
  c.max_position_embeddings = std::max<int64_t>(max_positions, 1);
  auto out = std::make_unique<Config>(c, family, config_json, map);
  out->section_max_positions_ = max_positions;
  return out;
}

Family decoder_family(std::string name, std::vector<std::string> architectures,
                      std::unique_ptr<FamilyConfig> (*read)(const ConfigDoc&, const std::string&),
                      std::unique_ptr<FamilyConfig> (*from_section)(config::Reader&),
                      const std::vector<std::pair<std::string, std::string>>& section_keys) {
  return Family{std::move(name), std::move(architectures), "embed_tokens.weight", "model.", "max_position_embeddings",
                "hidden_size", read, section_keys, from_section};
}

const Family& family() {
  static const Family kFamily =
      decoder_family("llama", {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}, &read, &from_section);
  return kFamily;
}

std::unique_ptr<FamilyConfig> family_config(const LlamaConfig& c) { return decoder_config(c, family(), &llama_json); }

const LlamaConfig* settings(const FamilyConfig& f) {
  const auto* c = dynamic_cast<const Config*>(&f);
  return c ? &c->llama() : nullptr;
}

}  // namespace zinc::models::llama
