// core/backend/openblas_core: a program that calls
// ReexecWithBetterOpenBlasCore first never runs OpenBLAS's fallback kernels
// on a CPU with AVX2 and FMA, and a set OPENBLAS_CORETYPE is left alone.
#include "core/backend/openblas_core.h"

#include <gtest/gtest.h>
#include <stdio.h>
#include <stdlib.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace muond {
namespace {

// The probe's printed line `line` (0: its kernels, 1: its process name), run
// with OPENBLAS_CORETYPE=`coretype` ("": unset).
std::string ProbeLine(const std::string& coretype, int line_index) {
  const char* dir = getenv("TEST_SRCDIR");
  const char* workspace = getenv("TEST_WORKSPACE");
  const std::string probe =
      dir == nullptr ? "tests/core/backend/openblas_core_probe"
                     : absl::StrCat(dir, "/", workspace,
                                    "/tests/core/backend/openblas_core_probe");
  const std::string env =
      coretype.empty() ? "env -u OPENBLAS_CORETYPE "
                       : absl::StrCat("env OPENBLAS_CORETYPE=", coretype, " ");
  FILE* out = popen((env + probe).c_str(), "r");
  if (out == nullptr) return "<popen failed>";
  char line[128] = {0};
  bool read = false;
  for (int i = 0; i <= line_index; ++i) {
    read = fgets(line, sizeof(line), out) != nullptr;
  }
  pclose(out);
  return read ? std::string(absl::StripSuffix(line, "\n")) : "<no output>";
}

std::string ProbeCore(const std::string& coretype) {
  return ProbeLine(coretype, 0);
}

bool IsFallback(const std::string& core) {
  return core == "Prescott" || core == "Core2" || core == "Nehalem" ||
         core == "Sandybridge";
}

TEST(OpenBlasCore, NamesTheKernels) { EXPECT_FALSE(OpenBlasCore().empty()); }

TEST(OpenBlasCore, NoFallbackKernelsAfterTheReexec) {
  const std::string core = ProbeCore("");
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_FALSE(IsFallback(core)) << core;
  }
#endif
  EXPECT_FALSE(core.empty());
  EXPECT_NE(core[0], '<') << core;
}

// Started again or not, the process keeps its name (comm, at most 15
// characters: what ps, pgrep and pkill go by), not exec's "exe".
TEST(OpenBlasCore, TheProcessKeepsItsName) {
  EXPECT_EQ(ProbeLine("", 1), "openblas_core_p");
  EXPECT_EQ(ProbeLine("Prescott", 1), "openblas_core_p");
}

TEST(OpenBlasCore, ASetCoretypeIsTheUsersChoice) {
  EXPECT_EQ(ProbeCore("Prescott"), "Prescott");
  setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  EXPECT_EQ(BetterOpenBlasCore(), "");
}

}  // namespace
}  // namespace muond
