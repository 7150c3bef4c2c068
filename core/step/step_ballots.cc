// This rank's ballot on a step (every local check, the domain agreements)
// and the job-wide vote, with the abandonment of a step a rank never joined.
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/step/domain_agreement.h"
#include "core/step/gather_job_ballots.h"
#include "core/step/layer_sharded_muon_impl.h"
#include "core/step/step_failures.h"

namespace muond {
namespace {

// The code the daemon recorded with its refusal (StepInputs::refusal), kOther
// where it gave none.
RefusalCode RecordedRefusalCode(const StepInputs& inputs) {
  return inputs.refusal_code == RefusalCode::kNone ? RefusalCode::kOther
                                                   : inputs.refusal_code;
}

}  // namespace

JobBallot LayerShardedMuonImpl::LocalBallot(const StepInputs& inputs,
                                            StepResult& result,
                                            std::vector<std::string>& bad,
                                            absl::Status& refusal) {
  JobBallot mine{.kind = BallotKind::kStep, .step_id = inputs.step_id};
  if (inputs.replay) return ReplayBallot(inputs, result, refusal);
  auto refuse = [&](absl::Status st, RefusalCode code) {
    if (st.ok() || !refusal.ok()) return;
    refusal = std::move(st);
    mine.verdict = JobVerdict::kRefuse;
    mine.code = code;
  };
  refuse(inputs.refusal, RecordedRefusalCode(inputs));
  refuse(CheckStepOverrides(inputs.overrides, group_algorithms_),
         RefusalCode::kOverrides);
  refuse(CheckSkipParams(inputs.skip_params,
                         [&](const std::string& name) {
                           return param_names_.contains(name);
                         }),
         RefusalCode::kSkipParams);
  // Always run: the domain agreements are collectives of their own. The grads
  // are not read where memory changed or the trainer refused (it copied none).
  // Where nothing was refused so far, a group's momentum phase runs in its
  // agreement, reading the grads once for both.
  const bool read_grads = inputs.refusal_code != RefusalCode::kMemory &&
                          inputs.refusal_code != RefusalCode::kTrainer;
  absl::StatusOr<std::vector<std::string>> agreed = AgreeAcrossDomains(
      inputs, result, read_grads, /*momentum_now=*/read_grads && refusal.ok());
  if (!agreed.ok()) {
    refuse(agreed.status(), IsCommunicationFailure(agreed.status())
                                ? RefusalCode::kCommunication
                            : absl::IsFailedPrecondition(agreed.status())
                                ? RefusalCode::kPlanVersion
                            : IsReplicaGradsRefusal(agreed.status())
                                ? RefusalCode::kReplicaGradients
                            // The agreements' other InvalidArgument:
                            // CheckStepAgreed.
                            : absl::IsInvalidArgument(agreed.status())
                                ? RefusalCode::kDomainDisagreement
                                : RefusalCode::kOther);
    return mine;
  }
  bad = *std::move(agreed);
  if (bad.empty() || !refusal.ok()) return mine;
  if (options_.skip_nonfinite) {
    mine.verdict = JobVerdict::kSkip;
  } else {
    refuse(NonFiniteError(bad), RefusalCode::kNonFinite);
  }
  return mine;
}

JobBallot LayerShardedMuonImpl::ReplayBallot(const StepInputs& inputs,
                                             StepResult& result,
                                             absl::Status& refusal) {
  JobBallot mine{.kind = BallotKind::kStep,
                 .step_id = inputs.step_id,
                 .verdict = JobVerdict::kReplay};
  // Only for the collectives: peers that do step this id wait in the domain
  // agreements for this rank. No grad is read (nothing is stepped here).
  absl::StatusOr<std::vector<std::string>> agreed =
      AgreeAcrossDomains(inputs, result, /*read_grads=*/false);
  if (!agreed.ok() && IsCommunicationFailure(agreed.status())) {
    refusal = agreed.status();
    mine.verdict = JobVerdict::kRefuse;
    mine.code = RefusalCode::kCommunication;
  } else if (!inputs.refusal.ok()) {
    // The daemon's refusal of the replay (its trainer refused it): every
    // rank fails it, none answers it from its record.
    refusal = inputs.refusal;
    mine.verdict = JobVerdict::kRefuse;
    mine.code = RecordedRefusalCode(inputs);
  }
  return mine;
}

absl::StatusOr<JobDecision> LayerShardedMuonImpl::VoteOnJob(
    const JobBallot& mine) {
  const absl::Time asked = absl::Now();
  absl::StatusOr<std::vector<JobBallot>> ballots =
      GatherJobBallots(options_.job, mine);
  if (absl::IsDeadlineExceeded(ballots.status())) {
    return AbandonStep(DidNotJoin(
        ballots.status(), MissingPeer(*options_.job, "the job"), mine.step_id,
        mine.kind == BallotKind::kCommit
            ? "the commit vote, after the exchanges"
            : "the job vote",
        absl::Now() - asked));
  }
  if (!ballots.ok()) return ballots.status();
  return FoldJobBallots(*ballots);
}

absl::Status LayerShardedMuonImpl::AbandonStep(absl::Status timeout) {
  abandoned_ = timeout;
  if (options_.job != nullptr) options_.job->Abort();
  for (GroupState& group : groups_) {
    const DomainBinding& d = group.config.domain;
    for (Communicator* comm : {d.gtp, d.tp, d.dp}) {
      if (comm != nullptr) comm->Abort();
    }
  }
  return timeout;
}

}  // namespace muond
