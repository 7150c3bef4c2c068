#pragma once
// The collective half of the per-step domain agreement (domain_agreement.h):
// one all_gather of every rank's DomainVote over the group's dp communicator
// (the replicas of this rank's shard, which compare their gradient
// fingerprints there), then (carrying that fold) over its gtp_remat
// communicator, then over its tp communicator: the fold reaches the whole
// domain, so every rank learns whether any shard's replicas differ.
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/step/domain_agreement.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {

// Floats of the scratch GatherDomainVotes needs for communicators of up to
// `largest_comm` ranks: the rank's own vote, then the gathered ones.
int64_t DomainVoteScratchFloats(int64_t largest_comm);

// Gathers and folds the votes of `domain`'s ranks, staging them through
// `scratch` (DomainVoteScratchFloats floats of `backend` memory; the
// communicators read and write backend memory). `replica_grads` (if not
// null) gets the gradient fingerprints of this rank's DP group by replica d
// (just mine without a DP axis). Communicator errors are returned as they
// come.
absl::StatusOr<DomainVote> GatherDomainVotes(
    Backend& backend, const DomainBinding& domain, float* scratch,
    DomainVote mine, std::vector<uint64_t>* replica_grads = nullptr);

}  // namespace muond
