#pragma once
// Which OpenBLAS kernels this process runs. Debian 12's OpenBLAS (0.3.21,
// built DYNAMIC_ARCH) picks its kernels by CPU model and falls back to the
// Prescott (SSE3) ones on a CPU it does not know: on an Emerald Rapids host
// (family 6, model 207) its SGEMM then runs at a sixth of the SkylakeX
// kernels' speed, and the CPU backend's Newton–Schulz with it.
// OPENBLAS_CORETYPE, read once when the library loads, names the kernels
// instead; the daemon runs itself again with it set
// (ReexecWithBetterOpenBlasCore).
#include <string>

namespace muond {

// The kernels OpenBLAS runs in this process ("Haswell", "SkylakeX", ...).
std::string OpenBlasCore();

// The OPENBLAS_CORETYPE this process should run with: "SkylakeX" or
// "Haswell" where OpenBLAS fell back to older kernels (Prescott, Core2,
// Nehalem, Sandybridge) than this CPU and its OS support (AVX-512 F, CD, BW,
// DQ and VL; else AVX2 and FMA); "" where it chose those or better, where
// OPENBLAS_CORETYPE is set already (the user's choice), or off x86-64.
std::string BetterOpenBlasCore();

// Runs this program again (execv of /proc/self/exe, the same argv: the same
// pid) with OPENBLAS_CORETYPE=BetterOpenBlasCore() when that is not empty,
// and MUOND_OPENBLAS_FALLBACK naming the kernels it replaced. Returns where
// there is nothing to do (""), in the image started again, which it gives
// the process's name back (MUOND_REEXEC_NAME carries it: exec names it
// "exe"), or where the exec failed (why, for the log once logging is up).
// Call first in main, before any thread starts.
std::string ReexecWithBetterOpenBlasCore(char** argv);

// The kernels this process runs and who chose them, for a log line:
// "SkylakeX (chosen over OpenBLAS's fallback Prescott)", "Haswell
// (OPENBLAS_CORETYPE)", "SkylakeX".
std::string DescribeOpenBlasKernels();

}  // namespace muond
