// NorMuon and AdaMuon on the CPU backend (MuonVariantFullMatrix: the
// single-process path's renormalisation of the NS output) against fp64
// references written from the anchors' source, step by step:
//   NorMuon  dion normuon.py _normuon_normalization_core (eps = 1e-8 there)
//   AdaMuon  Emerging-Optimizers adaptive_muon.py, moment2_method "adamuon"
// over several steps with a zero update in the middle (no NaN: the update
// stays zero and the state decays), within fp32 rounding; and the option
// checks (variant names, beta2, eps) naming the field and the rule.
#include "core/muon/muon_variant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "core/backend/cpu_backend.h"
#include "core/muon/muon_update.h"

namespace muond {
namespace {

constexpr int kRows = 7, kCols = 5;

std::vector<float> Update(int step) {
  std::mt19937 rng(1234 + step);
  std::normal_distribution<float> dist(0.0f, 0.3f);
  std::vector<float> u(kRows * kCols);
  for (float& x : u) x = step == 2 ? 0.0f : dist(rng);  // step 2: zero grad
  return u;
}

// dion: V = lerp(V, mean_j U^2, 1 - b2); U' = U / (sqrt(V) + eps);
// U' *= ||U|| / max(||U'||, eps).
void NorMuonRef(std::vector<double>& u, std::vector<double>& v, double b2,
                double eps) {
  double n1 = 0, n2 = 0;
  for (int i = 0; i < kRows; ++i) {
    double mean = 0;
    for (int j = 0; j < kCols; ++j) mean += u[i * kCols + j] * u[i * kCols + j];
    n1 += mean;
    mean /= kCols;
    v[i] = v[i] + (1 - b2) * (mean - v[i]);
    for (int j = 0; j < kCols; ++j) {
      u[i * kCols + j] /= std::sqrt(v[i]) + eps;
      n2 += u[i * kCols + j] * u[i * kCols + j];
    }
  }
  const double ratio = std::sqrt(n1) / std::max(std::sqrt(n2), eps);
  for (double& x : u) x *= ratio;
}

// NorMuon's update as the param sees it: each row times its factor
// (MuonVariantFullMatrix leaves `u` and writes the factors; the update
// applies them, as here, in fp32).
void ApplyNorMuonFactors(std::vector<float>& u,
                         const std::vector<float>& rows) {
  const float* factors = rows.data() + 2 * kRows;
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kCols; ++j) u[i * kCols + j] *= factors[i];
  }
}

// EO: moment2.lerp_(O^2, 1 - b2); O / (sqrt(moment2) + eps).
void AdaMuonRef(std::vector<double>& u, std::vector<double>& v, double b2,
                double eps) {
  for (size_t k = 0; k < u.size(); ++k) {
    v[k] = v[k] + (1 - b2) * (u[k] * u[k] - v[k]);
    u[k] /= std::sqrt(v[k]) + eps;
  }
}

void RunAgainstReference(MuonVariant variant) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  MuonOptions o;
  o.variant = variant;
  o.beta2 = 0.9;
  o.moment2_eps = 1e-8;
  const int m2_cols = variant == MuonVariant::kNorMuon ? 1 : kCols;
  std::vector<float> v(kRows * m2_cols, 0.0f), rows(3 * kRows);
  std::vector<double> v_ref(v.size(), 0.0);
  for (int step = 0; step < 5; ++step) {
    std::vector<float> u = Update(step);
    std::vector<double> u_ref(u.begin(), u.end());
    ASSERT_TRUE(MuonVariantFullMatrix(
                    *cpu, o,
                    ContiguousView(u.data(), DType::kFloat32, kRows, kCols),
                    ContiguousView(v.data(), DType::kFloat32, kRows, m2_cols),
                    ContiguousView(rows.data(), DType::kFloat32, kRows, 3))
                    .ok());
    if (variant == MuonVariant::kNorMuon) {
      ApplyNorMuonFactors(u, rows);
      NorMuonRef(u_ref, v_ref, o.beta2, o.moment2_eps);
    } else {
      AdaMuonRef(u_ref, v_ref, o.beta2, o.moment2_eps);
    }
    for (size_t k = 0; k < u.size(); ++k) {
      ASSERT_TRUE(std::isfinite(u[k])) << "step " << step;
      EXPECT_NEAR(u[k], u_ref[k], 2e-6 * (1 + std::fabs(u_ref[k])))
          << "update step " << step << " [" << k << "]";
    }
    for (size_t k = 0; k < v.size(); ++k) {
      EXPECT_NEAR(v[k], v_ref[k], 2e-6 * (1e-6 + std::fabs(v_ref[k])))
          << "state step " << step << " [" << k << "]";
    }
    if (step == 2) {
      for (float x : u) EXPECT_EQ(x, 0.0f) << "a zero update stays zero";
    }
  }
}

