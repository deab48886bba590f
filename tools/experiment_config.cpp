// zinc tools: the parsers of the experiment sections (model, data, run,
// comm) and their cross-field checks; see experiment_config.h. Each section
// walks its JSON object through the engine's Reader, as the DeepSpeed
// sections do in engine/config.cpp.
#include "tools/experiment_config.h"

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "core/log.h"
#include "engine/config_reader.h"
#include "models/models.h"
#include "tools/hf_model.h"

namespace zinc::tools {
namespace {

using namespace config;

// The size keys of each model type (any other type's are refused by name).
const std::vector<std::string>& type_keys(ModelType t) {
  static const std::vector<std::string> kGpt = {"block_size", "n_layer", "n_head", "n_embd"};
  static const std::vector<std::string> kMlp = {"context", "n_embd", "hidden", "n_layer"};
  static const std::vector<std::string> kLlama = {
      "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
      "head_dim",    "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings"};
  return t == ModelType::kGpt ? kGpt : t == ModelType::kMlp ? kMlp : kLlama;
}

void parse_model(Reader& root, ModelConfig& m) {
  Reader r = root.section("model");
  const bool type_given = r.get_enum("type", m.type, {{"gpt", ModelType::kGpt}, {"mlp", ModelType::kMlp}, {"llama", ModelType::kLlama}});
  if (type_given) m.given.push_back("type");
  if (r.get_file_name("from_pretrained", m.from_pretrained) && m.from_pretrained.empty())
    throw ConfigError(r.last_path(), "must not be empty (a Hugging Face model folder)");
  auto note = [&](bool got, const char* k) {
    if (got) m.given.push_back(k);
  };
  note(r.get_int("vocab_size", m.vocab_size, closed(0, 1 << 24)), "vocab_size");
  note(r.get_int("block_size", m.block_size, at_least(0)), "block_size");
  note(r.get_int("n_layer", m.n_layer, at_least(1)), "n_layer");
  note(r.get_int("n_head", m.n_head, at_least(1)), "n_head");
  note(r.get_int("n_embd", m.n_embd, at_least(1)), "n_embd");
  note(r.get_int("context", m.context, at_least(1)), "context");
  note(r.get_int("hidden", m.hidden, at_least(1)), "hidden");
  note(r.get_int("hidden_size", m.hidden_size, at_least(1)), "hidden_size");
  note(r.get_int("intermediate_size", m.intermediate_size, at_least(1)), "intermediate_size");
  note(r.get_int("num_hidden_layers", m.num_hidden_layers, at_least(1)), "num_hidden_layers");
  note(r.get_int("num_attention_heads", m.num_attention_heads, at_least(1)), "num_attention_heads");
  note(r.get_int("num_key_value_heads", m.num_key_value_heads, at_least(0)), "num_key_value_heads");
  note(r.get_int("head_dim", m.head_dim, at_least(0)), "head_dim");
  note(r.get_int("max_position_embeddings", m.max_position_embeddings, at_least(0)), "max_position_embeddings");
  note(r.get_number("rms_norm_eps", m.rms_norm_eps, above(0)), "rms_norm_eps");
  note(r.get_number("rope_theta", m.rope_theta, above(0)), "rope_theta");
  note(r.get_bool("tie_word_embeddings", m.tie_word_embeddings), "tie_word_embeddings");
  r.get_bool("gradient_checkpointing", m.gradient_checkpointing);
  r.finish();
  // With a folder the type comes from its architecture (checked when it is
  // read); without one, a size key of another type changes nothing: said.
  if (!m.from_pretrained.empty()) return;
  const std::vector<std::string>& own = type_keys(m.type);
  for (const std::string& k : m.given) {
    if (k == "type" || k == "vocab_size" || std::find(own.begin(), own.end(), k) != own.end()) continue;
    std::string owners;
    for (ModelType t : {ModelType::kGpt, ModelType::kMlp, ModelType::kLlama}) {
      const auto& keys = type_keys(t);
      if (std::find(keys.begin(), keys.end(), k) != keys.end())
        owners += (owners.empty() ? "" : ", ") + std::string(model_type_name(t));
    }
    r.warn("model." + k, std::string("ignored: not a size of model.type \"") + model_type_name(m.type) +
                             "\" (it is " + owners + "'s)");
  }
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
  if (trainer_on && m.type == ModelType::kMlp) {
    throw ConfigError("trainer.gradient_checkpointing",
                      std::string("not supported by model.type \"") + model_type_name(m.type) +
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
  r.get_number("timeout_seconds", comm.timeout_seconds, above(0));
  r.finish();
}

}  // namespace

const char* model_type_name(ModelType t) {
  switch (t) {
    case ModelType::kGpt: return "gpt";
    case ModelType::kMlp: return "mlp";
    case ModelType::kLlama: return "llama";
  }
  return "?";
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
                          std::string(model_type_name(e.model.type)) + " of " + std::to_string(e.model.n_layer) +
                          " layers of " + std::to_string(e.model.n_embd) +
                          " from random weights (set model, or model.from_pretrained)";
    log_warn("config: " + w);
    e.warnings.push_back(w);
  }
  if (!e.data_given) {
    const std::string w = "data: no data section: zinc-train trains on synthetic tokens (set data.type and data.path)";
    log_warn("config: " + w);
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

models::LlamaConfig llama_config(const ModelConfig& m, int64_t vocab_size, int64_t seq_len) {
  models::LlamaConfig c;
  if (vocab_size > 0) c.vocab_size = vocab_size;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_hidden_layers = m.num_hidden_layers;
  c.num_attention_heads = m.num_attention_heads;
  c.num_key_value_heads = m.num_key_value_heads;
  c.head_dim = m.head_dim;
  c.max_position_embeddings = m.max_position_embeddings > 0 ? m.max_position_embeddings : std::max<int64_t>(seq_len, 1);
  c.rms_norm_eps = m.rms_norm_eps;
  c.rope_theta = m.rope_theta;
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.gradient_checkpointing = m.gradient_checkpointing;
  return c;
}

void ExperimentConfig::validate() const {
  // The model's own size rules (models/), at the section's JSON paths. The
  // vocabulary, and a block size of 0, come from the data when the model is
  // built (build_experiment); the models' defaults stand in for them here.
  std::optional<models::SizeError> bad;
  if (!model.from_pretrained.empty()) {
    // The sizes are config.json's, checked when the folder is read.
  } else if (model.type == ModelType::kLlama) {
    bad = models::size_error(llama_config(model, 0, 0));
  } else if (model.type == ModelType::kGpt) {
    models::GptConfig g;
    if (model.block_size > 0) g.block_size = model.block_size;
    g.n_layer = model.n_layer;
    g.n_head = model.n_head;
    g.n_embd = model.n_embd;
    bad = models::size_error(g);
  } else if (model.type == ModelType::kMlp) {
    models::MlpConfig m;
    m.context = model.context;
    m.n_embd = model.n_embd;
    m.hidden = model.hidden;
    m.n_layer = model.n_layer;
    bad = models::size_error(m);
  }
  if (bad) throw ConfigError("model." + bad->field, bad->message);
  if (model.gradient_checkpointing && model.type == ModelType::kMlp && model.from_pretrained.empty()) {
    throw ConfigError("model.gradient_checkpointing", std::string("not supported by model.type \"") +
                                                          model_type_name(model.type) +
                                                          "\" (the gpt and the llama recompute their layers); remove it");
  }
  if (model.type == ModelType::kLlama && model.max_position_embeddings > 0 &&
      model.max_position_embeddings < data.seq_len) {
    throw ConfigError("model.max_position_embeddings", "must be >= data.seq_len " + std::to_string(data.seq_len) +
                                                           ", got " + std::to_string(model.max_position_embeddings));
  }

  // The model against the data.
  if (model.type == ModelType::kGpt && model.block_size > 0 && model.block_size < data.seq_len) {
    throw ConfigError("model.block_size", "must be >= data.seq_len " + std::to_string(data.seq_len) +
                                              ", got " + std::to_string(model.block_size));
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
  nlohmann::json model = {{"type", model_type_name(m.type)},
                           {"vocab_size", m.vocab_size},
                           {"gradient_checkpointing", m.gradient_checkpointing}};
  if (!m.from_pretrained.empty()) {
    // The sizes are the folder's: only the keys the section gave (they agree with it).
    model["from_pretrained"] = m.from_pretrained;
    if (std::find(m.given.begin(), m.given.end(), "type") == m.given.end()) model.erase("type");
    if (std::find(m.given.begin(), m.given.end(), "vocab_size") == m.given.end()) model.erase("vocab_size");
  } else if (m.type == ModelType::kLlama) {
    model.update({{"hidden_size", m.hidden_size},
                  {"intermediate_size", m.intermediate_size},
                  {"num_hidden_layers", m.num_hidden_layers},
                  {"num_attention_heads", m.num_attention_heads},
                  {"num_key_value_heads", m.num_key_value_heads},
                  {"head_dim", m.head_dim},
                  {"max_position_embeddings", m.max_position_embeddings},
                  {"rms_norm_eps", m.rms_norm_eps},
                  {"rope_theta", m.rope_theta},
                  {"tie_word_embeddings", m.tie_word_embeddings}});
  } else if (m.type == ModelType::kGpt) {
    model.update({{"block_size", m.block_size}, {"n_layer", m.n_layer}, {"n_head", m.n_head}, {"n_embd", m.n_embd}});
  } else {
    model.update({{"context", m.context}, {"n_embd", m.n_embd}, {"hidden", m.hidden}, {"n_layer", m.n_layer}});
  }
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
    if (m.type == ModelType::kLlama)
      return {m.hidden_size, "model.hidden_size", "model.hidden_size " + std::to_string(m.hidden_size)};
    return {m.n_embd, "model.n_embd", "model.n_embd " + std::to_string(m.n_embd)};
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
    log_warn("config: " + w);
    p.experiment.warnings.push_back(w);
  }
  return p;
}

}  // namespace zinc::tools
