// The per-step domain agreement decided from plain gathered values: no
// backend, no communicator. Each expectation is worked out by hand from the
// rule (finite only if all are; route by the oldest of the newest versions;
// refuse when that is older than the newest of the oldest held ones).
#include "core/step/domain_agreement.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

// The floats an all_gather of `votes` would deliver, in rank order.
std::vector<float> Gathered(const std::vector<DomainVote>& votes) {
  std::vector<float> out;
  for (const DomainVote& v : votes) {
    const auto f = EncodeDomainVote(v);
    out.insert(out.end(), f.begin(), f.end());
  }
  return out;
}

DomainVote Vote(bool finite, int64_t newest, int64_t oldest) {
  return {.all_finite = finite, .homes_version = newest, .oldest_held = oldest};
}

TEST(DomainVoteEncoding, VersionsUpTo2To48TravelExactly) {
  for (int64_t v : {int64_t(0), int64_t(1), (int64_t(1) << 24) - 1,
                    int64_t(1) << 24, (int64_t(1) << 24) + 1,
                    int64_t(123456789012345), kMaxDomainVoteVersion}) {
    const DomainVote vote = Vote(false, v, v / 3);
    const auto floats = EncodeDomainVote(vote);
    EXPECT_EQ(DecodeDomainVote(floats), vote) << v;
  }
  // The encoding itself: [finite, high, low, high, low] with 2^24 as base.
  const auto floats = EncodeDomainVote(Vote(true, (int64_t(5) << 24) + 7, 9));
  EXPECT_EQ(floats[0], 1.0f);
  EXPECT_EQ(floats[1], 5.0f);
  EXPECT_EQ(floats[2], 7.0f);
  EXPECT_EQ(floats[3], 0.0f);
  EXPECT_EQ(floats[4], 9.0f);
}

TEST(FoldDomainVotes, FiniteOnlyIfEveryRankIs) {
  const std::vector<DomainVote> votes = {Vote(true, 3, 1), Vote(false, 3, 1),
                                         Vote(true, 3, 1)};
  EXPECT_FALSE(FoldDomainVotes(votes[0], Gathered(votes)).all_finite);
  const std::vector<DomainVote> fine = {Vote(true, 3, 1), Vote(true, 3, 1)};
  EXPECT_TRUE(FoldDomainVotes(fine[0], Gathered(fine)).all_finite);
}

TEST(FoldDomainVotes, OldestNewestAndNewestOldest) {
  // Rank 1 is a plan behind; rank 2 dropped versions below 4.
  const std::vector<DomainVote> votes = {Vote(true, 9, 2), Vote(true, 8, 1),
                                         Vote(true, 11, 4)};
  const DomainVote agreed = FoldDomainVotes(votes[0], Gathered(votes));
  EXPECT_EQ(agreed, Vote(true, 8, 4));
}

TEST(FoldDomainVotes, EveryRankReachesTheSameDecision) {
  const std::vector<DomainVote> votes = {Vote(true, 5, 1), Vote(true, 7, 3),
                                         Vote(false, 6, 2), Vote(true, 5, 5)};
  const std::vector<float> gathered = Gathered(votes);
  for (const DomainVote& mine : votes) {
    EXPECT_EQ(FoldDomainVotes(mine, gathered), Vote(false, 5, 5));
  }
}

TEST(FoldDomainVotes, GtpThenTpCoversTheDomain) {
  // A 2 x 2 domain: votes[g][t]. Gather over gtp (fixed t), then over tp
  // carrying the gtp fold, as GatherDomainVotesOfGroups does.
  const DomainVote votes[2][2] = {{Vote(true, 10, 3), Vote(true, 12, 6)},
                                  {Vote(true, 9, 2), Vote(true, 14, 1)}};
  const DomainVote whole = Vote(true, 9, 6);
  for (int g = 0; g < 2; ++g) {
    for (int t = 0; t < 2; ++t) {
      DomainVote after_gtp[2];
      for (int tt = 0; tt < 2; ++tt) {
        after_gtp[tt] = FoldDomainVotes(votes[g][tt],
                                        Gathered({votes[0][tt], votes[1][tt]}));
      }
      const DomainVote agreed =
          FoldDomainVotes(after_gtp[t], Gathered({after_gtp[0], after_gtp[1]}));
      EXPECT_EQ(agreed, whole) << "rank (" << g << ", " << t << ")";
    }
  }
}

TEST(FoldDomainVotes, ARankWithoutHomesMeansTheFallback) {
  const std::vector<DomainVote> votes = {Vote(true, 4, 1), Vote(true, 0, 0)};
  const DomainVote agreed = FoldDomainVotes(votes[0], Gathered(votes));
  EXPECT_EQ(agreed.homes_version, 0);
  EXPECT_TRUE(CheckHomesVersionHeld(agreed, "g", 8).ok());
}

