// CUDA SymmetricGemmStridedBatchedOut (the sm_90a lower-triangle kernel on
// H100/H200, cuBLASLt full product + mirror elsewhere and below the
// threshold) against the same backend's GemmStridedBatchedOut (cuBLASLt, an
// independent implementation) on the same bf16/fp16 inputs. Skipped without a
// GPU.
//
// Tolerance, per element: |d - ref| <= 4 u |ref| + 2 k 2^-23 (|alpha| S +
// |beta| |c|) + tiny, u the output type's unit roundoff (bf16 2^-8, fp16
// 2^-11), S = |op(a)| |op(b)| (an fp32 GEMM of absolute values). Both sides
// accumulate the same products in fp32 in different orders (each within
// k 2^-23 S of the exact sum: the tensor cores' accumulation truncates) and
// round once to the output type, so they may differ by that much plus about
// an ulp; a wrong tile, a missed k-block or a misplaced mirror is off by
// O(|ref|). d must equal d^T bitwise, padding columns (row_stride > n) must
// keep their sentinel, and a second call must reproduce d bitwise. Every case
// runs with each of the kernel's consumer schedules
// (CudaBackendOptions::sym_gemm_schedule: cooperative, ping-pong and wide)
// and with auto, the backend's pick by size.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/backend/backend.h"
#include "core/backend/bf16.h"
#include "core/backend/cuda_backend.h"
#include "core/backend/cuda_backend_options.h"
#include "core/backend/fp16.h"
#include "tests/common/cuda_test.h"

