#pragma once
// The dp_share exchange of one param group (docs/ARCHITECTURE.md "One step"):
// with a DP axis (D > 1) each param's update is computed once, on its home
// replica (NsHome::d), exactly as with D = 1; then one all_to_allv over the
// DP group {(d', g, t) : d' in [0, D)} (peer index d') copies it to the
// other replicas. Rank (d, g, t) sends to every peer d' != d the local update
// UL_i of every param homed in replica d and receives from peer d' those
// homed at d'. Every rank of a DP group holds the same shards, so a block is
// a whole local shard (spec.local_shape) on both sides. Pieces are in param
// order within a peer's segment. A skipped param still moves its (zero)
// update, so the counts depend only on the specs and homes.
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/exchange_plan.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"

namespace muond {

// The plan of rank (my_d, my_g, my_t) of `domain`: forward holds the
// all_to_allv (reverse is empty); group_ranks are the flat domain ranks of
// the DP group (DomainSize::FlatRank(d', g, t)), my_peer = my_d. Inactive
// (nothing moves) when D = 1 or every local shard is empty; every member of
// the DP group computes the same value. Errors (InvalidArgument naming the
// param): homes/specs size mismatch, a home replica outside [0, D),
// (my_d, my_g, my_t) outside the domain.
absl::StatusOr<StageExchange> BuildReplicaExchangePlan(
    const std::vector<ParamShardSpec>& specs, const std::vector<NsHome>& homes,
    DomainSize domain, int my_d, int my_g, int my_t);

}  // namespace muond
