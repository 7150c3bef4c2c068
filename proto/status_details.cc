#include "proto/status_details.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/common/error_reason.h"
#include "google/protobuf/any.pb.h"
#include "muond/v1/error_details.pb.h"

namespace muond {
namespace {

// The type URL googleapis gives ErrorInfo, so any gRPC tooling recognises it.
constexpr char kErrorInfoTypeUrl[] = "type.googleapis.com/google.rpc.ErrorInfo";

// Bytes `c` takes in grpc-message, which gRPC percent-encodes outside
// printable ASCII.
size_t PercentEncodedSize(unsigned char c) {
  return (c < 0x20 || c > 0x7E || c == '%') ? 3 : 1;
}

// `message`, cut (at a UTF-8 character boundary, with a note of the bytes
// cut) so that it and its copy in the details fit kWireMessageBudgetBytes
// once encoded. The message travels twice (grpc-message, and the details'
// copy, which google.rpc.Status tooling requires to be equal, base64-encoded
// as -bin metadata), and gRPC refuses trailers beyond its metadata limits
// outright: the client would get RESOURCE_EXHAUSTED instead of the error and
// its reason.
std::string WireMessage(absl::string_view message) {
  size_t encoded = 0;
  size_t cut = 0;  // the last character boundary within the budget
  for (size_t i = 0; i < message.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(message[i]);
    if ((c & 0xC0) != 0x80) cut = i;  // a character starts here
    encoded += PercentEncodedSize(c);
    if (encoded + (i + 1 + 2) / 3 * 4 > kWireMessageBudgetBytes) {
      return absl::StrCat(message.substr(0, cut), "... [", message.size() - cut,
                          " more bytes]");
    }
  }
  return std::string(message);
}

std::string ErrorInfoDetails(const absl::Status& status,
                             const std::string& message, ErrorReason reason) {
  v1::ErrorInfo info;
  info.set_reason(std::string(ErrorReasonName(reason)));
  info.set_domain(std::string(kErrorDomain));
  for (const auto& [key, value] : GetErrorMetadata(status)) {
    (*info.mutable_metadata())[key] = value;
  }
  v1::RpcStatus details;
  details.set_code(static_cast<int>(status.code()));
  details.set_message(message);
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
  std::string message = WireMessage(status.message());
  const ErrorReason reason = GetErrorReason(status);
  if (reason == ErrorReason::kUnspecified) return grpc::Status(code, message);
  return grpc::Status(code, message, ErrorInfoDetails(status, message, reason));
}

std::string ToRpcStatusBytes(const absl::Status& status) {
  const grpc::Status wire = ToGrpcStatus(status);
  if (!wire.error_details().empty()) return wire.error_details();
  v1::RpcStatus plain;
  plain.set_code(static_cast<int>(wire.error_code()));
  plain.set_message(wire.error_message());
  return plain.SerializeAsString();
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return AttachReason(
      absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                   status.error_message()),
      status.error_details());
}

std::optional<absl::Status> FromRpcStatusBytes(absl::string_view bytes) {
  v1::RpcStatus parsed;
  if (!parsed.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())) ||
      parsed.code() == 0) {
    return std::nullopt;
  }
  return FromGrpcStatus(
      grpc::Status(static_cast<grpc::StatusCode>(parsed.code()),
                   parsed.message(), std::string(bytes)));
}

}  // namespace muond
