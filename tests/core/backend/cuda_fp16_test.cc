// fp16 on the CUDA backend (tag gpu; skipped without a device), against an
// fp16 codec written here (round to nearest even via std::nearbyint) and the
// CPU backend's fp16 emulation: conversions bitwise, kMedium fp16 GEMMs
// within fp16 rounding of an fp64 product of the same inputs, normalisation
// into fp16 == normalisation into fp32 then one conversion, the symmetric
// mirror bitwise, finiteness checks on fp16 views.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "tests/common/cuda_test.h"

namespace muond {
namespace {

// fp32 -> fp16 bits, round to nearest even (no NaN inputs in these tests).
uint16_t RefF16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (a >= 65520.0) return sign | 0x7c00;  // max + half an ulp ties to inf
  if (a < std::ldexp(1.0, -14)) {          // subnormal (or rounds up to 2^-14)
    return sign | uint16_t(std::nearbyint(a * std::ldexp(1.0, 24)));
  }
  int e = 0;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): a in [2^(e-1), 2^e)
  double q = std::nearbyint(std::ldexp(a, 11 - e));  // in [1024, 2048]
  int biased = e - 1 + 15;
  if (q == 2048.0) {
    q = 1024.0;
    ++biased;
  }
  if (biased >= 31) return sign | 0x7c00;
  return sign | uint16_t((biased << 10) | (int(q) - 1024));
}

float RefF16ToFloat(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31) return float(s * std::numeric_limits<double>::infinity());
  if (e == 0) return float(s * std::ldexp(double(m), -24));
  return float(s * std::ldexp(double(1024 + m), e - 25));
}

// Values over fp16's range: normals, subnormals, exact ties between two
// fp16 neighbours, overflow to inf, and zeros.
std::vector<float> Fp16Probe(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v;
  for (int i = 0; i < 2000; ++i) v.push_back(d(rng));
  for (int i = 0; i < 500; ++i) v.push_back(d(rng) * 1e-6f);  // subnormal
  for (int i = 0; i < 500; ++i) v.push_back(d(rng) * 3e4f);   // large
  for (uint16_t h : {0x0001, 0x03ff, 0x0400, 0x3c00, 0x3c01, 0x7bfe}) {
    // Half-way to the next fp16: ties go to the even one.
    const float lo = RefF16ToFloat(h), hi = RefF16ToFloat(uint16_t(h + 1));
    v.push_back(0.5f * (lo + hi));
    v.push_back(-0.5f * (lo + hi));
  }
  for (float x : {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, 1e9f, -1e9f,
                  5.96e-8f, 2.9e-8f, 3.0e-8f}) {
    v.push_back(x);
  }
  while (v.size() % 64 != 0) v.push_back(1.0f);
  return v;
}

class CudaFp16Test : public muond::testing::CudaTest {
 protected:
  template <typename T>
  void* Up(const std::vector<T>& host) {
    return CudaTest::Up(host.data(), int64_t(host.size() * sizeof(T)));
  }
};

