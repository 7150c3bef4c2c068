// fp8 e4m3 optimizer state on the CPU backend: the codec of
// elementwise_math.h against an enumeration of the 256 codes (round trip,
// ties, saturation, subnormals), and Muon's momentum on blockwise-scaled
// state (single and batched, in place and staged, strided grads, short and
// all-zero blocks) and AdamW on fp8 moments bitwise against a plain
// reference (tests/core/backend/fp8_state_reference.h); AdamW's fp8 state
// against fp32 state on rarely-updated elements.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/elementwise_math.h"
#include "tests/core/backend/fp8_state_reference.h"

namespace muond {
namespace {

using testing::RefE4M3Code;
using testing::RefE4M3Value;
using testing::RefFp8State;

uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

void ExpectCode(float x) {
  EXPECT_EQ(int(ew::FloatToE4M3(x)), int(RefE4M3Code(x)))
      << x << " (bits " << std::hex << Bits(x) << ")";
}

TEST(E4M3Codec, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const float v = ew::E4M3ToFloat(uint8_t(c));
    const double ref = RefE4M3Value(c);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_EQ(ew::FloatToE4M3(v), ew::kE4M3NaN) << c;
      continue;
    }
    EXPECT_EQ(double(v), ref) << c;
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0) << c;
    EXPECT_EQ(int(ew::FloatToE4M3(v)), c) << c;
  }
}

TEST(E4M3Codec, TiesAndNeighboursOfEveryMidpointRoundLikeTheEnumeration) {
  for (int c = 0; c < 0x7e; ++c) {
    for (float sign : {1.0f, -1.0f}) {
      const float mid =
          sign * float((RefE4M3Value(c) + RefE4M3Value(c + 1)) / 2.0);
      ExpectCode(mid);
      ExpectCode(std::nextafter(mid, 0.0f));
      ExpectCode(std::nextafter(mid, sign * INFINITY));
      // A tie goes to the even mantissa.
      EXPECT_EQ(ew::FloatToE4M3(mid) & 1, 0) << mid;
    }
  }
}

TEST(E4M3Codec, SaturatesAndKeepsNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {448.0f, 448.5f, 464.0f, 465.0f, 480.0f, 1e30f, inf,
                  std::numeric_limits<float>::max()}) {
    EXPECT_EQ(ew::FloatToE4M3(x), 0x7e) << x;
    EXPECT_EQ(ew::FloatToE4M3(-x), 0xfe) << x;
  }
  EXPECT_EQ(ew::E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(ew::FloatToE4M3(std::nanf("")), ew::kE4M3NaN);
  EXPECT_EQ(ew::FloatToE4M3(-std::nanf("")), ew::kE4M3NaN);
}

