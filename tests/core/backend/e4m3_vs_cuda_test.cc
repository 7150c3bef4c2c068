// elementwise_math.h's e4m3 codec is CUDA's (cuda_fp8.h, satfinite) on
// every fp32 value and every code. Skipped without a GPU.
#include "tests/core/backend/e4m3_vs_cuda.h"

#include <gtest/gtest.h>

#include "tests/common/cuda_device.h"

namespace muond {
namespace {

TEST(E4M3VsCuda, EveryFloatAndEveryCodeAgree) {
  if (!muond::testing::HaveCudaDevice())
    GTEST_SKIP() << "no CUDA device on this machine";
  const testing::E4M3Mismatches m = testing::CompareE4M3WithCuda();
  ASSERT_EQ(m.error, 0);
  EXPECT_EQ(m.encode, 0u) << "first at fp32 bits 0x" << std::hex
                          << m.first_bits;
  EXPECT_EQ(m.decode, 0u);
}

}  // namespace
}  // namespace muond