TEST_F(CudaFp16Test, CodecRoundsToNearestEven) {
  // The reference itself, on known values.
  EXPECT_EQ(RefF16(1.0f), 0x3c00);
  EXPECT_EQ(RefF16(65504.0f), 0x7bff);
  EXPECT_EQ(RefF16(65520.0f), 0x7c00);
  EXPECT_EQ(RefF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(RefF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(RefF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(RefF16(-2.0f), 0xc000);
}

TEST_F(CudaFp16Test, Copy2DFp32ToFp16BitwiseTheCodecAndCpu) {
  const std::vector<float> x = Fp16Probe(1);
  const int64_t cols = 64, rows = int64_t(x.size()) / cols;
  void* src = Up(x);
  // Strided destination: row_stride cols + 8.
  void* dst = Dev(rows * (cols + 8) * 2);
  const MatrixView s = ContiguousView(src, DType::kFloat32, rows, cols);
  const MatrixView d{dst, DType::kFloat16, rows, cols, cols + 8};
  ASSERT_TRUE(gpu_->Copy2D(d, s).ok());
  const std::vector<uint16_t> got = Down<uint16_t>(dst, rows * (cols + 8));
  std::vector<uint16_t> cpu_out(rows * cols);
  std::vector<float> host = x;
  const absl::Status cpu_status =
      cpu_->Copy2D(ContiguousView(cpu_out.data(), DType::kFloat16, rows, cols),
                   ContiguousView(host.data(), DType::kFloat32, rows, cols));
  EXPECT_TRUE(cpu_status.ok()) << "CPU backend fp16: " << cpu_status;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float v = x[i * cols + j];
      ASSERT_EQ(got[i * (cols + 8) + j], RefF16(v)) << v;
      if (cpu_status.ok()) {
        ASSERT_EQ(cpu_out[i * cols + j], RefF16(v)) << v;
      }
    }
  }
}

TEST_F(CudaFp16Test, Copy2DFromFp16IsExactEveryPattern) {
  std::vector<uint16_t> all;
  for (uint32_t h = 0; h < 65536; ++h) {
    if (((h >> 10) & 31) == 31 && (h & 1023) != 0) continue;  // NaN
    all.push_back(uint16_t(h));
  }
  while (all.size() % 32 != 0) all.push_back(0x3c00);
  const int64_t cols = 32, rows = int64_t(all.size()) / cols;
  void* src = Up(all);
  void* f32 = Dev(rows * cols * 4);
  void* bf = Dev(rows * cols * 2);
  const MatrixView s = ContiguousView(src, DType::kFloat16, rows, cols);
  ASSERT_TRUE(
      gpu_->Copy2D(ContiguousView(f32, DType::kFloat32, rows, cols), s).ok());
  ASSERT_TRUE(
      gpu_->Copy2D(ContiguousView(bf, DType::kBFloat16, rows, cols), s).ok());
  const std::vector<float> got = Down<float>(f32, all.size());
  const std::vector<uint16_t> got_bf = Down<uint16_t>(bf, all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = RefF16ToFloat(all[i]);
    ASSERT_EQ(std::memcmp(&got[i], &want, 4), 0) << std::hex << all[i];
    // fp16 -> bf16 == fp16 -> fp32 (exact) -> bf16 (one rounding).
    ASSERT_EQ(got_bf[i], FloatToBf16Bits(want)) << std::hex << all[i];
  }
}

TEST_F(CudaFp16Test, Copy2DBf16ToFp16RoundsOnce) {
  const std::vector<float> x = Fp16Probe(2);
  std::vector<uint16_t> bf(x.size());
  for (size_t i = 0; i < x.size(); ++i) bf[i] = FloatToBf16Bits(x[i]);
  const int64_t cols = 64, rows = int64_t(x.size()) / cols;
  void* src = Up(bf);
  void* dst = Dev(rows * cols * 2);
  ASSERT_TRUE(gpu_->Copy2D(ContiguousView(dst, DType::kFloat16, rows, cols),
                           ContiguousView(src, DType::kBFloat16, rows, cols))
                  .ok());
  const std::vector<uint16_t> got = Down<uint16_t>(dst, x.size());
  for (size_t i = 0; i < x.size(); ++i)
    ASSERT_EQ(got[i], RefF16(Bf16BitsToFloat(bf[i]))) << i;
}

// op(a) op(b) of fp16 inputs in fp64, for the tolerance of a fp16 GEMM:
// |gpu - ref| <= half an fp16 ulp of |ref| (the final rounding) plus fp32
// accumulation error k * 2^-23 * sum |a||b| (and fp16's subnormal step).
void ExpectFp16Gemm(const std::vector<uint16_t>& got, int64_t ldd,
                    const std::vector<uint16_t>& a,
                    const std::vector<uint16_t>& b,
                    const std::vector<uint16_t>& c, Op oa, Op ob, int64_t m,
                    int64_t n, int64_t k, float alpha, float beta) {
  auto A = [&](int64_t i, int64_t l) {
    return double(RefF16ToFloat(oa == Op::kN ? a[i * k + l] : a[l * m + i]));
  };
  auto B = [&](int64_t l, int64_t j) {
    return double(RefF16ToFloat(ob == Op::kN ? b[l * n + j] : b[j * k + l]));
  };
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t l = 0; l < k; ++l) {
        ref += A(i, l) * B(l, j);
        mag += std::fabs(A(i, l) * B(l, j));
      }
      ref = alpha * ref + beta * double(RefF16ToFloat(c[i * n + j]));
      mag = std::fabs(alpha) * mag +
            std::fabs(beta * double(RefF16ToFloat(c[i * n + j])));
      const double g = RefF16ToFloat(got[i * ldd + j]);
      const double tol = std::ldexp(std::fabs(ref), -11) * 1.001 +
                         double(k + 2) * std::ldexp(mag, -23) +
                         std::ldexp(1.0, -25);
      ASSERT_LE(std::fabs(g - ref), tol) << "(" << i << "," << j << ") op_a "
                                         << int(oa) << " op_b " << int(ob);
    }
  }
}

