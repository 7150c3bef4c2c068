// CPU backend MatmulPrecision::kMedium (bf16 a, b, c; fp32 accumulation; one
// bf16 rounding) against an fp64 loop over the bf16 inputs and hand-computed
// bf16 values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/fp16.h"

namespace muond {
namespace {

constexpr uint16_t kBf16NaN = 0x7fc0;

// n bf16 values, each a normal sample rounded to nearest even.
std::vector<uint16_t> RandomBf16(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = FloatToBf16Bits(d(rng));
  return v;
}

std::vector<uint16_t> Bf16Of(const std::vector<float>& xs) {
  std::vector<uint16_t> v;
  for (float x : xs) v.push_back(FloatToBf16Bits(x));
  return v;
}

MatrixView V16(std::vector<uint16_t>& v, int64_t rows, int64_t cols,
               int64_t ld = -1, int64_t offset = 0) {
  return MatrixView{v.data() + offset, DType::kBFloat16, rows, cols,
                    ld < 0 ? cols : ld};
}

double At(const MatrixView& v, int64_t i, int64_t j) {
  return Bf16BitsToFloat(
      static_cast<const uint16_t*>(v.data)[i * v.row_stride + j]);
}

// The fp64 reference alpha * op(a) op(b) + beta * c of the bf16 inputs (c
// not read when beta == 0) and the sum of the terms' magnitudes.
struct Ref {
  double value, abs_terms;
};
Ref Reference(Op op_a, Op op_b, float alpha, const MatrixView& a,
              const MatrixView& b, float beta, const MatrixView& c, int64_t i,
              int64_t j) {
  const int64_t k = op_a == Op::kN ? a.cols : a.rows;
  double sum = 0, abs_sum = 0;
  for (int64_t l = 0; l < k; ++l) {
    const double x = op_a == Op::kN ? At(a, i, l) : At(a, l, i);
    const double y = op_b == Op::kN ? At(b, l, j) : At(b, j, l);
    sum += x * y;
    abs_sum += std::fabs(x * y);
  }
  const double bc = beta == 0.0f ? 0.0 : beta * At(c, i, j);
  return {alpha * sum + bc, std::fabs(alpha) * abs_sum + std::fabs(bc)};
}

// |got - ref| bound: one bf16 rounding of the fp32 result (2^-8 relative)
// plus the fp32 accumulation error (k + 2 roundings of 2^-24 relative to the
// terms' magnitudes), counted twice since it can also move that rounding.
double Tolerance(const Ref& r, int64_t k) {
  return std::ldexp(std::fabs(r.value), -8) +
         2.0 * double(k + 2) * std::ldexp(r.abs_terms, -24);
}

// Every element of c (computed from a, b and c0) within Tolerance of the
// fp64 reference.
void ExpectWithinBf16(Op op_a, Op op_b, float alpha, const MatrixView& a,
                      const MatrixView& b, float beta, const MatrixView& c0,
                      const MatrixView& c) {
  const int64_t k = op_a == Op::kN ? a.cols : a.rows;
  for (int64_t i = 0; i < c.rows; ++i) {
    for (int64_t j = 0; j < c.cols; ++j) {
      const Ref r = Reference(op_a, op_b, alpha, a, b, beta, c0, i, j);
      EXPECT_NEAR(At(c, i, j), r.value, Tolerance(r, k)) << i << "," << j;
    }
  }
}

struct OpCase {
  Op op_a, op_b;
};

class MediumGemmTest : public ::testing::TestWithParam<OpCase> {};

TEST_P(MediumGemmTest, MatchesFp64OfBf16InputsOnStridedViews) {
  auto backend = MakeCpuBackend();
  const auto [op_a, op_b] = GetParam();
  const int64_t m = 13, n = 7, k = 37, pad = 5;
  // Stored shapes, each a column block of a wider matrix (row_stride > cols).
  const int64_t ar = op_a == Op::kN ? m : k, ac = op_a == Op::kN ? k : m;
  const int64_t br = op_b == Op::kN ? k : n, bc = op_b == Op::kN ? n : k;
  std::vector<uint16_t> a = RandomBf16(ar * (ac + pad), 1),
                        b = RandomBf16(br * (bc + pad), 2),
                        c = RandomBf16(m * (n + pad), 3), c0 = c;
  const float alpha = 0.75f, beta = -1.5f;
  const MatrixView va = V16(a, ar, ac, ac + pad), vb = V16(b, br, bc, bc + pad);
  ASSERT_TRUE(backend
                  ->Gemm(op_a, op_b, alpha, va, vb, beta, V16(c, m, n, n + pad),
                         MatmulPrecision::kMedium)
                  .ok());
  ExpectWithinBf16(op_a, op_b, alpha, va, vb, beta, V16(c0, m, n, n + pad),
                   V16(c, m, n, n + pad));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = n; j < n + pad; ++j) {  // padding untouched
      EXPECT_EQ(c[i * (n + pad) + j], c0[i * (n + pad) + j]);
    }
  }
}

