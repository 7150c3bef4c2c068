// A Muon group with fp8 e4m3 momentum (MuonOptions::state_dtype) in the
// engine, one rank on the CPU backend: its steps, its exported state, the
// state's import/export round trip, a skipped param's state, and a step
// refused before its commit.
//
// The reference is independent of the engine's fp8 code: the state is kept
// by tests/core/backend/fp8_state_reference.h (dequantize, fp32 EMA,
// requantize), and the params by the single-process fp32 Muon step
// (MuonStepFullMatrix) run from an fp32 momentum equal to the dequantized
// state: the fp8 step computes the new momentum and the NS input from that
// value exactly as the fp32 step does, so the params match bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/muon/adamw.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"
#include "tests/core/backend/fp8_state_reference.h"

namespace muond {
namespace {

using testing::RefFp8State;

// w0: 20 x 30 (blocks of 256, 256 and 88 elements); w1: 12 x 8 with its
// grad a column block of a 12 x 11 matrix.
struct Shape {
  const char* name;
  int64_t rows, cols, grad_stride;
};
constexpr Shape kShapes[] = {{"w0", 20, 30, 30}, {"w1", 12, 8, 11}};

float Value(int param, int seed, int64_t i) {
  return float((param * 13 + seed * 17 + i * 5) % 23) / 23.0f - 0.4f;
}

MuonOptions Options(DType state_dtype) {
  MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.1;
  o.ns.precision = MatmulPrecision::kHighest;
  o.state_dtype = state_dtype;
  return o;
}

// One engine over params and grads it holds.
struct Engine {
  std::unique_ptr<Backend> backend = testing::MakeStepTestBackend();
  std::vector<std::vector<float>> params, grads;
  std::unique_ptr<LayerShardedMuon> opt;

  explicit Engine(const MuonOptions& options) {
    GroupConfig g;
    g.name = "dense";
    g.muon = options;
    g.domain.size = DomainSize{1, 1};
    for (int p = 0; p < 2; ++p) {
      const Shape& s = kShapes[p];
      params.emplace_back(s.rows * s.cols);
      grads.emplace_back(s.rows * s.grad_stride);
      for (size_t i = 0; i < params[p].size(); ++i) {
        params[p][i] = Value(p, 0, i);
      }
    }
    for (int p = 0; p < 2; ++p) {
      const Shape& s = kShapes[p];
      ParamBinding b;
      b.name = s.name;
      b.full_shape = {s.rows, s.cols};
      b.param =
          ContiguousView(params[p].data(), DType::kFloat32, s.rows, s.cols);
      b.grad = MatrixView{grads[p].data(), DType::kFloat32, s.rows, s.cols,
                          s.grad_stride};
      g.params.push_back(b);
    }
    auto created = LayerShardedMuon::Create(backend.get(), {g});
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) opt = *std::move(created);
  }
  void SetGrads(int seed) {
    for (int p = 0; p < 2; ++p) {
      for (size_t i = 0; i < grads[p].size(); ++i) {
        grads[p][i] = Value(p, seed, i);
      }
    }
  }
  absl::Status Step(int64_t id, std::set<std::string> skip = {}) {
    StepInputs in;
    in.step_id = id;
    in.skip_params = std::move(skip);
    return opt->RunStep(in).status();
  }
  std::map<std::string, std::vector<float>> State() {
    auto state = opt->ExportState();
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *state : std::map<std::string, std::vector<float>>{};
  }
};

// The reference of one param: its fp8 state and its params.
struct Reference {
  int p;
  RefFp8State state;
  std::vector<float> param;

