// The MLP family (model.type "mlp"): zinc's own next-token MLP, with no
// Hugging Face form (no architecture; Note [model families] in
// models/registry.cpp). The graph is model.cpp's.
#include <string>

#include "core/error.h"
#include "engine/config_reader.h"
#include "models/family.h"

namespace zinc::models::mlp {

const Family& family();

namespace {

class Config final : public FamilyConfig {
 public:
  explicit Config(const MlpConfig& c) : c_(c) {}
  const Family& family() const override { return mlp::family(); }
  std::unique_ptr<FamilyConfig> clone() const override { return std::make_unique<Config>(*this); }
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t max_positions() const override { return 0; }  // any length: it sees a window of `context` tokens
  int64_t hidden_size() const override { return c_.n_embd; }
  bool tied_head() const override { return false; }
  void untie_head(const std::string&) override {}
  std::shared_ptr<Model> build(Device device, bool gradient_checkpointing) const override {
    if (device != Device::kCpu)
      throw ConfigError("device", "model \"mlp\" computes on the CPU only (the GPU path runs GPT-2 and the Llama-style families)");
    if (gradient_checkpointing)
      throw ConfigError("model.gradient_checkpointing", "not supported by model.type \"mlp\"");
    return make_mlp(c_);
  }
  HfPieces pieces(const Model&, const std::string&) const override { return {}; }
  bool ignored_tensor(const std::string&) const override { return false; }
  nlohmann::json config_json() const override {
    throw Error("model \"mlp\" has no Hugging Face form (export a gpt or a llama)");
  }
  nlohmann::json section_json() const override {
    return {{"context", c_.context}, {"n_embd", c_.n_embd}, {"hidden", c_.hidden}, {"n_layer", c_.n_layer}};
  }
  std::optional<SizeError> size_error() const override { return models::size_error(c_); }
  void fit_data(int64_t vocab_size, int64_t) override {
    if (vocab_size > 0) c_.vocab_size = vocab_size;
  }
  bool supports_checkpointing() const override { return false; }

 private:
  MlpConfig c_;
};

// zinc's `model` section for "mlp". n_embd and n_layer are the keys the
// gpt's section has too, and their defaults are the gpt's (GptConfig's),
// as zinc-train has always had them; hidden's is 512.
std::unique_ptr<FamilyConfig> from_section(config::Reader& r) {
  using config::at_least;
  MlpConfig c;
  c.n_embd = GptConfig{}.n_embd;
  c.n_layer = GptConfig{}.n_layer;
  c.hidden = 512;
  r.get_int("context", c.context, at_least(1));
  r.get_int("n_embd", c.n_embd, at_least(1));
  r.get_int("hidden", c.hidden, at_least(1));
  r.get_int("n_layer", c.n_layer, at_least(1));
  return std::make_unique<Config>(c);
}

}  // namespace

const Family& family() {
  static const Family kFamily{"mlp", {}, "", "", "", "n_embd", nullptr,
                              {{"context", ""}, {"n_embd", ""}, {"hidden", ""}, {"n_layer", ""}}, &from_section};
  return kFamily;
}

}  // namespace zinc::models::mlp
