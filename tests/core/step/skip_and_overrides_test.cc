// Skipped params (StepInputs::skip_params, torch.optim's grad-None rule),
// per-step overrides of every hyperparameter torch reads at each step
// (momentum, nesterov, betas, eps), the domain's agreement on both, and
// per-param AdamW step counts.
//
// Two ranks (a 1x2 TP domain) run as threads over Gloo (loopback) with a job
// communicator, as a daemon's engine does. The reference is the
// single-process math on the same CPU backend: MuonStepFullMatrix on the full
// matrices and AdamWStep at the step count torch.optim would use
// (state[p]["step"] counts only the steps a param took), bit for bit (with
// ns_batch_size 1 the engine's numerics contract is bitwise).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/muon/adamw.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

constexpr int kT = 2;         // the domain: G = 1, T = 2
constexpr int64_t kRows = 8;  // full Muon shape, TP split of dim 0
constexpr int64_t kCols = 6;
constexpr int64_t kLocal = kRows / kT;
constexpr int64_t kAdamN = 5;  // each AdamW param: 1 x 5 on every rank
const char* const kMuonNames[] = {"w0", "w1"};
const char* const kAdamNames[] = {"b0", "b1"};

float Value(int rank, int param, int seed, int64_t i) {
  return float((rank * 7 + param * 13 + seed * 17 + i * 5) % 23) / 23.0f - 0.4f;
}

MuonOptions RegisteredMuon() {
  MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.1;
  return o;
}

AdamWOptions RegisteredAdamW() {
  AdamWOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.05;
  return o;
}

// One attempted step: each rank's inputs (`inputs(rank)`), gradient seed.
struct Attempt {
  std::function<StepInputs(int rank)> inputs;
  int seed = 1;
  // Params whose grad holds a NaN this attempt (its first element).
  std::set<std::string> nan_grads = {};
};

// What a rank saw: each attempt's status, and its params and exported state
// after it.
struct RankRun {
  std::vector<absl::Status> statuses;
  std::vector<std::map<std::string, std::vector<float>>> params_after;
  std::vector<std::map<std::string, std::vector<float>>> state_after;
};

// commit_delay_ms > 0: rank 1 votes on the commit that late, after its
// peers' communicator timeout (2 s then): every step is abandoned after its
// momentum phase.
void RunRank(InMemoryKeyValueStore* store, const std::string& prefix, int t,
             const std::vector<Attempt>* attempts, int commit_delay_ms,
             RankRun* run) {
  auto fail = [&](const absl::Status& st) { run->statuses.push_back(st); };
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = absl::Seconds(commit_delay_ms > 0 ? 2 : 8);
  auto tp = CreateGlooCommunicator(store, prefix + "/tp", t, kT, gloo);
  if (!tp.ok()) return fail(tp.status());
  auto job = CreateGlooCommunicator(store, prefix + "/job", t, kT, gloo);
  if (!job.ok()) return fail(job.status());
  std::unique_ptr<Backend> backend = testing::MakeStepTestBackend();
  std::map<std::string, std::vector<float>> params, grads;
  GroupConfig dense;
  dense.name = "dense";
  dense.muon = RegisteredMuon();
  dense.domain.size = DomainSize{1, kT};
  dense.domain.t = t;
  dense.domain.tp = tp->get();
  GroupConfig adam = dense;
  adam.name = "adam";
  adam.algorithm = Algorithm::kAdamW;
  adam.adamw = RegisteredAdamW();
  for (int p = 0; p < 2; ++p) {
    for (GroupConfig* g : {&dense, &adam}) {
      const bool muon = g == &dense;
      const std::string name = muon ? kMuonNames[p] : kAdamNames[p];
      const int64_t rows = muon ? kLocal : 1, cols = muon ? kCols : kAdamN;
      std::vector<float>& param = params[name];
      param.resize(rows * cols);
      grads[name].resize(rows * cols);
      for (int64_t i = 0; i < rows * cols; ++i) {
        param[i] = Value(t, muon ? p : p + 2, 0, i);
      }
      ParamBinding b;
      b.name = name;
      if (muon) {
        b.full_shape = {kRows, kCols};
        b.tags.tensor_model_parallel = true;
        b.tags.partition_dim = 0;
      }
      b.param = ContiguousView(param.data(), DType::kFloat32, rows, cols);
      b.grad = ContiguousView(grads[name].data(), DType::kFloat32, rows, cols);
      g->params.push_back(b);
    }
  }
  StepOptions options;
  options.job = job->get();
  if (t == 1) options.testonly_commit_delay_ms = commit_delay_ms;
  auto opt = LayerShardedMuon::Create(backend.get(), {dense, adam}, options);
  if (!opt.ok()) return fail(opt.status());
  for (const Attempt& a : *attempts) {
    for (int p = 0; p < 2; ++p) {
      for (auto& [name, pi] :
           {std::pair(kMuonNames[p], p), std::pair(kAdamNames[p], p + 2)}) {
        std::vector<float>& g = grads[name];
        for (size_t i = 0; i < g.size(); ++i) g[i] = Value(t, pi, a.seed, i);
        if (a.nan_grads.contains(name)) {
          g[0] = std::numeric_limits<float>::quiet_NaN();
        }
      }
    }
    run->statuses.push_back((*opt)->RunStep(a.inputs(t)).status());
    run->params_after.push_back(params);
    auto state = (*opt)->ExportState();
    if (!state.ok()) return fail(state.status());
    run->state_after.push_back(*state);
  }
}

