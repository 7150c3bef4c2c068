// The CUDA backend switches that the environment variables of earlier
// releases asked for (CudaBackendOptionsFromLegacyEnvironment): the rule
// muond-daemon's --cublas_gemmex, --cuda_graphs and --lt_autotune take their
// defaults by; and the names of the symmetric GEMM's schedules
// (--sym_gemm_schedule). A fake environment, no device.
#include "core/backend/cuda_backend_options.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace muond {
namespace {

CudaBackendOptions FromEnvironment(
    const std::map<std::string, std::string>& env) {
  return CudaBackendOptionsFromLegacyEnvironment(
      [&env](const char* name) -> const char* {
        auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      });
}

TEST(CudaBackendOptionsFromLegacyEnvironment, UnsetVariablesKeepTheDefaults) {
  const CudaBackendOptions options = FromEnvironment({});
  EXPECT_FALSE(options.cublas_gemmex);
  EXPECT_TRUE(options.cuda_graphs);
  EXPECT_EQ(options.lt_autotune, 0);
}

TEST(CudaBackendOptionsFromLegacyEnvironment, OnlyTheSwitchingValuesSwitch) {
  EXPECT_TRUE(FromEnvironment({{"MUOND_CUBLAS_GEMMEX", "1"}}).cublas_gemmex);
  for (const char* other : {"0", "", "true", "yes", "2"}) {
    EXPECT_FALSE(
        FromEnvironment({{"MUOND_CUBLAS_GEMMEX", other}}).cublas_gemmex)
        << other;
  }
  EXPECT_FALSE(FromEnvironment({{"MUOND_CUDA_GRAPHS", "0"}}).cuda_graphs);
  for (const char* other : {"1", "", "false", "no", "00"}) {
    EXPECT_TRUE(FromEnvironment({{"MUOND_CUDA_GRAPHS", other}}).cuda_graphs)
        << other;
  }
}

TEST(CudaBackendOptionsFromLegacyEnvironment,
     AutotuneIsTheNumberAsAtoiReadsIt) {
  EXPECT_EQ(FromEnvironment({{"MUOND_LT_AUTOTUNE", "8"}}).lt_autotune, 8);
  EXPECT_EQ(FromEnvironment({{"MUOND_LT_AUTOTUNE", "12abc"}}).lt_autotune, 12);
  EXPECT_EQ(FromEnvironment({{"MUOND_LT_AUTOTUNE", "abc"}}).lt_autotune, 0);
  // Clamping to [0, kMaxLtAutotune] is the backend's, as for a flag value.
  EXPECT_EQ(FromEnvironment({{"MUOND_LT_AUTOTUNE", "99"}}).lt_autotune, 99);
}

TEST(CudaBackendOptionsFromLegacyEnvironment, VariablesAreIndependent) {
  const CudaBackendOptions options = FromEnvironment({
      {"MUOND_CUBLAS_GEMMEX", "1"},
      {"MUOND_CUDA_GRAPHS", "0"},
      {"MUOND_LT_AUTOTUNE", "4"},
  });
  EXPECT_TRUE(options.cublas_gemmex);
  EXPECT_FALSE(options.cuda_graphs);
  EXPECT_EQ(options.lt_autotune, 4);
}

TEST(SymGemmSchedule, NamesParseToTheirSchedulesAndNothingElseParses) {
  for (SymGemmSchedule s :
       {SymGemmSchedule::kAuto, SymGemmSchedule::kCooperative,
        SymGemmSchedule::kPingpong, SymGemmSchedule::kWide}) {
    EXPECT_EQ(ParseSymGemmSchedule(SymGemmScheduleName(s)), s);
  }
  EXPECT_STREQ(SymGemmScheduleName(SymGemmSchedule::kPingpong), "pingpong");
  EXPECT_STREQ(SymGemmScheduleName(SymGemmSchedule::kWide), "wide");
  EXPECT_EQ(ParseSymGemmSchedule("cooperative"), SymGemmSchedule::kCooperative);
  for (const char* other : {"", "Auto", "ping-pong", "pingpong ", "coop"}) {
    EXPECT_FALSE(ParseSymGemmSchedule(other).has_value()) << other;
  }
  EXPECT_EQ(CudaBackendOptions{}.sym_gemm_schedule, SymGemmSchedule::kAuto);
}

}  // namespace
}  // namespace muond
