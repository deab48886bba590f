// zinc engine, private: section parsers of Config::parse that live in
// units of their own.
#pragma once

#include "engine/config.h"
#include "engine/config_reader.h"

namespace zinc::detail {

// optimizer: type and params into the struct of the type (config_optim.cpp).
void parse_optimizer(config::Reader& root, OptimizerConfig& o);
// scheduler: type and params (config_optim.cpp).
void parse_scheduler(config::Reader& root, SchedulerConfig& s);

}  // namespace zinc::detail
