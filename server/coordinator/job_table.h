#pragma once
// The coordinator's jobs: admission (Join: world size, tokens, max_jobs, a
// fresh incarnation once every daemon left), per-job token checks, rank
// liveness (plan streams and the join grace) and the expiry of idle jobs.
// Not thread-safe: CoordinatorCore calls it under its mutex, and a Job*
// it returns stays valid while that mutex is held (or while the job has a
// waiter: a job is never expired under one).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/coordinator_options.h"
#include "server/coordinator/job.h"
#include "server/coordinator/kv_store.h"

namespace muond {

class JobTable {
 public:
  // Not owned; each must outlive the table. `kv` drops the store of a job
  // that expires or starts afresh.
  JobTable(const CoordinatorOptions& options, KvStore* kv,
           CoordinatorMetrics* metrics)
      : options_(options), kv_(kv), metrics_(metrics) {}

  // The checks of a Join that need no job. InvalidArgument: a job id
  // CheckCoordinatorJobId refuses, world_size < 1, rank outside [0, world_size), a
  // host, device or address over 255 bytes or not printable ASCII.
  // PermissionDenied: a `coordinator_token` is set and the request's token
  // is another.
  static absl::Status CheckJoin(const v1::JoinRequest& request,
                                const std::string& coordinator_token);
  // CoordinatorCore::Join for a request CheckJoin accepted.
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request);
  // CoordinatorCore::CheckJobToken for a job id CheckCoordinatorJobId accepted
  // (compared in constant time).
  absl::Status CheckToken(const std::string& job_id,
                          const std::string& token) const;

  // The job, after expiring idle jobs; marks it active. InvalidArgument: a
  // job id CheckCoordinatorJobId refuses. NotFound: unknown (or expired) job.
  absl::StatusOr<Job*> Find(const std::string& job_id);

  // CoordinatorCore::StartWatching and Leave.
  bool StartWatching(const std::string& job_id, int rank);
  void Leave(const std::string& job_id, int rank);

  absl::StatusOr<v1::ListDaemonsResponse> ListDaemons(
      const v1::ListDaemonsRequest& request);
  std::vector<std::string> JobIds() const;
  std::vector<JobMetricsSnapshot> MetricsSnapshot() const;

 private:
  // Forgets jobs with no live daemon, no waiter and no RPC for
  // job_idle_expiry.
  void ExpireIdleJobs(absl::Time now);
  // OK when `request` has the world size and token of `job`, whose live
  // daemons hold it (an idle job was started afresh before);
  // FailedPrecondition naming the holders' world size and the fix otherwise.
  absl::Status CheckSameIncarnation(const Job& job,
                                    const v1::JoinRequest& request,
                                    absl::Time now) const;
  // A fresh job for a first Join.
  std::unique_ptr<Job> NewJob(const v1::JoinRequest& request) const;

  const CoordinatorOptions& options_;
  KvStore* const kv_;
  CoordinatorMetrics* const metrics_;
  std::map<std::string, std::unique_ptr<Job>> jobs_;
};

}  // namespace muond
