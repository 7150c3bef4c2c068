// GatherDomainVotesOfGroups: the domain agreements of many groups with one
// all_gather per communicator and stage, not one per group. Two ranks run as
// threads over Gloo (loopback); forty groups spread over a dp, a gtp_remat
// and two tp communicators. Reference: each group's agreed vote worked out
// by hand from what each rank brought (finite only if both are, the oldest
// of the newest homes versions, the newest of the oldest, the smallest and
// largest fingerprints, replicas agreeing only on equal gradient
// fingerprints). A communicator that fails leaves the groups on it with its
// error and the others agreed; one that times out stops the gathers.
#include "core/step/gather_domain_votes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/delegating_communicator.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"

namespace muond {
namespace {

constexpr int kRanks = 2;
constexpr int kGroups = 40;

// A Gloo communicator that counts its all_gathers and, where `fail` is set,
// returns it instead of gathering (set alike on every rank: no peer waits).
class Counting final : public DelegatingCommunicator {
 public:
  using DelegatingCommunicator::DelegatingCommunicator;
  int all_gathers = 0;
  absl::Status fail;

 protected:
  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override {
    ++all_gathers;
    if (!fail.ok()) return fail;
    return DelegatingCommunicator::DoAllGather(send, count, recv, dtype);
  }
};

// Group k's communicators: tp "a" (odd k) or "b" (even k); dp "d" where
// k % 5 == 0; gtp_remat "g" where k % 8 == 3.
bool OnDp(int k) { return k % 5 == 0; }
bool OnGtp(int k) { return k % 8 == 3; }

// What rank r brings to group k's agreement.
DomainVote Mine(int k, int r) {
  DomainVote v;
  v.all_finite = !(k == 7 && r == 1);
  v.homes_version = 10 + k + r;
  v.oldest_held = 1 + r;
  v.skip_min = v.skip_max = k == 9 ? uint64_t(100 + r) : uint64_t(k);
  v.hyper_min = v.hyper_max = 50;
  v.grads = k == 15 && r == 1 ? 2000 : uint64_t(1000 + k);
  return v;
}

struct RankRun {
  absl::Status status;
  size_t timed_out = kGroups;
  std::vector<GroupVote> groups;
  // all_gathers by communicator: a, b, d, g.
  int gathers[4] = {0, 0, 0, 0};
};

// `failing`: which communicator fails (a, b, d, g), with what.
void RunRank(InMemoryKeyValueStore* store, int rank, char failing,
             absl::Status failure, RankRun* run) {
  std::unique_ptr<Counting> comms[4];
  const char names[] = {'a', 'b', 'd', 'g'};
  for (int c = 0; c < 4; ++c) {
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.timeout = absl::Seconds(60);
    auto comm = CreateGlooCommunicator(store, std::string(1, names[c]), rank,
                                       kRanks, gloo);
    if (!comm.ok()) {
      run->status = comm.status();
      return;
    }
    comms[c] = std::make_unique<Counting>(*std::move(comm));
    if (names[c] == failing) comms[c]->fail = failure;
  }
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> scratch(DomainVoteScratchFloats(kRanks, kGroups));
  run->groups.resize(kGroups);
  for (int k = 0; k < kGroups; ++k) {
    GroupVote& g = run->groups[k];
    g.backend = backend.get();
    g.scratch = scratch.data();
    g.tp = comms[k % 2 == 1 ? 0 : 1].get();
    if (OnDp(k)) g.dp = comms[2].get();
    if (OnGtp(k)) g.gtp = comms[3].get();
    g.vote = Mine(k, rank);
  }
  run->status =
      GatherDomainVotesOfGroups(absl::MakeSpan(run->groups), &run->timed_out);
  for (int c = 0; c < 4; ++c) run->gathers[c] = comms[c]->all_gathers;
}

void RunRanks(char failing, absl::Status failure, RankRun (&runs)[kRanks]) {
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back(RunRank, &store, r, failing, failure, &runs[r]);
  }
  for (std::thread& t : threads) t.join();
}

// Group k's agreed vote, by hand.
void ExpectAgreed(const GroupVote& got, int k) {
  const DomainVote a = Mine(k, 0), b = Mine(k, 1);
  EXPECT_EQ(got.vote.all_finite, k != 7) << k;
  EXPECT_EQ(got.vote.homes_version, 10 + k) << k;
  EXPECT_EQ(got.vote.oldest_held, 2) << k;
  EXPECT_EQ(got.vote.skip_min, std::min(a.skip_min, b.skip_min)) << k;
  EXPECT_EQ(got.vote.skip_max, std::max(a.skip_max, b.skip_max)) << k;
  EXPECT_EQ(got.vote.hyper_min, 50u) << k;
  EXPECT_EQ(got.vote.hyper_max, 50u) << k;
  if (OnDp(k)) {
    EXPECT_EQ(got.replica_grads, (std::vector<uint64_t>{a.grads, b.grads}))
        << k;
    EXPECT_EQ(got.vote.replicas_agree, k != 15) << k;
  } else {
    EXPECT_TRUE(got.vote.replicas_agree) << k;
  }
}

TEST(DomainVotesOfGroups, OneGatherPerCommunicatorAndEveryGroupAgreed) {
  RankRun runs[kRanks];
  RunRanks(0, absl::OkStatus(), runs);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(runs[r].status.ok()) << runs[r].status;
    // Forty groups' agreements: one all_gather on each communicator.
    for (int c = 0; c < 4; ++c) EXPECT_EQ(runs[r].gathers[c], 1) << r << c;
    for (int k = 0; k < kGroups; ++k) {
      const GroupVote& got = runs[r].groups[k];
      ASSERT_TRUE(got.status.ok()) << k << ": " << got.status;
      ExpectAgreed(got, k);
      if (!OnDp(k)) {
        EXPECT_EQ(got.replica_grads, std::vector<uint64_t>{Mine(k, r).grads})
            << k;
      }
    }
  }
}

