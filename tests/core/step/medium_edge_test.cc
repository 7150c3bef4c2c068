// Medium precision (bf16 Newton–Schulz, bf16 NS data path) at its edges, on
// one rank (a 1 x 1 domain: the same momentum -> NS -> update chain the
// daemons run, without the exchanges that system_test and
// layer_sharded_step_test cover): zero and huge gradients, bf16 momentum
// state, bf16 params and grads, batched NS, state export/import. Every
// result is checked against the single-process reference
// (MuonStepFullMatrix with a scratch in NsWorkDType) or a known value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/common/dtype.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {
namespace {

MuonOptions MediumOptions() {
  MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.95;
  o.nesterov = true;
  o.weight_decay = 0.1;
  o.ns.precision = MatmulPrecision::kMedium;
  return o;
}

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Storage for one matrix in `dtype` (fp32 or bf16), filled from fp32 values
// rounded once.
struct Matrix {
  DType dtype;
  int64_t rows, cols;
  std::vector<float> storage;  // room for either dtype

  Matrix(DType dt, int64_t r, int64_t c, const std::vector<float>& values)
      : dtype(dt), rows(r), cols(c), storage(r * c, 0.0f) {
    for (int64_t i = 0; i < r * c; ++i) Set(i, values[i]);
  }
  MatrixView view() {
    return ContiguousView(storage.data(), dtype, rows, cols);
  }
  float Get(int64_t i) const {
    if (dtype == DType::kFloat32) return storage[i];
    uint16_t b;
    std::memcpy(&b, reinterpret_cast<const char*>(storage.data()) + 2 * i, 2);
    return Bf16BitsToFloat(b);
  }
  void Set(int64_t i, float v) {
    if (dtype == DType::kFloat32) {
      storage[i] = v;
      return;
    }
    const uint16_t b = FloatToBf16Bits(v);
    std::memcpy(reinterpret_cast<char*>(storage.data()) + 2 * i, &b, 2);
  }
};

// One Muon param on a 1 x 1 domain.
struct Single {
  Matrix param, grad;
  std::unique_ptr<LayerShardedMuon> opt;
};

absl::StatusOr<std::unique_ptr<LayerShardedMuon>> MakeOptimizer(
    Backend* backend, const MuonOptions& options, Matrix& param, Matrix& grad,
    StepOptions step_options = {}) {
  GroupConfig cfg;
  cfg.name = "muon";
  cfg.muon = options;
  ParamBinding b;
  b.name = "w";
  b.full_shape = {param.rows, param.cols};
  b.param = param.view();
  b.grad = grad.view();
  cfg.params.push_back(b);
  return LayerShardedMuon::Create(backend, {cfg}, step_options);
}

// `steps` reference steps of MuonStepFullMatrix on a copy of `param0`.
std::vector<float> Reference(Backend& backend, const MuonOptions& options,
                             DType param_dtype, DType grad_dtype,
                             const std::vector<float>& param0,
                             const std::vector<std::vector<float>>& grads,
                             int64_t rows, int64_t cols) {
  Matrix p(param_dtype, rows, cols, param0);
  Matrix m(options.state_dtype, rows, cols,
           std::vector<float>(rows * cols, 0.0f));
  std::vector<float> scratch(rows * cols);
  auto ns = NewtonSchulz::Create(&backend, options.ns, rows, cols, 1);
  EXPECT_TRUE(ns.ok()) << ns.status();
  for (const std::vector<float>& gv : grads) {
    Matrix g(grad_dtype, rows, cols, gv);
    const absl::Status st = MuonStepFullMatrix(
        backend, options, **ns, p.view(), g.view(), m.view(),
        ContiguousView(scratch.data(), NsWorkDType(options.ns.precision), rows,
                       cols));
    EXPECT_TRUE(st.ok()) << st;
  }
  std::vector<float> out(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) out[i] = p.Get(i);
  return out;
}

void ExpectBitwise(const Matrix& got, const std::vector<float>& want) {
  int bad = 0;
  for (int64_t i = 0; i < got.rows * got.cols; ++i) {
    const float g = got.Get(i);
    if (std::memcmp(&g, &want[i], 4) != 0 && bad++ < 5) {
      ADD_FAILURE() << "element " << i << ": " << g << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0);
}

// The medium step on a 1 x 1 domain for param/grad dtypes and a state dtype,
// 3 steps, bitwise the reference.
void RunAgainstReference(DType param_dtype, DType grad_dtype, DType state_dtype,
                         int64_t rows, int64_t cols) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  MuonOptions options = MediumOptions();
  options.state_dtype = state_dtype;
  const std::vector<float> p0 = Random(rows * cols, 1, 0.5f);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < 3; ++s) grads.push_back(Random(rows * cols, 10 + s));
  Matrix param(param_dtype, rows, cols, p0);
  Matrix grad(grad_dtype, rows, cols, grads[0]);
  auto opt = MakeOptimizer(backend.get(), options, param, grad);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (const std::vector<float>& g : grads) {
    for (int64_t i = 0; i < rows * cols; ++i) grad.Set(i, g[i]);
    auto r = (*opt)->Step({});
    ASSERT_TRUE(r.ok()) << r.status();
  }
  ExpectBitwise(param, Reference(*backend, options, param_dtype, grad_dtype, p0,
                                 grads, rows, cols));
}

