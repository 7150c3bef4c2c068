#pragma once
// The trainer's end of a step channel (docs/ARCHITECTURE.md "The step
// channel"; the layout: proto/step_channel_layout.h): StepRequests through a
// POSIX shm object this process creates, answered by a daemon thread that
// waits on it. A gRPC call after a step's worth of idling costs ~0.7-1.1 ms
// (both ends' threads wake); a futex round trip through shared memory
// ~0.01-0.1 ms (bench/results/step_channel_cpu.md). Client (client.h) opens
// one after Register and sends Step and RefuseStep through it; the same as
// the Python client's muond/step_channel.py.
//
// Linux only (futexes, open-file-description locks). A channel whose step's
// outcome is unknown (the deadline passed, the daemon died) is broken: a
// late answer must never be read as the next step's, so it is never used
// again. Not thread-safe: one step at a time (Client holds a mutex).
//
// Fork: a forked child's copy of the channel is unmapped and its descriptor
// closed at once (a pthread_atfork handler), without unlocking or telling
// the daemon: the parent's channel goes on, and the daemon still sees the
// parent's death. A fork waits for a channel being created or closed, so
// no child has a copy the handler does not know. The child must not use the
// parent's channel or Client.
#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "muond/v1/muond.pb.h"

namespace muond {

// Bytes of a channel's request and response areas.
struct StepChannelCapacities {
  uint32_t request = 0;
  uint32_t response = 0;
};

// Room for the steps of `groups` (as registered): every param's name (in an
// answer's skipped_nonfinite with its group's as "group/param"), every
// group's override, 64 KiB for the rest, and in
// the request a trainer refusal of `refusal_bytes`; whole pages in
// [kMinCapacity, kMaxCapacity]. Python's muond.step_channel.capacities.
StepChannelCapacities StepChannelCapacitiesFor(
    const std::vector<v1::ParamGroup>& groups, size_t refusal_bytes);

// InvalidArgument naming `field` unless `capacity` is a multiple of 4096 in
// [kMinCapacity, kMaxCapacity] (proto/step_channel_layout.h).
absl::Status CheckStepChannelCapacity(absl::string_view field,
                                      uint32_t capacity);

// A fresh shm object name, "/muond-<job>-<pid>-<tag>-<nonce>" (the job id's
// characters outside [A-Za-z0-9_.-] as '_'; tag: 8 random hex digits per
// process; nonce: 63 random bits), the form of Python's muond.shm.shm_name.
// Unpredictable, so another local user cannot create it first (the channel
// is created with O_EXCL and would be off).
std::string StepChannelShmName(absl::string_view job_id);

class StepChannel {
 public:
  // What became of a request given to Step.
  enum class Outcome {
    kAnswered,  // the daemon's answer: a StepResponse or its refusal
    kNotSent,   // nothing sent (too large, or the channel unusable): use gRPC
    kTooLarge,  // answered, but past the response area: resend over gRPC
                // (answers_kept(): the daemon returns that answer there)
    kFailed,    // the outcome is unknown or unreadable: the channel is broken
  };
  struct Reply {
    Outcome outcome = Outcome::kNotSent;
    // kAnswered: the StepResponse or the refusal (as FromGrpcStatus gives
    // it); kFailed: DeadlineExceeded, Unavailable (the daemon is gone) or
    // Internal (an answer that does not parse).
    absl::StatusOr<v1::StepResponse> answer = absl::UnknownError("not sent");
  };

  // Creates shm object `name` (O_EXCL, mode 0600) of the capacities' size
  // (reserved with posix_fallocate: a full /dev/shm fails here, not as a
  // SIGBUS later), maps it, writes the header and takes the trainer's lock.
  // The name stays linked: the caller unlinks it once the daemon has opened
  // it (or failed to). On failure nothing is left behind. Unavailable with
  // the errno text, AlreadyExists for a taken name.
  static absl::StatusOr<std::unique_ptr<StepChannel>> Create(
      const std::string& name, StepChannelCapacities capacities);
  // Close().
  ~StepChannel();
  StepChannel(const StepChannel&) = delete;
  StepChannel& operator=(const StepChannel&) = delete;

