// The exchanges of a lane's groups batched across them (lane_exchanges.h):
// one all_to_allv per communicator, NS dtype and stage for as many groups as
// StepOptions::exchange_batch_bytes holds, instead of one per group.
// Eight ranks (a 2 x 2 x 2 D x G x T domain) run as threads over Gloo; each
// holds twelve groups, a group per layer, each with the replicated,
// GTP_remat, TP column, TP row and GTP_remat x TP params of the layout tests
// (stage 1, both stage 2 tp_dims and dp_share all move data), every other
// layer in medium precision (bf16 exchanges) and the others in highest
// (fp32). Checked:
//   * three steps batched whole, batched in budget-sized runs and unbatched
//     (exchange_batch_bytes 0: every group alone, as before batching) leave
//     every rank's params bitwise equal, and the unbatched run's highest
//     precision params equal the single-process reference;
//   * the all_to_allvs each communicator ran: per step one per dtype and
//     stage when whole; as many runs as the budget cuts the groups into,
//     worked out by hand from the groups' size bounds; one per group and
//     stage unbatched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/delegating_communicator.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/groups.h"
#include "core/comm/kv_store.h"
#include "core/common/status_macros.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/plan/exchange_plan.h"
#include "core/plan/replica_exchange.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"
#include "tests/core/step/layout_cases.h"

namespace muond {
namespace {

using testing_layouts::FullMatrix;
using testing_layouts::Layout;
using testing_layouts::ParamCase;
using testing_layouts::Shard;

constexpr int kLayers = 12;
constexpr int kSteps = 3;
const Layout kLayout{2, 2, 2};

// A Gloo communicator that counts its all_to_allvs and their largest send.
class Counting final : public DelegatingCommunicator {
 public:
  using DelegatingCommunicator::DelegatingCommunicator;
  int all_to_allvs = 0;
  int64_t max_send_bytes = 0;

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override {
    ++all_to_allvs;
    int64_t elements = 0;
    for (int64_t n : send_counts) elements += n;
    max_send_bytes =
        std::max(max_send_bytes, elements * int64_t(DTypeSize(dtype)));
    return DelegatingCommunicator::DoAllToAllV(send, send_counts, recv,
                                               recv_counts, dtype);
  }
};

bool Medium(int layer) { return layer % 2 == 1; }

MuonOptions LayerMuon(int layer) {
  return testing_layouts::LayoutMuon(Medium(layer) ? MatmulPrecision::kMedium
                                                   : MatmulPrecision::kHighest);
}

// Layer k's params: the layout tests' mixed params, named per layer.
std::vector<ParamCase> LayerParams(int layer) {
  std::vector<ParamCase> params = testing_layouts::MixedParams(kLayout);
  for (ParamCase& p : params)
    p.name = absl::StrCat("layer", layer, ".", p.name);
  return params;
}

struct RankRun {
  absl::Status status;
  std::map<std::string, std::vector<float>> params;
  std::map<std::string, int> all_to_allvs;  // by communicator: gtp, tp, dp
};

class Rank {
 public:
  explicit Rank(int flat) : flat_(flat) {
    t_ = flat % kLayout.T;
    g_ = (flat / kLayout.T) % kLayout.G;
    d_ = flat / (kLayout.T * kLayout.G);
  }

  void Run(KeyValueStore* store, int64_t batch_bytes, RankRun* run) {
    run->status = Build(store, batch_bytes);
    for (int step = 1; run->status.ok() && step <= kSteps; ++step) {
      SetGrads(step);
      run->status = opt_->RunStep({}).status();
    }
    run->params = params_;
    run->all_to_allvs = {{"gtp", gtp_->all_to_allvs},
                         {"tp", tp_->all_to_allvs},
                         {"dp", dp_->all_to_allvs}};
  }

