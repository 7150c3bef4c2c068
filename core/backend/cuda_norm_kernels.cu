// The deterministic two-pass Frobenius normalisation of a batch of slices
// (FrobeniusNormalize): fp64 partial sums in a fixed order, then every block
// divides by the same norm; strided, or 8 elements per access on contiguous
// aligned slices.
#include <cstdint>
#include <type_traits>

#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"

namespace muond {
namespace cuda_kernels {
namespace {

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

// grid (nb, batch): partials[slice * nb + block]; block b sums rows
// b, b + nb, ... of its slice (fixed order: deterministic for a shape).
__global__ void NormPartialsKernel(DView src, int64_t rows_per_slice,
                                   double* partials) {
  __shared__ double shared[kThreads];
  const int64_t slice = blockIdx.y;
  double sum = 0.0;
  for (int64_t r = blockIdx.x; r < rows_per_slice; r += gridDim.x) {
    const int64_t i = slice * rows_per_slice + r;
    for (int64_t j = threadIdx.x; j < src.cols; j += kThreads) {
      const double x = Ld(src, i, j);
      sum += x * x;
    }
  }
  const double total = BlockSum(sum, shared);
  if (threadIdx.x == 0) partials[slice * gridDim.x + blockIdx.x] = total;
}

// max(||slice||_F, eps): the slice's nb partial sums of squares reduced in
// the same fixed order by every block (so every block divides by the same
// value), the norm rounded to fp32.
__device__ float SliceDenominator(const double* partials, int64_t slice, int nb,
                                  float eps) {
  __shared__ double shared[kThreads];
  double part = 0.0;
  for (int t = threadIdx.x; t < nb; t += kThreads)
    part += partials[slice * nb + t];
  const double total = BlockSum(part, shared);
  const float norm = static_cast<float>(sqrt(total));
  return norm > eps ? norm : eps;
}

// grid (blocks, batch): every block reduces its slice's nb partials in the
// same order, then divides its rows of the slice.
__global__ void NormScaleKernel(DView src, DView dst, int64_t rows_per_slice,
                                const double* partials, int nb, float eps) {
  const int64_t slice = blockIdx.y;
  const float denom = SliceDenominator(partials, slice, nb, eps);
  for (int64_t r = blockIdx.x; r < rows_per_slice; r += gridDim.x) {
    const int64_t i = slice * rows_per_slice + r;
    for (int64_t j = threadIdx.x; j < src.cols; j += kThreads)
      St(dst, i, j, __fdiv_rn(Ld(src, i, j), denom));
  }
}

// ---- Frobenius normalisation of contiguous slices, 8 elements per access --
// The slices of a contiguous, 16-byte aligned src/dst whose slice size is a
// multiple of 8 (the NS input of the step engine: a slab of same-shape
// matrices) are read and written 16 bytes per thread (8 bf16, or 2 x 4 fp32)
// instead of one element: the element-wise kernels above reach about half of
// HBM bandwidth on 2-byte elements. Same fp64 sum of squares and the same
// per-element division; the summation order differs from the strided
// kernels (fixed for a shape, so still deterministic).
// Element formats of the 8-wide path: kFmt 0 fp32, 1 bf16, 2 fp16 (DType's
// values).
__host__ __device__ constexpr int FmtBytes(int fmt) { return fmt == 0 ? 4 : 2; }
template <int kFmt>
__device__ __forceinline__ void Load8(const char* p, int64_t g, float (&x)[8]) {
  if constexpr (kFmt == 0) {
    const float4 a = reinterpret_cast<const float4*>(p)[2 * g];
    const float4 b = reinterpret_cast<const float4*>(p)[2 * g + 1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 h = reinterpret_cast<const uint4*>(p)[g];
    const uint32_t w[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[2 * k] = HalfBitsToFloat<kFmt == 2>(uint16_t(w[k] & 0xffffu));
      x[2 * k + 1] = HalfBitsToFloat<kFmt == 2>(uint16_t(w[k] >> 16));
    }
  }
}
template <int kFmt>
__device__ __forceinline__ void Store8(char* p, int64_t g,
                                       const float (&x)[8]) {
  if constexpr (kFmt == 0) {
    reinterpret_cast<float4*>(p)[2 * g] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[2 * g + 1] =
        make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = FloatToHalfBits<kFmt == 2>(x[2 * k]) |
             (FloatToHalfBits<kFmt == 2>(x[2 * k + 1]) << 16);
    }
    reinterpret_cast<uint4*>(p)[g] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// grid (nb, batch): partials[slice * nb + block]; groups of 8 elements
// strided over the slice's blocks and threads (fixed order).
template <int kFmt>
__global__ void NormPartialsVecKernel(const char* src, int64_t groups,
                                      double* partials) {
  __shared__ double shared[kThreads];
  const char* s = src + int64_t(blockIdx.y) * groups * 8 * FmtBytes(kFmt);
  double sum = 0.0;
  const int64_t step = int64_t(gridDim.x) * kThreads;
#pragma unroll 2
  for (int64_t g = blockIdx.x * int64_t(kThreads) + threadIdx.x; g < groups;
       g += step) {
    float x[8];
    Load8<kFmt>(s, g, x);
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += double(x[k]) * double(x[k]);
  }
  const double total = BlockSum(sum, shared);
  if (threadIdx.x == 0) partials[blockIdx.y * gridDim.x + blockIdx.x] = total;
}

// grid (blocks, batch): every block reduces its slice's nb partials in the
// same order as NormScaleKernel, then divides its groups of the slice.
template <int kSrcFmt, int kDstFmt>
__global__ void NormScaleVecKernel(const char* src, char* dst, int64_t groups,
                                   const double* partials, int nb, float eps) {
  const int64_t slice = blockIdx.y;
  const float denom = SliceDenominator(partials, slice, nb, eps);
  const char* s = src + slice * groups * 8 * FmtBytes(kSrcFmt);
  char* d = dst + slice * groups * 8 * FmtBytes(kDstFmt);
  const int64_t step = int64_t(gridDim.x) * kThreads;
  for (int64_t g = blockIdx.x * int64_t(kThreads) + threadIdx.x; g < groups;
       g += step) {
    float x[8];
    Load8<kSrcFmt>(s, g, x);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = __fdiv_rn(x[k], denom);
    Store8<kDstFmt>(d, g, x);
  }
}

}  // namespace

int NormBlocksPerSlice(int64_t rows_per_slice, int64_t cols, int64_t batch) {
  int64_t nb = kNormPartials / batch;
  if (nb > 1024) nb = 1024;
  if (nb > rows_per_slice) nb = rows_per_slice;
  // At least ~8K elements per block.
  const int64_t by_size = (rows_per_slice * cols + 8191) / 8192;
  if (nb > by_size) nb = by_size;
  return nb < 1 ? 1 : int(nb);
}

// A view's element format for the 8-wide path (FmtBytes).
int Fmt(const KView& v) { return v.elem == 4 ? 0 : v.f16 ? 2 : 1; }

// The 16-byte path of FrobeniusNormalize applies: both views contiguous and
// 16-byte aligned, and every slice a whole number of 8-element groups.
bool NormVecOk(const KView& src, const KView& dst, int64_t slice_elems) {
  for (const KView* v : {&src, &dst}) {
    if (v->rows > 1 && v->ld != v->cols) return false;
    if (reinterpret_cast<uintptr_t>(v->data) % 16 != 0) return false;
  }
  return slice_elems % 8 == 0;
}

template <int kSrcFmt, int kDstFmt>
cudaError_t LaunchNormVec(const KView& src, const KView& dst, int64_t batch,
                          int64_t groups, int nb, float eps, double* partials,
                          cudaStream_t stream) {
  NormPartialsVecKernel<kSrcFmt>
      <<<dim3(unsigned(nb), unsigned(batch)), kThreads, 0, stream>>>(
          static_cast<const char*>(src.data), groups, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  int64_t blocks = (groups + kThreads - 1) / kThreads;
  if (blocks * batch > 65536) blocks = (65536 + batch - 1) / batch;
  if (blocks < 1) blocks = 1;
  NormScaleVecKernel<kSrcFmt, kDstFmt>
      <<<dim3(unsigned(blocks), unsigned(batch)), kThreads, 0, stream>>>(
          static_cast<const char*>(src.data), static_cast<char*>(dst.data),
          groups, partials, nb, eps);
  return cudaGetLastError();
}

cudaError_t FrobeniusNormalize(const KView& src, const KView& dst,
                               int64_t batch, float eps, double* partials,
                               cudaStream_t stream) {
  if (src.rows * src.cols == 0) return cudaSuccess;
  const int64_t r = src.rows / batch;
  const int nb = NormBlocksPerSlice(r, src.cols, batch);
  if (NormVecOk(src, dst, r * src.cols)) {
    const int64_t groups = r * src.cols / 8;
    auto launch = [&](auto src_fmt, auto dst_fmt) {
      return LaunchNormVec<decltype(src_fmt)::value, decltype(dst_fmt)::value>(
          src, dst, batch, groups, nb, eps, partials, stream);
    };
    using F32 = std::integral_constant<int, 0>;
    using Bf16 = std::integral_constant<int, 1>;
    using F16 = std::integral_constant<int, 2>;
    auto with_dst = [&](auto src_fmt) {
      switch (Fmt(dst)) {
        case 0:
          return launch(src_fmt, F32{});
        case 1:
          return launch(src_fmt, Bf16{});
        default:
          return launch(src_fmt, F16{});
      }
    };
    switch (Fmt(src)) {
      case 0:
        return with_dst(F32{});
      case 1:
        return with_dst(Bf16{});
      default:
        return with_dst(F16{});
    }
  }
  NormPartialsKernel<<<dim3(unsigned(nb), unsigned(batch)), kThreads, 0,
                       stream>>>(D(src), r, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  int64_t blocks = (r * src.cols + 4 * kThreads - 1) / (4 * kThreads);
  if (blocks > r) blocks = r;
  if (blocks * batch > 65536) blocks = (65536 + batch - 1) / batch;
  if (blocks < 1) blocks = 1;
  NormScaleKernel<<<dim3(unsigned(blocks), unsigned(batch)), kThreads, 0,
                    stream>>>(D(src), D(dst), r, partials, nb, eps);
  return cudaGetLastError();
}

}  // namespace cuda_kernels
}  // namespace muond
