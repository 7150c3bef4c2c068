#pragma once
// absl::Status <-> grpc::Status. The canonical codes share numbering, so the
// conversion keeps code and message.
#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace muond {

inline grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

inline absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace muond
