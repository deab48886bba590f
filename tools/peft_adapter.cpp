#include "tools/peft_adapter.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "engine/config.h"
#include "models/family.h"
#include "tools/output_folder.h"
#include "tools/safetensors.h"

namespace zinc::tools {

models::LoraConfig parse_peft_adapter_config(const nlohmann::json& doc, const std::string& path) {
  auto fail = [&](const std::string& key, const std::string& what) -> void {
    throw Error(path + ": " + key + ": " + what);
  };
  if (!doc.is_object()) throw Error(path + ": expected a JSON object (PEFT's adapter_config.json)");
  auto has = [&](const char* k) { return doc.contains(k) && !doc[k].is_null(); };
  const std::string type = has("peft_type") && doc["peft_type"].is_string() ? doc["peft_type"].get<std::string>() : "";
  if (type != "LORA") fail("peft_type", "expected \"LORA\", got " + (has("peft_type") ? doc["peft_type"].dump() : "nothing"));
  models::LoraConfig l;
  if (!has("r") || !doc["r"].is_number_integer() || doc["r"].get<int64_t>() < 1 ||
      doc["r"].get<int64_t>() > models::kMaxLoraRank)
    fail("r", "expected an integer in [1, " + std::to_string(models::kMaxLoraRank) + "], got " +
                  (has("r") ? doc["r"].dump() : "nothing"));
  l.r = doc["r"].get<int64_t>();
  if (has("lora_alpha")) {
    if (!doc["lora_alpha"].is_number()) fail("lora_alpha", "expected a number, got " + doc["lora_alpha"].dump());
    l.alpha = doc["lora_alpha"].get<double>();
    // As model.lora.lora_alpha: 0 scales every adapter to nothing (no step
    // could change the model), and past float's range the scale is inf.
    if (!(l.alpha > 0) || !std::isfinite(static_cast<float>(l.alpha)))
      fail("lora_alpha", "expected a number > 0 within float's range, got " + doc["lora_alpha"].dump());
  }
  if (has("use_rslora")) {
    if (!doc["use_rslora"].is_boolean()) fail("use_rslora", "expected true or false");
    l.rslora = doc["use_rslora"].get<bool>();
  }
  if (!has("target_modules")) fail("target_modules", "missing");
  const nlohmann::json& tm = doc["target_modules"];
  // The names are the model family's to check and order (FamilyConfig::set_lora).
  if (tm.is_string()) {
    if (tm.get<std::string>() != models::kAllLinear)
      fail("target_modules", "a regular expression (" + tm.dump() + ") is not taken; list the module names");
    l.targets = {models::kAllLinear};
  } else if (tm.is_array() && !tm.empty()) {
    for (const nlohmann::json& t : tm) {
      if (!t.is_string()) fail("target_modules", "expected module names, got " + t.dump());
      l.targets.push_back(t.get<std::string>());
    }
  } else {
    fail("target_modules", "expected a list of module names or \"all-linear\", got " + tm.dump());
  }
  if (has("bias") && doc["bias"] != "none")
    fail("bias", doc["bias"].dump() + ": only \"none\" (trained biases are not implemented)");
  // fan_in_fan_out says how the base's weights are laid out (GPT-2's
  // Conv1D): the family's tensor map knows that; the adapters are the same.
  for (const char* k : {"use_dora", "lora_bias"})
    if (has(k) && doc[k] != false) fail(k, doc[k].dump() + " is not implemented (DoRA, Conv1D layouts, LoRA biases)");
  if (has("modules_to_save")) {
    // The names are the family's to check (load_pretrained).
    if (!doc["modules_to_save"].is_array()) fail("modules_to_save", "expected a list of module names");
    for (const nlohmann::json& m : doc["modules_to_save"]) {
      if (!m.is_string()) fail("modules_to_save", "expected module names, got " + m.dump());
      l.modules_to_save.push_back(m.get<std::string>());
    }
  }
  for (const char* k : {"layers_to_transform", "layer_replication", "trainable_token_indices"})
    if (has(k) && !(doc[k].is_array() && doc[k].empty()))
      fail(k, doc[k].dump() + " is not implemented yet (zinc adapts every layer's targets, and trains nothing else)");
  for (const char* k : {"rank_pattern", "alpha_pattern"})
    if (has(k) && !(doc[k].is_object() && doc[k].empty()))
      fail(k, "per-module ranks or alphas are not implemented");
  // Keys of PEFT's that change what the saved A and B mean: read as plain
  // LoRA they would give another model without a word.
  // How A and B started does not change what they mean where the base
  // stays as it was: "gaussian" and EVA ("eva": A from the activations' SVD,
  // B zero) do; PiSSA, OLoRA, LoftQ and CorDA subtract the start from the
  // base weights, and the rest are not known to keep them.
  if (const nlohmann::json* init = has("init_lora_weights") ? &doc["init_lora_weights"] : nullptr;
      init && !init->is_boolean() && *init != "gaussian" && *init != "eva") {
    const std::string v = init->is_string() ? init->get<std::string>() : std::string();
    const bool changes_base = v.rfind("pissa", 0) == 0 || v == "olora" || v == "loftq" || v == "corda";
    fail("init_lora_weights",
         init->dump() + (changes_base ? " changed the base weights the adapter was trained on (PiSSA, OLoRA, LoftQ "
                                        "and CorDA subtract the adapter's start from them): not implemented"
                                      : " is not an initialisation zinc knows to keep the base weights as they "
                                        "were") +
             "; zinc reads adapters initialised with true, false, \"gaussian\" or \"eva\"");
  }
  // Each of these, set, is a variant of LoRA (or a subset of its modules)
  // that plain LoRA does not compute; PEFT writes null (or {}) otherwise.
  for (const char* k : {"loftq_config", "exclude_modules", "target_parameters", "alora_invocation_tokens",
                        "arrow_config", "kasa_config", "monteclora_config", "velora_config", "use_bdlora"})
    if (has(k) && doc[k] != false && !((doc[k].is_object() || doc[k].is_array()) && doc[k].empty()))
      fail(k, doc[k].dump() + " is not implemented (zinc reads plain LoRA over every named module)");
  if (has("use_qalora") && doc["use_qalora"] != false)
    fail("use_qalora", doc["use_qalora"].dump() + " is not implemented (QA-LoRA pools the input before A)");
  if (has("task_type") && doc["task_type"] != "CAUSAL_LM")
    fail("task_type", doc["task_type"].dump() + ": zinc trains causal language models (\"CAUSAL_LM\")");
  if (has("lora_dropout")) {
    // Training goes on with it (Note [LoRA dropout]); an evaluation drops nothing.
    if (!doc["lora_dropout"].is_number() || doc["lora_dropout"].get<double>() < 0 ||
        doc["lora_dropout"].get<double>() >= 1)
      fail("lora_dropout", "expected a number in [0, 1), got " + doc["lora_dropout"].dump());
    l.dropout = doc["lora_dropout"].get<double>();
  }
  return l;
}

models::LoraConfig read_peft_adapter_config(const std::string& dir) {
  const std::string path = dir + "/" + kAdapterConfigFile;
  std::string text;
  try {
    text = read_small_file(path, kMaxJsonFileBytes, "the adapter's adapter_config.json");
  } catch (const IoError& e) {
    throw IoError(std::string(e.what()) + " (is " + dir + " a PEFT adapter folder?)");
  }
  return parse_peft_adapter_config(parse_json_text(text, path), path);
}

nlohmann::json peft_adapter_config_json(const models::LoraConfig& lora, const std::string& base, bool fan_in_fan_out) {
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"base_model_name_or_path", base.empty() ? nlohmann::json(nullptr) : nlohmann::json(base)},
          {"r", lora.r},
          {"lora_alpha", lora.alpha},
          {"lora_dropout", lora.dropout},
          {"use_rslora", lora.rslora},
          {"target_modules", lora.targets},
          {"bias", "none"},
          {"fan_in_fan_out", fan_in_fan_out},
          {"init_lora_weights", true},
          {"inference_mode", true},
          {"modules_to_save",
           lora.modules_to_save.empty() ? nlohmann::json(nullptr) : nlohmann::json(lora.modules_to_save)},
          {"layers_to_transform", nullptr},
          {"rank_pattern", nlohmann::json::object()},
          {"alpha_pattern", nlohmann::json::object()},
          {"use_dora", false}};
}

