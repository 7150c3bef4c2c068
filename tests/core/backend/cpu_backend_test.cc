// CPU backend against plain fp64 loops and hand-computed values.
#include "core/backend/cpu_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string_view>
#include <utility>
#include <vector>

#include "core/backend/bf16.h"

namespace muond {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

MatrixView V(std::vector<float>& v, int64_t rows, int64_t cols,
             int64_t ld = -1) {
  return MatrixView{v.data(), DType::kFloat32, rows, cols, ld < 0 ? cols : ld};
}

MatrixView V16(std::vector<uint16_t>& v, int64_t rows, int64_t cols) {
  return MatrixView{v.data(), DType::kBFloat16, rows, cols, cols};
}

struct GemmCase {
  Op op_a, op_b;
};

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, MatchesFp64LoopOnStridedViews) {
  auto backend = MakeCpuBackend();
  const auto [op_a, op_b] = GetParam();
  const int64_t m = 13, n = 7, k = 11, pad = 5;
  // Stored shapes, each a column block of a wider matrix (row_stride > cols).
  const int64_t ar = op_a == Op::kN ? m : k, ac = op_a == Op::kN ? k : m;
  const int64_t br = op_b == Op::kN ? k : n, bc = op_b == Op::kN ? n : k;
  std::vector<float> a = Random(ar * (ac + pad), 1),
                     b = Random(br * (bc + pad), 2),
                     c = Random(m * (n + pad), 3), c0 = c;
  const float alpha = 0.75f, beta = -1.5f;
  ASSERT_TRUE(backend
                  ->Gemm(op_a, op_b, alpha, V(a, ar, ac, ac + pad),
                         V(b, br, bc, bc + pad), beta, V(c, m, n, n + pad),
                         MatmulPrecision::kHighest)
                  .ok());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (int64_t l = 0; l < k; ++l) {
        const double x =
            op_a == Op::kN ? a[i * (ac + pad) + l] : a[l * (ac + pad) + i];
        const double y =
            op_b == Op::kN ? b[l * (bc + pad) + j] : b[j * (bc + pad) + l];
        ref += x * y;
      }
      ref = alpha * ref + beta * double(c0[i * (n + pad) + j]);
      EXPECT_NEAR(c[i * (n + pad) + j], ref, 1e-5 * (1 + std::fabs(ref)));
    }
    for (int64_t j = n; j < n + pad; ++j) {  // padding untouched
      EXPECT_EQ(c[i * (n + pad) + j], c0[i * (n + pad) + j]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, GemmTest,
                         ::testing::Values(GemmCase{Op::kN, Op::kN},
                                           GemmCase{Op::kN, Op::kT},
                                           GemmCase{Op::kT, Op::kN},
                                           GemmCase{Op::kT, Op::kT}));

TEST(CpuBackend, GemmBetaZeroIgnoresNanInC) {
  auto backend = MakeCpuBackend();
  std::vector<float> a = {1, 2, 3, 4}, b = {1, 0, 0, 1},
                     c(4, std::numeric_limits<float>::quiet_NaN());
  ASSERT_TRUE(backend
                  ->Gemm(Op::kN, Op::kN, 1, V(a, 2, 2), V(b, 2, 2), 0,
                         V(c, 2, 2), MatmulPrecision::kHighest)
                  .ok());
  EXPECT_EQ(c, a);
}

TEST(CpuBackend, StridedBatchedEqualsPerSliceGemm) {
  auto backend = MakeCpuBackend();
  const int64_t batch = 3, m = 6, k = 5, n = 4;
  std::vector<float> a = Random(batch * m * k, 4), b = Random(batch * k * n, 5),
                     c(batch * m * n, 0), c1(batch * m * n, 0);
  ASSERT_TRUE(backend
                  ->GemmStridedBatched(Op::kN, Op::kN, 1, V(a, m, k), m * k,
                                       V(b, k, n), k * n, 0, V(c, m, n), m * n,
                                       batch, MatmulPrecision::kHighest)
                  .ok());
  for (int64_t s = 0; s < batch; ++s) {
    MatrixView as{a.data() + s * m * k, DType::kFloat32, m, k, k};
    MatrixView bs{b.data() + s * k * n, DType::kFloat32, k, n, n};
    MatrixView cs{c1.data() + s * m * n, DType::kFloat32, m, n, n};
    ASSERT_TRUE(
        backend
            ->Gemm(Op::kN, Op::kN, 1, as, bs, 0, cs, MatmulPrecision::kHighest)
            .ok());
  }
  EXPECT_EQ(c, c1);
}

TEST(CpuBackend, HighPrecisionIsAnError) {
  auto backend = MakeCpuBackend();
  std::vector<float> a(4, 1), c(4, 0);
  const absl::Status s =
      backend->Gemm(Op::kN, Op::kN, 1, V(a, 2, 2), V(a, 2, 2), 0, V(c, 2, 2),
                    MatmulPrecision::kHigh);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("CPU"), absl::string_view::npos) << s;
  EXPECT_FALSE(backend->SupportsPrecision(MatmulPrecision::kHigh));
  EXPECT_TRUE(backend->SupportsPrecision(MatmulPrecision::kHighest));
  EXPECT_TRUE(backend->SupportsPrecision(MatmulPrecision::kMedium));
}

