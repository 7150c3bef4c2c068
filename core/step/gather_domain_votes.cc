#include "core/step/gather_domain_votes.h"

#include <vector>

#include "core/common/status_macros.h"

namespace muond {

int64_t DomainVoteScratchFloats(int64_t largest_comm) {
  return kDomainVoteFloats * (1 + largest_comm);
}

absl::StatusOr<DomainVote> GatherDomainVotes(Backend& backend,
                                             const DomainBinding& domain,
                                             float* scratch, DomainVote mine) {
  for (Communicator* comm : {domain.gtp, domain.tp, domain.dp}) {
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
    mine = FoldDomainVotes(mine, gathered);
  }
  return mine;
}

}  // namespace muond
