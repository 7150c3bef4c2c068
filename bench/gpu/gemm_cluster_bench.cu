// Times CUTLASS's own sm90 GEMM (D = A B^T, bf16 in, fp32 accumulate, bf16
// out) at several tile shapes, schedules and cluster shapes beside cuBLAS on
// the same full product, sustained for seconds so that the GPU sits at its
// power limit, and prints each column's time and energy a launch (NVML's
// energy counter). Why: at the power limit a kernel's speed is its energy
// per product, and the symmetric GEMM (core/backend/sym_gemm_sm90_kernel.cuh)
// runs without clusters; this says what a 2-CTA cluster (TMA multicast of
// the shared operand) buys a full GEMM before the symmetric kernel's
// triangle walk is taught to pair tiles.
//
// Usage: gemm_cluster_bench M N K [BATCH [ITERS]] (kUsage below).
// Every column's D is first checked against cuBLAS's. After a warm-up of a
// few seconds, the columns run in the table's order, then again in reverse,
// and each column's two runs are averaged, so that drift over the call
// weighs on all alike.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/gpu/power_sampler.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace {

using Element = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // A: M x K, K-major
using LayoutB = cutlass::layout::ColumnMajor;  // B: N x K, K-major (B^T)
using LayoutD = cutlass::layout::RowMajor;

// A packed stride: the one dynamic non-batch mode (the leading dimension,
// every operand here K- or N-contiguous) and the batch mode.
template <class Stride>
Stride Packed(int64_t ld, int64_t batch_stride) {
  Stride s{};
  cute::get<0>(s) = ld;
  cute::get<2>(s) = batch_stride;
  return s;
}

#define CK(x)                                                \
  do {                                                       \
    cudaError_t e_ = (x);                                    \
    if (e_ != cudaSuccess) {                                 \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, \
                   cudaGetErrorString(e_));                  \
      std::exit(1);                                          \
    }                                                        \
  } while (0)

template <int kM, int kN, int kClusterM, int kClusterN, bool kPingpong>
struct Cutlass {
  using Tile = cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::_64>;
  using Cluster =
      cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using KernelSchedule =
      cute::conditional_t<kPingpong,
                          cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                          cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element,
      LayoutD, 8, Element, LayoutD, 8, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8,
      Element, LayoutB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                           Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // A launcher for D = A B^T over the batch, or an empty function where
  // CUTLASS refuses the problem.
  static std::function<void(cudaStream_t)> Make(int m, int n, int k, int l,
                                                const Element* a,
                                                const Element* b, Element* d,
                                                int sm_count) {
    // Row-major A (m x k), B given as n x k rows (B^T), row-major D.
    auto sa = Packed<typename Kernel::StrideA>(k, int64_t(m) * k);
    auto sb = Packed<typename Kernel::StrideB>(k, int64_t(n) * k);
    auto sd = Packed<typename Kernel::StrideD>(n, int64_t(m) * n);
    typename Gemm::Arguments args{
        l > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
              : cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, l},
        {a, sa, b, sb},
        {{1.f, 0.f}, d, sd, d, sd}};
    args.hw_info.sm_count = sm_count;
    // The adapter and its workspace live as long as the launcher.
    struct Owned {
      Gemm gemm;
      void* workspace = nullptr;
      ~Owned() { cudaFree(workspace); }
    };
    auto owned = std::make_shared<Owned>();
    if (owned->gemm.can_implement(args) != cutlass::Status::kSuccess) return {};
    const size_t bytes = Gemm::get_workspace_size(args);
    if (bytes > 0) CK(cudaMalloc(&owned->workspace, bytes));
    if (owned->gemm.initialize(args, owned->workspace) !=
        cutlass::Status::kSuccess) {
      return {};
    }
    // run() clears cudaGetLastError itself, so its status is the only word
    // of a failed launch (a cluster launch refused, say).
    return [owned](cudaStream_t s) {
      if (owned->gemm.run(s) != cutlass::Status::kSuccess) {
        std::fprintf(stderr, "a CUTLASS launch failed\n");
        std::exit(1);
      }
    };
  }
};

struct Column {
  std::string name;
  std::function<void(cudaStream_t)> launch;
  double ms = 0, mj = 0;
  int runs = 0, energy_runs = 0;  // energy_runs: runs the counter measured
};

// A count in [lo, hi] written in decimal digits only, or -1.
int64_t ParseCount(const char* s, int64_t lo, int64_t hi) {
  if (*s < '0' || *s > '9') return -1;  // no sign, no blanks
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (*end != '\0' || v < lo || v > hi) return -1;
  return v;
}