TEST(CpuBackend, GemmShapeMismatchNamesTheRule) {
  auto backend = MakeCpuBackend();
  std::vector<float> a(6, 1), c(4, 0);
  const absl::Status s =
      backend->Gemm(Op::kN, Op::kN, 1, V(a, 2, 3), V(a, 2, 3), 0, V(c, 2, 2),
                    MatmulPrecision::kHighest);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("k x n"), absl::string_view::npos) << s;
}

TEST(Bf16, RoundToNearestEvenKnownValues) {
  // 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: ties to even -> 1.
  EXPECT_EQ(FloatToBf16Bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: -> 1 + 2^-6.
  EXPECT_EQ(FloatToBf16Bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  // Just above the tie rounds up.
  EXPECT_EQ(
      FloatToBf16Bits(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
      0x3f81);
  EXPECT_EQ(FloatToBf16Bits(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16Bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(Bf16BitsToFloat(
      FloatToBf16Bits(std::numeric_limits<float>::quiet_NaN()))));
  // Largest finite fp32 overflows to +inf under RNE.
  EXPECT_EQ(FloatToBf16Bits(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(CpuBackend, Copy2DConvertsAndRespectsStrides) {
  auto backend = MakeCpuBackend();
  std::vector<float> src = {1.0f, 1.00390625f, 3.0f, -0.1f, 9, 9,
                            5.5f, 1e-3f,       7.0f, 2.0f,  9, 9};
  std::vector<uint16_t> mid(8, 0);
  std::vector<float> back(8, -1);
  ASSERT_TRUE(backend->Copy2D(V16(mid, 2, 4), V(src, 2, 4, 6)).ok());
  ASSERT_TRUE(backend->Copy2D(V(back, 2, 4), V16(mid, 2, 4)).ok());
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      const float x = src[i * 6 + j];
      EXPECT_EQ(mid[i * 4 + j], FloatToBf16Bits(x));
      EXPECT_EQ(back[i * 4 + j], RoundToBf16(x));
      EXPECT_LE(std::fabs(back[i * 4 + j] - x),
                std::fabs(x) * std::ldexp(1.0, -8));
    }
  }
}

// fp8 e4m3 copies only to fp8 (its block scales are not the view's): a
// conversion either way is refused naming both dtypes, and nothing is
// written; fp8 to fp8 copies the bytes.
TEST(CpuBackend, Copy2DConvertsNoFp8) {
  auto backend = MakeCpuBackend();
  std::vector<uint8_t> codes = {0x38, 0xb8, 0x40, 0x00};  // 1, -1, 2, 0
  std::vector<float> f32(4, -7.0f);
  std::vector<uint8_t> copy(4, 0xff);
  const MatrixView fp8 = ContiguousView(codes.data(), DType::kFloat8E4M3, 2, 2);
  for (const auto& [dst, src] :
       {std::pair{ContiguousView(f32.data(), DType::kFloat32, 2, 2), fp8},
        std::pair{fp8, ContiguousView(f32.data(), DType::kFloat32, 2, 2)}}) {
    const absl::Status st = backend->Copy2D(dst, src);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("fp8_e4m3"), std::string_view::npos) << st;
    EXPECT_NE(st.message().find("fp32"), std::string_view::npos) << st;
  }
  EXPECT_EQ(f32, std::vector<float>(4, -7.0f));
  EXPECT_EQ(codes, (std::vector<uint8_t>{0x38, 0xb8, 0x40, 0x00}));
  ASSERT_TRUE(
      backend
          ->Copy2D(ContiguousView(copy.data(), DType::kFloat8E4M3, 2, 2), fp8)
          .ok());
  EXPECT_EQ(copy, codes);
}

TEST(CpuBackend, FrobeniusNormalizePerSliceWithEps) {
  auto backend = MakeCpuBackend();
  // Three 2x3 slices: random, zero, and 1e-30 scaled.
  std::vector<float> src = Random(18, 7);
  for (int i = 6; i < 12; ++i) src[i] = 0.0f;
  for (int i = 12; i < 18; ++i) src[i] = src[i - 12] * 1e-30f;
  std::vector<float> dst(18, -1);
  ASSERT_TRUE(
      backend->FrobeniusNormalize(V(src, 6, 3), V(dst, 6, 3), 3, 1e-37f).ok());
  double n0 = 0;
  for (int i = 0; i < 6; ++i) n0 += double(src[i]) * src[i];
  for (int i = 0; i < 6; ++i) {
    EXPECT_NEAR(dst[i], src[i] / std::sqrt(n0), 1e-6);
    EXPECT_EQ(dst[6 + i], 0.0f);
    // The 1e-30 slice normalises to the same matrix (fp64 sum of squares).
    EXPECT_NEAR(dst[12 + i], dst[i], 1e-6);
  }
  // With a larger eps the tiny slice is divided by eps instead.
  ASSERT_TRUE(
      backend->FrobeniusNormalize(V(src, 6, 3), V(dst, 6, 3), 3, 1e-15f).ok());
  for (int i = 0; i < 6; ++i)
    EXPECT_NEAR(dst[12 + i], src[12 + i] / 1e-15f, 1e-20);
  EXPECT_FALSE(
      backend->FrobeniusNormalize(V(src, 6, 3), V(dst, 6, 3), 4, 1e-15f).ok());
  EXPECT_FALSE(
      backend->FrobeniusNormalize(V(src, 6, 3), V(dst, 6, 3), 3, 0.0f).ok());
}

TEST(CpuBackend, MuonMomentumNesterovOnAndOff) {
  auto backend = MakeCpuBackend();
  const double beta = 0.95;
  for (bool nesterov : {false, true}) {
    std::vector<float> g = Random(12, 8), m = Random(12, 9), m0 = m, out(12);
    ASSERT_TRUE(
        backend
            ->MuonMomentum(V(g, 3, 4), V(m, 3, 4), beta, nesterov, V(out, 3, 4))
            .ok());
    for (int i = 0; i < 12; ++i) {
      const double mref = m0[i] + (1 - beta) * (double(g[i]) - m0[i]);
      const double oref = nesterov ? g[i] + beta * (mref - g[i]) : mref;
      EXPECT_NEAR(m[i], mref, 1e-6);
      EXPECT_NEAR(out[i], oref, 1e-6);
    }
  }
  // The NS input never aliases the state.
  std::vector<float> g(4, 1), m(4, 0);
  EXPECT_FALSE(
      backend->MuonMomentum(V(g, 2, 2), V(m, 2, 2), beta, true, V(m, 2, 2))
          .ok());
}

TEST(CpuBackend, MuonMomentumBf16StateRoundsOnce) {
  auto backend = MakeCpuBackend();
  std::vector<float> g = Random(8, 10), out(8);
  std::vector<uint16_t> m(8);
  for (int i = 0; i < 8; ++i) m[i] = FloatToBf16Bits(0.5f * i);
  ASSERT_TRUE(
      backend->MuonMomentum(V(g, 2, 4), V16(m, 2, 4), 0.9, false, V(out, 2, 4))
          .ok());
  for (int i = 0; i < 8; ++i) {
    const float mref = 0.5f * i + 0.1f * (g[i] - 0.5f * i);
    EXPECT_NEAR(Bf16BitsToFloat(m[i]), mref, std::fabs(mref) * 0.008 + 1e-6);
    EXPECT_EQ(out[i], Bf16BitsToFloat(m[i]));
  }
}

// Out of place (the step engine: read the state, write the staged buffer)
// against in place, single and batched, fp32 and bf16 state, a strided view:
// the new momentum and the NS input are bitwise the same, momentum_in is not
// written.
TEST(CpuBackend, MuonMomentumOutOfPlaceIsInPlaceBitwise) {
  auto backend = MakeCpuBackend();
  for (bool nesterov : {false, true}) {
    for (bool bf16_state : {false, true}) {
      // 3 x 4 views in 3 x 5 storage (ld 5) for grad and both momenta.
      std::vector<float> g = Random(15, 31), m32 = Random(15, 32);
      std::vector<uint16_t> m16(15);
      for (int i = 0; i < 15; ++i) m16[i] = FloatToBf16Bits(m32[i]);
      auto state = [&](std::vector<float>& f, std::vector<uint16_t>& h) {
        return bf16_state ? MatrixView{h.data(), DType::kBFloat16, 3, 4, 5}
                          : V(f, 3, 4, 5);
      };
      std::vector<float> in_f = m32, inplace_f = m32, out_f(15, -7.0f);
      std::vector<uint16_t> in_h = m16, inplace_h = m16, out_h(15, 0xdead);
      std::vector<float> ns_in(12), ns_out(12);
      ASSERT_TRUE(backend
                      ->MuonMomentum(V(g, 3, 4, 5), state(inplace_f, inplace_h),
                                     0.95, nesterov, V(ns_in, 3, 4))
                      .ok());
      ASSERT_TRUE(backend
                      ->MuonMomentum(V(g, 3, 4, 5), state(in_f, in_h),
                                     state(out_f, out_h), 0.95, nesterov,
                                     V(ns_out, 3, 4))
                      .ok());
      EXPECT_EQ(in_f, m32);  // momentum_in untouched
      EXPECT_EQ(in_h, m16);
      for (int r = 0; r < 3; ++r) {
        for (int c = 0; c < 4; ++c) {
          const int i = r * 5 + c;
          if (bf16_state) {
            EXPECT_EQ(out_h[i], inplace_h[i]) << i;
          } else {
            EXPECT_EQ(std::memcmp(&out_f[i], &inplace_f[i], 4), 0) << i;
          }
          EXPECT_EQ(std::memcmp(&ns_out[r * 4 + c], &ns_in[r * 4 + c], 4), 0);
        }
        // The pad column of momentum_out is not written.
        EXPECT_EQ(bf16_state ? float(out_h[r * 5 + 4]) : out_f[r * 5 + 4],
                  bf16_state ? float(0xdead) : -7.0f);
      }
      // Batched (two params): the same values.
      std::vector<float> in2_f = m32, out2_f(15), ns2(12), g_b = Random(12, 33),
                         mi_b = Random(12, 34), mo_b(12), mp_b = mi_b, nsb(12),
                         nsp(12);
      std::vector<uint16_t> in2_h = m16, out2_h(15);
      const std::vector<MatrixView> grads = {V(g, 3, 4, 5), V(g_b, 3, 4)};
      const std::vector<MatrixView> ins = {state(in2_f, in2_h), V(mi_b, 3, 4)};
      const std::vector<MatrixView> outs = {state(out2_f, out2_h),
                                            V(mo_b, 3, 4)};
      const std::vector<MatrixView> nss = {V(ns2, 3, 4), V(nsb, 3, 4)};
      ASSERT_TRUE(
          backend->MuonMomentumBatch(grads, ins, outs, 0.95, nesterov, nss)
              .ok());
      ASSERT_TRUE(backend
                      ->MuonMomentum(V(g_b, 3, 4), V(mp_b, 3, 4), 0.95,
                                     nesterov, V(nsp, 3, 4))
                      .ok());
      EXPECT_EQ(in2_f, m32);
      EXPECT_EQ(in2_h, m16);
      EXPECT_EQ(ns2, ns_out);
      EXPECT_EQ(nsb, nsp);
      EXPECT_EQ(mo_b, mp_b);
      for (int r = 0; r < 3; ++r) {
        for (int c = 0; c < 4; ++c) {
          const int i = r * 5 + c;
          if (bf16_state) {
            EXPECT_EQ(out2_h[i], out_h[i]);
          } else {
            EXPECT_EQ(out2_f[i], out_f[i]);
          }
        }
      }
    }
  }
}

// The step engine's two passes: the NS input with the new momentum not
// stored (momentum_out Absent), then after the commit vote the new momentum
// in place with no NS input (out Absent). Each is bitwise the one in-place
// call, and the first leaves the state as it was; single and batched, fp32
// and bf16 state, a strided grad, fp32 and bf16 NS inputs.
TEST(CpuBackend, MuonMomentumInTwoPassesIsTheOneCall) {
  auto backend = MakeCpuBackend();
  for (bool nesterov : {false, true}) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      for (DType ns : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE(::testing::Message() << nesterov << int(state) << int(ns));
        // Two params: 3 x 4 with its grad in 3 x 5 storage, and 2 x 8.
        std::vector<float> g0 = Random(15, 41), g1 = Random(16, 42);
        const std::vector<MatrixView> grads = {V(g0, 3, 4, 5), V(g1, 2, 8)};
        auto state_of = [&](uint32_t seed, int64_t rows, int64_t cols) {
          std::vector<float> f = Random(rows * cols, seed);
          std::vector<uint8_t> bytes(f.size() * DTypeSize(state));
          for (size_t k = 0; k < f.size(); ++k) {
            if (state == DType::kFloat32) {
              std::memcpy(&bytes[4 * k], &f[k], 4);
            } else {
              const uint16_t h = FloatToBf16Bits(f[k]);
              std::memcpy(&bytes[2 * k], &h, 2);
            }
          }
          return bytes;
        };
        std::vector<std::vector<uint8_t>> one = {state_of(43, 3, 4),
                                                 state_of(44, 2, 8)};
        std::vector<std::vector<uint8_t>> two = one;
        const std::vector<std::vector<uint8_t>> start = one;
        std::vector<std::vector<uint8_t>> ns_one(2), ns_two(2);
        std::vector<MatrixView> m_one, m_two, o_one, o_two;
        for (int k = 0; k < 2; ++k) {
          const int64_t rows = grads[k].rows, cols = grads[k].cols;
          ns_one[k].assign(rows * cols * DTypeSize(ns), 0);
          ns_two[k].assign(rows * cols * DTypeSize(ns), 0xee);
          m_one.push_back(ContiguousView(one[k].data(), state, rows, cols));
          m_two.push_back(ContiguousView(two[k].data(), state, rows, cols));
          o_one.push_back(ContiguousView(ns_one[k].data(), ns, rows, cols));
          o_two.push_back(ContiguousView(ns_two[k].data(), ns, rows, cols));
        }
        std::vector<MatrixView> no_state, no_ns;
        for (int k = 0; k < 2; ++k) {
          no_state.push_back(Absent(m_two[k]));
          no_ns.push_back(Absent(o_two[k]));
        }
        for (bool batched : {false, true}) {
          one = start;
          two = start;
          if (batched) {
            ASSERT_TRUE(
                backend->MuonMomentumBatch(grads, m_one, 0.95, nesterov, o_one)
                    .ok());
            ASSERT_TRUE(backend
                            ->MuonMomentumBatch(grads, m_two, no_state, 0.95,
                                                nesterov, o_two)
                            .ok());
          } else {
            for (int k = 0; k < 2; ++k) {
              ASSERT_TRUE(backend
                              ->MuonMomentum(grads[k], m_one[k], 0.95, nesterov,
                                             o_one[k])
                              .ok());
              ASSERT_TRUE(backend
                              ->MuonMomentum(grads[k], m_two[k], no_state[k],
                                             0.95, nesterov, o_two[k])
                              .ok());
            }
          }
          EXPECT_EQ(two, start);  // the first pass only reads the state
          EXPECT_EQ(ns_two, ns_one);
          ASSERT_TRUE(backend
                          ->MuonMomentumBatch(grads, m_two, m_two, 0.95,
                                              nesterov, no_ns)
                          .ok());
          EXPECT_EQ(two, one);
          EXPECT_NE(two, start);
        }
        // Nothing to write: refused.
        EXPECT_FALSE(backend
                         ->MuonMomentum(grads[0], m_two[0], no_state[0], 0.95,
                                        nesterov, no_ns[0])
                         .ok());
      }
    }
  }
}

TEST(CpuBackend, MuonMomentumOutOfPlaceRejectsOverlap) {
  auto backend = MakeCpuBackend();
  std::vector<float> g(8, 1), m(8, 0), out(8), buf(12);
  // momentum_out overlapping momentum_in (shifted by one element).
  EXPECT_FALSE(
      backend
          ->MuonMomentum(V(g, 2, 4), V(buf, 2, 4),
                         MatrixView{buf.data() + 1, DType::kFloat32, 2, 4, 4},
                         0.9, true, V(out, 2, 4))
          .ok());
  // momentum_out over grad, and the NS input over momentum_out.
  EXPECT_FALSE(backend
                   ->MuonMomentum(V(g, 2, 4), V(m, 2, 4), V(g, 2, 4), 0.9, true,
                                  V(out, 2, 4))
                   .ok());
  EXPECT_FALSE(backend
                   ->MuonMomentum(V(g, 2, 4), V(m, 2, 4), V(buf, 2, 4), 0.9,
                                  true, V(buf, 2, 4))
                   .ok());
  // Spans of different lengths.
  const std::vector<MatrixView> one = {V(g, 2, 4)};
  const std::vector<MatrixView> none;
  EXPECT_FALSE(backend->MuonMomentumBatch(one, one, none, 0.9, true, one).ok());
  // Disjoint: fine.
  EXPECT_TRUE(backend
                  ->MuonMomentum(V(g, 2, 4), V(m, 2, 4), V(buf, 2, 4), 0.9,
                                 true, V(out, 2, 4))
                  .ok());
}

// The bf16 NS data path: the momentum kernel writes the Newton–Schulz input
// rounded once to bf16 (the fp32 value it would have written, then
// round-to-nearest-even), and the update reads a bf16 update exactly.
TEST(CpuBackend, MomentumWritesBf16NsInputRoundedOnce) {
  auto backend = MakeCpuBackend();
  for (bool nesterov : {false, true}) {
    std::vector<float> g = Random(12, 21), m = Random(12, 22), m32 = m,
                       out32(12);
    std::vector<uint16_t> out16(12);
    ASSERT_TRUE(backend
                    ->MuonMomentum(V(g, 3, 4), V(m, 3, 4), 0.95, nesterov,
                                   V16(out16, 3, 4))
                    .ok());
    ASSERT_TRUE(backend
                    ->MuonMomentum(V(g, 3, 4), V(m32, 3, 4), 0.95, nesterov,
                                   V(out32, 3, 4))
                    .ok());
    for (int i = 0; i < 12; ++i) {
      EXPECT_EQ(m[i], m32[i]) << i;  // the state does not depend on out
      EXPECT_EQ(out16[i], FloatToBf16Bits(out32[i])) << i;
      EXPECT_NEAR(Bf16BitsToFloat(out16[i]), out32[i],
                  std::fabs(out32[i]) * 0.004 + 1e-30);
    }
  }
}

TEST(CpuBackend, ApplyUpdateReadsBf16UpdateExactly) {
  auto backend = MakeCpuBackend();
  std::vector<float> p = Random(6, 23), p32 = p, u = Random(6, 24);
  std::vector<uint16_t> u16(6);
  for (int i = 0; i < 6; ++i) {
    u16[i] = FloatToBf16Bits(u[i]);
    u[i] = Bf16BitsToFloat(u16[i]);  // the same values in fp32
  }
  ASSERT_TRUE(backend
                  ->ApplyUpdate(V(p, 2, 3), V16(u16, 2, 3), 0.02f, 0.001f,
                                WeightDecayMethod::kDecoupled)
                  .ok());
  ASSERT_TRUE(backend
                  ->ApplyUpdate(V(p32, 2, 3), V(u, 2, 3), 0.02f, 0.001f,
                                WeightDecayMethod::kDecoupled)
                  .ok());
  EXPECT_EQ(p, p32);
}

TEST(CpuBackend, ApplyUpdateBatchTakesOneLrPerParam) {
  auto backend = MakeCpuBackend();
  std::vector<float> p1 = {1.0f, 2.0f}, p2 = {1.0f, 2.0f}, u = {0.5f, -0.5f};
  const std::vector<MatrixView> params = {V(p1, 1, 2), V(p2, 1, 2)},
                                updates = {V(u, 1, 2), V(u, 1, 2)};
  const std::vector<float> lrs = {0.1f, 0.2f};
  ASSERT_TRUE(backend
                  ->ApplyUpdateBatch(params, updates, lrs, 0.0f,
                                     WeightDecayMethod::kNone)
                  .ok());
  EXPECT_FLOAT_EQ(p1[0], 0.95f);
  EXPECT_FLOAT_EQ(p1[1], 2.05f);
  EXPECT_FLOAT_EQ(p2[0], 0.9f);
  EXPECT_FLOAT_EQ(p2[1], 2.1f);
  const std::vector<float> one_lr = {0.1f};
  const absl::Status st = backend->ApplyUpdateBatch(
      params, updates, one_lr, 0.0f, WeightDecayMethod::kNone);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("lrs"), std::string::npos) << st;
}

TEST(CpuBackend, ApplyUpdateWeightDecayVariants) {
  auto backend = MakeCpuBackend();
  const float lr = 0.1f, wd = 0.5f;
  std::vector<float> p0 = {1.0f, -2.0f, 3.0f, -4.0f};
  std::vector<float> u = {0.5f, 0.5f, -0.5f, -0.5f};
  struct Case {
    WeightDecayMethod method;
    float decay;
    std::vector<double> want;
  };
  const std::vector<Case> cases = {
      // decoupled: p - lr*wd*p - lr*u
      {WeightDecayMethod::kDecoupled,
       lr * wd,
       {1 - 0.05 - 0.05, -2 + 0.1 - 0.05, 3 - 0.15 + 0.05, -4 + 0.2 + 0.05}},
      // independent: p - wd*p - lr*u
      {WeightDecayMethod::kIndependent,
       wd,
       {0.5 - 0.05, -1 - 0.05, 1.5 + 0.05, -2 + 0.05}},
      // cautious: decay only where u*p > 0 (elements 0 and 3).
      {WeightDecayMethod::kCautious,
       lr * wd,
       {1 - 0.05 - 0.05, -2 - 0.05, 3 + 0.05, -4 + 0.2 + 0.05}},
      {WeightDecayMethod::kNone, lr * wd, {0.95, -2.05, 3.05, -3.95}},
  };
  for (const Case& c : cases) {
    std::vector<float> p = p0;
    ASSERT_TRUE(
        backend->ApplyUpdate(V(p, 2, 2), V(u, 2, 2), lr, c.decay, c.method)
            .ok());
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(p[i], c.want[i], 1e-6)
          << WeightDecayMethodName(c.method) << " " << i;
    }
  }
}

