// The registry of model families (models/family.h) and ConfigDoc.
//
// Note [model families]
// ---------------------
// A family lives in models/<family>/: model.cpp holds the graph (forward,
// backward, the parameter specs), family.cpp what ties it to transformers:
// reading config.json into the family's FamilyConfig (defaults and size
// rules written once, in the family's config struct in models/models.h),
// the tensor map both ways (FamilyConfig::pieces: each zinc parameter as
// pieces of transformers' tensors, whole rows, possibly transposed), the
// tensors a file may hold that zinc never reads, and the config.json an
// export writes. A family is registered by one line of ZINC_FAMILIES
// below; nothing outside its folder names it. Families that share a graph
// (Llama, Mistral and Qwen2 are one graph with options) are one family with
// several architectures.
#include "models/family.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "engine/config_reader.h"

namespace zinc::models {

// One line per family: the namespace its family.cpp defines family() in.
#define ZINC_FAMILIES(X) \
  X(gpt)                 \
  X(mlp)                 \
  X(llama)               \
  X(qwen3)               \
  X(smollm3)             \
  X(granite)             \
  X(gemma)               \
  X(gemma2)              \
  X(gemma3)              \
  X(olmo2)               \
  X(phi3)                \
  X(gpt_neox)            \
  X(mixtral)             \
  X(qwen3_moe)

#define ZINC_DECLARE_FAMILY(ns) \
  namespace ns {                \
  const Family& family();       \
  }
ZINC_FAMILIES(ZINC_DECLARE_FAMILY)
#undef ZINC_DECLARE_FAMILY

const std::vector<const Family*>& families() {
#define ZINC_LIST_FAMILY(ns) &ns::family(),
  static const std::vector<const Family*> kFamilies = {ZINC_FAMILIES(ZINC_LIST_FAMILY)};
#undef ZINC_LIST_FAMILY
  return kFamilies;
}

const Family* family_named(const std::string& name) {
  for (const Family* f : families())
    if (f->name == name) return f;
  return nullptr;
}

const Family* family_for_architecture(const std::string& architecture) {
  for (const Family* f : families())
    for (const std::string& a : f->architectures)
      if (a == architecture) return f;
  return nullptr;
}

std::shared_ptr<const FamilyConfig> section_defaults(const Family& family) {
  std::vector<std::string> warnings;
  static const nlohmann::json kEmpty = nlohmann::json::object();
  config::Reader r(kEmpty, "model", warnings, false);
  return family.from_section(r);
}

std::string supported_architectures_text() {
  std::string s;
  for (const Family* f : families())
    for (const std::string& a : f->architectures) s += (s.empty() ? "" : ", ") + a;
  return s;
}

void ConfigDoc::fail(const std::string& key, const std::string& msg) const {
  throw Error(path_ + ": " + (key.empty() ? "" : key + ": ") + msg);
}

int64_t ConfigDoc::get_int(const std::string& k) const {
  if (!has(k)) fail(k, "missing (zinc needs it to size the model)");
  return to_int(j_[k], k);
}

int64_t ConfigDoc::get_int(const std::string& k, int64_t dflt) const { return has(k) ? to_int(j_[k], k) : dflt; }

double ConfigDoc::get_number(const std::string& k, double dflt) const {
  if (!has(k)) return dflt;
  if (!j_[k].is_number()) fail(k, "expected a number, got " + j_[k].dump());
  return j_[k].get<double>();
}

bool ConfigDoc::get_bool(const std::string& k, bool dflt) const {
  if (!has(k)) return dflt;
  if (!j_[k].is_boolean()) fail(k, "expected true or false, got " + j_[k].dump());
  return j_[k].get<bool>();
}

std::string ConfigDoc::get_string(const std::string& k, const std::string& dflt) const {
  if (!has(k)) return dflt;
  if (!j_[k].is_string()) fail(k, "expected a string, got " + j_[k].dump());
  return j_[k].get<std::string>();
}

int64_t ConfigDoc::to_int(const nlohmann::json& v, const std::string& k) const {
  if (v.is_number_integer()) return v.get<int64_t>();
  // A whole number written as a float (2.0e3), inside int64's range (the
  // cast of one outside it is undefined).
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::trunc(d) && d >= -9.2e18 && d <= 9.2e18) return static_cast<int64_t>(d);
  }
  fail(k, "expected an integer, got " + v.dump());
}