TEST(E4M3Codec, SubnormalsZerosAndTinyValues) {
  EXPECT_EQ(ew::FloatToE4M3(0.0f), 0x00);
  EXPECT_EQ(ew::FloatToE4M3(-0.0f), 0x80);
  EXPECT_EQ(ew::E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(ew::E4M3ToFloat(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(ew::E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  for (float x :
       {std::ldexp(1.0f, -10), std::ldexp(1.5f, -10), std::ldexp(1.0f, -11),
        std::ldexp(3.0f, -10), std::ldexp(15.0f, -10), std::ldexp(0.99f, -6),
        std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::min(), 1e-30f}) {
    ExpectCode(x);
    ExpectCode(-x);
  }
}

TEST(E4M3Codec, RandomFloatsOfEveryMagnitudeMatchTheEnumeration) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  int checked = 0;
  while (checked < 200000) {
    const uint32_t u = bits(rng);
    float x;
    std::memcpy(&x, &u, 4);
    // Mostly the codes' range (exponents 2^-12 .. 2^9), some of the rest.
    const int exponent = int((u >> 23) & 0xff) - 127;
    if ((exponent < -12 || exponent > 9) && checked % 16 != 0) continue;
    ExpectCode(x);
    ++checked;
  }
}

// ---- Muon momentum on fp8 state ------------------------------------------

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// A state reached by quantizing random values, with block 1 all zero.
RefFp8State StartState(int64_t n, uint32_t seed) {
  std::vector<float> v = Random(n, seed, 0.3f);
  for (int64_t e = 256; e < std::min<int64_t>(n, 512); ++e) v[e] = 0.0f;
  return testing::RefQuantize(v);
}

struct Fp8Buffers {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  MatrixView View(int64_t rows, int64_t cols) {
    return ContiguousView(codes.data(), DType::kFloat8E4M3, rows, cols);
  }
};

void ExpectState(const Fp8Buffers& got, const RefFp8State& want) {
  ASSERT_EQ(got.codes.size(), want.codes.size());
  ASSERT_EQ(got.scales.size(), want.scales.size());
  for (size_t e = 0; e < want.codes.size(); ++e) {
    ASSERT_EQ(int(got.codes[e]), int(want.codes[e])) << "element " << e;
  }
  for (size_t b = 0; b < want.scales.size(); ++b) {
    ASSERT_EQ(Bits(got.scales[b]), Bits(want.scales[b])) << "block " << b;
  }
}

// rows x cols, grad a column block of a wider matrix (row_stride cols + pad),
// block 1 of the new momentum all zero when the grad is zero there.
void CheckMomentum(int64_t rows, int64_t cols, int64_t pad, bool nesterov,
                   bool in_place, DType ns_dtype) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  const int64_t n = rows * cols;
  const RefFp8State start = StartState(n, 11);
  std::vector<float> wide = Random(rows * (cols + pad), 12);
  std::vector<float> flat_grad(n);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t e = i * cols + j;
      if (e >= 256 && e < 512) wide[i * (cols + pad) + j] = 0.0f;
      flat_grad[e] = wide[i * (cols + pad) + j];
    }
  }
  const MatrixView grad{wide.data(), DType::kFloat32, rows, cols, cols + pad};
  std::vector<float> ref_out;
  const RefFp8State want =
      testing::RefMomentumStep(start, flat_grad, 0.95, nesterov, &ref_out);

  Fp8Buffers in{start.codes, start.scales}, staged{start.codes, start.scales};
  std::vector<float> out32(n);
  std::vector<uint16_t> out16(n);
  const MatrixView out =
      ns_dtype == DType::kFloat32
          ? ContiguousView(out32.data(), DType::kFloat32, rows, cols)
          : ContiguousView(out16.data(), DType::kBFloat16, rows, cols);
  Fp8Buffers& result = in_place ? in : staged;
  const absl::Status st = cpu->MuonMomentum(
      grad, in.View(rows, cols), result.View(rows, cols), 0.95, nesterov, out,
      BlockScales{in.scales.data(), result.scales.data()});
  ASSERT_TRUE(st.ok()) << st;
  ExpectState(result, want);
  if (!in_place) ExpectState(in, start);  // the committed state is only read
  for (int64_t e = 0; e < n; ++e) {
    const float got =
        ns_dtype == DType::kFloat32 ? out32[e] : Bf16BitsToFloat(out16[e]);
    const float ref =
        ns_dtype == DType::kFloat32 ? ref_out[e] : RoundToBf16(ref_out[e]);
    ASSERT_EQ(Bits(got), Bits(ref)) << "ns input element " << e;
  }
}

TEST(Fp8Momentum, MatchesTheReferenceInPlaceAndStaged) {
  for (bool nesterov : {false, true}) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(::testing::Message() << nesterov << in_place);
      CheckMomentum(7, 100, 0, nesterov, in_place, DType::kFloat32);  // 700
    }
  }
}

// The step engine's two passes on fp8 state: the NS input with momentum_out
// Absent (no scales out; the state only read), then the new codes and
// scales in place with the NS input Absent; each as the reference step.
TEST(Fp8Momentum, TwoPassesAreTheOneStep) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  const int64_t rows = 9, cols = 64, pad = 5;  // 576: blocks 256, 256, 64
  const int64_t n = rows * cols;
  const RefFp8State start = StartState(n, 51);
  std::vector<float> wide = Random(rows * (cols + pad), 52), flat(n);
  for (int64_t e = 0; e < n; ++e)
    flat[e] = wide[(e / cols) * (cols + pad) + e % cols];
  const MatrixView grad{wide.data(), DType::kFloat32, rows, cols, cols + pad};
  for (bool nesterov : {false, true}) {
    std::vector<float> ref_out;
    const RefFp8State want =
        testing::RefMomentumStep(start, flat, 0.95, nesterov, &ref_out);
    Fp8Buffers state{start.codes, start.scales};
    std::vector<float> out(n, -1.0f);
    const MatrixView out_view =
        ContiguousView(out.data(), DType::kFloat32, rows, cols);
    absl::Status st = cpu->MuonMomentum(
        grad, state.View(rows, cols), Absent(state.View(rows, cols)), 0.95,
        nesterov, out_view, BlockScales{state.scales.data(), nullptr});
    ASSERT_TRUE(st.ok()) << st;
    ExpectState(state, start);
    for (int64_t e = 0; e < n; ++e) {
      ASSERT_EQ(Bits(out[e]), Bits(ref_out[e])) << "ns input element " << e;
    }
    st = cpu->MuonMomentum(
        grad, state.View(rows, cols), state.View(rows, cols), 0.95, nesterov,
        Absent(out_view),
        BlockScales{state.scales.data(), state.scales.data()});
    ASSERT_TRUE(st.ok()) << st;
    ExpectState(state, want);
  }
}