TEST(CpuBackend, ApplyUpdateBf16ParamRoundsOnce) {
  auto backend = MakeCpuBackend();
  std::vector<uint16_t> p(4);
  std::vector<float> p0 = {1.0f, 256.0f, -3.0f, 0.01f},
                     u = {1e-3f, 0.3f, 1e-4f, 2e-5f};
  for (int i = 0; i < 4; ++i) p[i] = FloatToBf16Bits(p0[i]);
  ASSERT_TRUE(backend
                  ->ApplyUpdate(V16(p, 2, 2), V(u, 2, 2), 1.0f, 0.0f,
                                WeightDecayMethod::kNone)
                  .ok());
  for (int i = 0; i < 4; ++i) {
    const float want =
        RoundToBf16(Bf16BitsToFloat(FloatToBf16Bits(p0[i])) - u[i]);
    EXPECT_EQ(Bf16BitsToFloat(p[i]), want) << i;
  }
}

TEST(CpuBackend, AllFiniteFindsNanAndInf) {
  auto backend = MakeCpuBackend();
  std::vector<float> a = {1, 2, 3, 4}, b = {1, 2, 3, 4};
  std::vector<MatrixView> views = {V(a, 2, 2), V(b, 2, 2)};
  EXPECT_TRUE(*backend->AllFinite(views));
  b[3] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(*backend->AllFinite(views));
  b[3] = 0;
  // A NaN outside the view (in the row padding) does not count.
  std::vector<float> c = {1, std::nanf(""), 2, 3};
  EXPECT_TRUE(
      *backend->AllFinite({MatrixView{c.data(), DType::kFloat32, 2, 1, 2}}));
  c[2] = std::nanf("");
  EXPECT_FALSE(
      *backend->AllFinite({MatrixView{c.data(), DType::kFloat32, 2, 1, 2}}));
}

