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
// Usage: gemm_cluster_bench M N K [BATCH [ITERS]]
// Columns run in the table's order, then again in reverse, and each column's
// two runs are averaged, so that drift over the call weighs on all alike.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
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

#define CK(x)                                                           \
  do {                                                                  \
    cudaError_t e_ = (x);                                               \
    if (e_ != cudaSuccess) {                                            \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__,            \
                   cudaGetErrorString(e_));                             \
      std::exit(1);                                                     \
    }                                                                   \
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
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
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
    auto gemm = std::make_shared<Gemm>();
    if (gemm->can_implement(args) != cutlass::Status::kSuccess) return {};
    void* workspace = nullptr;
    const size_t bytes = Gemm::get_workspace_size(args);
    if (bytes > 0) CK(cudaMalloc(&workspace, bytes));
    if (gemm->initialize(args, workspace) != cutlass::Status::kSuccess) {
      return {};
    }
    return [gemm](cudaStream_t s) { gemm->run(s); };
  }
};

struct Column {
  std::string name;
  std::function<void(cudaStream_t)> launch;
  double ms = 0, mj = 0;
  int runs = 0;
};

int64_t ParseCount(const char* s, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0' || v < lo || v > hi) return -1;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 6) {
    std::fprintf(stderr, "usage: %s M N K [BATCH [ITERS]]\n", argv[0]);
    return 2;
  }
  const int64_t m = ParseCount(argv[1], 8, 1 << 16),
                n = ParseCount(argv[2], 8, 1 << 16),
                k = ParseCount(argv[3], 8, 1 << 16),
                l = argc > 4 ? ParseCount(argv[4], 1, 4096) : 1,
                iters = argc > 5 ? ParseCount(argv[5], 1, 1 << 20) : 1000;
  if (m < 0 || n < 0 || k < 0 || l < 0 || iters < 0 || m % 8 || n % 8 ||
      k % 8) {
    std::fprintf(stderr, "M, N, K: multiples of 8; BATCH, ITERS >= 1\n");
    return 2;
  }
  // Each operand fits in 8 GiB (the host copy of the larger one too).
  const int64_t kMaxElements = int64_t(1) << 32;
  if (m * k * l > kMaxElements || n * k * l > kMaxElements ||
      m * n * l > kMaxElements) {
    std::fprintf(stderr, "an operand over 2^32 elements: make it smaller\n");
    return 2;
  }
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::fprintf(stderr, "no CUDA device here\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  char bus[32] = {};
  CK(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
  muond::bench::PowerSampler power(bus);

  Element *a = nullptr, *b = nullptr, *d = nullptr;
  CK(cudaMalloc(&a, size_t(m * k * l) * sizeof(Element)));
  CK(cudaMalloc(&b, size_t(n * k * l) * sizeof(Element)));
  CK(cudaMalloc(&d, size_t(m * n * l) * sizeof(Element)));
  {  // Random operands: constant ones draw less power than a real product.
    std::vector<Element> h(size_t(std::max(m, n) * k * l));
    uint64_t x = 88172645463325252ull;
    for (auto& e : h) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      e = Element(float(int(x % 2001) - 1000) / 1000.f);
    }
    CK(cudaMemcpy(a, h.data(), size_t(m * k * l) * sizeof(Element),
                  cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, h.data(), size_t(n * k * l) * sizeof(Element),
                  cudaMemcpyHostToDevice));
  }
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) return 1;
  const int sms = prop.multiProcessorCount;

  std::vector<Column> cols;
  auto add = [&](const char* name, std::function<void(cudaStream_t)> f) {
    if (f) cols.push_back({name, std::move(f)});
    else std::printf("(%s: CUTLASS refused the problem)\n", name);
  };
  add("cuBLAS", [&](cudaStream_t s) {
    const float one = 1.f, zero = 0.f;
    cublasSetStream(cublas, s);
    // Row-major D (m x n) = A B^T is column-major D^T = B A^T.
    cublasGemmStridedBatchedEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m),
                               int(k), &one, b, CUDA_R_16BF, int(k), n * k, a,
                               CUDA_R_16BF, int(k), m * k, &zero, d,
                               CUDA_R_16BF, int(n), m * n, int(l),
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
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
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto run = [&](Column& c) {
    for (int64_t i = 0; i < std::min<int64_t>(iters, 50); ++i) c.launch(s);
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
    c.mj += (mj0 >= 0 && mj1 >= 0) ? (mj1 - mj0) / iters : 0;
    ++c.runs;
  };
  for (auto& c : cols) run(c);
  for (auto it = cols.rbegin(); it != cols.rend(); ++it) run(*it);
  CK(cudaGetLastError());

  const double flops = 2.0 * m * n * k * l;
  const Column& ref = cols.front();
  std::printf("%s, %d SMs; M %lld N %lld K %lld batch %lld, %lld launches a "
              "run, two runs a column\n\n",
              prop.name, sms, (long long)m, (long long)n, (long long)k,
              (long long)l, (long long)iters);
  std::printf("| kernel | ms | TFLOP/s | mJ a launch | W | ms ÷ cuBLAS | "
              "mJ ÷ cuBLAS |\n|---|---|---|---|---|---|---|\n");
  for (const Column& c : cols) {
    const double ms = c.ms / c.runs, mj = c.mj / c.runs;
    const double ref_ms = ref.ms / ref.runs, ref_mj = ref.mj / ref.runs;
    std::printf("| %s | %.4f | %.0f | %.1f | %.0f | %.3f | %.3f |\n",
                c.name.c_str(), ms, flops / ms / 1e9, mj, mj / ms,
                ms / ref_ms, ref_mj > 0 ? mj / ref_mj : 0.0);
  }
  return 0;
}
