#include "core/step/gather_domain_votes.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/common/status_macros.h"
#include "core/step/group_in_order.h"

namespace muond {

int64_t DomainVoteScratchFloats(int64_t comm_size, int64_t groups) {
  return kDomainVoteFloats * groups * (1 + comm_size);
}

namespace {

// The groups' communicator at each stage, in the order the fold goes.
constexpr Communicator* GroupVote::*kStages[] = {
    &GroupVote::dp, &GroupVote::gtp, &GroupVote::tp};

// One all_gather on `comm` of the votes of `members` (indices into
// `groups`), folded into each; at the dp stage, each member's replica
// fingerprints too.
absl::Status GatherOn(Communicator& comm, bool dp_stage,
                      absl::Span<GroupVote> groups,
                      const std::vector<size_t>& members) {
  const size_t n = members.size();
  const size_t per_rank = n * kDomainVoteFloats;
  std::vector<float> local(per_rank);
  for (size_t k = 0; k < n; ++k) {
    const auto vote = EncodeDomainVote(groups[members[k]].vote);
    std::copy(vote.begin(), vote.end(), local.begin() + k * kDomainVoteFloats);
  }
  GroupVote& first = groups[members.front()];
  Backend& backend = *first.backend;
  float* scratch = first.scratch;
  RETURN_IF_ERROR(
      backend.CopyFromHost(scratch, local.data(), sizeof(float) * per_rank));
  RETURN_IF_ERROR(comm.AllGather(scratch, int64_t(per_rank), scratch + per_rank,
                                 DType::kFloat32));
  RETURN_IF_ERROR(comm.Wait());
  std::vector<float> gathered(per_rank * comm.size());
  RETURN_IF_ERROR(backend.CopyToHost(gathered.data(), scratch + per_rank,
                                     gathered.size() * sizeof(float)));
  std::vector<float> of_group(kDomainVoteFloats * comm.size());
  for (size_t k = 0; k < n; ++k) {
    for (int r = 0; r < comm.size(); ++r) {
      const auto from = gathered.begin() + r * per_rank + k * kDomainVoteFloats;
      std::copy(from, from + kDomainVoteFloats,
                of_group.begin() + r * kDomainVoteFloats);
    }
    GroupVote& group = groups[members[k]];
    if (dp_stage) {
      std::vector<uint64_t> grads;
      for (size_t at = 0; at < of_group.size(); at += kDomainVoteFloats) {
        grads.push_back(DecodeDomainVote(absl::MakeConstSpan(of_group).subspan(
                                             at, kDomainVoteFloats))
                            .grads);
      }
      group.vote.replicas_agree =
          group.vote.replicas_agree && ReplicaGradsAgree(grads);
      group.replica_grads = std::move(grads);
    }
    group.vote = FoldDomainVotes(group.vote, of_group);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GatherDomainVotesOfGroups(absl::Span<GroupVote> groups,
                                       size_t* timed_out) {
  for (GroupVote& group : groups) group.replica_grads = {group.vote.grads};
  for (Communicator* GroupVote::*stage : kStages) {
    // The groups on each communicator, in order of its first group.
    const std::vector<std::vector<size_t>> batches = GroupInOrder(
        groups.size(),
        [&](size_t gi) {
          const Communicator* comm = groups[gi].*stage;
          return comm != nullptr && comm->size() > 1;
        },
        [&](size_t a, size_t b) {
          return groups[a].*stage == groups[b].*stage;
        });
    for (const std::vector<size_t>& members : batches) {
      Communicator& comm = *(groups[members.front()].*stage);
      const absl::Status gathered =
          GatherOn(comm, stage == &GroupVote::dp, groups, members);
      if (absl::IsDeadlineExceeded(gathered)) {
        *timed_out = members.front();
        return gathered;
      }
      for (size_t gi : members) groups[gi].status.Update(gathered);
    }
  }
  return absl::OkStatus();
}

}  // namespace muond