// The bf16 overflow threshold: the largest fp32 below it rounds to the bf16
// max, the threshold itself to inf; AllFiniteBelow draws the line there.
TEST(CpuBackend, AllFiniteBelowTheBf16OverflowThreshold) {
  auto backend = MakeCpuBackend();
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  const float below = BitsToFloat(kBf16OverflowThresholdBits - 1);
  EXPECT_TRUE(std::isinf(RoundToBf16(limit)));
  EXPECT_FALSE(std::isinf(RoundToBf16(below)));
  std::vector<float> a = {1, -below, 3, below};
  EXPECT_TRUE(*backend->AllFiniteBelow({V(a, 2, 2)}, limit));
  a[2] = -limit;
  EXPECT_FALSE(*backend->AllFiniteBelow({V(a, 2, 2)}, limit));
  EXPECT_TRUE(*backend->AllFinite({V(a, 2, 2)}));  // finite in fp32
  a[2] = std::nanf("");
  EXPECT_FALSE(*backend->AllFiniteBelow({V(a, 2, 2)}, limit));
}

// The default CheckedMuonMomentumBatch: the momentum bitwise the unchecked
// call's, and TakeGradChecks' finding kept across calls until taken.
TEST(CpuBackend, CheckedMomentumKeepsItsFindingUntilTaken) {
  auto backend = MakeCpuBackend();
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  std::vector<float> g1 = {1, -2, 3, 4}, g2 = {0.5f, 0.25f, -1, 2};
  std::vector<float> m = {0.1f, 0.2f, 0.3f, 0.4f}, m_ref = m;
  std::vector<float> out(4), out_ref(4);
  auto checked = [&](std::vector<float>& g) {
    return backend->CheckedMuonMomentumBatch({V(g, 2, 2)}, {V(m, 2, 2)},
                                             {V(m, 2, 2)}, 0.95, true,
                                             {V(out, 2, 2)}, {}, limit, 0);
  };
  ASSERT_TRUE(backend
                  ->MuonMomentumBatch({V(g1, 2, 2)}, {V(m_ref, 2, 2)}, 0.95,
                                      true, {V(out_ref, 2, 2)})
                  .ok());
  ASSERT_TRUE(checked(g1).ok());
  EXPECT_EQ(m, m_ref);
  EXPECT_EQ(out, out_ref);
  g2[1] = -limit;  // finite in fp32, beyond the bf16 range
  ASSERT_TRUE(checked(g2).ok());
  ASSERT_TRUE(checked(g1).ok());
  EXPECT_FALSE((*backend->TakeGradChecks(1))[0]);  // the second call's finding
  EXPECT_TRUE((*backend->TakeGradChecks(1))[0]);   // taken: afresh
}

