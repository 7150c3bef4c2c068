#pragma once
// How many param groups one registration (one engine) may hold: the rule's
// one home, applied by LayerShardedMuon::Create and by the daemon when a
// trainer registers.
#include <cstdint>

#include "absl/status/status.h"

namespace muond {

// Every group costs a domain agreement (a collective on multi-rank domains)
// per step, run one group after the other, and on the host each group of a
// single-rank domain is a lane of its own: 10,000 groups step within
// seconds on a host daemon (tests/core/step/many_groups_test.cc); far more
// would make every step pay for the per-group bookkeeping of groups that
// differ only in their hyperparameters.
inline constexpr int64_t kMaxParamGroups = 10000;

// OK for 1..kMaxParamGroups groups; otherwise InvalidArgument naming the
// count, the cap and what to do instead.
absl::Status CheckParamGroupCount(int64_t groups);

}  // namespace muond
