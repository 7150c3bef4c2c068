#include "server/coordinator/coordinator_core.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/echo.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/job_id.h"
#include "server/coordinator/manifest_checks.h"
#include "server/coordinator/plan_delivery.h"

namespace muond {

CoordinatorCore::CoordinatorCore(CoordinatorOptions options)
    : options_(std::move(options)),
      own_metrics_(options_.metrics == nullptr
                       ? std::make_unique<CoordinatorMetrics>()
                       : nullptr),
      metrics_(options_.metrics != nullptr ? options_.metrics
                                           : own_metrics_.get()),
      kv_(options_.kv),
      jobs_(options_, &kv_, metrics_),
      planner_(options_.planner, metrics_),
      rounds_(options_.rebalance_activate_margin, &planner_, metrics_),
      rebalancer_(options_, &planner_, metrics_) {}

absl::StatusOr<v1::JoinResponse> CoordinatorCore::Join(
    const v1::JoinRequest& request) {
  RETURN_IF_ERROR(JobTable::CheckJoin(request, options_.token));
  absl::MutexLock lock(&mu_);
  return jobs_.Join(request);
}

absl::Status CoordinatorCore::CheckJobToken(const std::string& job_id,
                                            const std::string& token) {
  // First of every RPC but Join (which checks it itself): an id no daemon
  // could have joined with is refused before it reaches a log or a lookup.
  RETURN_IF_ERROR(CheckCoordinatorJobId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  return jobs_.CheckToken(job_id, token);
}

bool CoordinatorCore::StartWatching(const std::string& job_id, int rank) {
  absl::MutexLock lock(&mu_);
  return jobs_.StartWatching(job_id, rank);
}

void CoordinatorCore::Leave(const std::string& job_id, int rank) {
  absl::MutexLock lock(&mu_);
  jobs_.Leave(job_id, rank);
}

absl::Status CoordinatorCore::KvSet(const v1::KvSetRequest& request) {
  RETURN_IF_ERROR(kv_.CheckSet(request));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(request.job_id()));
  return kv_.Set(job->kv, request);
}

absl::StatusOr<std::string> CoordinatorCore::KvGet(
    const v1::KvGetRequest& request, const std::function<bool()>& cancelled) {
  RETURN_IF_ERROR(KvStore::CheckGet(request));
  const absl::Duration timeout =
      std::min(absl::Milliseconds(request.timeout_ms()), options_.max_wait);
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(request.job_id()));
  // A job is never deleted under a waiter, so `job` stays valid while we
  // wait (a fresh job replaces it only when it has no waiter either).
  ++job->waiters;
  auto is_set = [job, &request]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job->kv.entries.count(request.key()) > 0;
  };
  while (!is_set()) {
    const absl::Time now = absl::Now();
    if (now >= deadline || (cancelled && cancelled())) {
      --job->waiters;
      return absl::DeadlineExceededError(
          absl::StrCat("key '", request.key(), "' of job '", job->id,
                       "' was not set within ", request.timeout_ms(), " ms"));
    }
    mu_.AwaitWithTimeout(absl::Condition(&is_set),
                         std::min(deadline - now, absl::Milliseconds(200)));
  }
  --job->waiters;
  job->last_activity = options_.clock();
  return job->kv.entries.at(request.key());
}

absl::Status CoordinatorCore::PublishManifest(
    const v1::PublishManifestRequest& request) {
  return PublishRegistration(request, "").status();
}

absl::StatusOr<int64_t> CoordinatorCore::PublishRegistration(
    const v1::PublishManifestRequest& published,
    const std::string& registration) {
  const absl::Status valid =
      ValidatePublishFields(published, options_.rebalance_activate_margin);
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Job*> job = jobs_.Find(published.job_id());
  if (!job.ok()) return valid.ok() ? job.status() : valid;
  auto it = (*job)->daemons.find(published.rank());
  if (it == (*job)->daemons.end()) {
    if (!valid.ok()) return valid;
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", published.rank(), " has not joined job '",
                     (*job)->id, "'; Join first"));
  }
  return rounds_.Publish(**job, it->second, published, registration, valid);
}

absl::StatusOr<v1::Plan> CoordinatorCore::GetPlan(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(job_id));
  return NewestPlan(*job);
}

