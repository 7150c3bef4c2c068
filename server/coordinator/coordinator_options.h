#pragma once
// What a CoordinatorCore is built from: its options (muond-coordinator's
// flags), the planner it calls per Muon group and the cost table type that
// planner reads.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/plan/plan_history.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/kv_store.h"

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

// Whether a --listen address (one CheckListenAddress accepts) is reachable
// from this host alone: a Unix socket ("unix:..."), "localhost", an IPv4
// literal in 127.0.0.0/8 or "[::1]". Any other host name may resolve to
// another host's address, so it is not.
bool IsThisHostOnly(absl::string_view listen);

// The rule of a coordinator without a token: it trusts every caller that
// reaches it (any caller may Join and so fill max_jobs, hold a job id, list
// a job's daemons), so it serves this host alone (IsThisHostOnly) unless
// `insecure_allow_untokened_tcp`. TLS does not lift the rule: TLS without
// client certificates encrypts, it authenticates no caller. OK with a
// token; InvalidArgument naming --listen, --token_file and how to make one.
absl::Status CheckUntokenedListen(absl::string_view listen, bool has_token,
                                  bool insecure_allow_untokened_tcp);

}  // namespace muond
