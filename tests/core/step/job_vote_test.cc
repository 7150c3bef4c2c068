// The job vote's fold (core/step/job_vote.h): every rank folds the same
// gathered ballots to the same decision.
#include "core/step/job_vote.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/match.h"
#include "core/common/error_reason.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

JobBallot Agree(int64_t id) { return {.step_id = id}; }
JobBallot Skip(int64_t id) {
  return {.step_id = id, .verdict = JobVerdict::kSkip};
}
JobBallot Replay(int64_t id) {
  return {.step_id = id, .verdict = JobVerdict::kReplay};
}
JobBallot Refuse(int64_t id, RefusalCode code) {
  return {.step_id = id, .verdict = JobVerdict::kRefuse, .code = code};
}

TEST(JobVoteTest, BallotsTravelExactly) {
  for (int64_t id : {int64_t{0}, int64_t{1}, int64_t{12}, int64_t{1} << 40,
                     (int64_t{1} << 62) + 3,
                     std::numeric_limits<int64_t>::max(), int64_t{-1}}) {
    for (const JobBallot& b :
         {Agree(id), Skip(id), Replay(id), Refuse(id, RefusalCode::kMemory),
          JobBallot{.kind = BallotKind::kCommit, .step_id = id}}) {
      const auto words = EncodeJobBallot(b);
      EXPECT_EQ(DecodeJobBallot(words), b) << id;
    }
  }
}

TEST(JobVoteTest, AllAgreeSteps) {
  const std::vector<JobBallot> b = {Agree(7), Agree(7), Agree(7)};
  EXPECT_EQ(FoldJobBallots(b).verdict, JobVerdict::kAgree);
  EXPECT_EQ(FoldJobBallots({Agree(7)}).verdict, JobVerdict::kAgree);
}

TEST(JobVoteTest, AnySkipSkipsEveryRank) {
  const std::vector<JobBallot> b = {Agree(3), Skip(3), Agree(3), Skip(3)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kSkip);
  EXPECT_EQ(d.skipping_ranks, (std::vector<int>{1, 3}));
}

TEST(JobVoteTest, AnyRefusalRefusesEveryRankAndBeatsSkip) {
  const std::vector<JobBallot> b = {
      Skip(12), Refuse(12, RefusalCode::kNonFinite), Agree(12),
      Refuse(12, RefusalCode::kOverrides)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kRefuse);
  EXPECT_EQ(d.refusals, (std::vector<Refusal>{{1, RefusalCode::kNonFinite},
                                              {3, RefusalCode::kOverrides}}));
  EXPECT_TRUE(d.skipping_ranks.empty());
  const absl::Status st = RefusedByPeers(d, 12);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "step 12 refused on every rank"))
      << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "rank 1 (non-finite gradients)"))
      << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "rank 3 (a step override)"))
      << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "nothing was applied")) << st;
  // The refusers' own answers have the details: a client raises theirs.
  EXPECT_TRUE(HasErrorReason(st, ErrorReason::kRefusedByPeer)) << st;
  EXPECT_EQ(GetErrorMetadata(st), (ErrorMetadata{{"ranks", "1,3"}}));
}

TEST(JobVoteTest, DifferentStepIdsRefuseNamingThem) {
  const std::vector<JobBallot> b = {Agree(12), Agree(13)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kRefuse);
  EXPECT_EQ(d.step_ids, (std::vector<int64_t>{12, 13}));
  const absl::Status st = RefusedByPeers(d, 12);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "rank 0: 12, rank 1: 13")) << st;
}

TEST(JobVoteTest, DifferentKindsRefuse) {
  const std::vector<JobBallot> b = {
      Agree(4), JobBallot{.kind = BallotKind::kCommit, .step_id = 4}};
  EXPECT_EQ(FoldJobBallots(b).verdict, JobVerdict::kRefuse);
}

TEST(JobVoteTest, PeerCommunicationFailureIsUnavailable) {
  const std::vector<JobBallot> b = {Agree(5),
                                    Refuse(5, RefusalCode::kCommunication)};
  EXPECT_EQ(RefusedByPeers(FoldJobBallots(b), 5).code(),
            absl::StatusCode::kUnavailable);
}

TEST(JobVoteTest, EveryRankReplayingReplays) {
  const std::vector<JobBallot> b = {Replay(5), Replay(5), Replay(5)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kReplay);
  EXPECT_EQ(d.replaying_ranks, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(FoldJobBallots({Replay(5)}).verdict, JobVerdict::kReplay);
}

// Last step ids [4, 5, 5, 5], Step 5: rank 0 would step, the others replay.
TEST(JobVoteTest, ReplayMixedWithAStepRefusesNamingWhoAppliedIt) {
  const std::vector<JobBallot> b = {Agree(5), Replay(5), Replay(5), Replay(5)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kRefuse);
  EXPECT_TRUE(d.refusals.empty());
  EXPECT_TRUE(d.step_ids.empty());
  const absl::Status st = RefusedByPeers(d, 5);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(),
                                "ranks 1, 2, 3 had already applied this step"))
      << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "and rank 0 had not")) << st;
}

// Last step ids [3, 5, 5, 5], Step 5: rank 0 refuses the gap.
TEST(JobVoteTest, ReplayMixedWithARefusalNamesBoth) {
  const std::vector<JobBallot> b = {Refuse(5, RefusalCode::kStepId), Replay(5),
                                    Replay(5), Replay(5)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kRefuse);
  const absl::Status st = RefusedByPeers(d, 5);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(st.message(), "rank 0 (the step id)")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "and rank 0 had not")) << st;
}