// Check slots: each keeps its own calls' finding (checked momentum or a check
// of its own, CheckGradsInto), one take returns the first n slots' and
// clears them (a slot left out keeps its finding), and a slot outside
// [0, grad_check_slots()) is refused, naming the rule.
TEST(CpuBackend, CheckedMomentumFindingsBySlot) {
  auto backend = MakeCpuBackend();
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  std::vector<float> fine = {1, -2, 3, 4}, bad = {1, std::nanf(""), 3, 4};
  std::vector<float> m = {0.1f, 0.2f, 0.3f, 0.4f}, out(4);
  auto checked = [&](std::vector<float>& g, int slot) {
    return backend->CheckedMuonMomentumBatch({V(g, 2, 2)}, {V(m, 2, 2)},
                                             {Absent(V(m, 2, 2))}, 0.95, true,
                                             {V(out, 2, 2)}, {}, limit, slot);
  };
  ASSERT_TRUE(checked(fine, 0).ok());
  ASSERT_TRUE(checked(bad, 1).ok());
  ASSERT_TRUE(checked(fine, 2).ok());
  ASSERT_TRUE(checked(bad, 4).ok());
  EXPECT_EQ(*backend->TakeGradChecks(4),
            (std::vector<bool>{true, false, true, true}));
  EXPECT_EQ(*backend->TakeGradChecks(5),
            (std::vector<bool>{true, true, true, true, false}));
  EXPECT_EQ(*backend->TakeGradChecks(5), std::vector<bool>(5, true));
  // A check of its own (no momentum) into a slot beside a checked momentum.
  ASSERT_TRUE(backend->CheckGradsInto({V(bad, 2, 2)}, limit, 2).ok());
  ASSERT_TRUE(checked(fine, 0).ok());
  ASSERT_TRUE(backend->CheckGradsInto({V(fine, 2, 2)}, limit, 1).ok());
  EXPECT_EQ(*backend->TakeGradChecks(3),
            (std::vector<bool>{true, true, false}));
  const int slots = backend->grad_check_slots();
  ASSERT_GE(slots, 1);
  for (int slot : {-1, slots}) {
    const absl::Status refused = checked(fine, slot);
    EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
    EXPECT_NE(refused.message().find("grad_check_slots"), std::string::npos)
        << refused;
  }
  for (int n : {0, slots + 1}) {
    EXPECT_TRUE(absl::IsInvalidArgument(backend->TakeGradChecks(n).status()))
        << n;
  }
}

TEST(CpuBackend, SymmetrizeFromLowerPerSlice) {
  auto backend = MakeCpuBackend();
  std::vector<float> a = {1, 99, 2, 3, 4, 99, 5, 6};
  ASSERT_TRUE(backend->SymmetrizeFromLower(V(a, 2, 2), 4, 2).ok());
  EXPECT_EQ(a, (std::vector<float>{1, 2, 2, 3, 4, 5, 5, 6}));
}

TEST(CpuBackend, MemoryRoundTrip) {
  auto backend = MakeCpuBackend();
  auto p = backend->Allocate(64);
  ASSERT_TRUE(p.ok());
  std::vector<float> in = {1, 2, 3, 4}, out(4);
  ASSERT_TRUE(backend->CopyFromHost(*p, in.data(), 16).ok());
  ASSERT_TRUE(backend->Memset0(MatrixView{*p, DType::kFloat32, 1, 2, 2}).ok());
  ASSERT_TRUE(backend->CopyToHost(out.data(), *p, 16).ok());
  EXPECT_EQ(out, (std::vector<float>{0, 0, 3, 4}));
  backend->Free(*p);
}

}  // namespace
}  // namespace muond
