// muond's CUDA kernels: strided copies with fp32<->bf16 conversion, the
// symmetric mirror, the deterministic two-pass Frobenius normalisation and
// the elementwise Muon/AdamW steps. Elementwise math comes from
// elementwise_math.h (no FMA contraction: bit-identical to the CPU backend).
#include "core/backend/bf16.h"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"

namespace muond {
namespace cuda_kernels {
namespace {

constexpr int kThreads = 256;

// The parts of a MatrixView a kernel needs, passed by value.
struct DView {
  char* data;
  int64_t rows, cols, ld;
  int elem;  // bytes per element: 4 fp32, 2 bf16
};

DView D(const KView& v) {
  return DView{static_cast<char*>(v.data), v.rows, v.cols, v.ld, v.elem};
}

__device__ __forceinline__ float Ld(const DView& v, int64_t i, int64_t j) {
  const char* p = v.data + (i * v.ld + j) * v.elem;
  if (v.elem == 4) return *reinterpret_cast<const float*>(p);
  return Bf16BitsToFloat(*reinterpret_cast<const uint16_t*>(p));
}

__device__ __forceinline__ void St(const DView& v, int64_t i, int64_t j,
                                   float x) {
  char* p = v.data + (i * v.ld + j) * v.elem;
  if (v.elem == 4) {
    *reinterpret_cast<float*>(p) = x;
  } else {
    *reinterpret_cast<uint16_t*>(p) = FloatToBf16Bits(x);
  }
}

int GridFor(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  if (blocks > 65535 * 4) blocks = 65535 * 4;
  return blocks < 1 ? 1 : static_cast<int>(blocks);
}

// Calls f(i, j) for every element of a rows x cols shape (grid-stride).
template <typename F>
__global__ void ForEachKernel(int64_t rows, int64_t cols, F f) {
  const int64_t n = rows * cols;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / cols;
    f(i, idx - i * cols);
  }
}

template <typename F>
cudaError_t LaunchForEach(int64_t rows, int64_t cols, cudaStream_t stream,
                          F f) {
  if (rows * cols == 0) return cudaSuccess;
  ForEachKernel<<<GridFor(rows * cols), kThreads, 0, stream>>>(rows, cols, f);
  return cudaGetLastError();
}

struct CopyOp {
  DView dst, src;
  __device__ void operator()(int64_t i, int64_t j) const {
    St(dst, i, j, Ld(src, i, j));
  }
};

struct SymOp {
  DView a;
  int64_t stride_bytes;
  __device__ void operator()(int64_t idx_slice_row, int64_t j) const {
    const int64_t s = idx_slice_row / a.cols, i = idx_slice_row % a.cols;
    if (j <= i) return;
    char* base = a.data + s * stride_bytes;
    char* dst = base + (i * a.ld + j) * a.elem;
    const char* src = base + (j * a.ld + i) * a.elem;
    if (a.elem == 4) {
      *reinterpret_cast<float*>(dst) = *reinterpret_cast<const float*>(src);
    } else {
      *reinterpret_cast<uint16_t*>(dst) =
          *reinterpret_cast<const uint16_t*>(src);
    }
  }
};

// Block-wide sum in shared memory, fixed tree order (deterministic).
__device__ double BlockSum(double x, double* shared) {
  shared[threadIdx.x] = x;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

// grid (kNormBlocks, batch): partials[slice * kNormBlocks + block].
__global__ void NormPartialsKernel(DView src, int64_t rows_per_slice,
                                   double* partials) {
  __shared__ double shared[kThreads];
  const int64_t slice = blockIdx.y;
  const int64_t n = rows_per_slice * src.cols;
  double sum = 0.0;
  for (int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x; idx < n;
       idx += int64_t(kNormBlocks) * kThreads) {
    const int64_t i = idx / src.cols;
    const double x = Ld(src, slice * rows_per_slice + i, idx - i * src.cols);
    sum += x * x;
  }
  const double total = BlockSum(sum, shared);
  if (threadIdx.x == 0) partials[slice * kNormBlocks + blockIdx.x] = total;
}

// grid (blocks, batch): every block reduces its slice's partials in the same
// order, then divides its share of the slice.
__global__ void NormScaleKernel(DView src, DView dst, int64_t rows_per_slice,
                                const double* partials, float eps) {
  __shared__ double shared[kThreads];
  const int64_t slice = blockIdx.y;
  const double part = threadIdx.x < kNormBlocks
                          ? partials[slice * kNormBlocks + threadIdx.x]
                          : 0.0;
  const double total = BlockSum(part, shared);
  const float norm = static_cast<float>(sqrt(total));
  const float denom = norm > eps ? norm : eps;
  const int64_t n = rows_per_slice * src.cols;
  for (int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * kThreads) {
    const int64_t i = slice * rows_per_slice + idx / src.cols;
    const int64_t j = idx % src.cols;
    St(dst, i, j, __fdiv_rn(Ld(src, i, j), denom));
  }
}

struct MomentumOp {
  DView grad, mom, out;
  float w_ema, w_nesterov;
  bool nesterov;
  __device__ void operator()(int64_t i, int64_t j) const {
    const float g = Ld(grad, i, j);
    St(mom, i, j, ew::MomentumEma(Ld(mom, i, j), g, w_ema));
    const float m = Ld(mom, i, j);
    St(out, i, j, nesterov ? ew::NesterovInput(g, m, w_nesterov) : m);
  }
};

struct ScaleOp {
  DView x;
  float scale, extra;
  __device__ void operator()(int64_t i, int64_t j) const {
    St(x, i, j, ew::Scale2(Ld(x, i, j), scale, extra));
  }
};

struct UpdateOp {
  DView p, u;
  float lr, decay;
  int method;
  __device__ void operator()(int64_t i, int64_t j) const {
    St(p, i, j, ew::UpdateParam(Ld(p, i, j), Ld(u, i, j), lr, decay, method));
  }
};

struct AdamWOp {
  DView p, g, m, v;
  float param_decay, omb1, beta2, omb2, step_size, bc2, eps;
  __device__ void operator()(int64_t i, int64_t j) const {
    const ew::AdamWOut o =
        ew::AdamWElement(Ld(p, i, j), Ld(g, i, j), Ld(m, i, j), Ld(v, i, j),
                         param_decay, omb1, beta2, omb2, step_size, bc2, eps);
    St(p, i, j, o.p);
    St(m, i, j, o.m);
    St(v, i, j, o.v);
  }
};

struct FiniteOp {
  DView v;
  int* flag;
  __device__ void operator()(int64_t i, int64_t j) const {
    if (!isfinite(Ld(v, i, j))) *flag = 1;
  }
};

}  // namespace

cudaError_t Copy2DConvert(const KView& dst, const KView& src,
                          cudaStream_t stream) {
  return LaunchForEach(src.rows, src.cols, stream, CopyOp{D(dst), D(src)});
}

cudaError_t SymmetrizeFromLower(const KView& a, int64_t stride, int64_t batch,
                                cudaStream_t stream) {
  const DView d = D(a);
  return LaunchForEach(batch * a.rows, a.cols, stream,
                       SymOp{d, stride * d.elem});
}

cudaError_t FrobeniusNormalize(const KView& src, const KView& dst,
                               int64_t batch, float eps, double* partials,
                               cudaStream_t stream) {
  if (src.rows * src.cols == 0) return cudaSuccess;
  const int64_t r = src.rows / batch;
  NormPartialsKernel<<<dim3(kNormBlocks, unsigned(batch)), kThreads, 0,
                       stream>>>(D(src), r, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  int64_t blocks = (r * src.cols + kThreads - 1) / kThreads;
  if (blocks > 1024) blocks = 1024;
  NormScaleKernel<<<dim3(unsigned(blocks), unsigned(batch)), kThreads, 0,
                    stream>>>(D(src), D(dst), r, partials, eps);
  return cudaGetLastError();
}

cudaError_t MuonMomentum(const KView& grad, const KView& momentum,
                         float one_minus_beta, float beta, bool nesterov,
                         const KView& out, cudaStream_t stream) {
  return LaunchForEach(
      grad.rows, grad.cols, stream,
      MomentumOp{D(grad), D(momentum), D(out), one_minus_beta, beta, nesterov});
}

cudaError_t ScaleInPlace(const KView& x, float scale, float extra,
                         cudaStream_t stream) {
  return LaunchForEach(x.rows, x.cols, stream, ScaleOp{D(x), scale, extra});
}

cudaError_t ApplyUpdate(const KView& param, const KView& update, float lr,
                        float decay, int method, cudaStream_t stream) {
  return LaunchForEach(param.rows, param.cols, stream,
                       UpdateOp{D(param), D(update), lr, decay, method});
}

cudaError_t AdamW(const KView& param, const KView& grad, const KView& exp_avg,
                  const KView& exp_avg_sq, float param_decay,
                  float one_minus_beta1, float beta2, float one_minus_beta2,
                  float step_size, float bc2_sqrt, float eps,
                  cudaStream_t stream) {
  return LaunchForEach(param.rows, param.cols, stream,
                       AdamWOp{D(param), D(grad), D(exp_avg), D(exp_avg_sq),
                               param_decay, one_minus_beta1, beta2,
                               one_minus_beta2, step_size, bc2_sqrt, eps});
}

cudaError_t MarkNonFinite(const KView& v, int* flag, cudaStream_t stream) {
  return LaunchForEach(v.rows, v.cols, stream, FiniteOp{D(v), flag});
}

}  // namespace cuda_kernels
}  // namespace muond
