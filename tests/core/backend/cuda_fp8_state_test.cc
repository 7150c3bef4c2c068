// Muon momentum on fp8 e4m3 state: the CUDA backend bitwise against the CPU
// backend (codes, block scales, NS input), single and batched (more tensors
// than one launch's table, strided grads, short and all-zero blocks, staged
// and in place). Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/common/state_storage.h"
#include "tests/common/cuda_test.h"

namespace muond {
namespace {

// One param's host buffers: grad (a column block of rows x (cols + pad)),
// fp8 state in and out with their scales, the NS input.
struct Host {
  int64_t rows, cols, pad;
  std::vector<float> grad, out;
  std::vector<uint8_t> codes_in, codes_out;
  std::vector<float> scales_in, scales_out;

  Host(int64_t r, int64_t c, int64_t p, uint32_t seed)
      : rows(r), cols(c), pad(p) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::uniform_int_distribution<int> code(0, 255);
    const int64_t n = r * c, blocks = (n + kStateBlock - 1) / kStateBlock;
    grad.resize(r * (c + p));
    for (float& x : grad) x = d(rng);
    for (int64_t e = 0; e < n; ++e) {
      const int c = code(rng);
      codes_in.push_back(uint8_t((c & 0x7f) == 0x7f ? 0 : c));  // no NaN
    }
    for (int64_t b = 0; b < blocks; ++b) scales_in.push_back(0.01f * (b + 1));
    // Block 1 (if any) zero state and zero grad: a zero block after.
    if (blocks > 1) {
      scales_in[1] = 0.0f;
      for (int64_t e = kStateBlock; e < std::min(n, 2 * kStateBlock); ++e) {
        grad[(e / c) * (c + p) + e % c] = 0.0f;
      }
    }
    codes_out.assign(n, 0xaa);
    scales_out.assign(blocks, -1.0f);
    out.assign(n, 0.0f);
  }
  int64_t n() const { return rows * cols; }
};

class CudaFp8StateTest : public muond::testing::CudaTest {
 protected:
  // Fills host with host.size() elements from dev.
  template <typename T>
  void Down(std::vector<T>& host, const void* dev) {
    host = CudaTest::Down<T>(dev, int64_t(host.size()));
  }

