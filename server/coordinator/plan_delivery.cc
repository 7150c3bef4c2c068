#include "server/coordinator/plan_delivery.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"

namespace muond {

absl::StatusOr<v1::Plan> NewestPlan(const Job& job) {
  if (job.plans.empty()) {
    return WithErrorReason(
        absl::NotFoundError(absl::StrCat(
            "job '", job.id, "' has no plan yet (waiting for manifests)")),
        ErrorReason::kNoPlanYet);
  }
  return *job.plans.newest();
}

int64_t RefusalsBeforeStream(const Job& job, int rank) {
  auto it = job.daemons.find(rank);
  return it == job.daemons.end() ? job.refusals : it->second.refusals_at_join;
}

bool WatcherHasNews(const Job& job, int64_t after_version,
                    int64_t refusals_seen, int64_t epoch_seen) {
  return job.refusals > refusals_seen || job.comm_epoch > epoch_seen ||
         job.plans.NextForWatcher(after_version) != nullptr;
}

v1::Plan TakeWatcherNews(const Job& job, int rank, int64_t after_version,
                         int64_t* refusals_seen, int64_t* epoch_seen) {
  if (job.refusals > *refusals_seen) {
    *refusals_seen = job.refusals;
    v1::Plan refusal;
    refusal.set_job_id(job.id);
    refusal.set_round_refused(job.refusal_reason);
    auto it = job.daemons.find(rank);
    if (it != job.daemons.end()) {
      refusal.set_refused_registration(it->second.refused_registration);
    }
    return refusal;
  }
  if (job.comm_epoch > *epoch_seen) {
    *epoch_seen = job.comm_epoch;
    v1::Plan epoch;
    epoch.set_job_id(job.id);
    epoch.set_comm_epoch(job.comm_epoch);
    return epoch;
  }
  return *job.plans.NextForWatcher(after_version);
}

absl::StatusOr<int64_t> AdvanceCommEpoch(Job& job, int64_t failed_epoch) {
  if (failed_epoch < 0 || failed_epoch >= kMaxCommEpoch) {
    return absl::InvalidArgumentError(absl::StrCat("comm_epoch ", failed_epoch,
                                                   " must be in [0, ",
                                                   kMaxCommEpoch - 1, "]"));
  }
  if (failed_epoch > job.comm_epoch && job.comm_epoch != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "comm_epoch ", failed_epoch, " is newer than the epoch of job '",
        job.id, "' (", job.comm_epoch,
        "): a daemon reports only an epoch the coordinator pushed"));
  }
  job.comm_epoch = std::max(job.comm_epoch, failed_epoch + 1);
  return job.comm_epoch;
}

}  // namespace muond
