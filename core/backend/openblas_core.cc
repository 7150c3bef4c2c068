#include "core/backend/openblas_core.h"

#include <strings.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

extern "C" char* openblas_get_corename(void);

namespace muond {
namespace {

// Set with OPENBLAS_CORETYPE by the re-exec: the kernels it replaced.
constexpr char kFallbackVariable[] = "MUOND_OPENBLAS_FALLBACK";
// The process name ReexecWithBetterOpenBlasCore hands to the image it starts.
constexpr char kNameVar[] = "MUOND_REEXEC_NAME";

// The kernels DYNAMIC_ARCH falls back to on a CPU newer than the library.
bool IsFallbackCore(const std::string& core) {
  for (const char* old : {"Prescott", "Core2", "Nehalem", "Sandybridge"}) {
    if (core == old) return true;
  }
  return false;
}

#if defined(__x86_64__)
// XCR0: the register state the OS saves on a context switch; a CPU's
// AVX-512 is usable only where the OS saves it (OSXSAVE set).
uint64_t OsSavedState() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return 0;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

std::string BestCoreOfThisCpu() {
  __builtin_cpu_init();
  const uint64_t saved = OsSavedState();
  const bool avx_state = (saved & 0x6) == 0x6;       // SSE, AVX
  const bool avx512_state = (saved & 0xe6) == 0xe6;  // + opmask, ZMM
  if (avx512_state && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    return "SkylakeX";
  }
  if (avx_state && __builtin_cpu_supports("avx2") &&
      __builtin_cpu_supports("fma")) {
    return "Haswell";
  }
  return "";
}
#else
std::string BestCoreOfThisCpu() { return ""; }
#endif

}  // namespace

std::string OpenBlasCore() {
  const char* name = openblas_get_corename();
  return name == nullptr ? "" : name;
}

std::string BetterOpenBlasCore() {
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  if (set != nullptr && *set != '\0') return "";
  if (!IsFallbackCore(OpenBlasCore())) return "";
  return BestCoreOfThisCpu();
}

std::string ReexecWithBetterOpenBlasCore(char** argv) {
  // The image started again takes back the process's name (comm: what ps,
  // top, pgrep, pkill and killall go by), which the kernel sets from the
  // path exec'd: "exe".
  if (const char* name = std::getenv(kNameVar); name != nullptr) {
    prctl(PR_SET_NAME, name, 0, 0, 0);
    unsetenv(kNameVar);
    return "";
  }
  const std::string core = BetterOpenBlasCore();
  if (core.empty()) return "";
  char name[17] = {0};  // comm is at most 15 characters and a NUL
  prctl(PR_GET_NAME, name, 0, 0, 0);
  // Set even if exec fails: a second try (a child of this process) does not
  // loop, and the value names what was meant.
  setenv(kFallbackVariable, OpenBlasCore().c_str(), 1);
  setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  setenv(kNameVar, name, 1);
  execv("/proc/self/exe", argv);
  const int exec_error = errno;
  unsetenv(kNameVar);  // exec failed: this image has its name
  unsetenv(kFallbackVariable);
  return std::string("could not start again with OPENBLAS_CORETYPE=") + core +
         " (execv /proc/self/exe: " + std::strerror(exec_error) +
         "); OpenBLAS runs its fallback kernels";
}

std::string DescribeOpenBlasKernels() {
  const std::string core = OpenBlasCore();
  const char* fallback = std::getenv(kFallbackVariable);
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  // OpenBLAS reads the variable ignoring case.
  const bool taken = set != nullptr && strcasecmp(core.c_str(), set) == 0;
  if (fallback != nullptr && taken) {
    return core + " (chosen over OpenBLAS's fallback " + fallback + ")";
  }
  if (set != nullptr && *set != '\0') {
    // A value OpenBLAS did not take (unknown to it, or set after it loaded).
    return taken ? core + " (OPENBLAS_CORETYPE)"
                 : core + " (OPENBLAS_CORETYPE=" + set + " not taken)";
  }
  return core;
}

}  // namespace muond
