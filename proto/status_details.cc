#include "proto/status_details.h"

#include <string>

#include "core/common/error_reason.h"
#include "google/protobuf/any.pb.h"
#include "muond/v1/error_details.pb.h"

namespace muond {
namespace {

// The type URL googleapis gives ErrorInfo, so any gRPC tooling recognises it.
constexpr char kErrorInfoTypeUrl[] = "type.googleapis.com/google.rpc.ErrorInfo";

std::string ErrorInfoDetails(const absl::Status& status, ErrorReason reason) {
  v1::ErrorInfo info;
  info.set_reason(std::string(ErrorReasonName(reason)));
  info.set_domain(std::string(kErrorDomain));
  for (const auto& [key, value] : GetErrorMetadata(status)) {
    (*info.mutable_metadata())[key] = value;
  }
  v1::RpcStatus details;
  details.set_code(static_cast<int>(status.code()));
  details.set_message(std::string(status.message()));
  google::protobuf::Any* any = details.add_details();
  any->set_type_url(kErrorInfoTypeUrl);
  any->set_value(info.SerializeAsString());
  return details.SerializeAsString();
}

// `status` with the reason of the first muond ErrorInfo in `details`.
absl::Status AttachReason(absl::Status status, const std::string& details) {
  v1::RpcStatus parsed;
  if (details.empty() || !parsed.ParseFromString(details)) return status;
  for (const google::protobuf::Any& any : parsed.details()) {
    v1::ErrorInfo info;
    if (any.type_url() != kErrorInfoTypeUrl ||
        !info.ParseFromString(any.value()) || info.domain() != kErrorDomain) {
      continue;
    }
    const ErrorReason reason = ErrorReasonFromName(info.reason());
    if (reason == ErrorReason::kUnspecified) continue;
    return WithErrorReason(
        std::move(status), reason,
        ErrorMetadata(info.metadata().begin(), info.metadata().end()));
  }
  return status;
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::string message(status.message());
  const ErrorReason reason = GetErrorReason(status);
  if (reason == ErrorReason::kUnspecified) return grpc::Status(code, message);
  return grpc::Status(code, message, ErrorInfoDetails(status, reason));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return AttachReason(
      absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                   status.error_message()),
      status.error_details());
}

}  // namespace muond