  // Runs the batch on both backends (in place or staged) and compares. The
  // NS input is written as out_type (Host::out has room for fp32).
  void Compare(std::vector<Host> params, bool nesterov, bool in_place,
               DType out_type = DType::kFloat32) {
    std::vector<Host> on_gpu = params;
    std::vector<MatrixView> g, mi, mo, o, dg, dmi, dmo, dout;
    std::vector<BlockScales> s, ds;
    struct Dev {
      void *codes_in, *codes_out, *out;
      float *scales_in, *scales_out;
    };
    std::vector<Dev> devs;
    for (Host& h : params) {
      const MatrixView grad{h.grad.data(), DType::kFloat32, h.rows, h.cols,
                            h.cols + h.pad};
      g.push_back(grad);
      mi.push_back(ContiguousView(h.codes_in.data(), DType::kFloat8E4M3, h.rows,
                                  h.cols));
      mo.push_back(in_place
                       ? mi.back()
                       : ContiguousView(h.codes_out.data(), DType::kFloat8E4M3,
                                        h.rows, h.cols));
      o.push_back(ContiguousView(h.out.data(), out_type, h.rows, h.cols));
      s.push_back({h.scales_in.data(),
                   in_place ? h.scales_in.data() : h.scales_out.data()});
      Dev d;
      d.codes_in = Up(h.codes_in.data(), h.n());
      d.codes_out = in_place ? d.codes_in : Up(h.codes_out.data(), h.n());
      d.out = Up(h.out.data(), h.n() * 4);
      d.scales_in = static_cast<float*>(
          Up(h.scales_in.data(), int64_t(h.scales_in.size()) * 4));
      d.scales_out =
          in_place ? d.scales_in
                   : static_cast<float*>(Up(h.scales_out.data(),
                                            int64_t(h.scales_out.size()) * 4));
      devs.push_back(d);
      MatrixView dgrad = grad;
      dgrad.data = Up(h.grad.data(), int64_t(h.grad.size()) * 4);
      dg.push_back(dgrad);
      dmi.push_back(
          ContiguousView(d.codes_in, DType::kFloat8E4M3, h.rows, h.cols));
      dmo.push_back(
          ContiguousView(d.codes_out, DType::kFloat8E4M3, h.rows, h.cols));
      dout.push_back(ContiguousView(d.out, out_type, h.rows, h.cols));
      ds.push_back({d.scales_in, d.scales_out});
    }
    ASSERT_TRUE(cpu_->MuonMomentumBatch(g, mi, mo, 0.95, nesterov, o, s).ok());
    const absl::Status st =
        gpu_->MuonMomentumBatch(dg, dmi, dmo, 0.95, nesterov, dout, ds);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_TRUE(gpu_->Synchronize().ok());
    for (size_t k = 0; k < params.size(); ++k) {
      Host& want = params[k];
      Host& got = on_gpu[k];
      Down(got.codes_out, devs[k].codes_out);
      Down(got.scales_out, devs[k].scales_out);
      Down(got.out, devs[k].out);
      const std::vector<uint8_t>& want_codes =
          in_place ? want.codes_in : want.codes_out;
      const std::vector<float>& want_scales =
          in_place ? want.scales_in : want.scales_out;
      EXPECT_EQ(got.codes_out, want_codes) << "param " << k;
      EXPECT_EQ(0, std::memcmp(got.scales_out.data(), want_scales.data(),
                               want_scales.size() * 4))
          << "param " << k;
      EXPECT_EQ(
          0, std::memcmp(got.out.data(), want.out.data(), want.out.size() * 4))
          << "param " << k;
    }
  }
};

// The step engine's two passes on the device: the NS input with momentum_out
// Absent (the codes and scales only read), then the new codes and scales in
// place with the NS input Absent; against the CPU backend's one in-place call.
TEST_F(CudaFp8StateTest, TwoPassesAreTheCpuOneCallBitwise) {
  std::vector<Host> params;
  for (int k = 0; k < 12; ++k) {
    params.emplace_back(3 + 5 * k, 17 + 23 * k, k % 3, 900 + k);
  }
  std::vector<MatrixView> g, m, o, dg, dm, dout, no_state, no_ns;
  std::vector<BlockScales> s, ds_in, ds_both;
  std::vector<void*> d_codes, d_out;
  std::vector<float*> d_scales;
  for (Host& h : params) {
    const MatrixView grad{h.grad.data(), DType::kFloat32, h.rows, h.cols,
                          h.cols + h.pad};
    g.push_back(grad);
    m.push_back(
        ContiguousView(h.codes_in.data(), DType::kFloat8E4M3, h.rows, h.cols));
    o.push_back(ContiguousView(h.out.data(), DType::kFloat32, h.rows, h.cols));
    s.push_back({h.scales_in.data(), h.scales_in.data()});
    d_codes.push_back(Up(h.codes_in.data(), h.n()));
    d_out.push_back(Up(h.out.data(), h.n() * 4));
    d_scales.push_back(static_cast<float*>(
        Up(h.scales_in.data(), int64_t(h.scales_in.size()) * 4)));
    MatrixView dgrad = grad;
    dgrad.data = Up(h.grad.data(), int64_t(h.grad.size()) * 4);
    dg.push_back(dgrad);
    dm.push_back(
        ContiguousView(d_codes.back(), DType::kFloat8E4M3, h.rows, h.cols));
    dout.push_back(
        ContiguousView(d_out.back(), DType::kFloat32, h.rows, h.cols));
    no_state.push_back(Absent(dm.back()));
    no_ns.push_back(Absent(dout.back()));
    ds_in.push_back({d_scales.back(), nullptr});
    ds_both.push_back({d_scales.back(), d_scales.back()});
  }
  const std::vector<Host> start = params;
  ASSERT_TRUE(cpu_->MuonMomentumBatch(g, m, m, 0.95, true, o, s).ok());
  absl::Status st =
      gpu_->MuonMomentumBatch(dg, dm, no_state, 0.95, true, dout, ds_in);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(gpu_->Synchronize().ok());
  for (size_t k = 0; k < params.size(); ++k) {
    std::vector<uint8_t> codes(params[k].n());
    std::vector<float> scales(params[k].scales_in.size()), out(params[k].n());
    Down(codes, d_codes[k]);
    Down(scales, d_scales[k]);
    Down(out, d_out[k]);
    EXPECT_EQ(codes, start[k].codes_in) << "param " << k;
    EXPECT_EQ(0, std::memcmp(scales.data(), start[k].scales_in.data(),
                             scales.size() * 4))
        << "param " << k;
    EXPECT_EQ(0, std::memcmp(out.data(), params[k].out.data(), out.size() * 4))
        << "param " << k;
  }
  st = gpu_->MuonMomentumBatch(dg, dm, dm, 0.95, true, no_ns, ds_both);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(gpu_->Synchronize().ok());
  for (size_t k = 0; k < params.size(); ++k) {
    std::vector<uint8_t> codes(params[k].n());
    std::vector<float> scales(params[k].scales_in.size());
    Down(codes, d_codes[k]);
    Down(scales, d_scales[k]);
    EXPECT_EQ(codes, params[k].codes_in) << "param " << k;
    EXPECT_EQ(0, std::memcmp(scales.data(), params[k].scales_in.data(),
                             scales.size() * 4))
        << "param " << k;
  }
}

// The momentum kernels' grad check on fp8 state (vector and strided grads):
// the NS input bitwise the unchecked call's, and TakeGradChecks finding what
// AllFiniteBelow finds where a grad element is NaN, Inf or at the limit.
TEST_F(CudaFp8StateTest, CheckedMomentumFindsWhatAllFiniteBelowFinds) {
  std::vector<Host> params;
  for (int k = 0; k < 6; ++k) {
    params.emplace_back(4 + 3 * k, 64 + 40 * k, k % 2, 700 + k);
  }
  std::vector<MatrixView> dg, dm, dout, dout_ref, no_state;
  std::vector<BlockScales> ds_in;
  for (Host& h : params) {
    MatrixView grad{h.grad.data(), DType::kFloat32, h.rows, h.cols,
                    h.cols + h.pad};
    grad.data = Up(h.grad.data(), int64_t(h.grad.size()) * 4);
    dg.push_back(grad);
    dm.push_back(ContiguousView(Up(h.codes_in.data(), h.n()),
                                DType::kFloat8E4M3, h.rows, h.cols));
    dout.push_back(ContiguousView(Up(h.out.data(), h.n() * 4), DType::kFloat32,
                                  h.rows, h.cols));
    dout_ref.push_back(ContiguousView(Up(h.out.data(), h.n() * 4),
                                      DType::kFloat32, h.rows, h.cols));
    no_state.push_back(Absent(dm.back()));
    ds_in.push_back({static_cast<float*>(Up(h.scales_in.data(),
                                            int64_t(h.scales_in.size()) * 4)),
                     nullptr});
  }
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  ASSERT_TRUE(
      gpu_->MuonMomentumBatch(dg, dm, no_state, 0.95, true, dout_ref, ds_in)
          .ok());
  ASSERT_TRUE(gpu_->CheckedMuonMomentumBatch(dg, dm, no_state, 0.95, true, dout,
                                             ds_in, limit, 0)
                  .ok());
  ASSERT_TRUE((*gpu_->TakeGradChecks(1))[0]);
  for (size_t k = 0; k < params.size(); ++k) {
    std::vector<float> got(params[k].n()), want(params[k].n());
    Down(got, dout[k].data);
    Down(want, dout_ref[k].data);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4)) << k;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float below = BitsToFloat(kBf16OverflowThresholdBits - 1);
  // Param 2 is contiguous with a partial last state block (10 x 144 = 1440
  // elements: the vector path then the short block).
  for (size_t k : {size_t(0), size_t(2), size_t(3), params.size() - 1}) {
    const Host& h = params[k];
    // First element, one inside the second state block, the last.
    for (int64_t e : {int64_t(0), kStateBlock + 5, h.n() - 1}) {
      if (e >= h.n()) continue;
      float* at = static_cast<float*>(dg[k].data) +
                  (e / h.cols) * (h.cols + h.pad) + e % h.cols;
      for (float v : {nan, -inf, -limit, below}) {
        ASSERT_TRUE(gpu_->CopyFromHost(at, &v, sizeof(float)).ok());
        const bool want = *gpu_->AllFiniteBelow(dg, limit);
        ASSERT_TRUE(gpu_->CheckedMuonMomentumBatch(dg, dm, no_state, 0.95, true,
                                                   dout, ds_in, limit, 0)
                        .ok());
        EXPECT_EQ((*gpu_->TakeGradChecks(1))[0], want)
            << "param " << k << " elem " << e << " value " << v;
        EXPECT_EQ(want, v == below);
      }
      const float fine = h.grad[(e / h.cols) * (h.cols + h.pad) + e % h.cols];
      ASSERT_TRUE(gpu_->CopyFromHost(at, &fine, sizeof(float)).ok());
    }
  }
  // A finding is taken once: the next call starts afresh.
  EXPECT_TRUE((*gpu_->TakeGradChecks(1))[0]);
}