  explicit Reference(int p_) : p(p_) {
    const Shape& s = kShapes[p];
    state = testing::RefQuantize(std::vector<float>(s.rows * s.cols, 0.0f));
    for (int64_t i = 0; i < s.rows * s.cols; ++i) {
      param.push_back(Value(p, 0, i));
    }
  }
  // The grad the engine sees, gathered from its strided rows.
  std::vector<float> Grad(int seed) const {
    const Shape& s = kShapes[p];
    std::vector<float> g;
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t c = 0; c < s.cols; ++c) {
        g.push_back(Value(p, seed, r * s.grad_stride + c));
      }
    }
    return g;
  }
  void Step(int seed) {
    const Shape& s = kShapes[p];
    std::vector<float> grad = Grad(seed);
    std::vector<float> momentum = testing::RefDequantize(state);
    std::vector<float> scratch(grad.size()), ns_input;
    state = testing::RefMomentumStep(state, grad, 0.9, true, &ns_input);
    std::unique_ptr<Backend> cpu = MakeCpuBackend();
    const MuonOptions fp32 = Options(DType::kFloat32);
    auto ns = NewtonSchulz::Create(cpu.get(), fp32.ns, s.rows, s.cols, 1);
    ASSERT_TRUE(ns.ok()) << ns.status();
    auto view = [&](std::vector<float>& v) {
      return ContiguousView(v.data(), DType::kFloat32, s.rows, s.cols);
    };
    const absl::Status st =
        MuonStepFullMatrix(*cpu, fp32, **ns, view(param), view(grad),
                           view(momentum), view(scratch));
    ASSERT_TRUE(st.ok()) << st;
    // The fp32 step's momentum is the fp8 step's before quantisation.
    const RefFp8State requantized = testing::RefQuantize(momentum);
    ASSERT_EQ(requantized.codes, state.codes);
  }
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void ExpectMatches(Engine& engine, const std::vector<Reference>& refs,
                   const std::string& when) {
  const auto state = engine.State();
  for (const Reference& r : refs) {
    const std::string key = std::string("dense/") + kShapes[r.p].name;
    EXPECT_TRUE(SameBits(engine.params[r.p], r.param)) << key << " " << when;
    EXPECT_TRUE(
        SameBits(state.at(key + ".momentum"), testing::RefDequantize(r.state)))
        << key << ".momentum " << when;
  }
}

TEST(Fp8StateEngine, StepsMatchTheReferenceAndSkippedParamsKeepTheirState) {
  Engine engine(Options(DType::kFloat8E4M3));
  ASSERT_NE(engine.opt, nullptr);
  std::vector<Reference> refs = {Reference(0), Reference(1)};
  for (int seed = 1; seed <= 3; ++seed) {
    engine.SetGrads(seed);
    ASSERT_TRUE(engine.Step(seed).ok());
    for (Reference& r : refs) r.Step(seed);
    ExpectMatches(engine, refs, "after step " + std::to_string(seed));
  }
  // w1 skipped: its params and state stay, w0 steps on.
  engine.SetGrads(4);
  ASSERT_TRUE(engine.Step(4, {"w1"}).ok());
  refs[0].Step(4);
  ExpectMatches(engine, refs, "after step 4 (w1 skipped)");
}

TEST(Fp8StateEngine, ExportImportExportIsBitIdenticalAndStepsOnTheSame) {
  Engine a(Options(DType::kFloat8E4M3));
  ASSERT_NE(a.opt, nullptr);
  for (int seed = 1; seed <= 2; ++seed) {
    a.SetGrads(seed);
    ASSERT_TRUE(a.Step(seed).ok());
  }
  const auto exported = a.State();
  Engine b(Options(DType::kFloat8E4M3));
  ASSERT_NE(b.opt, nullptr);
  b.params = a.params;
  ASSERT_TRUE(b.opt->ImportState(exported).ok());
  EXPECT_EQ(b.State(), exported);
  // The imported codes and scales are the exported ones: the next step is
  // bitwise the same.
  a.SetGrads(3);
  b.SetGrads(3);
  ASSERT_TRUE(a.Step(3).ok());
  ASSERT_TRUE(b.Step(3).ok());
  EXPECT_EQ(a.State(), b.State());
  EXPECT_TRUE(SameBits(a.params[0], b.params[0]));
  EXPECT_TRUE(SameBits(a.params[1], b.params[1]));
}

