#include "core/step/gather_job_ballots.h"

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {

absl::StatusOr<std::vector<JobBallot>> GatherJobBallots(Communicator* job,
                                                        const JobBallot& mine) {
  if (job == nullptr || job->size() <= 1) return std::vector<JobBallot>{mine};
  if (job->memory_space() != MemorySpace::kHost) {
    return absl::InternalError(absl::StrCat(
        "job vote: communicator '", job->name(), "' is not host memory"));
  }
  const auto words = EncodeJobBallot(mine);
  std::vector<uint32_t> gathered(kJobBallotWords * job->size());
  // Raw 32-bit words as fp32 elements: the all_gather copies bytes, it does
  // no arithmetic, so every bit arrives as sent.
  RETURN_IF_ERROR(job->AllGather(words.data(), kJobBallotWords, gathered.data(),
                                 DType::kFloat32));
  RETURN_IF_ERROR(job->Wait());
  std::vector<JobBallot> ballots;
  for (int r = 0; r < job->size(); ++r) {
    ballots.push_back(DecodeJobBallot(absl::MakeConstSpan(gathered).subspan(
        size_t(r) * kJobBallotWords, kJobBallotWords)));
  }
  return ballots;
}

}  // namespace muond