  // The daemon opened the channel (OpenStepChannel succeeded): Close tells
  // it, so its thread ends at once rather than when the lock is dropped.
  // `answers_kept`: its OpenStepChannelResponse.answers_kept.
  void MarkOpenedByDaemon(bool answers_kept) {
    opened_ = true;
    answers_kept_ = answers_kept;
  }
  // The daemon keeps an answer too large for the channel for the Step RPC
  // of the same request, which returns it as it was; else that RPC answers
  // from the daemon's record (replayed).
  bool answers_kept() const { return answers_kept_; }

  // Sends `request` and waits for the answer until `deadline`, checking
  // every 0.5 s that the daemon still holds its lock. Not sent when the
  // request is larger than the request area, or the daemon's end is gone
  // already (then the channel is unusable: a daemon restarted on the same
  // address gets the step over gRPC).
  Reply Step(const v1::StepRequest& request, absl::Time deadline);

  // Polls for the answer over the last `poll` before it is expected (when
  // the last step's wait ended) and as long after, instead of sleeping on
  // the futex, so that a trainer that slept through a GPU step is awake when
  // the answer comes (waking costs ~0.05-0.1 ms:
  // bench/results/step_channel_cpu.md). Up to 2 x `poll` of one core a step;
  // a step whose last wait was under 2 x `poll` does not poll. Zero (the
  // default): sleep throughout; more than kMaxAnswerPoll is kMaxAnswerPoll
  // (as the Python client's MAX_ANSWER_POLL_S).
  static constexpr absl::Duration kMaxAnswerPoll = absl::Milliseconds(100);
  void set_answer_poll(absl::Duration poll) {
    answer_poll_ =
        std::clamp(poll, absl::ZeroDuration(), absl::Duration(kMaxAnswerPoll));
  }
  // Polls for an answer run so far (set_answer_poll).
  int64_t answer_polls() const { return answer_polls_; }

  // Step may send: not broken, the daemon's end not seen gone, not a forked
  // child's copy.
  bool usable() const;
  // Why not usable(), for the client's StepChannelStatus().
  std::string WhyUnusable() const;

  // Sends the close op (unless broken or never opened), unmaps, unlocks and
  // closes the descriptor. Idempotent.
  void Close();

 private:
  StepChannel(int fd, StepChannelCapacities capacities);
  absl::Status MapAndLock();
  uint32_t* Word(uint64_t offset) const;
  void Post(uint32_t op, uint32_t length);
  absl::Status AwaitAnswer(absl::Time deadline);
  // Looks at response_seq until the answer is there or `until`, yielding
  // the core between looks.
  void PollAnswer(absl::Time until) const;
  bool DaemonGone() const;
  Reply ReadAnswer() const;
  // Unmaps and closes; the trainer's lock dropped when `unlock` (not in a
  // forked child: it shares the parent's open file description, so its
  // lock).
  void Release(bool unlock);
  static void ForgetAllInForkedChild();
  // pthread_atfork's handlers, once per process.
  static void InstallForkHandler();

  int fd_;
  char* base_ = nullptr;  // the whole object, mapped
  const StepChannelCapacities capacities_;
  const size_t size_;
  const pid_t pid_;      // the process that created it
  uint32_t seq_ = 0;     // the last request_seq posted
  bool opened_ = false;  // the daemon has it
  bool answers_kept_ = false;
  bool broken_ = false;    // a step's outcome is unknown
  std::string broken_by_;  // what made it unknown
  bool end_gone_ = false;  // the daemon's lock was gone before a step
  absl::Duration answer_poll_ = absl::ZeroDuration();
  absl::Duration last_wait_ = absl::ZeroDuration();  // the last step's wait
  int64_t answer_polls_ = 0;
};

}  // namespace muond
