// Newton–Schulz on the CPU backend against an fp64 plain-loop reference (every
// coefficient set, both orientations), the SVD polar factor, the bf16
// (medium) path against highest, and its edge cases (zero, tiny norms,
// batching, validation).
#include "core/muon/newton_schulz.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
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
  std::vector<Abc> out;
  const std::vector<NsCoefficients> schedule =
      *CoefficientSchedule(o.coefficient_type, o.custom, o.num_steps);
  for (const NsCoefficients& k : schedule) {
    out.push_back({k.a, k.b, k.c});
  }
  return out;
}

std::vector<float> RunNs(Backend& backend, const NsOptions& o,
                         std::vector<float> g, int64_t rows, int64_t cols) {
  auto ns = NewtonSchulz::Create(&backend, o, rows, cols);
  EXPECT_TRUE(ns.ok()) << ns.status();
  std::vector<float> out(g.size(), -1.0f);
  EXPECT_TRUE((*ns)->Run(V(g, rows, cols), V(out, rows, cols), 1).ok());
  return out;
}

struct SetCase {
  CoefficientType type;
  int steps;
};

class EveryCoefficientSet : public ::testing::TestWithParam<SetCase> {};

TEST_P(EveryCoefficientSet, MatchesFp64ReferenceWideAndTall) {
  auto backend = MakeCpuBackend();
  NsOptions o;
  o.coefficient_type = GetParam().type;
  o.num_steps = GetParam().steps;
  if (o.coefficient_type == CoefficientType::kCustom) {
    o.custom = {{3.0f, -3.2f, 1.2f}, {2.0f, -1.5f, 0.5f}, {1.5f, -0.5f, 0.0f}};
  }
  for (auto [rows, cols] : {std::pair<int, int>{24, 40}, {40, 24}, {32, 32}}) {
    const std::vector<float> g = Random(rows * cols, rows * 100 + cols);
    const std::vector<float> got = RunNs(*backend, o, g, rows, cols);
    const Mat want =
        testing::NewtonSchulzRef(g, rows, cols, ScheduleOf(o), o.eps);
    // fp32 GEMMs vs fp64: a few ulps per step, amplified by the polynomial.
    EXPECT_LT(testing::RelFrobDiff(got, want), 2e-5)
        << CoefficientTypeName(o.coefficient_type) << " " << rows << "x"
        << cols;
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllSets, EveryCoefficientSet,
    ::testing::Values(SetCase{CoefficientType::kSimple, 5},
                      SetCase{CoefficientType::kQuintic, 5},
                      SetCase{CoefficientType::kQuintic, 7},  // cycles
                      SetCase{CoefficientType::kPolarExpress, 8},
                      SetCase{CoefficientType::kPolarExpress, 10},  // last
                      SetCase{CoefficientType::kAol, 5},
                      SetCase{CoefficientType::kCans, 7},
                      SetCase{CoefficientType::kDeepseekV4, 10},
                      SetCase{CoefficientType::kCustom, 4}));  // c = 0 step

TEST(CoefficientSchedule, CycleAndRepeatLast) {
  auto q = *CoefficientSchedule(CoefficientType::kQuintic, {}, 7);
  EXPECT_EQ(q[5].a, 4.0848f);  // cycles back to the first tuple
  EXPECT_EQ(q[6].c, 2.6377f);
  auto pe = *CoefficientSchedule(CoefficientType::kPolarExpress, {}, 10);
  EXPECT_EQ(pe[0].b, -22.9019f);
  EXPECT_EQ(pe[9].a, 1.8750f);  // repeats the last tuple
  EXPECT_EQ(pe[8].c, 0.3750f);
  auto cans = *CoefficientSchedule(CoefficientType::kCans, {}, 6);
  EXPECT_EQ(cans[5].a, 2.2737f);
  auto aol = *CoefficientSchedule(CoefficientType::kAol, {}, 5);
  EXPECT_EQ(aol[4].a, 4.0098f);
  auto s = *CoefficientSchedule(CoefficientType::kSimple, {}, 3);
  EXPECT_EQ(s[2].b, -4.7750f);
  EXPECT_EQ(*ParseCoefficientType("polar_express"),
            CoefficientType::kPolarExpress);
  EXPECT_FALSE(ParseCoefficientType("quintik").ok());
}

TEST(NewtonSchulz, TallIsTransposeOfWide) {
  auto backend = MakeCpuBackend();
  const int r = 20, c = 36;
  const std::vector<float> g = Random(r * c, 5);
  std::vector<float> gt(r * c);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) gt[j * r + i] = g[i * c + j];
  const std::vector<float> wide = RunNs(*backend, NsOptions{}, g, r, c);
  const std::vector<float> tall = RunNs(*backend, NsOptions{}, gt, c, r);
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j)
      EXPECT_NEAR(tall[j * r + i], wide[i * c + j], 1e-5);
}

