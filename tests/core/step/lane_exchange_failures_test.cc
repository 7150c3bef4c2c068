// Failures inside a lane's batched collectives (lane_exchanges.h). Two ranks
// over Gloo run one lane of groups, each with one param GTP-sharded over
// both; the gtp communicator is wrapped so that it "dies" at a chosen call
// (returns DeadlineExceeded without talking, as a Gloo timeout would) and
// counts the calls made after that; rank 0's backend can fail a chosen
// Copy2D (a pack). Checked:
//   * a communicator's failure after a local one is still reported as the
//     communicator's (the step abandoned: DeadlineExceeded), and no further
//     collective goes out over it;
//   * a timeout in NorMuon's row-statistics gather (after the exchanges)
//     stops the lane's collectives too;
//   * a pack failure in a batch of five groups names the group whose piece
//     failed, and the peer refuses the step instead of timing out;
//   * ranks that registered the groups of a communicator in different
//     orders refuse the step in the domain agreement, naming the group,
//     instead of exchanging each other's data;
//   * NorMuon's row statistics failing on one rank still gathers them, so
//     the peer refuses instead of timing out;
//   * a communicator's failure in a later lane decides the step over a
//     local failure in an earlier one.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/comm/delegating_communicator.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

constexpr int kRanks = 2;

struct Scenario {
  int groups = 3;
  int64_t batch_bytes = 0;
  int64_t rank1_batch_bytes = -1;  // rank 1's own, where >= 0
  MuonVariant variant = MuonVariant::kMuon;
  int all_to_allv_dies_at = 0;     // the n-th all_to_allv fails (0: none)
  int all_gather_dies_at = 0;      // the n-th all_gather fails (0: none)
  int copy_fails_at = 0;           // rank 0's n-th Copy2D fails (0: none)
  bool reversed_on_rank1 = false;  // rank 1 registers the groups backwards
  bool row_stats_fail = false;     // rank 0's NorMuon row statistics fail
  // A second lane after the groups' one: a group over a gtp communicator of
  // its own that dies at its first all_to_allv.
  bool later_lane_dies = false;
};

// The gtp communicator: from its chosen call on, every call and Wait
// returns DeadlineExceeded; counts the calls made after the first failure.
class Dying final : public DelegatingCommunicator {
 public:
  Dying(std::unique_ptr<Communicator> inner, const Scenario& s)
      : DelegatingCommunicator(std::move(inner)),
        a2a_dies_at_(s.all_to_allv_dies_at),
        gather_dies_at_(s.all_gather_dies_at) {}
  absl::Status Wait() override {
    return dead_ ? Timeout() : DelegatingCommunicator::Wait();
  }
  int calls_after_death = 0;

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override {
    if (Dies(++all_to_allvs_, a2a_dies_at_)) return Timeout();
    return DelegatingCommunicator::DoAllToAllV(send, send_counts, recv,
                                               recv_counts, dtype);
  }
  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override {
    if (Dies(++all_gathers_, gather_dies_at_)) return Timeout();
    return DelegatingCommunicator::DoAllGather(send, count, recv, dtype);
  }

 private:
  bool Dies(int call, int dies_at) {
    if (dead_) ++calls_after_death;
    if (dies_at > 0 && call >= dies_at) dead_ = true;
    return dead_;
  }
  static absl::Status Timeout() {
    return absl::DeadlineExceededError("test: gtp timed out (peer gone)");
  }
  const int a2a_dies_at_, gather_dies_at_;
  int all_to_allvs_ = 0, all_gathers_ = 0;
  bool dead_ = false;
};

class FailingCopy final : public testing::DelegatingBackend {
 public:
  absl::Status Copy2D(const MatrixView& d, const MatrixView& s) override {
    if (fail_at > 0 && ++seen == fail_at) {
      return absl::InternalError("injected Copy2D failure");
    }
    return DelegatingBackend::Copy2D(d, s);
  }
  absl::Status NorMuonRowStats(absl::Span<const NorMuonRowBlock> blocks,
                               const MatrixView& state,
                               const MatrixView& stats) override {
    if (row_stats_fail) {
      return absl::InternalError("injected NorMuonRowStats failure");
    }
    return DelegatingBackend::NorMuonRowStats(blocks, state, stats);
  }
  int fail_at = 0;  // armed for the step only
  int seen = 0;
  bool row_stats_fail = false;
};

