#include "server/coordinator/coordinator_options.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {

absl::Status CoordinatorOptions::Validate() const {
  RETURN_IF_ERROR(ValidatePlansKept("plans_kept", plans_kept));
  if (!std::isfinite(rebalance_threshold) || rebalance_threshold < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rebalance_threshold: ", rebalance_threshold,
                     " must be finite and >= 0 (0 = off)"));
  }
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"rebalance_interval_steps",
                                        rebalance_interval_steps},
        {"rebalance_activate_margin", rebalance_activate_margin}}) {
    if (value < 1 || value > kMaxRebalanceSteps) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", value, " must be in [1, ", kMaxRebalanceSteps, "]"));
    }
  }
  for (const auto& [field, value] :
       {std::pair<const char*, absl::Duration>{"max_wait", max_wait},
        {"job_idle_expiry_s", job_idle_expiry},
        {"join_grace_s", join_grace}}) {
    if (value <= absl::ZeroDuration() || value == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", absl::FormatDuration(value), " must be > 0 and finite"));
    }
  }
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"max_jobs", max_jobs},
        {"kv_max_key_bytes", kv.max_key_bytes},
        {"kv_max_value_bytes", kv.max_value_bytes},
        {"kv_max_keys_per_job", kv.max_keys_per_job},
        {"kv_max_total_bytes", kv.max_total_bytes}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", value, " must be >= 1"));
    }
  }
  return absl::OkStatus();
}

}  // namespace muond
