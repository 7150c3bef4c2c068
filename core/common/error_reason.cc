#include "core/common/error_reason.h"

#include <optional>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muond {
namespace {

struct NamedReason {
  ErrorReason reason;
  absl::string_view name;
};

constexpr NamedReason kReasons[] = {
    {ErrorReason::kUnspecified, "ERROR_REASON_UNSPECIFIED"},
    {ErrorReason::kPeerGone, "PEER_GONE"},
    {ErrorReason::kNoPlanYet, "NO_PLAN_YET"},
    {ErrorReason::kAlreadyRegistered, "ALREADY_REGISTERED"},
    {ErrorReason::kTrainerRefused, "TRAINER_REFUSED"},
    {ErrorReason::kRefusedByPeer, "REFUSED_BY_PEER"},
    {ErrorReason::kStepWithdrawn, "STEP_WITHDRAWN"},
};

// Payload text: the reason's name, then one "\n<key>=<C-escaped value>" per
// metadata entry (escaping keeps newlines in values from splitting lines).
std::string EncodePayload(ErrorReason reason, const ErrorMetadata& metadata) {
  std::string out(ErrorReasonName(reason));
  for (const auto& [key, value] : metadata) {
    absl::StrAppend(&out, "\n", key, "=", absl::CEscape(value));
  }
  return out;
}

std::optional<std::string> PayloadText(const absl::Status& status) {
  // absl::optional: Debian's Abseil does not alias it to std::optional.
  const auto payload = status.GetPayload(kErrorReasonTypeUrl);
  if (!payload.has_value()) return std::nullopt;
  return std::string(*payload);
}

}  // namespace

absl::string_view ErrorReasonName(ErrorReason reason) {
  for (const NamedReason& r : kReasons) {
    if (r.reason == reason) return r.name;
  }
  return kReasons[0].name;
}

ErrorReason ErrorReasonFromName(absl::string_view name) {
  for (const NamedReason& r : kReasons) {
    if (r.name == name) return r.reason;
  }
  return ErrorReason::kUnspecified;
}

absl::Status WithErrorReason(absl::Status status, ErrorReason reason,
                             const ErrorMetadata& metadata) {
  if (status.ok() || reason == ErrorReason::kUnspecified) return status;
  status.SetPayload(kErrorReasonTypeUrl,
                    absl::Cord(EncodePayload(reason, metadata)));
  return status;
}

ErrorReason GetErrorReason(const absl::Status& status) {
  std::optional<std::string> text = PayloadText(status);
  if (!text.has_value()) return ErrorReason::kUnspecified;
  std::vector<absl::string_view> lines = absl::StrSplit(*text, '\n');
  return ErrorReasonFromName(lines[0]);
}

ErrorMetadata GetErrorMetadata(const absl::Status& status) {
  ErrorMetadata metadata;
  std::optional<std::string> text = PayloadText(status);
  if (!text.has_value()) return metadata;
  std::vector<absl::string_view> lines = absl::StrSplit(*text, '\n');
  for (size_t i = 1; i < lines.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(lines[i], absl::MaxSplits('=', 1));
    std::string value;
    if (!absl::CUnescape(kv.second, &value)) continue;  // not ours: skip
    metadata[std::string(kv.first)] = std::move(value);
  }
  return metadata;
}

absl::Status WithContext(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  absl::Status out(status.code(), absl::StrCat(prefix, status.message()));
  status.ForEachPayload(
      [&out](absl::string_view type_url, const absl::Cord& payload) {
        out.SetPayload(type_url, payload);
      });
  return out;
}

}  // namespace muond