std::vector<RankRun> RunWorld(const std::string& prefix,
                              const std::vector<Attempt>& attempts,
                              int commit_delay_ms = 0) {
  InMemoryKeyValueStore store;
  std::vector<RankRun> runs(kT);
  std::vector<std::thread> threads;
  for (int t = 0; t < kT; ++t) {
    threads.emplace_back(RunRank, &store, prefix, t, &attempts, commit_delay_ms,
                         &runs[t]);
  }
  for (std::thread& th : threads) th.join();
  return runs;
}

// One step of the reference: the seed of its gradients, the options, and
// whether the param is skipped (then nothing at all happens to it).
struct RefStep {
  int seed = 1;
  MuonOptions muon = RegisteredMuon();
  AdamWOptions adamw = RegisteredAdamW();
  bool skip = false;
};

// The full matrix of Muon param `p` after `steps`, its momentum too.
std::vector<float> ReferenceMuon(int p, const std::vector<RefStep>& steps,
                                 std::vector<float>* momentum_out = nullptr) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  auto full = [&](int seed) {
    std::vector<float> m(kRows * kCols);
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kCols; ++c) {
        m[r * kCols + c] =
            Value(int(r / kLocal), p, seed, (r % kLocal) * kCols + c);
      }
    }
    return m;
  };
  std::vector<float> param = full(0), momentum(kRows * kCols, 0.0f),
                     scratch(kRows * kCols);
  auto view = [](std::vector<float>& v) {
    return ContiguousView(v.data(), DType::kFloat32, kRows, kCols);
  };
  for (const RefStep& s : steps) {
    if (s.skip) continue;
    std::vector<float> grad = full(s.seed);
    auto ns = NewtonSchulz::Create(backend.get(), s.muon.ns, kRows, kCols, 1);
    EXPECT_TRUE(ns.ok()) << ns.status();
    const absl::Status st =
        MuonStepFullMatrix(*backend, s.muon, **ns, view(param), view(grad),
                           view(momentum), view(scratch));
    EXPECT_TRUE(st.ok()) << st;
  }
  EXPECT_TRUE(backend->Synchronize().ok());
  if (momentum_out != nullptr) *momentum_out = momentum;
  return param;
}

