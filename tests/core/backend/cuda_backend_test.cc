// CUDA backend against the CPU backend (the reference): GEMMs at highest
// to 1e-5 relative, medium within bf16 rounding of an fp64 product of the
// rounded inputs, elementwise kernels bit-identical. Skipped without a GPU.
#include "core/backend/cuda_backend.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/fp16.h"
#include "tests/common/cuda_test.h"

namespace muond {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// x's values rounded to a 2-byte dtype (bf16 or fp16), as bits.
std::vector<uint16_t> Bits16(const std::vector<float>& x, DType dtype) {
  std::vector<uint16_t> bits;
  for (float v : x) {
    bits.push_back(dtype == DType::kFloat16 ? FloatToFp16Bits(v)
                                            : FloatToBf16Bits(v));
  }
  return bits;
}

class CudaBackendTest : public muond::testing::CudaTest {
 protected:
  // Device copy of host bytes; returns a view with the host view's layout.
  MatrixView Up(const MatrixView& host) {
    const int64_t bytes = (host.rows * std::max(host.row_stride, host.cols)) *
                          int64_t(DTypeSize(host.dtype));
    MatrixView d = host;
    d.data = CudaTest::Up(host.data, bytes);
    return d;
  }
  template <typename T>
  std::vector<T> Down(const MatrixView& dev, int64_t n) {
    return CudaTest::Down<T>(dev.data, n);
  }
};

TEST_F(CudaBackendTest, HasStreamAndName) {
  EXPECT_NE(gpu_->stream(), nullptr);
  EXPECT_TRUE(gpu_->is_device());
  EXPECT_EQ(gpu_->name(), "cuda:0");
}

TEST_F(CudaBackendTest, GemmHighestMatchesCpuAllTransposesStrided) {
  const int64_t m = 70, n = 33, k = 129, pad = 3;
  for (Op oa : {Op::kN, Op::kT}) {
    for (Op ob : {Op::kN, Op::kT}) {
      const int64_t ar = oa == Op::kN ? m : k, ac = oa == Op::kN ? k : m;
      const int64_t br = ob == Op::kN ? k : n, bc = ob == Op::kN ? n : k;
      std::vector<float> a = Random(ar * (ac + pad), 1),
                         b = Random(br * (bc + pad), 2),
                         c = Random(m * (n + pad), 3);
      MatrixView ha{a.data(), DType::kFloat32, ar, ac, ac + pad};
      MatrixView hb{b.data(), DType::kFloat32, br, bc, bc + pad};
      MatrixView hc{c.data(), DType::kFloat32, m, n, n + pad};
      MatrixView da = Up(ha), db = Up(hb), dc = Up(hc);
      ASSERT_TRUE(
          gpu_->Gemm(oa, ob, 0.5f, da, db, 2.0f, dc, MatmulPrecision::kHighest)
              .ok());
      ASSERT_TRUE(
          cpu_->Gemm(oa, ob, 0.5f, ha, hb, 2.0f, hc, MatmulPrecision::kHighest)
              .ok());
      const std::vector<float> got = Down<float>(dc, m * (n + pad));
      double max_ref = 0, max_diff = 0;
      for (int64_t i = 0; i < m * (n + pad); ++i) {
        max_ref = std::max(max_ref, std::fabs(double(c[i])));
        max_diff = std::max(max_diff, std::fabs(double(got[i]) - c[i]));
      }
      EXPECT_LE(max_diff, 1e-5 * max_ref) << int(oa) << int(ob);
    }
  }
}

TEST_F(CudaBackendTest, GemmMediumWithinBf16Rounding) {
  const int64_t m = 64, n = 48, k = 256;
  std::vector<float> a = Random(m * k, 4), b = Random(k * n, 5);
  std::vector<uint16_t> a16(m * k), b16(k * n), c16(m * n, 0);
  for (size_t i = 0; i < a.size(); ++i) a16[i] = FloatToBf16Bits(a[i]);
  for (size_t i = 0; i < b.size(); ++i) b16[i] = FloatToBf16Bits(b[i]);
  MatrixView da = Up({a16.data(), DType::kBFloat16, m, k, k});
  MatrixView db = Up({b16.data(), DType::kBFloat16, k, n, n});
  MatrixView dc = Up({c16.data(), DType::kBFloat16, m, n, n});
  ASSERT_TRUE(
      gpu_->Gemm(Op::kN, Op::kN, 1, da, db, 0, dc, MatmulPrecision::kMedium)
          .ok());
  const std::vector<uint16_t> got = Down<uint16_t>(dc, m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t l = 0; l < k; ++l) {
        const double p = double(Bf16BitsToFloat(a16[i * k + l])) *
                         Bf16BitsToFloat(b16[l * n + j]);
        ref += p;
        mag += std::fabs(p);
      }
      // One bf16 output rounding (2^-8 relative) plus fp32 accumulation.
      EXPECT_NEAR(Bf16BitsToFloat(got[i * n + j]), ref,
                  std::fabs(ref) * std::ldexp(1.0, -8) + mag * 1e-6);
    }
  }
}

TEST_F(CudaBackendTest, GemmHighMatchesCpuToTf32Accuracy) {
  const int64_t m = 32, n = 32, k = 64;
  std::vector<float> a = Random(m * k, 6), b = Random(k * n, 7), c(m * n, 0),
                     c_cpu(m * n, 0);
  MatrixView ha{a.data(), DType::kFloat32, m, k, k},
      hb{b.data(), DType::kFloat32, k, n, n};
  MatrixView dc = Up({c.data(), DType::kFloat32, m, n, n});
  ASSERT_TRUE(gpu_->Gemm(Op::kN, Op::kN, 1, Up(ha), Up(hb), 0, dc,
                         MatmulPrecision::kHigh)
                  .ok());
  ASSERT_TRUE(cpu_->Gemm(Op::kN, Op::kN, 1, ha, hb, 0,
                         {c_cpu.data(), DType::kFloat32, m, n, n},
                         MatmulPrecision::kHighest)
                  .ok());
  const std::vector<float> got = Down<float>(dc, m * n);
  for (int64_t i = 0; i < m * n; ++i)
    EXPECT_NEAR(got[i], c_cpu[i], 0.05);  // TF32: 2^-11
}

TEST_F(CudaBackendTest, ElementwiseKernelsAreBitIdenticalToCpu) {
  const int64_t r = 37, c = 41, n = r * c;
  std::vector<float> g = Random(n, 8), m = Random(n, 9), p = Random(n, 10),
                     u = Random(n, 11);
  std::vector<float> v = Random(n, 12);
  for (float& x : v) x = x * x;
  auto hv = [&](std::vector<float>& x) {
    return MatrixView{x.data(), DType::kFloat32, r, c, c};
  };
  // Momentum (Nesterov on and off).
  for (bool nesterov : {false, true}) {
    std::vector<float> mc = m, oc(n), og(n, 0);
    MatrixView dg = Up(hv(g)), dm = Up(hv(m)), dout = Up(hv(og));
    ASSERT_TRUE(gpu_->MuonMomentum(dg, dm, 0.95, nesterov, dout).ok());
    ASSERT_TRUE(cpu_->MuonMomentum(hv(g), hv(mc), 0.95, nesterov, hv(oc)).ok());
    EXPECT_EQ(Down<float>(dm, n), mc);
    EXPECT_EQ(Down<float>(dout, n), oc);
  }
  // Update, every weight decay method, fp32 and bf16 params.
  for (WeightDecayMethod w :
       {WeightDecayMethod::kDecoupled, WeightDecayMethod::kIndependent,
        WeightDecayMethod::kCautious, WeightDecayMethod::kNone}) {
    std::vector<float> pc = p;
    MatrixView dp = Up(hv(p)), du = Up(hv(u));
    ASSERT_TRUE(gpu_->ApplyUpdate(dp, du, 0.02f, 0.001f, w).ok());
    ASSERT_TRUE(cpu_->ApplyUpdate(hv(pc), hv(u), 0.02f, 0.001f, w).ok());
    EXPECT_EQ(Down<float>(dp, n), pc) << WeightDecayMethodName(w);
    std::vector<uint16_t> p16(n);
    for (int64_t i = 0; i < n; ++i) p16[i] = FloatToBf16Bits(p[i]);
    std::vector<uint16_t> p16c = p16;
    MatrixView dp16 = Up({p16.data(), DType::kBFloat16, r, c, c});
    ASSERT_TRUE(gpu_->ApplyUpdate(dp16, du, 0.02f, 0.001f, w).ok());
    ASSERT_TRUE(cpu_->ApplyUpdate({p16c.data(), DType::kBFloat16, r, c, c},
                                  hv(u), 0.02f, 0.001f, w)
                    .ok());
    EXPECT_EQ(Down<uint16_t>(dp16, n), p16c) << WeightDecayMethodName(w);
  }
  // AdamW.
  {
    AdamWScalars s;
    s.param_decay = 0.99999f;
    s.step_size = 1e-3f / 0.271f;
    s.bias_correction2_sqrt = 0.0632f;
    std::vector<float> pc = p, mc = m, vc = v;
    MatrixView dp = Up(hv(p)), dg = Up(hv(g)), dm = Up(hv(m)), dv = Up(hv(v));
    ASSERT_TRUE(gpu_->AdamW(dp, dg, dm, dv, s).ok());
    ASSERT_TRUE(cpu_->AdamW(hv(pc), hv(g), hv(mc), hv(vc), s).ok());
    EXPECT_EQ(Down<float>(dp, n), pc);
    EXPECT_EQ(Down<float>(dm, n), mc);
    EXPECT_EQ(Down<float>(dv, n), vc);
  }
  // Copy2D with conversion, strided source.
  {
    std::vector<uint16_t> o16(n), o16c(n);
    MatrixView src{g.data(), DType::kFloat32, r, c - 5, c};
    MatrixView dsrc = Up(src);
    MatrixView ddst = Up({o16.data(), DType::kBFloat16, r, c - 5, c - 5});
    ASSERT_TRUE(gpu_->Copy2D(ddst, dsrc).ok());
    ASSERT_TRUE(
        cpu_->Copy2D({o16c.data(), DType::kBFloat16, r, c - 5, c - 5}, src)
            .ok());
    const auto got = Down<uint16_t>(ddst, r * (c - 5));
    EXPECT_TRUE(std::equal(got.begin(), got.end(), o16c.begin()));
  }
}

