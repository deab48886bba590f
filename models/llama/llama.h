// The Llama family's entry points (models/llama/family.cpp): for a model
// zinc builds from its own `model` section, and for tests that look inside
// a config.json as the family read it.
#pragma once

#include <memory>

#include "models/family.h"
#include "models/models.h"

namespace zinc::models::llama {

const Family& family();
std::unique_ptr<FamilyConfig> family_config(const LlamaConfig& c);
// The LlamaConfig inside `f`, or nullptr when `f` is another family's.
const LlamaConfig* settings(const FamilyConfig& f);

}  // namespace zinc::models::llama
