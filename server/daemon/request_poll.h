#pragma once
// When a step channel's thread looks for its trainer's next request by
// polling instead of sleeping on the futex. A trainer's steps come at a
// steady period (forward, backward, the step), and a thread that slept
// through the trainer's forward and backward takes ~0.05-0.2 ms to wake once
// the request is posted (bench/results/step_channel_cpu.md, "The request's
// leg"): polling from a little before the request is due takes that off
// every step, for at most 2 x `poll` of one core a step.
//
// The request is due the trainer's last turn (from an answer to its next
// request: its forward and backward) after the last answer. Counted from the
// answer, the daemon's own step time, which varies from step to step, does
// not move the window away from the request, as it did when the window was
// placed by the interval between the last two requests
// (bench/results/step_channel_cpu.md, last section).
#include <algorithm>
#include <chrono>
#include <optional>

namespace muond {

class RequestPoll {
 public:
  using Clock = std::chrono::steady_clock;
  struct Window {
    Clock::time_point from, until;
  };

  // The poll as it counts: <= 0 is none, more than kMaxPoll is kMaxPoll
  // (the wake-up it hides is a fraction of a millisecond; the cap keeps the
  // window's sums far from overflow and a gone trainer noticed soon). The
  // daemon's wait for a trainer's verdict polls as long.
  static constexpr Clock::duration kMaxPoll = std::chrono::milliseconds(100);
  static Clock::duration Capped(Clock::duration poll) {
    return std::clamp(poll, Clock::duration::zero(), kMaxPoll);
  }
  explicit RequestPoll(Clock::duration poll) : poll_(Capped(poll)) {}

  // A request was taken at `at`.
  void Arrived(Clock::time_point at);
  // The answer to the request taken last was posted at `at`.
  void Answered(Clock::time_point at) { answered_ = at; }
  // Where to poll for the next request: from `poll` before it is due (the
  // last answer plus the trainer's last turn) to `poll` after. None with
  // polling off, before a turn was measured (a request after an answer),
  // before the last request's answer (StepChannels::Serve answers every
  // request it takes unless the channel ends; kept for any other caller),
  // when requests come less than 2 x `poll` apart (steps that short are a
  // host daemon's, whose cores the poll would take from the step) or once
  // Spent() this turn.
  std::optional<Window> Next() const;
  // The window went by without a request: sleep until it comes (a pause in
  // the steps, such as an evaluation, costs one window, not one per slice).
  void Spent() { spent_ = true; }

 private:
  const Clock::duration poll_;
  std::optional<Clock::time_point> arrived_, answered_;
  Clock::duration interval_{0};          // between the last two requests
  std::optional<Clock::duration> turn_;  // the last answer -> request
  bool spent_ = false;
};

}  // namespace muond