// AdamW through the flat multi-element kernel: a length past one grid's
// elements in flight (several grid-stride rounds and a ragged tail), and a
// strided view (the 2-D path), each bitwise the CPU backend.
TEST_F(CudaBackendTest, AdamWLongAndStridedIsCpuBitwise) {
  AdamWScalars s;
  s.param_decay = 0.9999f;
  s.step_size = 3e-4f / 0.19f;
  s.bias_correction2_sqrt = 0.0707f;
  struct Case {
    int64_t rows, cols, ld;
  };
  for (const Case& k :
       {Case{1, 132 * 16 * 1024 * 2 + 13, 132 * 16 * 1024 * 2 + 13},
        Case{301, 517, 530}}) {
    const int64_t n = k.rows * k.ld;
    std::vector<float> p = Random(n, 21), g = Random(n, 22), m = Random(n, 23),
                       v = Random(n, 24);
    for (float& x : v) x = x * x;
    std::vector<float> pc = p, mc = m, vc = v;
    auto hv = [&](std::vector<float>& x) {
      return MatrixView{x.data(), DType::kFloat32, k.rows, k.cols, k.ld};
    };
    MatrixView dp = Up(hv(p)), dg = Up(hv(g)), dm = Up(hv(m)), dv = Up(hv(v));
    ASSERT_TRUE(gpu_->AdamW(dp, dg, dm, dv, s).ok());
    ASSERT_TRUE(cpu_->AdamW(hv(pc), hv(g), hv(mc), hv(vc), s).ok());
    const std::vector<float> gp = Down<float>(dp, n), gm = Down<float>(dm, n),
                             gv = Down<float>(dv, n);
    for (int64_t i = 0; i < k.rows; ++i) {
      for (int64_t j = 0; j < k.cols; ++j) {
        const int64_t e = i * k.ld + j;
        ASSERT_EQ(gp[e], pc[e]) << k.rows << "x" << k.cols << " at " << e;
        ASSERT_EQ(gm[e], mc[e]) << e;
        ASSERT_EQ(gv[e], vc[e]) << e;
      }
    }
  }
}

