// zinc tools: the parsers of the experiment sections (model, data, run,
// comm) and their cross-field checks; see experiment_config.h. Each section
// walks its JSON object through the engine's Reader, as the DeepSpeed
// sections do in engine/config.cpp.
#include "tools/experiment_config.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "core/error.h"
#include "core/log.h"
#include "engine/config_reader.h"
#include "models/models.h"
#include "tools/hf_model.h"
#include "tools/peft_adapter.h"

namespace zinc::tools {
namespace {

using namespace config;

// Every family's section keys, and the families that take each.
std::vector<std::string> owners_of(const std::string& key) {
  std::vector<std::string> out;
  for (const models::Family* f : models::families())
    for (const auto& [k, hf] : f->section_keys)
      if (k == key) out.push_back(f->name);
  return out;
}

// model.lora: PEFT's LoraConfig keys, its defaults (r 8, lora_alpha 8,
// target_modules q_proj and v_proj, as PEFT picks for the Llama family).
void parse_lora(Reader& model, models::LoraConfig& l) {
  Reader r = model.section("lora");
  l = models::LoraConfig{};
  l.r = 8;
  r.get_int("r", l.r, closed(1, models::kMaxLoraRank));
  r.get_number("lora_alpha", l.alpha, above(0));
  r.get_bool("use_rslora", l.rslora);
  r.get_number("lora_dropout", l.dropout, lo_closed(0, 1));
  std::string bias = "none";
  if (r.get_choice("bias", bias, {"none", "all", "lora_only"}) && bias != "none")
    throw ConfigError(r.last_path(), "\"" + bias + "\": trained biases are not implemented; only \"none\"");
  bool init = true;
  if (r.get_bool("init_lora_weights", init) && !init)
    throw ConfigError(r.last_path(), "false (B drawn at random, PEFT's test setting) is not implemented; true "
                                     "starts A Kaiming-uniform and B at zero, as PEFT does");
  if (const nlohmann::json* mts = r.find("modules_to_save"); mts && !mts->is_null()) {
    // The names are the family's to check (its size rules).
    if (!mts->is_array()) throw ConfigError(r.last_path(), "expected a list of module names, got " + mts->dump());
    for (const nlohmann::json& m : *mts) {
      if (!m.is_string()) throw ConfigError(r.last_path(), "expected module names, got " + m.dump());
      if (std::find(l.modules_to_save.begin(), l.modules_to_save.end(), m.get<std::string>()) ==
          l.modules_to_save.end())
        l.modules_to_save.push_back(m.get<std::string>());
    }
  }
  l.targets = {};  // PEFT's default for the family (FamilyConfig::set_lora)
  if (const nlohmann::json* tm = r.find("target_modules")) {
    const std::string at = r.last_path();
    l.targets.clear();
    // The names are checked by the model's family (FamilyConfig::set_lora
    // and its size rules), which knows its modules and orders them.
    if (tm->is_string() && tm->get<std::string>() == models::kAllLinear) {
      l.targets = {models::kAllLinear};
    } else if (tm->is_array() && !tm->empty()) {
      for (const nlohmann::json& t : *tm) {
        if (!t.is_string()) throw ConfigError(at, "expected module names, got " + t.dump());
        const std::string name = t.get<std::string>();
        if (std::find(l.targets.begin(), l.targets.end(), name) == l.targets.end()) l.targets.push_back(name);
      }
    } else {
      throw ConfigError(at, "expected a list of module names or \"all-linear\", got " + tm->dump());
    }
  }
  r.finish();
}

void parse_model(Reader& root, ModelConfig& m) {
  Reader r = root.section("model");
  std::vector<std::string> names;
  for (const models::Family* f : models::families()) names.push_back(f->name);
  if (r.get_choice("type", m.type, names)) m.given.push_back("type");
  if (r.get_file_name("from_pretrained", m.from_pretrained) && m.from_pretrained.empty())
    throw ConfigError(r.last_path(), "must not be empty (a Hugging Face model folder)");
  if (r.get_int("vocab_size", m.vocab_size, closed(0, 1 << 24))) m.given.push_back("vocab_size");
  r.get_bool("gradient_checkpointing", m.gradient_checkpointing);
  r.get_bool("pack_frozen_weights", m.pack_frozen_weights);
  // "lora": null is LoRA off, as PEFT's configs write null for what is unused.
  if (const nlohmann::json* l = r.find("lora"); l && !l->is_null()) parse_lora(r, m.lora);
  if (r.get_file_name("adapter", m.adapter)) {
    if (m.adapter.empty()) throw ConfigError(r.last_path(), "must not be empty (a PEFT adapter folder)");
    if (m.from_pretrained.empty())
      throw ConfigError(r.last_path(), "an adapter adapts a pretrained model: give model.from_pretrained too");
    if (m.lora.enabled())
      throw ConfigError(r.last_path(), "give model.lora or model.adapter, not both (the adapter folder's "
                                       "adapter_config.json is its configuration)");
  }
  const models::Family& family = m.family();
  if (m.from_pretrained.empty()) {
    // The family reads its own keys; a key of another family changes
    // nothing: said. Any other key is an unknown key (finish()).
    m.settings.model = family.from_section(r);
    for (const std::string& k : r.keys()) {
      const std::vector<std::string> owners = owners_of(k);
      if (owners.empty() || std::find(owners.begin(), owners.end(), family.name) != owners.end()) continue;
      r.skip(k);
      std::string who;
      for (const std::string& o : owners) who += (who.empty() ? "" : ", ") + o;
      r.warn("model." + k, "ignored: not a size of model.type \"" + family.name + "\" (it is " + who + "'s)");
    }
    for (const auto& [k, hf] : family.section_keys)
      if (r.has(k.c_str())) m.given.push_back(k);
  } else {
    // The sizes are the folder's: a size key given too is kept as written,
    // to be checked against config.json when the folder is read
    // (build_experiment), where its family is known.
    for (const std::string& k : r.keys()) {
      if (owners_of(k).empty()) continue;
      r.skip(k);
      m.given_values[k] = *r.find(k.c_str());
      m.given.push_back(k);
    }
  }
  r.finish();
}

// model.gradient_checkpointing and the trainer section's TrainingArguments
// flag switch the same thing: either turns it on; both given and different
// is an error naming both paths (neither silently wins).
void combine_gradient_checkpointing(const nlohmann::json& doc, const TrainerConfig& t, ModelConfig& m) {
  if (t.gradient_checkpointing < 0) return;
  const bool model_given = doc.contains("model") && doc["model"].is_object() &&
                           doc["model"].contains("gradient_checkpointing");
  const bool trainer_on = t.gradient_checkpointing == 1;
  if (model_given && m.gradient_checkpointing != trainer_on) {
    throw ConfigError("model.gradient_checkpointing",
                      std::string(m.gradient_checkpointing ? "true" : "false") +
                          " conflicts with trainer.gradient_checkpointing " + (trainer_on ? "true" : "false") +
                          "; give one of them, or both the same");
  }
  if (trainer_on && m.from_pretrained.empty() && !m.settings.model->supports_checkpointing()) {
    throw ConfigError("trainer.gradient_checkpointing",
                      std::string("not supported by model.type \"") + m.type +
                          "\" (the gpt and the llama recompute their layers); set it to false");
  }
  m.gradient_checkpointing = m.gradient_checkpointing || trainer_on;
}

void parse_data(Reader& root, DataConfig& d) {
  Reader r = root.section("data");
  r.get_enum("type", d.type,
             {{"synthetic", DataType::kSynthetic}, {"text", DataType::kText}, {"tokens", DataType::kTokens}});
  bool has_path = r.get_file_name("path", d.path);
  r.get_int("seq_len", d.seq_len, at_least(1));
  bool has_vocab = r.get_int("vocab_size", d.vocab_size, closed(2, int64_t{1} << 24));
  const bool has_width = r.get_enum("token_dtype", d.token_bytes, {{"uint16", int64_t{2}}, {"uint32", int64_t{4}}});
  bool has_det = r.get_number("determinism", d.determinism, closed(0, 1));
  r.get_u64("seed", d.seed);
  bool has_eval = r.get_number("eval_fraction", d.eval_fraction, lo_closed(0, 1));
  const bool has_mask = r.get_file_name("mask_path", d.mask_path);
  const bool has_docs = r.get_file_name("documents_path", d.documents_path);
  r.finish();
  for (auto [has, key] : {std::pair{has_mask, "mask_path"}, std::pair{has_docs, "documents_path"}})
    if (has && d.type != DataType::kTokens)
      throw ConfigError(r.path_of(key), std::string("is for type \"tokens\" only (a file beside the token file), not \"") +
                                            data_type_name(d.type) + "\"");
  if (d.type == DataType::kSynthetic) {
    if (has_path) r.warn(r.path_of("path"), "ignored for type \"synthetic\"");
    if (has_width) r.warn(r.path_of("token_dtype"), "ignored for type \"synthetic\"");
    if (has_eval && d.eval_fraction > 0) {
      r.warn(r.path_of("eval_fraction"), "ignored for type \"synthetic\" (an endless stream)");
    }
  } else {
    if (d.path.empty()) {
      throw ConfigError(r.path_of("path"),
                        "required for type \"" + std::string(data_type_name(d.type)) + "\" (the file to read)");
    }
    if (d.type == DataType::kTokens) {
      // A token file's vocabulary comes from the file unless the config
      // states it (then every token is checked against it).
      if (!has_vocab) d.vocab_size = 0;
    } else if (has_vocab) {
      r.warn(r.path_of("vocab_size"), "ignored for type \"text\" (bytes: the vocabulary is 256)");
    }
    if (has_width && d.type != DataType::kTokens)
      r.warn(r.path_of("token_dtype"), "ignored for type \"text\" (bytes)");
    if (has_det) {
      r.warn(r.path_of("determinism"),
             "ignored for type \"" + std::string(data_type_name(d.type)) + "\" (only synthetic data takes it)");
    }
  }
}

void parse_run(Reader& root, RunConfig& run) {
  Reader r = root.section("run");
  r.get_int("steps", run.steps, at_least(0));  // 0: load (and --save-pretrained) without training
  r.get_u64("seed", run.seed);
  r.get_int("eval_interval", run.eval_interval, at_least(0));
  r.get_int("eval_batches", run.eval_batches, at_least(1));
  r.get_int("checkpoint_interval", run.checkpoint_interval, at_least(0));
  if (r.get_file_name("output_dir", run.output_dir) && run.output_dir.empty())
    throw ConfigError(r.last_path(), "must not be empty");
  if (r.get_file_name("checkpoint_dir", run.checkpoint_dir) && run.checkpoint_dir.empty())
    throw ConfigError(r.last_path(), "must not be empty (leave it out for output_dir/checkpoints)");
  if (run.checkpoint_dir.empty()) run.checkpoint_dir = run.output_dir + "/checkpoints";
  r.get_int("keep_last", run.keep_last, at_least(0));
  r.finish();
}

void parse_comm(Reader& root, CommConfig& comm) {
  Reader r = root.section("comm");
  r.get_enum("backend", comm.backend,
             {{"auto", CommBackend::kAuto},
              {"mpi", CommBackend::kMpi},
              {"shm", CommBackend::kShm},
              {"hierarchical", CommBackend::kHierarchical}});
  // At least a second: below it a healthy rank that is a moment late is
  // reported as stopped or dead (1e-9 failed 2-rank runs at random, each
  // blaming the other rank).
  r.get_number("timeout_seconds", comm.timeout_seconds, at_least(1));
  r.finish();
}

}  // namespace

const models::Family& ModelConfig::family() const {
  const models::Family* f = models::family_named(type);
  if (!f) throw ConfigError("model.type", "\"" + type + "\" is not a registered model family");
  return *f;
}

const char* comm_backend_name(CommBackend b) {
  switch (b) {
    case CommBackend::kAuto: return "auto";
    case CommBackend::kMpi: return "mpi";
    case CommBackend::kShm: return "shm";
    case CommBackend::kHierarchical: return "hierarchical";
  }
  return "?";
}

const std::vector<std::string>& ExperimentConfig::sections() {
  static const std::vector<std::string> kSections = {"model", "data", "run", "comm", "trainer"};
  return kSections;
}

ExperimentConfig ExperimentConfig::parse(const nlohmann::json& doc) { return parse(doc, parse_trainer(doc)); }

ExperimentConfig ExperimentConfig::parse(const nlohmann::json& doc, const TrainerConfig& trainer) {
  ExperimentConfig e;
  e.trainer = trainer;
  Reader root(doc, "", e.warnings);
  parse_model(root, e.model);
  combine_gradient_checkpointing(doc, trainer, e.model);
  parse_data(root, e.data);
  parse_run(root, e.run);
  tools::parse_comm(root, e.comm);
  // No root.finish(): the other top-level keys are Config::parse's.
  e.validate();
  e.model_given = doc.is_object() && doc.contains("model");
  e.data_given = doc.is_object() && doc.contains("data");
  if (!e.model_given) {
    const std::string w = "model: no model section: zinc-train trains its default model, a " +
                          e.model.type + " of " + std::to_string(e.model.settings.model->section_json()["n_layer"].get<int64_t>()) +
                          " layers of " + std::to_string(e.model.settings.model->hidden_size()) +
                          " from random weights (set model, or model.from_pretrained)";
    log_warn_rank0("config: " + w);
    e.warnings.push_back(w);
  }
  if (!e.data_given) {
    const std::string w = "data: no data section: zinc-train trains on synthetic tokens (set data.type and data.path)";
    log_warn_rank0("config: " + w);
    e.warnings.push_back(w);
  }
  return e;
}

CommConfig ExperimentConfig::parse_comm(const nlohmann::json& doc) {
  CommConfig c;
  if (!doc.is_object()) return c;
  std::vector<std::string> warnings;
  Reader root(doc, "", warnings);
  tools::parse_comm(root, c);
  return c;  // no root.finish(): the other keys are parse_experiment()'s
}

void ExperimentConfig::validate() const {
  // The model's own size rules (models/), at the section's JSON paths, then
  // the model against the data (the vocabulary, and positions left at 0,
  // come from the data when the model is built: build_experiment; the
  // family's defaults stand in for them here). With a folder the sizes are
  // config.json's, checked when it is read.
  if (model.from_pretrained.empty()) {
    const models::FamilyConfig& fc = *model.settings.model;
    if (auto bad = fc.size_error()) throw ConfigError("model." + bad->field, bad->message);
    if (model.gradient_checkpointing && !fc.supports_checkpointing())
      throw ConfigError("model.gradient_checkpointing", "not supported by model.type \"" + model.type +
                                                            "\" (the gpt and the llama recompute their layers); remove it");
    fc.clone()->fit_data(0, data.seq_len);
  }
  const int64_t data_vocab = data.type == DataType::kSynthetic ? data.vocab_size
                             : data.type == DataType::kText    ? 256
                                                               : 0;
  if (model.vocab_size > 0 && data_vocab > 0 && model.vocab_size < data_vocab) {
    throw ConfigError("model.vocab_size", "must be >= the data's vocabulary " + std::to_string(data_vocab) +
                                              " (or 0 to take it from the data), got " +
                                              std::to_string(model.vocab_size));
  }
  if ((data.type == DataType::kText || data.type == DataType::kTokens) && data.path.empty()) {
    throw ConfigError("data.path",
                      "required for type \"" + std::string(data_type_name(data.type)) + "\" (the file to read)");
  }
}

nlohmann::json to_json(const ExperimentConfig& e) {
  const ModelConfig& m = e.model;
  const DataConfig& d = e.data;
  const RunConfig& r = e.run;
  nlohmann::json data = {{"type", data_type_name(d.type)}, {"seq_len", d.seq_len}, {"seed", d.seed}};
  if (d.type == DataType::kSynthetic) {
    data["vocab_size"] = d.vocab_size;
    data["determinism"] = d.determinism;
  } else {
    data["path"] = d.path;
    if (d.type == DataType::kTokens && d.vocab_size > 0) data["vocab_size"] = d.vocab_size;
    if (d.type == DataType::kTokens && d.token_bytes > 0) data["token_dtype"] = d.token_bytes == 4 ? "uint32" : "uint16";
    if (!d.mask_path.empty()) data["mask_path"] = d.mask_path;
    if (!d.documents_path.empty()) data["documents_path"] = d.documents_path;
    data["eval_fraction"] = d.eval_fraction;
  }
  nlohmann::json model = {{"type", m.type}, {"vocab_size", m.vocab_size}, {"gradient_checkpointing", m.gradient_checkpointing}};
  if (!m.from_pretrained.empty()) {
    // The sizes are the folder's: only the keys the section gave (they agree with it).
    model["from_pretrained"] = m.from_pretrained;
    if (std::find(m.given.begin(), m.given.end(), "type") == m.given.end()) model.erase("type");
    if (std::find(m.given.begin(), m.given.end(), "vocab_size") == m.given.end()) model.erase("vocab_size");
    model.update(m.given_values);
  } else {
    model.update(m.settings.model->section_json());
  }
  if (m.lora.enabled())
    model["lora"] = {{"r", m.lora.r}, {"lora_alpha", m.lora.alpha}, {"use_rslora", m.lora.rslora},
                     {"lora_dropout", m.lora.dropout}, {"target_modules", m.lora.targets},
                     {"modules_to_save", m.lora.modules_to_save}};
  if (!m.adapter.empty()) model["adapter"] = m.adapter;
  if (m.lora.enabled() || !m.adapter.empty()) model["pack_frozen_weights"] = m.pack_frozen_weights;
  return {{"model", model},
          {"data", data},
          {"run",
           {{"steps", r.steps},
            {"seed", r.seed},
            {"eval_interval", r.eval_interval},
            {"eval_batches", r.eval_batches},
            {"checkpoint_interval", r.checkpoint_interval},
            {"output_dir", r.output_dir},
            {"checkpoint_dir", r.checkpoint_dir},
            {"keep_last", r.keep_last}}},
          {"comm", {{"backend", comm_backend_name(e.comm.backend)}, {"timeout_seconds", e.comm.timeout_seconds}}}};
}

// Note [one config pass]
// -----------------------
// A document is read once, section by section, each key by one reader:
// the trainer section first (the "auto" rules and the experiment both use
// it), then the experiment's sections, then "auto" (resolve_auto) from the
// parsed values in AutoFacts, then the DeepSpeed sections of the resolved
// document. "auto" comes after the experiment because its rules depend on
// it: the schedule's length is run.steps, and the ZeRO buckets follow the
// model's hidden size, which is model.n_embd for the GPT, model.hidden_size
// for the Llama and config.json's for a model folder (the Trainer reads
// model.config.hidden_size). The only key read twice is the batch triad's
// micro-batch and accumulation, which train_batch_size's "auto" multiplies
// before Config::parse checks them.
AutoFacts auto_facts(const ExperimentConfig& e, int world_size) {
  AutoFacts f;
  f.world_size = world_size;
  f.trainer = e.trainer;
  f.run_steps = e.run.steps;
  const ModelConfig m = e.model;
  f.hidden = [m]() -> AutoFacts::Width {
    if (!m.from_pretrained.empty()) {
      const HfConfig hf = read_hf_config(m.from_pretrained);
      const int64_t h = hf.model->hidden_size();
      return {h, "model.from_pretrained", "hidden size " + std::to_string(h) + " of " + m.from_pretrained + "/config.json"};
    }
    const int64_t h = m.settings.model->hidden_size();
    const std::string key = "model." + m.family().hidden_size_key;
    return {h, key, key + " " + std::to_string(h)};
  };
  return f;
}

ResolvedConfig resolve_auto(const nlohmann::json& doc, int world_size) {
  return resolve_auto(doc, auto_facts(ExperimentConfig::parse(doc), world_size));
}

ParsedExperiment parse_experiment(const nlohmann::json& doc, int world_size) {
  ParsedExperiment p;
  // The order of Note [one config pass]: the trainer section, the
  // experiment's sections, "auto" from what those two hold, the DeepSpeed
  // sections of the resolved document.
  const TrainerConfig trainer = parse_trainer(doc);
  p.experiment = ExperimentConfig::parse(doc, trainer);
  ResolvedConfig r = resolve_auto(doc, auto_facts(p.experiment, world_size));
  p.config = Config::parse(r.doc, world_size, ExperimentConfig::sections());
  p.auto_values = std::move(r.values);
  p.config.seed = p.experiment.run.seed;
  // DeepSpeed's activation_checkpointing section configures checkpointing
  // but does not switch it on (models opt in); say so when it is the only
  // sign that checkpointing was wanted.
  if (p.config.activation_checkpointing.given && !p.experiment.model.gradient_checkpointing) {
    const std::string w = "activation_checkpointing: does not switch checkpointing on (in DeepSpeed, neither); "
                          "set model.gradient_checkpointing or trainer.gradient_checkpointing to true";
    log_warn_rank0("config: " + w);
    p.experiment.warnings.push_back(w);
  }
  return p;
}

}  // namespace zinc::tools