TEST(Fp8Momentum, StridedGradAndBf16NsInput) {
  CheckMomentum(9, 64, 5, true, false, DType::kBFloat16);
  CheckMomentum(3, 3, 2, false, true, DType::kFloat32);  // one short block
}

TEST(Fp8Momentum, BatchIsTheSingleCalls) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {16, 32}, {5, 7}, {33, 10}};
  std::vector<std::vector<float>> grads, outs;
  std::vector<Fp8Buffers> in, out_state;
  std::vector<RefFp8State> want;
  std::vector<MatrixView> g, mi, mo, o;
  std::vector<BlockScales> scales;
  for (size_t k = 0; k < shapes.size(); ++k) {
    const auto [rows, cols] = shapes[k];
    const RefFp8State start = StartState(rows * cols, 20 + k);
    grads.push_back(Random(rows * cols, 30 + k));
    std::vector<float> ref_out;
    want.push_back(
        testing::RefMomentumStep(start, grads.back(), 0.9, true, &ref_out));
    in.push_back({start.codes, start.scales});
    out_state.push_back({start.codes, std::vector<float>(start.scales.size())});
    outs.emplace_back(rows * cols);
  }
  for (size_t k = 0; k < shapes.size(); ++k) {
    const auto [rows, cols] = shapes[k];
    g.push_back(ContiguousView(grads[k].data(), DType::kFloat32, rows, cols));
    mi.push_back(in[k].View(rows, cols));
    mo.push_back(out_state[k].View(rows, cols));
    o.push_back(ContiguousView(outs[k].data(), DType::kFloat32, rows, cols));
    scales.push_back({in[k].scales.data(), out_state[k].scales.data()});
  }
  const absl::Status st =
      cpu->MuonMomentumBatch(g, mi, mo, 0.9, true, o, scales);
  ASSERT_TRUE(st.ok()) << st;
  for (size_t k = 0; k < shapes.size(); ++k) ExpectState(out_state[k], want[k]);
}

TEST(Fp8Momentum, RefusesMissingScalesStridedStateAndMixedDtypes) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::vector<float> grad(64), out(64), f32(64), scales(1);
  std::vector<uint8_t> codes(64), codes2(64);
  const MatrixView g = ContiguousView(grad.data(), DType::kFloat32, 8, 8);
  const MatrixView o = ContiguousView(out.data(), DType::kFloat32, 8, 8);
  const MatrixView m = ContiguousView(codes.data(), DType::kFloat8E4M3, 8, 8);
  absl::Status st = cpu->MuonMomentum(g, m, 0.9, false, o);
  EXPECT_TRUE(absl::StrContains(st.message(), "needs its block scales")) << st;
  const MatrixView strided{codes.data(), DType::kFloat8E4M3, 4, 4, 8};
  st = cpu->MuonMomentum(g.Block(0, 0, 4, 4), strided, strided, 0.9, false,
                         o.Block(0, 0, 4, 4),
                         BlockScales{scales.data(), scales.data()});
  EXPECT_TRUE(absl::StrContains(st.message(), "contiguous")) << st;
  st = cpu->MuonMomentum(g, m,
                         ContiguousView(f32.data(), DType::kFloat32, 8, 8), 0.9,
                         false, o, BlockScales{scales.data(), scales.data()});
  EXPECT_TRUE(absl::StrContains(st.message(), "both be fp8_e4m3")) << st;
  const MatrixView m32 = ContiguousView(f32.data(), DType::kFloat32, 8, 8);
  st = cpu->MuonMomentum(g, m32, m32, 0.9, false, o,
                         BlockScales{scales.data(), scales.data()});
  EXPECT_TRUE(absl::StrContains(st.message(), "fp8_e4m3 state only")) << st;
  EXPECT_TRUE(std::all_of(codes.begin(), codes.end(),
                          [](uint8_t c) { return c == 0; }));
}

// ---- AdamW on bf16 and fp8 moments ----------------------------------------