// AdamW param `p` of rank `t` after `steps`: torch.optim's per-param step
// count counts only the steps the param took.
std::vector<float> ReferenceAdamW(int t, int p,
                                  const std::vector<RefStep>& steps) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> param(kAdamN), grad(kAdamN), m(kAdamN, 0.0f),
      v(kAdamN, 0.0f);
  for (int64_t i = 0; i < kAdamN; ++i) param[i] = Value(t, p + 2, 0, i);
  auto view = [](std::vector<float>& x) {
    return ContiguousView(x.data(), DType::kFloat32, 1, kAdamN);
  };
  int64_t taken = 0;
  for (const RefStep& s : steps) {
    if (s.skip) continue;
    for (int64_t i = 0; i < kAdamN; ++i) grad[i] = Value(t, p + 2, s.seed, i);
    const absl::Status st = AdamWStep(*backend, s.adamw, ++taken, view(param),
                                      view(grad), view(m), view(v));
    EXPECT_TRUE(st.ok()) << st;
  }
  EXPECT_TRUE(backend->Synchronize().ok());
  return param;
}

void ExpectBits(const std::vector<float>& got, const std::vector<float>& want,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << what;
}

// Rank t's rows of a full Muon matrix.
std::vector<float> RowsOf(const std::vector<float>& full, int t) {
  return {full.begin() + t * kLocal * kCols,
          full.begin() + (t + 1) * kLocal * kCols};
}

// Every param of every rank after attempt `a` equals the reference of
// `muon[p]` / `adamw[p]` steps.
void ExpectReference(const std::vector<RankRun>& runs, size_t a,
                     const std::vector<std::vector<RefStep>>& muon,
                     const std::vector<std::vector<RefStep>>& adamw) {
  for (int p = 0; p < 2; ++p) {
    const std::vector<float> full = ReferenceMuon(p, muon[p]);
    for (int t = 0; t < kT; ++t) {
      ExpectBits(runs[t].params_after[a].at(kMuonNames[p]), RowsOf(full, t),
                 absl::StrCat(kMuonNames[p], " rank ", t, " attempt ", a));
      ExpectBits(runs[t].params_after[a].at(kAdamNames[p]),
                 ReferenceAdamW(t, p, adamw[p]),
                 absl::StrCat(kAdamNames[p], " rank ", t, " attempt ", a));
    }
  }
}

StepInputs Overriding(const StepOverrides& overrides) {
  StepInputs in;
  in.overrides = overrides;
  return in;
}

StepInputs Skipping(std::set<std::string> names) {
  StepInputs in;
  in.skip_params = std::move(names);
  return in;
}

TEST(SkipParams, SkippedParamsAndTheirStateStayOthersMatchTheReference) {
  // Step 2 skips w1 (Muon) and b0 (AdamW) on both ranks: torch.optim with
  // their grads None at step 2.
  const std::vector<Attempt> attempts = {{[](int) { return StepInputs{}; }, 1},
                                         {[](int) {
                                            return Skipping({"w1", "b0"});
                                          },
                                          2},
                                         {[](int) { return StepInputs{}; }, 3}};
  const std::vector<RankRun> runs = RunWorld("skip", attempts);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), 3u) << runs[t].statuses.back();
    for (const absl::Status& st : runs[t].statuses) ASSERT_TRUE(st.ok()) << st;
    // After step 2 the skipped params and their state are bitwise those
    // after step 1; the others moved.
    for (const char* name : {"w1", "b0"}) {
      ExpectBits(runs[t].params_after[1].at(name),
                 runs[t].params_after[0].at(name), name);
    }
    for (const std::string key : {"dense/w1.momentum", "adam/b0.exp_avg",
                                  "adam/b0.exp_avg_sq", "adam/b0.step"}) {
      ExpectBits(runs[t].state_after[1].at(key), runs[t].state_after[0].at(key),
                 key);
    }
    EXPECT_EQ(runs[t].state_after[1].at("adam/b0.step"), std::vector<float>{1});
    EXPECT_EQ(runs[t].state_after[1].at("adam/b1.step"), std::vector<float>{2});
    EXPECT_EQ(runs[t].state_after[2].at("adam/b0.step"), std::vector<float>{2});
    EXPECT_EQ(runs[t].state_after[2].at("adam/b1.step"), std::vector<float>{3});
    EXPECT_NE(runs[t].params_after[1].at("w0"),
              runs[t].params_after[0].at("w0"));
  }
  const std::vector<RefStep> all = {{.seed = 1}, {.seed = 2}, {.seed = 3}};
  const std::vector<RefStep> skip2 = {
      {.seed = 1}, {.seed = 2, .skip = true}, {.seed = 3}};
  ExpectReference(runs, 2, {all, skip2}, {skip2, all});
  // The momentum state of the skipped param equals the reference's too.
  std::vector<float> momentum;
  ReferenceMuon(1, skip2, &momentum);
  for (int t = 0; t < kT; ++t) {
    ExpectBits(runs[t].state_after[2].at("dense/w1.momentum"),
               RowsOf(momentum, t), "w1 momentum");
  }
}

