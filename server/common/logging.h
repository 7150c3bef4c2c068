#pragma once
// glog setup for the servers: logs to stderr; the absl flag --v (defined in
// verbosity_flag.cc, linked with this library) sets glog's verbosity.

namespace muond {

// The value of --v.
int VerbosityFlag();

// Call once at the start of main, after absl::ParseCommandLine.
void InitServerLogging(const char* argv0);

}  // namespace muond