 private:
  absl::Status Build(KeyValueStore* store, int64_t batch_bytes) {
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.timeout = absl::Seconds(20);
    const DomainSize size{kLayout.G, kLayout.T, kLayout.D};
    absl::StatusOr<DomainGroups> groups =
        SplitDomain(size, d_, g_, t_, "layers");
    if (!groups.ok()) return groups.status();
    auto counting = [&](const std::string& prefix, int rank, int n,
                        std::unique_ptr<Counting>& out) -> absl::Status {
      auto c = CreateGlooCommunicator(store, prefix, rank, n, gloo);
      if (!c.ok()) return c.status();
      out = std::make_unique<Counting>(*std::move(c));
      return absl::OkStatus();
    };
    absl::Status made = counting(groups->gtp_remat_prefix, g_, kLayout.G, gtp_);
    made.Update(counting(groups->tp_prefix, t_, kLayout.T, tp_));
    made.Update(counting(groups->dp_prefix, d_, kLayout.D, dp_));
    auto job =
        CreateGlooCommunicator(store, "job", flat_, kLayout.world(), gloo);
    if (!job.ok()) made.Update(job.status());
    if (!made.ok()) return made;
    job_ = *std::move(job);
    // Sized first: the views point into these vectors.
    for (int k = 0; k < kLayers; ++k) {
      for (const ParamCase& p : LayerParams(k)) {
        int64_t r, c;
        params_[p.name] = Shard(FullMatrix(p.name, 0, p.rows, p.cols), p,
                                kLayout, g_, t_, &r, &c);
        grads_[p.name].assign(r * c, 0.0f);
        shapes_[p.name] = {r, c};
      }
    }
    std::vector<GroupConfig> configs;
    for (int k = 0; k < kLayers; ++k) {
      GroupConfig& group = configs.emplace_back();
      group.name = absl::StrCat("layer", k);
      group.muon = LayerMuon(k);
      group.domain = {size, g_, t_, d_, gtp_.get(), tp_.get(), dp_.get()};
      for (const ParamCase& p : LayerParams(k)) {
        group.params.push_back(testing_layouts::BindingOf(
            p, kLayout, params_[p.name], grads_[p.name], shapes_[p.name]));
      }
    }
    StepOptions options;
    options.job = job_.get();
    options.exchange_batch_bytes = batch_bytes;
    auto opt = LayerShardedMuon::Create(backend_.get(), configs, options);
    if (!opt.ok()) return opt.status();
    opt_ = *std::move(opt);
    for (int k = 0; k < kLayers; ++k) {
      RETURN_IF_ERROR(
          opt_->SetHomes(absl::StrCat("layer", k),
                         testing_layouts::Homes(LayerParams(k), kLayout)));
    }
    return absl::OkStatus();
  }

  void SetGrads(int step) {
    for (int k = 0; k < kLayers; ++k) {
      for (const ParamCase& p : LayerParams(k)) {
        int64_t r, c;
        const std::vector<float> shard =
            Shard(FullMatrix(p.name, step, p.rows, p.cols), p, kLayout, g_, t_,
                  &r, &c);
        std::copy(shard.begin(), shard.end(), grads_[p.name].begin());
      }
    }
  }

