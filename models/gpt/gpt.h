// The GPT family's entry points (models/gpt/family.cpp): for a model zinc
// builds from its own `model` section, and for tests that look inside a
// config.json as the family read it.
#pragma once

#include <memory>

#include "models/family.h"
#include "models/models.h"

namespace zinc::models::gpt {

const Family& family();
std::unique_ptr<FamilyConfig> family_config(const GptConfig& c);
// The GptConfig inside `f`, or nullptr when `f` is another family's.
const GptConfig* settings(const FamilyConfig& f);

}  // namespace zinc::models::gpt
