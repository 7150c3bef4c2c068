// The kernels of the Muon variants (core/muon/muon_variant.h): NorMuon's
// per-row sums of squares and row scaling, AdaMuon's elementwise second
// moment. Elementwise formulas: core/backend/elementwise_math.h.
#include <cstdint>

#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"

namespace muond {
namespace cuda_kernels {
namespace {

// One block per row (grid-strided): fp64 partial sums per thread, then the
// fixed tree of BlockSum, so a row's sum does not depend on the launch.
__global__ void RowSumSquaresKernel(DView x, DView sums) {
  __shared__ double shared[kThreads];
  for (int64_t i = blockIdx.x; i < x.rows; i += gridDim.x) {
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j < x.cols; j += kThreads) {
      const double v = Ld(x, i, j);
      sum += v * v;
    }
    shared[threadIdx.x] = sum;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
      __syncthreads();
    }
    if (threadIdx.x == 0) St(sums, i, 0, static_cast<float>(shared[0]));
    __syncthreads();
  }
}

struct ScaleRowsOp {
  DView x, factors;
  __device__ void operator()(int64_t i, int64_t j) const {
    St(x, i, j, ew::Mul(Ld(x, i, j), Ld(factors, i, 0)));
  }
};

struct AdaMuonOp {
  DView u, v_in, v_out;
  float one_minus_beta2, eps;
  __device__ void operator()(int64_t i, int64_t j) const {
    const ew::AdaMuonOut o =
        ew::AdaMuonElement(Ld(u, i, j), Ld(v_in, i, j), one_minus_beta2, eps);
    St(v_out, i, j, o.v);
    St(u, i, j, o.u);
  }
};

}  // namespace

cudaError_t RowSumSquares(const KView& x, const KView& sums,
                          cudaStream_t stream) {
  if (x.rows == 0) return cudaSuccess;
  const int64_t blocks = x.rows < 65535 ? x.rows : 65535;
  RowSumSquaresKernel<<<unsigned(blocks), kThreads, 0, stream>>>(D(x), D(sums));
  return cudaGetLastError();
}

cudaError_t ScaleRows(const KView& x, const KView& factors,
                      cudaStream_t stream) {
  return LaunchForEach2D(x.rows, x.cols, stream, ScaleRowsOp{D(x), D(factors)});
}

cudaError_t AdaMuonNormalize(const KView& update, const KView& v_in,
                             const KView& v_out, float one_minus_beta2,
                             float eps, cudaStream_t stream) {
  return LaunchForEach(
      {update, v_in, v_out}, update.rows, update.cols, stream,
      AdaMuonOp{D(update), D(v_in), D(v_out), one_minus_beta2, eps});
}

}  // namespace cuda_kernels
}  // namespace muond