// A skipped param's grad is not the step's (torch.optim: its grad is None):
// a NaN left in its buffer neither refuses nor skips the step, and the
// result is the reference's with the param skipped (that the check reads no
// skipped grad at all: grad_check_in_momentum_test).
TEST(SkipParams, ANanInASkippedParamsGradDoesNotStopTheStep) {
  const std::vector<Attempt> attempts = {{[](int) { return StepInputs{}; }, 1},
                                         {[](int) {
                                            return Skipping({"w1", "b0"});
                                          },
                                          2,
                                          {"w1", "b0"}},
                                         {[](int) { return StepInputs{}; }, 3}};
  const std::vector<RankRun> runs = RunWorld("skipnan", attempts);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), 3u);
    for (const absl::Status& st : runs[t].statuses) ASSERT_TRUE(st.ok()) << st;
  }
  const std::vector<RefStep> all = {{.seed = 1}, {.seed = 2}, {.seed = 3}};
  const std::vector<RefStep> skip2 = {
      {.seed = 1}, {.seed = 2, .skip = true}, {.seed = 3}};
  ExpectReference(runs, 2, {all, skip2}, {skip2, all});
}

// A step abandoned after its momentum phase (rank 1's commit vote comes
// after rank 0's communicator timeout): the momentum kernel has run, writing
// only the NS input, so the exported momentum is still the initial zeros
// (the kernel in place on the state would have made it (1-beta) g) and no
// param moved. The committed path, the same kernel storing the momentum at
// the commit, is held to the in-place reference by SkipParams above.
TEST(AbandonedStep, LeavesMomentumAndParamsBitwiseUnchanged) {
  const std::vector<Attempt> attempts = {{[](int) { return StepInputs{}; }, 1}};
  const std::vector<RankRun> runs =
      RunWorld("abandon", attempts, /*commit_delay_ms=*/3000);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), 1u);
    EXPECT_FALSE(runs[t].statuses[0].ok()) << "rank " << t;
    ASSERT_EQ(runs[t].state_after.size(), 1u);
    for (int p = 0; p < 2; ++p) {
      const std::string key =
          absl::StrCat("dense/", kMuonNames[p], ".momentum");
      ExpectBits(runs[t].state_after[0].at(key),
                 std::vector<float>(kLocal * kCols, 0.0f), key);
      std::vector<float> initial(kLocal * kCols);
      for (int64_t i = 0; i < kLocal * kCols; ++i)
        initial[i] = Value(t, p, 0, i);
      ExpectBits(runs[t].params_after[0].at(kMuonNames[p]), initial,
                 kMuonNames[p]);
    }
  }
}