// Exactly the fp32 path on the widened operands, rounded once, for bf16 and
// fp16 on strided views: the widening and rounding copies (every 16-bit
// operand and result of an NS product) change no bit and touch no padding.
TEST_P(MediumGemmTest, IsTheFp32GemmOfTheWidenedOperandsRoundedOnce) {
  auto backend = MakeCpuBackend();
  const auto [op_a, op_b] = GetParam();
  const int64_t m = 9, n = 11, k = 23, pad = 3;
  const int64_t ar = op_a == Op::kN ? m : k, ac = op_a == Op::kN ? k : m;
  const int64_t br = op_b == Op::kN ? k : n, bc = op_b == Op::kN ? n : k;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const bool fp16 = dtype == DType::kFloat16;
    const auto to_bits = fp16 ? FloatToFp16Bits : FloatToBf16Bits;
    const auto to_float = fp16 ? Fp16BitsToFloat : Bf16BitsToFloat;
    std::vector<uint16_t> a(ar * (ac + pad)), b(br * (bc + pad)),
        c(m * (n + pad));
    std::mt19937 rng(7);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto* v : {&a, &b, &c}) {
      for (uint16_t& x : *v) x = to_bits(d(rng));
    }
    const std::vector<uint16_t> c0 = c;
    // The reference: contiguous fp32 copies through kHighest.
    auto widen = [&](const std::vector<uint16_t>& v, int64_t rows, int64_t cols,
                     int64_t ld) {
      std::vector<float> w(rows * cols);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          w[i * cols + j] = to_float(v[i * ld + j]);
        }
      }
      return w;
    };
    std::vector<float> a32 = widen(a, ar, ac, ac + pad),
                       b32 = widen(b, br, bc, bc + pad),
                       c32 = widen(c, m, n, n + pad);
    const float alpha = 0.75f, beta = -1.5f;
    ASSERT_TRUE(backend
                    ->Gemm(op_a, op_b, alpha,
                           {a32.data(), DType::kFloat32, ar, ac, ac},
                           {b32.data(), DType::kFloat32, br, bc, bc}, beta,
                           {c32.data(), DType::kFloat32, m, n, n},
                           MatmulPrecision::kHighest)
                    .ok());
    ASSERT_TRUE(
        backend
            ->Gemm(op_a, op_b, alpha, {a.data(), dtype, ar, ac, ac + pad},
                   {b.data(), dtype, br, bc, bc + pad}, beta,
                   {c.data(), dtype, m, n, n + pad}, MatmulPrecision::kMedium)
            .ok());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n + pad; ++j) {
        const uint16_t want =
            j < n ? to_bits(c32[i * n + j]) : c0[i * (n + pad) + j];
        ASSERT_EQ(c[i * (n + pad) + j], want)
            << (fp16 ? "fp16" : "bf16") << " (" << i << ", " << j << ")";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, MediumGemmTest,
                         ::testing::Values(OpCase{Op::kN, Op::kN},
                                           OpCase{Op::kN, Op::kT},
                                           OpCase{Op::kT, Op::kN},
                                           OpCase{Op::kT, Op::kT}));

