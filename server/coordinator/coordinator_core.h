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
// Thread-safety: all methods are thread-safe; WaitForPlan and KvGet block.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/plan/plan_history.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/coordinator_metrics.h"

namespace muond {

// Cost of NS on one matrix, by shape ({rows, cols}); absent shapes use the
// planner's analytic ns_cost.
using CostTable = std::map<std::vector<int64_t>, double>;

// Plans one Muon group: a home per param in manifest order. The manifest is
// the one of the domain's lowest global rank. `cost_model` is never
// UNSPECIFIED; with COST_MODEL_MEASURED `costs` is non-empty.
using GroupPlanner = std::function<absl::StatusOr<v1::GroupPlan>(
    const v1::GroupManifest& manifest, v1::CostModel cost_model,
    const CostTable& costs)>;

// Bounds of the rendezvous store, so no client can grow the coordinator
// without limit (ResourceExhausted naming the limit). NCCL stores a 128-byte
// unique id per communicator, Gloo one address list per rank (about 100
// bytes per peer): 1 MiB per value holds thousands of ranks.
struct KvLimits {
  int64_t max_key_bytes = 1024;
  int64_t max_value_bytes = 1 << 20;
  int64_t max_keys_per_job = 1 << 16;
  // Keys plus values over every job of the coordinator.
  int64_t max_total_bytes = int64_t(256) << 20;
};

struct CoordinatorOptions {
  // When non-empty every Join must carry this token.
  std::string token;
  // Longest a KvGet or a watcher may block in one call.
  absl::Duration max_wait = absl::Minutes(10);
  KvLimits kv;
  // Jobs this coordinator holds at once; a Join for a new job beyond it is
  // ResourceExhausted (idle jobs expire first).
  int max_jobs = 64;
  // A job with no live daemon and no RPC for this long is forgotten: its
  // world size, token, store, manifests and plans.
  absl::Duration job_idle_expiry = absl::Minutes(10);
  // A rank is live while its plan stream (WatchPlans) is open, and for this
  // long after its Join before the stream opens (the daemon opens it right
  // after joining). A Join that never watches stops holding the rank then.
  absl::Duration join_grace = absl::Seconds(30);
  // The clock of expiry and grace (tests inject one).
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  GroupPlanner planner;
  // Automatic rebalancing from measured timings (docs/ARCHITECTURE.md
  // "Plans and their versions"). A job is checked when every rank has
  // reported a step at least `rebalance_interval_steps` after both the
  // activation of its latest plan and its previous check (hysteresis: at most
  // one automatic rebalance per that many steps, and only from timings
  // measured under the current plan).
  // It is rebalanced when the per-rank NS phase times of the latest reports
  // show max/mean > `rebalance_threshold`: the job is planned again with the
  // measured cost table ("measured" model) and, if any home changes, the
  // plan is pushed as the next version activating at the latest reported
  // step + `rebalance_activate_margin` (far enough ahead that every daemon
  // has it before that step). rebalance_threshold <= 0: off.
  double rebalance_threshold = 0;
  int64_t rebalance_interval_steps = 100;
  int64_t rebalance_activate_margin = 20;
  // Plans a job keeps, oldest dropped first, so a long job that rebalances
  // often does not grow without bound (a plan holds every param's home). A
  // watcher further behind than that gets the oldest kept plan. In
  // [1, kPlansKept] (Validate): daemons keep kPlansKept, so keeping more is
  // of no use.
  int plans_kept = kPlansKept;
  // Where plans, planning failures, manifests and rebalances are counted
  // (not owned; must outlive the core); null: counted nowhere that is served.
  CoordinatorMetrics* metrics = nullptr;

  // InvalidArgument naming the field and its rule: plans_kept outside [1,
  // kPlansKept], a NaN or negative rebalance_threshold, an interval or margin
  // outside [1, kMaxRebalanceSteps], non-positive durations or limits. The
  // names are muond-coordinator's flags (job_idle_expiry_s,
  // kv_max_value_bytes).
  absl::Status Validate() const;

