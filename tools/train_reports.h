// zinc tools: what zinc-train prints for --estimate (the RAM and disk each
// rank will need, at this stage and the others) and --check (every key with
// its value and source, the warnings, and whether the run would start).
// Called on every rank (each checks its own host); rank 0 prints.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"

namespace zinc::tools {

// --estimate for `doc` at `world` ranks; the exit code.
int print_estimate(comm::Communicator& comm, int world, const nlohmann::json& doc, const std::string& config_path,
                   bool json);
// --check of the config file with `overrides`; the exit code (1: refused).
// `steps_given`: the last override is --steps's run.steps, labelled so.
int print_check(comm::Communicator& comm, int world, const std::string& config_path,
                const std::vector<std::string>& overrides, bool json, bool ignore_resources, bool steps_given);

}  // namespace zinc::tools