TEST(Fp8StateEngine, HostStateStepsAsDeviceState) {
  MuonOptions host = Options(DType::kFloat8E4M3);
  host.state_location = StateLocation::kHost;
  Engine a(Options(DType::kFloat8E4M3)), b(host);
  ASSERT_NE(a.opt, nullptr);
  ASSERT_NE(b.opt, nullptr);
  for (int seed = 1; seed <= 2; ++seed) {
    a.SetGrads(seed);
    b.SetGrads(seed);
    ASSERT_TRUE(a.Step(seed).ok());
    ASSERT_TRUE(b.Step(seed).ok());
  }
  EXPECT_EQ(a.params, b.params);
  EXPECT_EQ(a.State(), b.State());
}

TEST(Fp8StateEngine, ImportQuantizesFp32StatePerBlock) {
  Engine engine(Options(DType::kFloat8E4M3));
  ASSERT_NE(engine.opt, nullptr);
  std::map<std::string, std::vector<float>> fp32;
  for (int p = 0; p < 2; ++p) {
    std::vector<float> v(kShapes[p].rows * kShapes[p].cols);
    for (size_t i = 0; i < v.size(); ++i) v[i] = Value(p, 9, i) * 0.37f;
    fp32[std::string("dense/") + kShapes[p].name + ".momentum"] = v;
  }
  ASSERT_TRUE(engine.opt->ImportState(fp32).ok());
  for (const auto& [key, values] : engine.State()) {
    EXPECT_TRUE(SameBits(
        values, testing::RefDequantize(testing::RefQuantize(fp32.at(key)))))
        << key;
  }
}

TEST(Fp8StateEngine, ImportRecoversScalesThat448TimesDoesNotRoundTrip) {
  // Blocks of dequantized codes whose scale s has float(float(448 * s) / 448)
  // != s: the plain rule would pick a neighbour of s and change every value.
  std::vector<float> scales;
  for (float s = 1e-3f; scales.size() < 3; s = std::nextafter(s, 1.0f)) {
    const float absmax = 448.0f * s;
    if (absmax / 448.0f != s) scales.push_back(s);
  }
  Engine engine(Options(DType::kFloat8E4M3));
  ASSERT_NE(engine.opt, nullptr);
  std::map<std::string, std::vector<float>> state;
  for (int p = 0; p < 2; ++p) {
    const int64_t n = kShapes[p].rows * kShapes[p].cols;
    RefFp8State fp8;
    for (int64_t e = 0; e < n; ++e) {
      // Every block holds +-448 (code 0x7e) and codes of both signs.
      fp8.codes.push_back(uint8_t(e % 256 == 0 ? 0x7e : (e * 37) % 0xfe));
      if (fp8.codes.back() == 0x7f) fp8.codes.back() = 0x7d;
    }
    for (int64_t b = 0; b * 256 < n; ++b) fp8.scales.push_back(scales[b % 3]);
    state[std::string("dense/") + kShapes[p].name + ".momentum"] =
        testing::RefDequantize(fp8);
  }
  ASSERT_TRUE(engine.opt->ImportState(state).ok());
  const auto exported = engine.State();
  for (const auto& [key, values] : state) {
    EXPECT_TRUE(SameBits(exported.at(key), values)) << key;
  }
}

