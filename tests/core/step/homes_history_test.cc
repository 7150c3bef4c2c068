// NS homes versions that left a rank's history: many plan versions reaching
// the ranks of a domain between two steps (e.g. `muonctl rebalance` in a
// tight loop) can leave the domain with no version every rank still holds
// (each group keeps its newest kPlansKept = 64). Then every rank of the domain
// must fail the step the same way, before anything changes. Before the fix only
// the rank that had dropped the agreed version failed; its peers went on into
// the exchange, waited there for the communicator timeout and failed as if a
// peer had died (UNAVAILABLE "restart the job's daemons" in muond), their
// momentum already updated.
//
// Two ranks (a 1x2 TP domain) run as threads over Gloo (loopback) and an
// in-memory store. Reference: the same two steps on a world that never lost
// a version, bit for bit (with ns_batch_size 1 the NS home does not change
// the result), so the refused step provably applied nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/plan/plan_history.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {
namespace {

constexpr int kT = 2;         // the domain: G = 1, T = 2
constexpr int64_t kRows = 8;  // full shape of each param, TP split of dim 0
constexpr int64_t kCols = 6;
constexpr int kParams = 2;
constexpr int64_t kVersions = kPlansKept + 2;  // more than a group keeps

// Homes of plan `version`: the two params' NS on alternating ranks.
std::vector<NsHome> HomesOf(int64_t version) {
  return {NsHome{0, int(version % kT)}, NsHome{0, int((version + 1) % kT)}};
}

float Value(int rank, int param, int step, int64_t i) {
  return float((rank * 7 + param * 13 + step * 17 + i * 5) % 23) / 23.0f - 0.4f;
}

// What one rank does; `versions_before[s]` are the homes versions it is given
// before step attempt s. Records each attempt's status and the agreed
// version, and the final params.
struct RankRun {
  std::vector<std::vector<int64_t>> versions_before;
  std::vector<int> grad_step;  // gradient seed of each attempt
  std::vector<absl::Status> statuses;
  std::vector<int64_t> agreed;
  std::vector<std::vector<float>> params_after;  // after each attempt
};

void RunRank(InMemoryKeyValueStore* store, const std::string& prefix, int t,
             RankRun* run) {
  auto fail = [&](const absl::Status& st) { run->statuses.push_back(st); };
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = absl::Seconds(8);
  auto comm = CreateGlooCommunicator(store, prefix, t, kT, gloo);
  if (!comm.ok()) return fail(comm.status());
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const int64_t local_rows = kRows / kT;
  std::vector<std::vector<float>> params(kParams), grads(kParams);
  GroupConfig cfg;
  cfg.name = "dense";
  cfg.algorithm = Algorithm::kMuon;
  cfg.muon.lr = 0.02;
  cfg.muon.momentum = 0.9;
  cfg.muon.weight_decay = 0.1;
  cfg.domain.size = DomainSize{1, kT};
  cfg.domain.t = t;
  cfg.domain.tp = comm->get();
  for (int p = 0; p < kParams; ++p) {
    params[p].resize(local_rows * kCols);
    grads[p].resize(local_rows * kCols);
    for (int64_t i = 0; i < local_rows * kCols; ++i) {
      params[p][i] = Value(t, p, 0, i);
    }
    ParamBinding b;
    b.name = absl::StrCat("w", p);
    b.full_shape = {kRows, kCols};
    b.tags.tensor_model_parallel = true;
    b.tags.partition_dim = 0;
    b.param =
        ContiguousView(params[p].data(), DType::kFloat32, local_rows, kCols);
    b.grad =
        ContiguousView(grads[p].data(), DType::kFloat32, local_rows, kCols);
    cfg.params.push_back(b);
  }
  auto opt = LayerShardedMuon::Create(backend.get(), {cfg});
  if (!opt.ok()) return fail(opt.status());
  for (size_t a = 0; a < run->versions_before.size(); ++a) {
    for (int64_t v : run->versions_before[a]) {
      absl::Status st = (*opt)->SetHomes("dense", HomesOf(v), v);
      if (!st.ok()) return fail(st);
    }
    for (int p = 0; p < kParams; ++p) {
      for (int64_t i = 0; i < local_rows * kCols; ++i) {
        grads[p][i] = Value(t, p, run->grad_step[a], i);
      }
    }
    auto result = (*opt)->Step({});
    run->statuses.push_back(result.status());
    run->agreed.push_back(result.ok() ? result->homes_versions.at("dense")
                                      : -1);
    std::vector<float> flat;
    for (const auto& p : params) flat.insert(flat.end(), p.begin(), p.end());
    run->params_after.push_back(flat);
  }
}

std::vector<int64_t> Range(int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (int64_t v = lo; v <= hi; ++v) out.push_back(v);
  return out;
}

void RunWorld(const std::string& prefix, RankRun* runs) {
  InMemoryKeyValueStore store;
  std::vector<std::thread> threads;
  for (int t = 0; t < kT; ++t) {
    threads.emplace_back(RunRank, &store, prefix, t, &runs[t]);
  }
  for (std::thread& th : threads) th.join();
}

TEST(HomesHistory, NoCommonVersionFailsEveryRankAndAppliesNothing) {
  // Rank 0 got versions 1..10 before step 1 (it keeps 3..10), rank 1 only
  // version 1: no version is held by both. Then rank 1 catches up and the
  // step is retried with the same gradients.
  RankRun runs[kT];
  runs[0].versions_before = {Range(1, kVersions), {}};
  runs[1].versions_before = {{1}, Range(2, kVersions)};
  for (RankRun& r : runs) r.grad_step = {1, 1};
  RunWorld("evicted", runs);

  // The reference: a world that gets version 10 at once and steps once.
  RankRun clean[kT];
  for (RankRun& r : clean) {
    r.versions_before = {{kVersions}};
    r.grad_step = {1};
  }
  RunWorld("clean", clean);

  for (int t = 0; t < kT; ++t) {
    SCOPED_TRACE(absl::StrCat("rank t=", t));
    ASSERT_EQ(runs[t].statuses.size(), 2u) << runs[t].statuses.back();
    const absl::Status& refused = runs[t].statuses[0];
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "dense")) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "version")) << refused;
    // Nothing applied: the params are their initial values.
    for (int p = 0; p < kParams; ++p) {
      for (int64_t i = 0; i < (kRows / kT) * kCols; ++i) {
        ASSERT_EQ(runs[t].params_after[0][p * (kRows / kT) * kCols + i],
                  Value(t, p, 0, i))
            << "param w" << p << " element " << i;
      }
    }
    ASSERT_TRUE(runs[t].statuses[1].ok()) << runs[t].statuses[1];
    EXPECT_EQ(runs[t].agreed[1], kVersions);
    ASSERT_EQ(clean[t].statuses.size(), 1u);
    ASSERT_TRUE(clean[t].statuses[0].ok()) << clean[t].statuses[0];
    // Momentum too: the retried step equals a first step bit for bit.
    const std::vector<float>& got = runs[t].params_after[1];
    const std::vector<float>& want = clean[t].params_after[0];
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4));
    EXPECT_NE(0, std::memcmp(got.data(), runs[t].params_after[0].data(),
                             got.size() * 4))
        << "the retried step changed nothing";
  }
}

}  // namespace
}  // namespace muond
