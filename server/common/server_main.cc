#include "server/common/server_main.h"

#include <iostream>

#include "absl/flags/parse.h"
#include "server/common/cli.h"
#include "server/common/logging.h"
#include "server/common/shutdown.h"

namespace muond {

bool BeginServerMain(int argc, char** argv, absl::string_view usage,
                     const std::vector<std::string>& flag_sources) {
  // SIGTERM/SIGINT from now on go to the shutdown watcher.
  InstallShutdownSignalHandler();
  InstallServerUsage(usage, flag_sources);
  if (WantsHelp(argc, argv)) {
    PrintServerHelp(std::cout, usage, flag_sources);
    return false;
  }
  absl::ParseCommandLine(argc, argv);
  InitServerLogging(argv[0]);
  return true;
}

}  // namespace muond