void add_lora_delta(float* w, const float* A, const float* B, int64_t rows, int64_t in, int64_t r, float scale) {
  std::vector<float> row(static_cast<size_t>(in));
  for (int64_t i = 0; i < rows; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t k = 0; k < r; ++k) {
      const float bik = B[i * r + k];
      for (int64_t j = 0; j < in; ++j) row[static_cast<size_t>(j)] += bik * A[k * in + j];
    }
    for (int64_t j = 0; j < in; ++j) w[i * in + j] += row[static_cast<size_t>(j)] * scale;
  }
}

bool merge_lora_module(const Model& model, int block, std::vector<float>& flat, int adapter,
                       const std::vector<float>& adapter_flat, const std::string& weight, const std::string& path,
                       int64_t row, float scale) {
  const BlockSpec& b = model.blocks()[static_cast<size_t>(block)];
  const BlockSpec& a = model.blocks()[static_cast<size_t>(adapter)];
  auto index = [](const BlockSpec& s, const std::string& name) {
    for (size_t i = 0; i < s.params.size(); ++i)
      if (s.params[i].name == name) return static_cast<int>(i);
    return -1;
  };
  const int ai = index(a, path + ".lora_A.weight"), bi = index(a, path + ".lora_B.weight"), wi = index(b, weight);
  if (ai < 0) return false;
  if (bi < 0 || wi < 0) throw Error("merge_lora: block '" + b.name + "' has no " + weight + " for " + path);
  const BlockLayout lb = BlockLayout::from_spec(b), la = BlockLayout::from_spec(a);
  const Shape& as = a.params[static_cast<size_t>(ai)].shape;  // (r, in)
  const Shape& bs = a.params[static_cast<size_t>(bi)].shape;  // (rows, r)
  const int64_t r = as.dims[0], in = as.dims[1], rows = bs.dims[0];
  add_lora_delta(flat.data() + lb.offsets[static_cast<size_t>(wi)] + row * in,
                 adapter_flat.data() + la.offsets[static_cast<size_t>(ai)],
                 adapter_flat.data() + la.offsets[static_cast<size_t>(bi)], rows, in, r, scale);
  return true;
}

LoraConfig resolve_lora_targets(LoraConfig lora, const std::vector<std::string>& modules,
                                const std::vector<std::string>& defaults) {
  const std::vector<std::string>& t = lora.targets;
  if (t.empty()) {
    lora.targets = defaults;
    return lora;
  }
  if (t.size() == 1 && t[0] == kAllLinear) {
    lora.targets = modules;
    return lora;
  }
  std::vector<std::string> ordered;
  for (const std::string& m : modules)
    if (std::find(t.begin(), t.end(), m) != t.end()) ordered.push_back(m);
  for (const std::string& m : t)
    if (std::find(modules.begin(), modules.end(), m) == modules.end()) ordered.push_back(m);
  lora.targets = ordered;
  return lora;
}

void FamilyConfig::set_lora(const LoraConfig& lora) {
  if (!lora.enabled()) return;
  throw ConfigError("model.lora", "model.type \"" + family().name + "\" takes no LoRA adapters yet");
}

void FamilyConfig::merge_lora(const Model&, int, std::vector<float>&, int, const std::vector<float>&) const {
  throw Error("model.type \"" + family().name + "\" has no LoRA adapters to merge");
}

std::vector<HfPiece> FamilyConfig::adapter_pieces(const Model& model, int block, int param,
                                                  const std::string& name) const {
  const Shape& sh = model.blocks()[static_cast<size_t>(block)].params[static_cast<size_t>(param)].shape;
  const std::vector<int64_t> shape(sh.dims.begin(), sh.dims.begin() + sh.ndim);
  return {HfPiece{name, shape, shape.empty() ? 1 : shape[0], false}};
}

const LoraConfig& FamilyConfig::lora() const {
  static const LoraConfig kNone;
  return kNone;
}

}  // namespace zinc::models
