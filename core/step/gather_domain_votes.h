#pragma once
// The collective half of the per-step domain agreement (domain_agreement.h):
// for each group, an all_gather of every rank's DomainVote over the group's
// dp communicator (the replicas of this rank's shard, which compare their
// gradient fingerprints there), then (carrying that fold) over its gtp_remat
// communicator, then over its tp communicator: the fold reaches the whole
// domain, so every rank learns whether any shard's replicas differ. The
// groups that use one communicator at a stage share one all_gather.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/comm/communicator.h"
#include "core/step/domain_agreement.h"

namespace muond {

// Floats of the scratch one gather of GatherDomainVotesOfGroups needs for
// the votes of `groups` groups on a communicator of `comm_size` ranks: the
// rank's own votes, then the gathered ones.
int64_t DomainVoteScratchFloats(int64_t comm_size, int64_t groups);

// One group's part in GatherDomainVotesOfGroups.
struct GroupVote {
  Backend* backend = nullptr;  // the group's (its lane's)
  // The group's domain's communicators (DomainBinding): null or of one rank
  // where the domain has no such axis.
  Communicator* dp = nullptr;
  Communicator* gtp = nullptr;
  Communicator* tp = nullptr;
  // The lane's scratch, of `backend` memory (the communicators read and
  // write backend memory): DomainVoteScratchFloats for the most groups on
  // one of the lane's communicators.
  float* scratch = nullptr;
  // In: this rank's vote. Out: the domain's (where `status` is OK).
  DomainVote vote;
  // Out: the gradient fingerprints of this rank's DP group by replica d
  // (just mine without a DP axis).
  std::vector<uint64_t> replica_grads;
  // Out: the first error of a gather that carried this group's vote.
  absl::Status status;
};

// Gathers and folds the votes of every group's domain, with one all_gather
// per communicator and stage (dp, then gtp_remat, then tp) for all the
// groups that use that communicator there, not one per group: a thousand
// groups on one domain gather three times, not three thousand. Each rank
// sends its groups' votes back to back, in the order of `groups`;
// communicators of a stage run in the order of the first group that uses
// them. Every rank of a communicator holds the groups that use it, in the
// same order (their collectives require it), so every rank issues the same
// gathers in the same order. A group whose gather failed still takes part
// in its later stages (its peers wait for it there); its `status` keeps the
// failure. A gather that timed out (DeadlineExceeded: a rank never arrived)
// stops them all: returned, with the index of the first group it carried in
// `timed_out`.
absl::Status GatherDomainVotesOfGroups(absl::Span<GroupVote> groups,
                                       size_t* timed_out);

}  // namespace muond
