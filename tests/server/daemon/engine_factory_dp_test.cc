// The daemon's engine factory on a domain with a DP axis (Domain.dp_size 2,
// tp_size 2): four daemons' engines, built by MakeEngineFactory on threads
// over one rendezvous store (host mode, Gloo), get per-replica tp
// communicators and a DP communicator, so each param's NS runs only on its
// home replica and the update reaches the other through dp_share. Every
// rank's shards equal the single-process reference (MuonStepFullMatrix on the
// full matrices), bit for bit, and the NS runs are where the homes say.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/backend/cpu_backend.h"
#include "core/comm/kv_store.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "server/daemon/engine_factory.h"
#include "tests/common/muon_group.h"

namespace muond {
namespace {

constexpr int kD = 2, kT = 2, kWorld = kD * kT;
constexpr int kSteps = 2;

struct FullParam {
  std::string name;
  int64_t rows, cols;
  bool tp;  // column-parallel (TP dim 0); else replicated
};
const FullParam kParams[] = {{"col", 8, 6, true}, {"rep", 6, 5, false}};
// col: NS at (g 0, t 1) of replica 1; rep: every rank of replica 0.
const std::vector<NsHome> kHomes = {{.g = 0, .t = 1, .d = 1}, {.d = 0}};

std::vector<float> Full(const FullParam& p, int step) {
  std::mt19937 rng(uint32_t(p.rows * 131 + p.cols * 7 + step));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> m(p.rows * p.cols);
  for (float& x : m) x = dist(rng);
  return m;
}

// Rank t's rows of a column-parallel param; all of a replicated one.
std::vector<float> ShardOf(const FullParam& p, const std::vector<float>& full,
                           int t) {
  if (!p.tp) return full;
  const int64_t rows = p.rows / kT;
  return {full.begin() + t * rows * p.cols,
          full.begin() + (t + 1) * rows * p.cols};
}

struct RankOut {
  absl::Status status;
  std::map<std::string, std::vector<float>> params;
  int64_t ns_runs = 0;
  double dp_share_us = 0;
};

void RunRank(std::shared_ptr<KeyValueStore> store, int rank, RankOut* out) {
  const int d = rank / kT, t = rank % kT;
  std::map<std::string, std::vector<float>> grads;
  Registration reg;
  BoundGroup group;
  group.proto = testing::DenseMuonGroup(1, kT, 0, t);
  group.proto.mutable_domain()->set_dp_size(kD);
  group.proto.mutable_domain()->set_d(d);
  for (const FullParam& p : kParams) {
    out->params[p.name] = ShardOf(p, Full(p, 0), t);
    grads[p.name].assign(out->params[p.name].size(), 0.0f);
  }
  for (const FullParam& p : kParams) {
    BoundParam b;
    b.name = p.name;
    b.full_shape = {p.rows, p.cols};
    const int64_t rows = p.tp ? p.rows / kT : p.rows;
    b.local_shape = {rows, p.cols};
    b.tags.tensor_model_parallel = p.tp;
    b.tags.partition_dim = p.tp ? 0 : -1;
    b.param = ContiguousView(out->params[p.name].data(), DType::kFloat32, rows,
                             p.cols);
    b.grad =
        ContiguousView(grads[p.name].data(), DType::kFloat32, rows, p.cols);
    group.params.push_back(b);
  }
  reg.groups.push_back(std::move(group));
  EngineOptions options;
  options.job_id = "job";
  options.rank = rank;
  options.world_size = kWorld;
  options.comm_timeout = absl::Seconds(8);
  v1::Plan plan;
  plan.set_version(1);
  auto engine =
      MakeEngineFactory(options, store)(reg, plan, [] { return false; });
  if (!engine.ok()) {
    out->status = engine.status();
    return;
  }
  LayerShardedMuon& muon = *(*engine)->muon;
  out->status = muon.SetHomes("muon", kHomes, 1);
  for (int step = 1; step <= kSteps && out->status.ok(); ++step) {
    for (const FullParam& p : kParams) {
      const std::vector<float> g = ShardOf(p, Full(p, step), t);
      std::copy(g.begin(), g.end(), grads[p.name].begin());
    }
    absl::StatusOr<StepResult> result = muon.RunStep(StepInputs{});
    out->status = result.status();
    if (!result.ok()) break;
    out->ns_runs = 0;
    for (const ShapeTiming& s : result->ns_shapes) out->ns_runs += s.count;
    out->dp_share_us = result->timings.dp_share_us;
  }
}

std::vector<float> Reference(const FullParam& p, const MuonOptions& muon) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> param = Full(p, 0), grad, momentum(param.size(), 0.0f),
                     scratch(param.size());
  auto view = [&](std::vector<float>& v) {
    return ContiguousView(v.data(), DType::kFloat32, p.rows, p.cols);
  };
  auto ns = NewtonSchulz::Create(backend.get(), muon.ns, p.rows, p.cols, 1);
  EXPECT_TRUE(ns.ok()) << ns.status();
  for (int step = 1; step <= kSteps; ++step) {
    grad = Full(p, step);
    EXPECT_TRUE(MuonStepFullMatrix(*backend, muon, **ns, view(param),
                                   view(grad), view(momentum), view(scratch))
                    .ok());
  }
  return param;
}

TEST(EngineFactoryDp, ReplicasShareNsThroughTheDpCommunicator) {
  auto store = std::make_shared<InMemoryKeyValueStore>();
  std::vector<RankOut> outs(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back(RunRank, store, r, &outs[r]);
  }
  for (std::thread& th : threads) th.join();
  const absl::StatusOr<MuonOptions> muon =
      MuonOptionsFromProto(testing::DenseMuonGroup(1, kT, 0, 0));
  ASSERT_TRUE(muon.ok()) << muon.status();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(outs[r].status.ok()) << "rank " << r << ": " << outs[r].status;
    const int d = r / kT, t = r % kT;
    // col on (d 1, t 1) only; rep on both ranks of replica 0.
    EXPECT_EQ(outs[r].ns_runs, (d == 1 && t == 1) + (d == 0)) << "rank " << r;
    EXPECT_GT(outs[r].dp_share_us, 0) << "rank " << r;
  }
  for (const FullParam& p : kParams) {
    const std::vector<float> full = Reference(p, *muon);
    for (int r = 0; r < kWorld; ++r) {
      const std::vector<float> want = ShardOf(p, full, r % kT);
      const std::vector<float>& got = outs[r].params.at(p.name);
      ASSERT_EQ(got.size(), want.size());
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
          << p.name << " on rank " << r;
    }
  }
}

}  // namespace
}  // namespace muond