TEST(Overrides, MomentumNesterovBetasEpsAreUsedForTheirStep) {
  StepOverrides o;
  o.momentum["dense"] = 0.5;
  o.nesterov["dense"] = false;
  o.beta1["adam"] = 0.8;
  o.beta2["adam"] = 0.99;
  o.eps["adam"] = 1e-6;
  StepOverrides lr_only;
  lr_only.lr["dense"] = 0.01;
  lr_only.lr["adam"] = 0.003;
  const std::vector<Attempt> attempts = {
      {[&](int) { return Overriding(o); }, 1},
      {[&](int) { return Overriding(lr_only); }, 2}};
  const std::vector<RankRun> runs = RunWorld("overrides", attempts);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), 2u) << runs[t].statuses.back();
    for (const absl::Status& st : runs[t].statuses) ASSERT_TRUE(st.ok()) << st;
  }
  RefStep first{.seed = 1}, second{.seed = 2};
  first.muon.momentum = 0.5;
  first.muon.nesterov = false;
  first.adamw.beta1 = 0.8;
  first.adamw.beta2 = 0.99;
  first.adamw.eps = 1e-6;
  second.muon.lr = 0.01;
  second.adamw.lr = 0.003;
  ExpectReference(runs, 1, {{first, second}, {first, second}},
                  {{first, second}, {first, second}});
  // And they made a difference: the registered values give other params.
  const std::vector<float> registered =
      ReferenceMuon(0, {{.seed = 1}, {.seed = 2}});
  EXPECT_NE(runs[0].params_after[1].at("w0"), RowsOf(registered, 0));
}

// Each case: rank 0's inputs differ from rank 1's; every rank refuses,
// naming the group and what differs, and nothing changes.
TEST(DomainAgreement, RanksThatSkipOrStepDifferentlyAreAllRefused) {
  StepOverrides momentum;
  momentum.momentum["dense"] = 0.5;
  StepOverrides beta1;
  beta1.beta1["adam"] = 0.5;
  struct Case {
    StepInputs rank0;
    std::string group, what;
  };
  const std::vector<Case> cases = {
      {Skipping({"w1"}), "dense", "skip_params"},
      {Skipping({"b1"}), "adam", "skip_params"},
      {Overriding(momentum), "dense", "momentum=0.5"},
      {Overriding(beta1), "adam", "beta1=0.5"}};
  std::vector<Attempt> attempts;
  for (const Case& c : cases) {
    attempts.push_back(
        {[&c](int rank) { return rank == 0 ? c.rank0 : StepInputs{}; }, 1});
  }
  // Then the ranks agree: the step applies as the reference's first.
  attempts.push_back({[](int) { return StepInputs{}; }, 1});
  const std::vector<RankRun> runs = RunWorld("disagree", attempts);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), attempts.size())
        << runs[t].statuses.back();
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(absl::StrCat("rank ", t, " case ", i));
      const absl::Status& st = runs[t].statuses[i];
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_TRUE(absl::StrContains(st.message(), "'" + cases[i].group + "'"))
          << st;
      EXPECT_TRUE(absl::StrContains(st.message(), "disagree")) << st;
      if (t == 0) {  // rank 0's side shows its own values
        EXPECT_TRUE(absl::StrContains(st.message(), cases[i].what)) << st;
      }
      // Nothing changed: the params are their initial values.
      for (int p = 0; p < 2; ++p) {
        for (const char* name : {kMuonNames[p], kAdamNames[p]}) {
          const std::vector<float>& got = runs[t].params_after[i].at(name);
          for (size_t k = 0; k < got.size(); ++k) {
            ASSERT_EQ(got[k], Value(t, name[0] == 'w' ? p : p + 2, 0, k))
                << name;
          }
        }
      }
      EXPECT_EQ(runs[t].state_after[i].at("adam/b0.step"),
                std::vector<float>{0});
    }
    ASSERT_TRUE(runs[t].statuses.back().ok()) << runs[t].statuses.back();
  }
  ExpectReference(runs, cases.size(), {{{.seed = 1}}, {{.seed = 1}}},
                  {{{.seed = 1}}, {{.seed = 1}}});
}