TEST(MediumEdge, Fp32ParamsAndStateBitwise) {
  RunAgainstReference(DType::kFloat32, DType::kFloat32, DType::kFloat32, 24,
                      16);
}

TEST(MediumEdge, Bf16MomentumStateBitwise) {
  RunAgainstReference(DType::kFloat32, DType::kFloat32, DType::kBFloat16, 16,
                      24);
}

TEST(MediumEdge, Bf16ParamsAndGradsBitwise) {
  RunAgainstReference(DType::kBFloat16, DType::kBFloat16, DType::kFloat32, 20,
                      20);
  RunAgainstReference(DType::kBFloat16, DType::kFloat32, DType::kBFloat16, 8,
                      32);
}

// A zero gradient has norm 0: NS sees 0 / max(0, eps) = 0 and returns 0, so
// the step is the weight decay alone, p * (1 - lr * wd), never NaN.
TEST(MediumEdge, ZeroGradGivesWeightDecayOnly) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const int64_t rows = 12, cols = 8;
  const std::vector<float> p0 = Random(rows * cols, 3);
  Matrix param(DType::kFloat32, rows, cols, p0);
  Matrix grad(DType::kFloat32, rows, cols, std::vector<float>(rows * cols));
  const MuonOptions options = MediumOptions();
  auto opt = MakeOptimizer(backend.get(), options, param, grad);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->Step({}).ok());
  ExpectBitwise(
      param, Reference(*backend, options, DType::kFloat32, DType::kFloat32, p0,
                       {std::vector<float>(rows * cols)}, rows, cols));
  for (int64_t i = 0; i < rows * cols; ++i) {
    ASSERT_TRUE(std::isfinite(param.Get(i))) << i;
    const float decay = float(1.0 - 0.02 * 0.1);
    EXPECT_NEAR(param.Get(i), p0[i] * decay, 1e-6f * std::abs(p0[i]));
  }
}

std::vector<float> ParamValues(const Matrix& m) {
  std::vector<float> out(m.rows * m.cols);
  for (int64_t i = 0; i < m.rows * m.cols; ++i) out[i] = m.Get(i);
  return out;
}

