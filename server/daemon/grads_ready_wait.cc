#include "server/daemon/grads_ready_wait.h"

#include <sched.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace muond {

absl::Status AwaitGradsReady(const ImportedEvent& event, int64_t step_id,
                             const std::function<bool()>& trainer_gone,
                             const GradsReadyWaitOptions& options) {
  const absl::Time start = absl::Now();
  absl::Time next_gone_check = start;
  auto refused = [&](const std::string& why) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_id, ": the trainer's grads-ready event (",
                     "RegisterParamsRequest.grads_ready_event) ", why,
                     "; no grad was read and nothing applied"));
  };
  while (true) {
    absl::StatusOr<bool> done = event.Done();
    if (!done.ok()) {
      return refused(
          absl::StrCat("cannot be queried: ", done.status().message()));
    }
    if (*done) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (trainer_gone && now >= next_gone_check) {
      if (trainer_gone()) {
        return refused(
            "never completed: its trainer ended first (its GPU work before "
            "the record never ran)");
      }
      next_gone_check = now + options.gone_every;
    }
    if (now - start >= options.timeout) {
      return refused(absl::StrCat(
          "did not complete within ", absl::FormatDuration(options.timeout),
          " (the trainer's GPU work failed or hangs?)"));
    }
    if (now - start < options.spin) {
      sched_yield();
    } else {
      absl::SleepFor(options.nap);
    }
  }
}

}  // namespace muond
