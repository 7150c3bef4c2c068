#pragma once
// The CUDA backend's switches (MakeCudaBackend), in a header without CUDA so
// the daemon's flags and CPU tests can name them. Core reads no environment:
// the processes set these (muond-daemon --cublas_gemmex, --cuda_graphs,
// --lt_autotune; server/README.md).
#include <functional>
#include <optional>
#include <string_view>

namespace muond {

// How the sm_90a symmetric GEMM's two consumer warpgroups share its work
// (core/backend/sym_gemm_sm90_kernel.cuh): kCooperative (both on one 128 x
// 128 tile), kPingpong (a tile each, one's epilogue under the other's
// mainloop), kWide (both on one 128 x 256 tile), kAuto (the backend's pick:
// wide from n = 8192, ping-pong for products with c (d = alpha a b + beta c,
// beta != 0) from n = 2048 and for X X^T and X^T X without c whose batch's
// lower tiles fill two waves of the GPU, else cooperative; sym_gemm_rule.h).
enum class SymGemmSchedule { kAuto, kCooperative, kPingpong, kWide };

// "auto", "cooperative", "pingpong", "wide"; nullopt for anything else.
std::optional<SymGemmSchedule> ParseSymGemmSchedule(std::string_view name);
const char* SymGemmScheduleName(SymGemmSchedule schedule);

struct CudaBackendOptions {
  // GEMMs through the legacy cublasGemmEx path (plus a copy for a separate
  // output) instead of cublasLt, for A/B measurements.
  bool cublas_gemmex = false;
  // RunGraph captures the work into a CUDA graph and replays it; false:
  // RunGraph runs its work directly (debugging).
  bool cuda_graphs = true;
  // Diagnostic, off (0) by default since the pick would depend on timings:
  // each cublasLt GEMM plan times the heuristic's first N algorithms once and
  // keeps the fastest (N > 1 tunes; clamped to [0, 32]).
  int lt_autotune = 0;
  // False: no cuBLAS handles and no 64 MiB cuBLAS workspace, so a backend
  // that only copies and runs elementwise kernels (Backend::NewStream's)
  // costs no device memory; its GEMMs fail FailedPrecondition.
  bool blas = true;
  // The symmetric GEMM kernel's schedule (muond-daemon --sym_gemm_schedule).
  SymGemmSchedule sym_gemm_schedule = SymGemmSchedule::kAuto;
};

// The largest lt_autotune the backend honours; larger values are clamped.
inline constexpr int kMaxLtAutotune = 32;

// The options the environment variables of earlier releases asked for, so a
// process that takes the options as flags can default each flag to its
// variable: MUOND_CUBLAS_GEMMEX=1 sets cublas_gemmex, MUOND_CUDA_GRAPHS=0
// clears cuda_graphs, MUOND_LT_AUTOTUNE=N sets lt_autotune to N (atoi: a
// non-number is 0). Any other value, or an unset variable (`lookup` returns
// null), leaves the default. `lookup` is the caller's getenv: this function
// reads no environment itself.
CudaBackendOptions CudaBackendOptionsFromLegacyEnvironment(
    const std::function<const char*(const char*)>& lookup);

}  // namespace muond