absl::StatusOr<std::optional<v1::Plan>> CoordinatorCore::WaitForPlan(
    const std::string& job_id, int64_t after_version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(job_id));
  auto newer = [job, after_version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return job->plans.NextForWatcher(after_version) != nullptr;
  };
  ++job->waiters;  // keeps `job` from expiring while we wait
  const bool found = mu_.AwaitWithTimeout(absl::Condition(&newer), timeout);
  --job->waiters;
  if (!found) return std::optional<v1::Plan>();
  return std::optional<v1::Plan>(*job->plans.NextForWatcher(after_version));
}

absl::StatusOr<std::optional<v1::Plan>> CoordinatorCore::WaitForWatcher(
    const std::string& job_id, int rank, int64_t after_version,
    int64_t* refusals_seen, absl::Duration timeout, int64_t* epoch_seen) {
  int64_t epoch_zero = 0;
  if (epoch_seen == nullptr) epoch_seen = &epoch_zero;
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(job_id));
  if (*refusals_seen < 0) *refusals_seen = RefusalsBeforeStream(*job, rank);
  auto ready = [job, after_version, refusals_seen,
                epoch_seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return WatcherHasNews(*job, after_version, *refusals_seen, *epoch_seen);
  };
  ++job->waiters;  // keeps `job` from expiring while we wait
  const bool found = mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  --job->waiters;
  if (!found) return std::optional<v1::Plan>();
  return std::optional<v1::Plan>(
      TakeWatcherNews(*job, rank, after_version, refusals_seen, epoch_seen));
}

absl::StatusOr<v1::ReportCommFailureResponse>
CoordinatorCore::ReportCommFailure(
    const v1::ReportCommFailureRequest& request) {
  if (request.comm_epoch() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("comm_epoch ", request.comm_epoch(), " must be >= 0"));
  }
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(request.job_id()));
  if (!job->daemons.contains(request.rank())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", request.rank(), " has not joined job '", job->id, "'"));
  }
  // New communicators need every rank: with one gone, rebuilding would only
  // wait out a rendezvous timeout after another (the job re-registers once
  // it is back).
  const absl::Time now = absl::Now();
  for (int r = 0; r < job->world_size; ++r) {
    auto it = job->daemons.find(r);
    if (it == job->daemons.end() ||
        !Live(it->second, now, options_.join_grace)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "communicators not rebuilt: rank ", r, " of job '", job->id,
          "' is not connected to the coordinator (its daemon is gone or "
          "restarting)"));
    }
  }
  const int64_t before = job->comm_epoch;
  v1::ReportCommFailureResponse response;
  ASSIGN_OR_RETURN(const int64_t epoch,
                   AdvanceCommEpoch(*job, request.comm_epoch()));
  response.set_comm_epoch(epoch);
  if (response.comm_epoch() != before) {
    LOG(WARNING) << "job " << job->id << ": rank " << request.rank()
                 << " reported failed communicators of epoch "
                 << request.comm_epoch() << " (" << Echo(request.reason())
                 << "); every daemon rebuilds them under epoch "
                 << response.comm_epoch();
  }
  return response;
}

absl::Status CoordinatorCore::ReportTimings(
    const v1::ReportTimingsRequest& request) {
  RETURN_IF_ERROR(Rebalancer::CheckTimings(request));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(request.job_id()));
  auto it = job->daemons.find(request.rank());
  if (it == job->daemons.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", request.rank(), " has not joined job '", job->id, "'"));
  }
  rebalancer_.Record(*job, it->second, request);
  return absl::OkStatus();
}

absl::StatusOr<CostTable> CoordinatorCore::MeasuredCosts(
    const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(job_id));
  return Rebalancer::MeasuredCosts(*job);
}

absl::StatusOr<v1::Plan> CoordinatorCore::Rebalance(
    const v1::RebalanceRequest& request) {
  ASSIGN_OR_RETURN(const CostTable explicit_costs,
                   Rebalancer::CheckRequest(request));
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Job * job, jobs_.Find(request.job_id()));
  return rebalancer_.Rebalance(*job, request, explicit_costs);
}

absl::StatusOr<v1::ListDaemonsResponse> CoordinatorCore::ListDaemons(
    const v1::ListDaemonsRequest& request) {
  absl::MutexLock lock(&mu_);
  return jobs_.ListDaemons(request);
}

std::vector<JobMetricsSnapshot> CoordinatorCore::MetricsSnapshot() {
  absl::MutexLock lock(&mu_);
  return jobs_.MetricsSnapshot();
}

std::vector<std::string> CoordinatorCore::JobIds() {
  absl::MutexLock lock(&mu_);
  return jobs_.JobIds();
}

}  // namespace muond
