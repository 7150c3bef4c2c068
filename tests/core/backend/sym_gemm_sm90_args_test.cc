// Which arguments the sm_90a symmetric GEMM takes (sym_gemm_sm90::Unsupported,
// host code: no device needed). Anything it refuses runs on the backend's
// fallback (cuBLASLt's full product + mirror), so each rule that protects the
// kernel's loads and stores must refuse exactly what would break them.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "core/backend/sym_gemm_sm90.h"

namespace muond::sym_gemm_sm90 {
namespace {

alignas(16) uint16_t storage[64];

// A batch of 3 aligned 64 x 64 X X^T products with beta c, every stride a
// multiple of 8: what the kernel takes.
Args Supported() {
  Args a;
  a.trans_a = false;
  a.trans_b = true;
  a.n = 64;
  a.k = 64;
  a.batch = 3;
  a.beta = 0.5f;
  a.a = a.b = a.c = storage;
  a.d = storage;
  a.lda = a.ldb = a.ldc = a.ldd = 64;
  a.stride_a = a.stride_b = a.stride_c = a.stride_d = 64 * 64;
  return a;
}

TEST(SymGemmSm90Unsupported, TakesAlignedOperandsWithEitherSchedule) {
  Args a = Supported();
  EXPECT_STREQ(Unsupported(a), "");
  a.schedule = Schedule::kPingpong;
  EXPECT_STREQ(Unsupported(a), "");
}

TEST(SymGemmSm90Unsupported, CsBatchStrideMustSuitSixteenByteLoads) {
  Args a = Supported();
  a.stride_c = 0;  // one c for every slice
  EXPECT_STREQ(Unsupported(a), "");
  for (int64_t bad : {int64_t{-8}, int64_t{4}, int64_t{64 * 64 + 1}}) {
    a.stride_c = bad;
    EXPECT_NE(std::string(Unsupported(a)).find("c's batch stride"),
              std::string::npos)
        << bad;
  }
  a.beta = 0.0f;  // c is not read
  EXPECT_STREQ(Unsupported(a), "");
  a.beta = 0.5f;
  a.batch = 1;  // one slice: the stride is never applied
  EXPECT_STREQ(Unsupported(a), "");
}

TEST(SymGemmSm90Unsupported, RefusesWhatItsLoadsAndStoresCannotTake) {
  Args a = Supported();
  a.trans_a = a.trans_b = true;
  EXPECT_STRNE(Unsupported(a), "");
  a = Supported();
  a.k = 60;  // X's rows not a multiple of 8 elements (TMA)
  EXPECT_STRNE(Unsupported(a), "");
  a = Supported();
  a.c = reinterpret_cast<const char*>(storage) + 2;
  EXPECT_STRNE(Unsupported(a), "");
  a.beta = 0.0f;  // an unaligned c that is never read is fine
  EXPECT_STREQ(Unsupported(a), "");
  a = Supported();
  a.ldc = 68;
  EXPECT_STRNE(Unsupported(a), "");
  a = Supported();
  a.stride_d = 4;
  EXPECT_STRNE(Unsupported(a), "");
}

}  // namespace
}  // namespace muond::sym_gemm_sm90