TEST_F(CudaFp8StateTest, OneTensorInPlaceAndStaged) {
  for (bool in_place : {false, true}) {
    Compare({Host(37, 50, 0, 1)}, true, in_place);
  }
}

TEST_F(CudaFp8StateTest, ManyTensorsStridedGradsAcrossLaunches) {
  std::vector<Host> params;
  for (int k = 0; k < 30; ++k) {
    params.emplace_back(3 + k, 17 + 9 * k, k % 3, 100 + k);
  }
  Compare(params, false, false);
  Compare(params, true, true);
}

// 16-bit NS inputs take the kernel's 4-element vector stores (contiguous,
// full blocks) and its per-element path (padded grads, the last block).
TEST_F(CudaFp8StateTest, SixteenBitNsInputs) {
  for (DType out_type : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<Host> params;
    for (int k = 0; k < 6; ++k) {
      params.emplace_back(5 + 11 * k, 64 + 37 * k, k % 2, 300 + k);
    }
    Compare(params, true, false, out_type);
    Compare(params, false, true, out_type);
  }
}

TEST_F(CudaFp8StateTest, AdamWOnFp8MomentsIsTheCpuBitwise) {
  const int64_t rows = 7, cols = 100, pad = 3;  // 700: blocks 256, 256, 188
  Host h(rows, cols, pad, 7);
  std::vector<float> param(rows * cols);
  for (size_t i = 0; i < param.size(); ++i) param[i] = 0.01f * float(i % 97);
  // exp_avg_sq's codes: non-negative.
  std::vector<uint8_t> v_codes = h.codes_in;
  for (uint8_t& c : v_codes) c &= 0x7e;
  std::vector<float> v_scales = h.scales_in;
  AdamWScalars s;
  s.step_size = 0.01f;
  s.bias_correction2_sqrt = 0.2f;
  const MatrixView grad{h.grad.data(), DType::kFloat32, rows, cols, cols + pad};
  MatrixView dgrad = grad;
  dgrad.data = Up(h.grad.data(), int64_t(h.grad.size()) * 4);
  void* dparam = Up(param.data(), int64_t(param.size()) * 4);
  void* dm = Up(h.codes_in.data(), rows * cols);
  void* dv = Up(v_codes.data(), rows * cols);
  float* dms = static_cast<float*>(Up(h.scales_in.data(), 3 * 4));
  float* dvs = static_cast<float*>(Up(v_scales.data(), 3 * 4));
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(
        cpu_->AdamW(
                ContiguousView(param.data(), DType::kFloat32, rows, cols), grad,
                ContiguousView(h.codes_in.data(), DType::kFloat8E4M3, rows,
                               cols),
                ContiguousView(v_codes.data(), DType::kFloat8E4M3, rows, cols),
                s, AdamWMomentScales{h.scales_in.data(), v_scales.data()})
            .ok());
    const absl::Status st =
        gpu_->AdamW(ContiguousView(dparam, DType::kFloat32, rows, cols), dgrad,
                    ContiguousView(dm, DType::kFloat8E4M3, rows, cols),
                    ContiguousView(dv, DType::kFloat8E4M3, rows, cols), s,
                    AdamWMomentScales{dms, dvs});
    ASSERT_TRUE(st.ok()) << st;
  }
  ASSERT_TRUE(gpu_->Synchronize().ok());
  std::vector<float> got_param(param.size()), got_ms(3), got_vs(3);
  std::vector<uint8_t> got_m(rows * cols), got_v(rows * cols);
  Down(got_param, dparam);
  Down(got_m, dm);
  Down(got_v, dv);
  Down(got_ms, dms);
  Down(got_vs, dvs);
  EXPECT_EQ(0, std::memcmp(got_param.data(), param.data(), param.size() * 4));
  EXPECT_EQ(got_m, h.codes_in);
  EXPECT_EQ(got_v, v_codes);
  EXPECT_EQ(0, std::memcmp(got_ms.data(), h.scales_in.data(), 3 * 4));
  EXPECT_EQ(0, std::memcmp(got_vs.data(), v_scales.data(), 3 * 4));
}

