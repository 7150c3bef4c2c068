#pragma once
// The job-wide vote on a step, as pure functions over the ballots the ranks
// gather (no communicator: gather_job_ballots.h carries them).
//
// Why: a group's domain agreement (domain_agreement.h) only spans the ranks
// of that domain. A refusal that only one rank sees (a bad override, a step
// id out of sequence, non-finite gradients in a group only it holds, e.g. the
// `<group>.solo-r<rank>` groups of muond.torch.Muon) must reach every rank of
// the job before anything changes, or its peers wait in their exchanges for
// the communicator timeout and the job's step ids split. So every rank brings
// one ballot per step to one all_gather over the job communicator (all
// world_size daemons) and folds the same ballots the same way: every rank
// reaches the same decision (step, skip or refuse).
//
// The same ballot carries the commit vote ("my exchanges succeeded") after
// the exchanges and before anything is written (layer_sharded_muon.cc).
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace muond {

// What one rank says about the step.
enum class JobVerdict : uint32_t {
  kAgree = 0,   // I can step
  kSkip = 1,    // non-finite gradients with skip_nonfinite: skip it
  kRefuse = 2,  // I refuse it (code says why)
  // I already applied this step (it is my last step id): answer it from my
  // record. Only a job-wide replay is answered so; a replay on some ranks
  // and not others means their last step ids differ, and every rank refuses
  // at once instead of the others waiting for the replaying ones.
  kReplay = 3,
};

// Why a rank refused, small enough to travel in a ballot; the refusing rank
// keeps its full message, its peers name the rank and this code.
enum class RefusalCode : uint32_t {
  kNone = 0,
  kOverrides = 1,      // a step override out of range or naming no group
  kStepId = 2,         // the step id out of sequence or out of range
  kNonFinite = 3,      // non-finite gradients (without skip_nonfinite)
  kPlanVersion = 4,    // a plan version this rank does not hold
  kMemory = 5,         // registered memory changed (unmapped, shrunk)
  kCommunication = 6,  // this rank's communicators failed (a peer is gone)
  kOther = 7,
  kSkipParams = 8,          // a skip_params name this rank does not hold
  kDomainDisagreement = 9,  // a domain's ranks skip or step differently
  kNonFiniteUpdate = 10,    // non-finite NS output (custom coefficients)
  kReplicaGradients = 11,   // a domain's DP replicas hold different grads
  kTrainer = 12,            // the rank's trainer refused (its own checks)
  // The rank's trainer withdrew a step it sent before its checks
  // (StepRequest.await_trainer_verdict).
  kTrainerWithdrew = 13,
};

// The phase the ballot votes on: a step's start or its commit.
enum class BallotKind : uint32_t { kStep = 1, kCommit = 2 };

struct JobBallot {
  BallotKind kind = BallotKind::kStep;
  int64_t step_id = 0;
  JobVerdict verdict = JobVerdict::kAgree;
  RefusalCode code = RefusalCode::kNone;

  bool operator==(const JobBallot&) const = default;
};

// A ballot travels as kJobBallotWords 32-bit words: [kind, step_id low 32
// bits, step_id high 32 bits, verdict, code]. The all_gather only moves bytes
// (no arithmetic), so the step id travels exactly.
inline constexpr int kJobBallotWords = 5;
std::array<uint32_t, kJobBallotWords> EncodeJobBallot(const JobBallot& ballot);
JobBallot DecodeJobBallot(absl::Span<const uint32_t> words);

// A refusing rank and its code.
struct Refusal {
  int rank = 0;
  RefusalCode code = RefusalCode::kNone;
  bool operator==(const Refusal&) const = default;
};

// What the job decided, the same on every rank.
struct JobDecision {
  JobVerdict verdict = JobVerdict::kAgree;
  int world_size = 0;  // the number of ballots folded
  // kRefuse: the ranks that refused (rank order) ...
  std::vector<Refusal> refusals;
  // ... or, when empty, the ranks' step ids or kinds differ: each rank's.
  std::vector<int64_t> step_ids;
  // kSkip: the ranks that asked to skip (rank order).
  std::vector<int> skipping_ranks;
  // The ranks that voted kReplay (rank order); when the decision is kRefuse
  // with some but not all ranks here, that mix is (one of) the reasons.
  std::vector<int> replaying_ranks;

  bool operator==(const JobDecision&) const = default;
};

// Folds the ballots of every rank (index = rank): any refusal -> every rank
// refuses; ballots of different kinds or step ids -> every rank refuses
// (they are not voting on the same thing); some ranks replaying and others
// not -> every rank refuses (code kStepId: their last step ids differ);
// every rank replaying -> every rank replays; else any skip -> every rank
// skips; else step.
JobDecision FoldJobBallots(absl::Span<const JobBallot> ballots);

// "refused by rank 1 (non-finite gradients), rank 3 (a step override)",
// "the ranks voted on different steps (rank 0: 12, rank 1: 13)" and/or
// "ranks 1, 2, 3 had already applied this step ... and rank 0 had not",
// joined by "; ", for messages.
std::string DescribeRefusals(const JobDecision& decision);
std::string RefusalCodeName(RefusalCode code);

// The status a rank answers a refused step with when it did not refuse it
// itself: the first refuser's canonical code (InvalidArgument for overrides
// and non-finite gradients, FailedPrecondition for step ids, plans, memory
// and anything else, Unavailable for a peer's communication failure), the
// message naming every refuser and that nothing was applied. When a trainer
// refused (RefusalCode::kTrainer) and no rank's communication failed:
// FailedPrecondition with ErrorReason kTrainerRefused, metadata {"ranks":
// the job ranks (daemons) whose trainers refused}. Otherwise, where some
// ranks refused: ErrorReason kRefusedByPeer, metadata {"ranks": them}.
absl::Status RefusedByPeers(const JobDecision& decision, int64_t step_id);

// ABORTED with ErrorReason kStepWithdrawn (metadata {"ranks": them}) when
// a refusal in `decision` is a trainer's withdrawal and none a trainer's own
// refusal (that trainer sends no step again) or a failed communicator:
// every rank sends the step again, whatever else was refused (it may come
// from memory the withdrawing trainer was about to change). OK otherwise.
absl::Status WithdrawnByPeers(const JobDecision& decision, int64_t step_id);

// This rank's own answer to a step its trainer withdrew (`why`: the
// verdict it gave, or why none came): ABORTED with ErrorReason
// kStepWithdrawn, metadata {"ranks": `rank`}.
absl::Status WithdrawnHere(int64_t step_id, int rank, const std::string& why);

}  // namespace muond
