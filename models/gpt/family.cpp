// The GPT family (model.type "gpt"): transformers' GPT2LMHeadModel
// (Note [model families] in models/registry.cpp). The graph is model.cpp's.
//
// The tensor map: zinc's block "embed" {wte, wpe} is "wte.weight" and
// "wpe.weight"; "h.3" with "attn.c_attn.weight" is "h.3.attn.c_attn.weight";
// the final block is "ln_f.*". GPT-2 stores its linear weights as Conv1D,
// (in, out), where zinc keeps (out, in): those pieces are transposed. The
// head is the embedding (no tensor of its own). Files name the tensors with
// "transformer." in front, or with no prefix.
#include <algorithm>
#include <string>

#include "core/error.h"
#include "engine/config_reader.h"
#include "models/gpt/gpt.h"

namespace zinc::models::gpt {
namespace {

class Config final : public FamilyConfig {
 public:
  explicit Config(const GptConfig& c) : c_(c) {}
  const Family& family() const override { return gpt::family(); }
  std::unique_ptr<FamilyConfig> clone() const override { return std::make_unique<Config>(*this); }
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t max_positions() const override { return c_.block_size; }
  int64_t hidden_size() const override { return c_.n_embd; }
  bool tied_head() const override { return true; }
  void untie_head(const std::string& where) override {
    throw Error(where + ": transformers keeps such a head apart from the embedding, and zinc's gpt cannot (its "
                        "head is the embedding); refusing rather than dropping it");
  }
  void set_lora(const LoraConfig& lora) override {
    // PEFT's default for GPT-2: c_attn.
    c_.lora = resolve_lora_targets(lora, {"c_attn", "c_proj", "c_fc"}, {"c_attn"});
  }
  const LoraConfig& lora() const override { return c_.lora; }
  bool lora_fan_in_fan_out() const override { return true; }  // GPT-2's Conv1D layers
  void merge_lora(const Model& model, int block, std::vector<float>& flat, int adapter,
                  const std::vector<float>& adapter_flat) const override {
    // Each module's whole weight (the export transposes it, and the delta,
    // into the file's Conv1D layout).
    for (const std::string path : {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"})
      merge_lora_module(model, block, flat, adapter, adapter_flat, path + ".weight", path, 0, c_.lora.scale());
  }
  std::shared_ptr<Model> build(Device device, bool gradient_checkpointing) const override {
    GptConfig g = c_;
    g.device = device;
    g.gradient_checkpointing = gradient_checkpointing;
    return make_gpt(g);
  }
  HfPieces pieces(const Model& model, const std::string& prefix) const override {
    HfPieces out;
    for (const BlockSpec& b : model.blocks()) {
      std::vector<std::vector<HfPiece>> block;
      for (const ParamSpec& p : b.params) {
        const std::vector<int64_t> shape(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim);
        const int64_t rows = shape.empty() ? 1 : shape[0];
        // embed.wte -> wte.weight; h.3.attn.c_attn.weight as it is; ln_f.weight.
        const std::string name = prefix + (b.name == "embed" ? p.name + ".weight" : b.name + "." + p.name);
        const bool conv1d = p.name.find("attn.c_") == 0 || p.name.find("mlp.c_") == 0;
        if (conv1d && shape.size() == 2)
          block.push_back({{name, {shape[1], shape[0]}, rows, true}});
        else
          block.push_back({{name, shape, rows, false}});
      }
      out.push_back(std::move(block));
    }
    return out;
  }
  bool ignored_tensor(const std::string& name) const override {
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    return name == "lm_head.weight" || ends_with(".attn.bias") || ends_with(".attn.masked_bias");
  }
  nlohmann::json config_json() const override {
    return {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"vocab_size", c_.vocab_size},
            {"n_positions", c_.block_size},
            {"n_ctx", c_.block_size},
            {"n_embd", c_.n_embd},
            {"n_layer", c_.n_layer},
            {"n_head", c_.n_head},
            {"n_inner", nullptr},
            {"activation_function", "gelu_new"},
            {"layer_norm_epsilon", 1e-5},
            {"initializer_range", 0.02},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"tie_word_embeddings", true}};
  }
  nlohmann::json section_json() const override {
    return {{"block_size", section_block_size_}, {"n_layer", c_.n_layer}, {"n_head", c_.n_head}, {"n_embd", c_.n_embd}};
  }
  std::optional<SizeError> size_error() const override { return models::size_error(c_); }
  void fit_data(int64_t vocab_size, int64_t seq_len) override {
    if (vocab_size > 0) c_.vocab_size = vocab_size;
    if (section_block_size_ == 0) c_.block_size = std::max<int64_t>(seq_len, 1);
    if (c_.block_size < seq_len)
      throw ConfigError("model.block_size", "must be >= data.seq_len " + std::to_string(seq_len) + ", got " +
                                                std::to_string(c_.block_size));
  }
  const GptConfig& gpt() const { return c_; }
  // The section's block_size: 0 takes data.seq_len (fit_data).
  int64_t section_block_size_ = -1;

 private:
  GptConfig c_;
};

// zinc's `model` section for "gpt": the sizes, defaults GptConfig's; a
// block_size of 0 (the default) is the data's sequence length.
std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  using config::at_least;
  GptConfig c;
  int64_t block_size = 0;
  r.get_int("block_size", block_size, at_least(0));
  r.get_int("n_layer", c.n_layer, at_least(1));
  r.get_int("n_head", c.n_head, at_least(1));
  r.get_int("n_embd", c.n_embd, at_least(1));
  if (block_size > 0) c.block_size = block_size;
  auto out = std::make_unique<Config>(c);
  out->section_block_size_ = block_size;
  return out;
}

std::unique_ptr<FamilyConfig> read(const ConfigDoc& f, const std::string& /*architecture*/) {
  GptConfig c;
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
  if (eps != 1e-5) f.fail("layer_norm_epsilon", "zinc's gpt uses 1e-05, got " + nlohmann::json(eps).dump());
  for (const char* k : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"})
    if (f.get_bool(k, false)) f.fail(k, "true is not supported (zinc's gpt is GPT-2's plain attention)");
  if (!f.get_bool("scale_attn_weights", true)) f.fail("scale_attn_weights", "false is not supported");
  if (!f.get_bool("tie_word_embeddings", true))
    f.fail("tie_word_embeddings", "false is not supported (zinc's gpt ties its head)");
  if (auto bad = size_error(c)) f.fail(bad->field, bad->message);
  return std::make_unique<Config>(c);
}

}  // namespace

const Family& family() {
  static const Family kFamily{"gpt",
                              {"GPT2LMHeadModel"},
                              "wte.weight",
                              "transformer.",
                              "n_positions",
                              "n_embd",
                              &read,
                              {{"block_size", "n_positions"}, {"n_layer", ""}, {"n_head", ""}, {"n_embd", ""}},
                              &from_section};
  return kFamily;
}

std::unique_ptr<FamilyConfig> family_config(const GptConfig& c) { return std::make_unique<Config>(c); }

const GptConfig* settings(const FamilyConfig& f) {
  const auto* c = dynamic_cast<const Config*>(&f);
  return c ? &c->gpt() : nullptr;
}

}  // namespace zinc::models::gpt