std::vector<uint16_t> RandomF16(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& h : v) h = RefF16(d(rng));
  return v;
}

TEST_F(CudaFp16Test, MediumGemmFp16WithinRoundingAllTransposes) {
  const int64_t m = 70, n = 48, k = 136;
  for (Op oa : {Op::kN, Op::kT}) {
    for (Op ob : {Op::kN, Op::kT}) {
      const int64_t ar = oa == Op::kN ? m : k, ac = oa == Op::kN ? k : m;
      const int64_t br = ob == Op::kN ? k : n, bc = ob == Op::kN ? n : k;
      const auto a = RandomF16(ar * ac, 1, 0.2f),
                 b = RandomF16(br * bc, 2, 0.2f), c = RandomF16(m * n, 3, 1.0f);
      const MatrixView da = ContiguousView(Up(a), DType::kFloat16, ar, ac);
      const MatrixView db = ContiguousView(Up(b), DType::kFloat16, br, bc);
      const MatrixView dc = ContiguousView(Up(c), DType::kFloat16, m, n);
      const MatrixView dd =
          ContiguousView(Dev(m * n * 2), DType::kFloat16, m, n);
      ASSERT_TRUE(gpu_->GemmOut(oa, ob, 0.75f, da, db, 0.5f, dc, dd,
                                MatmulPrecision::kMedium)
                      .ok());
      ExpectFp16Gemm(Down<uint16_t>(dd.data, m * n), n, a, b, c, oa, ob, m, n,
                     k, 0.75f, 0.5f);
      // In place (Gemm) with beta 0 agrees with the CPU backend's emulation
      // within the same bound.
      ASSERT_TRUE(
          gpu_->Gemm(oa, ob, 1.0f, da, db, 0.0f, dc, MatmulPrecision::kMedium)
              .ok());
      ExpectFp16Gemm(Down<uint16_t>(dc.data, m * n), n, a, b, c, oa, ob, m, n,
                     k, 1.0f, 0.0f);
      std::vector<uint16_t> ha = a, hb = b, hc(m * n);
      const absl::Status cpu = cpu_->Gemm(
          oa, ob, 1.0f, ContiguousView(ha.data(), DType::kFloat16, ar, ac),
          ContiguousView(hb.data(), DType::kFloat16, br, bc), 0.0f,
          ContiguousView(hc.data(), DType::kFloat16, m, n),
          MatmulPrecision::kMedium);
      EXPECT_TRUE(cpu.ok()) << "CPU backend fp16 gemm: " << cpu;
      if (cpu.ok()) {
        ExpectFp16Gemm(hc, n, a, b, c, oa, ob, m, n, k, 1.0f, 0.0f);
      }
    }
  }
}

TEST_F(CudaFp16Test, BatchedGemmOutFp16PerSlice) {
  const int64_t m = 40, n = 40, k = 72, batch = 3;
  const auto a = RandomF16(batch * m * k, 4, 0.2f),
             b = RandomF16(batch * n * k, 5, 0.2f),
             c = RandomF16(batch * m * n, 6, 1.0f);
  const MatrixView da = ContiguousView(Up(a), DType::kFloat16, m, k);
  const MatrixView db = ContiguousView(Up(b), DType::kFloat16, n, k);
  const MatrixView dc = ContiguousView(Up(c), DType::kFloat16, m, n);
  const MatrixView dd =
      ContiguousView(Dev(batch * m * n * 2), DType::kFloat16, m, n);
  ASSERT_TRUE(gpu_->GemmStridedBatchedOut(Op::kN, Op::kT, 1.0f, da, m * k, db,
                                          n * k, -0.25f, dc, m * n, dd, m * n,
                                          batch, MatmulPrecision::kMedium)
                  .ok());
  const std::vector<uint16_t> got = Down<uint16_t>(dd.data, batch * m * n);
  for (int64_t s = 0; s < batch; ++s) {
    auto part = [&](const std::vector<uint16_t>& v, int64_t size) {
      return std::vector<uint16_t>(v.begin() + s * size,
                                   v.begin() + (s + 1) * size);
    };
    ExpectFp16Gemm(part(got, m * n), n, part(a, m * k), part(b, n * k),
                   part(c, m * n), Op::kN, Op::kT, m, n, k, 1.0f, -0.25f);
  }
}