// -0.0 on one rank and 0.0 on another are the same value: the ranks agree.
TEST(DomainAgreement, NegativeZeroAgreesWithZero) {
  auto with = [](double momentum, double beta1) {
    StepOverrides o;
    o.momentum["dense"] = momentum;
    o.beta1["adam"] = beta1;
    return Overriding(o);
  };
  const std::vector<Attempt> attempts = {
      {[&](int rank) { return rank == 0 ? with(-0.0, -0.0) : with(0.0, 0.0); },
       1}};
  const std::vector<RankRun> runs = RunWorld("negzero", attempts);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), 1u);
    EXPECT_TRUE(runs[t].statuses[0].ok())
        << "rank " << t << ": " << runs[t].statuses[0];
  }
}

TEST(SkipParams, AnUnknownNameOnOneRankIsRefusedOnEveryRank) {
  const std::vector<Attempt> attempts = {
      {[](int rank) { return rank == 1 ? Skipping({"ghost"}) : StepInputs{}; },
       1},
      {[](int) { return StepInputs{}; }, 1}};
  const std::vector<RankRun> runs = RunWorld("unknown", attempts);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), 2u) << runs[t].statuses.back();
    const absl::Status& st = runs[t].statuses[0];
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_TRUE(absl::StrContains(st.message(),
                                  t == 1 ? "skip_params: 'ghost' names no param"
                                         : "rank 1 (a skip_params name"))
        << st;
    EXPECT_EQ(runs[t].state_after[0].at("adam/b1.step"), std::vector<float>{0});
    EXPECT_TRUE(runs[t].statuses[1].ok()) << runs[t].statuses[1];
  }
  ExpectReference(runs, 1, {{{.seed = 1}}, {{.seed = 1}}},
                  {{{.seed = 1}}, {{.seed = 1}}});
}

// A single-rank engine for the state tests.
struct SoloAdamW {
  std::vector<float> b0 = {0.1f, 0.2f}, b1 = {0.3f, 0.4f, 0.5f};
  std::vector<float> g0 = {1, 1}, g1 = {1, 1, 1};
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::unique_ptr<LayerShardedMuon> opt;

  SoloAdamW() {
    GroupConfig g;
    g.name = "adam";
    g.algorithm = Algorithm::kAdamW;
    g.adamw = RegisteredAdamW();
    for (auto [name, p, grad] :
         {std::tuple("b0", &b0, &g0), std::tuple("b1", &b1, &g1)}) {
      ParamBinding b;
      b.name = name;
      b.param = ContiguousView(p->data(), DType::kFloat32, 1, p->size());
      b.grad = ContiguousView(grad->data(), DType::kFloat32, 1, p->size());
      g.params.push_back(b);
    }
    auto created = LayerShardedMuon::Create(backend.get(), {g});
    EXPECT_TRUE(created.ok()) << created.status();
    opt = *std::move(created);
  }
};

TEST(AdamWStepCounts, PerParamKeysRoundTripAndOldGroupKeyGivesEveryParam) {
  SoloAdamW a;
  ASSERT_TRUE(a.opt->RunStep(Skipping({"b1"})).ok());
  auto state = a.opt->ExportState();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->at("adam/b0.step"), std::vector<float>{1});
  EXPECT_EQ(state->at("adam/b1.step"), std::vector<float>{0});
  EXPECT_FALSE(state->contains("adam/.step"));

  // Into a fresh engine: the counts travel per param.
  SoloAdamW b;
  ASSERT_TRUE(b.opt->ImportState(*state).ok());
  EXPECT_EQ(*b.opt->ExportState(), *state);

  // An old state map (one "<group>/.step"): every param gets its count.
  std::map<std::string, std::vector<float>> old = *state;
  old.erase("adam/b0.step");
  old.erase("adam/b1.step");
  old["adam/.step"] = {4};
  SoloAdamW c;
  ASSERT_TRUE(c.opt->ImportState(old).ok());
  auto imported = c.opt->ExportState();
  EXPECT_EQ(imported->at("adam/b0.step"), std::vector<float>{4});
  EXPECT_EQ(imported->at("adam/b1.step"), std::vector<float>{4});
  // Both kinds at once: the old key is refused by name, nothing written.
  old["adam/b0.step"] = {2};
  old["adam/b1.step"] = {2};
  const absl::Status both = c.opt->ImportState(old);
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument) << both;
  EXPECT_TRUE(absl::StrContains(both.message(), "adam/.step")) << both;
  EXPECT_EQ(c.opt->ExportState()->at("adam/b0.step"), std::vector<float>{4});

  // The next step uses each param's own count: b0 at step 5 after the old
  // group count 4, as AdamWStep with step 5.
  std::vector<float> want = a.b0, m(2, 0.0f), v(2, 0.0f), g = a.g0;
  // Reference from c's imported moments and params.
  const std::vector<float> exp_avg = imported->at("adam/b0.exp_avg"),
                           exp_avg_sq = imported->at("adam/b0.exp_avg_sq");
  m = exp_avg;
  v = exp_avg_sq;
  want = c.b0;
  auto view = [](std::vector<float>& x) {
    return ContiguousView(x.data(), DType::kFloat32, 1, x.size());
  };
  ASSERT_TRUE(AdamWStep(*c.backend, RegisteredAdamW(), 5, view(want), view(g),
                        view(m), view(v))
                  .ok());
  ASSERT_TRUE(c.opt->RunStep(StepInputs{}).ok());
  ExpectBits(c.b0, want, "b0 at step 5");
}

