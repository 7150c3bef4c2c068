#include "server/common/cli.h"

#include <algorithm>
#include <cstring>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "server/common/job_id.h"

namespace muond {
namespace {

bool FromSources(absl::string_view filename,
                 const std::vector<std::string>& sources) {
  for (const std::string& s : sources) {
    if (absl::StrContains(filename, s)) return true;
  }
  return false;
}

bool ValidHost(absl::string_view host) {
  if (host.empty()) return false;
  if (host.front() == '[') {  // [IPv6]
    return host.size() > 2 && host.back() == ']';
  }
  for (char c : host) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '-' && c != '_') {
      return false;
    }
  }
  return true;
}

}  // namespace

void InstallServerUsage(absl::string_view usage,
                        const std::vector<std::string>& flag_sources,
                        absl::string_view version_line) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  auto filter = [flag_sources](absl::string_view filename) {
    return FromSources(filename, flag_sources);
  };
  config.contains_help_flags = filter;
  config.contains_helpshort_flags = filter;
  config.version_string = [line = std::string(version_line)] {
    return line + "\n";
  };
  absl::SetFlagsUsageConfig(config);
}

bool WantsHelp(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") return false;  // positional arguments follow
    if (arg == "--help" || arg == "-help" || arg == "--helpshort" ||
        arg == "-helpshort" || arg == "-h") {
      return true;
    }
  }
  return false;
}

void PrintServerHelp(std::ostream& out, absl::string_view usage,
                     const std::vector<std::string>& flag_sources) {
  out << usage << "\n\nFlags:\n";
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired() && FromSources(flag->Filename(), flag_sources)) {
      flags.push_back(flag);
    }
  }
  std::sort(flags.begin(), flags.end(),
            [](auto* a, auto* b) { return a->Name() < b->Name(); });
  for (const absl::CommandLineFlag* flag : flags) {
    const std::string def = flag->DefaultValue();
    out << "  --" << flag->Name()
        << " (default: " << (def.empty() ? "\"\"" : def) << ")\n      "
        << flag->Help() << "\n";
  }
}

absl::Status CheckDaemonIdentityFlags(const std::string& job_id,
                                      const std::string& coordinator, int rank,
                                      int world_size) {
  std::vector<std::string> problems;
  if (job_id.empty()) {
    problems.push_back("--job_id is required");
  } else if (absl::Status id = CheckJobId("--job_id", job_id); !id.ok()) {
    problems.push_back(std::string(id.message()));
  }
  if (coordinator.empty()) {
    problems.push_back(
        "--coordinator is required (HOST:PORT of muond-coordinator)");
  }
  if (world_size == -1) {
    problems.push_back("--world_size is required (number of daemons, >= 1)");
  } else if (world_size < 1) {
    problems.push_back(
        absl::StrCat("--world_size=", world_size, " must be >= 1"));
  }
  if (rank == -1) {
    problems.push_back(
        "--rank is required (this daemon's rank, >= 0; -1 means unset)");
  } else if (rank < 0 || (world_size >= 1 && rank >= world_size)) {
    problems.push_back(
        world_size >= 1
            ? absl::StrCat("--rank=", rank,
                           " must be in [0, --world_size=", world_size, ")")
            : absl::StrCat("--rank=", rank, " must be >= 0"));
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrJoin(problems, "; "));
}

absl::Status CheckListenAddress(absl::string_view flag,
                                const std::string& address) {
  const auto malformed = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "='", address, "' is malformed: ", why,
        "; expected HOST:PORT (e.g. 127.0.0.1:7070) or unix:/ABS/PATH"));
  };
  if (absl::StartsWith(address, "unix:")) {
    absl::string_view path = absl::string_view(address).substr(5);
    absl::ConsumePrefix(&path, "//");
    if (path.empty() || path[0] != '/') {
      return malformed("the unix socket path must be absolute");
    }
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return malformed("no ':PORT'");
  const absl::string_view host = absl::string_view(address).substr(0, colon);
  const absl::string_view port = absl::string_view(address).substr(colon + 1);
  int port_number = -1;
  if (port.empty() ||
      !std::all_of(port.begin(), port.end(),
                   [](char c) { return absl::ascii_isdigit(c); }) ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return malformed(absl::StrCat("port '", port, "' is not in [0, 65535]"));
  }
  if (!ValidHost(host)) {
    return malformed(
        absl::StrCat("host '", host, "' is not a host name or IP"));
  }
  return absl::OkStatus();
}

absl::Status CheckCudaDeviceIndex(int device, int device_count,
                                  const std::string& count_error) {
  if (!count_error.empty() || device_count <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", device, ": no CUDA device is visible on this machine",
        count_error.empty() ? "" : absl::StrCat(" (", count_error, ")"),
        "; use --host for the CPU backend"));
  }
  if (device < 0 || device >= device_count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", device, " is out of range: ", device_count,
        " CUDA device(s) visible, valid indices are [0, ", device_count, ")"));
  }
  return absl::OkStatus();
}

}  // namespace muond
