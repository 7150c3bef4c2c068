#pragma once
// glog setup for the servers: logs to stderr; the absl flag --v (defined in
// verbosity_flag.cc, linked with this library) sets glog's verbosity and
// --log_format (logging.cc) the line format:
//   text  glog's own lines (the default).
//   json  one JSON object per line: time (RFC 3339, UTC, microseconds),
//         severity, file, line, thread, message, server, and job and rank once
//         SetLogJob named them. glog, gRPC core (gpr_log) and protobuf all
//         write through it; a FATAL line carries the stack ("stack") and the
//         process aborts right after it, so nothing but JSON reaches stderr.
//         Command-line errors (absl's flag parser, before logging starts)
//         stay plain text.
#include <string>

#include "absl/strings/string_view.h"

namespace muond {

enum class LogFormat { kText, kJson };

// absl flag conversion of --log_format: "text" or "json"; anything else is
// refused naming the allowed values.
bool AbslParseFlag(absl::string_view text, LogFormat* format,
                   std::string* error);
std::string AbslUnparseFlag(LogFormat format);

// The value of --v.
int VerbosityFlag();

// Call once at the start of main, after absl::ParseCommandLine. `server`
// ("muond-daemon", "muond-coordinator") is the JSON lines' "server".
void InitServerLogging(const char* argv0, absl::string_view server);

// The job and rank of every JSON line from now on (a daemon, once its flags
// are checked). Thread-safe.
void SetLogJob(absl::string_view job, int rank);

}  // namespace muond
