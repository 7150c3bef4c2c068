// Muon scale modes exactly against the formulas, option validation, and a
// full Muon step (momentum, NS, scale, weight decay) vs an fp64 reference.
#include "core/muon/muon_update.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/muon/adamw.h"
#include "tests/core/muon/ns_reference.h"

namespace muond {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

MatrixView V(std::vector<float>& v, int64_t rows, int64_t cols) {
  return ContiguousView(v.data(), DType::kFloat32, rows, cols);
}

TEST(MuonScale, ModesMatchFormulasExactly) {
  for (auto [r, c] : {std::pair<int64_t, int64_t>{4096, 1024},
                      {1024, 4096},
                      {14336, 4096},
                      {7, 7}}) {
    const double rd = double(r), cd = double(c);
    EXPECT_EQ(MuonShapeScale(ScaleMode::kSpectral, r, c),
              std::sqrt(std::max(rd, cd)));
    EXPECT_EQ(MuonShapeScale(ScaleMode::kShapeScaling, r, c),
              std::sqrt(std::max(1.0, rd / cd)));
    EXPECT_EQ(MuonShapeScale(ScaleMode::kUnitRmsNorm, r, c),
              std::sqrt(rd / cd));
    EXPECT_EQ(MuonShapeScale(ScaleMode::kOriginal, r, c),
              std::sqrt(std::max(1.0, rd / cd)));
    EXPECT_EQ(MuonShapeScale(ScaleMode::kMatchRmsAdamW, r, c),
              0.2 * std::sqrt(std::max(rd, cd)));
    EXPECT_EQ(MuonScaleFactor(ScaleMode::kSpectral, r, c, 0.2),
              std::sqrt(std::max(rd, cd)) * 0.2);
  }
  EXPECT_EQ(MuonShapeScale(ScaleMode::kSpectral, 4096, 1024), 64.0);
  EXPECT_EQ(MuonShapeScale(ScaleMode::kUnitRmsNorm, 1024, 4096), 0.5);
  EXPECT_EQ(*ParseScaleMode("match_rms_adamw"), ScaleMode::kMatchRmsAdamW);
  EXPECT_FALSE(ParseScaleMode("rms").ok());
  EXPECT_EQ(*ParseWeightDecayMethod("cautious"), WeightDecayMethod::kCautious);
}

TEST(MuonScale, AdjustedLrIsLrTimesScaleRoundedOnce) {
  MuonOptions o;
  o.lr = 0.02;
  o.extra_scale_factor = 0.2;
  o.scale_mode = ScaleMode::kShapeScaling;
  EXPECT_EQ(*MuonAdjustedLr(o, 3000, 1000),
            float(0.02 * (std::sqrt(3000.0 / 1000.0) * 0.2)));
  o.scale_mode = ScaleMode::kOriginal;  // torch: lr * max(1, A/B)^0.5
  EXPECT_EQ(*MuonAdjustedLr(o, 1000, 3000), float(0.02 * 0.2));
  const absl::Status st = MuonAdjustedLr(o, 0, 3).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("full_rows"), std::string::npos) << st;
}

TEST(MuonOptions, ValidateNamesFieldAndRule) {
  auto expect = [](MuonOptions o, const char* needle) {
    const absl::Status s = o.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(s.message().find(needle), absl::string_view::npos) << s;
  };
  EXPECT_TRUE(MuonOptions{}.Validate().ok());
  MuonOptions o;
  o.lr = -1;
  expect(o, "lr");
  o = {};
  o.momentum = 1.0;
  expect(o, "momentum");
  o = {};
  o.weight_decay = NAN;
  expect(o, "weight_decay");
  o = {};
  o.extra_scale_factor = 0;
  expect(o, "extra_scale_factor");
  o = {};
  o.ns_batch_size = -1;  // 0 is auto
  expect(o, "ns_batch_size");
  o = {};
  o.ns.num_steps = 100;
  expect(o, "num_steps");
  o = {};
  o.ns.syrk_block_rows = 17;
  expect(o, "syrk_block_rows");
  AdamWOptions a;
  EXPECT_TRUE(a.Validate().ok());
  a.beta2 = 1.0;
  EXPECT_NE(a.Validate().message().find("beta2"), absl::string_view::npos);
  a = {};
  a.eps = 0;
  EXPECT_NE(a.Validate().message().find("eps"), absl::string_view::npos);
}

