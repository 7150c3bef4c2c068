#pragma once
// This rank's half of the "every gradient is finite" vote of a group.
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/step/group_state.h"

namespace muond {

// The bound every gradient element must stay under, |g| < limit, for a
// group's step to go ahead. Where a Muon group carries gradients through
// bf16 (the NS input of medium precision, or bf16 momentum state) a finite
// fp32 gradient at or beyond the bf16 overflow threshold (~3.396e38) would
// round to inf there and turn the whole update into NaN, so it fails (or
// skips) the step like a non-finite one. Momentum and NS input are convex
// combinations of gradients (lerp), so gradients under the bound keep them
// under it in exact arithmetic. In fp32, torch's lerp order m + w (g - m)
// (muond's, bitwise) overflows when g and m are both near the fp32 range with
// opposite signs (|g|, |m| >~ 1.7e38): torch.optim.Muon's momentum then
// becomes inf and so does muond's, unrefused. The bound costs nothing: the
// same one read of the gradients.
float GradLimit(const GroupState& group);

// The grads of the group's params not in `skip`: the ones its finiteness
// check reads. A skipped param's grad is not this step's (the trainer sent
// none) and is not read.
std::vector<MatrixView> GradsToCheck(const GroupState& group,
                                     const std::set<std::string>& skip);

// Whether every gradient of the group's params not in `skip` is under
// GradLimit (true for a group without such params).
absl::StatusOr<bool> GradsWithinLimit(const GroupState& group,
                                      const std::set<std::string>& skip);

// The params not in `skip` whose gradients break GradLimit, as
// "group/param", with the reason when the gradient is finite but beyond the
// bf16 range.
absl::StatusOr<std::vector<std::string>> BadGradNames(
    const GroupState& group, const std::set<std::string>& skip);

}  // namespace muond
