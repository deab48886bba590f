// zinc tools: LoRA adapters in PEFT's format (adapter_config.json and
// adapter_model.safetensors, as peft's save_pretrained writes them): their
// configuration read into models::LoraConfig, checked key by key.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "models/models.h"
#include "tools/hf_model.h"

namespace zinc::tools {

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";
// PEFT's prefix of every adapter tensor of a causal LM: the PeftModel's
// base_model (the LoraModel), then its model (the ...ForCausalLM).
inline constexpr const char* kPeftPrefix = "base_model.model.";

// An adapter_config.json document (`path` names it in errors) as a
// LoraConfig. Throws zinc::Error "PATH: KEY: what" for a configuration zinc
// cannot reproduce: another peft_type, DoRA, biases, per-layer ranks or
// layers, a regex for target_modules. lora_dropout and modules_to_save are
// read (the family checks the modules' names when the model is built).
models::LoraConfig parse_peft_adapter_config(const nlohmann::json& doc, const std::string& path);
// DIR/adapter_config.json, read and parsed.
models::LoraConfig read_peft_adapter_config(const std::string& dir);

// adapter_config.json for `lora` as PEFT writes it (PEFT's LoraConfig keys;
// base: the base model's folder, or empty; fan_in_fan_out: the base's
// layers are Conv1D, GPT-2's).
nlohmann::json peft_adapter_config_json(const models::LoraConfig& lora, const std::string& base, bool fan_in_fan_out);

struct PeftExportOptions {
  std::string out_dir;  // created if missing
  int rank = 0;         // only rank 0 writes
  std::vector<std::string> inputs;  // what the run reads: out_dir must not be, nor hold, any
  std::string what = "--save-adapter";
  std::string base_model;  // adapter_config.json's base_model_name_or_path
};
struct PeftExportResult {
  std::string file;  // the adapter_model.safetensors
  int64_t tensors = 0, bytes = 0;
};
// The LoRA adapters of `model` (its adapter blocks, read through `read`,
// a collective where it must be: every rank calls this) as a PEFT adapter
// folder that peft.PeftModel.from_pretrained reads onto the base model:
// adapter_config.json and adapter_model.safetensors (fp32, PEFT's names).
// The folder is replaced as one unit (tools/output_folder.h). Throws
// zinc::Error when the model has no adapters.
PeftExportResult export_peft_adapter(const HfConfig& cfg, const Model& model, const BlockReader& read,
                                     const PeftExportOptions& opts);
// The same from a LoRA checkpoint of zinc-train or zinc.train (its tag
// `tag`, or the one `latest` names): the adapters' fp32 master values, with
// the model and adapter configuration the checkpoint's client_state keeps
// (hf_config, lora). Throws zinc::Error naming the checkpoint when it is
// not a LoRA checkpoint or its parameters are not that model's.
PeftExportResult export_checkpoint_peft(const std::string& checkpoint_dir, const std::string& tag,
                                        PeftExportOptions opts);

}  // namespace zinc::tools