// Full step vs fp64: momentum EMA, (Nesterov) input, NS, scale, decay, update.
struct StepCase {
  bool nesterov;
  WeightDecayMethod wd;
  ScaleMode scale;
};

class MuonStep : public ::testing::TestWithParam<StepCase> {};

TEST_P(MuonStep, ThreeStepsMatchFp64Reference) {
  const auto [nesterov, wd, scale] = GetParam();
  auto backend = MakeCpuBackend();
  const int r = 24, c = 16;
  MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.9;
  o.nesterov = nesterov;
  o.weight_decay = 0.1;
  o.weight_decay_method = wd;
  o.scale_mode = scale;
  o.extra_scale_factor = 0.5;
  auto ns = *NewtonSchulz::Create(backend.get(), o.ns, r, c);
  std::vector<float> p = Random(r * c, 3), m(r * c, 0.0f), scratch(r * c);
  std::vector<double> pr(p.begin(), p.end()), mr(r * c, 0.0);
  std::vector<testing::Abc> sched;
  const std::vector<NsCoefficients> coeffs =
      *CoefficientSchedule(o.ns.coefficient_type, {}, 5);
  for (const NsCoefficients& k : coeffs) sched.push_back({k.a, k.b, k.c});
  for (int step = 0; step < 3; ++step) {
    std::vector<float> g = Random(r * c, 100 + step);
    ASSERT_TRUE(MuonStepFullMatrix(*backend, o, *ns, V(p, r, c), V(g, r, c),
                                   V(m, r, c), V(scratch, r, c))
                    .ok());
    std::vector<float> in(r * c);
    for (int i = 0; i < r * c; ++i) {
      mr[i] = mr[i] + (1 - o.momentum) * (g[i] - mr[i]);
      in[i] = float(nesterov ? g[i] + o.momentum * (mr[i] - g[i]) : mr[i]);
    }
    const testing::Mat orth =
        testing::NewtonSchulzRef(in, r, c, sched, o.ns.eps);
    const double s = MuonShapeScale(scale, r, c) * o.extra_scale_factor;
    for (int i = 0; i < r * c; ++i) {
      const double u = orth[i] * s;
      const bool decay = wd == WeightDecayMethod::kDecoupled ||
                         wd == WeightDecayMethod::kIndependent ||
                         (wd == WeightDecayMethod::kCautious && u * pr[i] > 0);
      const double factor = wd == WeightDecayMethod::kIndependent
                                ? o.weight_decay
                                : o.lr * o.weight_decay;
      if (decay) pr[i] -= factor * pr[i];
      pr[i] -= o.lr * u;
    }
    for (int i = 0; i < r * c; ++i) {
      EXPECT_NEAR(m[i], mr[i], 1e-5);
      EXPECT_NEAR(p[i], pr[i], 2e-5 * (1 + std::fabs(pr[i])))
          << step << " " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, MuonStep,
    ::testing::Values(
        StepCase{false, WeightDecayMethod::kDecoupled, ScaleMode::kSpectral},
        StepCase{true, WeightDecayMethod::kDecoupled, ScaleMode::kSpectral},
        StepCase{true, WeightDecayMethod::kIndependent,
                 ScaleMode::kShapeScaling},
        StepCase{false, WeightDecayMethod::kCautious, ScaleMode::kUnitRmsNorm},
        StepCase{true, WeightDecayMethod::kNone, ScaleMode::kOriginal},
        StepCase{false, WeightDecayMethod::kDecoupled,
                 ScaleMode::kMatchRmsAdamW}));

TEST(MuonStepState, Bf16StateAndParam) {
  auto backend = MakeCpuBackend();
  MuonOptions o;
  o.state_dtype = DType::kBFloat16;
  const int r = 8, c = 8;
  auto ns = *NewtonSchulz::Create(backend.get(), o.ns, r, c);
  std::vector<uint16_t> m(r * c, 0), p(r * c, 0x3f80);  // p = 1
  std::vector<float> g = Random(r * c, 5), scratch(r * c);
  MatrixView mv{m.data(), DType::kBFloat16, r, c, c},
      pv{p.data(), DType::kBFloat16, r, c, c};
  ASSERT_TRUE(
      MuonStepFullMatrix(*backend, o, *ns, pv, V(g, r, c), mv, V(scratch, r, c))
          .ok());
  // Momentum is the bf16 rounding of (1-beta) g; the fp32-state option is
  // rejected.
  for (int i = 0; i < r * c; ++i)
    EXPECT_EQ(m[i], FloatToBf16Bits(float(1 - 0.95) * g[i]));
  std::vector<float> mf(r * c);
  EXPECT_FALSE(
      MuonMomentumPhase(*backend, o, V(g, r, c), V(mf, r, c), V(scratch, r, c))
          .ok());
}

// AdamW: three steps vs a hand-written fp64 loop of torch.optim.AdamW.
TEST(AdamW, MatchesHandComputedSteps) {
  auto backend = MakeCpuBackend();
  for (bool bias_correction : {true, false}) {
    AdamWOptions o;
    o.lr = 1e-2;
    o.beta1 = 0.9;
    o.beta2 = 0.95;
    o.eps = 1e-8;
    o.weight_decay = 0.1;
    o.bias_correction = bias_correction;
    const int n = 33;
    std::vector<float> p = Random(n, 7), m(n, 0), v(n, 0);
    std::vector<double> pr(p.begin(), p.end()), mr(n, 0), vr(n, 0);
    for (int t = 1; t <= 3; ++t) {
      std::vector<float> g = Random(n, 20 + t);
      ASSERT_TRUE(AdamWStep(*backend, o, t, V(p, 1, n), V(g, 1, n), V(m, 1, n),
                            V(v, 1, n))
                      .ok());
      const double bc1 = bias_correction ? 1 - std::pow(o.beta1, t) : 1;
      const double bc2 = bias_correction ? 1 - std::pow(o.beta2, t) : 1;
      for (int i = 0; i < n; ++i) {
        pr[i] *= 1 - o.lr * o.weight_decay;
        mr[i] = o.beta1 * mr[i] + (1 - o.beta1) * g[i];
        vr[i] = o.beta2 * vr[i] + (1 - o.beta2) * double(g[i]) * g[i];
        pr[i] -=
            o.lr / bc1 * mr[i] / (std::sqrt(vr[i]) / std::sqrt(bc2) + o.eps);
      }
      for (int i = 0; i < n; ++i) {
        EXPECT_NEAR(m[i], mr[i], 1e-6 * (1 + std::fabs(mr[i])));
        EXPECT_NEAR(v[i], vr[i], 1e-6 * (1 + std::fabs(vr[i])));
        EXPECT_NEAR(p[i], pr[i], 1e-6 * (1 + std::fabs(pr[i])));
      }
    }
  }
  // Known value: step 1, g = 1, m = v = 0, no decay: p -= lr * 1/(1 + eps).
  std::vector<float> p = {0.5f}, g = {1.0f}, m = {0}, v = {0};
  AdamWOptions o;
  o.weight_decay = 0;
  ASSERT_TRUE(
      AdamWStep(*backend, o, 1, V(p, 1, 1), V(g, 1, 1), V(m, 1, 1), V(v, 1, 1))
          .ok());
  EXPECT_NEAR(p[0], 0.5 - 1e-3, 1e-7);
  EXPECT_FALSE(
      AdamWStep(*backend, o, 0, V(p, 1, 1), V(g, 1, 1), V(m, 1, 1), V(v, 1, 1))
          .ok());
}

}  // namespace
}  // namespace muond
