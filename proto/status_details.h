#pragma once
// absl::Status <-> grpc::Status for muond's servers and clients. The
// canonical codes share numbering, so code and message carry over as they
// are; an ErrorReason (core/common/error_reason.h) travels as a
// google.rpc.ErrorInfo in the status details (muond/v1/error_details.proto)
// and comes back as the same Status payload on the other side.
#include <grpcpp/support/status.h>

#include <cstddef>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace muond {

// Encoded bytes a message may take on the wire, both of its copies
// (grpc-message, percent-encoded, and the details' copy, base64-encoded)
// together: a longer message is cut, with a note of the bytes cut, so that an
// error and its reason stay under gRPC's 8 KiB metadata soft limit (about
// 2.6 kB of ASCII text, 1.4 kB of other UTF-8).
inline constexpr size_t kWireMessageBudgetBytes = 6144;

// Code and message; with an ErrorReason attached, also the details:
// RpcStatus{code, message, [Any(ErrorInfo{reason, "muond.dev", metadata})]}.
grpc::Status ToGrpcStatus(const absl::Status& status);

// ToGrpcStatus's code, message and details as one serialized
// muond.v1.RpcStatus (wire-compatible google.rpc.Status), also without an
// ErrorReason: how a refusal travels outside gRPC (the step channel,
// proto/step_channel_layout.h).
std::string ToRpcStatusBytes(const absl::Status& status);

// Code and message; the ErrorReason of the first ErrorInfo with domain
// "muond.dev" and a known reason in the details, if any. Details that do not
// parse are ignored (the code and message still hold).
absl::Status FromGrpcStatus(const grpc::Status& status);

// The inverse of ToRpcStatusBytes: what FromGrpcStatus gives for the status
// those bytes carry (they are what gRPC carries as grpc-status-details-bin),
// so a refusal read from the step channel equals the Step RPC's. Nullopt
// when the bytes are no muond.v1.RpcStatus or carry code OK (no failure).
std::optional<absl::Status> FromRpcStatusBytes(absl::string_view bytes);

}  // namespace muond