AdamWScalars Scalars() {
  AdamWScalars s;
  s.param_decay = 0.999f;
  s.one_minus_beta1 = 0.1f;
  s.beta2 = 0.999f;
  s.one_minus_beta2 = 0.001f;
  s.step_size = 0.01f;
  s.bias_correction2_sqrt = 0.3f;
  s.eps = 1e-8f;
  return s;
}
testing::RefAdamWScalars RefScalars(const AdamWScalars& s) {
  return {s.param_decay, s.one_minus_beta1,       s.beta2, s.one_minus_beta2,
          s.step_size,   s.bias_correction2_sqrt, s.eps};
}

TEST(Fp8AdamW, TwoStepsMatchTheReference) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  const int64_t rows = 3, cols = 200, pad = 4;  // 600: blocks 256, 256, 88
  std::vector<float> param = Random(rows * cols, 40), ref_param = param;
  Fp8Buffers m{std::vector<uint8_t>(rows * cols), std::vector<float>(3, 0.0f)},
      v = m;
  RefFp8State ref_m = testing::RefQuantize(std::vector<float>(rows * cols)),
              ref_v = ref_m;
  for (uint32_t step = 0; step < 2; ++step) {
    std::vector<float> wide = Random(rows * (cols + pad), 41 + step);
    std::vector<float> flat;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j)
        flat.push_back(wide[i * (cols + pad) + j]);
    }
    const MatrixView grad{wide.data(), DType::kFloat32, rows, cols, cols + pad};
    const absl::Status st =
        cpu->AdamW(ContiguousView(param.data(), DType::kFloat32, rows, cols),
                   grad, m.View(rows, cols), v.View(rows, cols), Scalars(),
                   AdamWMomentScales{m.scales.data(), v.scales.data()});
    ASSERT_TRUE(st.ok()) << st;
    testing::RefAdamWFp8Step(ref_m, ref_v, ref_param, flat,
                             RefScalars(Scalars()));
    ExpectState(m, ref_m);
    ExpectState(v, ref_v);
    for (size_t e = 0; e < param.size(); ++e) {
      ASSERT_EQ(Bits(param[e]), Bits(ref_param[e])) << "param element " << e;
    }
  }
}

// torch.optim.AdamW's per-step scalars for step t (1-based), in double.
AdamWScalars TorchScalars(double lr, double beta1, double beta2, double eps,
                          double weight_decay, int t) {
  AdamWScalars s;
  s.param_decay = float(1.0 - lr * weight_decay);
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.step_size = float(lr / (1.0 - std::pow(beta1, t)));
  s.bias_correction2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, t)));
  s.eps = float(eps);
  return s;
}

// A rare embedding row: a few elements get a large grad every step, the
// rest a small grad one step in seven and zero otherwise. Stored linearly,
// a small element's v (~1e-9 against the block's ~1e-3) would round to 0
// while its m (~1e-4 against ~0.1) survives, and the zero-grad steps after
// would move it by step_size * m / eps. With v stored as sqrt(v), 50 fp8
// steps stay close to the fp32-state AdamW computed here.
TEST(Fp8AdamW, RareGradElementsFollowTheFp32StateStep) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  constexpr int64_t kN = 256, kFrequent = 8;
  constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8,
                   kDecay = 0.01;
  std::vector<float> param = Random(kN, 60, 0.05f), ref_param = param;
  std::vector<float> ref_m(kN, 0.0f), ref_v(kN, 0.0f);
  Fp8Buffers m{std::vector<uint8_t>(kN), std::vector<float>(1, 0.0f)}, v = m;
  for (int t = 1; t <= 50; ++t) {
    const std::vector<float> noise = Random(kN, 61 + t);
    std::vector<float> grad(kN, 0.0f);
    for (int64_t e = 0; e < kN; ++e) {
      if (e < kFrequent)
        grad[e] = 1.0f + 0.2f * noise[e];
      else if ((e + t) % 7 == 0)
        grad[e] = 1e-3f * noise[e];
    }
    const AdamWScalars s = TorchScalars(kLr, kBeta1, kBeta2, kEps, kDecay, t);
    ASSERT_TRUE(cpu->AdamW(ContiguousView(param.data(), DType::kFloat32, 1, kN),
                           ContiguousView(grad.data(), DType::kFloat32, 1, kN),
                           m.View(1, kN), v.View(1, kN), s,
                           AdamWMomentScales{m.scales.data(), v.scales.data()})
                    .ok());
    for (int64_t e = 0; e < kN; ++e) {  // fp32 state, torch's order
      const float g = grad[e];
      ref_m[e] = ref_m[e] + s.one_minus_beta1 * (g - ref_m[e]);
      ref_v[e] = ref_v[e] * s.beta2 + (s.one_minus_beta2 * g) * g;
      const float denom = std::sqrt(ref_v[e]) / s.bias_correction2_sqrt + s.eps;
      ref_param[e] =
          ref_param[e] * s.param_decay - s.step_size * (ref_m[e] / denom);
    }
  }
  float ref_max = 0.0f, got_max = 0.0f, max_diff = 0.0f;
  for (int64_t e = 0; e < kN; ++e) {
    ref_max = std::max(ref_max, std::fabs(ref_param[e]));
    got_max = std::max(got_max, std::fabs(param[e]));
    max_diff = std::max(max_diff, std::fabs(param[e] - ref_param[e]));
  }
  EXPECT_LE(got_max, 1.1f * ref_max);
  EXPECT_LE(max_diff, 0.05f * ref_max)
      << "largest |fp8 - fp32| " << max_diff << ", largest |param| " << ref_max;
}