TEST_F(CudaFp16Test, NormalizeIntoFp16IsNormalizeThenConvert) {
  // Contiguous (the 8-wide path) and strided (the element path) sources.
  for (int64_t pad : {0, 3}) {
    const int64_t batch = 3, r = 24, cols = 40, ld = cols + pad;
    std::mt19937 rng(9);
    std::normal_distribution<float> d(0.0f, 5.0f);
    std::vector<float> x(batch * r * ld);
    for (float& v : x) v = d(rng);
    const MatrixView src{Up(x), DType::kFloat32, batch * r, cols, ld};
    const MatrixView f32 = ContiguousView(Dev(batch * r * cols * 4),
                                          DType::kFloat32, batch * r, cols);
    const MatrixView f16 = ContiguousView(Dev(batch * r * cols * 2),
                                          DType::kFloat16, batch * r, cols);
    const MatrixView via = ContiguousView(Dev(batch * r * cols * 2),
                                          DType::kFloat16, batch * r, cols);
    ASSERT_TRUE(gpu_->FrobeniusNormalize(src, f32, batch, 1e-7f).ok());
    ASSERT_TRUE(gpu_->FrobeniusNormalize(src, f16, batch, 1e-7f).ok());
    ASSERT_TRUE(gpu_->Copy2D(via, f32).ok());
    const auto direct = Down<uint16_t>(f16.data, batch * r * cols);
    EXPECT_EQ(direct, Down<uint16_t>(via.data, batch * r * cols)) << pad;
    // And the fp32 result is x / ||slice|| (to fp32 rounding of the norm).
    const std::vector<float> n32 = Down<float>(f32.data, batch * r * cols);
    for (int64_t s = 0; s < batch; ++s) {
      double ss = 0;
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < cols; ++j)
          ss += double(x[(s * r + i) * ld + j]) * x[(s * r + i) * ld + j];
      const float norm = float(std::sqrt(ss));
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < cols; ++j)
          ASSERT_EQ(n32[(s * r + i) * cols + j],
                    x[(s * r + i) * ld + j] / norm);
    }
  }
}

