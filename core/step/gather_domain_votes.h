#pragma once
// The collective half of the per-step domain agreement (domain_agreement.h):
// one all_gather of every rank's DomainVote over the group's gtp_remat
// communicator, then (carrying that fold) over its tp communicator, which
// reaches the whole replica, then (carrying the replica's fold) over its dp
// communicator, which reaches every replica: the whole domain.
#include <cstdint>

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
// communicators read and write backend memory). Communicator errors are
// returned as they come.
absl::StatusOr<DomainVote> GatherDomainVotes(Backend& backend,
                                             const DomainBinding& domain,
                                             float* scratch, DomainVote mine);

}  // namespace muond
