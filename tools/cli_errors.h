// zinc tools: how zinc-train and zinc-export end on a command-line usage
// error, and where their standard output could not be written. CLI11 ended
// them with its own exit codes (105, 106, 109, 114), where zinc's usage
// checks exit 2 and the docs say so; and a misspelt flag got no suggestion,
// where a misspelt config key gets one. Header-only: the two programs link
// CLI11 themselves.
#pragma once

#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
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

// Standard output that cannot be written (a full disk under `> run.log`,
// /dev/full) lost a run's progress lines and summary with exit code 0:
// printf says nothing. stdout_lost() flushes and, the first time a write
// has failed, says so on stderr, naming the reason; the program's work
// goes on (a run's checkpoints and exports do not go through stdout).
// output_checked() then makes a successful exit 1, as coreutils do.
// Whether main found standard output closed (standard_streams()).
inline bool& stdout_was_closed() {
  static bool closed = false;
  return closed;
}
inline bool stdout_lost(const char* program) {
  static int lost = 0;  // the first failure's errno
  if (lost != 0) return true;
  errno = 0;
  if (!stdout_was_closed() && std::fflush(stdout) == 0 && !std::ferror(stdout)) return false;
  lost = stdout_was_closed() ? EBADF : errno != 0 ? errno : EIO;
  std::fprintf(stderr, "%s: error: cannot write standard output: %s; what it prints from here on is lost (the "
                       "work goes on, and the exit code will be 1)\n",
               program, std::strerror(lost));
  return true;
}
inline int output_checked(int rc, const char* program) { return stdout_lost(program) && rc == 0 ? 1 : rc; }

// First thing in main. A reader of standard output that went away (`| head`)
// ended the program with SIGPIPE, without a word and in the middle of a
// save or an export: ignored, the write fails with EPIPE, which
// stdout_lost() reports, and the work goes on. A standard stream that was
// closed (`>&-`, `2>&-`) left its number free, so the next file opened (a
// checkpoint folder's lock file) took it and printf and the log wrote into
// that file: each is opened on /dev/null instead, and a closed standard
// output is reported as one that cannot be written.
inline void standard_streams() {
  std::signal(SIGPIPE, SIG_IGN);
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int null = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (null >= 0 && null != fd) {
      ::dup2(null, fd);
      ::close(null);
    }
    if (fd == 1) stdout_was_closed() = true;
  }
}

}  // namespace zinc::tools