  // The largest rebalance interval or activation margin accepted.
  static constexpr int64_t kMaxRebalanceSteps = int64_t(1) << 40;
};

class CoordinatorCore {
 public:
  explicit CoordinatorCore(CoordinatorOptions options);

  // InvalidArgument: a job id CheckJobId refuses, world_size < 1, rank outside
  // [0, world_size), world_size different from the job's. PermissionDenied:
  // wrong token. AlreadyExists: the rank is live (its plan stream is open, or
  // it joined less than join_grace ago); a stale join is replaced.
  // ResourceExhausted: a new job beyond max_jobs.
  // When no rank of the job is live (all left: the job's daemons restart),
  // the job's key/value store is cleared first; plans and manifests stay.
  // A Join with another world size or token then starts a fresh job.
  absl::StatusOr<v1::JoinResponse> Join(const v1::JoinRequest& request);
  // OK when the job has no token (its first Join carried none) or `token`
  // equals it; PermissionDenied naming the job otherwise. Unknown jobs are
  // OK here (the RPC itself answers NotFound); a job id CheckJobId refuses
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
  absl::StatusOr<std::optional<v1::Plan>> WaitForWatcher(
      const std::string& job_id, int rank, int64_t after_version,
      int64_t* refusals_seen, absl::Duration timeout);

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
  struct Daemon {
    v1::JoinRequest join;
    // Open plan streams, and a join not yet followed by one (see
    // CoordinatorOptions::join_grace).
    int streams = 0;
    bool join_pending = false;
    absl::Time joined_at;
    int64_t last_step_id = -1;
    v1::StepTimings last_timings;
    bool has_manifest = false;
    v1::PublishManifestRequest manifest;
    std::string registration;  // id of the registration that published
    // Published a new registration since the job's latest plan.
    bool new_round = false;
    // The registration of this rank the job's latest refusal dropped (empty:
    // none), sent with that refusal on the rank's plan stream.
    std::string refused_registration;
    // Stale registrations (StaleForRefusedRound): the latest of this rank a
    // refusal dropped (the one its daemon re-publishes on a reconnect) and
    // the latest whose own publish was refused, each with the refusal (empty
    // id: none). Ids are never reused, so they stay until replaced.
    std::string dropped_registration;
    absl::Status dropped_by;
    std::string refused_publish;
    absl::Status refused_by;
    // The job's refusal count at the rank's Join: its plan stream sends the
    // refusals after it.
    int64_t refusals_at_join = 0;
    // Shape -> (ns_us, count) of the latest report that measured it.
    std::map<std::vector<int64_t>, std::pair<double, int64_t>> shape_times;
  };
  struct Job {
    std::string id;
    int world_size = 0;
    std::string token;
    std::map<int, Daemon> daemons;
    std::map<std::string, std::string> kv;
    // The newest CoordinatorOptions::plans_kept versions; its floor and
    // resume step come from the daemons' publishes (PublishManifestRequest:
    // the newest plan version any of them holds and the latest step any of
    // them applied), non-zero on a coordinator that restarted under running
    // daemons.
    PlanHistory<v1::Plan> plans;
    // Manifest fingerprint the latest plan was computed from.
    std::string planned_fingerprint;
    // Lowest reported step at the last automatic-rebalance check.
    int64_t last_rebalance_check_step = -1;
    // Expiry: the last RPC that named the job, and the calls blocked on it
    // (a job is never deleted under a waiter).
    absl::Time last_activity;
    int waiters = 0;
    // Bytes of keys plus values in `kv`.
    int64_t kv_bytes = 0;
    // Refused registration rounds so far and the latest one's reason: pushed
    // to every plan stream (WaitForWatcher), so every rank's trainer stops
    // with the reason instead of waiting for a plan.
    int64_t refusals = 0;
    std::string refusal_reason;
    absl::StatusCode refusal_code = absl::StatusCode::kOk;
  };

