#pragma once
// absl::Status <-> grpc::Status for muond's servers and clients. The
// canonical codes share numbering, so code and message carry over as they
// are; an ErrorReason (core/common/error_reason.h) travels as a
// google.rpc.ErrorInfo in the status details (muond/v1/error_details.proto)
// and comes back as the same Status payload on the other side.
#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace muond {

// Code and message; with an ErrorReason attached, also the details:
// RpcStatus{code, message, [Any(ErrorInfo{reason, "muond.dev", metadata})]}.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Code and message; the ErrorReason of the first ErrorInfo with domain
// "muond.dev" and a known reason in the details, if any. Details that do not
// parse are ignored (the code and message still hold).
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace muond
