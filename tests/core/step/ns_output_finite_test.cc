// Custom Newton-Schulz coefficients that leave the iteration dtype's range
// (an overflowing user schedule): refused, never applied.
//  a. A custom coefficient above fp16's 65504 where Gram NS iterates in fp16
//     is refused at registration, naming the tuple and the range.
//  b. A custom schedule whose coefficients fit but whose product overflows
//     (300^3 in fp16 Gram NS; 1e4 in fp32 standard NS) makes a NaN/Inf update
//     from finite gradients: every rank of the job refuses the step together,
//     params and momentum stay bitwise as before, and the next step runs.
//
// Two ranks (a 1x2 TP domain) run as threads over Gloo (loopback) with a job
// communicator, as a daemon's engine does. The expectation is independent of
// the engine: the params as registered (unchanged bits), zero momentum, and
// a zero-gradient step that only decays the weights.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {
namespace {

constexpr int kT = 2;
constexpr int64_t kRows = 8;  // 8 x 24: aspect 3, Gram NS under kGram
constexpr int64_t kCols = 24;
constexpr int64_t kLocal = kRows / kT;
constexpr float kLr = 0.02f;
constexpr float kWd = 0.1f;

float Value(int rank, int seed, int64_t i) {
  return float((rank * 7 + seed * 17 + i * 5) % 23) / 23.0f - 0.4f;
}

MuonOptions Muon(NsAlgorithm algorithm, MatmulPrecision precision,
                 std::vector<NsCoefficients> custom, int steps) {
  MuonOptions o;
  o.lr = kLr;
  o.momentum = 0.9;
  o.weight_decay = kWd;
  o.ns.algorithm = algorithm;
  o.ns.precision = precision;
  o.ns.coefficient_type = CoefficientType::kCustom;
  o.ns.custom = std::move(custom);
  o.ns.num_steps = steps;
  o.ns.gram_restarts = std::vector<int>{};
  return o;
}

struct RankRun {
  absl::Status create;
  std::vector<float> initial;
  std::map<std::string, std::vector<float>> state_before;
  absl::Status bad_step, next_step;
  std::vector<float> after_bad, after_next;
  std::map<std::string, std::vector<float>> state_after_bad;
};

void RunRank(InMemoryKeyValueStore* store, const MuonOptions* muon,
             bool skip_next, int t, RankRun* run) {
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = absl::Seconds(8);
  auto tp = CreateGlooCommunicator(store, "tp", t, kT, gloo);
  auto job = CreateGlooCommunicator(store, "job", t, kT, gloo);
  if (!tp.ok() || !job.ok()) {
    run->create = tp.ok() ? job.status() : tp.status();
    return;
  }
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> param(kLocal * kCols), grad(kLocal * kCols);
  for (size_t i = 0; i < param.size(); ++i) param[i] = Value(t, 0, i);
  run->initial = param;
  GroupConfig g;
  g.name = "dense";
  g.muon = *muon;
  g.domain.size = DomainSize{1, kT};
  g.domain.t = t;
  g.domain.tp = tp->get();
  ParamBinding b;
  b.name = "w0";
  b.full_shape = {kRows, kCols};
  b.tags.tensor_model_parallel = true;
  b.tags.partition_dim = 0;
  b.param = ContiguousView(param.data(), DType::kFloat32, kLocal, kCols);
  b.grad = ContiguousView(grad.data(), DType::kFloat32, kLocal, kCols);
  g.params.push_back(b);
  StepOptions options;
  options.job = job->get();
  auto opt = LayerShardedMuon::Create(backend.get(), {g}, options);
  run->create = opt.status();
  if (!opt.ok()) return;
  run->state_before = *(*opt)->ExportState();
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = Value(t, 1, i);
  StepInputs step1;
  step1.step_id = 1;
  run->bad_step = (*opt)->RunStep(step1).status();
  run->after_bad = param;
  run->state_after_bad = *(*opt)->ExportState();
  // Zero gradients into zero momentum: NS of zeros is zeros (finite).
  for (float& x : grad) x = 0.0f;
  StepInputs step2;
  step2.step_id = 2;
  if (skip_next) step2.skip_params = {"w0"};
  run->next_step = (*opt)->RunStep(step2).status();
  run->after_next = param;
}

std::vector<RankRun> RunWorld(const MuonOptions& muon, bool skip_next = false) {
  InMemoryKeyValueStore store;
  std::vector<RankRun> runs(kT);
  std::vector<std::thread> threads;
  for (int t = 0; t < kT; ++t) {
    threads.emplace_back(RunRank, &store, &muon, skip_next, t, &runs[t]);
  }
  for (std::thread& th : threads) th.join();
  return runs;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(NsOutputFinite, CustomCoefficientAboveFp16RefusedAtRegistration) {
  const MuonOptions muon =
      Muon(NsAlgorithm::kGram, MatmulPrecision::kMedium,
           {{3.4445f, -4.775f, 2.0315f}, {70000.0f, 0.0f, 0.0f}}, 2);
  const absl::Status st = muon.Validate();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "custom coefficients: tuple 1"))
      << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "fp16 range")) << st;
  for (const RankRun& r : RunWorld(muon)) {
    EXPECT_TRUE(absl::IsInvalidArgument(r.create)) << r.create;
    EXPECT_TRUE(absl::StrContains(r.create.message(), "tuple 1")) << r.create;
  }
  // The same coefficients are fine where nothing iterates in fp16.
  MuonOptions bf16 = muon;
  bf16.ns.gram_dtype = DType::kBFloat16;
  EXPECT_TRUE(bf16.Validate().ok()) << bf16.Validate();
  MuonOptions highest = muon;
  highest.ns.precision = MatmulPrecision::kHighest;
  EXPECT_TRUE(highest.Validate().ok()) << highest.Validate();
  MuonOptions standard = muon;
  standard.ns.algorithm = NsAlgorithm::kStandard;
  EXPECT_TRUE(standard.Validate().ok()) << standard.Validate();
}