TEST(NewtonSchulz, ZeroMatrixGivesZeroNeverNan) {
  auto backend = MakeCpuBackend();
  for (auto [r, c] : {std::pair<int, int>{8, 16}, {16, 8}}) {
    const std::vector<float> out =
        RunNs(*backend, NsOptions{}, std::vector<float>(r * c, 0.0f), r, c);
    for (float x : out) EXPECT_EQ(x, 0.0f);
  }
}

TEST(NewtonSchulz, ScaleInvariantDownToTinyNorms) {
  auto backend = MakeCpuBackend();
  const int n = 16;
  // Identity scaled down to 1e-30: with eps below the norm the result is the
  // NS of I (fp64 sum of squares: 1e-60 does not underflow).
  NsOptions o;
  o.eps = 1e-37f;
  std::vector<float> eye(n * n, 0.0f);
  for (int i = 0; i < n; ++i) eye[i * n + i] = 1.0f;
  const std::vector<float> ref = RunNs(*backend, o, eye, n, n);
  for (float s : {1e-5f, 1e-10f, 1e-20f, 1e-30f}) {
    std::vector<float> g = eye;
    for (float& x : g) x *= s;
    const std::vector<float> out = RunNs(*backend, o, g, n, n);
    for (int i = 0; i < n * n; ++i) EXPECT_NEAR(out[i], ref[i], 1e-6) << s;
  }
  // Default eps (1e-15): a random matrix at 1e-12 is still normalised.
  const std::vector<float> g = Random(n * 24, 9);
  const std::vector<float> base = RunNs(*backend, NsOptions{}, g, n, 24);
  std::vector<float> tiny = g;
  for (float& x : tiny) x *= 1e-12f;
  const std::vector<float> out = RunNs(*backend, NsOptions{}, tiny, n, 24);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(out[i], base[i], 1e-5);
}

TEST(NewtonSchulz, PolarExpressCloserToPolarFactorThanQuinticAt10Steps) {
  auto backend = MakeCpuBackend();
  const int r = 32, c = 48;
  const std::vector<float> g = Random(r * c, 11);
  const Mat polar = testing::PolarFactor(g, r, c);
  NsOptions quintic, pe;
  quintic.num_steps = pe.num_steps = 10;
  pe.coefficient_type = CoefficientType::kPolarExpress;
  const double d_quintic =
      testing::RelFrobDiff(RunNs(*backend, quintic, g, r, c), polar);
  const double d_pe = testing::RelFrobDiff(RunNs(*backend, pe, g, r, c), polar);
  EXPECT_LT(d_pe, d_quintic);
  EXPECT_LT(d_pe, 1e-2);
  // Quintic does not converge to U V^T (singular values ~ U(0.7, 1.2)).
  EXPECT_LT(d_quintic, 0.5);
}

TEST(NewtonSchulz, BatchedEqualsPerSliceAndBatchOfOneIsUnbatched) {
  auto backend = MakeCpuBackend();
  const int r = 12, c = 20, batch = 3;
  std::vector<float> g = Random(batch * r * c, 13), out(g.size());
  auto ns = *NewtonSchulz::Create(backend.get(), NsOptions{}, r, c, batch);
  ASSERT_TRUE(ns->Run(V(g, batch * r, c), V(out, batch * r, c), batch).ok());
  auto single = *NewtonSchulz::Create(backend.get(), NsOptions{}, r, c, 1);
  for (int s = 0; s < batch; ++s) {
    std::vector<float> slice(g.begin() + s * r * c,
                             g.begin() + (s + 1) * r * c);
    std::vector<float> one(r * c), one_batched(r * c);
    ASSERT_TRUE(single->Run(V(slice, r, c), V(one, r, c), 1).ok());
    // Batch of 1 through the batched instance: bitwise the unbatched path.
    ASSERT_TRUE(ns->Run(V(slice, r, c), V(one_batched, r, c), 1).ok());
    EXPECT_EQ(one, one_batched);
    for (int i = 0; i < r * c; ++i)
      EXPECT_NEAR(out[s * r * c + i], one[i], 1e-6);
  }
}

