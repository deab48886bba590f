// zinc tools: how zinc-train and zinc-export end on a command-line usage
// error. CLI11 ended them with its own exit codes (105, 106, 109, 114), where
// zinc's usage checks exit 2 and the docs say so; and a misspelt flag got no
// suggestion, where a misspelt config key gets one. Header-only: the two
// programs link CLI11 themselves.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "engine/config_text.h"

namespace zinc::tools {

// Prints `e` as "PROGRAM: error: ..." (an unknown option with the nearest
// known one), and returns 2; --help returns CLI11's 0 after its text.
inline int usage_error(CLI::App& app, const CLI::ParseError& e, const char* program) {
  if (e.get_exit_code() == 0) return app.exit(e);  // --help
  std::string msg = e.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    std::vector<std::string> names;
    for (const CLI::Option* o : app.get_options())
      for (const std::string& n : o->get_lnames()) names.push_back("--" + n);
    for (const std::string& extra : app.remaining()) {
      if (extra.rfind("--", 0) != 0) continue;
      const std::string flag = extra.substr(0, extra.find('='));
      const std::string near = did_you_mean(flag, names);
      msg = "unknown option " + flag + (near.empty() ? std::string() : " (did you mean " + near + "?)");
      break;
    }
  }
  std::fprintf(stderr, "%s: error: %s (%s --help lists the options)\n", program, msg.c_str(), program);
  return 2;
}

}  // namespace zinc::tools
