#pragma once
// Plan delivery: what GetPlan answers and what each plan stream sends next.
// A watcher gets every version after the one it holds, oldest first (a
// daemon that skipped one could be asked for it by its domain); a daemon's
// stream also gets each refused registration round, before the next plan.
// Pure reads of a Job: CoordinatorCore holds its mutex and does the waiting.
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
// refusals has something to send.
bool WatcherHasNews(const Job& job, int64_t after_version,
                    int64_t refusals_seen);

// What that stream sends next (requires WatcherHasNews): the latest refusal
// as a Plan with only job_id, round_refused and this rank's
// refused_registration (advancing *refusals_seen), else the oldest plan
// newer than `after_version` (after_version 0: the newest).
v1::Plan TakeWatcherNews(const Job& job, int rank, int64_t after_version,
                         int64_t* refusals_seen);

}  // namespace muond
