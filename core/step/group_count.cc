#include "core/step/group_count.h"

#include "absl/strings/str_cat.h"

namespace muond {

absl::Status CheckParamGroupCount(int64_t groups) {
  if (groups <= kMaxParamGroups) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "groups: ", groups, " param groups exceed the cap of ", kMaxParamGroups,
      " per registration; merge the groups that share hyperparameters into "
      "one (a group holds any number of params), and change a group's lr or "
      "weight_decay over training through the step's per-group overrides "
      "(muond.torch.Muon sends each group's live lr and weight_decay with "
      "every step) rather than through more groups"));
}

}  // namespace muond