namespace muond {
namespace {

constexpr uint16_t kSentinel = 0x7fc1;  // a NaN in bf16 and fp16

int64_t Up8(int64_t v) { return (v + 7) / 8 * 8; }

struct Case {
  DType dtype;
  bool xtx;  // false: X X^T, op (N,T), X is n x k; true: X^T X, (T,N)
  int64_t n, k, batch;
  float alpha, beta;
  int64_t pad;  // row_stride = Up8(cols) + pad
};

std::string Name(const Case& c) {
  return absl::StrCat(std::string(DTypeName(c.dtype)), c.xtx ? " XtX" : " XXt",
                      " n=", c.n, " k=", c.k, " batch=", c.batch,
                      " alpha=", c.alpha, " beta=", c.beta, " pad=", c.pad);
}

class SymGemmCudaTest : public muond::testing::CudaTest,
                        public ::testing::WithParamInterface<SymGemmSchedule> {
 protected:
  void SetUp() override {
    muond::testing::CudaTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    CudaBackendOptions options;
    options.sym_gemm_schedule = GetParam();
    auto b = MakeCudaBackend(0, options);
    ASSERT_TRUE(b.ok()) << b.status();
    gpu_ = std::move(*b);
  }

  uint16_t ToBits(float v, DType t) {
    return t == DType::kBFloat16 ? FloatToBf16Bits(v) : FloatToFp16Bits(v);
  }
  float FromBits(uint16_t b, DType t) {
    return t == DType::kBFloat16 ? Bf16BitsToFloat(b) : Fp16BitsToFloat(b);
  }

  void Check(const Case& cs);
};

void SymGemmCudaTest::Check(const Case& cs) {
  SCOPED_TRACE(Name(cs));
  const DType t = cs.dtype;
  const int64_t n = cs.n, k = cs.k, batch = cs.batch;
  const int64_t xr = cs.xtx ? k : n, xc = cs.xtx ? n : k;
  const int64_t ldx = Up8(xc) + cs.pad, sx = ldx * xr;
  const int64_t ldd = Up8(n) + cs.pad, sd = ldd * n;
  std::mt19937 rng(uint32_t(n * 7919 + k * 31 + batch));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> hx(sx * batch), hc(sd * batch, kSentinel);
  std::vector<float> hxa(sx * batch);
  for (int64_t i = 0; i < sx * batch; ++i) {
    hx[i] = ToBits(u(rng), t);
    hxa[i] = std::fabs(FromBits(hx[i], t));
  }
  for (int64_t l = 0; l < batch; ++l)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j)
        hc[l * sd + i * ldd + j] = hc[l * sd + j * ldd + i] = ToBits(u(rng), t);
  const std::vector<uint16_t> fill(sd * batch, kSentinel);
  const MatrixView x{Up(hx.data(), sx * batch * 2), t, xr, xc, ldx};
  const MatrixView xa{Up(hxa.data(), sx * batch * 4), DType::kFloat32, xr, xc,
                      ldx};
  const MatrixView c{Up(hc.data(), sd * batch * 2), t, n, n, ldd};
  const MatrixView d{Up(fill.data(), sd * batch * 2), t, n, n, ldd};
  const MatrixView ref{Up(fill.data(), sd * batch * 2), t, n, n, ldd};
  const MatrixView s{*gpu_->Allocate(sd * batch * 4), DType::kFloat32, n, n,
                     ldd};
  allocs_.push_back(s.data);
  const Op oa = cs.xtx ? Op::kT : Op::kN, ob = cs.xtx ? Op::kN : Op::kT;
  const MatmulPrecision med = MatmulPrecision::kMedium;
  ASSERT_TRUE(gpu_->SymmetricGemmStridedBatchedOut(oa, ob, cs.alpha, x, sx, x,
                                                   sx, cs.beta, c, sd, d, sd,
                                                   batch, med)
                  .ok());
  const std::vector<uint16_t> first = Down<uint16_t>(d.data, sd * batch);
  ASSERT_TRUE(gpu_->SymmetricGemmStridedBatchedOut(oa, ob, cs.alpha, x, sx, x,
                                                   sx, cs.beta, c, sd, d, sd,
                                                   batch, med)
                  .ok());
  ASSERT_TRUE(gpu_->GemmStridedBatchedOut(oa, ob, cs.alpha, x, sx, x, sx,
                                          cs.beta, c, sd, ref, sd, batch, med)
                  .ok());
  ASSERT_TRUE(gpu_->GemmStridedBatchedOut(oa, ob, 1.0f, xa, sx, xa, sx, 0.0f, s,
                                          sd, s, sd, batch,
                                          MatmulPrecision::kHighest)
                  .ok());
  const std::vector<uint16_t> hd = Down<uint16_t>(d.data, sd * batch);
  const std::vector<uint16_t> hr = Down<uint16_t>(ref.data, sd * batch);
  const std::vector<float> hs = Down<float>(s.data, sd * batch);
  EXPECT_EQ(hd, first) << "a second call must reproduce d bitwise";
  const double uu =
      t == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  int64_t bad = 0, asym = 0, pad = 0, unwritten = 0;
  double worst = 0;
  for (int64_t l = 0; l < batch; ++l) {
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = n; j < ldd; ++j)
        pad += hd[l * sd + i * ldd + j] != kSentinel;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t o = l * sd + i * ldd + j;
        if (hd[o] == kSentinel) {
          ++unwritten;
          continue;
        }
        asym += hd[o] != hd[l * sd + j * ldd + i];
        const double dv = FromBits(hd[o], t), rv = FromBits(hr[o], t);
        const double cv = std::fabs(FromBits(hc[o], t));
        const double tol =
            4 * uu * std::fabs(rv) +
            2.0 * double(k) * std::ldexp(1.0, -23) *
                (std::fabs(cs.alpha) * hs[o] + std::fabs(cs.beta) * cv) +
            1e-30;
        const double e = std::fabs(dv - rv);
        if (!(e <= tol)) ++bad;
        if (e / tol > worst) worst = e / tol;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "worst |d - ref| / tol = " << worst;
  EXPECT_EQ(asym, 0) << "d must be bitwise symmetric";
  EXPECT_EQ(pad, 0) << "padding columns were written";
  EXPECT_EQ(unwritten, 0) << "elements of d were not written";
}

// Odd sizes (1, 7, 130, 1000) with k = n and k ~ 3.5 n, both orientations,
// both dtypes, alpha/beta with a symmetric c, a batch, padded rows. k and n
// round to multiples of 8 where the kernel's contiguous extent needs it
// (sym_gemm_sm90::Unsupported); the rest take the fallback.
TEST_P(SymGemmCudaTest, OddSizesBothOrientationsBothDtypes) {
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    for (bool xtx : {false, true}) {
      for (int64_t n : {1, 7, 130, 1000}) {
        const int64_t k35 = Up8(n * 7 / 2);
        Check({t, xtx, n, Up8(n), 1, 1.0f, 0.0f, 0});
        Check({t, xtx, n, k35, 1, 1.0f, 0.0f, 0});
        Check({t, xtx, n, n, 1, 0.7f, -0.3f, 8});  // unaligned k or n
        Check({t, xtx, n, k35, 3, 1.0f, 0.5f, 8});
      }
    }
  }
}