// Every conversion between fp32, bf16 and fp16, on the vector path
// (contiguous, both ends 16-byte aligned; n a multiple of 8, with a tail, or
// under 8) and element by element (either end or both one element off
// alignment), bitwise the CPU backend's Copy2D of the same values (NaNs,
// infinities and subnormals among them), and not a byte written outside the
// destination (sentinels on both sides).
TEST_F(CudaFp16Test, Copy2DConvertEveryPairBothPathsBitwiseTheCpu) {
  std::vector<float> probe = Fp16Probe(3);
  probe[2] = std::numeric_limits<float>::quiet_NaN();  // inside n = 5 too
  probe[100] = -std::numeric_limits<float>::quiet_NaN();
  probe[101] = std::numeric_limits<float>::infinity();
  const DType types[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const int64_t total = int64_t(probe.size()), pad = 16;
  const uint8_t sentinel = 0xa5;
  for (DType from : types) {
    const int64_t fs = int64_t(DTypeSize(from));
    // The source values in `from`, made on the CPU backend from the probe.
    std::vector<char> src_host(total * fs);
    std::vector<float> probe_copy = probe;
    ASSERT_TRUE(cpu_->Copy2D(ContiguousView(src_host.data(), from, 1, total),
                             ContiguousView(probe_copy.data(), DType::kFloat32,
                                            1, total))
                    .ok());
    char* dsrc = static_cast<char*>(Up(src_host));
    for (DType to : types) {
      if (to == from) continue;
      const int64_t ts = int64_t(DTypeSize(to));
      for (const auto& [src_off, dst_off] :
           {std::pair<int64_t, int64_t>{0, 0}, {1, 1}, {0, 1}, {1, 0}}) {
        // The probe ends with its crafted values (ties, overflow, zeros,
        // subnormals), then padding: every n here reaches past them.
        for (int64_t n : {total - 8, total - 5, int64_t{5}}) {
          SCOPED_TRACE(::testing::Message()
                       << DTypeName(from) << " -> " << DTypeName(to)
                       << " offsets " << src_off << "/" << dst_off << " n "
                       << n);
          // pad elements before and after the destination, all sentinels.
          const int64_t bytes = (n + 2 * pad) * ts;
          std::vector<char> fill(bytes, char(sentinel));
          char* ddst = static_cast<char*>(Up(fill));
          char* at = ddst + (pad + dst_off) * ts;
          ASSERT_TRUE(
              gpu_->Copy2D(ContiguousView(at, to, 1, n),
                           ContiguousView(dsrc + src_off * fs, from, 1, n))
                  .ok());
          const std::vector<char> got = Down<char>(ddst, bytes);
          std::vector<char> want(n * ts);
          ASSERT_TRUE(
              cpu_->Copy2D(ContiguousView(want.data(), to, 1, n),
                           ContiguousView(src_host.data() + src_off * fs, from,
                                          1, n))
                  .ok());
          const int64_t first = (pad + dst_off) * ts;
          ASSERT_EQ(std::memcmp(got.data() + first, want.data(), want.size()),
                    0);
          for (int64_t b = 0; b < bytes; ++b) {
            if (b >= first && b < first + n * ts) continue;
            ASSERT_EQ(uint8_t(got[b]), sentinel) << "byte " << b << " written";
          }
        }
      }
    }
  }
}

// The mirror of 2-byte matrices with an even ld (the pair kernel: 64 x 64
// tiles, upper tiles only) at sizes that fill whole tiles, leave a partial
// one, or end in an odd column, batched: every element the lower triangle's.
TEST_F(CudaFp16Test, SymmetrizePairsEveryElementFromTheLower) {
  struct Case {
    int64_t n, ld, batch;
  };
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    for (const Case& c : {Case{64, 64, 1}, Case{130, 130, 3}, Case{37, 38, 2},
                          Case{768, 768, 5}, Case{200, 256, 2}}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dt) << " n " << c.n << " ld " << c.ld
                   << " batch " << c.batch);
      const int64_t stride = c.n * c.ld;
      const auto a = RandomF16(c.batch * stride, 11, 1.0f);
      const MatrixView da{Up(a), dt, c.n, c.n, c.ld};
      ASSERT_TRUE(gpu_->SymmetrizeFromLower(da, stride, c.batch).ok());
      const auto got = Down<uint16_t>(da.data, c.batch * stride);
      for (int64_t s = 0; s < c.batch; ++s) {
        for (int64_t i = 0; i < c.n; ++i) {
          for (int64_t j = 0; j < c.ld; ++j) {
            const int64_t at = s * stride + i * c.ld + j;
            // Columns past n (the ld's padding) are left alone.
            const int64_t from =
                j >= c.n ? at
                         : s * stride + std::max(i, j) * c.ld + std::min(i, j);
            ASSERT_EQ(got[at], a[from])
                << "slice " << s << " (" << i << ", " << j << ")";
          }
        }
      }
    }
  }
}

TEST_F(CudaFp16Test, SymmetrizeAndFiniteOnFp16) {
  const int64_t n = 37, batch = 2;
  const auto a = RandomF16(batch * n * n, 7, 1.0f);
  const MatrixView da = ContiguousView(Up(a), DType::kFloat16, n, n);
  ASSERT_TRUE(gpu_->SymmetrizeFromLower(da, n * n, batch).ok());
  const auto got = Down<uint16_t>(da.data, batch * n * n);
  for (int64_t s = 0; s < batch; ++s)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j)
        ASSERT_EQ(got[s * n * n + i * n + j],
                  a[s * n * n + std::max(i, j) * n + std::min(i, j)]);
  const MatrixView all = ContiguousView(da.data, DType::kFloat16, batch * n, n);
  EXPECT_TRUE(*gpu_->AllFinite({all}));
  // |x| < 2 fails for a normal sample; +inf (0x7c00) fails finiteness.
  EXPECT_FALSE(*gpu_->AllFiniteBelow({all}, 2.0f));
  const uint16_t inf = 0x7c00;
  ASSERT_TRUE(
      gpu_->CopyFromHost(static_cast<char*>(da.data) + 2 * 100, &inf, 2).ok());
  EXPECT_FALSE(*gpu_->AllFinite({all}));
}

}  // namespace
}  // namespace muond