// Exact values that tell one rounding after fp32 accumulation from bf16
// rounding along the way (bf16 has 8 significant bits: ulp(1) = 2^-7).
TEST(CpuBackendMedium, AccumulatesInFp32AndRoundsOnceToNearestEven) {
  auto backend = MakeCpuBackend();
  const float e9 = std::ldexp(1.0f, -9), e8 = std::ldexp(1.0f, -8);
  struct Case {
    std::vector<float> a_row, b_col;
    float beta, c;
    uint16_t want;
  };
  const std::vector<Case> cases = {
      // 1 + 3*2^-9 rounds up to 1 + 2^-7; a bf16 running sum would stay 1.
      {{1, 1, 1, 1}, {1, e9, e9, e9}, 0.0f, 0.0f, 0x3f81},
      // 1 + 2^-8 is a tie: to even, 1.
      {{1, 1}, {1, e8}, 0.0f, 0.0f, 0x3f80},
      // 1 + 3*2^-8 is a tie between 1 + 2^-7 (odd) and 1 + 2^-6: 1 + 2^-6.
      {{1, 1}, {1 + 2 * e8, e8}, 0.0f, 0.0f, 0x3f82},
      // (1 + 2^-9) + 1.5*2^-9 = 1 + 1.25*2^-8 rounds up; rounding a*b to bf16
      // before adding beta*c would give 1.
      {{1, 1}, {1, e9}, 1.0f, 1.5f * e9, 0x3f81},
      // beta*c in fp32 from the bf16 c: 0.5 * 2 + 1 = 2.
      {{1}, {1}, 0.5f, 2.0f, 0x4000},
  };
  for (const Case& t : cases) {
    const int64_t k = int64_t(t.a_row.size());
    std::vector<uint16_t> a = Bf16Of(t.a_row), b = Bf16Of(t.b_col),
                          c = Bf16Of({t.c});
    ASSERT_TRUE(backend
                    ->Gemm(Op::kN, Op::kN, 1.0f, V16(a, 1, k), V16(b, k, 1),
                           t.beta, V16(c, 1, 1), MatmulPrecision::kMedium)
                    .ok());
    EXPECT_EQ(c[0], t.want) << "k " << k << " beta " << t.beta;
  }
}

TEST(CpuBackendMedium, StridedBatchWithGapsMatchesFp64AndPerSliceGemm) {
  auto backend = MakeCpuBackend();
  const int64_t batch = 3, m = 6, k = 9, n = 5, pad = 2, gap = 7;
  // Slice i of x starts at i * stride_x; each slice is a strided view of
  // its rows (row_stride = cols + pad) and slices leave `gap` elements free.
  // a is used transposed (stored k x m), b as stored (k x n).
  const int64_t sa = k * (m + pad) + gap, sb = k * (n + pad) + gap,
                sc = m * (n + pad) + gap;
  std::vector<uint16_t> a = RandomBf16(batch * sa, 4),
                        b = RandomBf16(batch * sb, 5),
                        c = RandomBf16(batch * sc, 6), c0 = c, c1 = c;
  const float alpha = -1.25f, beta = 0.5f;
  ASSERT_TRUE(backend
                  ->GemmStridedBatched(
                      Op::kT, Op::kN, alpha, V16(a, k, m, m + pad), sa,
                      V16(b, k, n, n + pad), sb, beta, V16(c, m, n, n + pad),
                      sc, batch, MatmulPrecision::kMedium)
                  .ok());
  for (int64_t s = 0; s < batch; ++s) {
    const MatrixView as = V16(a, k, m, m + pad, s * sa),
                     bs = V16(b, k, n, n + pad, s * sb);
    ExpectWithinBf16(Op::kT, Op::kN, alpha, as, bs, beta,
                     V16(c0, m, n, n + pad, s * sc),
                     V16(c, m, n, n + pad, s * sc));
    ASSERT_TRUE(backend
                    ->Gemm(Op::kT, Op::kN, alpha, as, bs, beta,
                           V16(c1, m, n, n + pad, s * sc),
                           MatmulPrecision::kMedium)
                    .ok());
  }
  // Bitwise the per-slice Gemm, with row padding and gaps untouched.
  EXPECT_EQ(c, c1);
  for (int64_t s = 0; s < batch; ++s) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = n; j < n + pad; ++j) {
        const int64_t p = s * sc + i * (n + pad) + j;
        EXPECT_EQ(c[p], c0[p]);
      }
    }
    for (int64_t p = s * sc + m * (n + pad); p < (s + 1) * sc; ++p) {
      EXPECT_EQ(c[p], c0[p]);
    }
  }
}

