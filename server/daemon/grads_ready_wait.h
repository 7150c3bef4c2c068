#pragma once
// Waiting on the host for a trainer's grads-ready event
// (RegisterParamsRequest.grads_ready_event) before a step reads its grads.
//
// The wait is the daemon's host thread polling the event, never a stream of
// the daemon waiting on it: a trainer that dies, or whose GPU work faults,
// before its record runs leaves the event incomplete for good, and a stream
// waiting on it would block every later call of the daemon (its host
// synchronisations, its teardown) for good. Polled, the step is refused
// instead once the trainer is gone or the timeout passes.
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/daemon/memory_mapper.h"

namespace muond {

struct GradsReadyWaitOptions {
  // The longest wait (muond-daemon: half --comm_timeout_s, so that the
  // refusal reaches the job's other ranks before their communicators time
  // out).
  absl::Duration timeout = absl::Seconds(30);
  // Polled back to back (yielding the core) this long, then every `nap`:
  // backward's tail usually ends within the first; a longer one costs a
  // wake-up of at most `nap` after the event completes.
  absl::Duration spin = absl::Milliseconds(2);
  absl::Duration nap = absl::Microseconds(50);
  // How often `trainer_gone` is asked (a step channel's answers with a
  // system call).
  absl::Duration gone_every = absl::Milliseconds(1);
};

// OK once `event` completed. FailedPrecondition naming step `step_id`, the
// event and why when the trainer is gone first (`trainer_gone`, may be
// empty), when `options.timeout` passes, or when the event cannot be
// queried: the step must then read no grad.
absl::Status AwaitGradsReady(const ImportedEvent& event, int64_t step_id,
                             const std::function<bool()>& trainer_gone,
                             const GradsReadyWaitOptions& options);

}  // namespace muond