  bool Live(const Daemon& daemon, absl::Time now) const;
  bool AnyLive(const Job& job, absl::Time now) const;
  // Drops the job's store (its bytes leave total_kv_bytes_).
  void ClearKv(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets jobs with no live daemon, no waiter and no RPC for
  // job_idle_expiry.
  void ExpireIdleJobs(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A fresh job for a first Join.
  std::unique_ptr<Job> NewJob(const v1::JoinRequest& request) const;
  // FailedPrecondition while some ranks but not all published a new
  // registration since the latest plan, or not every rank has a manifest.
  absl::Status CheckNoRoundInProgress(const Job& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::StatusOr<Job*> FindJob(const std::string& job_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks the published manifests of the job against each other; OK when
  // consistent (maybe incomplete).
  absl::Status CheckAgainstPeers(const Job& job,
                                 const v1::PublishManifestRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Computes the job's next plan (PlanHistory::NextVersion) from its
  // manifests.
  absl::StatusOr<v1::Plan> ComputePlan(const Job& job, const CostTable& costs,
                                       v1::CostModel cost_model,
                                       int64_t activate_at_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ComputePlan without counting its failure.
  absl::StatusOr<v1::Plan> PlanJob(const Job& job, const CostTable& costs,
                                   v1::CostModel cost_model,
                                   int64_t activate_at_step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AllPublished(const Job& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // PublishRegistration's checks of the request alone (shape, resume fields).
  static absl::Status ValidatePublishFields(
      const v1::PublishManifestRequest& published,
      const CoordinatorOptions& options);
  // PublishRegistration for a joined rank whose request passed
  // ValidatePublishFields.
  absl::StatusOr<int64_t> PublishJoined(
      Job& job, Daemon& daemon, const v1::PublishManifestRequest& published,
      const std::string& registration) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A publish of `refused_rank` was refused: drops every manifest of the
  // registration round (published since the latest plan) and the refused
  // rank's own, so a retry is compared with, and planned from, nothing of
  // the refused attempt.
  // The refusal is pushed to every rank's plan stream, naming to each rank
  // the registration of its that was dropped (`registration` for the refused
  // rank's own attempt).
  // `reason` is the text pushed (Plan.round_refused).
  void RefuseRound(Job& job, int refused_rank, const std::string& registration,
                   absl::StatusCode code, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rule for publishes after a refused round: a publish of a registration
  // the refused round refused or dropped belongs to the refused attempt (a
  // reconnect's re-publish; its trainer heard the refusal and registers
  // again), so it is refused with that round's reason and changes nothing.
  // Every other publish (a new registration id, or none) is judged as usual:
  // a new registration starts or joins the next round whichever rank
  // publishes first. Publish order cannot tell a new registration from one
  // made for the refused attempt (a rank whose publish arrives after the
  // refusal may be either), so order is never the rule: refusing a rank for
  // publishing before the refused rank left it without a plan.
  absl::Status StaleForRefusedRound(const Job& job, const Daemon& daemon,
                                    const v1::PublishManifestRequest& published,
                                    const std::string& registration) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A daemon's own refusal of its trainer's registration
  // (PublishManifestRequest .registration_refused): refuses the job's round.
  absl::StatusOr<int64_t> RefuseOwnRegistration(
      Job& job, const v1::PublishManifestRequest& published,
      const std::string& registration) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  CostTable JobMeasuredCosts(const Job& job) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The automatic rebalance of CoordinatorOptions, checked after a report.
  void MaybeRebalance(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  // options_.metrics, or one of our own when it is null.
  const std::unique_ptr<CoordinatorMetrics> own_metrics_;
  CoordinatorMetrics* const metrics_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  int64_t total_kv_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muond
