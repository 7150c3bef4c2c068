#pragma once
// PhaseClock: a step's phase times without a host wait after each phase.
//
// A wait after each phase left the device idle while the host issued the
// next phase's work (~0.2 ms a wait on an H100, several a step). Instead,
// on a backend with time marks (Backend::TimeMark: CUDA events), each phase
// is bracketed by two marks in the backend's queue and nothing waits; Finish,
// at the step's end, waits for every backend the phases ran on once and adds
// each phase's device time to its PhaseTimings field. On a backend without
// marks (the CPU backend, whose calls return with their work done) a phase
// is timed by the wall clock after a Synchronize.
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/backend/backend.h"
#include "core/step/step_result.h"

namespace muond {

class PhaseClock {
 public:
  // A PhaseTimings field a phase's time adds to.
  using Field = double PhaseTimings::*;

  // Forgets the last step's phases (and lets their backends reuse the marks).
  void Start();

  // Runs `phase` (work issued on `backend`) under the trace range `name`; its
  // time adds to `field` at Finish. A failed phase is not timed.
  template <typename Fn>
  absl::Status Time(Backend& backend, const char* name, Field field,
                    Fn&& phase) {
    backend.PushRange(name);
    const Stamp from = StampBefore(backend);
    absl::Status status = phase();
    if (status.ok()) status = Add(backend, from, field);
    backend.PopRange();
    return status;
  }

  // Waits for the work of every backend a phase ran on, then adds each
  // phase's time to `into`. Fails only where the wait does (a time that
  // cannot be read leaves its phase untimed: the step's work is done).
  absl::Status Finish(PhaseTimings& into);

  // Waits for the work of every backend a phase ran on, for a step that ends
  // before Finish: nothing it issued is still running when it returns.
  absl::Status Drain();

 private:
  // A phase's start: its backend's time mark, or (mark < 0) the wall clock
  // where the backend has none.
  struct Stamp {
    int mark = -1;
    absl::Time wall;
  };
  // A timed phase: between two marks of `backend` (read at Finish), or
  // (from < 0) `wall_us` of wall time.
  struct Span {
    Backend* backend;
    int from = -1, to = -1;
    double wall_us = 0;
    Field field;
  };

  Stamp StampBefore(Backend& backend);
  absl::Status Add(Backend& backend, Stamp from, Field field);
  absl::Status WaitForBackends();

  std::vector<Span> spans_;
  // The backends that gave a mark this step: Finish and Drain wait for
  // them, Start clears their marks.
  std::vector<Backend*> marked_;
};

}  // namespace muond
