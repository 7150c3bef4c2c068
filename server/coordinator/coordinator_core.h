#pragma once
// The coordinator's job logic, apart from gRPC (the service in
// coordinator_service.h is a thin layer over this class, so everything here is
// testable in-process).
//
// A CoordinatorCore holds many jobs. Per job: the expected world size (from
// the first Join), the joined daemons, a rendezvous key/value store, the
// manifests the daemons published and the versioned NS-home plans.
//
// Plan lifecycle: when every rank of the job has published a manifest and the
// manifests of each group agree across the ranks of its domain, the core plans
// every Muon group (version 1, activate_at_step 0 = at once) and wakes the
// watchers. Rebalance computes version + 1 with a cost table; it activates at
// the latest reported step + activate_after_steps. A rank that publishes a
// different manifest later (re-registration) invalidates the job's manifests
// until all ranks agree again; the next plan gets the next version. A
// refused publish refuses its whole round (RefuseRound): the manifests
// published since the latest plan are dropped and every rank registers again.
// Version numbers, the floor after a coordinator restart and retention are the
// rules of each job's PlanHistory (core/plan/plan_history.h).
//
// The class is a facade over one component per concern, each in its own
// file: JobTable (jobs, tokens, liveness, expiry), KvStore (rendezvous keys
// and their limits), manifest_checks.h (pure checks of a published
// manifest), RegistrationRounds (rounds and their refusals), JobPlanner (a
// job's next plan), plan_delivery.h (what a plan stream sends next) and
// Rebalancer (timings, measured costs, rebalancing). The per-job state they
// share is job.h's Job.
//
// Thread-safety: all methods are thread-safe; WaitForPlan, WaitForWatcher
// and KvGet block. One mutex, mu_, guards the JobTable (so every Job in it)
// and the KvStore's totals; the components are not thread-safe and are only
// called with mu_ held, and the blocking calls wait on mu_ (a Job with a
// waiter is never expired, so the waiter's Job* stays valid).
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/coordinator_options.h"
#include "server/coordinator/job_planner.h"
#include "server/coordinator/job_table.h"
#include "server/coordinator/kv_store.h"
#include "server/coordinator/rebalancer.h"
#include "server/coordinator/registration_rounds.h"

namespace muond {

class CoordinatorCore {
 public:
  explicit CoordinatorCore(CoordinatorOptions options);

  // InvalidArgument: a job id CheckCoordinatorJobId refuses, world_size < 1, rank outside
  // [0, world_size). PermissionDenied: not the coordinator's token.
  // FailedPrecondition: the job's live daemons joined with another world size
  // or token (the daemon waits it out until its deadline). AlreadyExists: the
  // rank is live (its plan stream is open, or it joined less than join_grace
  // ago); a stale join is replaced. ResourceExhausted: a new job beyond
  // max_jobs. When no rank of the job is live (all left: the job's daemons
  // restart), the job's key/value store is cleared first; plans and manifests
  // stay. A Join with another world size or token then starts a fresh job.
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request);
  // OK when the job has no token (its first Join carried none) or `token`
  // equals it; PermissionDenied naming the job otherwise. Unknown jobs are
  // OK here (the RPC itself answers NotFound); a job id CheckCoordinatorJobId refuses
  // is InvalidArgument. Every job-scoped RPC after
  // Join checks this, so only members of the job reach its rendezvous keys.
  absl::Status CheckJobToken(const std::string& job_id,
                             const std::string& token);

  // A plan stream of a joined rank opened: the rank is live until every
  // stream of it ended (Leave). False (nothing counted) for an unknown job
  // or a rank that has not joined: an observer, not the daemon.
  bool StartWatching(const std::string& job_id, int rank);
  // A plan stream of the rank ended (or the rank left): once none is open
  // the rank is not live and may join again.
  void Leave(const std::string& job_id, int rank);

  // NotFound: unknown job. InvalidArgument: empty key. ResourceExhausted
  // naming the KvLimits field the key or value would exceed.
  absl::Status KvSet(const v1::KvSetRequest& request);
  // Blocks up to min(timeout_ms, max_wait) or until `cancelled()` returns
  // true (polled). DeadlineExceeded naming the key when it stays unset.
  absl::StatusOr<std::string> KvGet(
      const v1::KvGetRequest& request,
      const std::function<bool()>& cancelled = {});

