// Newton–Schulz on the CUDA backend (tag gpu; skipped without a device):
// highest == CPU to 1e-5 relative; medium and the symmetric (use_syrk) path
// within bf16 rounding; batched == unbatched per slice (batch of one bitwise,
// 1e-6 otherwise).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/muon/newton_schulz.h"
#include "tests/common/cuda_device.h"
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

double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

class NsCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!muond::testing::HaveCudaDevice())
      GTEST_SKIP() << "no CUDA device on this machine";
    gpu_ = std::move(*MakeCudaBackend(0));
    cpu_ = MakeCpuBackend();
  }
  std::vector<float> RunGpu(const NsOptions& o, std::vector<float> g, int64_t r,
                            int64_t c, int64_t batch = 1,
                            int64_t max_batch = 1) {
    auto ns = NewtonSchulz::Create(gpu_.get(), o, r, c, max_batch);
    EXPECT_TRUE(ns.ok()) << ns.status();
    const int64_t bytes = int64_t(g.size()) * 4;
    void* din = *gpu_->Allocate(bytes);
    void* dout = *gpu_->Allocate(bytes);
    EXPECT_TRUE(gpu_->CopyFromHost(din, g.data(), bytes).ok());
    EXPECT_TRUE((*ns)
                    ->Run(ContiguousView(din, DType::kFloat32, batch * r, c),
                          ContiguousView(dout, DType::kFloat32, batch * r, c),
                          batch)
                    .ok());
    std::vector<float> out(g.size());
    EXPECT_TRUE(gpu_->CopyToHost(out.data(), dout, bytes).ok());
    gpu_->Free(din);
    gpu_->Free(dout);
    return out;
  }
  std::vector<float> RunCpu(const NsOptions& o, std::vector<float> g, int64_t r,
                            int64_t c) {
    auto ns = *NewtonSchulz::Create(cpu_.get(), o, r, c);
    std::vector<float> out(g.size());
    EXPECT_TRUE(ns->Run(ContiguousView(g.data(), DType::kFloat32, r, c),
                        ContiguousView(out.data(), DType::kFloat32, r, c), 1)
                    .ok());
    return out;
  }
  std::unique_ptr<Backend> gpu_, cpu_;
};

TEST_F(NsCudaTest, HighestMatchesCpuEveryCoefficientSet) {
  for (CoefficientType t :
       {CoefficientType::kSimple, CoefficientType::kQuintic,
        CoefficientType::kPolarExpress, CoefficientType::kAol,
        CoefficientType::kCans, CoefficientType::kDeepseekV4}) {
    NsOptions o;
    o.coefficient_type = t;
    for (auto [r, c] : {std::pair<int, int>{256, 384}, {384, 256}}) {
      const std::vector<float> g = Random(r * c, r + c + int(t));
      EXPECT_LE(RelDiff(RunGpu(o, g, r, c), RunCpu(o, g, r, c)), 1e-5)
          << CoefficientTypeName(t) << " " << r << "x" << c;
    }
  }
}

TEST_F(NsCudaTest, MediumAndSyrkWithinBf16Rounding) {
  const int r = 512, c = 768;
  const std::vector<float> g = Random(r * c, 3);
  const std::vector<float> ref = RunCpu(NsOptions{}, g, r, c);
  NsOptions medium;
  medium.precision = MatmulPrecision::kMedium;
  medium.algorithm = NsAlgorithm::kStandard;  // the standard path's products
  const std::vector<float> gemm_path = RunGpu(medium, g, r, c);
  // bf16 keeps 8 mantissa bits: 2^-8 relative per rounding; 5 NS steps with
  // bf16 X, A, B stay within a few of those in Frobenius norm.
  EXPECT_LE(RelDiff(gemm_path, ref), 8 * std::ldexp(1.0, -8));
  medium.use_syrk = true;
  // m = 512 runs the full product by default; force the blocked path.
  medium.syrk_block_rows = 4;
  const std::vector<float> syrk = RunGpu(medium, g, r, c);
  EXPECT_LE(RelDiff(syrk, gemm_path), 8 * std::ldexp(1.0, -8));
  EXPECT_LE(RelDiff(syrk, ref), 8 * std::ldexp(1.0, -8));
  // Tall input through the symmetric path.
  const std::vector<float> gt = Random(c * r, 4);
  EXPECT_LE(RelDiff(RunGpu(medium, gt, c, r), RunCpu(NsOptions{}, gt, c, r)),
            8 * std::ldexp(1.0, -8));
}

// Block rows start at multiples of 8 and the last one is ragged, so any shape
// works (unaligned bf16 blocks take cublasLt's lower-alignment kernels).
TEST_F(NsCudaTest, SyrkAnyShapeWithinBf16Rounding) {
  NsOptions o;
  o.precision = MatmulPrecision::kMedium;
  o.algorithm = NsAlgorithm::kStandard;  // 100 x 36 would take Gram (auto)
  o.use_syrk = true;
  o.syrk_block_rows = 3;
  for (auto [r, c] : {std::pair<int, int>{100, 36}, {36, 100}, {57, 41}}) {
    const std::vector<float> g = Random(r * c, r + c);
    EXPECT_LE(RelDiff(RunGpu(o, g, r, c), RunCpu(NsOptions{}, g, r, c)),
              8 * std::ldexp(1.0, -8))
        << r << "x" << c;
  }
}

TEST_F(NsCudaTest, BatchedEqualsUnbatchedPerSlice) {
  for (MatmulPrecision p :
       {MatmulPrecision::kHighest, MatmulPrecision::kMedium}) {
    NsOptions o;
    o.precision = p;
    const int r = 128, c = 192, batch = 4;
    const std::vector<float> g = Random(batch * r * c, 7);
    const std::vector<float> batched = RunGpu(o, g, r, c, batch, batch);
    for (int s = 0; s < batch; ++s) {
      const std::vector<float> slice(g.begin() + s * r * c,
                                     g.begin() + (s + 1) * r * c);
      const std::vector<float> one = RunGpu(o, slice, r, c);
      // A batch of one through a batched instance takes the unbatched path.
      EXPECT_EQ(RunGpu(o, slice, r, c, 1, batch), one);
      const std::vector<float> part(batched.begin() + s * r * c,
                                    batched.begin() + (s + 1) * r * c);
      const double tol =
          p == MatmulPrecision::kHighest ? 1e-6 : 8 * std::ldexp(1.0, -8);
      EXPECT_LE(RelDiff(part, one), tol)
          << MatmulPrecisionName(p) << " slice " << s;
    }
  }
}

TEST_F(NsCudaTest, ZeroGivesZero) {
  for (MatmulPrecision p :
       {MatmulPrecision::kHighest, MatmulPrecision::kMedium}) {
    NsOptions o;
    o.precision = p;
    for (float x : RunGpu(o, std::vector<float>(64 * 96, 0.0f), 64, 96))
      EXPECT_EQ(x, 0.0f);
  }
}

}  // namespace
}  // namespace muond