// beta c on the kernel where c's and d's last 8-element chunks and last
// tiles are partial (n = 130, 257, 1300: X X^T with k a multiple of 8),
// batched; 257 and 1300 have an odd number of tile rows (the wide schedule's
// last pair row half outside).
TEST_P(SymGemmCudaTest, PartialChunksOfC) {
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    Check({t, false, 130, 136, 3, 0.7f, -0.3f, 0});
    Check({t, false, 257, 264, 2, 1.0f, 0.5f, 8});
    Check({t, false, 1300, 1304, 2, 1.0f, 0.5f, 0});
  }
}

TEST_P(SymGemmCudaTest, Large) {
  Check({DType::kBFloat16, false, 4096, 4096, 1, 1.0f, 0.0f, 0});
  Check({DType::kBFloat16, false, 4096, 14336, 1, 1.0f, 0.0f, 0});
  Check({DType::kFloat16, true, 4096, 4096, 1, 0.7f, -0.3f, 8});
  Check({DType::kBFloat16, true, 2048, 7168, 2, 1.0f, 0.0f, 0});
  // The size from which `auto` takes the wide tiles (sym_gemm_rule.h).
  Check({DType::kBFloat16, false, 8192, 8192, 1, 1.0f, 0.0f, 0});
}

// Products of symmetric operands (Gram NS's R Z, Q Z): (N,N) and (N,T) of an
// exactly symmetric S give S S, equal to cuBLAS's (N,N) product within the
// tolerance, with beta c; (N,N) runs the kernel too where n % 8 == 0.
TEST_P(SymGemmCudaTest, ProductsOfSymmetricOperands) {
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t n : {7, 136, 1000, 2048}) {
      SCOPED_TRACE(absl::StrCat(std::string(DTypeName(t)), " n=", n));
      std::mt19937 rng{uint32_t(n)};
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      const int64_t ld = Up8(n);
      std::vector<uint16_t> hs(n * ld, 0), hc(n * ld, 0);
      std::vector<float> habs(n * ld, 0.0f);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
          hs[i * ld + j] = hs[j * ld + i] = ToBits(u(rng), t);
          hc[i * ld + j] = hc[j * ld + i] = ToBits(u(rng), t);
          habs[i * ld + j] = habs[j * ld + i] =
              std::fabs(FromBits(hs[i * ld + j], t));
        }
      const MatrixView sv{Up(hs.data(), n * ld * 2), t, n, n, ld};
      const MatrixView sa{Up(habs.data(), n * ld * 4), DType::kFloat32, n, n,
                          ld};
      const MatrixView c{Up(hc.data(), n * ld * 2), t, n, n, ld};
      const MatrixView ref{Up(hc.data(), n * ld * 2), t, n, n, ld};
      const MatrixView bound{Up(habs.data(), n * ld * 4), DType::kFloat32, n, n,
                             ld};
      const MatmulPrecision med = MatmulPrecision::kMedium;
      const float alpha = 0.6f, beta = 0.25f;
      ASSERT_TRUE(gpu_->GemmStridedBatchedOut(Op::kN, Op::kN, alpha, sv, 0, sv,
                                              0, beta, c, 0, ref, 0, 1, med)
                      .ok());
      ASSERT_TRUE(gpu_->GemmStridedBatchedOut(Op::kN, Op::kN, 1.0f, sa, 0, sa,
                                              0, 0.0f, bound, 0, bound, 0, 1,
                                              MatmulPrecision::kHighest)
                      .ok());
      const std::vector<uint16_t> hr = Down<uint16_t>(ref.data, n * ld);
      const std::vector<float> hb = Down<float>(bound.data, n * ld);
      const double uu =
          t == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
      for (Op ob : {Op::kN, Op::kT}) {
        const MatrixView d{Up(hc.data(), n * ld * 2), t, n, n, ld};
        ASSERT_TRUE(gpu_->SymmetricGemmStridedBatchedOut(Op::kN, ob, alpha, sv,
                                                         0, sv, 0, beta, c, 0,
                                                         d, 0, 1, med)
                        .ok());
        const std::vector<uint16_t> hd = Down<uint16_t>(d.data, n * ld);
        int64_t bad = 0, asym = 0;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) {
            const int64_t o = i * ld + j;
            asym += hd[o] != hd[j * ld + i];
            const double rv = FromBits(hr[o], t);
            const double tol =
                4 * uu * std::fabs(rv) +
                2.0 * double(n) * std::ldexp(1.0, -23) *
                    (alpha * hb[o] + beta * std::fabs(FromBits(hc[o], t))) +
                1e-30;
            bad += !(std::fabs(FromBits(hd[o], t) - rv) <= tol);
          }
        EXPECT_EQ(bad, 0) << (ob == Op::kN ? "(N,N)" : "(N,T)");
        EXPECT_EQ(asym, 0) << (ob == Op::kN ? "(N,N)" : "(N,T)");
      }
    }
  }
}

