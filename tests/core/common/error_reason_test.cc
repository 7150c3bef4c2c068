// ErrorReason payloads: attach, read back (with metadata), survive
// WithContext; names round-trip.
#include "core/common/error_reason.h"

#include <gtest/gtest.h>

#include "absl/strings/cord.h"

namespace muond {
namespace {

TEST(ErrorReason, NamesRoundTripAndUnknownNamesAreUnspecified) {
  for (ErrorReason r : {ErrorReason::kPeerGone, ErrorReason::kNoPlanYet}) {
    EXPECT_EQ(ErrorReasonFromName(ErrorReasonName(r)), r);
  }
  EXPECT_EQ(ErrorReasonName(ErrorReason::kPeerGone), "PEER_GONE");
  EXPECT_EQ(ErrorReasonName(ErrorReason::kNoPlanYet), "NO_PLAN_YET");
  EXPECT_EQ(ErrorReasonFromName("SOMETHING_NEWER"), ErrorReason::kUnspecified);
  EXPECT_EQ(ErrorReasonFromName(""), ErrorReason::kUnspecified);
}

TEST(ErrorReason, AttachedReasonAndMetadataAreReadBack) {
  const absl::Status plain = absl::UnavailableError("a peer daemon is gone");
  EXPECT_EQ(GetErrorReason(plain), ErrorReason::kUnspecified);
  EXPECT_TRUE(GetErrorMetadata(plain).empty());

  // Values with the payload's separators ('\n', '=') and escapes survive.
  const ErrorMetadata metadata = {{"step_id", "12"}, {"note", "a=b\nc\\d\"e"}};
  const absl::Status st =
      WithErrorReason(plain, ErrorReason::kPeerGone, metadata);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(st.message(), "a peer daemon is gone");
  EXPECT_TRUE(HasErrorReason(st, ErrorReason::kPeerGone));
  EXPECT_FALSE(HasErrorReason(st, ErrorReason::kNoPlanYet));
  EXPECT_EQ(GetErrorMetadata(st), metadata);
  EXPECT_EQ(std::string(*st.GetPayload(kErrorReasonTypeUrl)),
            "PEER_GONE\nnote=a=b\\nc\\\\d\\\"e\nstep_id=12");

  // A second reason replaces the first.
  const absl::Status again = WithErrorReason(st, ErrorReason::kNoPlanYet);
  EXPECT_EQ(GetErrorReason(again), ErrorReason::kNoPlanYet);
  EXPECT_TRUE(GetErrorMetadata(again).empty());
}

TEST(ErrorReason, OkAndUnspecifiedAttachNothing) {
  EXPECT_TRUE(WithErrorReason(absl::OkStatus(), ErrorReason::kPeerGone).ok());
  const absl::Status st =
      WithErrorReason(absl::AbortedError("x"), ErrorReason::kUnspecified);
  EXPECT_FALSE(st.GetPayload(kErrorReasonTypeUrl).has_value());
}

TEST(WithContext, PrefixesTheMessageKeepsCodeAndEveryPayload) {
  absl::Status st = WithErrorReason(absl::DeadlineExceededError("timed out"),
                                    ErrorReason::kPeerGone, {{"step_id", "3"}});
  st.SetPayload("type.example/other", absl::Cord("kept too"));
  const absl::Status wrapped =
      WithContext(WithContext(st, "all_to_allv: "), "group 'dense': ");
  EXPECT_EQ(wrapped.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(wrapped.message(), "group 'dense': all_to_allv: timed out");
  EXPECT_TRUE(HasErrorReason(wrapped, ErrorReason::kPeerGone));
  EXPECT_EQ(GetErrorMetadata(wrapped), (ErrorMetadata{{"step_id", "3"}}));
  EXPECT_EQ(std::string(*wrapped.GetPayload("type.example/other")), "kept too");
  EXPECT_TRUE(WithContext(absl::OkStatus(), "ignored: ").ok());
}

}  // namespace
}  // namespace muond
