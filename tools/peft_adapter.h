// zinc tools: LoRA adapters in PEFT's format (adapter_config.json and
// adapter_model.safetensors, as peft's save_pretrained writes them): their
// configuration read into models::LoraConfig, checked key by key.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "models/models.h"

namespace zinc::tools {

inline constexpr const char* kAdapterConfigFile = "adapter_config.json";
inline constexpr const char* kAdapterWeightsFile = "adapter_model.safetensors";
// PEFT's prefix of every adapter tensor of a causal LM: the PeftModel's
// base_model (the LoraModel), then its model (the ...ForCausalLM).
inline constexpr const char* kPeftPrefix = "base_model.model.";

// The linear layers LoRA adapts in the Llama-style families, as PEFT names
// their modules; "all-linear" means these.
const std::vector<std::string>& lora_linear_modules();

// An adapter_config.json document (`path` names it in errors) as a
// LoraConfig. Throws zinc::Error "PATH: KEY: what" for a configuration zinc
// cannot reproduce: another peft_type, DoRA, biases, per-layer ranks or
// layers, modules_to_save, a regex for target_modules. lora_dropout > 0 is
// a warning (zinc trains without dropout; the values are unaffected).
models::LoraConfig parse_peft_adapter_config(const nlohmann::json& doc, const std::string& path);
// DIR/adapter_config.json, read and parsed.
models::LoraConfig read_peft_adapter_config(const std::string& dir);

}  // namespace zinc::tools
