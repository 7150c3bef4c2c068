#include "server/common/job_id.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace muond {
namespace {

bool IsIdChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
         c == '_' || c == '-';
}

bool IsId(absl::string_view value) {
  return !value.empty() && int(value.size()) <= kMaxJobIdChars &&
         std::all_of(value.begin(), value.end(), IsIdChar);
}

// Quotes a bounded, escaped prefix: the value may be megabytes of control
// bytes, and the message reaches logs and the caller.
std::string Quoted(absl::string_view field, absl::string_view value,
                   size_t max_bytes) {
  const absl::string_view shown = value.substr(0, max_bytes);
  return absl::StrCat(field, "=\"", absl::CHexEscape(shown),
                      value.size() > shown.size() ? "..." : "", "\" (",
                      value.size(), " bytes)");
}

constexpr char kIdRule[] = " characters of [A-Za-z0-9._-]";

}  // namespace

absl::Status CheckJobId(absl::string_view field, absl::string_view value) {
  if (IsId(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(Quoted(field, value, kMaxJobIdChars), " must be 1-",
                   kMaxJobIdChars, kIdRule,
                   " (a job id names sockets, shm objects and metrics "
                   "labels)"));
}

absl::Status CheckOptimizerName(absl::string_view field,
                                absl::string_view value) {
  if (IsId(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      Quoted(field, value, kMaxJobIdChars), " must be 1-", kMaxJobIdChars,
      kIdRule,
      " (an optimizer instance's name; empty names the daemon's default "
      "instance)"));
}

std::string InstanceJobId(absl::string_view job, absl::string_view name) {
  if (name.empty()) return std::string(job);
  return absl::StrCat(job, "/", name);
}

bool IsInstanceJobId(absl::string_view job_id) {
  return job_id.find('/') != absl::string_view::npos;
}

std::string DescribeInstance(absl::string_view name) {
  if (name.empty()) return "the default optimizer instance";
  return absl::StrCat("optimizer instance '", name, "'");
}

absl::Status CheckCoordinatorJobId(absl::string_view field,
                                   absl::string_view value) {
  const size_t slash = value.find('/');
  if (slash == absl::string_view::npos) return CheckJobId(field, value);
  if (IsId(value.substr(0, slash)) && IsId(value.substr(slash + 1))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      Quoted(field, value, 2 * kMaxJobIdChars + 1), " must be 1-",
      kMaxJobIdChars, kIdRule,
      " (a job id), or an optimizer instance's job: <job id>/<name of such "
      "characters>"));
}

}  // namespace muond
