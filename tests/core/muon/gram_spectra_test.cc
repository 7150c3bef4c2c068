// The Gram Newton–Schulz numerics suite (gram_spectra_suite.h) on the CPU
// backend: fp16 and bf16 are emulated exactly as the CUDA GEMMs round
// (products exact in fp32, fp32 accumulation, one rounding of the result),
// so the rounding effects the suite measures show here too.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/backend/cpu_backend.h"
#include "tests/core/muon/gram_spectra_suite.h"
#include "tests/core/muon/spectral_reference.h"

namespace muond::testing {
namespace {

// Wide and tall, aspect 1.67 to 4, each a batch of 2; the small shape classes
// the default sends to Gram (8 x 24 to 32 x 128) among them.
const std::vector<SpectraShape> kShapes = {
    {64, 256}, {256, 64}, {96, 160}, {8, 24}, {12, 30}, {30, 12}, {32, 128}};

// The spectral reference against the plain fp64 NS loop (ns_reference.h) on
// the same fp32 input, and sigma_max by power iteration against the known
// largest singular value: the suite's yardsticks, checked independently.
TEST(GramSpectraTest, SpectralReferenceMatchesFp64Loop) {
  const std::vector<Abc> quintic = {{4.0848f, -6.8946f, 2.9270f},
                                    {3.9505f, -6.3029f, 2.6377f},
                                    {3.7418f, -5.5913f, 2.3037f},
                                    {2.8769f, -3.1427f, 1.2046f},
                                    {2.8366f, -3.0525f, 1.2012f}};
  // 1024 > 512 takes RandomOrthogonal's Hadamard form (the GPU twin's
  // 1024 x 4096 shapes); the others Householder's.
  for (auto [r, c] : {std::pair<int, int>{24, 56}, {56, 24}, {16, 1024}}) {
    const int m = std::min(r, c);
    std::vector<double> s(m);
    for (int i = 0; i < m; ++i) s[i] = 3.0 / (1 + i);
    const KnownSpectrum ks(r, c, s, 5);
    const Mat x = ks.Input();
    const std::vector<float> g(x.begin(), x.end());
    const Mat loop = NewtonSchulzRef(g, r, c, quintic, 1e-15);
    const Mat exact = ks.NsExact(quintic, 1e-15);
    std::vector<float> exact_f(exact.begin(), exact.end());
    // fp32 input rounding (2^-24) amplified by at most p'(0) ~ 500.
    EXPECT_LE(RelError(exact_f, loop), 1e-5) << r << "x" << c;
    EXPECT_NEAR(SigmaMax(g, r, c), 3.0, 3e-6) << r << "x" << c;
  }
  EXPECT_EQ(SigmaMax({1.0f, std::nanf("")}, 1, 2), HUGE_VAL);
  // max of p over [0, 1] lies inside (p(1) < max p for quintic).
  EXPECT_GT(NsScalarMaxOn01(quintic), NsScalar(1.0, quintic));
}

TEST(GramSpectraTest, ErrorsFiniteScaleInvariantAndZero) {
  const auto cpu = MakeCpuBackend();
  CheckSpectraErrors(cpu.get(), kShapes);
}

TEST(GramSpectraTest, SigmaMaxBoundHoldsOnlyWithRestarts) {
  const auto cpu = MakeCpuBackend();
  CheckSigmaMaxBound(cpu.get(), {{64, 256, true}, {256, 64, true}});
}

// The shape classes the default routes to Gram (aspect >= 2.5 below a short
// side of 1536), both orientations, up to 128 x 512 on the CPU.
TEST(GramSpectraTest, SigmaMaxBoundHoldsAtShapeClasses) {
  const auto cpu = MakeCpuBackend();
  CheckSigmaMaxAtShapeClasses(cpu.get(), {{8, 24},
                                          {24, 8},
                                          {12, 30},
                                          {30, 12},
                                          {16, 64},
                                          {32, 128},
                                          {128, 32},
                                          {64, 256},
                                          {128, 512}});
}

}  // namespace
}  // namespace muond::testing