TEST(MuonVariant, NorMuonMatchesTheFp64ReferenceIncludingAZeroUpdate) {
  RunAgainstReference(MuonVariant::kNorMuon);
}

TEST(MuonVariant, AdaMuonMatchesTheFp64ReferenceIncludingAZeroUpdate) {
  RunAgainstReference(MuonVariant::kAdaMuon);
}

TEST(MuonVariant, NorMuonKeepsTheFrobeniusNorm) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  MuonOptions o;
  o.variant = MuonVariant::kNorMuon;
  std::vector<float> u = Update(0), v(kRows, 0.0f), rows(3 * kRows);
  double before = 0, after = 0;
  for (float x : u) before += double(x) * x;
  ASSERT_TRUE(MuonVariantFullMatrix(
                  *cpu, o,
                  ContiguousView(u.data(), DType::kFloat32, kRows, kCols),
                  ContiguousView(v.data(), DType::kFloat32, kRows, 1),
                  ContiguousView(rows.data(), DType::kFloat32, kRows, 3))
                  .ok());
  ApplyNorMuonFactors(u, rows);
  for (float x : u) after += double(x) * x;
  EXPECT_NEAR(std::sqrt(after), std::sqrt(before), 1e-6 * std::sqrt(before));
}

TEST(MuonVariant, OptionsAreCheckedNamingTheFieldAndTheRule) {
  EXPECT_EQ(*ParseMuonVariant("normuon"), MuonVariant::kNorMuon);
  EXPECT_EQ(*ParseMuonVariant("adamuon"), MuonVariant::kAdaMuon);
  EXPECT_EQ(*ParseMuonVariant("muon"), MuonVariant::kMuon);
  EXPECT_EQ(ParseMuonVariant("namo").status().message(),
            "variant: unknown name 'namo'; expected muon, normuon or adamuon");
  MuonOptions o;
  o.variant = MuonVariant::kNorMuon;
  o.beta2 = 1.0;
  EXPECT_EQ(o.Validate().message(), "muon beta2 must be in [0, 1), got 1");
  o.beta2 = 0.95;
  o.moment2_eps = 0.0;
  EXPECT_TRUE(
      absl::StrContains(o.Validate().message(),
                        "muon moment2_eps must be > 0 and finite as a float32"))
      << o.Validate();
  o.moment2_eps = std::nan("");
  EXPECT_FALSE(o.Validate().ok());
  o.moment2_eps = 1e-8;
  EXPECT_TRUE(o.Validate().ok());
  // AdaMuon's normalised update (up to 1/sqrt(1 - beta2)) must fit fp16;
  // NorMuon rescales its rows and takes any beta2 < 1.
  o.beta2 = 1.0 - 1e-10;
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  o.variant = MuonVariant::kAdaMuon;
  EXPECT_TRUE(absl::StrContains(
      o.Validate().message(),
      "muon beta2 must be at most 1 - 2^-30 with variant adamuon"))
      << o.Validate();
  o.beta2 = 1.0 - 1.0 / double(1 << 30);
  EXPECT_TRUE(o.Validate().ok()) << o.Validate();
  o.variant = MuonVariant::kNorMuon;
}

}  // namespace
}  // namespace muond