TEST(CheckHomesVersionHeld, HeldWhenNotOlderThanEveryOldest) {
  EXPECT_TRUE(CheckHomesVersionHeld(Vote(true, 4, 4), "g", 8).ok());
  EXPECT_TRUE(CheckHomesVersionHeld(Vote(true, 5, 4), "g", 8).ok());
  EXPECT_TRUE(CheckHomesVersionHeld(Vote(true, 0, 0), "g", 8).ok());
}

TEST(CheckHomesVersionHeld, DroppedVersionRefusesNamingGroupAndVersions) {
  const absl::Status s = CheckHomesVersionHeld(Vote(true, 3, 11), "attn", 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  const std::string m(s.message());
  EXPECT_NE(m.find("group 'attn'"), std::string::npos) << m;
  EXPECT_NE(m.find("newest is version 3"), std::string::npos) << m;
  EXPECT_NE(m.find("versions from 11 on"), std::string::npos) << m;
  EXPECT_NE(m.find("keeps its newest 8"), std::string::npos) << m;
}

TEST(DomainVoteEncoding, GradFingerprintAndReplicasAgreeTravelExactly) {
  DomainVote vote = Vote(true, 3, 1);
  vote.grads = 0xfedcba9876543210ull;
  vote.replicas_agree = false;
  EXPECT_EQ(DecodeDomainVote(EncodeDomainVote(vote)), vote);
}

TEST(FoldDomainVotes, ReplicasAgreeOnlyIfEveryRankSaysSoAndGradsStayMine) {
  DomainVote mine = Vote(true, 1, 1), other = Vote(true, 1, 1);
  mine.grads = 11;
  other.grads = 22;
  other.replicas_agree = false;
  const DomainVote agreed = FoldDomainVotes(mine, Gathered({mine, other}));
  EXPECT_FALSE(agreed.replicas_agree);
  EXPECT_EQ(agreed.grads, 11u);  // only the DP gather compares them
  EXPECT_TRUE(FoldDomainVotes(mine, Gathered({mine, mine})).replicas_agree);
}

TEST(Fingerprint, DiffersForOneWordOrOneByteChangedAndIsStable) {
  std::vector<float> a(37, 0.25f), b = a;
  b[20] = -0.25f;  // a sign bit: the high bit of its 32-bit word
  Fingerprint fa, fb, fa_again;
  fa.Add(a.data(), a.size() * sizeof(float));
  fb.Add(b.data(), b.size() * sizeof(float));
  fa_again.Add(a.data(), a.size() * sizeof(float));
  EXPECT_NE(fa.value(), fb.value());
  EXPECT_EQ(fa.value(), fa_again.value());
  EXPECT_NE(StepFingerprint({"ab"}), StepFingerprint({"a", "b"}));
}

TEST(ReplicaGradsAgree, EqualTakenFingerprintsAgreeZeroMeansNotTaken) {
  EXPECT_TRUE(ReplicaGradsAgree(std::vector<uint64_t>{5, 5, 5}));
  EXPECT_TRUE(ReplicaGradsAgree(std::vector<uint64_t>{0, 5, 0}));
  EXPECT_TRUE(ReplicaGradsAgree(std::vector<uint64_t>{}));
  EXPECT_FALSE(ReplicaGradsAgree(std::vector<uint64_t>{5, 0, 6}));
}

TEST(CheckReplicaGradsAgreed, RefusalNamesGroupShardAndEachReplica) {
  DomainVote agreed;
  EXPECT_TRUE(CheckReplicaGradsAgreed(agreed, "w", 0, 1, {{7, 8}}).ok());
  agreed.replicas_agree = false;
  const absl::Status mine =
      CheckReplicaGradsAgreed(agreed, "w", 0, 1, {{0x7, 0x8, 0}});
  EXPECT_EQ(mine.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IsReplicaGradsRefusal(mine));
  EXPECT_EQ(mine.message(),
            "group 'w': its DP replicas of shard (g=0, t=1) (d=0: "
            "0x0000000000000007, d=1: 0x0000000000000008, d=2: not taken) "
            "hold different gradients; replicas must step on the same "
            "gradient (average it across them first, as DDP's all-reduce "
            "does), or each keeps momentum of its own and they drift apart; "
            "the step was not applied on any rank");
  const absl::Status other =
      CheckReplicaGradsAgreed(agreed, "w", 0, 0, {{7, 7}});
  EXPECT_TRUE(IsReplicaGradsRefusal(other));
  EXPECT_NE(other.message().find("the DP replicas of another shard"),
            std::string::npos)
      << other;
  EXPECT_FALSE(IsReplicaGradsRefusal(absl::InvalidArgumentError("x")));
}

}  // namespace
}  // namespace muond