// The exported second moment is v = fl(q * q) of q = code * scale; its
// import takes sqrt(v), which gives q back for every code and any scale that
// keeps q * q normal, so export -> import -> export is exact.
TEST(Fp8AdamW, SquareRootOfTheSquaredCodeIsTheCode) {
  std::mt19937 rng(70);
  std::uniform_int_distribution<uint32_t> bits(0x20000000u, 0x5f000000u);
  int checked = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const float scale = BitsToFloat(bits(rng));  // ~1e-19 .. ~9e18
    for (int code = 1; code <= 0x7e; ++code) {
      const float q = float(RefE4M3Value(code)) * scale;
      if (!(q * q >= std::numeric_limits<float>::min()) || std::isinf(q * q)) {
        continue;
      }
      ASSERT_EQ(Bits(std::sqrt(q * q)), Bits(q))
          << "code " << code << " scale " << scale;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100000);
}

TEST(Bf16AdamW, MomentsAreTheFp32StepRoundedToNearestEven) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  const int64_t n = 300;
  std::vector<float> param = Random(n, 50), grad = Random(n, 51);
  std::vector<float> m32 = Random(n, 52, 0.1f), v32(n);
  for (int64_t e = 0; e < n; ++e) {
    m32[e] = RoundToBf16(m32[e]);
    v32[e] = RoundToBf16(m32[e] * m32[e] + 0.01f);
  }
  std::vector<uint16_t> m16(n), v16(n);
  for (int64_t e = 0; e < n; ++e) {
    m16[e] = FloatToBf16Bits(m32[e]);
    v16[e] = FloatToBf16Bits(v32[e]);
  }
  std::vector<float> ref_param = param;
  const testing::RefAdamWScalars s = RefScalars(Scalars());
  const absl::Status st =
      cpu->AdamW(ContiguousView(param.data(), DType::kFloat32, 1, n),
                 ContiguousView(grad.data(), DType::kFloat32, 1, n),
                 ContiguousView(m16.data(), DType::kBFloat16, 1, n),
                 ContiguousView(v16.data(), DType::kBFloat16, 1, n), Scalars());
  ASSERT_TRUE(st.ok()) << st;
  for (int64_t e = 0; e < n; ++e) {
    const float g = grad[e];
    const float p = ref_param[e] * s.param_decay;
    const float m = testing::RefLerp(m32[e], g, s.one_minus_beta1);
    const float v = v32[e] * s.beta2 + (s.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    ASSERT_EQ(Bits(param[e]), Bits(p + (-s.step_size) * (m / denom))) << e;
    ASSERT_EQ(m16[e], FloatToBf16Bits(m)) << e;
    ASSERT_EQ(v16[e], FloatToBf16Bits(v)) << e;
  }
}

TEST(Fp8AdamW, RefusesMixedMomentDtypesAndMissingScales) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::vector<float> p(8), g(8), f32(8);
  std::vector<uint8_t> codes(8);
  const MatrixView pv = ContiguousView(p.data(), DType::kFloat32, 1, 8);
  const MatrixView gv = ContiguousView(g.data(), DType::kFloat32, 1, 8);
  const MatrixView c = ContiguousView(codes.data(), DType::kFloat8E4M3, 1, 8);
  absl::Status st = cpu->AdamW(pv, gv, c, c, Scalars());
  EXPECT_TRUE(absl::StrContains(st.message(), "block scales")) << st;
  st = cpu->AdamW(pv, gv, c, ContiguousView(f32.data(), DType::kFloat32, 1, 8),
                  Scalars());
  EXPECT_TRUE(absl::StrContains(st.message(), "one state dtype")) << st;
}

}  // namespace
}  // namespace muond
