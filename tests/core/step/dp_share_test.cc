// The DP axis of the step engine (docs/ARCHITECTURE.md "One step"): in a
// D x G x T domain every replica d holds the same shards; each Muon param is
// exchanged and orthogonalized only on its home replica (NsHome::d) and the
// dp_share phase copies its update to the others. Checked against the
// single-process reference (MuonStepFullMatrix on the full matrices, the same
// CPU backend), bit for bit at ns_batch_size 1 / highest:
//   * every rank's params after 3 steps, for 2x1x1, 4x1x1, 2x2x1, 2x1x2 and
//     2x2x2, with replicated, GTP_remat, TP and GTP_remat x TP params homed
//     on different replicas, an AdamW group (local only) and params skipped
//     at step 2;
//   * the NS runs of each rank (StepResult::ns_shapes counts) are those its
//     homes give it: none for a param homed on another replica;
//   * a step refused on one replica, replicas that skip differently and
//     replicas whose gradients differ (the domain agreement over the DP
//     group) are refused on every rank, and nothing changes.
// The ranks are threads over Gloo (loopback), with a job communicator, as a
// daemon's engine runs them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/groups.h"
#include "core/comm/kv_store.h"
#include "core/muon/adamw.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"
#include "tests/core/step/layout_cases.h"

namespace muond {
namespace {

using testing_layouts::FullMatrix;
using testing_layouts::Layout;
using testing_layouts::Pad;
using testing_layouts::ParamCase;
using testing_layouts::Shard;
using testing_layouts::SpecOf;

constexpr int kSteps = 3;
constexpr int64_t kAdamN = 5;  // the AdamW param: 1 x 5 on every rank

std::vector<ParamCase> Params(const Layout& l) {
  return testing_layouts::MixedParams(l);
}

std::vector<NsHome> Homes(const Layout& l) {
  return testing_layouts::Homes(Params(l), l);
}

// The NS runs rank (d, g, t) owes each step under `homes`, counted from the
// sharding model alone: a replicated param on every rank of its home
// replica, a GTP_remat one on its home row there, the others on their home
// rank; nothing for a param homed on another replica.
int64_t ExpectedNsRuns(const Layout& l, int d, int g, int t) {
  const std::vector<ParamCase> params = Params(l);
  const std::vector<NsHome> homes = Homes(l);
  int64_t runs = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamShardSpec spec = SpecOf(params[i], l);
    const NsHome& h = homes[i];
    if (h.d != d) continue;
    if (spec.sharding == ParamSharding::kReplicated) {
      ++runs;
    } else if (spec.sharding == ParamSharding::kGtpRemat) {
      runs += h.g == g;
    } else {
      runs += h.g == g && h.t == t;
    }
  }
  return runs;
}

MuonOptions TestMuon() { return testing_layouts::LayoutMuon(); }

AdamWOptions TestAdamW() {
  AdamWOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.05;
  return o;
}

float AdamValue(int flat, int step, int64_t i) {
  return float((flat * 7 + step * 17 + i * 5) % 23) / 23.0f - 0.4f;
}

// One attempted step: its gradients' step (seed) and each rank's inputs.
struct Attempt {
  int seed = 1;
  std::function<StepInputs(int d)> inputs = [](int) { return StepInputs{}; };
  // This rank's gradient differs from its replicas' (-1: none does).
  int differ_on_rank = -1;
};

// What a rank saw after each attempt.
struct RankRun {
  std::vector<absl::Status> statuses;
  std::vector<std::map<std::string, std::vector<float>>> params_after;
  std::vector<int64_t> ns_runs;
  std::vector<double> dp_share_us;
};

class Rank {
 public:
  Rank(const Layout& l, int flat) : l_(l), flat_(flat) {
    d_ = flat / (l.G * l.T);
    g_ = (flat / l.T) % l.G;
    t_ = flat % l.T;
  }

  void Run(KeyValueStore* store, const std::string& prefix,
           const std::vector<Attempt>& attempts, RankRun* run) {
    auto opt = Build(store, prefix);
    if (!opt.ok()) {
      run->statuses.push_back(opt.status());
      return;
    }
    for (const Attempt& a : attempts) {
      SetGrads(a.seed, a.differ_on_rank == flat_);
      absl::StatusOr<StepResult> result = (*opt)->RunStep(a.inputs(d_));
      run->statuses.push_back(result.status());
      int64_t ns_runs = 0;
      if (result.ok()) {
        for (const ShapeTiming& s : result->ns_shapes) ns_runs += s.count;
      }
      run->ns_runs.push_back(ns_runs);
      run->dp_share_us.push_back(result.ok() ? result->timings.dp_share_us
                                             : -1);
      run->params_after.push_back(params_);
    }
  }

 private:
  absl::StatusOr<std::unique_ptr<LayerShardedMuon>> Build(
      KeyValueStore* store, const std::string& prefix) {
    GlooOptions gloo;
    gloo.hostname = "127.0.0.1";
    gloo.timeout = absl::Seconds(8);
    const DomainSize size{l_.G, l_.T, l_.D};
    absl::StatusOr<DomainGroups> groups =
        SplitDomain(size, d_, g_, t_, prefix + "/dense");
    if (!groups.ok()) return groups.status();
    GroupConfig dense;
    dense.name = "dense";
    dense.muon = TestMuon();
    dense.domain.size = size;
    dense.domain.d = d_;
    dense.domain.g = g_;
    dense.domain.t = t_;
    struct Axis {
      const std::string& prefix;
      int rank, size;
      Communicator** comm;
    };
    for (const Axis& a :
         {Axis{groups->gtp_remat_prefix, g_, l_.G, &dense.domain.gtp},
          Axis{groups->tp_prefix, t_, l_.T, &dense.domain.tp},
          Axis{groups->dp_prefix, d_, l_.D, &dense.domain.dp}}) {
      if (a.size <= 1) continue;
      auto c = CreateGlooCommunicator(store, a.prefix, a.rank, a.size, gloo);
      if (!c.ok()) return c.status();
      *a.comm = c->get();
      comms_.push_back(*std::move(c));
    }
    auto job =
        CreateGlooCommunicator(store, prefix + "/job", flat_, l_.world(), gloo);
    if (!job.ok()) return job.status();
    StepOptions options;
    options.job = job->get();
    // NS runs are counted from the per-shape timings: every step, on a
    // device-like backend too.
    options.ns_shape_timing_every = 1;
    comms_.push_back(*std::move(job));
    GroupConfig adam = dense;
    adam.name = "adam";
    adam.algorithm = Algorithm::kAdamW;
    adam.adamw = TestAdamW();
    const std::vector<ParamCase> params = Params(l_);
    // Sized first: the views point into these vectors.
    for (const ParamCase& p : params) {
      int64_t r, c;
      params_[p.name] =
          Shard(FullMatrix(p.name, 0, p.rows, p.cols), p, l_, g_, t_, &r, &c);
      grads_[p.name].assign(r * c, 0.0f);
      shapes_[p.name] = {r, c};
    }
    params_["b"].resize(kAdamN);
    for (int64_t i = 0; i < kAdamN; ++i)
      params_["b"][i] = AdamValue(flat_, 0, i);
    grads_["b"].assign(kAdamN, 0.0f);
    for (const ParamCase& p : params) {
      dense.params.push_back(testing_layouts::BindingOf(
          p, l_, params_[p.name], grads_[p.name], shapes_[p.name]));
    }
    ParamBinding b;
    b.name = "b";
    b.param = ContiguousView(params_["b"].data(), DType::kFloat32, 1, kAdamN);
    b.grad = ContiguousView(grads_["b"].data(), DType::kFloat32, 1, kAdamN);
    adam.params.push_back(b);
    auto opt = LayerShardedMuon::Create(backend_.get(), {dense, adam}, options);
    if (!opt.ok()) return opt.status();
    const absl::Status homes = (*opt)->SetHomes("dense", Homes(l_));
    if (!homes.ok()) return homes;
    return opt;
  }

  // Every replica gets the same (full) gradients: DDP's all-reduced ones
  // (`differ`: this rank's "rep" gradient is off by one element).
  void SetGrads(int step, bool differ) {
    for (const ParamCase& p : Params(l_)) {
      int64_t r, c;
      const std::vector<float> shard = Shard(
          FullMatrix(p.name, step, p.rows, p.cols), p, l_, g_, t_, &r, &c);
      // Into the registered memory: the engine's views point at it.
      std::copy(shard.begin(), shard.end(), grads_[p.name].begin());
    }
    for (int64_t i = 0; i < kAdamN; ++i) {
      grads_["b"][i] = AdamValue(g_ * l_.T + t_, step, i);
    }
    if (differ) grads_["rep"][0] += 0.5f;
  }

  const Layout l_;
  const int flat_;
  int d_ = 0, g_ = 0, t_ = 0;
  std::unique_ptr<Backend> backend_ = testing::MakeStepTestBackend();
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::map<std::string, std::vector<float>> params_, grads_;
  std::map<std::string, std::pair<int64_t, int64_t>> shapes_;
};

std::vector<RankRun> RunWorld(const Layout& l, const std::string& prefix,
                              const std::vector<Attempt>& attempts) {
  InMemoryKeyValueStore store;
  std::vector<RankRun> runs(l.world());
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<std::thread> threads;
  for (int r = 0; r < l.world(); ++r) {
    ranks.push_back(std::make_unique<Rank>(l, r));
  }
  for (int r = 0; r < l.world(); ++r) {
    threads.emplace_back(
        [&, r] { ranks[r]->Run(&store, prefix, attempts, &runs[r]); });
  }
  for (std::thread& th : threads) th.join();
  return runs;
}

// Param `p`'s full matrix after the steps `seeds` (0: skipped at that step).
std::vector<float> ReferenceMuon(const ParamCase& p,
                                 const std::vector<int>& seeds) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const MuonOptions muon = TestMuon();
  std::vector<float> param = FullMatrix(p.name, 0, p.rows, p.cols);
  std::vector<float> grad(param.size()), momentum(param.size(), 0.0f),
      scratch(param.size());
  auto view = [&](std::vector<float>& v) {
    return ContiguousView(v.data(), DType::kFloat32, p.rows, p.cols);
  };
  auto ns = NewtonSchulz::Create(backend.get(), muon.ns, p.rows, p.cols, 1);
  EXPECT_TRUE(ns.ok()) << ns.status();
  for (int seed : seeds) {
    if (seed == 0) continue;
    grad = FullMatrix(p.name, seed, p.rows, p.cols);
    const absl::Status st =
        MuonStepFullMatrix(*backend, muon, **ns, view(param), view(grad),
                           view(momentum), view(scratch));
    EXPECT_TRUE(st.ok()) << st;
  }
  EXPECT_TRUE(backend->Synchronize().ok());
  return param;
}

// `flat`'s AdamW param after `seeds`, its gradients those of `shard` (its
// (g, t), the same on every replica).
std::vector<float> ReferenceAdamW(int flat, int shard,
                                  const std::vector<int>& seeds) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> param(kAdamN), grad(kAdamN), m(kAdamN, 0.0f),
      v(kAdamN, 0.0f);
  for (int64_t i = 0; i < kAdamN; ++i) param[i] = AdamValue(flat, 0, i);
  auto view = [](std::vector<float>& x) {
    return ContiguousView(x.data(), DType::kFloat32, 1, kAdamN);
  };
  int64_t taken = 0;
  for (int seed : seeds) {
    if (seed == 0) continue;
    for (int64_t i = 0; i < kAdamN; ++i) grad[i] = AdamValue(shard, seed, i);
    EXPECT_TRUE(AdamWStep(*backend, TestAdamW(), ++taken, view(param),
                          view(grad), view(m), view(v))
                    .ok());
  }
  return param;
}

void ExpectBits(const std::vector<float>& got, const std::vector<float>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << what;
}

// Every rank's params after attempt `a` equal the reference of `seeds`
// (per param name; "b" is the AdamW param).
void ExpectReference(const Layout& l, const std::vector<RankRun>& runs,
                     size_t a,
                     const std::map<std::string, std::vector<int>>& seeds) {
  for (const ParamCase& p : Params(l)) {
    const std::vector<float> full = ReferenceMuon(p, seeds.at(p.name));
    for (int r = 0; r < l.world(); ++r) {
      int64_t rows, cols;
      const std::vector<float> want =
          Shard(full, p, l, (r / l.T) % l.G, r % l.T, &rows, &cols);
      ExpectBits(runs[r].params_after[a].at(p.name), want,
                 absl::StrCat(p.name, " on rank ", r, " after attempt ", a));
    }
  }
  for (int r = 0; r < l.world(); ++r) {
    ExpectBits(runs[r].params_after[a].at("b"),
               ReferenceAdamW(r, r % (l.G * l.T), seeds.at("b")),
               absl::StrCat("AdamW b on rank ", r, " after attempt ", a));
  }
}

StepInputs Skipping(std::set<std::string> names) {
  StepInputs in;
  in.skip_params = std::move(names);
  return in;
}

class DpShare : public ::testing::TestWithParam<Layout> {};

TEST_P(DpShare, ParamsEqualTheReferenceAndNsRunsOnlyOnHomeReplicas) {
  const Layout l = GetParam();
  // Step 2 skips "col" (TP-sharded) and "rep" (replicated on replica 1) and
  // the AdamW param everywhere: torch.optim with their grads None.
  const std::vector<Attempt> attempts = {
      {1},
      {2,
       [](int) {
         return Skipping({"col", "rep", "b"});
       }},
      {3}};
  const std::vector<RankRun> runs =
      RunWorld(l, absl::StrCat("dp", l.D, "x", l.G, "x", l.T), attempts);
  for (int r = 0; r < l.world(); ++r) {
    ASSERT_EQ(runs[r].statuses.size(), attempts.size())
        << "rank " << r << ": " << runs[r].statuses.back();
    for (const absl::Status& st : runs[r].statuses) {
      ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st;
    }
    const int d = r / (l.G * l.T), g = (r / l.T) % l.G, t = r % l.T;
    for (size_t a = 0; a < attempts.size(); ++a) {
      // A skipped param still runs NS (on zeros): the counts do not change.
      EXPECT_EQ(runs[r].ns_runs[a], ExpectedNsRuns(l, d, g, t))
          << "rank " << r << " (d=" << d << ", g=" << g << ", t=" << t
          << ") step " << a + 1;
      EXPECT_GT(runs[r].dp_share_us[a], 0) << "rank " << r;
    }
  }
  const std::vector<int> all = {1, 2, 3}, skip2 = {1, 0, 3};
  ExpectReference(l, runs, 2,
                  {{"rep", skip2},
                   {"gtp", all},
                   {"col", skip2},
                   {"row", all},
                   {"col2", all},
                   {"b", skip2}});
  // The NS work is spread: each replica runs only its params' NS, so the
  // whole domain runs each param's NS on one replica only.
  int64_t total = 0;
  for (const RankRun& run : runs) total += run.ns_runs[0];
  int64_t one_replica = 0;
  const Layout single{1, l.G, l.T};
  for (int r = 0; r < single.world(); ++r) {
    for (int d = 0; d < l.D; ++d) {
      one_replica += ExpectedNsRuns(l, d, (r / l.T) % l.G, r % l.T);
    }
  }
  EXPECT_EQ(total, one_replica);
}

INSTANTIATE_TEST_SUITE_P(Layouts, DpShare,
                         ::testing::Values(Layout{2, 1, 1}, Layout{4, 1, 1},
                                           Layout{2, 2, 1}, Layout{2, 1, 2},
                                           Layout{2, 2, 2}),
                         [](const auto& info) {
                           const Layout& l = info.param;
                           return absl::StrCat("D", l.D, "G", l.G, "T", l.T);
                         });

// Nothing moved on any rank after attempt `a`: every param is its initial
// value.
void ExpectUnchanged(const Layout& l, const std::vector<RankRun>& runs,
                     size_t a) {
  ExpectReference(l, runs, a,
                  {{"rep", {}},
                   {"gtp", {}},
                   {"col", {}},
                   {"row", {}},
                   {"col2", {}},
                   {"b", {}}});
}

// After attempt `a`, every param on every rank has taken exactly one step,
// with the gradients of seed 1 (the accepted attempt's): the refused attempt
// before it changed nothing.
void ExpectEveryParamSteppedOnce(const Layout& l,
                                 const std::vector<RankRun>& runs, size_t a) {
  const std::vector<int> once = {1};
  ExpectReference(l, runs, a,
                  {{"rep", once},
                   {"gtp", once},
                   {"col", once},
                   {"row", once},
                   {"col2", once},
                   {"b", once}});
}

TEST(DpShareRefusals, AStepRefusedOnOneReplicaIsRefusedOnAll) {
  const Layout l{2, 1, 2};
  auto refused_on_replica1 = [](int d) {
    StepInputs in;
    if (d == 1) {
      in.refusal = absl::FailedPreconditionError("replica 1 refuses");
      in.refusal_code = RefusalCode::kOther;
    }
    return in;
  };
  const std::vector<Attempt> attempts = {{1, refused_on_replica1}, {1}};
  const std::vector<RankRun> runs = RunWorld(l, "refuse", attempts);
  for (int r = 0; r < l.world(); ++r) {
    ASSERT_EQ(runs[r].statuses.size(), 2u) << runs[r].statuses.back();
    EXPECT_FALSE(runs[r].statuses[0].ok()) << "rank " << r;
    if (r >= l.G * l.T) {
      EXPECT_TRUE(
          absl::StrContains(runs[r].statuses[0].message(), "replica 1 refuses"))
          << runs[r].statuses[0];
    }
    EXPECT_TRUE(runs[r].statuses[1].ok()) << runs[r].statuses[1];
  }
  ExpectUnchanged(l, runs, 0);
  ExpectEveryParamSteppedOnce(l, runs, 1);
}

TEST(DpShareRefusals, ReplicasWithDifferentGradientsAreRefusedOnEveryRank) {
  // D=2 x G=2: rank 3 (d=1, g=1) holds a gradient its replica rank 1 does
  // not; the replicas of g=0 agree. Without the check each replica would
  // fold its own gradient into its momentum and the two would drift apart.
  const Layout l{2, 2, 1};
  const std::vector<Attempt> attempts = {{.seed = 1, .differ_on_rank = 3},
                                         {.seed = 1}};
  const std::vector<RankRun> runs = RunWorld(l, "replica-grads", attempts);
  for (int r = 0; r < l.world(); ++r) {
    ASSERT_EQ(runs[r].statuses.size(), 2u) << runs[r].statuses.back();
    const absl::Status& st = runs[r].statuses[0];
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "group 'dense'")) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "hold different gradients"))
        << st;
    if (r % 2 == 1) {  // the replicas of g=1 name themselves and each side
      EXPECT_TRUE(absl::StrContains(st.message(),
                                    "its DP replicas of shard (g=1, t=0)"))
          << st;
      EXPECT_TRUE(absl::StrContains(st.message(), "d=0: 0x")) << st;
      EXPECT_TRUE(absl::StrContains(st.message(), "d=1: 0x")) << st;
    } else {
      EXPECT_TRUE(absl::StrContains(st.message(), "another shard")) << st;
    }
    EXPECT_TRUE(runs[r].statuses[1].ok()) << runs[r].statuses[1];
  }
  ExpectUnchanged(l, runs, 0);
  ExpectEveryParamSteppedOnce(l, runs, 1);
}

TEST(DpShareRefusals, ReplicasThatSkipDifferentlyAreRefusedOnEveryRank) {
  const Layout l{2, 1, 2};
  // Replica 0 skips "row" (homed on replica 1), replica 1 does not: each
  // replica agrees within itself, only the vote over the DP group sees it.
  const std::vector<Attempt> attempts = {
      {1, [](int d) { return d == 0 ? Skipping({"row"}) : StepInputs{}; }},
      {1}};
  const std::vector<RankRun> runs = RunWorld(l, "disagree", attempts);
  for (int r = 0; r < l.world(); ++r) {
    ASSERT_EQ(runs[r].statuses.size(), 2u) << runs[r].statuses.back();
    const absl::Status& st = runs[r].statuses[0];
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "'dense'")) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "disagree")) << st;
    EXPECT_TRUE(runs[r].statuses[1].ok()) << runs[r].statuses[1];
  }
  ExpectUnchanged(l, runs, 0);
  ExpectEveryParamSteppedOnce(l, runs, 1);
}

}  // namespace
}  // namespace muond
