#pragma once
// The one rule for a job id, shared by muond's --job_id, every coordinator
// RPC that names a job and muonctl's --job_id; and for the name of an
// optimizer instance a daemon hosts, which uses the same alphabet.
#include <string>

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

// An optimizer instance's name (RegisterParamsRequest.optimizer and the
// other requests' `optimizer`): the job id's rule, named as a name.
absl::Status CheckOptimizerName(absl::string_view field,
                                absl::string_view value);

// The coordinator's job of optimizer instance `name` of job `job`:
// "<job>/<name>". '/' is outside the job-id alphabet, so it never collides
// with a user's job; "" (the default instance) is the job itself.
std::string InstanceJobId(absl::string_view job, absl::string_view name);

// Whether `job_id` is an optimizer instance's job (has the '/' of
// InstanceJobId): such a job ends with its instance, and its holders are
// told to pick another name rather than another --job_id.
bool IsInstanceJobId(absl::string_view job_id);

// Instance `name` in a message: "optimizer instance 'x'", or "the default
// optimizer instance" for "" (the words muond.torch uses too).
std::string DescribeInstance(absl::string_view name);

// What a coordinator RPC may name: a job id (CheckJobId) or an instance's
// job, InstanceJobId of a valid job id and a valid name. InvalidArgument
// naming `field` and both forms otherwise.
absl::Status CheckCoordinatorJobId(absl::string_view field,
                                   absl::string_view value);

}  // namespace muond