// The symmetric path (block-row count 0: SymmetricGemmStridedBatchedOut; >= 1:
// the legacy lower-triangle block rows of A = X X^T and B = b A + c A^2, then
// the mirror): for every count (including the clamp to m/8 rows per block and
// uneven last rows), both orientations and a batch, it must equal the fp64
// reference as the full-product path does.
TEST(NewtonSchulz, SymmetricPathMatchesFp64ReferenceForEveryBlockRowCount) {
  auto backend = MakeCpuBackend();
  NsOptions o;
  o.use_syrk = true;
  const int batch = 3;
  for (auto [rows, cols] :
       {std::pair<int, int>{40, 64}, {72, 48}, {56, 56}, {41, 57}, {57, 41}}) {
    const std::vector<float> g = Random(batch * rows * cols, rows + cols);
    for (int k : {0, 1, 2, 3, 5, 16}) {
      o.syrk_block_rows = k;
      auto ns = *NewtonSchulz::Create(backend.get(), o, rows, cols, batch);
      std::vector<float> out(g.size(), -1.0f), in = g;
      ASSERT_TRUE(
          ns->Run(V(in, batch * rows, cols), V(out, batch * rows, cols), batch)
              .ok());
      for (int s = 0; s < batch; ++s) {
        const std::vector<float> slice(g.begin() + s * rows * cols,
                                       g.begin() + (s + 1) * rows * cols);
        const std::vector<float> got(out.begin() + s * rows * cols,
                                     out.begin() + (s + 1) * rows * cols);
        const Mat want =
            testing::NewtonSchulzRef(slice, rows, cols, ScheduleOf(o), o.eps);
        EXPECT_LT(testing::RelFrobDiff(got, want), 2e-5)
            << rows << "x" << cols << " block rows " << k << " slice " << s;
      }
    }
  }
}

// 0 (the default) means SymmetricGemmStridedBatchedOut, no block rows;
// explicit counts are clamped to blocks of at least 8 rows.
TEST(NewtonSchulz, SyrkBlockRowsDefaultsAndClamp) {
  EXPECT_EQ(SyrkBlockRows(4096, 0), 0);
  EXPECT_EQ(SyrkBlockRows(768, 0), 0);
  EXPECT_EQ(SyrkBlockRows(4096, 1), 1);
  EXPECT_EQ(SyrkBlockRows(4096, 8), 8);
  EXPECT_EQ(SyrkBlockRows(40, 16), 5);  // blocks of at least 8 rows
}

TEST(NewtonSchulz, InputUntouchedAndOutputMayAliasInput) {
  auto backend = MakeCpuBackend();
  std::vector<float> g = Random(8 * 12, 15), g0 = g, out(g.size());
  auto ns = *NewtonSchulz::Create(backend.get(), NsOptions{}, 8, 12);
  ASSERT_TRUE(ns->Run(V(g, 8, 12), V(out, 8, 12), 1).ok());
  EXPECT_EQ(g, g0);
  ASSERT_TRUE(ns->Run(V(g, 8, 12), V(g, 8, 12), 1).ok());
  EXPECT_EQ(g, out);
}

TEST(NewtonSchulz, StridedOutputView) {
  auto backend = MakeCpuBackend();
  std::vector<float> g = Random(8 * 12, 17), out(8 * 12), wide(8 * 20, 7.0f);
  auto ns = *NewtonSchulz::Create(backend.get(), NsOptions{}, 8, 12);
  ASSERT_TRUE(ns->Run(V(g, 8, 12), V(out, 8, 12), 1).ok());
  ASSERT_TRUE(ns->Run(V(g, 8, 12),
                      MatrixView{wide.data(), DType::kFloat32, 8, 12, 20}, 1)
                  .ok());
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 12; ++j) EXPECT_EQ(wide[i * 20 + j], out[i * 12 + j]);
    for (int j = 12; j < 20; ++j) EXPECT_EQ(wide[i * 20 + j], 7.0f);
  }
}

