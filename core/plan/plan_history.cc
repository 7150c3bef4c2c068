#include "core/plan/plan_history.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace muond {

absl::Status ValidatePlansKept(const char* field, int kept) {
  if (kept >= 1 && kept <= kPlansKept) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", kept, " must be in [1, ", kPlansKept,
                   "] (kPlansKept, the plan versions a daemon and its step "
                   "engine keep)"));
}

int64_t AgreedPlanVersion(int64_t active,
                          const std::map<std::string, int64_t>& agreed) {
  int64_t version = active;
  for (const auto& [group, v] : agreed) version = std::min(version, v);
  return version;
}

}  // namespace muond
