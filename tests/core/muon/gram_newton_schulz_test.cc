// Gram Newton–Schulz on the CPU backend: the fp64 Gram reference equals the
// fp64 standard reference (the algebra), muond's fp32 Gram matches the fp64
// reference, fp16/bf16 iteration within their rounding, batching, the
// zero matrix, dispatch by aspect ratio, FLOP counts, default restarts and
// validation.
#include "core/muon/gram_newton_schulz.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_join.h"
#include "core/backend/cpu_backend.h"
#include "core/muon/newton_schulz.h"
#include "tests/core/muon/ns_reference.h"

namespace muond {
namespace {

using testing::Abc;
using testing::Mat;

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

std::vector<Abc> ScheduleOf(const NsOptions& o) {
  // Held in a named vector: a range-for over *StatusOr<vector>{} would
  // iterate a destroyed temporary.
  const std::vector<NsCoefficients> schedule =
      *CoefficientSchedule(o.coefficient_type, o.custom, o.num_steps);
  std::vector<Abc> out;
  for (const NsCoefficients& k : schedule) out.push_back({k.a, k.b, k.c});
  return out;
}

double RelDiff(const Mat& a, const Mat& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

NsOptions GramOptions(CoefficientType type, int steps) {
  NsOptions o;
  o.algorithm = NsAlgorithm::kGram;
  o.coefficient_type = type;
  o.num_steps = steps;
  return o;
}

std::vector<float> RunGram(const NsOptions& o, std::vector<float> g,
                           int64_t rows, int64_t cols) {
  auto backend = MakeCpuBackend();
  auto ns = GramNewtonSchulz::Create(backend.get(), o, rows, cols);
  EXPECT_TRUE(ns.ok()) << ns.status();
  std::vector<float> out(g.size(), -1.0f);
  const absl::Status s = (*ns)->Run(V(g, rows, cols), V(out, rows, cols), 1);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// The shapes: wide and tall, aspect 3 and 5/2.
const std::pair<int, int> kShapes[] = {{8, 24}, {24, 8}, {12, 30}, {30, 12}};

TEST(GramReference, EqualsStandardInFp64ForSeveralRestartSets) {
  // A well-conditioned input: the standard and Gram evaluations of the same
  // polynomial agree to rounding in fp64.
  for (auto [rows, cols] : kShapes) {
    const std::vector<float> g = Random(rows * cols, rows * 7 + cols);
    for (CoefficientType t :
         {CoefficientType::kQuintic, CoefficientType::kPolarExpress,
          CoefficientType::kSimple}) {
      const std::vector<Abc> sched = ScheduleOf(GramOptions(t, 5));
      const Mat want = testing::NewtonSchulzRef(g, rows, cols, sched, 1e-15);
      for (const std::vector<int>& restarts :
           std::vector<std::vector<int>>{{}, {2}, {1, 3}, {1, 2, 3, 4}}) {
        const Mat got =
            testing::GramNewtonSchulzRef(g, rows, cols, sched, restarts, 1e-15);
        EXPECT_LT(RelDiff(got, want), 1e-10)
            << rows << "x" << cols << " " << CoefficientTypeName(t)
            << " restarts " << restarts.size();
      }
    }
  }
}

TEST(GramNewtonSchulz, Fp32MatchesFp64ReferenceWideAndTall) {
  for (auto [rows, cols] : kShapes) {
    const std::vector<float> g = Random(rows * cols, rows * 11 + cols);
    for (const std::vector<int>& restarts : std::vector<std::vector<int>>{
             {}, {2}, {1, 3}, {1, 2}, {4}, {1, 2, 3, 4}}) {
      // Consecutive restarts and a restart at the last step too: each makes
      // a fresh Q from Z (Z's buffer and Q's trade places).
      NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
      o.gram_restarts = restarts;
      const std::vector<float> got = RunGram(o, g, rows, cols);
      const Mat want = testing::GramNewtonSchulzRef(
          g, rows, cols, ScheduleOf(o), restarts, o.eps);
      EXPECT_LT(testing::RelFrobDiff(got, want), 1e-5)
          << rows << "x" << cols << " restarts "
          << absl::StrJoin(restarts, ",");
    }
  }
}

// Short and custom schedules: one step (no R update, no restart possible),
// two steps, and a cubic step (c == 0: Z's product runs with alpha 0).
TEST(GramNewtonSchulz, ShortAndCubicSchedulesMatchTheReference) {
  NsOptions o = GramOptions(CoefficientType::kCustom, 1);
  o.custom = {{3.0f, -3.2f, 1.2f}, {1.5f, -0.5f, 0.0f}, {2.0f, -1.5f, 0.5f}};
  for (int steps : {1, 2, 3, 7}) {
    o.num_steps = steps;
    for (auto [rows, cols] : kShapes) {
      const std::vector<float> g = Random(rows * cols, steps * 31 + rows);
      const std::vector<int> restarts = GramRestarts(o);
      const std::vector<float> got = RunGram(o, g, rows, cols);
      const Mat want = testing::GramNewtonSchulzRef(
          g, rows, cols, ScheduleOf(o), restarts, o.eps);
      EXPECT_LT(testing::RelFrobDiff(got, want), 1e-5)
          << steps << " steps " << rows << "x" << cols;
      EXPECT_LT(RelDiff(want, testing::NewtonSchulzRef(g, rows, cols,
                                                       ScheduleOf(o), o.eps)),
                1e-10);
    }
  }
}

// fp16 (11 significant bits) and bf16 (8) iterations vs the fp64 reference
// (measured 1.1e-3..1.7e-3 and 0.9e-2..1.7e-2 on these shapes):
// within their rounding, and fp16 closer than bf16 (why it is the default).
TEST(GramNewtonSchulz, MediumFp16AndBf16WithinTheirRounding) {
  for (auto [rows, cols] : kShapes) {
    const std::vector<float> g = Random(rows * cols, rows * 13 + cols);
    NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
    o.precision = MatmulPrecision::kMedium;
    const Mat want = testing::GramNewtonSchulzRef(g, rows, cols, ScheduleOf(o),
                                                  GramRestarts(o), o.eps);
    o.gram_dtype = DType::kFloat16;
    const double e16 = testing::RelFrobDiff(RunGram(o, g, rows, cols), want);
    o.gram_dtype = DType::kBFloat16;
    const double ebf = testing::RelFrobDiff(RunGram(o, g, rows, cols), want);
    EXPECT_LT(e16, 4e-3) << rows << "x" << cols;
    EXPECT_LT(ebf, 4e-2) << rows << "x" << cols;
    EXPECT_GT(e16, 1e-6) << "fp16 path ran in fp32?";
    EXPECT_LT(e16, ebf) << rows << "x" << cols;
  }
}

TEST(GramNewtonSchulz, BatchEqualsPerSliceBitwise) {
  auto backend = MakeCpuBackend();
  for (auto [rows, cols] : kShapes) {
    for (MatmulPrecision p :
         {MatmulPrecision::kHighest, MatmulPrecision::kMedium}) {
      NsOptions o = GramOptions(CoefficientType::kPolarExpress, 5);
      o.precision = p;
      const int64_t batch = 3, slice = rows * cols;
      std::vector<float> g = Random(batch * slice, 99 + rows);
      auto ns = GramNewtonSchulz::Create(backend.get(), o, rows, cols, batch);
      ASSERT_TRUE(ns.ok()) << ns.status();
      std::vector<float> out(g.size());
      ASSERT_TRUE(
          (*ns)
              ->Run(V(g, batch * rows, cols), V(out, batch * rows, cols), batch)
              .ok());
      for (int64_t s = 0; s < batch; ++s) {
        std::vector<float> one(g.begin() + s * slice,
                               g.begin() + (s + 1) * slice);
        std::vector<float> o1(slice);
        ASSERT_TRUE((*ns)->Run(V(one, rows, cols), V(o1, rows, cols), 1).ok());
        for (int64_t i = 0; i < slice; ++i)
          ASSERT_EQ(out[s * slice + i], o1[i]) << "slice " << s << " " << i;
      }
    }
  }
}

TEST(GramNewtonSchulz, ZeroMatrixGivesZero) {
  for (MatmulPrecision p :
       {MatmulPrecision::kHighest, MatmulPrecision::kMedium}) {
    NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
    o.precision = p;
    for (float v : RunGram(o, std::vector<float>(8 * 24, 0.0f), 8, 24))
      ASSERT_EQ(v, 0.0f);
  }
}

// A strided fp32 output under kMedium (the fp16 result converted once) and
// in == out aliasing.
TEST(GramNewtonSchulz, StridedAndInPlaceOutput) {
  auto backend = MakeCpuBackend();
  NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
  const int rows = 8, cols = 24;
  std::vector<float> g = Random(rows * cols, 5);
  const std::vector<float> want = RunGram(o, g, rows, cols);
  auto ns = GramNewtonSchulz::Create(backend.get(), o, rows, cols);
  ASSERT_TRUE(ns.ok());
  std::vector<float> wide(rows * 40, 7.0f);
  MatrixView out = ContiguousView(wide.data(), DType::kFloat32, rows, cols);
  out.row_stride = 40;
  ASSERT_TRUE((*ns)->Run(V(g, rows, cols), out, 1).ok());
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j)
      ASSERT_EQ(wide[i * 40 + j], want[i * cols + j]);
    ASSERT_EQ(wide[i * 40 + cols], 7.0f);  // the gap is not written
  }
  std::vector<float> inplace = g;
  ASSERT_TRUE(
      (*ns)->Run(V(inplace, rows, cols), V(inplace, rows, cols), 1).ok());
  EXPECT_EQ(inplace, want);
}

TEST(NewtonSchulzDispatch, GramOnlyAtOrAboveTheAspectThreshold) {
  auto backend = MakeCpuBackend();
  NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
  struct Case {
    int rows, cols;
    double ratio;
    bool gram;
  };
  for (const Case& c : std::vector<Case>{{8, 24, 0, true},
                                         {24, 8, 0, true},
                                         {16, 16, 0, false},
                                         {16, 20, 0, false},  // 1.25 < 2.5
                                         {16, 20, 1.25, true},
                                         {16, 16, 1.0, true},
                                         {8, 24, 4.0, false}}) {
    o.gram_min_aspect_ratio = c.ratio;
    auto ns = NewtonSchulz::Create(backend.get(), o, c.rows, c.cols);
    ASSERT_TRUE(ns.ok()) << ns.status();
    EXPECT_EQ((*ns)->gram() != nullptr, c.gram)
        << c.rows << "x" << c.cols << " ratio " << c.ratio;
    EXPECT_EQ(UsesGramNs(o, c.rows, c.cols), c.gram);
  }
  // Standard never dispatches to Gram.
  o.algorithm = NsAlgorithm::kStandard;
  o.gram_min_aspect_ratio = 0;
  EXPECT_FALSE(UsesGramNs(o, 8, 64));
  // Auto (the default) is Gram's rule at medium precision, standard above it.
  EXPECT_EQ(NsOptions().algorithm, NsAlgorithm::kAuto);
  o.algorithm = NsAlgorithm::kAuto;
  o.precision = MatmulPrecision::kMedium;
  EXPECT_TRUE(UsesGramNs(o, 8, 64));
  EXPECT_TRUE(UsesGramNs(o, 64, 8));
  EXPECT_FALSE(UsesGramNs(o, 16, 20));
  o.precision = MatmulPrecision::kHighest;
  EXPECT_FALSE(UsesGramNs(o, 8, 64));
  o.precision = MatmulPrecision::kHigh;
  EXPECT_FALSE(UsesGramNs(o, 8, 64));
}

// The default threshold follows the short side (H200 sweep: Gram pays from
// m/n ~2.5 at n = 1024, from ~1.5 at n >= 2048); an explicit ratio is one
// number for all sizes.
TEST(NewtonSchulzDispatch, DefaultThresholdIsSizeAware) {
  NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
  EXPECT_EQ(DefaultGramMinAspectRatio(8), 2.5);
  EXPECT_EQ(DefaultGramMinAspectRatio(1024), 2.5);
  EXPECT_EQ(DefaultGramMinAspectRatio(1535), 2.5);
  EXPECT_EQ(DefaultGramMinAspectRatio(1536), 1.5);
  EXPECT_EQ(DefaultGramMinAspectRatio(4096), 1.5);
  struct Case {
    int64_t rows, cols;
    double ratio;
    bool gram;
  };
  for (const Case& c : std::vector<Case>{
           {1024, 2048, 0, false},   // 2 < 2.5 (sweep: 0.948)
           {1024, 2560, 0, true},    // 2.5
           {3584, 1024, 0, true},    // tall 3.5 (sweep: 1.103)
           {1024, 1536, 0, false},   // 1.5 below the size bound
           {2048, 3072, 0, true},    // 1.5 (sweep: 1.034)
           {2048, 2560, 0, false},   // 1.25 (sweep: 0.973)
           {1536, 2304, 0, true},    // 1.5 at the size bound
           {1535, 2303, 0, false},   // just below it: 2.5 rules
           {1024, 2048, 2.0, true},  // explicit ratio wins, all sizes
           {2048, 3072, 2.0, false}}) {
    o.gram_min_aspect_ratio = c.ratio;
    EXPECT_EQ(UsesGramNs(o, c.rows, c.cols), c.gram)
        << c.rows << "x" << c.cols << " ratio " << c.ratio;
    EXPECT_EQ(
        GramMinAspectRatio(o, c.rows, c.cols),
        c.ratio > 0 ? c.ratio : (std::min(c.rows, c.cols) < 1536 ? 2.5 : 1.5));
  }
}

TEST(NewtonSchulzDispatch, RunDelegatesToGram) {
  auto backend = MakeCpuBackend();
  NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
  const int rows = 24, cols = 8;
  std::vector<float> g = Random(rows * cols, 3);
  auto ns = NewtonSchulz::Create(backend.get(), o, rows, cols);
  ASSERT_TRUE(ns.ok());
  std::vector<float> out(g.size());
  ASSERT_TRUE((*ns)->Run(V(g, rows, cols), V(out, rows, cols), 1).ok());
  EXPECT_EQ(out, RunGram(o, g, rows, cols));
  // Standard NS's FLOPs stay the reported FlopsPerMatrix; RunFlops is Gram's.
  EXPECT_DOUBLE_EQ((*ns)->FlopsPerMatrix(), 5 * (4.0 * 64 * 24 + 2.0 * 512));
  EXPECT_DOUBLE_EQ((*ns)->RunFlopsPerMatrix(), (*ns)->gram()->FlopsPerMatrix());
  // Bad views name the rule as standard NS does.
  std::vector<float> small(10);
  EXPECT_EQ((*ns)->Run(V(small, 2, 5), V(out, rows, cols), 1).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GramNewtonSchulz, FlopCounts) {
  auto backend = MakeCpuBackend();
  const double m = 8, n = 24;
  NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
  o.gram_restarts = std::vector<int>{2};
  auto ns = GramNewtonSchulz::Create(backend.get(), o, 8, 24);
  ASSERT_TRUE(ns.ok());
  // R, restart (X = QX, R), final QX: 8 m^2 n; Z x5, QZ x3, R update x2
  // pairs: 14 products of 2 m^3.
  EXPECT_DOUBLE_EQ((*ns)->FlopsPerMatrix(), 8 * m * m * n + 28 * m * m * m);
  // Ideal: the R products and all m x m products at half.
  EXPECT_DOUBLE_EQ((*ns)->IdealFlopsPerMatrix(),
                   6 * m * m * n + 14 * m * m * m);
  o.gram_restarts = std::vector<int>{};
  ns = GramNewtonSchulz::Create(backend.get(), o, 8, 24);
  ASSERT_TRUE(ns.ok());
  // No restart: 4 m^2 n; Z x5, QZ x4, R update x4 pairs = 17 products.
  EXPECT_DOUBLE_EQ((*ns)->FlopsPerMatrix(), 4 * m * m * n + 34 * m * m * m);
}

TEST(GramRestartDefaults, TableAndFallback) {
  const DType fp16 = DType::kFloat16, bf16 = DType::kBFloat16,
              fp32 = DType::kFloat32;
  // Rows from tools/gram_restart_tuner.py's output (its test checks the
  // whole table): bf16's coarser rounding needs later or more restarts.
  EXPECT_EQ(DefaultGramRestarts(CoefficientType::kQuintic, 5, fp16),
            std::vector<int>{2});
  EXPECT_EQ(DefaultGramRestarts(CoefficientType::kQuintic, 5, bf16),
            (std::vector<int>{2, 3}));
  EXPECT_EQ(DefaultGramRestarts(CoefficientType::kPolarExpress, 5, fp16),
            (std::vector<int>{1, 3}));
  EXPECT_EQ(DefaultGramRestarts(CoefficientType::kPolarExpress, 5, bf16),
            (std::vector<int>{2, 3}));
  EXPECT_EQ(DefaultGramRestarts(CoefficientType::kPolarExpress, 5, fp32),
            (std::vector<int>{1, 3}));
  EXPECT_EQ(DefaultGramRestarts(CoefficientType::kPolarExpress, 8, fp16),
            (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(DefaultGramRestarts(CoefficientType::kSimple, 1, bf16),
            std::vector<int>{});
  // The fallback ignores the dtype.
  for (DType d : {fp16, bf16, fp32}) {
    EXPECT_EQ(DefaultGramRestarts(CoefficientType::kCustom, 7, d),
              (std::vector<int>{2, 4, 6}));
    EXPECT_EQ(DefaultGramRestarts(CoefficientType::kCustom, 2, d),
              std::vector<int>{1});
    EXPECT_EQ(DefaultGramRestarts(CoefficientType::kQuintic, 12, d),
              (std::vector<int>{2, 4, 6, 8, 10}));
  }
  // Every default passes validation for every built-in set, length and
  // dtype.
  auto backend = MakeCpuBackend();
  for (CoefficientType t :
       {CoefficientType::kSimple, CoefficientType::kQuintic,
        CoefficientType::kPolarExpress, CoefficientType::kAol,
        CoefficientType::kCans, CoefficientType::kDeepseekV4}) {
    for (int steps = 1; steps <= 20; ++steps) {
      for (DType d : {fp16, bf16, fp32}) {
        NsOptions o = GramOptions(t, steps);
        o.gram_restarts = DefaultGramRestarts(t, steps, d);
        EXPECT_TRUE(ValidateNsOptions(o, *backend).ok())
            << CoefficientTypeName(t) << " " << steps << " " << DTypeName(d);
      }
    }
  }
}

// NsOptions resolve to the row of the dtype Gram NS iterates in.
TEST(GramRestartDefaults, ResolvedByIterationDType) {
  NsOptions o = GramOptions(CoefficientType::kPolarExpress, 5);
  o.precision = MatmulPrecision::kMedium;
  o.gram_dtype = DType::kFloat16;
  EXPECT_EQ(GramRestarts(o), (std::vector<int>{1, 3}));
  o.gram_dtype = DType::kBFloat16;
  EXPECT_EQ(GramRestarts(o), (std::vector<int>{2, 3}));
  o.precision = MatmulPrecision::kHighest;  // fp32, whatever gram_dtype says
  EXPECT_EQ(GramRestarts(o), (std::vector<int>{1, 3}));
  o.gram_restarts = std::vector<int>{1};  // explicit wins
  EXPECT_EQ(GramRestarts(o), std::vector<int>{1});
}

TEST(GramValidation, ErrorsNameTheFieldAndRule) {
  auto backend = MakeCpuBackend();
  auto err = [&](const NsOptions& o) {
    return std::string(ValidateNsOptions(o, *backend).message());
  };
  NsOptions o = GramOptions(CoefficientType::kQuintic, 5);
  o.gram_restarts = std::vector<int>{0};
  EXPECT_NE(err(o).find("gram_restarts"), std::string::npos) << err(o);
  EXPECT_NE(err(o).find("[1, num_steps"), std::string::npos) << err(o);
  o.gram_restarts = std::vector<int>{5};
  EXPECT_NE(err(o).find("got 5"), std::string::npos) << err(o);
  o.gram_restarts = std::vector<int>{3, 2};
  EXPECT_NE(err(o).find("ascending and distinct"), std::string::npos);
  o.gram_restarts = std::vector<int>{2, 2};
  EXPECT_NE(err(o).find("ascending and distinct"), std::string::npos);
  o.gram_restarts = std::vector<int>{};  // no restart is allowed
  EXPECT_TRUE(ValidateNsOptions(o, *backend).ok());
  o.gram_dtype = DType::kFloat32;
  EXPECT_NE(err(o).find("gram_dtype must be fp16 or bf16"), std::string::npos);
  o.gram_dtype = DType::kBFloat16;
  for (double bad : {0.5, -1.0, std::nan(""), double(INFINITY)}) {
    o.gram_min_aspect_ratio = bad;
    EXPECT_NE(err(o).find("gram_min_aspect_ratio"), std::string::npos) << bad;
  }
  o.gram_min_aspect_ratio = 1.0;
  EXPECT_TRUE(ValidateNsOptions(o, *backend).ok());
  // Checked for the standard algorithm too.
  o.algorithm = NsAlgorithm::kStandard;
  o.gram_restarts = std::vector<int>{7};
  EXPECT_FALSE(ValidateNsOptions(o, *backend).ok());
}

}  // namespace
}  // namespace muond