struct RankRun {
  absl::Status status;
  int calls_after_death = 0;
};

void RunRank(InMemoryKeyValueStore* store, int rank, const Scenario& s,
             RankRun* run) {
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = absl::Seconds(4);
  auto job = CreateGlooCommunicator(store, "job", rank, kRanks, gloo);
  auto inner = CreateGlooCommunicator(store, "gtp", rank, kRanks, gloo);
  if (!job.ok() || !inner.ok()) {
    run->status = job.ok() ? inner.status() : job.status();
    return;
  }
  Dying gtp(*std::move(inner), s);
  auto inner2 = CreateGlooCommunicator(store, "gtp2", rank, kRanks, gloo);
  if (!inner2.ok()) {
    run->status = inner2.status();
    return;
  }
  Dying gtp2(*std::move(inner2), {.all_to_allv_dies_at = 1});
  FailingCopy backend;
  std::vector<std::vector<float>> p(s.groups), g(s.groups);
  std::vector<GroupConfig> groups(s.groups);
  for (int k = 0; k < s.groups; ++k) {
    const int64_t cols = 6 + k;  // each group's size its own
    p[k].assign(4 * cols, 0.1f + k);
    g[k].assign(4 * cols, 0.2f + k);
    groups[k].name = absl::StrCat("g", k);
    groups[k].muon.lr = 0.02;
    groups[k].muon.variant = s.variant;
    groups[k].domain.size = DomainSize{kRanks, 1};
    groups[k].domain.g = rank;
    groups[k].domain.gtp = &gtp;
    ParamBinding b;
    b.name = absl::StrCat("w", k);
    b.full_shape = {4 * kRanks, cols};
    b.tags.is_gtp_weight_remat = true;
    b.param = ContiguousView(p[k].data(), DType::kFloat32, 4, cols);
    b.grad = ContiguousView(g[k].data(), DType::kFloat32, 4, cols);
    groups[k].params.push_back(b);
  }
  if (s.reversed_on_rank1 && rank == 1) {
    std::reverse(groups.begin(), groups.end());
  }
  std::vector<float> p2(4 * 6, 0.3f), g2(4 * 6, 0.4f);
  if (s.later_lane_dies) {
    GroupConfig& other = groups.emplace_back(groups.front());
    other.name = "other";
    other.domain.gtp = &gtp2;
    other.params.resize(1);
    other.params[0].name = "w-other";
    other.params[0].full_shape = {4 * kRanks, 6};
    other.params[0].param = ContiguousView(p2.data(), DType::kFloat32, 4, 6);
    other.params[0].grad = ContiguousView(g2.data(), DType::kFloat32, 4, 6);
  }
  StepOptions options;
  options.job = job->get();
  options.exchange_batch_bytes = rank == 1 && s.rank1_batch_bytes >= 0
                                     ? s.rank1_batch_bytes
                                     : s.batch_bytes;
  options.concurrent_groups = false;  // lanes in order, on this thread
  auto engine = LayerShardedMuon::Create(&backend, groups, options);
  if (!engine.ok()) {
    run->status = engine.status();
    return;
  }
  for (const GroupConfig& group : groups) {
    run->status.Update((*engine)->SetHomes(group.name, {NsHome{0, 0}}));
  }
  if (!run->status.ok()) return;
  backend.fail_at = rank == 0 ? s.copy_fails_at : 0;
  backend.row_stats_fail = rank == 0 && s.row_stats_fail;
  run->status = (*engine)->Step({}).status();
  run->calls_after_death = gtp.calls_after_death + gtp2.calls_after_death;
}

std::vector<RankRun> RunWorld(const Scenario& s) {
  InMemoryKeyValueStore store;
  std::vector<RankRun> runs(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back(RunRank, &store, r, s, &runs[r]);
  }
  for (std::thread& t : threads) t.join();
  return runs;
}

// Rank 1 refused the step because rank 0 did, without waiting out a
// timeout (which would have abandoned it).
void ExpectRank1RefusedByRank0(const std::vector<RankRun>& runs) {
  EXPECT_FALSE(absl::IsDeadlineExceeded(runs[1].status)) << runs[1].status;
  EXPECT_NE(runs[1].status.message().find("refused by rank 0"),
            std::string::npos)
      << runs[1].status;
}

