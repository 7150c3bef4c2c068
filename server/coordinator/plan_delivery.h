#pragma once
// Plan delivery: what GetPlan answers and what each plan stream sends next.
// A watcher gets every version after the one it holds, oldest first (a
// daemon that skipped one could be asked for it by its domain); a daemon's
// stream also gets each refused registration round, before the next plan.
// A daemon's stream also gets the job's communicator epoch whenever it
// moves (AdvanceCommEpoch, the one write here). CoordinatorCore holds the
// Job's mutex and does the waiting.
#include <cstdint>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/job.h"

namespace muond {

// The job's newest plan. NotFound (ErrorReason kNoPlanYet) when it has none.
absl::StatusOr<v1::Plan> NewestPlan(const Job& job);

// The refusals a new plan stream of `rank` counts as seen: those before the
// rank's Join (a refusal between the Join and the stream's first wait is
// this rank's news too); every refusal so far for a rank that never joined.
int64_t RefusalsBeforeStream(const Job& job, int rank);

// A plan stream holding plan `after_version` that has seen `refusals_seen`
// refusals and communicator epoch `epoch_seen` has something to send.
bool WatcherHasNews(const Job& job, int64_t after_version,
                    int64_t refusals_seen, int64_t epoch_seen);

// What that stream sends next (requires WatcherHasNews): the latest refusal
// as a Plan with only job_id, round_refused and this rank's
// refused_registration (advancing *refusals_seen), else a newer
// communicator epoch as a Plan with only job_id and comm_epoch (advancing
// *epoch_seen), else the oldest plan newer than
// `after_version` (after_version 0: the newest).
v1::Plan TakeWatcherNews(const Job& job, int rank, int64_t after_version,
                         int64_t* refusals_seen, int64_t* epoch_seen);

// A daemon's communicators of `failed_epoch` failed: the job moves to
// failed_epoch + 1 unless it is there or beyond already (the first report of
// an epoch moves it; the other ranks' reports of the same failure do not).
// A reported epoch above the job's is refused (a daemon reports only an
// epoch it was pushed, so a caller cannot jump the epoch to its top), except
// on a job still at epoch 0: a coordinator that restarted under running
// daemons, which moves above the report. Epochs stay below kMaxCommEpoch.
// Returns the job's epoch.
inline constexpr int64_t kMaxCommEpoch = (int64_t{1} << 48) - 1;
absl::StatusOr<int64_t> AdvanceCommEpoch(Job& job, int64_t failed_epoch);

}  // namespace muond
