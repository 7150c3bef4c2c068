// proto/status_details: absl::Status <-> grpc::Status keeps code, message and
// the ErrorReason, encoded as googleapis' google.rpc.Status + ErrorInfo.
#include "proto/status_details.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "core/common/error_reason.h"

namespace muond {
namespace {

// Protobuf wire format by hand (the independent reference): a
// length-delimited field `field` holding `bytes`, for lengths < 128.
std::string Field(int field, const std::string& bytes) {
  return std::string(1, char(field << 3 | 2)) + char(bytes.size()) + bytes;
}

// google.rpc.Status{code, message, details: [Any(ErrorInfo{reason, domain,
// metadata{key: value}})]} as googleapis-based servers write it.
std::string GoogleRpcStatus(int code, const std::string& message,
                            const std::string& reason,
                            const std::string& domain, const std::string& key,
                            const std::string& value) {
  const std::string entry = Field(1, key) + Field(2, value);
  const std::string info =
      Field(1, reason) + Field(2, domain) + Field(3, entry);
  const std::string any =
      Field(1, "type.googleapis.com/google.rpc.ErrorInfo") + Field(2, info);
  return std::string(1, char(1 << 3 | 0)) + char(code) + Field(2, message) +
         Field(3, any);
}

TEST(StatusDetails, ReasonAndMetadataRoundTrip) {
  const absl::Status in =
      WithErrorReason(absl::UnavailableError("step 4 failed: a peer is gone"),
                      ErrorReason::kPeerGone, {{"step_id", "4"}});
  const grpc::Status wire = ToGrpcStatus(in);
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(wire.error_message(), "step 4 failed: a peer is gone");
  // The details are exactly what a googleapis server would send.
  EXPECT_EQ(wire.error_details(),
            GoogleRpcStatus(14, "step 4 failed: a peer is gone", "PEER_GONE",
                            "muond.dev", "step_id", "4"));
  const absl::Status out = FromGrpcStatus(wire);
  EXPECT_EQ(out.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(out.message(), in.message());
  EXPECT_TRUE(HasErrorReason(out, ErrorReason::kPeerGone));
  EXPECT_EQ(GetErrorMetadata(out), (ErrorMetadata{{"step_id", "4"}}));
}

TEST(StatusDetails, NoReasonNoDetails) {
  const grpc::Status wire = ToGrpcStatus(absl::NotFoundError("unknown job"));
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(wire.error_message(), "unknown job");
  EXPECT_TRUE(wire.error_details().empty());
  const absl::Status out = FromGrpcStatus(wire);
  EXPECT_EQ(out.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetErrorReason(out), ErrorReason::kUnspecified);
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(StatusDetails, ReadsGoogleapisDetailsAndIgnoresForeignOrBrokenOnes) {
  const std::string ours =
      GoogleRpcStatus(5, "no plan", "NO_PLAN_YET", "muond.dev", "k", "v");
  absl::Status st = FromGrpcStatus(
      grpc::Status(grpc::StatusCode::NOT_FOUND, "no plan", ours));
  EXPECT_TRUE(HasErrorReason(st, ErrorReason::kNoPlanYet));
  EXPECT_EQ(GetErrorMetadata(st), (ErrorMetadata{{"k", "v"}}));

  for (const std::string& details :
       {GoogleRpcStatus(5, "x", "NO_PLAN_YET", "example.com", "k", "v"),
        GoogleRpcStatus(5, "x", "FROM_A_NEWER_SERVER", "muond.dev", "k", "v"),
        std::string("\xff\xff not a proto")}) {
    st = FromGrpcStatus(
        grpc::Status(grpc::StatusCode::NOT_FOUND, "no plan", details));
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(st.message(), "no plan");
    EXPECT_EQ(GetErrorReason(st), ErrorReason::kUnspecified);
  }
}

// The step channel carries a refusal as ToRpcStatusBytes; read back, it is
// what the same refusal over gRPC gives (code, message, reason, metadata),
// with or without a reason.
TEST(StatusDetails, RpcStatusBytesReadBackAsOverGrpc) {
  const absl::Status refusals[] = {
      WithErrorReason(absl::FailedPreconditionError("step 3: refused"),
                      ErrorReason::kTrainerRefused, {{"ranks", "0,2"}}),
      absl::InvalidArgumentError("overrides[0]: no group 'x'")};
  for (const absl::Status& in : refusals) {
    const std::optional<absl::Status> out =
        FromRpcStatusBytes(ToRpcStatusBytes(in));
    ASSERT_TRUE(out.has_value()) << in;
    const absl::Status over_grpc = FromGrpcStatus(ToGrpcStatus(in));
    EXPECT_EQ(out->code(), over_grpc.code());
    EXPECT_EQ(out->message(), over_grpc.message());
    EXPECT_EQ(GetErrorReason(*out), GetErrorReason(over_grpc));
    EXPECT_EQ(GetErrorMetadata(*out), GetErrorMetadata(over_grpc));
    EXPECT_EQ(out->code(), in.code());
  }
  EXPECT_TRUE(HasErrorReason(*FromRpcStatusBytes(ToRpcStatusBytes(refusals[0])),
                             ErrorReason::kTrainerRefused));
  // Bytes that are no RpcStatus, and a status of code OK, are no refusal.
  EXPECT_FALSE(FromRpcStatusBytes("\xff\xff not a proto").has_value());
  EXPECT_FALSE(FromRpcStatusBytes("").has_value());
  EXPECT_FALSE(FromRpcStatusBytes(Field(2, "fine")).has_value());
}

}  // namespace
}  // namespace muond