// Last step ids [5, 5, 5], Step 5 again and rank 1's trainer refuses it:
// every rank refuses naming rank 1's trainer, and rank 1 is not said to
// have missed step 5 (its daemon applied it; its trainer refused the retry).
TEST(JobVoteTest, ReplayRefusedByATrainerNamesOnlyTheTrainer) {
  const std::vector<JobBallot> b = {Replay(5), Refuse(5, RefusalCode::kTrainer),
                                    Replay(5)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kRefuse);
  const absl::Status st = RefusedByPeers(d, 5);
  EXPECT_TRUE(absl::StrContains(st.message(), "rank 1 (its trainer's own"))
      << st;
  EXPECT_FALSE(absl::StrContains(st.message(), "had not")) << st;
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(GetErrorReason(st), ErrorReason::kTrainerRefused) << st;
  EXPECT_EQ(GetErrorMetadata(st), (ErrorMetadata{{"ranks", "1"}}));
}

// A trainer's withdrawal is ABORTED with STEP_WITHDRAWN on every rank,
// naming the withdrawing ranks, whatever else was refused (a skip-list
// disagreement, non-finite gradients: they may come from memory that trainer
// was about to change); a failed communicator or a peer trainer's refusal
// outranks it; without one, nothing is said.
TEST(JobVoteTest, WithdrawalsOutrankRefusalsButNotCommunication) {
  JobDecision d =
      FoldJobBallots({Refuse(4, RefusalCode::kDomainDisagreement),
                      Refuse(4, RefusalCode::kTrainerWithdrew), Skip(4),
                      Refuse(4, RefusalCode::kTrainerWithdrew)});
  absl::Status st = WithdrawnByPeers(d, 4);
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_EQ(GetErrorReason(st), ErrorReason::kStepWithdrawn) << st;
  EXPECT_EQ(GetErrorMetadata(st), (ErrorMetadata{{"ranks", "1,3"}}));
  EXPECT_TRUE(absl::StrContains(st.message(), "rank 1 (its trainer withdrew"))
      << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "send the same step again"))
      << st;
  d = FoldJobBallots({Refuse(4, RefusalCode::kCommunication),
                      Refuse(4, RefusalCode::kTrainerWithdrew), Agree(4)});
  EXPECT_TRUE(WithdrawnByPeers(d, 4).ok());
  // A peer trainer's refusal outranks it too: that trainer sends no step
  // again, so every rank answers TRAINER_REFUSED.
  d = FoldJobBallots({Refuse(4, RefusalCode::kTrainerWithdrew),
                      Refuse(4, RefusalCode::kTrainer)});
  EXPECT_TRUE(WithdrawnByPeers(d, 4).ok());
  EXPECT_EQ(GetErrorReason(RefusedByPeers(d, 4)), ErrorReason::kTrainerRefused);
  d = FoldJobBallots({Refuse(4, RefusalCode::kNonFinite), Agree(4)});
  EXPECT_TRUE(WithdrawnByPeers(d, 4).ok());
  st = WithdrawnHere(4, 2, "its trainer ended before its verdict");
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_EQ(GetErrorReason(st), ErrorReason::kStepWithdrawn) << st;
  EXPECT_EQ(GetErrorMetadata(st), (ErrorMetadata{{"ranks", "2"}}));
  EXPECT_TRUE(absl::StrContains(st.message(), "ended before its verdict"))
      << st;
}

// A trainer's refusal among other refusals: the reason names every refusing
// trainer's rank, whatever refused first; without one there is no reason.
TEST(JobVoteTest, TrainerRefusalsCarryTheirReasonAndRanks) {
  JobDecision d = FoldJobBallots({Refuse(3, RefusalCode::kOverrides),
                                  Refuse(3, RefusalCode::kTrainer), Agree(3),
                                  Refuse(3, RefusalCode::kTrainer)});
  absl::Status st = RefusedByPeers(d, 3);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_EQ(GetErrorReason(st), ErrorReason::kTrainerRefused) << st;
  EXPECT_EQ(GetErrorMetadata(st), (ErrorMetadata{{"ranks", "1,3"}}));
  d = FoldJobBallots({Refuse(3, RefusalCode::kTrainer),
                      Refuse(3, RefusalCode::kCommunication), Agree(3)});
  st = RefusedByPeers(d, 3);  // a peer gone outranks the trainer
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ(GetErrorReason(st), ErrorReason::kUnspecified) << st;
  d = FoldJobBallots({Refuse(3, RefusalCode::kOverrides), Agree(3)});
  st = RefusedByPeers(d, 3);  // a daemon's own refusal: its answer has it
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(GetErrorReason(st), ErrorReason::kRefusedByPeer) << st;
  EXPECT_EQ(GetErrorMetadata(st), (ErrorMetadata{{"ranks", "0"}}));
}

TEST(JobVoteTest, ReplayMixedWithASkipRefuses) {
  const std::vector<JobBallot> b = {Replay(2), Skip(2)};
  const JobDecision d = FoldJobBallots(b);
  EXPECT_EQ(d.verdict, JobVerdict::kRefuse);
  EXPECT_TRUE(absl::StrContains(RefusedByPeers(d, 2).message(),
                                "rank 0 had already applied this step"));
}

}  // namespace
}  // namespace muond