PeftExportResult export_peft_adapter(const HfConfig& cfg, const Model& model, const BlockReader& read,
                                     const PeftExportOptions& opts) {
  namespace fs = std::filesystem;
  const models::LoraConfig& lora = cfg.model->lora();
  std::vector<size_t> adapters, saved;  // saved: modules_to_save's blocks (trained, not adapters)
  for (size_t b = 0; b < model.blocks().size(); ++b) {
    if (models::is_adapter_block(model.blocks()[b].name))
      adapters.push_back(b);
    else if (!model.blocks()[b].frozen)
      saved.push_back(b);
  }
  if (adapters.empty() || !lora.enabled())
    throw Error(opts.what + ": the model has no LoRA adapters (model.lora or model.adapter makes them)");
  PeftExportResult result;
  const bool writer = opts.rank == 0;
  std::optional<OutputFolder> folder;
  if (writer) {
    folder.emplace(opts.out_dir, opts.what, opts.inputs);
    check_model_kind(opts.out_dir, opts.what, true);
  }
  // Every adapter tensor, in model order, with PEFT's name; then the
  // modules to save, PEFT's prefix on the base's name.
  std::vector<SafeTensor> tensors;
  const auto named = saved.empty() ? models::HfPieces{} : hf_pieces(cfg, model, cfg.family->export_prefix);
  for (size_t b : saved)
    for (size_t p = 0; p < named[b].size(); ++p) {
      ZINC_CHECK(named[b][p].size() == 1, "export_peft_adapter: a module to save is one tensor in the file");
      tensors.push_back({std::string(kPeftPrefix) + named[b][p][0].name, DType::kF32, named[b][p][0].shape});
    }
  for (size_t b : adapters) {
    const BlockSpec& spec = model.blocks()[b];
    const std::string layer = spec.name.substr(0, spec.name.size() - std::strlen(models::kAdapterBlockSuffix));
    for (const ParamSpec& p : spec.params)
      tensors.push_back({std::string(kPeftPrefix) + cfg.family->export_prefix + layer + "." + p.name, DType::kF32,
                         std::vector<int64_t>(p.shape.dims.begin(), p.shape.dims.begin() + p.shape.ndim)});
  }
  std::unique_ptr<SafetensorsWriter> w;
  if (writer) {
    result.file = (fs::path(opts.out_dir) / kAdapterWeightsFile).string();
    w = std::make_unique<SafetensorsWriter>((fs::path(folder->staging()) / kAdapterWeightsFile).string(), tensors,
                                            std::map<std::string, std::string>{{"format", "pt"}});
  }
  std::vector<size_t> order = saved;
  order.insert(order.end(), adapters.begin(), adapters.end());
  for (size_t b : order) {
    const std::vector<float> flat = read(static_cast<int>(b));  // every rank: a collective read
    if (!writer) continue;
    const BlockLayout layout = BlockLayout::from_spec(model.blocks()[b]);
    const bool adapter = models::is_adapter_block(model.blocks()[b].name);
    for (size_t p = 0; p < layout.offsets.size(); ++p) {
      const float* values = flat.data() + layout.offsets[p];
      const size_t n = static_cast<size_t>(layout.numels[p]);
      std::vector<float> file_order;
      if (adapter) {
        // The file's row order where the family's differs (FamilyConfig::adapter_pieces).
        const auto pcs = cfg.model->adapter_pieces(model, static_cast<int>(b), static_cast<int>(p), "");
        if (pcs.size() > 1 || pcs[0].file_row >= 0) {
          int64_t rows = 0;
          for (const HfPiece& pc : pcs) rows += pc.rows;
          const size_t cols = n / static_cast<size_t>(rows);
          file_order.resize(n);
          size_t z = 0;
          for (const HfPiece& pc : pcs) {
            std::copy_n(values + z * cols, static_cast<size_t>(pc.rows) * cols,
                        file_order.data() + static_cast<size_t>(pc.file_row) * cols);
            z += static_cast<size_t>(pc.rows);
          }
          values = file_order.data();
        }
      }
      w->append(values, n * 4);
      result.tensors += 1;
    }
  }
  if (!writer) return result;
  w->finish();
  result.bytes = w->data_bytes();
  export_fault_point("shard");  // the test hook (tools/output_folder.h): the weights written, nothing else
  ckpt::write_file_atomic((fs::path(folder->staging()) / kAdapterConfigFile).string(),
                          peft_adapter_config_json(lora, opts.base_model, cfg.model->lora_fan_in_fan_out()).dump(2) + "\n",
                          opts.what);
  folder->commit([](const std::string& name) {
    return name == kAdapterConfigFile || name == kAdapterWeightsFile || name == "adapter_model.bin";
  });
  return result;
}