// The dp communicator fails at the first stage: its groups keep its error
// and still take part in their tp gathers (their peers wait for them
// there); every other group agrees as before.
TEST(DomainVotesOfGroups, AFailedCommunicatorFailsItsGroupsOnly) {
  RankRun runs[kRanks];
  RunRanks('d', absl::UnavailableError("gloo: dp peer reset"), runs);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(runs[r].status.ok()) << runs[r].status;
    EXPECT_EQ(runs[r].gathers[0], 1);
    EXPECT_EQ(runs[r].gathers[1], 1);
    for (int k = 0; k < kGroups; ++k) {
      const GroupVote& got = runs[r].groups[k];
      if (OnDp(k)) {
        EXPECT_TRUE(absl::IsUnavailable(got.status)) << k << ": " << got.status;
        // Folded at the tp stage all the same: rank 1 brought 11 + k.
        EXPECT_EQ(got.vote.homes_version, 10 + k) << k;
      } else {
        ASSERT_TRUE(got.status.ok()) << k << ": " << got.status;
        ExpectAgreed(got, k);
      }
    }
  }
}

// A gather that times out stops them all: tp "b" runs first at the tp
// stage (group 0 uses it), so "a" never gathers, and group 0 is named.
TEST(DomainVotesOfGroups, ATimeoutStopsTheGathersAndNamesItsFirstGroup) {
  RankRun runs[kRanks];
  RunRanks('b', absl::DeadlineExceededError("gloo: tp peer never came"), runs);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(absl::IsDeadlineExceeded(runs[r].status)) << runs[r].status;
    EXPECT_EQ(runs[r].timed_out, 0u);
    EXPECT_EQ(runs[r].gathers[0], 0) << "gathered after the timeout";
    EXPECT_EQ(runs[r].gathers[2], 1);
    EXPECT_EQ(runs[r].gathers[3], 1);
  }
}

}  // namespace
}  // namespace muond