TEST(Fp8StateEngine, AStepRefusedBeforeItsCommitLeavesTheStateUntouched) {
  // Custom coefficients whose product overflows fp32: the NS output is not
  // finite and the step is refused after its momentum phase.
  MuonOptions bad = Options(DType::kFloat8E4M3);
  bad.ns.coefficient_type = CoefficientType::kCustom;
  bad.ns.custom = {{1e4f, -1e4f, 1e4f}};
  bad.ns.num_steps = 5;
  Engine engine(bad);
  ASSERT_NE(engine.opt, nullptr);
  Engine source(Options(DType::kFloat8E4M3));
  source.SetGrads(1);
  ASSERT_TRUE(source.Step(1).ok());
  const auto state = source.State();
  ASSERT_TRUE(engine.opt->ImportState(state).ok());
  const std::vector<std::vector<float>> params = engine.params;
  engine.SetGrads(2);
  const absl::Status st = engine.Step(1);
  EXPECT_TRUE(absl::StrContains(st.message(), "not finite")) << st;
  EXPECT_EQ(engine.State(), state);
  EXPECT_EQ(engine.params, params);
}

TEST(Fp8StateEngine, GroupStateBytesCountTheScales) {
  // 600 + 96 elements: 3 + 1 blocks of scales.
  EXPECT_EQ(
      StateBytes(DType::kFloat8E4M3, 600) + StateBytes(DType::kFloat8E4M3, 96),
      600 + 3 * 4 + 96 + 4);
}

TEST(Fp8StateEngine, AnUnknownStateDtypeIsRefusedNamingTheField) {
  MuonOptions o = Options(DType::kFloat16);
  const absl::Status st = o.Validate();
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "muon state_dtype")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "fp32, bf16 or fp8_e4m3")) << st;
}

// ---- AdamW with fp8 moments ------------------------------------------------

constexpr int64_t kAdamN = 300;  // 1 x 300: blocks of 256 and 44

AdamWOptions Fp8AdamWOptions() {
  AdamWOptions options;
  options.lr = 0.01;
  options.weight_decay = 0.05;
  options.state_dtype = DType::kFloat8E4M3;
  return options;
}

// One AdamW group "adam" of one param "b0" (1 x kAdamN) on `param`, `grad`.
std::pair<std::unique_ptr<Backend>, std::unique_ptr<LayerShardedMuon>>
MakeAdamW(const AdamWOptions& options, std::vector<float>& param,
          std::vector<float>& grad) {
  GroupConfig g;
  g.name = "adam";
  g.algorithm = Algorithm::kAdamW;
  g.adamw = options;
  g.domain.size = DomainSize{1, 1};
  ParamBinding b;
  b.name = "b0";
  b.param = ContiguousView(param.data(), DType::kFloat32, 1, kAdamN);
  b.grad = ContiguousView(grad.data(), DType::kFloat32, 1, kAdamN);
  g.params.push_back(b);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  auto opt = LayerShardedMuon::Create(backend.get(), {g});
  EXPECT_TRUE(opt.ok()) << opt.status();
  if (!opt.ok()) return {std::move(backend), nullptr};
  return {std::move(backend), *std::move(opt)};
}

TEST(Fp8StateEngine, AdamWMomentsStepExportAndImportLikeTheReference) {
  constexpr int64_t kN = kAdamN;
  const AdamWOptions options = Fp8AdamWOptions();
  auto make = [&](std::vector<float>& param, std::vector<float>& grad) {
    return MakeAdamW(options, param, grad);
  };
  std::vector<float> param(kN), grad(kN);
  for (int64_t i = 0; i < kN; ++i) param[i] = Value(2, 0, i);
  auto [backend, opt] = make(param, grad);
  std::vector<float> ref_param = param;
  RefFp8State ref_m = testing::RefQuantize(std::vector<float>(kN)),
              ref_v = ref_m;
  for (int step = 1; step <= 3; ++step) {
    for (int64_t i = 0; i < kN; ++i) grad[i] = Value(2, step, i);
    StepInputs in;
    in.step_id = step;
    ASSERT_TRUE(opt->RunStep(in).ok());
    const AdamWScalars s = MakeAdamWScalars(options, step);
    testing::RefAdamWFp8Step(
        ref_m, ref_v, ref_param, grad,
        {s.param_decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
         s.step_size, s.bias_correction2_sqrt, s.eps});
    EXPECT_TRUE(SameBits(param, ref_param)) << "step " << step;
    auto state = opt->ExportState();
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_TRUE(
        SameBits(state->at("adam/b0.exp_avg"), testing::RefDequantize(ref_m)))
        << "step " << step;
    EXPECT_TRUE(SameBits(state->at("adam/b0.exp_avg_sq"),
                         testing::RefDequantizeSquared(ref_v)))
        << "step " << step;
  }
  const auto exported = *opt->ExportState();
  std::vector<float> param2 = param, grad2(kN);
  auto [backend2, opt2] = make(param2, grad2);
  ASSERT_TRUE(opt2->ImportState(exported).ok());
  EXPECT_EQ(*opt2->ExportState(), exported);
}

