// Symmetric GEMM d = X X^T (bf16, fp32 accumulation) on the CUDA backend, four
// ways, as a markdown table:
//   sym        Backend::SymmetricGemmStridedBatchedOut (the sm_90a
//              lower-triangle kernel where the backend takes it)
//   full       GemmStridedBatchedOut (cuBLASLt, the whole product)
//   full+mir   full + SymmetrizeFromLower (the fallback of `sym`)
//   blockrow   the legacy use_syrk path: 4 lower block rows for n >= 4096
//              (1 below), each a GEMM, + SymmetrizeFromLower
// TFLOP/s count the full 2 n^2 k per matrix, so the kernel's figure is
// "effective" (it does about half the work). The ratios are the times of
// full+mir and blockrow over sym. Used to set the kernel's threshold
// (UseSymGemmKernel in core/backend/cuda_backend_gram.cc; bench/README.md).
//
//   sym_gemm_bench [--reps=20] [--quick]
// Without a GPU it prints SKIP and exits 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cuda_backend.h"
#include "core/backend/cuda_backend_options.h"

namespace muond {
namespace {

#define OK_OR_DIE(expr)                                               \
  do {                                                                \
    const absl::Status s_ = (expr);                                   \
    if (!s_.ok()) {                                                   \
      std::fprintf(stderr, "%s: %s\n", #expr, s_.ToString().c_str()); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (0)

double TimeMs(Backend& be, int reps, const std::function<void()>& f) {
  auto stream = static_cast<cudaStream_t>(be.stream());
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, stream);
  for (int i = 0; i < reps; ++i) f();
  cudaEventRecord(b, stream);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return double(ms) / reps;
}

void Row(Backend& be, int64_t n, int64_t k, int64_t batch, int reps) {
  const DType t = DType::kBFloat16;
  const int64_t sx = n * k, sd = n * n;
  void* xp = *be.Allocate(sx * batch * 2);
  void* dp = *be.Allocate(sd * batch * 2);
  // Values in [-0.5, 0.5) (zeros would run cooler and clock higher).
  std::vector<uint16_t> host(sx * batch);
  for (size_t i = 0; i < host.size(); ++i)
    host[i] = FloatToBf16Bits(float((uint32_t(i) * 2654435761u) >> 24) / 256.f -
                              0.5f);
  OK_OR_DIE(be.CopyFromHost(xp, host.data(), sx * batch * 2));
  const MatrixView x{xp, t, n, k, k}, d{dp, t, n, n, n};
  const MatmulPrecision med = MatmulPrecision::kMedium;
  auto sym = [&] {
    OK_OR_DIE(be.SymmetricGemmStridedBatchedOut(
        Op::kN, Op::kT, 1.0f, x, sx, x, sx, 0.0f, d, sd, d, sd, batch, med));
  };
  auto full = [&] {
    OK_OR_DIE(be.GemmStridedBatchedOut(Op::kN, Op::kT, 1.0f, x, sx, x, sx, 0.0f,
                                       d, sd, d, sd, batch, med));
  };
  auto full_mirror = [&] {
    full();
    OK_OR_DIE(be.SymmetrizeFromLower(d, sd, batch));
  };
  const int blocks = n >= 4096 ? 4 : 1;
  auto block_rows = [&] {
    for (int i = 0; i < blocks; ++i) {
      const int64_t i0 = (n * i / blocks) / 8 * 8;
      const int64_t i1 = i + 1 == blocks ? n : (n * (i + 1) / blocks) / 8 * 8;
      OK_OR_DIE(be.GemmStridedBatchedOut(
          Op::kN, Op::kT, 1.0f, x.Block(i0, 0, i1 - i0, k), sx,
          x.Block(0, 0, i1, k), sx, 0.0f, d.Block(i0, 0, i1 - i0, i1), sd,
          d.Block(i0, 0, i1 - i0, i1), sd, batch, med));
    }
    OK_OR_DIE(be.SymmetrizeFromLower(d, sd, batch));
  };
  const double flop = 2.0 * double(n) * double(n) * double(k) * batch;
  const int r = flop > 1e12 ? std::max(3, reps / 2) : reps;
  const double ts = TimeMs(be, r, sym), tf = TimeMs(be, r, full),
               tm = TimeMs(be, r, full_mirror), tb = TimeMs(be, r, block_rows);
  auto tflops = [&](double ms) { return flop / (ms * 1e-3) / 1e12; };
  std::printf(
      "| %lld | %lld | %lld | %s | %.4f | %.0f | %.4f | %.0f | %.4f | %.4f | "
      "%.2f | %.2f |\n",
      (long long)n, (long long)k, (long long)batch,
      be.FastSymmetricGemm(n, k, t, batch) ? "kernel" : "cuBLAS", ts,
      tflops(ts), tf, tflops(tf), tm, tb, tm / ts, tb / ts);
  be.Free(xp);
  be.Free(dp);
}

int Main(int argc, char** argv) {
  int reps = 20;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::atoi(argv[i] + 7);
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
  }
  if (!CudaDeviceAvailable()) {
    std::printf("SKIP: no CUDA device\n");
    return 0;
  }
  // The CUDA backend switches from the same environment variables that
  // default muond-daemon's flags (MUOND_CUDA_GRAPHS, MUOND_CUBLAS_GEMMEX,
  // MUOND_LT_AUTOTUNE; core reads none itself).
  auto be =
      MakeCudaBackend(0, CudaBackendOptionsFromLegacyEnvironment(
                             [](const char* n) { return std::getenv(n); }));
  if (!be.ok()) {
    std::fprintf(stderr, "%s\n", be.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "| n | k | batch | sym path | sym ms | sym TFLOP/s | full ms | full "
      "TFLOP/s | full+mir ms | blockrow ms | full+mir / sym | blockrow / sym "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  const std::vector<int64_t> ns =
      quick ? std::vector<int64_t>{1024, 4096}
            : std::vector<int64_t>{256,  512,  768,  1024, 1536,
                                   2048, 3072, 4096, 8192};
  for (int64_t n : ns)
    for (int64_t k : {n, n * 7 / 2}) Row(**be, n, k, 1, reps);
  for (int64_t n : {128, 256, 512, 1024})
    for (int64_t b : {8, 32}) Row(**be, n, n * 7 / 2 / 8 * 8, b, reps);
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) { return muond::Main(argc, argv); }
