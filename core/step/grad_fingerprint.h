#pragma once
// This rank's fingerprint of a group's gradients, which its DP replicas
// compare in the per-step domain agreement (domain_agreement.h).
#include <cstdint>
#include <set>
#include <string>

#include "core/step/group_state.h"

namespace muond {

// The Fingerprint of the group's gradients (every param not in `skip`, in
// registration order, row by row: the same bytes give the same value on any
// rank), or 0 where none is taken: without a DP axis (nothing to compare)
// and on device backends, whose gradients live in device memory (the
// Backend has no on-device hash, and a copy of every gradient to the host
// each step would cost more than the check is worth; the check is
// host-only there).
uint64_t GradFingerprint(const GroupState& group,
                         const std::set<std::string>& skip);

}  // namespace muond
