#pragma once
// One step's messages as DaemonCore handles them: the StepRequest checked
// against the registration before the engine runs it (the step id rule, the
// overrides, the skip_params), each failure a refusal the engine votes on
// with the whole job (core/step/job_vote.h) so the messages reach every rank;
// then the StepResponse and the coordinator's timings report of a step that
// ran.
#include <cstdint>
#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "core/step/layer_sharded_muon.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/registration.h"

namespace muond {

// The step id rules for a step that is not a replay: id in [0, max_step_id]
// (InvalidArgument) and, after a step, the last id + 1 (FailedPrecondition
// naming both ids).
absl::Status CheckStepId(int64_t id, std::optional<int64_t> last_step_id,
                         int64_t max_step_id);

// The request's overrides, checked: InvalidArgument for a GroupOverride of a
// group the registration does not hold, or a group named twice; then the
// engine's value rules (CheckStepOverrides).
absl::StatusOr<StepOverrides> ParseOverrides(const v1::StepRequest& request,
                                             const Registration& registration);

// The request's skip_params; InvalidArgument naming a name the registration
// does not hold (CheckSkipParams).
absl::StatusOr<std::set<std::string>> ParseSkipParams(
    const v1::StepRequest& request, const Registration& registration);

// Records `st` as the step's refusal under `code` unless it is OK or a
// refusal is recorded already (the first one is what the job votes on).
void Refuse(StepInputs& inputs, absl::Status st, RefusalCode code);

// The step's refusal by its trainer (StepRequest.trainer_refusal, echoed
// bounded), FailedPrecondition; OK when the request carries none. Checked on
// a replay too: a refused replay must fail on every rank, or the ranks whose
// trainers did not refuse advance their step id and the refusing one does
// not (their ids never meet again).
absl::Status TrainerRefusal(const v1::StepRequest& request);

// This rank's checks of a step that is not a replay, as refusals in `inputs`
// instead of early returns, so the peers refuse the step at once too instead
// of waiting for this rank in their exchanges. In order: the registered
// memory (first: a shrunk shm object would SIGBUS the step, and only a
// kMemory refusal keeps the engine from reading the grads), the trainer's
// own refusal (StepRequest.trainer_refusal), the step id, the overrides, the
// skip_params; the valid overrides and skip_params are set in `inputs`.
void CheckStepRequest(const v1::StepRequest& request,
                      const Registration& registration,
                      std::optional<int64_t> last_step_id, int64_t max_step_id,
                      StepInputs& inputs);

// The answer to step `step_id` that ran: its timings, the plan version its
// domains agreed on (a peer may not have the newest yet), the params skipped
// as non-finite.
v1::StepResponse StepResponseOf(int64_t step_id, const StepResult& result,
                                int64_t active_plan_version);

// The step's timings for the coordinator, with the measured NS time per
// full-matrix shape: the coordinator's rebalancing cost table (empty on
// unmeasured steps).
v1::ReportTimingsRequest TimingsReportOf(const std::string& job_id, int rank,
                                         const v1::StepResponse& response,
                                         const StepResult& result);

// The daemon's periodic log line of a step: its phase times and the plan
// version it ran under.
std::string StepLogLine(int64_t step_id, const PhaseTimings& timings,
                        int64_t plan_version);

// A step whose collectives failed, as DaemonCore reports it: `health`, what
// Health says from now on (the communicators are unusable), and `status`,
// the step's UNAVAILABLE answer with ErrorReason PEER_GONE. Both name the
// peers (`peers`, the coordinator's view; empty when unknown) and say what to
// do: with `healing` (the coordinator heard of it) the daemons rebuild
// their communicators and the trainer sends the step again; without, the
// trainers re-register. A timeout (DEADLINE_EXCEEDED) is a hung or stopped
// peer, which may still be alive: said so instead of calling it gone.
struct PeerFailure {
  std::string health;
  absl::Status status;
};
PeerFailure DescribePeerFailure(int64_t step_id, const absl::Status& st,
                                const std::string& peers, bool healing);

}  // namespace muond