// A finite fp32 value that bf16 cannot hold (it would round to inf) is
// refused naming the entry and the element, and nothing is loaded; the
// largest value below the threshold loads as bf16's max.
TEST(Fp8StateEngine, Bf16StateRefusesAnImportedValueThatOverflowsBf16) {
  Engine engine(Options(DType::kBFloat16));
  ASSERT_NE(engine.opt, nullptr);
  const auto before = engine.State();
  std::map<std::string, std::vector<float>> state = before;
  const float bf16_max = Bf16BitsToFloat(0x7f7f);
  const float threshold = BitsToFloat(kBf16OverflowThresholdBits);
  state["dense/w0.momentum"][0] = 0.5f;  // a change that must not land
  state["dense/w1.momentum"][5] = -threshold;
  // CheckImportState (a daemon's PREPARE) refuses it alike, writing nothing.
  const absl::Status checked = engine.opt->CheckImportState(state);
  EXPECT_TRUE(absl::IsInvalidArgument(checked)) << checked;
  EXPECT_TRUE(absl::StrContains(checked.message(), "element 5")) << checked;
  EXPECT_EQ(engine.State(), before);
  const absl::Status refused = engine.opt->ImportState(state);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "dense/w1.momentum"))
      << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "element 5")) << refused;
  EXPECT_EQ(engine.State(), before);
  state["dense/w1.momentum"][5] = -std::nextafter(threshold, 0.0f);
  EXPECT_TRUE(engine.opt->CheckImportState(state).ok());
  ASSERT_TRUE(engine.opt->ImportState(state).ok());
  EXPECT_EQ(engine.State()["dense/w1.momentum"][5], -bf16_max);
}

// exp_avg_sq imports as the codes of its square root per block, exports as
// the squares; exp_avg linearly.
TEST(Fp8StateEngine, AdamWSecondMomentImportsAsItsSquareRoot) {
  std::vector<float> param(kAdamN), grad(kAdamN);
  auto [backend, opt] = MakeAdamW(Fp8AdamWOptions(), param, grad);
  ASSERT_NE(opt, nullptr);
  std::vector<float> m(kAdamN), v(kAdamN);
  for (int64_t i = 0; i < kAdamN; ++i) {
    m[i] = Value(3, 1, i) * 0.1f;
    // Eight decades within a block: linear codes would flush the small ones.
    v[i] = std::pow(10.0f, -float(i % 9)) * (0.5f + Value(3, 2, i));
  }
  ASSERT_TRUE(opt->ImportState({{"adam/b0.exp_avg", m},
                                {"adam/b0.exp_avg_sq", v},
                                {"adam/b0.step", {4.0f}}})
                  .ok());
  const auto state = opt->ExportState();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_TRUE(SameBits(state->at("adam/b0.exp_avg"),
                       testing::RefDequantize(testing::RefQuantize(m))));
  const std::vector<float> v_back =
      testing::RefDequantizeSquared(testing::RefQuantizeRoot(v));
  EXPECT_TRUE(SameBits(state->at("adam/b0.exp_avg_sq"), v_back));
  for (int64_t i = 0; i < kAdamN; ++i) {
    EXPECT_GT(v_back[i], 0.0f) << "element " << i;
  }
}