// Launches `launch` until `seconds` of GPU time have passed: the clock and
// power settle to the limit before anything is timed.
void WarmUp(const std::function<void(cudaStream_t)>& launch, cudaStream_t s,
            double seconds) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0, s));
  float ms = 0;
  while (ms < seconds * 1e3) {
    for (int i = 0; i < 20; ++i) launch(s);
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms, e0, e1));
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// The largest |x - ref| over the largest |ref|: each column's D against
// cuBLAS's, so that a wrong layout or stride is not timed as real work.
double RelativeError(const std::vector<Element>& x,
                     const std::vector<Element>& ref) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err = std::max(err, std::abs(double(float(x[i])) - double(float(ref[i]))));
    scale = std::max(scale, std::abs(double(float(ref[i]))));
  }
  return scale > 0 ? err / scale : err;
}

constexpr const char* kUsage =
    "usage: gemm_cluster_bench M N K [BATCH [ITERS]]\n"
    "  M, N, K: multiples of 8 in [8, 65536]; BATCH in [1, 4096] (default 1);\n"
    "  ITERS in [1, 1048576] launches a run (default 1000); each operand at\n"
    "  most 2^32 elements. Give ITERS so that a run lasts seconds.\n";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 6) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  const int64_t m = ParseCount(argv[1], 8, 1 << 16),
                n = ParseCount(argv[2], 8, 1 << 16),
                k = ParseCount(argv[3], 8, 1 << 16),
                l = argc > 4 ? ParseCount(argv[4], 1, 4096) : 1,
                iters = argc > 5 ? ParseCount(argv[5], 1, 1 << 20) : 1000;
  // Each operand fits in 8 GiB (the host copies too).
  const int64_t kMaxElements = int64_t(1) << 32;
  if (m < 0 || n < 0 || k < 0 || l < 0 || iters < 0 || m % 8 || n % 8 ||
      k % 8 || m * k * l > kMaxElements || n * k * l > kMaxElements ||
      m * n * l > kMaxElements) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::fprintf(stderr,
                 "gemm_cluster_bench: no CUDA device here (it needs "
                 "an sm_90 GPU)\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr,
                 "gemm_cluster_bench: the kernels are sm_90a; this "
                 "GPU is compute capability %d.%d\n",
                 prop.major, prop.minor);
    return 2;
  }
  char bus[32] = {};
  CK(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
  muond::bench::PowerSampler power(bus);

  const size_t a_elems = size_t(m * k * l), b_elems = size_t(n * k * l),
               d_elems = size_t(m * n * l);
  Element *a = nullptr, *b = nullptr, *d = nullptr;
  CK(cudaMalloc(&a, a_elems * sizeof(Element)));
  CK(cudaMalloc(&b, b_elems * sizeof(Element)));
  CK(cudaMalloc(&d, d_elems * sizeof(Element)));
  {
    // Random operands (constant ones draw less power than a real product),
    // A and B from one stream, so that they differ even where M = N: the
    // correctness check below then sees a transposed D or swapped operands.
    uint64_t x = 88172645463325252ull;
    auto fill = [&x](Element* dst, size_t count) {
      std::vector<Element> h(count);
      for (auto& e : h) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        e = Element(float(int(x % 2001) - 1000) / 1000.f);
      }
      CK(cudaMemcpy(dst, h.data(), count * sizeof(Element),
                    cudaMemcpyHostToDevice));
    };
    fill(a, a_elems);
    fill(b, b_elems);
  }
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) return 1;
  const int sms = prop.multiProcessorCount;

  std::vector<Column> cols;
  auto add = [&](const char* name, std::function<void(cudaStream_t)> f) {
    if (f)
      cols.push_back({name, std::move(f)});
    else
      std::printf("(%s: CUTLASS refused the problem)\n", name);
  };
  add("cuBLAS", [&](cudaStream_t s) {
    const float one = 1.f, zero = 0.f;
    // Row-major D (m x n) = A B^T is column-major D^T = B A^T.
    if (cublasSetStream(cublas, s) != CUBLAS_STATUS_SUCCESS ||
        cublasGemmStridedBatchedEx(
            cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, b,
            CUDA_R_16BF, int(k), n * k, a, CUDA_R_16BF, int(k), m * k, &zero, d,
            CUDA_R_16BF, int(n), m * n, int(l), CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "the cuBLAS launch failed\n");
      std::exit(1);
    }
  });
  add("coop 128x128 1x1",
      Cutlass<128, 128, 1, 1, false>::Make(m, n, k, l, a, b, d, sms));
  add("coop 128x128 2x1",
      Cutlass<128, 128, 2, 1, false>::Make(m, n, k, l, a, b, d, sms));
  add("coop 128x256 1x1",
      Cutlass<128, 256, 1, 1, false>::Make(m, n, k, l, a, b, d, sms));
  add("coop 128x256 2x1",
      Cutlass<128, 256, 2, 1, false>::Make(m, n, k, l, a, b, d, sms));
  add("pingpong 64x128 1x1",
      Cutlass<64, 128, 1, 1, true>::Make(m, n, k, l, a, b, d, sms));
  add("pingpong 128x128 1x1",
      Cutlass<128, 128, 1, 1, true>::Make(m, n, k, l, a, b, d, sms));
  add("pingpong 128x128 2x1",
      Cutlass<128, 128, 2, 1, true>::Make(m, n, k, l, a, b, d, sms));

  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  // Every column computes the same D: each is checked once against
  // cuBLAS's before anything is timed.
  {  // the host copies go before the timing
    std::vector<Element> ref(d_elems), got(d_elems);
    for (Column& c : cols) {
      CK(cudaMemsetAsync(d, 0, d_elems * sizeof(Element), s));
      c.launch(s);
      CK(cudaStreamSynchronize(s));
      CK(cudaMemcpy(got.data(), d, d_elems * sizeof(Element),
                    cudaMemcpyDeviceToHost));
      if (&c == &cols.front()) {
        ref = got;
        continue;
      }
      // fp32 accumulation in either order, one bf16 rounding: within a few
      // units of bf16's last place of the largest entry.
      const double err = RelativeError(got, ref);
      if (!(err <= 1e-2)) {
        std::fprintf(stderr,
                     "%s: D differs from cuBLAS's by %.3g of its "
                     "largest entry\n",
                     c.name.c_str(), err);
        return 1;
      }
    }
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto run = [&](Column& c) {
    for (int64_t i = 0; i < std::min<int64_t>(iters, 50); ++i) c.launch(s);
    // The counter is read between host syncs; the timed interval starts
    // after the read, so the sync's gap is in neither.
    CK(cudaStreamSynchronize(s));
    const double mj0 = power.EnergyMillijoules();
    CK(cudaEventRecord(e0, s));
    for (int64_t i = 0; i < iters; ++i) c.launch(s);
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    const double mj1 = power.EnergyMillijoules();
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    c.ms += ms / iters;
    ++c.runs;
    const double mj = muond::bench::PowerSampler::PerLaunch(mj0, mj1, iters);
    if (mj >= 0) {
      c.mj += mj;
      ++c.energy_runs;
    }
  };
  // The first column would otherwise start from idle, at the boost clock.
  WarmUp(cols.front().launch, s, 3.0);
  for (auto& c : cols) run(c);
  for (auto it = cols.rbegin(); it != cols.rend(); ++it) run(*it);
  CK(cudaGetLastError());

  const double flops = 2.0 * m * n * k * l;
  auto mean_ms = [](const Column& c) { return c.ms / c.runs; };
  auto mean_mj = [](const Column& c) {
    return c.energy_runs > 0 ? c.mj / c.energy_runs : -1.0;
  };
  const Column& ref_col = cols.front();
  std::printf(
      "%s, %d SMs; M %lld N %lld K %lld batch %lld, %lld launches a "
      "run, two runs a column; every column's D within 1e-2 of "
      "cuBLAS's (relative to its largest entry)\n\n",
      prop.name, sms, (long long)m, (long long)n, (long long)k, (long long)l,
      (long long)iters);
  std::printf(
      "| kernel | ms | TFLOP/s | mJ a launch | W | ms ÷ cuBLAS | "
      "mJ ÷ cuBLAS |\n|---|---|---|---|---|---|---|\n");
  for (const Column& c : cols) {
    const double ms = mean_ms(c), mj = mean_mj(c), ref_mj = mean_mj(ref_col);
    std::printf("| %s | %.4f | %.0f | ", c.name.c_str(), ms, flops / ms / 1e9);
    if (mj >= 0)
      std::printf("%.1f | %.0f | ", mj, mj / ms);
    else
      std::printf("n/a | n/a | ");
    std::printf("%.3f | ", ms / mean_ms(ref_col));
    if (mj >= 0 && ref_mj > 0)
      std::printf("%.3f |\n", mj / ref_mj);
    else
      std::printf("n/a |\n");
  }
  if (std::any_of(cols.begin(), cols.end(),
                  [](const Column& c) { return c.energy_runs < c.runs; })) {
    std::printf(
        "\n(energy n/a in %s: NVML, its energy counter or a tick of it "
        "over the run was missing)\n",
        power.Available() ? "some runs" : "every run (no NVML)");
  }
  return 0;
}
