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

// The probe's printed kernels, their description and its process name, run
// with OPENBLAS_CORETYPE=`coretype` ("": unset).
struct Probed {
  std::string core, description, name;
};

Probed Probe(const std::string& coretype) {
  const char* dir = getenv("TEST_SRCDIR");
  const char* workspace = getenv("TEST_WORKSPACE");
  const std::string probe =
      dir == nullptr ? "tests/core/backend/openblas_core_probe"
                     : absl::StrCat(dir, "/", workspace,
                                    "/tests/core/backend/openblas_core_probe");
  const std::string env =
      coretype.empty() ? "env -u OPENBLAS_CORETYPE "
                       : absl::StrCat("env OPENBLAS_CORETYPE=", coretype, " ");
  FILE* out =
      popen((env + "env -u MUOND_OPENBLAS_FALLBACK " + probe).c_str(), "r");
  if (out == nullptr) return {"<popen failed>", "", ""};
  Probed probed{"<no output>", "", ""};
  char line[256] = {0};
  for (std::string* field : {&probed.core, &probed.description, &probed.name}) {
    if (fgets(line, sizeof(line), out) == nullptr) break;
    *field = std::string(absl::StripSuffix(line, "\n"));
  }
  pclose(out);
  return probed;
}

std::string ProbeCore(const std::string& coretype) {
  return Probe(coretype).core;
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

// The log line says who chose: muond over a named fallback, or the user.
TEST(OpenBlasCore, TheDescriptionSaysWhoChose) {
  const Probed probed = Probe("");
  const std::string chosen = probed.core + " (chosen over OpenBLAS's fallback ";
  if (probed.description != probed.core) {
    ASSERT_EQ(probed.description.rfind(chosen, 0), 0u) << probed.description;
    const std::string fallback = probed.description.substr(
        chosen.size(), probed.description.size() - chosen.size() - 1);
    EXPECT_TRUE(IsFallback(fallback)) << probed.description;
  }
  EXPECT_EQ(Probe("Haswell").description, "Haswell (OPENBLAS_CORETYPE)");
}

// Started again or not, the process keeps its name (comm, at most 15
// characters: what ps, pgrep and pkill go by), not exec's "exe".
TEST(OpenBlasCore, TheProcessKeepsItsName) {
  EXPECT_EQ(Probe("").name, "openblas_core_p");
  EXPECT_EQ(Probe("Prescott").name, "openblas_core_p");
}

TEST(OpenBlasCore, ASetCoretypeIsTheUsersChoice) {
  EXPECT_EQ(ProbeCore("Prescott"), "Prescott");
  setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  EXPECT_EQ(BetterOpenBlasCore(), "");
}

}  // namespace
}  // namespace muond