// Blocks of squared codes whose scale s has float(float(448 * s) / 448) != s
// come back with s: exported second moments import bit for bit.
TEST(Fp8StateEngine, AdamWSecondMomentImportRecoversItsScales) {
  std::vector<float> scales;
  for (float s = 1e-3f; scales.size() < 2; s = std::nextafter(s, 1.0f)) {
    if (448.0f * s / 448.0f != s) scales.push_back(s);
  }
  RefFp8State root;
  for (int64_t e = 0; e < kAdamN; ++e) {
    // Every block holds 448 (code 0x7e) and the non-negative codes.
    root.codes.push_back(uint8_t(e % 256 == 0 ? 0x7e : (e * 37) % 0x7f));
  }
  root.scales = scales;
  std::vector<float> param(kAdamN), grad(kAdamN);
  auto [backend, opt] = MakeAdamW(Fp8AdamWOptions(), param, grad);
  ASSERT_NE(opt, nullptr);
  const std::map<std::string, std::vector<float>> state = {
      {"adam/b0.exp_avg", std::vector<float>(kAdamN)},
      {"adam/b0.exp_avg_sq", testing::RefDequantizeSquared(root)},
      {"adam/b0.step", {2.0f}}};
  ASSERT_TRUE(opt->ImportState(state).ok());
  EXPECT_EQ(*opt->ExportState(), state);
}

// One gradient spike of 1e7 in a block spans more than e4m3 holds below the
// block's largest second-moment root. The neighbours' roots must not code as
// 0 while their first moments live on: then a zero-grad step would move them
// by step_size * m / eps. Each moves no more than fp32 state moves it
// (rounded up, their divisor is at least the true one) but a rounding of m.
TEST(Fp8StateEngine, AdamWSpikeInABlockLeavesNoNeighbourDividedByEps) {
  auto run = [](DType state_dtype) {
    AdamWOptions options;
    options.lr = 1e-3;
    options.weight_decay = 0.0;
    options.state_dtype = state_dtype;
    std::vector<float> param(kAdamN, 0.0f), grad(kAdamN);
    auto [backend, opt] = MakeAdamW(options, param, grad);
    EXPECT_NE(opt, nullptr);
    std::vector<float> before;
    for (int step = 1; step <= 100 && opt != nullptr; ++step) {
      for (int64_t i = 0; i < kAdamN; ++i) grad[i] = step < 100 ? 1.0f : 0.0f;
      grad[0] = step == 1 ? 1e7f : 0.0f;
      if (step == 100) before = param;
      StepInputs in;
      in.step_id = step;
      EXPECT_TRUE(opt->RunStep(in).ok());
    }
    std::vector<float> moved(kAdamN);
    for (int64_t i = 0; i < kAdamN; ++i)
      moved[i] = std::fabs(param[i] - before[i]);
    return moved;
  };
  const std::vector<float> fp8 = run(DType::kFloat8E4M3);
  const std::vector<float> fp32 = run(DType::kFloat32);
  for (int64_t i = 1; i < 256; ++i) {
    ASSERT_GT(fp32[i], 0.0f) << i;
    EXPECT_LE(fp8[i], 1.07f * fp32[i]) << "element " << i;
  }
}

TEST(Fp8StateEngine, Bf16AdamWMomentsRoundTripAndCountTwoBytes) {
  AdamWOptions options;
  options.state_dtype = DType::kBFloat16;
  EXPECT_TRUE(options.Validate().ok()) << options.Validate();
  options.state_dtype = DType::kFloat16;
  const absl::Status st = options.Validate();
  EXPECT_TRUE(absl::StrContains(st.message(), "adamw state_dtype")) << st;
}

}  // namespace
}  // namespace muond