// Each step applies its own overrides to the registered options, and only
// its own: a step without overrides runs the registered ones, and a step
// refused for its overrides leaves nothing behind for the next (the engine
// resolves them once a step, GroupState::step_muon / step_adamw).
TEST(StepOverrides, EachStepRunsItsOwnOptionsWithNoneCarriedOver) {
  StepOverrides first;
  first.lr["dense"] = 0.05;
  first.momentum["dense"] = 0.5;
  first.weight_decay["dense"] = 0.0;
  first.lr["adam"] = 0.02;
  first.beta1["adam"] = 0.7;
  StepOverrides refused;  // momentum out of range
  refused.lr["dense"] = 0.3;
  refused.momentum["dense"] = 1.5;
  refused.lr["adam"] = 0.5;
  StepOverrides fourth;
  fourth.nesterov["dense"] = false;
  fourth.eps["adam"] = 1e-3;
  const std::vector<Attempt> attempts = {
      {[&](int) { return Overriding(first); }, 1},
      {[&](int) { return StepInputs{}; }, 2},
      {[&](int) { return Overriding(refused); }, 3},
      {[&](int) { return Overriding(fourth); }, 4},
      {[&](int) { return StepInputs{}; }, 5}};
  const std::vector<RankRun> runs = RunWorld("own_options", attempts);
  for (int t = 0; t < kT; ++t) {
    ASSERT_EQ(runs[t].statuses.size(), 5u) << runs[t].statuses.back();
    EXPECT_TRUE(runs[t].statuses[0].ok()) << runs[t].statuses[0];
    EXPECT_TRUE(runs[t].statuses[1].ok()) << runs[t].statuses[1];
    EXPECT_FALSE(runs[t].statuses[2].ok());
    EXPECT_TRUE(runs[t].statuses[3].ok()) << runs[t].statuses[3];
    EXPECT_TRUE(runs[t].statuses[4].ok()) << runs[t].statuses[4];
  }
  RefStep r1{.seed = 1}, r2{.seed = 2}, r4{.seed = 4}, r5{.seed = 5};
  r1.muon.lr = 0.05;
  r1.muon.momentum = 0.5;
  r1.muon.weight_decay = 0.0;
  r1.adamw.lr = 0.02;
  r1.adamw.beta1 = 0.7;
  r4.muon.nesterov = false;
  r4.adamw.eps = 1e-3;
  const std::vector<RefStep> steps = {r1, r2, r4, r5};
  ExpectReference(runs, 4, {steps, steps}, {steps, steps});
  ExpectReference(runs, 1, {{r1, r2}, {r1, r2}}, {{r1, r2}, {r1, r2}});
}

}  // namespace
}  // namespace muond