  const int flat_;
  int d_ = 0, g_ = 0, t_ = 0;
  std::unique_ptr<Backend> backend_ = testing::MakeStepTestBackend();
  std::unique_ptr<Counting> gtp_, tp_, dp_;
  std::unique_ptr<Communicator> job_;
  std::unique_ptr<LayerShardedMuon> opt_;
  std::map<std::string, std::vector<float>> params_, grads_;
  std::map<std::string, std::pair<int64_t, int64_t>> shapes_;
};

std::vector<RankRun> RunWorld(int64_t batch_bytes) {
  InMemoryKeyValueStore store;
  std::vector<RankRun> runs(kLayout.world());
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < kLayout.world(); ++r) {
    ranks.push_back(std::make_unique<Rank>(r));
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < kLayout.world(); ++r) {
    threads.emplace_back(
        [&, r] { ranks[r]->Run(&store, batch_bytes, &runs[r]); });
  }
  for (std::thread& th : threads) th.join();
  return runs;
}

// Param `p`'s full matrix after kSteps steps of the single-process path.
std::vector<float> ReferenceMuon(const ParamCase& p, const MuonOptions& muon) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> param = FullMatrix(p.name, 0, p.rows, p.cols);
  std::vector<float> grad, momentum(param.size(), 0.0f), scratch(param.size());
  auto view = [&](std::vector<float>& v) {
    return ContiguousView(v.data(), DType::kFloat32, p.rows, p.cols);
  };
  auto ns = NewtonSchulz::Create(backend.get(), muon.ns, p.rows, p.cols, 1);
  EXPECT_TRUE(ns.ok()) << ns.status();
  for (int step = 1; step <= kSteps; ++step) {
    grad = FullMatrix(p.name, step, p.rows, p.cols);
    EXPECT_TRUE(MuonStepFullMatrix(*backend, muon, **ns, view(param),
                                   view(grad), view(momentum), view(scratch))
                    .ok());
  }
  return param;
}

// The size bound of a layer's group (lane_exchanges.h): its params' whole
// elements in its NS dtype.
int64_t SizeBound(int layer) {
  int64_t elements = 0;
  for (const ParamCase& p : LayerParams(layer)) elements += p.rows * p.cols;
  return elements * (Medium(layer) ? 2 : 4);
}

// How many batches the layers of one dtype make under `budget`, cut in
// layer order as lane_exchanges.h says.
int BatchesUnder(int64_t budget, bool medium) {
  int batches = 0;
  int64_t bound = 0;
  bool open = false;
  for (int k = 0; k < kLayers; ++k) {
    if (Medium(k) != medium) continue;
    if (!open || bound + SizeBound(k) > budget) {
      ++batches;
      bound = 0;
      open = true;
    }
    bound += SizeBound(k);
  }
  return batches;
}

// The all_to_allvs one layer's group runs on rank `flat` per step, by
// communicator, from its exchange plans (every layer's are alike): stage 1
// forward and reverse over gtp and each stage 2 forward and reverse over tp
// where active (some rank of the gtp or tp group moves data of a param homed
// in this replica), dp_share over dp.
std::map<std::string, int> ExchangesPerGroup(int flat) {
  const int t = flat % kLayout.T, g = (flat / kLayout.T) % kLayout.G;
  const int d = flat / (kLayout.T * kLayout.G);
  const DomainSize size{kLayout.G, kLayout.T, kLayout.D};
  std::vector<ParamShardSpec> specs;
  for (const ParamCase& p : LayerParams(0)) {
    specs.push_back(testing_layouts::SpecOf(p, kLayout));
  }
  const std::vector<NsHome> homes =
      testing_layouts::Homes(LayerParams(0), kLayout);
  absl::StatusOr<GroupExchangePlan> plan =
      BuildGroupExchangePlan(specs, homes, size, g, t, d);
  absl::StatusOr<StageExchange> share =
      BuildReplicaExchangePlan(specs, homes, size, d, g, t);
  EXPECT_TRUE(plan.ok() && share.ok());
  std::map<std::string, int> n = {{"gtp", 0}, {"tp", 0}, {"dp", 0}};
  if (!plan.ok() || !share.ok()) return n;
  if (plan->has_stage1 && plan->stage1.active) n["gtp"] = 2;
  for (const StageExchange& s2 : plan->stage2) n["tp"] += s2.active ? 2 : 0;
  n["dp"] = share->active ? 1 : 0;
  return n;
}