TEST(CpuBackendMedium, BetaZeroIgnoresNanInC) {
  auto backend = MakeCpuBackend();
  const int64_t m = 4, k = 6, n = 3;
  std::vector<uint16_t> a = RandomBf16(m * k, 7), b = RandomBf16(k * n, 8),
                        c(m * n, kBf16NaN), nan_c = c;
  ASSERT_TRUE(backend
                  ->Gemm(Op::kN, Op::kN, 2.0f, V16(a, m, k), V16(b, k, n), 0.0f,
                         V16(c, m, n), MatmulPrecision::kMedium)
                  .ok());
  for (uint16_t x : c) EXPECT_TRUE(std::isfinite(Bf16BitsToFloat(x)));
  ExpectWithinBf16(Op::kN, Op::kN, 2.0f, V16(a, m, k), V16(b, k, n), 0.0f,
                   V16(nan_c, m, n), V16(c, m, n));
  // The same through GemmOut: NaN in c (not read) and in d (overwritten).
  std::vector<uint16_t> d(m * n, kBf16NaN), c_again(m * n, kBf16NaN);
  ASSERT_TRUE(backend
                  ->GemmOut(Op::kN, Op::kN, 2.0f, V16(a, m, k), V16(b, k, n),
                            0.0f, V16(c_again, m, n), V16(d, m, n),
                            MatmulPrecision::kMedium)
                  .ok());
  EXPECT_EQ(d, c);
}

TEST(CpuBackendMedium, GemmOutReadsBf16CAndLeavesItUnchanged) {
  auto backend = MakeCpuBackend();
  const int64_t m = 5, k = 8, n = 6;
  std::vector<uint16_t> a = RandomBf16(k * m, 9), b = RandomBf16(n * k, 10),
                        c = RandomBf16(m * n, 11), c0 = c, d(m * n, kBf16NaN);
  ASSERT_TRUE(backend
                  ->GemmOut(Op::kT, Op::kT, 1.0f, V16(a, k, m), V16(b, n, k),
                            -0.75f, V16(c, m, n), V16(d, m, n),
                            MatmulPrecision::kMedium)
                  .ok());
  EXPECT_EQ(c, c0);
  ExpectWithinBf16(Op::kT, Op::kT, 1.0f, V16(a, k, m), V16(b, n, k), -0.75f,
                   V16(c0, m, n), V16(d, m, n));
}

TEST(CpuBackendMedium, EmptyInnerDimensionScalesC) {
  auto backend = MakeCpuBackend();
  std::vector<uint16_t> a, b, c = Bf16Of({1.5f, -3.0f, 0.25f, 8.0f});
  ASSERT_TRUE(backend
                  ->Gemm(Op::kN, Op::kN, 1.0f, V16(a, 2, 0), V16(b, 0, 2), 0.5f,
                         V16(c, 2, 2), MatmulPrecision::kMedium)
                  .ok());
  EXPECT_EQ(c, Bf16Of({0.75f, -1.5f, 0.125f, 4.0f}));
  std::fill(c.begin(), c.end(), kBf16NaN);
  ASSERT_TRUE(backend
                  ->Gemm(Op::kN, Op::kN, 1.0f, V16(a, 2, 0), V16(b, 0, 2), 0.0f,
                         V16(c, 2, 2), MatmulPrecision::kMedium)
                  .ok());
  EXPECT_EQ(c, std::vector<uint16_t>(4, 0));
}

TEST(CpuBackendMedium, WrongOperandDTypeNamesOperandAndRule) {
  auto backend = MakeCpuBackend();
  std::vector<float> a32(4, 1.0f);
  std::vector<uint16_t> b = Bf16Of({1, 0, 0, 1}), c(4, 0), c0 = c;
  const MatrixView a32v = {a32.data(), DType::kFloat32, 2, 2, 2};
  const absl::Status s =
      backend->Gemm(Op::kN, Op::kN, 1.0f, a32v, V16(b, 2, 2), 0.0f,
                    V16(c, 2, 2), MatmulPrecision::kMedium);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(
      s.message().find("medium needs bf16 or fp16 (all the same) a, b and c"),
      absl::string_view::npos)
      << s;
  EXPECT_NE(s.message().find("got a fp32"), absl::string_view::npos) << s;
  EXPECT_EQ(c, c0);  // a failed call modifies nothing
  // bf16 operands with highest are rejected the other way round.
  const absl::Status h =
      backend->Gemm(Op::kN, Op::kN, 1.0f, V16(b, 2, 2), V16(b, 2, 2), 0.0f,
                    V16(c, 2, 2), MatmulPrecision::kHighest);
  EXPECT_EQ(h.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(h.message().find("highest needs fp32"), absl::string_view::npos)
      << h;
}

}  // namespace
}  // namespace muond
