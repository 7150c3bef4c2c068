#pragma once
// The state the coordinator keeps per job, read and written by every
// component (job table, rendezvous store, registration rounds, plan delivery,
// rebalancer). Plain data: no locking of its own; CoordinatorCore's mutex
// guards every Job.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/plan/plan_history.h"
#include "muond/v1/muond.pb.h"

namespace muond {

// One rank of a job: its Join, liveness, registration and latest timings.
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

// A job's rendezvous keys (KvStore keeps the totals over every job).
struct JobKv {
  std::map<std::string, std::string> entries;
  // Bytes of keys plus values in `entries`.
  int64_t bytes = 0;
};

struct Job {
  std::string id;
  int world_size = 0;
  std::string token;
  std::map<int, Daemon> daemons;
  JobKv kv;
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
  // Refused registration rounds so far and the latest one's reason: pushed
  // to every plan stream (WaitForWatcher), so every rank's trainer stops
  // with the reason instead of waiting for a plan.
  int64_t refusals = 0;
  std::string refusal_reason;
  absl::StatusCode refusal_code = absl::StatusCode::kOk;
  // The communicator epoch (plan_delivery.h AdvanceCommEpoch): pushed to
  // every plan stream, so every daemon rebuilds its communicators after one
  // reported a failed collective.
  int64_t comm_epoch = 0;
};

// A rank is live while a plan stream of it is open, or within `join_grace`
// of a Join not yet followed by one.
inline bool Live(const Daemon& daemon, absl::Time now,
                 absl::Duration join_grace) {
  return daemon.streams > 0 ||
         (daemon.join_pending && now - daemon.joined_at < join_grace);
}

inline bool AnyLive(const Job& job, absl::Time now, absl::Duration join_grace) {
  for (const auto& [rank, d] : job.daemons) {
    if (Live(d, now, join_grace)) return true;
  }
  return false;
}

}  // namespace muond