TEST(LaneExchangeFailures, CommunicatorFailureAfterALocalOneIsNotMasked) {
  // Every group alone: three all_to_allvs a step of the exchange. Rank 0's
  // first pack fails; the gtp communicator dies at its second all_to_allv.
  const std::vector<RankRun> runs =
      RunWorld({.groups = 3, .all_to_allv_dies_at = 2, .copy_fails_at = 1});
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_TRUE(absl::IsDeadlineExceeded(runs[r].status)) << runs[r].status;
    EXPECT_EQ(runs[r].calls_after_death, 0)
        << "collectives went out over a communicator that had failed";
  }
}

TEST(LaneExchangeFailures, VariantGatherTimeoutStopsTheLane) {
  // The 1st all_gather is the domain agreement's; the 2nd the first group's
  // NorMuon row statistics, after the exchanges.
  const std::vector<RankRun> runs = RunWorld({.groups = 3,
                                              .batch_bytes = int64_t{64} << 20,
                                              .variant = MuonVariant::kNorMuon,
                                              .all_gather_dies_at = 2});
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_TRUE(absl::IsDeadlineExceeded(runs[r].status)) << runs[r].status;
    EXPECT_EQ(runs[r].calls_after_death, 0);
  }
}

TEST(LaneExchangeFailures, PackFailureNamesItsGroupAndThePeerRefuses) {
  // One batch of five groups; the pieces for peer 0 are packed group after
  // group, so rank 0's 5th Copy2D is g4's.
  const std::vector<RankRun> runs = RunWorld(
      {.groups = 5, .batch_bytes = int64_t{64} << 20, .copy_fails_at = 5});
  EXPECT_NE(runs[0].status.message().find(
                "group 'g4': exchange: injected Copy2D failure"),
            std::string::npos)
      << runs[0].status;
  ExpectRank1RefusedByRank0(runs);
}

TEST(LaneExchangeFailures, GroupsRegisteredInAnotherOrderAreRefused) {
  // Batched, the per-peer totals of the swapped groups would still match.
  const std::vector<RankRun> runs = RunWorld({.groups = 3,
                                              .batch_bytes = int64_t{64} << 20,
                                              .reversed_on_rank1 = true});
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_TRUE(absl::IsInvalidArgument(runs[r].status)) << runs[r].status;
    EXPECT_NE(
        runs[r].status.message().find(
            "the ranks of its domain disagree on the group as registered"),
        std::string::npos)
        << runs[r].status;
  }
  // Registered alike, the same groups step.
  for (const RankRun& run : RunWorld({.groups = 3})) {
    EXPECT_TRUE(run.status.ok()) << run.status;
  }
}

// StepOptions::exchange_batch_bytes is the engine's, not the job's: ranks
// built with different ones would cut a lane's exchanges into different
// collectives. Every rank refuses the step in the domain agreement, naming
// it, before any exchange.
TEST(LaneExchangeFailures, RanksCuttingExchangesDifferentlyAreRefused) {
  const std::vector<RankRun> runs = RunWorld(
      {.groups = 3, .batch_bytes = int64_t{64} << 20, .rank1_batch_bytes = 0});
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_TRUE(absl::IsInvalidArgument(runs[r].status)) << runs[r].status;
    EXPECT_NE(runs[r].status.message().find(absl::StrCat(
                  "exchange_batch_bytes=", r == 1 ? 0 : int64_t{64} << 20)),
              std::string::npos)
        << runs[r].status;
  }
}

TEST(LaneExchangeFailures, RowStatisticsFailureStillGathersThem) {
  const std::vector<RankRun> runs = RunWorld(
      {.groups = 2, .variant = MuonVariant::kNorMuon, .row_stats_fail = true});
  EXPECT_NE(runs[0].status.message().find("injected NorMuonRowStats failure"),
            std::string::npos)
      << runs[0].status;
  ExpectRank1RefusedByRank0(runs);
}

TEST(LaneExchangeFailures, ALaterLanesCommunicatorFailureDecidesTheStep) {
  // Rank 0's first pack fails in the first lane; the second lane's
  // communicator times out on both ranks.
  const std::vector<RankRun> runs =
      RunWorld({.groups = 2, .copy_fails_at = 1, .later_lane_dies = true});
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_TRUE(absl::IsDeadlineExceeded(runs[r].status)) << runs[r].status;
  }
}

}  // namespace
}  // namespace muond
