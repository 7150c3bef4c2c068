#pragma once
// Why an operation failed, beyond its canonical code (docs/ARCHITECTURE.md
// "Errors"). Code that must react to one particular failure branches on its
// ErrorReason, never on the message text: messages are for people and may
// change; reasons are part of the API.
//
// In process the reason travels as an absl::Status payload under
// kErrorReasonTypeUrl. On the wire (proto/status_details.h) it becomes a
// google.rpc.ErrorInfo {reason: ErrorReasonName(r), domain: kErrorDomain,
// metadata} in the gRPC status details, which every client can read.
//
// Re-wrapping a status to add context must keep its payloads: use
// WithContext, not absl::Status(st.code(), absl::StrCat(prefix,
// st.message())).
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace muond {

// Only the reasons some code branches on. Names (ErrorReasonName) are the
// wire contract: never rename one; the Python client repeats them
// (client/python/muond/client.py, checked by a test).
enum class ErrorReason {
  kUnspecified = 0,  // no reason attached
  // A step failed because a collective with a peer daemon failed (transport
  // error, timeout, or a communicator an earlier failure aborted): a peer is
  // gone or stuck. Set by the daemon's Step (UNAVAILABLE); clients report it
  // as such instead of as their own daemon being unreachable.
  kPeerGone,
  // The coordinator has no plan for the job yet: not every daemon published
  // its manifest (NOT_FOUND from GetPlan; "unknown job" has no reason).
  kNoPlanYet,
  // RegisterParams: another client's params are registered on this daemon
  // (FAILED_PRECONDITION; metadata {"client_id": the holder}). A trainer
  // that knows the holder is gone (a crashed earlier run) unregisters it as
  // the operator and registers again (muond.torch.Muon does).
  kAlreadyRegistered,
  // Step: a trainer's own checks failed before it sent its step, so it sent
  // a refusal (StepRequest.trainer_refusal) and the job refused the step on
  // every rank (FAILED_PRECONDITION; in the other ranks' answers metadata
  // {"ranks": the job ranks, i.e. daemons, whose trainers refused,
  // comma-separated}; a peer's communication failure outranks it). That trainer
  // raised the error naming the param and the rule; nothing was applied, and
  // the same step can be sent again.
  kTrainerRefused,
  // Step: another daemon of the job refused the step (its checks, e.g.
  // non-finite gradients or overrides) and the job refused it on every rank;
  // this rank's answer only names the refuser: metadata {"ranks": the job
  // ranks that refused, comma-separated}. That rank's answer has the details
  // (e.g. the param and the rule, or the step id): a client with several
  // daemons raises it instead. Nothing was applied.
  kRefusedByPeer,
  // Step: a trainer withdrew a step it sent before its own checks
  // (StepRequest.await_trainer_verdict: the checks found a grad or param
  // moved, or failed, or it gave no verdict) and the job refused the step on
  // every rank (ABORTED; metadata {"ranks": the job ranks whose trainers
  // withdrew it}). Nothing was applied: every rank's trainer sends the same
  // step id again.
  kStepWithdrawn,
};

// Free-form details of a reason (ErrorInfo.metadata): lower_snake_case keys,
// any values, e.g. {"step_id": "12"}.
using ErrorMetadata = std::map<std::string, std::string>;

// The absl::Status payload type URL of the reason.
inline constexpr absl::string_view kErrorReasonTypeUrl =
    "type.muond.dev/muond.ErrorReason";
// ErrorInfo.domain of muond's reasons.
inline constexpr absl::string_view kErrorDomain = "muond.dev";

// UPPER_SNAKE_CASE name, e.g. "PEER_GONE"; "ERROR_REASON_UNSPECIFIED" for
// kUnspecified.
absl::string_view ErrorReasonName(ErrorReason reason);
// The reason named `name`; kUnspecified for an unknown name (a newer peer's
// reason: the canonical code still holds).
ErrorReason ErrorReasonFromName(absl::string_view name);

// `status` with `reason` and `metadata` attached (replacing an earlier
// reason). An OK status, or kUnspecified, is returned unchanged.
absl::Status WithErrorReason(absl::Status status, ErrorReason reason,
                             const ErrorMetadata& metadata = {});
// The attached reason; kUnspecified when there is none.
ErrorReason GetErrorReason(const absl::Status& status);
// The attached reason's metadata; empty when there is none.
ErrorMetadata GetErrorMetadata(const absl::Status& status);
inline bool HasErrorReason(const absl::Status& status, ErrorReason reason) {
  return GetErrorReason(status) == reason;
}

// `status` with its message prefixed by `prefix` (code and every payload
// kept). OK stays OK.
absl::Status WithContext(const absl::Status& status, absl::string_view prefix);

}  // namespace muond