// AdamW's 4-element path (contiguous fp32 or bf16 views, each aligned) for
// every dtype combination of param, grad and moments, lengths with each
// ragged tail (n % 4 = 0..3, past one grid's elements in flight), and every
// view, or only the second moment, one element off its alignment (the
// element-wise path), each bit for bit the CPU backend.
TEST_F(CudaBackendTest, AdamWFourWideIsCpuBitwiseForEveryDtypeAndTail) {
  AdamWScalars s;
  s.param_decay = 0.9999f;
  s.one_minus_beta1 = 0.1f;
  s.beta2 = 0.95f;
  s.one_minus_beta2 = 0.05f;
  s.step_size = 3e-4f / 0.19f;
  s.bias_correction2_sqrt = 0.0707f;
  // The values of a view of `dtype` at `offset` elements into its buffer.
  struct Buffer {
    DType dtype;
    int64_t offset, n;
    std::vector<float> f32;
    std::vector<uint16_t> b16;
    MatrixView View() {
      void* base = dtype == DType::kFloat32 ? static_cast<void*>(f32.data())
                                            : static_cast<void*>(b16.data());
      char* at = static_cast<char*>(base) + offset * DTypeSize(dtype);
      return {at, dtype, 1, n, n};
    }
  };
  auto make = [&](DType dtype, int64_t offset, int64_t n, uint64_t seed,
                  bool square) {
    Buffer b{dtype, offset, n, {}, {}};
    std::vector<float> x = Random(offset + n, seed);
    if (square) {
      for (float& e : x) e = e * e;
    }
    if (dtype == DType::kFloat32) {
      b.f32 = x;
    } else {
      b.b16.resize(x.size());
      for (size_t i = 0; i < x.size(); ++i) b.b16[i] = FloatToBf16Bits(x[i]);
    }
    return b;
  };
  const DType kTypes[] = {DType::kFloat32, DType::kBFloat16};
  // One grid round of the 4-wide kernel (132 x 16 blocks x 256 threads x 4
  // runs x 4 elements) and part of a second.
  const int64_t kLong = 132 * 16 * 256 * 16 + 4000;
  for (DType pt : kTypes) {
    for (DType gt : kTypes) {
      for (DType st : kTypes) {
        for (int64_t n : {kLong, kLong + 1, kLong + 2, kLong + 3, int64_t(3)}) {
          // Offsets of param, grad, first and second moment, in elements.
          using Offsets = std::array<int64_t, 4>;
          for (const Offsets& off : {Offsets{0, 0, 0, 0}, Offsets{1, 1, 1, 1},
                                     Offsets{0, 0, 0, 1}}) {
            if (off != Offsets{0, 0, 0, 0} && n != kLong + 3) continue;
            std::vector<Buffer> host = {
                make(pt, off[0], n, 31, false), make(gt, off[1], n, 32, false),
                make(st, off[2], n, 33, false), make(st, off[3], n, 34, true)};
            std::vector<Buffer> cpu = host;
            std::vector<MatrixView> dev;
            for (Buffer& b : host) {
              // Up copies the whole allocation from the view's base: the
              // offset is taken on the device.
              MatrixView whole = b.View();
              whole.data = b.dtype == DType::kFloat32
                               ? static_cast<void*>(b.f32.data())
                               : static_cast<void*>(b.b16.data());
              whole.cols = b.offset + b.n;
              whole.row_stride = whole.cols;
              MatrixView d = Up(whole);
              d.data =
                  static_cast<char*>(d.data) + b.offset * DTypeSize(b.dtype);
              d.cols = d.row_stride = b.n;
              dev.push_back(d);
            }
            ASSERT_TRUE(gpu_->AdamW(dev[0], dev[1], dev[2], dev[3], s).ok());
            ASSERT_TRUE(cpu_->AdamW(cpu[0].View(), cpu[1].View(), cpu[2].View(),
                                    cpu[3].View(), s)
                            .ok());
            for (int k : {0, 2, 3}) {
              const MatrixView want = cpu[k].View();
              const size_t bytes = size_t(n) * DTypeSize(want.dtype);
              const std::vector<char> got = Down<char>(dev[k], int64_t(bytes));
              ASSERT_EQ(std::memcmp(got.data(), want.data, bytes), 0)
                  << "view " << k << ", dtypes " << DTypeName(pt) << "/"
                  << DTypeName(gt) << "/" << DTypeName(st) << ", n " << n
                  << ", offsets " << off[0] << off[1] << off[2] << off[3];
            }
          }
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, FrobeniusNormalizeMatchesCpuIncludingZeroAndTiny) {
  const int64_t r = 96, c = 80, batch = 3;
  std::vector<float> x = Random(batch * r * c, 13);
  for (int64_t i = r * c; i < 2 * r * c; ++i) x[i] = 0.0f;
  for (int64_t i = 2 * r * c; i < 3 * r * c; ++i)
    x[i] = x[i - 2 * r * c] * 1e-30f;
  MatrixView hx{x.data(), DType::kFloat32, batch * r, c, c};
  std::vector<float> want(x.size()), got_init(x.size(), -1);
  MatrixView dx = Up(hx),
             dy = Up({got_init.data(), DType::kFloat32, batch * r, c, c});
  ASSERT_TRUE(gpu_->FrobeniusNormalize(dx, dy, batch, 1e-37f).ok());
  ASSERT_TRUE(cpu_->FrobeniusNormalize(
                      hx, {want.data(), DType::kFloat32, batch * r, c, c},
                      batch, 1e-37f)
                  .ok());
  const auto got = Down<float>(dy, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-30) << i;
  }
}

// Every src/dst dtype pair, on contiguous slices whose size is a multiple
// of 8 (the 16-byte path) and on slices that are not (35 elements: the
// element-wise path), against the CPU backend: within 1e-6 relative for an
// fp32 dst, one bf16 rounding step (2^-8 relative) for a bf16 dst.
TEST_F(CudaBackendTest, FrobeniusNormalizeBf16AndFp32BothPaths) {
  const int64_t batch = 3;
  for (auto [r, c] : {std::pair<int64_t, int64_t>{24, 40}, {5, 7}}) {
    const int64_t n = batch * r * c;
    for (DType sd : {DType::kFloat32, DType::kBFloat16}) {
      for (DType dd : {DType::kFloat32, DType::kBFloat16}) {
        std::vector<float> x = Random(n, 17);
        std::vector<uint16_t> x16(n);
        for (int64_t i = 0; i < n; ++i) {
          x16[i] = FloatToBf16Bits(x[i]);
          if (sd == DType::kBFloat16) x[i] = Bf16BitsToFloat(x16[i]);
        }
        MatrixView hx = sd == DType::kFloat32
                            ? MatrixView{x.data(), sd, batch * r, c, c}
                            : MatrixView{x16.data(), sd, batch * r, c, c};
        std::vector<float> want(n), out32(n, -1);
        std::vector<uint16_t> out16(n, 0);
        MatrixView dy = dd == DType::kFloat32
                            ? Up({out32.data(), dd, batch * r, c, c})
                            : Up({out16.data(), dd, batch * r, c, c});
        ASSERT_TRUE(gpu_->FrobeniusNormalize(Up(hx), dy, batch, 1e-7f).ok());
        ASSERT_TRUE(cpu_->FrobeniusNormalize(
                            {x.data(), DType::kFloat32, batch * r, c, c},
                            {want.data(), DType::kFloat32, batch * r, c, c},
                            batch, 1e-7f)
                        .ok());
        std::vector<float> got(n);
        if (dd == DType::kFloat32) {
          got = Down<float>(dy, n);
        } else {
          const auto g16 = Down<uint16_t>(dy, n);
          for (int64_t i = 0; i < n; ++i) got[i] = Bf16BitsToFloat(g16[i]);
        }
        const double tol = dd == DType::kFloat32 ? 1e-6 : 1.0 / 256;
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_NEAR(got[i], want[i], tol * std::fabs(want[i]) + 1e-30)
              << r << "x" << c << " src " << DTypeName(sd) << " dst "
              << DTypeName(dd) << " elem " << i;
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, AllFinite) {
  std::vector<float> a = {1, 2, 3, 4};
  MatrixView da = Up({a.data(), DType::kFloat32, 2, 2, 2});
  EXPECT_TRUE(*gpu_->AllFinite({da}));
  a[2] = std::numeric_limits<float>::quiet_NaN();
  MatrixView db = Up({a.data(), DType::kFloat32, 2, 2, 2});
  EXPECT_FALSE(*gpu_->AllFinite({da, db}));
}

// Time marks (events in the stream) time work without waiting for it: the
// stream is still busy after the closing mark, and once synchronised the
// marked time is positive and no longer than the host's wall time around the
// same work. Marks restart after ClearTimeMarks, a reading of a mark not made
// fails, and a mark under a graph capture is refused (it would be a node of
// the graph, not a time of this run).
TEST_F(CudaBackendTest, TimeMarksTimeWorkWithoutWaiting) {
  const int64_t n = 4096;
  std::vector<float> a = Random(n * n, 7);
  MatrixView da = Up({a.data(), DType::kFloat32, n, n, n});
  MatrixView dc = Up({a.data(), DType::kFloat32, n, n, n});
  ASSERT_TRUE(gpu_->Synchronize().ok());
  gpu_->ClearTimeMarks();
  const auto before = std::chrono::steady_clock::now();
  absl::StatusOr<int> from = gpu_->TimeMark();
  ASSERT_TRUE(from.ok()) << from.status();
  EXPECT_EQ(*from, 0);
  for (int i = 0; i < 8; ++i) {  // ~1.1 TFLOP in fp32: milliseconds
    ASSERT_TRUE(gpu_->Gemm(Op::kN, Op::kN, 1.0f, da, da, 0.0f, dc,
                           MatmulPrecision::kHighest)
                    .ok());
  }
  absl::StatusOr<int> to = gpu_->TimeMark();
  ASSERT_TRUE(to.ok()) << to.status();
  EXPECT_EQ(*to, 1);
  EXPECT_EQ(cudaStreamQuery(static_cast<cudaStream_t>(gpu_->stream())),
            cudaErrorNotReady)
      << "the mark waited for the work";
  ASSERT_TRUE(gpu_->Synchronize().ok());
  const double wall_us = std::chrono::duration<double, std::micro>(
                             std::chrono::steady_clock::now() - before)
                             .count();
  absl::StatusOr<double> us = gpu_->MarkedUs(*from, *to);
  ASSERT_TRUE(us.ok()) << us.status();
  EXPECT_GT(*us, 0);
  EXPECT_LE(*us, wall_us);
  EXPECT_EQ(gpu_->MarkedUs(*from, 2).status().code(),
            absl::StatusCode::kOutOfRange);
  gpu_->ClearTimeMarks();
  EXPECT_EQ(*gpu_->TimeMark(), 0);
  absl::Status inside;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  ASSERT_TRUE(gpu_->RunGraph(0x71de,
                             [&] {
                               cudaStreamIsCapturing(
                                   static_cast<cudaStream_t>(gpu_->stream()),
                                   &capture);
                               inside = gpu_->TimeMark().status();
                               return gpu_->Memset0(dc);
                             })
                  .ok());
  if (capture != cudaStreamCaptureStatusNone) {
    EXPECT_EQ(inside.code(), absl::StatusCode::kFailedPrecondition) << inside;
  } else {  // CUDA graphs turned off (MUOND_* environment): no capture
    EXPECT_TRUE(inside.ok()) << inside;
  }
  ASSERT_TRUE(gpu_->Synchronize().ok());
}

// Out-of-place momentum (the step engine's: state in, staged buffer out),
// single and batched (a multi-tensor table of vec4 tensors, a strided one,
// bf16 state, an empty one), against the CPU backend in place: the new
// momentum and the NS input are bitwise the same and momentum_in is not
// written.
TEST_F(CudaBackendTest, MomentumOutOfPlaceIsCpuInPlaceBitwise) {
  const int count = 50;
  std::vector<std::vector<uint8_t>> g(count), m(count), m_cpu(count),
      out_cpu(count);
  std::vector<MatrixView> dg, dm_in, dm_out, dns, hg, hm, hns;
  for (int i = 0; i < count; ++i) {
    const int64_t r = i == 5 ? 0 : 3 + i % 7, c = 16 + 4 * (i % 5);
    const int64_t ld = i == 7 ? c + 4 : c;
    const bool bf16 = i % 3 == 1;
    const DType sd = bf16 ? DType::kBFloat16 : DType::kFloat32;
    const int64_t n = r * ld, es = bf16 ? 2 : 4;
    const std::vector<float> gf = Random(n, 100 + i), mf = Random(n, 300 + i);
    g[i].resize(n * 4);
    std::memcpy(g[i].data(), gf.data(), n * 4);
    m[i].resize(n * es);
    for (int64_t k = 0; k < n; ++k) {
      if (bf16) {
        const uint16_t h = FloatToBf16Bits(mf[k]);
        std::memcpy(m[i].data() + 2 * k, &h, 2);
      } else {
        std::memcpy(m[i].data() + 4 * k, &mf[k], 4);
      }
    }
    m_cpu[i] = m[i];
    out_cpu[i].assign(n * 4, 0);
    hg.push_back({g[i].data(), DType::kFloat32, r, c, ld});
    hm.push_back({m_cpu[i].data(), sd, r, c, ld});
    hns.push_back({out_cpu[i].data(), DType::kFloat32, r, c, ld});
    dg.push_back(Up(hg.back()));
    dm_in.push_back(Up({m[i].data(), sd, r, c, ld}));
    std::vector<uint8_t> zeros(n * es, 0);
    dm_out.push_back(Up({zeros.data(), sd, r, c, ld}));
    dns.push_back(Up(hns.back()));
  }
  // Nesterov on for the batched call, off for the single calls.
  for (bool batched : {true, false}) {
    for (int i = 0; i < count; ++i) {
      ASSERT_TRUE(cpu_->MuonMomentum(hg[i], hm[i], 0.95, batched, hns[i]).ok());
    }
    if (batched) {
      ASSERT_TRUE(
          gpu_->MuonMomentumBatch(dg, dm_in, dm_out, 0.95, true, dns).ok());
    } else {
      for (int i = 0; i < count; ++i) {
        ASSERT_TRUE(
            gpu_->MuonMomentum(dg[i], dm_in[i], dm_out[i], 0.95, false, dns[i])
                .ok());
      }
    }
    for (int i = 0; i < count; ++i) {
      const int64_t es = DTypeSize(hm[i].dtype), ld = hm[i].row_stride;
      const int64_t n = hm[i].rows * ld;
      EXPECT_EQ(Down<uint8_t>(dm_in[i], n * es), m[i]) << i;
      const auto got_m = Down<uint8_t>(dm_out[i], n * es);
      const auto got_o = Down<uint8_t>(dns[i], n * 4);
      for (int64_t k = 0; k < n; ++k) {
        if (k % ld >= hm[i].cols) continue;  // the stride gap
        ASSERT_EQ(std::memcmp(&got_m[k * es], &m_cpu[i][k * es], es), 0)
            << i << " " << k;
        ASSERT_EQ(std::memcmp(&got_o[k * 4], &out_cpu[i][k * 4], 4), 0)
            << i << " " << k;
      }
      m_cpu[i] = m[i];  // the next round starts from the same state
    }
  }
}

// The step engine's two passes on the device (the NS input with momentum_out
// Absent, then the new momentum in place with the NS input Absent), single
// and batched (vec4 tables in fp32 and bf16 state, a strided tensor, bf16
// NS inputs, an empty one), against the CPU backend's one in-place call: the
// first pass leaves the state as it was, and each output is bitwise.
TEST_F(CudaBackendTest, MomentumInTwoPassesIsCpuOneCallBitwise) {
  const int count = 40;
  std::vector<std::vector<uint8_t>> g(count), m(count), m_cpu(count),
      ns_cpu(count);
  std::vector<MatrixView> dg, dm, dns, hg, hm, hns;
  std::vector<DType> state_dtype(count);
  for (int i = 0; i < count; ++i) {
    const int64_t r = i == 5 ? 0 : 3 + i % 7, c = 16 + 4 * (i % 5);
    const int64_t ld = i == 7 ? c + 4 : c;
    const DType sd = i % 3 == 1 ? DType::kBFloat16 : DType::kFloat32;
    state_dtype[i] = sd;
    const DType nd = i % 4 == 2 ? DType::kBFloat16 : DType::kFloat32;
    const int64_t n = r * ld, es = DTypeSize(sd);
    const std::vector<float> gf = Random(n, 500 + i), mf = Random(n, 700 + i);
    g[i].resize(n * 4);
    std::memcpy(g[i].data(), gf.data(), n * 4);
    m[i].resize(n * es);
    for (int64_t k = 0; k < n; ++k) {
      if (sd == DType::kBFloat16) {
        const uint16_t h = FloatToBf16Bits(mf[k]);
        std::memcpy(m[i].data() + 2 * k, &h, 2);
      } else {
        std::memcpy(m[i].data() + 4 * k, &mf[k], 4);
      }
    }
    ns_cpu[i].assign(n * DTypeSize(nd), 0);
    hg.push_back({g[i].data(), DType::kFloat32, r, c, ld});
    hns.push_back({ns_cpu[i].data(), nd, r, c, ld});
    dg.push_back(Up(hg.back()));
    dns.push_back(Up(hns.back()));
  }
  for (bool batched : {true, false}) {
    dm.clear();
    hm.clear();
    for (int i = 0; i < count; ++i) {
      m_cpu[i] = m[i];
      hm.push_back({m_cpu[i].data(), state_dtype[i], hg[i].rows, hg[i].cols,
                    hg[i].row_stride});
      ASSERT_TRUE(cpu_->MuonMomentum(hg[i], hm[i], 0.95, batched, hns[i]).ok());
      dm.push_back(Up({m[i].data(), hm[i].dtype, hm[i].rows, hm[i].cols,
                       hm[i].row_stride}));
    }
    std::vector<MatrixView> no_state, no_ns;
    for (int i = 0; i < count; ++i) {
      no_state.push_back(Absent(dm[i]));
      no_ns.push_back(Absent(dns[i]));
    }
    if (batched) {
      ASSERT_TRUE(
          gpu_->MuonMomentumBatch(dg, dm, no_state, 0.95, true, dns).ok());
    } else {
      for (int i = 0; i < count; ++i) {
        ASSERT_TRUE(
            gpu_->MuonMomentum(dg[i], dm[i], no_state[i], 0.95, false, dns[i])
                .ok());
      }
    }
    for (int i = 0; i < count; ++i) {
      const int64_t n = hm[i].rows * hm[i].row_stride;
      EXPECT_EQ(Down<uint8_t>(dm[i], n * DTypeSize(hm[i].dtype)), m[i]) << i;
    }
    ASSERT_TRUE(gpu_->MuonMomentumBatch(dg, dm, dm, 0.95, batched, no_ns).ok());
    for (int i = 0; i < count; ++i) {
      const int64_t ld = hm[i].row_stride, n = hm[i].rows * ld;
      const int64_t es = DTypeSize(hm[i].dtype), os = DTypeSize(hns[i].dtype);
      const auto got_m = Down<uint8_t>(dm[i], n * es);
      const auto got_o = Down<uint8_t>(dns[i], n * os);
      for (int64_t k = 0; k < n; ++k) {
        if (k % ld >= hm[i].cols) continue;  // the stride gap
        ASSERT_EQ(std::memcmp(&got_m[k * es], &m_cpu[i][k * es], es), 0)
            << i << " " << k;
        ASSERT_EQ(std::memcmp(&got_o[k * os], &ns_cpu[i][k * os], os), 0)
            << i << " " << k;
      }
    }
  }
}

// The batched momentum/update and the multi-tensor AllFinite against the
// CPU backend's single calls: more tensors than one launch table holds, a
// strided one, bf16 state/params, an empty one (bit-identical).
TEST_F(CudaBackendTest, BatchedElementwiseIsBitIdenticalToSingleCalls) {
  const int count = 90;
  std::vector<std::vector<float>> g(count), m(count), p(count), u(count);
  std::vector<std::vector<uint16_t>> m16(count), p16(count);
  std::vector<MatrixView> hg, hm, ho, hp, hu, dg, dm, dout, dp, du;
  std::vector<std::vector<float>> outs(count);
  for (int i = 0; i < count; ++i) {
    const int64_t r = i == 5 ? 0 : 3 + i % 7, c = 17 + 3 * (i % 5);
    const int64_t ld = i == 7 ? c + 4 : c;  // one strided tensor
    const int64_t n = r * ld;
    g[i] = Random(n, 100 + i);
    m[i] = Random(n, 300 + i);
    p[i] = Random(n, 500 + i);
    u[i] = Random(n, 700 + i);
    outs[i].assign(n, 0.0f);
    const bool bf16 = i % 3 == 1;
    MatrixView vm{m[i].data(), DType::kFloat32, r, c, ld};
    MatrixView vp{p[i].data(), DType::kFloat32, r, c, ld};
    if (bf16) {
      m16[i].resize(n);
      p16[i].resize(n);
      for (int64_t k = 0; k < n; ++k) {
        m16[i][k] = FloatToBf16Bits(m[i][k]);
        p16[i][k] = FloatToBf16Bits(p[i][k]);
      }
      vm = {m16[i].data(), DType::kBFloat16, r, c, ld};
      vp = {p16[i].data(), DType::kBFloat16, r, c, ld};
    }
    hg.push_back({g[i].data(), DType::kFloat32, r, c, ld});
    hm.push_back(vm);
    ho.push_back({outs[i].data(), DType::kFloat32, r, c, ld});
    hp.push_back(vp);
    hu.push_back({u[i].data(), DType::kFloat32, r, c, ld});
    dg.push_back(Up(hg.back()));
    dm.push_back(Up(hm.back()));
    dout.push_back(Up(ho.back()));
    dp.push_back(Up(hp.back()));
    du.push_back(Up(hu.back()));
  }
  // Momentum keeps one state dtype per call on the real path; the kernels
  // take any mix, so this checks both element sizes in one table.
  ASSERT_TRUE(gpu_->MuonMomentumBatch(dg, dm, 0.95, true, dout).ok());
  for (int i = 0; i < count; ++i)
    ASSERT_TRUE(cpu_->MuonMomentum(hg[i], hm[i], 0.95, true, ho[i]).ok());
  std::vector<float> lrs;  // one adjusted lr per param
  for (int i = 0; i < count; ++i) lrs.push_back(0.02f * float(1 + i % 3));
  ASSERT_TRUE(
      gpu_->ApplyUpdateBatch(dp, du, lrs, 0.001f, WeightDecayMethod::kDecoupled)
          .ok());
  for (int i = 0; i < count; ++i)
    ASSERT_TRUE(cpu_->ApplyUpdate(hp[i], hu[i], lrs[i], 0.001f,
                                  WeightDecayMethod::kDecoupled)
                    .ok());
  for (int i = 0; i < count; ++i) {
    const int64_t n = hg[i].rows * hg[i].row_stride;
    // Compare only the view's elements (the stride gap is not written).
    auto in_view = [&](int64_t k) { return k % hg[i].row_stride < hg[i].cols; };
    const auto got_out = Down<float>(dout[i], n);
    for (int64_t k = 0; k < n; ++k) {
      if (in_view(k)) {
        ASSERT_EQ(got_out[k], outs[i][k]) << i << " " << k;
      }
    }
    if (hm[i].dtype == DType::kFloat32) {
      const auto gm = Down<float>(dm[i], n), gp = Down<float>(dp[i], n);
      for (int64_t k = 0; k < n; ++k) {
        if (!in_view(k)) continue;
        ASSERT_EQ(gm[k], m[i][k]) << i;
        ASSERT_EQ(gp[k], p[i][k]) << i;
      }
    } else {
      const auto gm = Down<uint16_t>(dm[i], n), gp = Down<uint16_t>(dp[i], n);
      for (int64_t k = 0; k < n; ++k) {
        if (!in_view(k)) continue;
        ASSERT_EQ(gm[k], m16[i][k]) << i;
        ASSERT_EQ(gp[k], p16[i][k]) << i;
      }
    }
  }
  EXPECT_TRUE(*gpu_->AllFinite(dg));
  std::vector<float> bad = g[count - 1];
  bad.back() = std::numeric_limits<float>::infinity();
  std::vector<MatrixView> with_bad = dg;
  MatrixView hb = hg[count - 1];
  hb.data = bad.data();
  with_bad.back() = Up(hb);
  EXPECT_FALSE(*gpu_->AllFinite(with_bad));
}

// The float4 (vec4) path of the batched kernels: fp32 tensors of several
// 4096-element tiles with a ragged end (n % 4 != 0), next to views that start
// 4 bytes into an allocation (not 16-byte aligned: the scalar path) and 16
// bytes in (aligned again). Bitwise the CPU backend; AllFinite finds one
// non-finite value in a middle tile, in the ragged end, and in the unaligned
// view.
TEST_F(CudaBackendTest, Vec4AndUnalignedElementwiseBitIdenticalToCpu) {
  const int64_t sizes[] = {3 * 4096 + 7, 4096, 5, 2 * 4096 + 2};
  const int64_t offsets[] = {0, 1, 4, 0};  // elements into the allocation
  const int count = 4;
  std::vector<std::vector<float>> g(count), m(count), p(count), u(count),
      out(count);
  std::vector<MatrixView> hg, hm, ho, hp, hu, dg, dm, dout, dp, du;
  auto view = [](std::vector<float>& v, int64_t off, int64_t n) {
    return MatrixView{v.data() + off, DType::kFloat32, 1, n, n};
  };
  for (int i = 0; i < count; ++i) {
    const int64_t n = sizes[i], off = offsets[i], total = n + off;
    g[i] = Random(total, 900 + i);
    m[i] = Random(total, 910 + i);
    p[i] = Random(total, 920 + i);
    u[i] = Random(total, 930 + i);
    out[i].assign(total, 0.0f);
    for (auto [host, dev, vec] :
         {std::tuple{&hg, &dg, &g[i]}, std::tuple{&hm, &dm, &m[i]},
          std::tuple{&ho, &dout, &out[i]}, std::tuple{&hp, &dp, &p[i]},
          std::tuple{&hu, &du, &u[i]}}) {
      MatrixView whole = view(*vec, 0, total);
      MatrixView d = Up(whole);
      d.data = static_cast<float*>(d.data) + off;
      d.cols = d.row_stride = n;
      host->push_back(view(*vec, off, n));
      dev->push_back(d);
    }
  }
  ASSERT_TRUE(gpu_->MuonMomentumBatch(dg, dm, 0.95, true, dout).ok());
  const std::vector<float> lrs(count, 0.02f);
  ASSERT_TRUE(
      gpu_->ApplyUpdateBatch(dp, du, lrs, 0.001f, WeightDecayMethod::kDecoupled)
          .ok());
  for (int i = 0; i < count; ++i) {
    ASSERT_TRUE(cpu_->MuonMomentum(hg[i], hm[i], 0.95, true, ho[i]).ok());
    ASSERT_TRUE(cpu_->ApplyUpdate(hp[i], hu[i], 0.02f, 0.001f,
                                  WeightDecayMethod::kDecoupled)
                    .ok());
  }
  for (int i = 0; i < count; ++i) {
    const int64_t n = sizes[i], off = offsets[i];
    const auto got_m = Down<float>(dm[i], n), got_o = Down<float>(dout[i], n),
               got_p = Down<float>(dp[i], n);
    for (int64_t k = 0; k < n; ++k) {
      ASSERT_EQ(got_m[k], m[i][off + k]) << "tensor " << i << " elem " << k;
      ASSERT_EQ(got_o[k], out[i][off + k]) << "tensor " << i << " elem " << k;
      ASSERT_EQ(got_p[k], p[i][off + k]) << "tensor " << i << " elem " << k;
    }
  }
  EXPECT_TRUE(*gpu_->AllFinite(dg));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (auto [i, k] : {std::pair<int, int64_t>{0, 4096 + 123},  // middle tile
                      {0, sizes[0] - 1},                       // ragged end
                      {1, 77}}) {                              // unaligned
    float* at = static_cast<float*>(dg[i].data) + k;
    ASSERT_TRUE(gpu_->CopyFromHost(at, &nan, sizeof(float)).ok());
    EXPECT_FALSE(*gpu_->AllFinite(dg)) << "tensor " << i << " elem " << k;
    const float fine = g[i][offsets[i] + k];
    ASSERT_TRUE(gpu_->CopyFromHost(at, &fine, sizeof(float)).ok());
    EXPECT_TRUE(*gpu_->AllFinite(dg));
  }
  // The bf16 range check: the same places, a value at the bf16 overflow
  // threshold (finite in fp32), then one just below it.
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  const float below = BitsToFloat(kBf16OverflowThresholdBits - 1);
  EXPECT_TRUE(*gpu_->AllFiniteBelow(dg, limit));
  for (auto [i, k] :
       {std::pair<int, int64_t>{0, 4096 + 123}, {0, sizes[0] - 1}, {1, 77}}) {
    float* at = static_cast<float*>(dg[i].data) + k;
    for (float v : {-limit, below}) {
      ASSERT_TRUE(gpu_->CopyFromHost(at, &v, sizeof(float)).ok());
      EXPECT_EQ(*gpu_->AllFiniteBelow(dg, limit), v == below)
          << "tensor " << i << " elem " << k << " value " << v;
      EXPECT_TRUE(*gpu_->AllFinite(dg));
    }
    const float fine = g[i][offsets[i] + k];
    ASSERT_TRUE(gpu_->CopyFromHost(at, &fine, sizeof(float)).ok());
  }
}

// The momentum kernels' grad check (CheckedMuonMomentumBatch): fp32 grads
// as a vec4 multi-tile tensor with a ragged end (bf16 state), a view 4
// bytes into its allocation (the scalar path) and a strided one (the
// single-tensor kernel); bf16 grads (the table's 2-byte vec4 path) and fp16
// grads (the flat single-tensor path). The outputs are bitwise the
// unchecked call's, and TakeGradChecks finds what AllFiniteBelow finds for
// NaN, Inf, the bf16 limit and just below it (in each grad's dtype).
TEST_F(CudaBackendTest, CheckedMomentumFindsWhatAllFiniteBelowFinds) {
  struct Shape {
    int64_t rows, cols, ld, offset;
    bool bf16_state;
    DType grad;
  };
  const std::vector<Shape> shapes = {
      {3, 4099, 4099, 0, false, DType::kFloat32},
      {5, 37, 37, 0, true, DType::kFloat32},
      {6, 33, 33, 1, false, DType::kFloat32},
      {7, 20, 24, 0, false, DType::kFloat32},
      {4, 1030, 1030, 0, false, DType::kBFloat16},
      {3, 50, 50, 0, false, DType::kFloat16}};
  // v as the grad's dtype stores it.
  auto bits_of = [](float v, DType d) {
    std::vector<uint8_t> b(DTypeSize(d));
    if (d == DType::kFloat32) {
      std::memcpy(b.data(), &v, 4);
    } else {
      const uint16_t h =
          d == DType::kBFloat16 ? FloatToBf16Bits(v) : FloatToFp16Bits(v);
      std::memcpy(b.data(), &h, 2);
    }
    return b;
  };
  std::vector<std::vector<float>> g;
  std::vector<MatrixView> dg, dm, dout, dout_ref, no_state;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const int64_t n = s.offset + s.rows * s.ld, es = DTypeSize(s.grad);
    g.push_back(Random(n, 40 + uint32_t(i)));
    std::vector<uint8_t> gb(n * es);
    for (int64_t k = 0; k < n; ++k) {
      std::memcpy(gb.data() + k * es, bits_of(g[i][k], s.grad).data(), es);
    }
    MatrixView grad = Up({gb.data(), s.grad, 1, n, n});
    grad.data = static_cast<char*>(grad.data) + s.offset * es;
    grad.rows = s.rows;
    grad.cols = s.cols;
    grad.row_stride = s.ld;
    dg.push_back(grad);
    const std::vector<float> mf = Random(n, 60 + uint32_t(i));
    std::vector<uint16_t> mb(n);
    for (int64_t k = 0; k < n; ++k) mb[k] = FloatToBf16Bits(mf[k]);
    MatrixView m = s.bf16_state
                       ? Up({mb.data(), DType::kBFloat16, s.rows, s.cols, s.ld})
                       : Up({const_cast<float*>(mf.data()), DType::kFloat32,
                             s.rows, s.cols, s.ld});
    dm.push_back(m);
    no_state.push_back(Absent(m));
    const std::vector<float> zeros(s.rows * s.ld, 0.0f);
    for (auto* outs : {&dout, &dout_ref}) {
      outs->push_back(Up({const_cast<float*>(zeros.data()), DType::kFloat32,
                          s.rows, s.cols, s.ld}));
    }
  }
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  ASSERT_TRUE(
      gpu_->MuonMomentumBatch(dg, dm, no_state, 0.95, true, dout_ref).ok());
  ASSERT_TRUE(gpu_->CheckedMuonMomentumBatch(dg, dm, no_state, 0.95, true, dout,
                                             {}, limit, 0)
                  .ok());
  ASSERT_TRUE((*gpu_->TakeGradChecks(1))[0]);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const int64_t n = shapes[i].rows * shapes[i].ld;
    EXPECT_EQ(Down<float>(dout[i], n), Down<float>(dout_ref[i], n)) << i;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float below = BitsToFloat(kBf16OverflowThresholdBits - 1);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const int64_t es = DTypeSize(s.grad);
    // First element, one in the middle, the ragged end.
    for (int64_t e : {int64_t(0), s.rows * s.cols / 2, s.rows * s.cols - 1}) {
      char* at = static_cast<char*>(dg[i].data) +
                 ((e / s.cols) * s.ld + e % s.cols) * es;
      for (float v : {nan, inf, -limit, below}) {
        const std::vector<uint8_t> b = bits_of(v, s.grad);
        ASSERT_TRUE(gpu_->CopyFromHost(at, b.data(), es).ok());
        const bool want = *gpu_->AllFiniteBelow(dg, limit);
        ASSERT_TRUE(gpu_->CheckedMuonMomentumBatch(dg, dm, no_state, 0.95, true,
                                                   dout, {}, limit, 0)
                        .ok());
        EXPECT_EQ((*gpu_->TakeGradChecks(1))[0], want)
            << "tensor " << i << " elem " << e << " value " << v;
        // fp32 and bf16 hold `below` under the limit; fp16 overflows it.
        EXPECT_EQ(want, v == below && s.grad != DType::kFloat16) << i;
      }
      const std::vector<uint8_t> fine =
          bits_of(g[i][s.offset + (e / s.cols) * s.ld + e % s.cols], s.grad);
      ASSERT_TRUE(gpu_->CopyFromHost(at, fine.data(), es).ok());
    }
  }
  EXPECT_TRUE((*gpu_->TakeGradChecks(1))[0]);
}

// Check slots on the device: each slot's flag is its own calls' (one NaN in
// one group's grads marks that group alone; checked momentum or
// CheckGradsInto), one take reads the first n and clears them, the last slot
// works, and slots outside the range are refused.
TEST_F(CudaBackendTest, GradCheckSlotsKeepTheirOwnFindings) {
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  const int slots = gpu_->grad_check_slots();
  ASSERT_GE(slots, 3);
  std::vector<float> fine = Random(6 * 40, 7), bad = fine;
  bad[6 * 40 - 1] = std::numeric_limits<float>::quiet_NaN();
  const MatrixView good_g = Up({fine.data(), DType::kFloat32, 6, 40, 40});
  const MatrixView bad_g = Up({bad.data(), DType::kFloat32, 6, 40, 40});
  const std::vector<float> m0 = Random(6 * 40, 8), zeros(6 * 40, 0.0f);
  const MatrixView m =
      Up({const_cast<float*>(m0.data()), DType::kFloat32, 6, 40, 40});
  const MatrixView out =
      Up({const_cast<float*>(zeros.data()), DType::kFloat32, 6, 40, 40});
  auto checked = [&](const MatrixView& g, int slot) {
    return gpu_->CheckedMuonMomentumBatch({g}, {m}, {Absent(m)}, 0.95, true,
                                          {out}, {}, limit, slot);
  };
  ASSERT_TRUE(checked(good_g, 0).ok());
  ASSERT_TRUE(checked(bad_g, 1).ok());
  ASSERT_TRUE(checked(good_g, 2).ok());
  ASSERT_TRUE(checked(bad_g, slots - 1).ok());
  EXPECT_EQ(*gpu_->TakeGradChecks(3), (std::vector<bool>{true, false, true}));
  const std::vector<bool> all = *gpu_->TakeGradChecks(slots);
  EXPECT_EQ(std::count(all.begin(), all.end(), false), 1);
  EXPECT_FALSE(all.back());
  EXPECT_EQ(*gpu_->TakeGradChecks(slots), std::vector<bool>(slots, true));
  // A check of its own (no momentum kernel) into a slot, without a wait.
  ASSERT_TRUE(gpu_->CheckGradsInto({bad_g}, limit, 1).ok());
  ASSERT_TRUE(gpu_->CheckGradsInto({good_g}, limit, 0).ok());
  ASSERT_TRUE(checked(good_g, 2).ok());
  EXPECT_EQ(*gpu_->TakeGradChecks(3), (std::vector<bool>{true, false, true}));
  EXPECT_TRUE(
      absl::IsInvalidArgument(gpu_->CheckGradsInto({good_g}, limit, slots)));
  EXPECT_TRUE(absl::IsInvalidArgument(checked(good_g, slots)));
  EXPECT_TRUE(absl::IsInvalidArgument(checked(good_g, -1)));
  EXPECT_TRUE(
      absl::IsInvalidArgument(gpu_->TakeGradChecks(slots + 1).status()));
}

// The bf16 NS data path through the 4-wide (vec4) kernels: fp32 grads and
// state, the NS input written as bf16 and a bf16 update read by the update,
// for multi-tile tensors with a ragged end and bf16 views 2 and 4 bytes into
// an allocation (not 8-byte aligned: the scalar path) and 8 bytes in
// (aligned again). Bitwise the CPU backend.
TEST_F(CudaBackendTest, Bf16NsInputAndUpdateBitIdenticalToCpu) {
  const int64_t sizes[] = {3 * 4096 + 7, 4096, 5, 2 * 4096 + 2, 4099};
  const int64_t offsets[] = {0, 1, 4, 0, 2};  // bf16 elements in
  const int count = 5;
  std::vector<std::vector<float>> g(count), m(count), p(count);
  std::vector<std::vector<uint16_t>> out(count), u(count);
  std::vector<MatrixView> hg, hm, ho, hp, hu, dg, dm, dout, dp, du;
  std::vector<float> lrs;
  for (int i = 0; i < count; ++i) {
    const int64_t n = sizes[i], off = offsets[i];
    g[i] = Random(n, 940 + i);
    m[i] = Random(n, 950 + i);
    p[i] = Random(n, 960 + i);
    const std::vector<float> uf = Random(n + off, 970 + i);
    u[i].resize(n + off);
    for (int64_t k = 0; k < n + off; ++k) u[i][k] = FloatToBf16Bits(uf[k]);
    out[i].assign(n + off, 0);
    lrs.push_back(0.01f * float(i + 1));
    for (auto [host, dev, view] :
         {std::tuple{&hg, &dg,
                     MatrixView{g[i].data(), DType::kFloat32, 1, n, n}},
          std::tuple{&hm, &dm,
                     MatrixView{m[i].data(), DType::kFloat32, 1, n, n}},
          std::tuple{&hp, &dp,
                     MatrixView{p[i].data(), DType::kFloat32, 1, n, n}}}) {
      host->push_back(view);
      dev->push_back(Up(view));
    }
    for (auto [host, dev, vec] :
         {std::tuple{&ho, &dout, &out[i]}, std::tuple{&hu, &du, &u[i]}}) {
      MatrixView d = Up({vec->data(), DType::kBFloat16, 1, n + off, n + off});
      d.data = static_cast<uint16_t*>(d.data) + off;
      d.cols = d.row_stride = n;
      host->push_back({vec->data() + off, DType::kBFloat16, 1, n, n});
      dev->push_back(d);
    }
  }
  ASSERT_TRUE(gpu_->MuonMomentumBatch(dg, dm, 0.95, true, dout).ok());
  ASSERT_TRUE(
      gpu_->ApplyUpdateBatch(dp, du, lrs, 0.001f, WeightDecayMethod::kCautious)
          .ok());
  for (int i = 0; i < count; ++i) {
    ASSERT_TRUE(cpu_->MuonMomentum(hg[i], hm[i], 0.95, true, ho[i]).ok());
    ASSERT_TRUE(cpu_->ApplyUpdate(hp[i], hu[i], lrs[i], 0.001f,
                                  WeightDecayMethod::kCautious)
                    .ok());
  }
  for (int i = 0; i < count; ++i) {
    const int64_t n = sizes[i], off = offsets[i];
    const auto got_m = Down<float>(dm[i], n), got_p = Down<float>(dp[i], n);
    const auto got_o = Down<uint16_t>(dout[i], n);
    for (int64_t k = 0; k < n; ++k) {
      ASSERT_EQ(got_m[k], m[i][k]) << "tensor " << i << " elem " << k;
      ASSERT_EQ(got_o[k], out[i][off + k]) << "tensor " << i << " elem " << k;
      ASSERT_EQ(got_p[k], p[i][k]) << "tensor " << i << " elem " << k;
    }
  }
}

// Gram NS's fp16 result as the update (NsResultDType) beside bf16 and fp32
// ones in one ApplyUpdateBatch: vec4 tiles with ragged ends, views 1-2
// elements into their allocation (the scalar path), a strided matrix (its
// own launch), a bf16 param; the signature changes between neighbours, so
// tables split. Bitwise the CPU backend's single calls.
TEST_F(CudaBackendTest, Fp16UpdatesBitIdenticalToCpu) {
  struct Case {
    int64_t rows, cols, ld, offset;
    DType update, param;
  };
  const Case cases[] = {
      {1, 3 * 4096 + 7, 3 * 4096 + 7, 0, DType::kFloat16, DType::kFloat32},
      {1, 4096, 4096, 0, DType::kBFloat16, DType::kFloat32},
      {1, 4096, 4096, 0, DType::kFloat16, DType::kFloat32},
      {1, 5, 5, 1, DType::kFloat16, DType::kFloat32},
      {1, 2 * 4096 + 2, 2 * 4096 + 2, 2, DType::kFloat16, DType::kFloat32},
      {1, 4099, 4099, 0, DType::kFloat16, DType::kBFloat16},
      {1, 1000, 1000, 0, DType::kFloat32, DType::kFloat32},
      {33, 130, 136, 0, DType::kFloat16, DType::kFloat32},
  };
  const int count = int(std::size(cases));
  std::vector<std::vector<float>> pf(count), uf(count);
  std::vector<std::vector<uint16_t>> p16(count), u16(count);
  std::vector<MatrixView> hp, hu, dp, du;
  std::vector<float> lrs;
  auto place = [&](void* base, const Case& c, DType d) {
    MatrixView v{base, d, c.rows, c.cols, c.ld};
    MatrixView dev =
        Up({base, d, 1, c.rows * c.ld + c.offset, c.rows * c.ld + c.offset});
    dev.data = static_cast<char*>(dev.data) + c.offset * DTypeSize(d);
    dev.rows = c.rows, dev.cols = c.cols, dev.row_stride = c.ld;
    v.data = static_cast<char*>(base) + c.offset * DTypeSize(d);
    return std::pair{v, dev};
  };
  for (int i = 0; i < count; ++i) {
    const Case& c = cases[i];
    const int64_t n = c.rows * c.ld + c.offset;
    pf[i] = Random(n, 1200 + i);
    uf[i] = Random(n, 1300 + i);
    void* pb = pf[i].data();
    void* ub = uf[i].data();
    if (c.param != DType::kFloat32)
      pb = (p16[i] = Bits16(pf[i], c.param)).data();
    if (c.update != DType::kFloat32) {
      ub = (u16[i] = Bits16(uf[i], c.update)).data();
    }
    auto [hpv, dpv] = place(pb, c, c.param);
    auto [huv, duv] = place(ub, c, c.update);
    hp.push_back(hpv), dp.push_back(dpv), hu.push_back(huv), du.push_back(duv);
    lrs.push_back(0.01f * float(i + 1));
  }
  ASSERT_TRUE(
      gpu_->ApplyUpdateBatch(dp, du, lrs, 0.001f, WeightDecayMethod::kCautious)
          .ok());
  for (int i = 0; i < count; ++i) {
    ASSERT_TRUE(cpu_->ApplyUpdate(hp[i], hu[i], lrs[i], 0.001f,
                                  WeightDecayMethod::kCautious)
                    .ok());
  }
  for (int i = 0; i < count; ++i) {
    const Case& c = cases[i];
    const int64_t n = c.rows * c.ld;
    if (c.param == DType::kFloat32) {
      const auto got = Down<float>(dp[i], n);
      for (int64_t k = 0; k < n; ++k) {
        if (k % c.ld >= c.cols) continue;
        ASSERT_EQ(got[k], pf[i][c.offset + k])
            << "param " << i << " elem " << k;
      }
    } else {
      const auto got = Down<uint16_t>(dp[i], n);
      for (int64_t k = 0; k < n; ++k) {
        ASSERT_EQ(got[k], p16[i][c.offset + k])
            << "param " << i << " elem " << k;
      }
    }
  }
}

// A NorMuon row set of 70 matrices (three kernel tables) on both backends:
// fp32, bf16 and fp16 updates (Gram NS's result), a strided one, an empty
// shard, padding rows, rows of larger full matrices (global0 > 0), silent
// copies, sums without state and skipped matrices. State entries, sums of
// slices, staged state and every row left alone are bitwise the CPU's; row
// sums, factors and scaled rows within rounding (the fp64 sums run in another
// order on the device).
TEST_F(CudaBackendTest, NorMuonRowSetMatchesCpu) {
  const int count = 70;
  std::vector<std::vector<float>> f(count);
  std::vector<std::vector<uint16_t>> h(count);
  std::vector<NorMuonRowBlock> hb, db;
  int64_t rows = 0, slots = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t r = i == 3 ? 0 : 2 + i % 9, c = 5 + 37 * (i % 4);
    const int64_t ld = i == 7 ? c + 3 : c;
    f[i] = Random(r * ld, 900 + i);
    MatrixView host{f[i].data(), DType::kFloat32, r, c, ld};
    if (i % 2 == 1) {
      const DType d = i % 4 == 3 ? DType::kFloat16 : DType::kBFloat16;
      h[i] = Bits16(f[i], d);
      host = {h[i].data(), d, r, c, ld};
    }
    NorMuonRowBlock b{.update = host,
                      .row_offset = rows,
                      .stats_offset = slots,
                      .full_rows = r + (i % 5) * 3,
                      .full_cols = c * (i % 6 == 0 ? 2 : 1),
                      .global0 = i % 5,
                      .valid = r - (i % 4 == 2 && r > 0 ? 1 : 0),
                      .adds_sums = i % 11 != 4,
                      .speaks_state = i % 11 != 4 && i % 7 != 2,
                      .skip = i % 13 == 6};
    hb.push_back(b);
    b.update = Up(host);
    db.push_back(b);
    rows += r;
    slots += 2 * b.full_rows;
  }
  auto col = [](std::vector<float>& v) {
    return MatrixView{v.data(), DType::kFloat32, int64_t(v.size()), 1, 1};
  };
  std::vector<float> state = Random(rows, 77), stats(slots), zeros(slots);
  for (float& x : state) x = std::fabs(x) * 1e-3f;
  const MatrixView d_state = Up(col(state)), d_stats = Up(col(zeros));
  ASSERT_TRUE(cpu_->NorMuonRowStats(hb, col(state), col(stats)).ok());
  ASSERT_TRUE(gpu_->NorMuonRowStats(db, d_state, d_stats).ok());
  const std::vector<float> got_stats = Down<float>(d_stats, slots);
  for (const NorMuonRowBlock& b : hb) {
    for (int64_t k = 0; k < 2 * b.full_rows; ++k) {
      const int64_t at = b.stats_offset + k;
      if (k >= b.full_rows) {
        ASSERT_EQ(got_stats[at], stats[at]) << "state entry " << at;
      } else {
        ASSERT_NEAR(got_stats[at], stats[at], 3e-7f * stats[at]) << at;
      }
    }
  }

  std::vector<float> slices = Random(3 * slots, 78), summed(slots);
  const MatrixView d_summed = Up(col(zeros));
  MatrixView h_slices{slices.data(), DType::kFloat32, 3, slots, slots};
  ASSERT_TRUE(cpu_->SumSlices(h_slices, col(summed)).ok());
  ASSERT_TRUE(gpu_->SumSlices(Up(h_slices), d_summed).ok());
  EXPECT_EQ(Down<float>(d_summed, slots), summed);

  // Both normalise from the CPU's statistics.
  std::vector<float> staged(rows), factors(rows);
  const MatrixView d_staged = Up(col(staged)), d_factors = Up(col(factors));
  ASSERT_TRUE(cpu_->NorMuonFactors(hb, col(stats), col(state), col(staged),
                                   col(factors), 0.95, 1e-8)
                  .ok());
  ASSERT_TRUE(gpu_->NorMuonFactors(db, Up(col(stats)), d_state, d_staged,
                                   d_factors, 0.95, 1e-8)
                  .ok());
  EXPECT_EQ(Down<float>(d_staged, rows), staged);
  const std::vector<float> got_f = Down<float>(d_factors, rows);
  for (int i = 0; i < count; ++i) {
    const NorMuonRowBlock& b = hb[i];
    const MatrixView& u = b.update;
    for (int64_t r = 0; r < u.rows; ++r) {
      const int64_t row = b.row_offset + r;
      ASSERT_NEAR(got_f[row], factors[row], 1e-6f * factors[row]) << row;
      if (b.skip || r >= b.valid) {
        ASSERT_EQ(factors[row], 1.0f) << "matrix " << i << " row " << r;
      }
    }
    // The update is the update kernel's to scale.
    const int64_t n = u.rows * u.row_stride;
    if (u.dtype != DType::kFloat32) {
      ASSERT_EQ(Down<uint16_t>(db[i].update, n), h[i]) << "matrix " << i;
    } else {
      ASSERT_EQ(Down<float>(db[i].update, n), f[i]) << "matrix " << i;
    }
  }
}

// The update with NorMuon's row factors over 50 params (two tables): fp32,
// bf16 and fp16 updates, columns that are not a multiple of 4 (vec4 runs that
// cross rows), a strided param (its own launch): bitwise the CPU's.
TEST_F(CudaBackendTest, RowScaledUpdateBitIdenticalToCpu) {
  const int count = 50;
  std::vector<std::vector<float>> p(count), u(count), fac(count);
  std::vector<std::vector<uint16_t>> u16(count);
  std::vector<MatrixView> hp, hu, hf, dp, du, df;
  std::vector<float> lrs;
  for (int i = 0; i < count; ++i) {
    const int64_t r = 1 + i % 7, c = 3 + 5 * (i % 6);
    const int64_t ld = i == 9 ? c + 2 : c;
    p[i] = Random(r * ld, 300 + i);
    u[i] = Random(r * ld, 400 + i);
    fac[i] = Random(r, 500 + i);
    MatrixView hu_i{u[i].data(), DType::kFloat32, r, c, ld};
    if (i % 3 != 2) {
      const DType d = i % 3 == 0 ? DType::kBFloat16 : DType::kFloat16;
      u16[i] = Bits16(u[i], d);
      hu_i = {u16[i].data(), d, r, c, ld};
    }
    hp.push_back({p[i].data(), DType::kFloat32, r, c, ld});
    hu.push_back(hu_i);
    hf.push_back({fac[i].data(), DType::kFloat32, r, 1, 1});
    dp.push_back(Up(hp.back()));
    du.push_back(Up(hu.back()));
    df.push_back(Up(hf.back()));
    lrs.push_back(0.01f * float(1 + i % 4));
  }
  ASSERT_TRUE(gpu_->ApplyRowScaledUpdateBatch(dp, du, df, lrs, 0.002f,
                                              WeightDecayMethod::kCautious)
                  .ok());
  ASSERT_TRUE(cpu_->ApplyRowScaledUpdateBatch(hp, hu, hf, lrs, 0.002f,
                                              WeightDecayMethod::kCautious)
                  .ok());
  for (int i = 0; i < count; ++i) {
    const std::vector<float> got = Down<float>(dp[i], int64_t(p[i].size()));
    for (size_t k = 0; k < got.size(); ++k) {
      if (int64_t(k) % hp[i].row_stride >= hp[i].cols) continue;
      ASSERT_EQ(got[k], p[i][k]) << "param " << i << " elem " << k;
    }
  }
}

// A row's sum on the device depends on its columns alone: the rows of a
// matrix summed whole, as a later block of it, and from an unaligned copy
// give the same bits (what makes layouts agree on CUDA).
TEST_F(CudaBackendTest, NorMuonRowSumsIndependentOfPlacement) {
  const int64_t r = 9, c = 301;
  std::vector<float> a = Random(r * c, 5), shifted(1 + 5 * c);
  std::copy(a.begin() + 4 * c, a.end(), shifted.begin() + 1);
  const MatrixView whole = Up({a.data(), DType::kFloat32, r, c, c});
  const MatrixView tail = Up({shifted.data(), DType::kFloat32, 6, c, c});
  MatrixView unaligned = tail;
  unaligned.data = static_cast<float*>(tail.data) + 1;
  unaligned.rows = 5;
  std::vector<float> zeros(4 * r);
  const MatrixView state = Up({zeros.data(), DType::kFloat32, r, 1, 1});
  const MatrixView stats = Up({zeros.data(), DType::kFloat32, 4 * r, 1, 1});
  const NorMuonRowBlock all{.update = whole,
                            .full_rows = r,
                            .full_cols = c,
                            .valid = r,
                            .adds_sums = true};
  const NorMuonRowBlock later{.update = whole.Block(4, 0, 5, c),
                              .stats_offset = 2 * r,
                              .full_rows = r,
                              .full_cols = c,
                              .global0 = 4,
                              .valid = 5,
                              .adds_sums = true};
  ASSERT_TRUE(gpu_->NorMuonRowStats({all, later}, state, stats).ok());
  std::vector<float> got = Down<float>(stats, 4 * r);
  NorMuonRowBlock moved = later;
  moved.update = unaligned;
  moved.stats_offset = 0;
  ASSERT_TRUE(gpu_->NorMuonRowStats({moved}, state, stats).ok());
  const std::vector<float> got_moved = Down<float>(stats, 2 * r);
  for (int64_t i = 4; i < r; ++i) {
    EXPECT_EQ(got[2 * r + i], got[i]) << "row " << i << " as a later block";
    EXPECT_EQ(got_moved[i], got[i]) << "row " << i << " unaligned";
    EXPECT_GT(got[i], 0.0f);
  }
}

// AdaMuonNormalizeBatch over 45 updates (tables of fp32, bf16 and fp16
// updates, out of place) is bitwise the CPU's single calls.
TEST_F(CudaBackendTest, AdaMuonBatchBitIdenticalToCpu) {
  const int count = 45;
  std::vector<std::vector<float>> u(count), v(count), vo(count);
  std::vector<std::vector<uint16_t>> u16(count);
  std::vector<MatrixView> hu, hv, hvo, du, dv, dvo;
  for (int i = 0; i < count; ++i) {
    const int64_t r = 1 + i % 6, c = 4 * (1 + i % 9) + (i % 4 == 3 ? 1 : 0);
    u[i] = Random(r * c, 40 + i);
    v[i] = Random(r * c, 140 + i);
    for (float& x : v[i]) x = std::fabs(x);
    vo[i].assign(r * c, 0.0f);
    MatrixView hu_i{u[i].data(), DType::kFloat32, r, c, c};
    if (i % 2 == 0) {
      const DType d = i % 4 == 0 ? DType::kBFloat16 : DType::kFloat16;
      u16[i] = Bits16(u[i], d);
      hu_i = {u16[i].data(), d, r, c, c};
    }
    hu.push_back(hu_i);
    hv.push_back({v[i].data(), DType::kFloat32, r, c, c});
    hvo.push_back({vo[i].data(), DType::kFloat32, r, c, c});
    du.push_back(Up(hu.back()));
    dv.push_back(Up(hv.back()));
    dvo.push_back(Up(hvo.back()));
  }
  ASSERT_TRUE(gpu_->AdaMuonNormalizeBatch(du, dv, dvo, 0.95, 1e-8f).ok());
  for (int i = 0; i < count; ++i)
    ASSERT_TRUE(cpu_->AdaMuonNormalize(hu[i], hv[i], hvo[i], 0.95, 1e-8f).ok());
  for (int i = 0; i < count; ++i) {
    const int64_t n = hu[i].rows * hu[i].cols;
    EXPECT_EQ(Down<float>(dvo[i], n), vo[i]) << "moment2 " << i;
    if (i % 2 == 0) {
      EXPECT_EQ(Down<uint16_t>(du[i], n), u16[i]) << "update " << i;
    } else {
      EXPECT_EQ(Down<float>(du[i], n), u[i]) << "update " << i;
    }
  }
}

TEST(CudaBackendCreate, FailsCleanlyWithoutDevice) {
  if (muond::testing::HaveCudaDevice()) {
    EXPECT_FALSE(MakeCudaBackend(1 << 20).ok());
  } else {
    auto b = MakeCudaBackend(0);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace muond
