#pragma once
// absl::Status <-> grpc::Status for the servers: code, message and the
// ErrorReason (as google.rpc.ErrorInfo in the status details; see
// proto/status_details.h, shared with the clients).
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "proto/status_details.h"

namespace muond {

inline grpc::Status ToGrpc(const absl::Status& status) {
  return ToGrpcStatus(status);
}

inline absl::Status FromGrpc(const grpc::Status& status) {
  return FromGrpcStatus(status);
}

}  // namespace muond