  // NotFound: unknown job. FailedPrecondition: rank not joined.
  // InvalidArgument: empty/duplicate group or param names, a domain that does
  // not contain the rank's coordinates, a manifest that differs from an
  // earlier rank of the same domain (names the first differing param, both
  // ranks), two ranks claiming the same (g, t). Nothing is stored on error,
  // and the refusal drops the round's earlier manifests too (RefuseRound).
  absl::Status PublishManifest(const v1::PublishManifestRequest& request);
  // The same, for a daemon registration identified by `registration` (a
  // daemon-chosen id, new for every RegisterParams; the same id again is a
  // reconnect re-publish). Registration rounds: once every rank has
  // published a new registration since the latest plan, the job gets a new
  // plan version (activating at step 0) even when the manifests are
  // unchanged, so communicators rendezvous under fresh keys. Returns the
  // lowest plan version that can belong to this registration's round (the
  // daemon builds its engine only from such a plan). An empty
  // `registration` counts as new only when the manifest is new.
  // A request with `registration_refused` (and no groups) is a daemon's own
  // refusal of its trainer's registration: it refuses the job's round with
  // "rank r refused its trainer's registration: <reason>" (OK: recorded).
  // After a refusal, a publish of a registration the refused round refused
  // or dropped (a reconnect's re-publish of it) is refused with that round's
  // reason and changes nothing (StaleForRefusedRound); any other registration
  // starts or joins the next round, whichever rank publishes first.
  absl::StatusOr<int64_t> PublishRegistration(
      const v1::PublishManifestRequest& request,
      const std::string& registration);

  // NotFound: unknown job, or no plan yet.
  absl::StatusOr<v1::Plan> GetPlan(const std::string& job_id);

  // Waits up to `timeout` for a plan of version > `after_version` and returns
  // the oldest such one, so a watcher gets every version in order (a daemon
  // that skipped one could be asked for it by its domain); after_version 0
  // (a new watcher): the newest plan. nullopt on timeout. NotFound: unknown
  // job.
  absl::StatusOr<std::optional<v1::Plan>> WaitForPlan(const std::string& job_id,
                                                      int64_t after_version,
                                                      absl::Duration timeout);

  // WaitForPlan for a daemon's plan stream (rank `rank`), which also carries
  // the refusals of registration rounds: returns the job's next refusal after
  // `*refusals_seen` (a Plan with only job_id, round_refused and this rank's
  // refused_registration; never a plan, never in the history) before the
  // next plan, and advances `*refusals_seen`. *refusals_seen < 0 (a new
  // stream): starts from the rank's Join, older refusals are not sent.
  // The stream also sends each newer communicator epoch than *epoch_seen
  // (a Plan with only job_id and comm_epoch), advancing it; null: a stream
  // that started at epoch 0.
  absl::StatusOr<std::optional<v1::Plan>> WaitForWatcher(
      const std::string& job_id, int rank, int64_t after_version,
      int64_t* refusals_seen, absl::Duration timeout,
      int64_t* epoch_seen = nullptr);

  // A daemon's collective failed under communicator epoch
  // `request.comm_epoch()`: moves the job past it (AdvanceCommEpoch) and
  // wakes every plan stream. NotFound: unknown job. FailedPrecondition: rank
  // not joined, or a rank of the job not live (naming it; nothing moves:
  // new communicators would wait for it). InvalidArgument: a negative
  // comm_epoch.
  absl::StatusOr<v1::ReportCommFailureResponse> ReportCommFailure(
      const v1::ReportCommFailureRequest& request);

  // Keeps the rank's latest step timings and, per shape, its latest measured
  // NS time; may push an automatic rebalance (CoordinatorOptions).
  // NotFound: unknown job. FailedPrecondition: rank not joined.
  // InvalidArgument: a shape entry that is not 2-D with positive dims, with
  // count < 1 or a non-finite or negative ns_us (nothing is stored).
  absl::Status ReportTimings(const v1::ReportTimingsRequest& request);

  // The job's measured cost table: per shape, the NS time of one matrix in
  // microseconds (sum of ns_us / sum of count over every rank's latest
  // measurement of that shape). Shapes measured as 0 are left out (the
  // planner estimates them). NotFound: unknown job.
  absl::StatusOr<CostTable> MeasuredCosts(const std::string& job_id);

  // NotFound: unknown job. FailedPrecondition: no plan yet (manifests
  // missing), or a registration round in progress (some ranks published a
  // new registration, not all). InvalidArgument: unknown cost model, a cost
  // table entry with a non-positive or non-finite cost or a shape that is not
  // 2-D, activate_after_steps < 1 or an activation step past int64.
  absl::StatusOr<v1::Plan> Rebalance(const v1::RebalanceRequest& request);

  // NotFound: unknown job. Ranks in order; `live` is false for a rank whose
  // plan stream ended (dead, or restarting).
  absl::StatusOr<v1::ListDaemonsResponse> ListDaemons(
      const v1::ListDaemonsRequest& request);

  std::vector<std::string> JobIds();

  // Every job as the metrics show it (CoordinatorMetrics::CollectJobsFrom):
  // live daemons, the newest plan's version and each rank's share of its NS
  // cost (from the rank's latest manifest).
  std::vector<JobMetricsSnapshot> MetricsSnapshot();

 private:
  const CoordinatorOptions options_;
  // options_.metrics, or one of our own when it is null.
  const std::unique_ptr<CoordinatorMetrics> own_metrics_;
  CoordinatorMetrics* const metrics_;
  absl::Mutex mu_;
  KvStore kv_ ABSL_GUARDED_BY(mu_);
  JobTable jobs_ ABSL_GUARDED_BY(mu_);
  // Stateless between calls (they change only the Job they are given).
  const JobPlanner planner_;
  RegistrationRounds rounds_;
  Rebalancer rebalancer_;
};

}  // namespace muond