// A finite fp32 grad beyond the bf16 range rounds to inf in the bf16 NS
// input (or bf16 momentum) and would turn the whole update into NaN. The
// step must refuse it, naming the param and the rule, and change neither
// params nor momentum; with skip_nonfinite it is skipped. fp32 NS with fp32
// state carries the same grad fine.
TEST(MediumEdge, FiniteGradBeyondBf16RangeFailsTheStepAndChangesNothing) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const int64_t rows = 8, cols = 8;
  const std::vector<float> p0 = Random(rows * cols, 4);
  std::vector<float> g = Random(rows * cols, 5);
  g[3] = 3.4e38f;  // finite in fp32 (max 3.4028e38), inf in bf16
  struct Case {
    MatmulPrecision precision;
    DType state;
    bool refused;
    const char* holder;
  };
  for (const Case& c :
       {Case{MatmulPrecision::kMedium, DType::kFloat32, true, "medium"},
        Case{MatmulPrecision::kMedium, DType::kBFloat16, true, "medium"},
        Case{MatmulPrecision::kHighest, DType::kBFloat16, true, "momentum"},
        Case{MatmulPrecision::kHighest, DType::kFloat32, false, ""}}) {
    for (bool skip : {false, true}) {
      SCOPED_TRACE(absl::StrCat("precision ", int(c.precision), " state ",
                                std::string(DTypeName(c.state)), " skip ",
                                skip));
      MuonOptions o = MediumOptions();
      o.momentum = 0.0;  // the NS input is the grad itself
      o.ns.precision = c.precision;
      o.state_dtype = c.state;
      Matrix param(DType::kFloat32, rows, cols, p0);
      Matrix grad(DType::kFloat32, rows, cols, g);
      StepOptions so;
      so.skip_nonfinite = skip;
      auto opt = MakeOptimizer(backend.get(), o, param, grad, so);
      ASSERT_TRUE(opt.ok()) << opt.status();
      absl::StatusOr<StepResult> r = (*opt)->Step({});
      if (!c.refused) {
        ASSERT_TRUE(r.ok()) << r.status();
        EXPECT_TRUE(r->skipped_nonfinite.empty());
        for (float v : ParamValues(param)) ASSERT_TRUE(std::isfinite(v));
        continue;
      }
      std::string message;
      if (skip) {
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_EQ(r->skipped_nonfinite.size(), 1u);
        message = r->skipped_nonfinite[0];
      } else {
        ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
            << r.status();
        message = std::string(r.status().message());
      }
      EXPECT_NE(message.find("muon/w"), std::string::npos) << message;
      EXPECT_NE(message.find("beyond the bf16 range"), std::string::npos)
          << message;
      EXPECT_NE(message.find(c.holder), std::string::npos) << message;
      ExpectBitwise(param, p0);
      // Momentum untouched: a later clean step equals a fresh first step.
      const std::vector<float> clean = Random(rows * cols, 6);
      for (int64_t i = 0; i < rows * cols; ++i) grad.Set(i, clean[i]);
      ASSERT_TRUE((*opt)->Step({}).ok());
      ExpectBitwise(param, Reference(*backend, o, DType::kFloat32,
                                     DType::kFloat32, p0, {clean}, rows, cols));
    }
  }
}

// The largest grads the bf16 path holds (the bf16 max, and an fp32 value
// that still rounds to it) step normally and give finite params.
TEST(MediumEdge, GradAtTheBf16MaxSteps) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const int64_t rows = 8, cols = 8;
  const std::vector<float> p0 = Random(rows * cols, 7);
  std::vector<float> g = Random(rows * cols, 8);
  g[0] = Bf16BitsToFloat(0x7F7F);    // bf16 max, 3.3895e38
  g[1] = -BitsToFloat(0x7F7F7FFFu);  // rounds to -bf16 max
  Matrix param(DType::kFloat32, rows, cols, p0);
  Matrix grad(DType::kFloat32, rows, cols, g);
  MuonOptions o = MediumOptions();
  o.momentum = 0.0;
  auto opt = MakeOptimizer(backend.get(), o, param, grad);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->Step({}).ok());
  ExpectBitwise(param, Reference(*backend, o, DType::kFloat32, DType::kFloat32,
                                 p0, {g}, rows, cols));
  for (float v : ParamValues(param)) ASSERT_TRUE(std::isfinite(v));
}

// Save/load with medium: 2 steps, export, a fresh optimizer imports the
// state and takes the third step; bitwise the 3-step reference.
TEST(MediumEdge, ExportImportRoundTripBitwise) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const int64_t rows = 16, cols = 12;
  const MuonOptions o = MediumOptions();
  const std::vector<float> p0 = Random(rows * cols, 9, 0.5f);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < 3; ++s) grads.push_back(Random(rows * cols, 20 + s));
  Matrix param(DType::kFloat32, rows, cols, p0);
  Matrix grad(DType::kFloat32, rows, cols, grads[0]);
  std::map<std::string, std::vector<float>> state;
  {
    auto opt = MakeOptimizer(backend.get(), o, param, grad);
    ASSERT_TRUE(opt.ok()) << opt.status();
    for (int s = 0; s < 2; ++s) {
      for (int64_t i = 0; i < rows * cols; ++i) grad.Set(i, grads[s][i]);
      ASSERT_TRUE((*opt)->Step({}).ok());
    }
    auto exported = (*opt)->ExportState();
    ASSERT_TRUE(exported.ok()) << exported.status();
    state = *exported;
  }
  auto opt = MakeOptimizer(backend.get(), o, param, grad);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->ImportState(state).ok());
  for (int64_t i = 0; i < rows * cols; ++i) grad.Set(i, grads[2][i]);
  ASSERT_TRUE((*opt)->Step({}).ok());
  ExpectBitwise(param, Reference(*backend, o, DType::kFloat32, DType::kFloat32,
                                 p0, grads, rows, cols));
}

