#include "server/common/job_id.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace muond {

absl::Status CheckJobId(absl::string_view field, absl::string_view value) {
  const bool allowed =
      std::all_of(value.begin(), value.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
               c == '_' || c == '-';
      });
  if (!value.empty() && int(value.size()) <= kMaxJobIdChars && allowed) {
    return absl::OkStatus();
  }
  // Quote a bounded, escaped prefix: the value may be megabytes of control
  // bytes, and the message reaches logs and the caller.
  const absl::string_view shown = value.substr(0, kMaxJobIdChars);
  return absl::InvalidArgumentError(absl::StrCat(
      field, "=\"", absl::CHexEscape(shown),
      value.size() > shown.size() ? "..." : "", "\" (", value.size(),
      " bytes) must be 1-", kMaxJobIdChars,
      " characters of [A-Za-z0-9._-] (a job id names sockets, shm objects "
      "and metrics labels)"));
}

}  // namespace muond
