// zinc engine, private: the parsers of zinc's experiment sections (model,
// data, run, comm), called by Config::parse (config_experiment.cpp).
#pragma once

#include "engine/config.h"

namespace zinc::config_detail {

class Reader;
void parse_model(Reader& root, ModelConfig& m);
void parse_data(Reader& root, DataConfig& d);
void parse_run(Reader& root, RunConfig& run);
void parse_comm(Reader& root, CommConfig& comm);

}  // namespace zinc::config_detail