// bf16 momentum saves widened to fp32 and loads rounded back: 2 steps,
// export, a fresh optimizer imports and takes the third step, bitwise the
// uninterrupted 3-step run. An fp32 value that is not a bf16 value imports
// as its round-to-nearest-even bf16.
TEST(MediumEdge, Bf16StateExportImportRoundTripBitwise) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const int64_t rows = 8, cols = 12;
  MuonOptions o = MediumOptions();
  o.state_dtype = DType::kBFloat16;
  const std::vector<float> p0 = Random(rows * cols, 11, 0.5f);
  std::vector<std::vector<float>> grads;
  for (int s = 0; s < 3; ++s) grads.push_back(Random(rows * cols, 30 + s));
  Matrix param(DType::kFloat32, rows, cols, p0);
  Matrix grad(DType::kFloat32, rows, cols, grads[0]);
  auto run_steps = [&](LayerShardedMuon& opt, int from, int to) {
    for (int s = from; s < to; ++s) {
      for (int64_t i = 0; i < rows * cols; ++i) grad.Set(i, grads[s][i]);
      ASSERT_TRUE(opt.Step({}).ok());
    }
  };
  std::map<std::string, std::vector<float>> state;
  {
    auto opt = MakeOptimizer(backend.get(), o, param, grad);
    ASSERT_TRUE(opt.ok()) << opt.status();
    run_steps(**opt, 0, 2);
    auto exported = (*opt)->ExportState();
    ASSERT_TRUE(exported.ok()) << exported.status();
    state = *exported;
  }
  ASSERT_EQ(state.size(), 1u);
  const std::vector<float>& momentum = state.at("muon/w.momentum");
  ASSERT_EQ(int64_t(momentum.size()), rows * cols);
  int nonzero = 0;
  for (float m : momentum) {
    EXPECT_EQ(FloatBits(m), FloatBits(RoundToBf16(m))) << "not a bf16 value";
    nonzero += m != 0.0f;
  }
  EXPECT_GT(nonzero, 0);

  auto opt = MakeOptimizer(backend.get(), o, param, grad);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->ImportState(state).ok());
  run_steps(**opt, 2, 3);
  ExpectBitwise(param, Reference(*backend, o, DType::kFloat32, DType::kFloat32,
                                 p0, grads, rows, cols));

  // fp32 values that bf16 cannot hold are rounded on import.
  std::vector<float> fine(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) fine[i] = 1.0f + float(i) / 1024.0f;
  ASSERT_TRUE((*opt)->ImportState({{"muon/w.momentum", fine}}).ok());
  auto back = (*opt)->ExportState();
  ASSERT_TRUE(back.ok()) << back.status();
  for (int64_t i = 0; i < rows * cols; ++i) {
    EXPECT_EQ(FloatBits(back->at("muon/w.momentum")[i]),
              FloatBits(RoundToBf16(fine[i])))
        << i;
  }
}

// A state entry of the wrong size is refused naming it, and nothing changes.
TEST(MediumEdge, Bf16StateImportOfAWrongSizeChangesNothing) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const int64_t rows = 8, cols = 8;
  MuonOptions o = MediumOptions();
  o.state_dtype = DType::kBFloat16;
  const std::vector<float> p0 = Random(rows * cols, 11);
  Matrix param(DType::kFloat32, rows, cols, p0);
  Matrix grad(DType::kFloat32, rows, cols, Random(rows * cols, 12));
  auto opt = MakeOptimizer(backend.get(), o, param, grad);
  ASSERT_TRUE(opt.ok()) << opt.status();
  const absl::Status imported = (*opt)->ImportState(
      {{"muon/w.momentum", std::vector<float>(rows * cols - 1, 1.0f)}});
  EXPECT_EQ(imported.code(), absl::StatusCode::kInvalidArgument) << imported;
  EXPECT_NE(imported.message().find("muon/w.momentum"), std::string::npos);
  // The momentum is still zero: the first step equals the reference's.
  ASSERT_TRUE((*opt)->Step({}).ok());
  ExpectBitwise(param, Reference(*backend, o, DType::kFloat32, DType::kFloat32,
                                 p0, {Random(rows * cols, 12)}, rows, cols));
}

}  // namespace
}  // namespace muond