PeftExportResult export_checkpoint_peft(const std::string& checkpoint_dir, const std::string& tag,
                                        PeftExportOptions opts) {
  const ckpt::TagFiles files = ckpt::open_tag(checkpoint_dir, tag);
  const nlohmann::json client = files.meta.value("client_state", nlohmann::json::object());
  if (!client.is_object() || !client.contains("hf_config") || !client.contains("lora"))
    throw Error(files.dir + ": not a LoRA checkpoint of a Hugging Face model (its client_state has no " +
                (client.is_object() && client.contains("hf_config") ? "lora" : "hf_config") +
                "; zinc-train stores both for a model.lora or model.adapter run); --format peft writes LoRA adapters");
  HfConfig cfg = parse_hf_config(client.at("hf_config"), files.dir + ": client_state.hf_config");
  const models::LoraConfig lora = parse_peft_adapter_config(client.at("lora"), files.dir + ": client_state.lora");
  std::unique_ptr<models::FamilyConfig> fc = cfg.model->clone();
  fc->set_lora(lora);
  if (auto bad = fc->size_error())
    throw Error(files.dir + ": client_state.lora: " + bad->field + ": " + bad->message);
  cfg.model = std::move(fc);
  const std::shared_ptr<Model> model = make_hf_model(cfg);
  check_checkpoint_blocks(files.dir, files.meta.at("blocks"), *model, cfg.architecture + " with its LoRA adapters");
  if (client.contains("hf_source") && client["hf_source"].is_string()) {
    const CheckpointSource source = checkpoint_source(client["hf_source"].get<std::string>(), checkpoint_dir);
    if (opts.base_model.empty()) opts.base_model = client["hf_source"].get<std::string>();
    opts.inputs.insert(opts.inputs.end(), source.protect.begin(), source.protect.end());
  }
  // The checkpoint being read (and the folder that holds its tags) is not
  // an export folder either.
  opts.inputs.push_back(files.dir);
  opts.inputs.push_back(checkpoint_dir);
  // Nor the base model's folder: an adapter_config.json there turns the
  // base into base plus adapter for transformers with PEFT.
  if (!opts.base_model.empty() && std::filesystem::is_directory(opts.base_model))
    opts.inputs.push_back(opts.base_model);
  ckpt::CheckpointReader reader(files.dir, files.ranks, files.block_names);
  return export_peft_adapter(cfg, *model, checkpoint_master_reader(reader, *model), opts);
}

}  // namespace zinc::tools