// kMedium on the CPU backend: X, A and B in bf16, every GEMM accumulated in
// fp32 and rounded once to bf16. The result stays within bf16 rounding of
// the fp32 (kHighest) one: 2^-8 relative per rounding, a few of them over 5
// steps (the CUDA bound of ns_cuda_test), for tall, wide, square and a batch.
TEST(NewtonSchulz, MediumWithinBf16RoundingOfHighest) {
  auto backend = MakeCpuBackend();
  NsOptions medium;
  medium.precision = MatmulPrecision::kMedium;
  const double tol = 2e-2;  // ~ 5 * 2^-8
  const int batch = 3;
  for (auto [r, c] : {std::pair<int, int>{48, 32}, {32, 48}, {40, 40}}) {
    const int64_t n = int64_t(r) * c;
    std::vector<float> g = Random(batch * n, r * 7 + c);
    auto high = *NewtonSchulz::Create(backend.get(), NsOptions{}, r, c, batch);
    auto med = *NewtonSchulz::Create(backend.get(), medium, r, c, batch);
    std::vector<float> want(g.size()), got(g.size()), one(n);
    ASSERT_TRUE(
        high->Run(V(g, batch * r, c), V(want, batch * r, c), batch).ok());
    ASSERT_TRUE(med->Run(V(g, batch * r, c), V(got, batch * r, c), batch).ok());
    for (int s = 0; s < batch; ++s) {
      const std::vector<float> got_s(got.begin() + s * n,
                                     got.begin() + (s + 1) * n);
      const Mat want_s(want.begin() + s * n, want.begin() + (s + 1) * n);
      const double d = testing::RelFrobDiff(got_s, want_s);
      EXPECT_LE(d, tol) << r << "x" << c << " slice " << s;
      // It did run in bf16: not the fp32 result, every element a bf16 value.
      EXPECT_GT(d, 0.0) << r << "x" << c << " slice " << s;
      for (float x : got_s) ASSERT_EQ(x, RoundToBf16(x)) << r << "x" << c;
    }
    // The unbatched path (Gemm) on slice 1 agrees with the batched one.
    std::vector<float> slice(g.begin() + n, g.begin() + 2 * n);
    ASSERT_TRUE(med->Run(V(slice, r, c), V(one, r, c), 1).ok());
    EXPECT_EQ(one, std::vector<float>(got.begin() + n, got.begin() + 2 * n));
  }
}

TEST(NsValidation, ErrorsNameTheFieldAndRule) {
  auto backend = MakeCpuBackend();
  auto expect_error = [&](NsOptions o, const char* needle) {
    const absl::Status s = ValidateNsOptions(o, *backend);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(s.message().find(needle), absl::string_view::npos) << s;
  };
  NsOptions o;
  o.num_steps = 0;
  expect_error(o, "num_steps");
  o = NsOptions{};
  o.eps = 0.0f;
  expect_error(o, "eps");
  o = NsOptions{};
  o.coefficient_type = CoefficientType::kCustom;
  expect_error(o, "custom");
  o = NsOptions{};
  o.custom = {{1, 2, 3}};
  expect_error(o, "custom");
  o = NsOptions{};
  o.precision = MatmulPrecision::kHigh;  // TF32: CUDA only
  expect_error(o, "precision high");
  o.precision = MatmulPrecision::kMedium;
  EXPECT_TRUE(ValidateNsOptions(o, *backend).ok());
  o = NsOptions{};
  o.syrk_block_rows = 17;
  expect_error(o, "syrk_block_rows");
  o.syrk_block_rows = -1;
  expect_error(o, "syrk_block_rows");
  EXPECT_TRUE(ValidateNsOptions(NsOptions{}, *backend).ok());
}

TEST(NsValidation, RunChecksShapesAndBatch) {
  auto backend = MakeCpuBackend();
  auto ns = *NewtonSchulz::Create(backend.get(), NsOptions{}, 4, 6, 2);
  std::vector<float> g(3 * 4 * 6), out(g.size());
  EXPECT_FALSE(ns->Run(V(g, 12, 6), V(out, 12, 6), 3).ok());
  EXPECT_FALSE(ns->Run(V(g, 5, 6), V(out, 5, 6), 1).ok());
  EXPECT_FALSE(NewtonSchulz::Create(backend.get(), NsOptions{}, 0, 6).ok());
  EXPECT_NEAR(ns->FlopsPerMatrix(), 5 * (4.0 * 16 * 6 + 2.0 * 64), 1e-9);
}

}  // namespace
}  // namespace muond