TEST(LaneExchanges, BatchedRunsAreBitwiseTheUnbatchedWithFewerCollectives) {
  // Budget-sized runs: the highest precision layers (912 bytes each) two to
  // a batch, the medium ones (456 bytes) four.
  const int64_t budget = 2000;
  ASSERT_EQ(SizeBound(0), 912);
  ASSERT_EQ(BatchesUnder(budget, /*medium=*/false), 3);
  ASSERT_EQ(BatchesUnder(budget, /*medium=*/true), 2);
  const std::vector<RankRun> unbatched = RunWorld(0);
  const std::vector<RankRun> whole = RunWorld(int64_t{64} << 20);
  const std::vector<RankRun> cut = RunWorld(budget);
  struct Expected {
    const std::vector<RankRun>* runs;
    const char* what;
    int batches;  // per exchange, both dtypes
  };
  for (const Expected& e :
       {Expected{&unbatched, "unbatched", kLayers},
        Expected{&whole, "whole", 2},
        Expected{&cut, "cut",
                 BatchesUnder(budget, false) + BatchesUnder(budget, true)}}) {
    for (int r = 0; r < kLayout.world(); ++r) {
      SCOPED_TRACE(absl::StrCat(e.what, ", rank ", r));
      const RankRun& run = (*e.runs)[r];
      ASSERT_TRUE(run.status.ok()) << run.status;
      const std::map<std::string, int> per_group = ExchangesPerGroup(r);
      for (const char* comm : {"gtp", "tp", "dp"}) {
        EXPECT_EQ(run.all_to_allvs.at(comm),
                  kSteps * e.batches * per_group.at(comm))
            << comm;
      }
      if (e.runs != &unbatched) {
        EXPECT_EQ(run.params, unbatched[r].params);
      }
    }
  }
  // Every communicator carries exchanges on some rank.
  std::map<std::string, int> all = {{"gtp", 0}, {"tp", 0}, {"dp", 0}};
  for (int r = 0; r < kLayout.world(); ++r) {
    for (const auto& [comm, n] : ExchangesPerGroup(r)) all[comm] += n;
  }
  for (const auto& [comm, n] : all) EXPECT_GT(n, 0) << comm;
  // The unbatched run against the single-process path, at rank (0, 0, 0)
  // and (1, 1, 1): bitwise where every param's rows are whole (highest).
  for (int r : {0, kLayout.world() - 1}) {
    const int t = r % kLayout.T, g = (r / kLayout.T) % kLayout.G;
    for (int k = 0; k < kLayers; k += 2) {
      for (const ParamCase& p : LayerParams(k)) {
        int64_t rows, cols;
        const std::vector<float> want = Shard(ReferenceMuon(p, LayerMuon(k)), p,
                                              kLayout, g, t, &rows, &cols);
        EXPECT_EQ(unbatched[r].params.at(p.name), want) << p.name;
      }
    }
  }
}