TEST_F(CudaFp8StateTest, AdamWOnBf16MomentsIsTheCpuBitwise) {
  const int64_t n = 1000;
  Host h(1, n, 0, 9);
  std::vector<float> param(n, 0.5f);
  std::vector<uint16_t> m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    m[i] = uint16_t(0x3c00 + i % 200);  // bf16 values near 0.0078
    v[i] = uint16_t(0x3800 + i % 300);  // positive
  }
  void* dparam = Up(param.data(), n * 4);
  void* dgrad = Up(h.grad.data(), n * 4);
  void* dm = Up(m.data(), n * 2);
  void* dv = Up(v.data(), n * 2);
  AdamWScalars s;
  auto view = [&](void* p, DType t) { return ContiguousView(p, t, 1, n); };
  ASSERT_TRUE(cpu_->AdamW(view(param.data(), DType::kFloat32),
                          view(h.grad.data(), DType::kFloat32),
                          view(m.data(), DType::kBFloat16),
                          view(v.data(), DType::kBFloat16), s)
                  .ok());
  ASSERT_TRUE(
      gpu_->AdamW(view(dparam, DType::kFloat32), view(dgrad, DType::kFloat32),
                  view(dm, DType::kBFloat16), view(dv, DType::kBFloat16), s)
          .ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  std::vector<float> got_param(n);
  std::vector<uint16_t> got_m(n), got_v(n);
  Down(got_param, dparam);
  Down(got_m, dm);
  Down(got_v, dv);
  EXPECT_EQ(0, std::memcmp(got_param.data(), param.data(), n * 4));
  EXPECT_EQ(got_m, m);
  EXPECT_EQ(got_v, v);
}

}  // namespace
}  // namespace muond
