// A rank whose own NS fails (out of memory on a GPU another process
// shares) still runs every collective of its lane, so its peers refuse the
// step in the commit vote instead of waiting out the comm timeout in one it
// skipped (the step would then be abandoned: DeadlineExceeded). Two ranks
// over Gloo (4 s timeout), a device-like backend; one lane holding a group
// whose params are GTP-sharded over both ranks (exchanges; Muon, or NorMuon
// whose row statistics are gathered over gtp after the exchanges) and a
// single-rank group whose NS needs none, in either order; on the first step
// (measured: NS after the vote) NS fails on rank 0 only: of the single-rank
// group's 3x5 matrix (before the exchanges), or of the sharded group's 8x6
// matrix assembled on rank 0 (between its forward and its reverse exchange,
// which rank 1 waits in).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

constexpr int kRanks = 2;

// A device-like CPU backend whose NS fails on matrices with `fail_cols`
// columns (0: none).
class Failing final : public testing::DelegatingBackend {
 public:
  bool is_device() const override { return true; }
  absl::Status FrobeniusNormalize(const MatrixView& s, const MatrixView& d,
                                  int64_t batch, float eps) override {
    if (fail_cols > 0 && (s.cols == fail_cols || s.rows == fail_cols)) {
      return absl::InternalError("injected NS failure");
    }
    return DelegatingBackend::FrobeniusNormalize(s, d, batch, eps);
  }
  int64_t fail_cols = 0;
};

struct RankRun {
  absl::Status status;
};

// `local_first`: the single-rank group registered first.
struct Case {
  bool local_first;  // the single-rank group registered first
  int64_t fail_cols;
  MuonVariant variant = MuonVariant::kMuon;  // of the sharded group
};

void RunRank(InMemoryKeyValueStore* store, int rank, const Case& c,
             RankRun* run) {
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = absl::Seconds(4);
  auto job = CreateGlooCommunicator(store, "job", rank, kRanks, gloo);
  auto gtp = CreateGlooCommunicator(store, "gtp", rank, kRanks, gloo);
  if (!job.ok() || !gtp.ok()) {
    run->status = job.ok() ? gtp.status() : job.status();
    return;
  }
  Failing backend;
  backend.fail_cols = rank == 0 ? c.fail_cols : 0;
  std::vector<float> pb(4 * 6, 0.1f), gb(4 * 6, 0.2f);
  std::vector<float> pa(3 * 5, 0.3f), ga(3 * 5, 0.4f);
  std::vector<GroupConfig> groups(2);
  // Group "sharded" first: its params' rows split over the two ranks.
  groups[0].name = "sharded";
  groups[0].muon.lr = 0.02;
  groups[0].muon.variant = c.variant;
  groups[0].domain.size = DomainSize{kRanks, 1};
  groups[0].domain.g = rank;
  groups[0].domain.gtp = gtp->get();
  ParamBinding b;
  b.name = "w";
  b.full_shape = {4 * kRanks, 6};
  b.tags.is_gtp_weight_remat = true;
  b.param = ContiguousView(pb.data(), DType::kFloat32, 4, 6);
  b.grad = ContiguousView(gb.data(), DType::kFloat32, 4, 6);
  groups[0].params.push_back(b);
  // Group "local": a single-rank domain (NS needs no exchange).
  groups[1].name = "local";
  groups[1].muon.lr = 0.02;
  ParamBinding a;
  a.name = "v";
  a.full_shape = {3, 5};
  a.param = ContiguousView(pa.data(), DType::kFloat32, 3, 5);
  a.grad = ContiguousView(ga.data(), DType::kFloat32, 3, 5);
  groups[1].params.push_back(a);
  StepOptions options;
  options.job = job->get();
  if (c.local_first) std::swap(groups[0], groups[1]);
  auto engine = LayerShardedMuon::Create(&backend, groups, options);
  if (!engine.ok()) {
    run->status = engine.status();
    return;
  }
  run->status.Update((*engine)->SetHomes("sharded", {NsHome{0, 0}}));
  run->status.Update((*engine)->SetHomes("local", {NsHome{0, 0}}));
  if (!run->status.ok()) return;
  run->status = (*engine)->Step({}).status();  // step 1: measured
}

// Both ranks refused the step (none waited out a timeout and abandoned
// it), rank 0 naming `failure`.
void ExpectRefusedAtOnce(const Case& c, const std::string& failure) {
  InMemoryKeyValueStore store;
  RankRun runs[kRanks];
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back(RunRank, &store, r, c, &runs[r]);
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_FALSE(runs[r].status.ok());
    EXPECT_FALSE(absl::IsDeadlineExceeded(runs[r].status))
        << "a refusal was expected, not an abandoned step: " << runs[r].status;
  }
  EXPECT_NE(runs[0].status.message().find(failure), std::string::npos)
      << runs[0].status;
  EXPECT_NE(runs[1].status.message().find("refused by rank 0"),
            std::string::npos)
      << runs[1].status;
}

TEST(LocalFailureBeforeExchanges, PeersRefuseInsteadOfTimingOut) {
  for (bool local_first : {false, true}) {
    SCOPED_TRACE(local_first ? "single-rank group first" : "sharded first");
    ExpectRefusedAtOnce({local_first, /*fail_cols=*/5},
                        "group 'local': Newton-Schulz after the vote failed");
  }
}

TEST(LocalFailureBetweenExchanges, PeersRefuseInsteadOfTimingOut) {
  for (MuonVariant variant : {MuonVariant::kMuon, MuonVariant::kNorMuon}) {
    for (bool local_first : {false, true}) {
      SCOPED_TRACE(absl::StrCat(
          variant == MuonVariant::kMuon ? "Muon, " : "NorMuon, ",
          local_first ? "single-rank group first" : "sharded first"));
      ExpectRefusedAtOnce({local_first, /*fail_cols=*/6, variant},
                          "injected NS failure");
    }
  }
}

}  // namespace
}  // namespace muond
