#pragma once
// Command-line helpers shared by muond and muond-coordinator: --help that
// lists the binary's own flags and exits 0, and flag checks whose messages
// name the flag and the rule it breaks.
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace muond {

// Sets absl's program usage message and a FlagsUsageConfig whose --help and
// --helpshort filters match flags defined in a source file whose path contains
// one of `flag_sources` (e.g. "server/daemon/"), so absl's own usage output
// (--helpfull, --helpmatch) knows the binary too, and --version prints
// `version_line`. Call once, before parsing.
void InstallServerUsage(absl::string_view usage,
                        const std::vector<std::string>& flag_sources,
                        absl::string_view version_line);

// True when argv[1..] holds a help request: --help, -help, --helpshort, -h.
// (--helpfull etc. are left to absl.)
bool WantsHelp(int argc, char** argv);

// Writes `usage`, then every flag defined in a file matching `flag_sources`,
// sorted by name: "  --NAME (default: VALUE)\n      HELP\n".
void PrintServerHelp(std::ostream& out, absl::string_view usage,
                     const std::vector<std::string>& flag_sources);

// muond's identity flags. InvalidArgument naming each missing flag or broken
// rule ("--rank=5 must be in [0, --world_size=2)", --job_id against
// CheckJobId), joined by "; ".
// `rank`/`world_size` of -1 mean "not given".
absl::Status CheckDaemonIdentityFlags(const std::string& job_id,
                                      const std::string& coordinator, int rank,
                                      int world_size);

// A listening address given as `flag`: "unix:PATH" / "unix://PATH" (absolute
// path) or HOST:PORT (HOST a name, an IPv4 address or a bracketed IPv6
// address; PORT in [0, 65535]). InvalidArgument saying it is malformed.
absl::Status CheckListenAddress(absl::string_view flag,
                                const std::string& address);

// --device=`device` against `device_count` visible CUDA devices
// (`count_error` non-empty when the CUDA runtime could not count them).
// FailedPrecondition: no CUDA device / index out of range.
absl::Status CheckCudaDeviceIndex(int device, int device_count,
                                  const std::string& count_error);

}  // namespace muond