// skip_next: the next step skips w0 (for a schedule that overflows whatever
// the input: fp16 Gram NS's Q alone reaches 300^3 even for zero gradients).
void ExpectRefusedThenNextStepRuns(const MuonOptions& muon, bool skip_next) {
  ASSERT_TRUE(muon.Validate().ok()) << muon.Validate();
  const std::vector<RankRun> runs = RunWorld(muon, skip_next);
  for (int t = 0; t < kT; ++t) {
    const RankRun& r = runs[t];
    ASSERT_TRUE(r.create.ok()) << r.create;
    EXPECT_TRUE(absl::IsInvalidArgument(r.bad_step)) << t << ": " << r.bad_step;
    // The rank that saw it names the param; a peer names the reason.
    const bool mine = absl::StrContains(r.bad_step.message(), "w0") &&
                      absl::StrContains(r.bad_step.message(),
                                        "Newton-Schulz output is not finite");
    const bool peer = absl::StrContains(
        r.bad_step.message(),
        "a non-finite Newton-Schulz output (custom coefficients)");
    EXPECT_TRUE(mine || peer) << t << ": " << r.bad_step;
    EXPECT_TRUE(SameBits(r.after_bad, r.initial)) << "rank " << t;
    ASSERT_EQ(r.state_after_bad.size(), r.state_before.size());
    for (const auto& [key, before] : r.state_before) {
      EXPECT_TRUE(SameBits(r.state_after_bad.at(key), before))
          << "rank " << t << " state " << key;
    }
    EXPECT_TRUE(r.next_step.ok()) << t << ": " << r.next_step;
    if (skip_next) {
      EXPECT_TRUE(SameBits(r.after_next, r.initial)) << "rank " << t;
      continue;
    }
    for (size_t i = 0; i < r.initial.size(); ++i) {
      EXPECT_NEAR(r.after_next[i], r.initial[i] * (1.0f - kLr * kWd), 1e-6f)
          << "rank " << t << " element " << i;
    }
  }
}

TEST(NsOutputFinite, Fp16GramOverflowRefusedOnEveryRank) {
  // 300 fits fp16; 300^3 times the normalised X does not.
  ExpectRefusedThenNextStepRuns(
      Muon(NsAlgorithm::kGram, MatmulPrecision::kMedium, {{300.0f, 0.0f, 0.0f}},
           3),
      /*skip_next=*/true);
}

TEST(NsOutputFinite, Fp32StandardOverflowRefusedOnEveryRank) {
  ExpectRefusedThenNextStepRuns(
      Muon(NsAlgorithm::kStandard, MatmulPrecision::kHighest,
           {{1e4f, -1e4f, 1e4f}}, 5),
      /*skip_next=*/false);
}

}  // namespace
}  // namespace muond
