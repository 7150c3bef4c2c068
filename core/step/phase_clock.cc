#include "core/step/phase_clock.h"

#include <algorithm>

#include "absl/time/clock.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"

namespace muond {

void PhaseClock::Start() {
  for (Backend* backend : marked_) backend->ClearTimeMarks();
  marked_.clear();
  spans_.clear();
}

PhaseClock::Stamp PhaseClock::StampBefore(Backend& backend) {
  const absl::StatusOr<int> mark = backend.TimeMark();
  if (!mark.ok()) return {.mark = -1, .wall = absl::Now()};
  if (std::find(marked_.begin(), marked_.end(), &backend) == marked_.end()) {
    marked_.push_back(&backend);
  }
  return {.mark = *mark, .wall = absl::Time()};
}

absl::Status PhaseClock::Add(Backend& backend, Stamp from, Field field) {
  if (from.mark >= 0) {
    const absl::StatusOr<int> to = backend.TimeMark();
    if (to.ok()) {
      spans_.push_back(
          {.backend = &backend, .from = from.mark, .to = *to, .field = field});
      return absl::OkStatus();
    }
    // Its end could not be marked: the phase goes untimed, waited for as
    // without marks.
    return backend.Synchronize();
  }
  // No marks: wait, so that the wall time is the phase's (free on the CPU
  // backend).
  RETURN_IF_ERROR(backend.Synchronize());
  spans_.push_back(
      {.backend = &backend,
       .wall_us = absl::ToDoubleMicroseconds(absl::Now() - from.wall),
       .field = field});
  return absl::OkStatus();
}

absl::Status PhaseClock::WaitForBackends() {
  absl::Status first;
  for (Backend* backend : marked_) first.Update(backend->Synchronize());
  return first;
}

absl::Status PhaseClock::Finish(PhaseTimings& into) {
  RETURN_IF_ERROR(WaitForBackends());
  for (const Span& s : spans_) {
    if (s.from < 0) {
      into.*s.field += s.wall_us;
      continue;
    }
    // The step's work is done: a time that cannot be read leaves its phase
    // untimed, it does not fail a step that was applied.
    const absl::StatusOr<double> us = s.backend->MarkedUs(s.from, s.to);
    if (us.ok()) {
      into.*s.field += *us;
    } else {
      LOG_FIRST_N(WARNING, 1)
          << "a phase's time could not be read: " << us.status();
    }
  }
  spans_.clear();
  return absl::OkStatus();
}

absl::Status PhaseClock::Drain() { return WaitForBackends(); }

}  // namespace muond