// Below the threshold (n = 768, k = 3.5 n: cuBLAS is faster) and for fp32 the
// call is cuBLASLt + mirror: still exactly symmetric and equal to the full
// product's lower triangle.
TEST_P(SymGemmCudaTest, ThresholdFallbackAndKernelAvailability) {
  Check({DType::kBFloat16, false, 768, 2688, 1, 1.0f, 0.0f, 0});
  int major = 0, minor = 0;
  ASSERT_EQ(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0),
      cudaSuccess);
  ASSERT_EQ(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0),
      cudaSuccess);
  const bool hopper = major == 9 && minor == 0;
  EXPECT_EQ(gpu_->FastSymmetricGemm(4096, 14336, DType::kBFloat16, 1), hopper);
  EXPECT_EQ(gpu_->FastSymmetricGemm(4096, 4096, DType::kFloat16, 1), hopper);
  EXPECT_FALSE(gpu_->FastSymmetricGemm(768, 2688, DType::kBFloat16, 1));
  EXPECT_FALSE(gpu_->FastSymmetricGemm(4096, 4096, DType::kFloat32, 1));
  EXPECT_FALSE(gpu_->FastSymmetricGemm(4100, 4096, DType::kBFloat16, 1));
  // Batched (sym_gemm_rule.h): 2048 alone loses, a batch of 28 (Qwen3's q/o
  // matrices) fills every SM of any GPU up to 952 SMs.
  EXPECT_FALSE(gpu_->FastSymmetricGemm(2048, 2048, DType::kBFloat16, 1));
  EXPECT_EQ(gpu_->FastSymmetricGemm(2048, 2048, DType::kBFloat16, 28), hopper);
  EXPECT_FALSE(gpu_->FastSymmetricGemm(512, 512, DType::kBFloat16, 1024));

  // fp32 (highest): full product + mirror.
  const int64_t n = 300, k = 200;
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  std::vector<float> hx(n * k);
  for (float& v : hx) v = g(rng);
  const MatrixView x{Up(hx.data(), n * k * 4), DType::kFloat32, n, k, k};
  const MatrixView d{*gpu_->Allocate(n * n * 4), DType::kFloat32, n, n, n};
  const MatrixView full{*gpu_->Allocate(n * n * 4), DType::kFloat32, n, n, n};
  allocs_.push_back(d.data);
  allocs_.push_back(full.data);
  const MatmulPrecision hi = MatmulPrecision::kHighest;
  ASSERT_TRUE(gpu_->SymmetricGemmStridedBatchedOut(
                      Op::kN, Op::kT, 1.0f, x, 0, x, 0, 0.0f, d, 0, d, 0, 1, hi)
                  .ok());
  ASSERT_TRUE(
      gpu_->GemmOut(Op::kN, Op::kT, 1.0f, x, x, 0.0f, full, full, hi).ok());
  const std::vector<float> hd = Down<float>(d.data, n * n);
  const std::vector<float> hf = Down<float>(full.data, n * n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      ASSERT_EQ(hd[i * n + j], hf[i * n + j]) << i << "," << j;
      ASSERT_EQ(hd[j * n + i], hd[i * n + j]) << i << "," << j;
    }
}

INSTANTIATE_TEST_SUITE_P(
    Schedules, SymGemmCudaTest,
    ::testing::Values(SymGemmSchedule::kCooperative, SymGemmSchedule::kPingpong,
                      SymGemmSchedule::kWide, SymGemmSchedule::kAuto),
    [](const ::testing::TestParamInfo<SymGemmSchedule>& info) {
      return std::string(SymGemmScheduleName(info.param));
    });

}  // namespace
}  // namespace muond
