#pragma once
// The start every server main shares (muond, muond-coordinator).
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace muond {

// In order: SIGTERM/SIGINT to the shutdown watcher (InstallShutdownSignal-
// Handler), the usage message and --help filter (InstallServerUsage), --help
// itself (PrintServerHelp to stdout; returns false and the caller exits 0),
// flag parsing (absl::ParseCommandLine) and logging (InitServerLogging).
// Returns true when the server should go on starting.
bool BeginServerMain(int argc, char** argv, absl::string_view usage,
                     const std::vector<std::string>& flag_sources);

}  // namespace muond
