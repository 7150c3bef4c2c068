// The CPU backend's 16-bit conversions (Copy2D between fp32 and bf16/fp16:
// the row loops every kMedium NS product runs, compiled for AVX-512 and AVX2
// besides the baseline) give the bits of the scalar conversions of bf16.h
// and fp16.h: every 16-bit pattern widened, and fp32 values at, next to and
// halfway between 16-bit values (ties, NaN payloads, inf, subnormals, the
// overflow edge) rounded, in rows whose lengths leave vector tails.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/fp16.h"

namespace muond {
namespace {

// A rows x cols view over `data` (row stride cols + pad: strided rows too).
template <typename T>
MatrixView View(std::vector<T>& data, DType dtype, int64_t cols, int64_t pad) {
  const int64_t stride = cols + pad;
  return MatrixView{data.data(), dtype, int64_t(data.size()) / stride, cols,
                    stride};
}

// fp32 bit patterns around each 16-bit value's own: the value, one ulp
// either side, and the halfway points below and above it (`shift`: 16 for
// bf16, 13 for fp16's mantissa), plus random patterns.
std::vector<uint32_t> RoundingCases(int shift) {
  std::vector<uint32_t> out;
  const uint32_t half = 1u << (shift - 1);
  for (uint32_t hi = 0; hi < (1u << (32 - shift));
       hi += (shift == 16 ? 1 : 7)) {
    const uint32_t u = hi << shift;
    for (uint32_t d : {0u, 1u, half - 1, half, half + 1, (1u << shift) - 1}) {
      out.push_back(u + d);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) out.push_back(rng());
  return out;
}

struct Case {
  DType narrow;
  uint16_t (*to_bits)(float);
  float (*from_bits)(uint16_t);
  int shift;
};

class CpuConversionsTest : public ::testing::TestWithParam<Case> {};

TEST_P(CpuConversionsTest, WideningEveryPatternGivesTheScalarBits) {
  const Case c = GetParam();
  auto backend = MakeCpuBackend();
  for (int64_t cols : {int64_t{257}, int64_t{31}}) {  // tails at 16, 8 lanes
    const int64_t pad = 3, rows = 65536 / cols + 1;
    std::vector<uint16_t> in(size_t(rows * (cols + pad)));
    for (size_t k = 0; k < in.size(); ++k) in[k] = uint16_t(k);
    std::vector<float> out(in.size(), -1.0f);
    ASSERT_TRUE(backend
                    ->Copy2D(View(out, DType::kFloat32, cols, pad),
                             View(in, c.narrow, cols, pad))
                    .ok());
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const size_t k = size_t(i * (cols + pad) + j);
        const uint32_t want = FloatBits(c.from_bits(in[k]));
        ASSERT_EQ(FloatBits(out[k]), want) << "pattern " << in[k];
      }
    }
  }
}

TEST_P(CpuConversionsTest, RoundingGivesTheScalarBits) {
  const Case c = GetParam();
  auto backend = MakeCpuBackend();
  const std::vector<uint32_t> bits = RoundingCases(c.shift);
  const int64_t cols = 1021, pad = 5;
  const int64_t rows = int64_t(bits.size()) / cols;
  std::vector<float> in(size_t(rows * (cols + pad)));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      in[size_t(i * (cols + pad) + j)] =
          BitsToFloat(bits[size_t(i * cols + j)]);
    }
  }
  std::vector<uint16_t> out(in.size(), 0xdead);
  ASSERT_TRUE(backend
                  ->Copy2D(View(out, c.narrow, cols, pad),
                           View(in, DType::kFloat32, cols, pad))
                  .ok());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const size_t k = size_t(i * (cols + pad) + j);
      ASSERT_EQ(out[k], c.to_bits(in[k])) << "fp32 bits " << FloatBits(in[k]);
    }
    for (int64_t j = cols; j < cols + pad; ++j) {  // the pad is not written
      ASSERT_EQ(out[size_t(i * (cols + pad) + j)], 0xdead);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Bf16AndFp16, CpuConversionsTest,
    ::testing::Values(
        Case{DType::kBFloat16, FloatToBf16Bits, Bf16BitsToFloat, 16},
        Case{DType::kFloat16, FloatToFp16Bits, Fp16BitsToFloat, 13}),
    [](const auto& info) {
      return info.param.narrow == DType::kBFloat16 ? "Bf16" : "Fp16";
    });

}  // namespace
}  // namespace muond
