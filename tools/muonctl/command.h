#pragma once
// A muonctl subcommand: `muonctl NAME ARGS...` calls Run(ARGS, out, err).
// Returns the process exit code (0 ok, 1 failure, 2 usage error).
#include <ostream>
#include <string>
#include <vector>

namespace muond::muonctl {

using CommandFn = int (*)(const std::vector<std::string>& args,
                          std::ostream& out, std::ostream& err);

struct Command {
  CommandFn run;
  const char* summary;  // one line for `muonctl help`
};

}  // namespace muond::muonctl
