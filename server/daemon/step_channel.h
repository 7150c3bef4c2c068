#pragma once
// Step channels: Step requests through a shared-memory object instead of a
// gRPC call. On one host a gRPC unary call costs ~0.25 ms back to back but
// ~0.7-1.1 ms after its threads slept for a step's length (both ends' gRPC
// threads wake through their pollers); a futex round trip ~0.01-0.1 ms
// (bench/results/step_channel_cpu.md). Each
// open channel has a thread that waits on the trainer's futex word, hands
// the request to the same handler as the Step RPC and writes the answer
// back (proto/step_channel_layout.h has the protocol).
//
// Bad input never reaches a mapping: the daemon reads and writes the object
// with pread/pwrite (a trainer that shrinks it ends its channel, it cannot
// SIGBUS the daemon) and maps only the header page, for the futex calls,
// which fail with EFAULT rather than fault on a shrunk object.
#include <sys/types.h>

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/memory_mapper.h"
#include "server/daemon/request_poll.h"

namespace muond {

struct StepChannelEnd;  // step_channel.cc

struct StepChannelOptions {
  // Channels open at once; OpenStepChannel beyond them is refused
  // (RESOURCE_EXHAUSTED). Each holds one descriptor and one thread. 0 turns
  // the channels off (FAILED_PRECONDITION: the trainer keeps using Step).
  int max_channels = 64;
  // The shm ownership rule, as for registered regions (memory_mapper.h).
  bool allow_foreign_shm = false;
  // How often an idle channel checks that its trainer still holds its lock
  // (and that the daemon is not shutting down).
  absl::Duration idle_check = absl::Milliseconds(500);
  // How long before its trainer's next request is due (the last answer plus
  // the trainer's last turn, answer to request) a channel's thread polls for
  // it instead of sleeping on the futex, and as long after (request_poll.h):
  // the wake-up after the trainer's forward and backward is then off the
  // step; also how long it looks for a trainer's verdict before it sleeps.
  // Zero: sleep throughout; at most RequestPoll::kMaxPoll (100 ms) counts
  // (muond-daemon --step_channel_request_poll_ms; host mode, whose step needs
  // the cores, does not poll).
  absl::Duration request_poll = absl::ZeroDuration();
  // At the limit, how long Open waits for an open channel to end before it
  // refuses: a trainer replacing its channel (a new registration) posts the
  // old one's close and opens the new one at once, before the old one's
  // thread has ended.
  absl::Duration slot_wait = absl::Seconds(1);
  // Starts a channel's thread (tests inject one that fails, as a pids or
  // thread limit does); null: std::thread.
  std::function<std::thread(std::function<void()>)> start_thread;
  // How long a step sent before its trainer's checks
  // (StepRequest.await_trainer_verdict) waits, before the job vote, for the
  // trainer's verdict before it is withdrawn. The daemon sets half its
  // --comm_timeout_s, so that the withdrawal reaches the job's other ranks
  // (waiting in the job vote) before their communicators time out.
  absl::Duration verdict_timeout = absl::Seconds(30);
  // Called with the number of open channels whenever it changes (the
  // daemon's muond_step_channels_open gauge), under StepChannels' mutex: it
  // must not call back into StepChannels. Null: none.
  std::function<void(int open)> open_changed;
};

// For a request with StepRequest.await_trainer_verdict: waits for its
// trainer's verdict; OK for go, else why the step is withdrawn.
using TrainerVerdict = std::function<absl::Status()>;

// The Step RPC's logic: the answer to one request, or its refusal. The
// channel passes the request's TrainerVerdict; the Step RPC an empty one.
using StepHandler = std::function<absl::StatusOr<v1::StepResponse>(
    const v1::StepRequest&, const TrainerVerdict&)>;

class StepChannels {
 public:
  StepChannels(StepHandler handler, StepChannelOptions options);
  // Shutdown(), then waits for every channel's thread (a step in flight
  // finishes first).
  ~StepChannels();
  StepChannels(const StepChannels&) = delete;
  StepChannels& operator=(const StepChannels&) = delete;

  // Opens the trainer's object `shm_name` and starts its thread.
  // InvalidArgument for a bad header (naming the field and the rule), the
  // shm errors of HandleOpener::OpenShmFile, ResourceExhausted past
  // max_channels or when the system refuses its thread, FailedPrecondition
  // when channels are off or shutting down.
  absl::StatusOr<v1::OpenStepChannelResponse> Open(
      const v1::OpenStepChannelRequest& request);

  // The answer a channel gave as too large for its response area
  // (kTooLarge) to the same request as `request`, once: its trainer sends
  // that request again over the Step RPC, which must return that answer as
  // it was (replayed or not), not run the step again (a replay would vote
  // with the job's other ranks, which are past it). Nullopt for any other
  // request. A channel keeps its last such answer until its next request.
  std::optional<absl::StatusOr<v1::StepResponse>> TakeKeptAnswer(
      const v1::StepRequest& request);

  // Channels stop taking requests; each thread ends after its current step.
  void Shutdown();

  // Channels whose thread still runs.
  int open_channels() const;
  // Requests a channel's thread found while polling for them
  // (StepChannelOptions::request_poll), not woken by the futex.
  int64_t requests_polled() const { return requests_polled_.load(); }

 private:
  // Channels are on, the daemon not stopping, a slot free.
  absl::Status CheckRoom();
  // A slot under max_channels once finished channels are reaped (at the
  // limit, after waiting up to options_.slot_wait for one to end).
  absl::Status SlotFree() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AnyEnded() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The channel's thread started and its entry listed, or why not.
  absl::Status StartServing(std::unique_ptr<StepChannelEnd> channel);
  void Serve(StepChannelEnd* channel);
  // Waits for the trainer's next request on `channel`: polls in the window
  // `poll` gives, else sleeps on the futex for a slice (ending where that
  // window starts). False once the trainer is gone.
  bool AwaitRequest(StepChannelEnd* channel, RequestPoll& poll);
  // The trainer's verdict on the request of `seq`
  // (proto/step_channel_layout.h).
  absl::Status AwaitVerdict(StepChannelEnd* channel, uint32_t seq);
  // `channel`'s kept answer: `answer` to `request`, or none (nullopt).
  void Keep(StepChannelEnd* channel, std::string request,
            std::optional<absl::StatusOr<v1::StepResponse>> answer);
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int OpenCount() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountChanged() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const StepHandler handler_;
  const StepChannelOptions options_;
  HandleOpener opener_;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> requests_polled_{0};
  mutable absl::Mutex mu_;
  std::list<std::unique_ptr<StepChannelEnd>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond
