// NorMuon and AdaMuon (core/muon/muon_variant.h) in a D x G x T domain
// against the single-process path (MuonStepFullMatrix with the variant, the
// same CPU backend) at ns_batch_size 1 / highest, for 3 steps with params
// skipped at step 2 and a param whose gradient is always zero:
//   * every rank's params bit for bit, except NorMuon's TP row-parallel
//     param (tp_dim 1 with T > 1: its row sums add T partial sums) within
//     fp32 rounding;
//   * no NaN from the zero gradient (its update is zero: only weight decay);
//   * each rank's exported variant state is its shard of the reference state
//     (bitwise where the params are), and an engine built fresh that imports
//     every rank's state after step 2 takes step 3 exactly as the
//     uninterrupted run.
// The ranks are threads over Gloo (loopback), as in dp_share_test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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
#include "core/muon/muon_variant.h"
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

// The mixed params and one whose grad is all zero (no NaN from the
// renormalisation).
std::vector<ParamCase> Params(const Layout& l) {
  std::vector<ParamCase> params = testing_layouts::MixedParams(l);
  params.push_back({"zero", 4, 6, 0, l.G > 1});
  return params;
}

std::vector<NsHome> Homes(const Layout& l) {
  return testing_layouts::Homes(Params(l), l);
}

// Set before the ranks start, read only while they run.
MuonVariant g_variant = MuonVariant::kNorMuon;
MatmulPrecision g_precision = MatmulPrecision::kHighest;

MuonOptions TestMuon() {
  MuonOptions o = testing_layouts::LayoutMuon(g_precision);
  o.variant = g_variant;
  o.beta2 = 0.9;
  o.moment2_eps = 1e-8;
  return o;
}

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
  std::vector<std::map<std::string, std::vector<float>>> states_after;
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
    if (opt.ok() && import_ != nullptr) {
      const absl::Status st = (*opt)->ImportState(*import_);
      if (!st.ok()) opt = st;
    }
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
      auto state = (*opt)->ExportState();
      run->states_after.push_back(
          state.ok() ? *state : std::map<std::string, std::vector<float>>{});
    }
  }

  // Loaded into the engine before the first attempt (null: none).
  const std::map<std::string, std::vector<float>>* import_ = nullptr;
  // Params as of the start (the resumed run starts from these).
  std::map<std::string, std::vector<float>>* start_params_ = nullptr;

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
    if (start_params_ != nullptr) {
      for (const ParamCase& p : params)
        params_[p.name] = start_params_->at(p.name);
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
    std::fill(grads_["zero"].begin(), grads_["zero"].end(), 0.0f);
  }

  const Layout l_;
  const int flat_;
  int d_ = 0, g_ = 0, t_ = 0;
  std::unique_ptr<Backend> backend_ = testing::MakeStepTestBackend();
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::map<std::string, std::vector<float>> params_, grads_;
  std::map<std::string, std::pair<int64_t, int64_t>> shapes_;
};

std::vector<RankRun> RunWorld(
    const Layout& l, const std::string& prefix,
    const std::vector<Attempt>& attempts,
    std::vector<std::map<std::string, std::vector<float>>>* imports = nullptr,
    std::vector<std::map<std::string, std::vector<float>>>* starts = nullptr) {
  InMemoryKeyValueStore store;
  std::vector<RankRun> runs(l.world());
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<std::thread> threads;
  for (int r = 0; r < l.world(); ++r) {
    ranks.push_back(std::make_unique<Rank>(l, r));
    if (imports != nullptr) ranks.back()->import_ = &(*imports)[r];
    if (starts != nullptr) ranks.back()->start_params_ = &(*starts)[r];
  }
  for (int r = 0; r < l.world(); ++r) {
    threads.emplace_back(
        [&, r] { ranks[r]->Run(&store, prefix, attempts, &runs[r]); });
  }
  for (std::thread& th : threads) th.join();
  return runs;
}

// The single-process path: param `p`'s full matrix and variant state after
// the steps `seeds` (0: skipped at that step).
struct Reference {
  std::vector<float> param, moment2;
};

Reference ReferenceRun(const ParamCase& p, const std::vector<int>& seeds) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const MuonOptions muon = TestMuon();
  Reference ref{FullMatrix(p.name, 0, p.rows, p.cols), {}};
  std::vector<float> grad(ref.param.size()), momentum(ref.param.size(), 0.0f),
      scratch(ref.param.size()), rows(3 * p.rows);
  const int64_t m2_cols = g_variant == MuonVariant::kNorMuon ? 1 : p.cols;
  ref.moment2.assign(p.rows * m2_cols, 0.0f);
  auto view = [&](std::vector<float>& v, int64_t cols) {
    return ContiguousView(v.data(), DType::kFloat32, p.rows, cols);
  };
  auto ns = NewtonSchulz::Create(backend.get(), muon.ns, p.rows, p.cols, 1);
  EXPECT_TRUE(ns.ok()) << ns.status();
  for (int seed : seeds) {
    if (seed == 0) continue;
    grad = FullMatrix(p.name, seed, p.rows, p.cols);
    if (p.name == "zero") std::fill(grad.begin(), grad.end(), 0.0f);
    const absl::Status st = MuonStepFullMatrix(
        *backend, muon, **ns, view(ref.param, p.cols), view(grad, p.cols),
        view(momentum, p.cols),
        // NS's input and output in the engine's dtype (bf16 under medium).
        ContiguousView(scratch.data(), NsWorkDType(muon.ns.precision), p.rows,
                       p.cols),
        view(ref.moment2, m2_cols), view(rows, 3));
    EXPECT_TRUE(st.ok()) << st;
  }
  return ref;
}

// Rank (g, t)'s shard of the reference state: NorMuon's rows of the shard
// (pad rows zero), AdaMuon's shard of the matrix.
std::vector<float> StateShard(const Reference& ref, const ParamCase& p,
                              const Layout& l, int g, int t) {
  int64_t rows, cols;
  if (g_variant == MuonVariant::kAdaMuon) {
    return Shard(ref.moment2, p, l, g, t, &rows, &cols);
  }
  ParamCase column = p;
  column.cols = 1;
  if (column.tp_dim == 1) column.tp_dim = -1;  // every TP rank: whole rows
  return Shard(ref.moment2, column, l, g, t, &rows, &cols);
}

bool Inexact(const ParamCase& p, const Layout& l) {
  return g_variant == MuonVariant::kNorMuon && p.tp_dim == 1 && l.T > 1;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 bool bitwise, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " [" << i << "]";
    if (bitwise) {
      ASSERT_EQ(0, std::memcmp(&got[i], &want[i], 4))
          << what << " [" << i << "]: " << got[i] << " vs " << want[i];
    } else {
      ASSERT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i])))
          << what << " [" << i << "]";
    }
  }
}

const char* kStateSuffix() {
  return g_variant == MuonVariant::kNorMuon ? ".variance_neuron" : ".moment2";
}

// Every rank's params and variant state after attempt `a` against the
// single-process path of `seeds`.
void ExpectReference(const Layout& l, const std::vector<RankRun>& runs,
                     size_t a, const std::vector<int>& all,
                     const std::vector<int>& skip2) {
  for (const ParamCase& p : Params(l)) {
    const bool skipped = p.name == "col" || p.name == "rep";
    const Reference ref = ReferenceRun(p, skipped ? skip2 : all);
    // The variant ran: its state holds the update's second moment.
    const bool some_state = std::any_of(ref.moment2.begin(), ref.moment2.end(),
                                        [](float x) { return x > 0.0f; });
    EXPECT_EQ(some_state, p.name != "zero") << p.name;
    for (int r = 0; r < l.world(); ++r) {
      const int g = (r / l.T) % l.G, t = r % l.T;
      int64_t rows, cols;
      const std::string what =
          absl::StrCat(std::string(MuonVariantName(g_variant)), " ", p.name,
                       " on rank ", r, " after attempt ", a);
      ExpectClose(runs[r].params_after[a].at(p.name),
                  Shard(ref.param, p, l, g, t, &rows, &cols), !Inexact(p, l),
                  what);
      ExpectClose(runs[r].states_after[a].at(
                      absl::StrCat("dense/", p.name, kStateSuffix())),
                  StateShard(ref, p, l, g, t), !Inexact(p, l),
                  what + " (state)");
    }
  }
}

StepInputs Skipping(std::set<std::string> names) {
  StepInputs in;
  in.skip_params = std::move(names);
  return in;
}

struct Case {
  MuonVariant variant;
  Layout layout;
  // Medium: bf16 NS, and Gram NS's fp16 result where the variant reads it.
  MatmulPrecision precision = MatmulPrecision::kHighest;
};

class VariantLayouts : public ::testing::TestWithParam<Case> {};

TEST_P(VariantLayouts, EqualTheSingleProcessPathAndResumeExactly) {
  g_variant = GetParam().variant;
  g_precision = GetParam().precision;
  const Layout l = GetParam().layout;
  const std::vector<Attempt> attempts = {
      {1},
      {2,
       [](int) {
         return Skipping({"col", "rep", "b"});
       }},
      {3}};
  const std::string prefix =
      absl::StrCat(std::string(MuonVariantName(g_variant)), l.D, "x", l.G, "x",
                   l.T, std::string(MatmulPrecisionName(g_precision)));
  const std::vector<RankRun> runs = RunWorld(l, prefix, attempts);
  for (int r = 0; r < l.world(); ++r) {
    ASSERT_EQ(runs[r].statuses.size(), attempts.size())
        << "rank " << r << ": " << runs[r].statuses.back();
    for (const absl::Status& st : runs[r].statuses) {
      ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st;
    }
  }
  ExpectReference(l, runs, 2, {1, 2, 3}, {1, 0, 3});
  // Resume: fresh engines import every rank's state after step 2 and take
  // step 3 from the params of step 2: the uninterrupted run's bits.
  std::vector<std::map<std::string, std::vector<float>>> states, starts;
  for (const RankRun& run : runs) {
    states.push_back(run.states_after[1]);
    starts.push_back(run.params_after[1]);
  }
  const std::vector<RankRun> resumed =
      RunWorld(l, prefix + "-resumed", {attempts[2]}, &states, &starts);
  for (int r = 0; r < l.world(); ++r) {
    ASSERT_EQ(resumed[r].statuses.size(), 1u) << resumed[r].statuses.back();
    ASSERT_TRUE(resumed[r].statuses[0].ok()) << resumed[r].statuses[0];
    for (const ParamCase& p : Params(l)) {
      ExpectClose(resumed[r].params_after[0].at(p.name),
                  runs[r].params_after[2].at(p.name), true,
                  absl::StrCat("resumed ", p.name, " on rank ", r));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, VariantLayouts,
    ::testing::Values(
        Case{MuonVariant::kNorMuon, {1, 1, 1}},
        Case{MuonVariant::kNorMuon, {2, 1, 1}},
        Case{MuonVariant::kNorMuon, {1, 2, 1}},
        Case{MuonVariant::kNorMuon, {1, 1, 2}},
        Case{MuonVariant::kNorMuon, {2, 2, 2}},
        Case{MuonVariant::kAdaMuon, {1, 1, 1}},
        Case{MuonVariant::kAdaMuon, {2, 2, 2}},
        Case{MuonVariant::kNorMuon, {2, 2, 2}, MatmulPrecision::kMedium},
        Case{MuonVariant::kAdaMuon, {2, 2, 2}, MatmulPrecision::kMedium}),
    [](const auto& info) {
      const Layout& l = info.param.layout;
      return absl::StrCat(
          std::string(MuonVariantName(info.param.variant)), "D", l.D, "G", l.G,
          "T", l.T, std::string(MatmulPrecisionName(info.param.precision)));
    });

}  // namespace
}  // namespace muond
