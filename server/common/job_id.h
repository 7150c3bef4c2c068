#pragma once
// The one rule for a job id, shared by muond's --job_id, every coordinator
// RPC that names a job and muonctl's --job_id.
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace muond {

inline constexpr int kMaxJobIdChars = 64;

// OK when `value` is 1-64 characters of [A-Za-z0-9._-]. A job id names unix
// sockets and shm objects, rendezvous keys, log lines and the {job} label of
// the coordinator's metrics, so it must be short and printable. Otherwise
// InvalidArgument naming `field` (e.g. "--job_id" or "job_id") and the rule,
// quoting at most the first 64 bytes, escaped.
absl::Status CheckJobId(absl::string_view field, absl::string_view value);

}  // namespace muond
