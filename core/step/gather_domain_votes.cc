#include "core/step/gather_domain_votes.h"

#include <utility>
#include <vector>

#include "core/common/status_macros.h"

namespace muond {

int64_t DomainVoteScratchFloats(int64_t largest_comm) {
  return kDomainVoteFloats * (1 + largest_comm);
}

absl::StatusOr<DomainVote> GatherDomainVotes(
    Backend& backend, const DomainBinding& domain, float* scratch,
    DomainVote mine, std::vector<uint64_t>* replica_grads) {
  if (replica_grads != nullptr) *replica_grads = {mine.grads};
  // The DP group first: its gather alone holds the replicas' own gradient
  // fingerprints; the others carry on whether they agreed.
  for (Communicator* comm : {domain.dp, domain.gtp, domain.tp}) {
    if (comm == nullptr || comm->size() <= 1) continue;
    const auto local = EncodeDomainVote(mine);
    RETURN_IF_ERROR(backend.CopyFromHost(scratch, local.data(),
                                         sizeof(float) * local.size()));
    RETURN_IF_ERROR(comm->AllGather(scratch, kDomainVoteFloats,
                                    scratch + kDomainVoteFloats,
                                    DType::kFloat32));
    RETURN_IF_ERROR(comm->Wait());
    std::vector<float> gathered(kDomainVoteFloats * comm->size());
    RETURN_IF_ERROR(backend.CopyToHost(gathered.data(),
                                       scratch + kDomainVoteFloats,
                                       gathered.size() * sizeof(float)));
    if (comm == domain.dp) {
      std::vector<uint64_t> grads;
      for (size_t at = 0; at < gathered.size(); at += kDomainVoteFloats) {
        grads.push_back(DecodeDomainVote(absl::MakeConstSpan(gathered).subspan(
                                             at, kDomainVoteFloats))
                            .grads);
      }
      mine.replicas_agree = mine.replicas_agree && ReplicaGradsAgree(grads);
      if (replica_grads != nullptr) *replica_grads = std::move(grads);
    }
    mine = FoldDomainVotes(mine, gathered);
  }
  return mine;
}

}  // namespace muond
