// fp16.h against known IEEE binary16 bit patterns, and the CPU backend's fp16
// paths (Copy2D, kMedium GEMM, FrobeniusNormalize, SymmetrizeFromLower,
// AddToDiagonal) against fp32 math rounded with those patterns.
#include "core/backend/fp16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/backend/cpu_backend.h"

namespace muond {
namespace {

float F(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(Fp16, KnownBitPatterns) {
  EXPECT_EQ(FloatToFp16Bits(1.0f), 0x3C00);
  EXPECT_EQ(FloatToFp16Bits(-2.0f), 0xC000);
  EXPECT_EQ(FloatToFp16Bits(0.5f), 0x3800);
  EXPECT_EQ(FloatToFp16Bits(0.0f), 0x0000);
  EXPECT_EQ(FloatToFp16Bits(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16Bits(65504.0f), 0x7BFF);  // max finite
  EXPECT_EQ(FloatToFp16Bits(65519.996f), 0x7BFF);
  EXPECT_EQ(FloatToFp16Bits(65520.0f), 0x7C00);  // halfway: ties to inf
  EXPECT_EQ(FloatToFp16Bits(-1e6f), 0xFC00);
  EXPECT_EQ(FloatToFp16Bits(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(FloatToFp16Bits(std::nanf("")) & 0x7E00, 0x7E00);  // quiet NaN
  EXPECT_EQ(FloatToFp16Bits(0x1p-14f), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToFp16Bits(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToFp16Bits(0x1p-25f), 0x0000);  // half of it: tie to even 0
  EXPECT_EQ(FloatToFp16Bits(F(0x33000001)), 0x0001);  // just above 2^-25
  EXPECT_EQ(FloatToFp16Bits(0x1.8p-24f), 0x0002);     // 1.5 ulp: tie to even 2
  EXPECT_EQ(FloatToFp16Bits(0x1.4p-24f), 0x0001);     // 1.25 ulp: down
  EXPECT_EQ(FloatToFp16Bits(0x3FFp-24f), 0x03FF);     // largest subnormal
  EXPECT_EQ(FloatToFp16Bits(0x7FFp-25f), 0x0400);     // rounds up to normal
  // Ties to even among normals: 1 + 2^-11 is halfway between 1 and 1+2^-10.
  EXPECT_EQ(FloatToFp16Bits(1.0f + 0x1p-11f), 0x3C00);
  EXPECT_EQ(FloatToFp16Bits(1.0f + 3 * 0x1p-11f), 0x3C02);
  EXPECT_EQ(FloatToFp16Bits(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);
  EXPECT_EQ(FloatToFp16Bits(3.14159265f), 0x4248);
}

TEST(Fp16, ToFloatIsExactAndRoundTrips) {
  EXPECT_EQ(Fp16BitsToFloat(0x3C00), 1.0f);
  EXPECT_EQ(Fp16BitsToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(Fp16BitsToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(Fp16BitsToFloat(0x8001), -0x1p-24f);
  EXPECT_TRUE(std::isinf(Fp16BitsToFloat(0x7C00)));
  EXPECT_TRUE(std::isnan(Fp16BitsToFloat(0x7E00)));
  // Every finite fp16 value converts to fp32 and back to itself.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00) continue;
    ASSERT_EQ(FloatToFp16Bits(Fp16BitsToFloat(uint16_t(h))), h) << h;
  }
}

MatrixView V(void* p, DType t, int64_t r, int64_t c) {
  return ContiguousView(p, t, r, c);
}

TEST(CpuBackendFp16, CopyGemmNormalizeSymmetrizeDiagonal) {
  auto be = MakeCpuBackend();
  const int n = 4;
  std::vector<float> a32(n * n), b32(n * n);
  for (int i = 0; i < n * n; ++i) {
    a32[i] = 0.1f * float(i) - 0.7f;
    b32[i] = 0.05f * float(i * i % 7) + 0.01f;
  }
  std::vector<uint16_t> a16(n * n), b16(n * n), c16(n * n), bf(n * n);
  ASSERT_TRUE(be->Copy2D(V(a16.data(), DType::kFloat16, n, n),
                         V(a32.data(), DType::kFloat32, n, n))
                  .ok());
  ASSERT_TRUE(be->Copy2D(V(b16.data(), DType::kFloat16, n, n),
                         V(b32.data(), DType::kFloat32, n, n))
                  .ok());
  for (int i = 0; i < n * n; ++i) ASSERT_EQ(a16[i], FloatToFp16Bits(a32[i]));
  // fp16 -> bf16 goes through the exact fp32 value, rounded once.
  ASSERT_TRUE(be->Copy2D(V(bf.data(), DType::kBFloat16, n, n),
                         V(a16.data(), DType::kFloat16, n, n))
                  .ok());
  for (int i = 0; i < n * n; ++i)
    ASSERT_EQ(bf[i], FloatToBf16Bits(Fp16BitsToFloat(a16[i])));
  // kMedium GEMM on fp16: fp32 accumulation of the widened operands, one
  // rounding of alpha*AB + beta*C.
  for (int i = 0; i < n * n; ++i) c16[i] = FloatToFp16Bits(0.25f * i);
  std::vector<uint16_t> c_in = c16;
  ASSERT_TRUE(
      be->Gemm(Op::kN, Op::kT, 2.0f, V(a16.data(), DType::kFloat16, n, n),
               V(b16.data(), DType::kFloat16, n, n), 0.5f,
               V(c16.data(), DType::kFloat16, n, n), MatmulPrecision::kMedium)
          .ok());
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      float acc = 0;
      for (int k = 0; k < n; ++k)
        acc +=
            Fp16BitsToFloat(a16[i * n + k]) * Fp16BitsToFloat(b16[j * n + k]);
      const float want = 2.0f * acc + 0.5f * Fp16BitsToFloat(c_in[i * n + j]);
      EXPECT_NEAR(Fp16BitsToFloat(c16[i * n + j]), want,
                  std::fabs(want) * 0x1p-11f + 1e-6f);
    }
  }
  // Mixed fp16/bf16 operands are an error naming the rule.
  const absl::Status mixed =
      be->Gemm(Op::kN, Op::kN, 1.0f, V(a16.data(), DType::kFloat16, n, n),
               V(bf.data(), DType::kBFloat16, n, n), 0.0f,
               V(c16.data(), DType::kFloat16, n, n), MatmulPrecision::kMedium);
  EXPECT_NE(mixed.message().find("bf16 or fp16 (all the same)"),
            std::string::npos);
  // FrobeniusNormalize into fp16: fp32 division then one rounding.
  std::vector<uint16_t> nrm(n * n);
  ASSERT_TRUE(be->FrobeniusNormalize(V(a32.data(), DType::kFloat32, n, n),
                                     V(nrm.data(), DType::kFloat16, n, n), 1,
                                     1e-15f)
                  .ok());
  double ss = 0;
  for (float x : a32) ss += double(x) * x;
  const float norm = float(std::sqrt(ss));
  for (int i = 0; i < n * n; ++i)
    ASSERT_EQ(nrm[i], FloatToFp16Bits(a32[i] / norm)) << i;
  // SymmetrizeFromLower mirrors fp16 bits.
  std::vector<uint16_t> s = a16;
  ASSERT_TRUE(
      be->SymmetrizeFromLower(V(s.data(), DType::kFloat16, n, n), n * n, 1)
          .ok());
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      ASSERT_EQ(s[i * n + j], a16[std::max(i, j) * n + std::min(i, j)]);
  // AddToDiagonal: batched, one rounding, off-diagonal untouched.
  std::vector<uint16_t> two(2 * n * n);
  for (int i = 0; i < 2 * n * n; ++i) two[i] = a16[i % (n * n)];
  ASSERT_TRUE(
      be->AddToDiagonal(V(two.data(), DType::kFloat16, n, n), n * n, 2, 3.3f)
          .ok());
  for (int s2 = 0; s2 < 2; ++s2)
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const uint16_t want =
            i == j ? FloatToFp16Bits(Fp16BitsToFloat(a16[i * n + j]) + 3.3f)
                   : a16[i * n + j];
        ASSERT_EQ(two[s2 * n * n + i * n + j], want);
      }
  std::vector<float> f32 = a32;
  ASSERT_TRUE(
      be->AddToDiagonal(V(f32.data(), DType::kFloat32, n, n), n * n, 1, -1.0f)
          .ok());
  EXPECT_EQ(f32[5], a32[5] - 1.0f);
  EXPECT_FALSE(
      be->AddToDiagonal(V(f32.data(), DType::kFloat32, 2, 8), 16, 1, 1.0f)
          .ok());
}

}  // namespace
}  // namespace muond