// dp_share sends the updates of the params homed in a replica to each of
// the D - 1 others: with four replicas and eight groups of one 16x16 fp32
// param all homed in replica 0 (per-group homes of a group per layer),
// replica 0 sends 3 x 1024 bytes a group. Under a 12288-byte budget that is
// four groups a batch: two all_to_allvs, each within the budget.
TEST(LaneExchanges, DpShareBatchesStayWithinTheBudget) {
  constexpr int kD = 4, kGroups = 8;
  constexpr int64_t kBudget = 12288;
  struct ReplicaRun {
    absl::Status status;
    int all_to_allvs = 0;
    int64_t max_send_bytes = 0;
  };
  InMemoryKeyValueStore store;
  std::vector<ReplicaRun> runs(kD);
  auto run_replica = [&](int d) {
    ReplicaRun& run = runs[d];
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.timeout = absl::Seconds(20);
    auto job = CreateGlooCommunicator(&store, "job", d, kD, gloo);
    auto inner = CreateGlooCommunicator(&store, "dp", d, kD, gloo);
    if (!job.ok() || !inner.ok()) {
      run.status = job.ok() ? inner.status() : job.status();
      return;
    }
    Counting dp(*std::move(inner));
    std::unique_ptr<Backend> backend = testing::MakeStepTestBackend();
    std::vector<std::vector<float>> p(kGroups, std::vector<float>(256, 0.1f));
    std::vector<std::vector<float>> g(kGroups, std::vector<float>(256, 0.2f));
    std::vector<GroupConfig> groups(kGroups);
    for (int k = 0; k < kGroups; ++k) {
      groups[k].name = absl::StrCat("layer", k);
      groups[k].muon.lr = 0.02;
      groups[k].domain.size = DomainSize{1, 1, kD};
      groups[k].domain.d = d;
      groups[k].domain.dp = &dp;
      ParamBinding b;
      b.name = absl::StrCat("w", k);
      b.full_shape = {16, 16};
      b.param = ContiguousView(p[k].data(), DType::kFloat32, 16, 16);
      b.grad = ContiguousView(g[k].data(), DType::kFloat32, 16, 16);
      groups[k].params.push_back(b);
    }
    StepOptions options;
    options.job = job->get();
    options.exchange_batch_bytes = kBudget;
    auto engine = LayerShardedMuon::Create(backend.get(), groups, options);
    if (!engine.ok()) {
      run.status = engine.status();
      return;
    }
    for (int k = 0; k < kGroups; ++k) {
      run.status.Update(
          (*engine)->SetHomes(absl::StrCat("layer", k), {NsHome{0, 0, 0}}));
    }
    if (run.status.ok()) run.status = (*engine)->Step({}).status();
    run.all_to_allvs = dp.all_to_allvs;
    run.max_send_bytes = dp.max_send_bytes;
  };
  std::vector<std::thread> threads;
  for (int d = 0; d < kD; ++d) threads.emplace_back(run_replica, d);
  for (std::thread& t : threads) t.join();
  for (int d = 0; d < kD; ++d) {
    SCOPED_TRACE(absl::StrCat("replica ", d));
    ASSERT_TRUE(runs[d].status.ok()) << runs[d].status;
    EXPECT_EQ(runs[d].all_to_allvs, 2);
    EXPECT_LE(runs[d].max_send_bytes, kBudget);
  }
  EXPECT_EQ(runs[0].max_send_bytes, 4 * 3 * 1024);
}

// Groups that exchange over one communicator must compute on one backend:
// each rank picks its groups' backends, and a batch is packed on one.
TEST(LaneExchanges, GroupsSharingACommunicatorMustShareABackend) {
  InMemoryKeyValueStore store;
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  auto gtp = CreateGlooCommunicator(&store, "gtp", 0, 1, gloo);
  ASSERT_TRUE(gtp.ok()) << gtp.status();
  std::unique_ptr<Backend> first = MakeCpuBackend(), second = MakeCpuBackend();
  std::vector<float> p(16, 0.1f), g(16, 0.2f), q(16, 0.1f), h(16, 0.2f);
  std::vector<GroupConfig> groups(2);
  for (int k = 0; k < 2; ++k) {
    groups[k].name = absl::StrCat("layer", k);
    groups[k].domain.gtp = gtp->get();
    ParamBinding b;
    b.name = absl::StrCat("w", k);
    b.full_shape = {4, 4};
    b.param = ContiguousView((k == 0 ? p : q).data(), DType::kFloat32, 4, 4);
    b.grad = ContiguousView((k == 0 ? g : h).data(), DType::kFloat32, 4, 4);
    groups[k].params.push_back(b);
  }
  groups[1].backend = second.get();
  const auto engine = LayerShardedMuon::Create(first.get(), groups);
  EXPECT_TRUE(absl::IsInvalidArgument(engine.status())) << engine.status();
  EXPECT_NE(engine.status().message().find(
                "groups 'layer0' and 'layer1' share the communicator"),
            std::string::npos)
      << engine.status();
  groups[1].backend = nullptr;  // the optimizer's, as the first group's
  EXPECT_TRUE(LayerShardedMuon::Create(first.get(), groups).ok());
}

}  // namespace
}  // namespace muond
