#pragma once
// The collective half of the job vote (job_vote.h): one all_gather of every
// rank's ballot over the job communicator (all daemons of the job).
#include <vector>

#include "absl/status/statusor.h"
#include "core/comm/communicator.h"
#include "core/step/job_vote.h"

namespace muond {

// Every rank's ballot, index = rank in `job`. `job` is a host-memory
// communicator (Gloo in host and GPU mode alike: a ballot is a few bytes);
// null or size 1: just `mine`. Communicator errors are returned as they come
// (DeadlineExceeded for a hung peer, Unavailable for a dead one).
absl::StatusOr<std::vector<JobBallot>> GatherJobBallots(Communicator* job,
                                                        const JobBallot& mine);

}  // namespace muond
