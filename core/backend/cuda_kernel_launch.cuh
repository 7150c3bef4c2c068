#pragma once
// What every family of muond's CUDA kernels (cuda_*_kernels.cu) shares: the
// view a kernel sees (DView), element loads and stores with fp32/bf16/fp16
// conversion, and the elementwise launchers (ForEach over a 2-D shape, the
// flat ILP path for contiguous load-store ops). Included by .cu files only;
// everything is internal to each including file.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "core/backend/bf16.h"
#include "core/backend/cuda_kernels.h"
#include "core/backend/fp16.h"

namespace muond {
namespace cuda_kernels {
namespace {

constexpr int kThreads = 256;
// Blocks of a grid-stride flat kernel: 16 per SM of a 132-SM H100/H200, the
// rest of the elements taken by the stride.
constexpr int64_t kMaxFlatBlocks = 132 * 16;

// The last k < count with start[k] <= b: which table entry CUDA block b
// works on, when entry k's blocks start at start[k] (ascending).
__device__ __forceinline__ int EntryOfBlock(const int* start, int count,
                                            int b) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The parts of a MatrixView a kernel needs, passed by value.
struct DView {
  char* data;
  int64_t rows, cols, ld;
  int elem;  // bytes per element: 4 fp32, 2 bf16 or fp16
  bool f16;  // 2-byte elements are fp16
};

DView D(const KView& v) {
  return DView{static_cast<char*>(v.data), v.rows, v.cols, v.ld, v.elem, v.f16};
}

// fp32 -> fp16 rounds to nearest even (__float2half_rn, one cvt.rn: the
// rounding of the CPU backend's core/backend/fp16.h), a NaN becoming fp16.h's
// quiet NaN with its sign, so both backends store the same bits; fp16 ->
// fp32 is exact (fp16.h's decoder).
__device__ __forceinline__ float F16BitsToFloat(uint16_t h) {
  return Fp16BitsToFloat(h);
}
__device__ __forceinline__ uint16_t FloatToF16Bits(float x) {
  if (x != x) return uint16_t(((__float_as_uint(x) >> 16) & 0x8000u) | 0x7e00u);
  return __half_as_ushort(__float2half_rn(x));
}

// A 2-byte element's bits (fp16 with kF16, else bf16) widened exactly, and
// fp32 rounded once to them: the one codec of every 2-byte load and store.
template <bool kF16>
__device__ __forceinline__ float HalfBitsToFloat(uint32_t bits) {
  return kF16 ? F16BitsToFloat(uint16_t(bits))
              : Bf16BitsToFloat(uint16_t(bits));
}
template <bool kF16>
__device__ __forceinline__ uint32_t FloatToHalfBits(float x) {
  return kF16 ? FloatToF16Bits(x) : FloatToBf16Bits(x);
}

// One element at p of a type known at compile time (kElem bytes: 4 fp32,
// 2 bf16 or, with kF16, fp16), decoded to or encoded from fp32. Ld / St
// pick one by the view's runtime type.
template <int kElem, bool kF16>
__device__ __forceinline__ float LdElem(const char* p) {
  if constexpr (kElem == 4) {
    return *reinterpret_cast<const float*>(p);
  } else {
    return HalfBitsToFloat<kF16>(*reinterpret_cast<const uint16_t*>(p));
  }
}
template <int kElem, bool kF16>
__device__ __forceinline__ void StElem(char* p, float x) {
  if constexpr (kElem == 4) {
    *reinterpret_cast<float*>(p) = x;
  } else {
    *reinterpret_cast<uint16_t*>(p) = uint16_t(FloatToHalfBits<kF16>(x));
  }
}

// Four consecutive elements: element e of a float4, and elements j..j+3 of
// a 16-byte (fp32) or 8-byte (2-byte elements) aligned array, decoded and
// encoded as LdElem / StElem do each.
__device__ __forceinline__ float& At(float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}
// Elements j..j+3 of a vec4 view of kElem-byte elements (fp32, or bf16 or
// with kF16 fp16, widened exactly).
template <int kElem, bool kF16 = false>
__device__ __forceinline__ float4 Ld4(const char* p, int64_t j) {
  if constexpr (kElem == 4) {
    return *reinterpret_cast<const float4*>(p + j * 4);
  } else {
    const uint2 h = *reinterpret_cast<const uint2*>(p + j * 2);
    return make_float4(
        HalfBitsToFloat<kF16>(h.x & 0xffffu), HalfBitsToFloat<kF16>(h.x >> 16),
        HalfBitsToFloat<kF16>(h.y & 0xffffu), HalfBitsToFloat<kF16>(h.y >> 16));
  }
}
// Stores 4 elements from j, each rounded once to bf16 (or with kF16 fp16)
// for a 2-byte view.
template <int kElem, bool kF16 = false>
__device__ __forceinline__ void St4(char* p, int64_t j, float4 x) {
  if constexpr (kElem == 4) {
    *reinterpret_cast<float4*>(p + j * 4) = x;
  } else {
    uint2 h;
    h.x = FloatToHalfBits<kF16>(x.x) | (FloatToHalfBits<kF16>(x.y) << 16);
    h.y = FloatToHalfBits<kF16>(x.z) | (FloatToHalfBits<kF16>(x.w) << 16);
    *reinterpret_cast<uint2*>(p + j * 2) = h;
  }
}

__device__ __forceinline__ float Ld(const DView& v, int64_t i, int64_t j) {
  const char* p = v.data + (i * v.ld + j) * v.elem;
  if (v.elem == 4) return LdElem<4, false>(p);
  return v.f16 ? LdElem<2, true>(p) : LdElem<2, false>(p);
}

__device__ __forceinline__ void St(const DView& v, int64_t i, int64_t j,
                                   float x) {
  char* p = v.data + (i * v.ld + j) * v.elem;
  if (v.elem == 4) {
    StElem<4, false>(p, x);
  } else if (v.f16) {
    StElem<2, true>(p, x);
  } else {
    StElem<2, false>(p, x);
  }
}

// Calls f(i, j) for every element of a rows x cols shape: block rows
// grid-stride over i, threads over j. No integer division per element.
template <typename F>
__global__ void ForEachKernel(int64_t rows, int64_t cols, F f) {
  const int64_t jstep = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.y; i < rows; i += gridDim.y) {
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < cols;
         j += jstep) {
      f(i, j);
    }
  }
}

template <typename F>
cudaError_t LaunchForEach2D(int64_t rows, int64_t cols, cudaStream_t stream,
                            F f) {
  if (rows * cols == 0) return cudaSuccess;
  int64_t bx = (cols + kThreads - 1) / kThreads, by = rows;
  if (by > 65535) by = 65535;
  if (bx > 4096) bx = 4096;
  if (by * bx > 262144) bx = (262144 + by - 1) / by;
  ForEachKernel<<<dim3(unsigned(bx), unsigned(by)), kThreads, 0, stream>>>(
      rows, cols, f);
  return cudaGetLastError();
}

bool Flat(std::initializer_list<KView> views) {
  for (const KView& v : views)
    if (v.rows > 1 && v.ld != v.cols) return false;
  return true;
}

// Elementwise over same-shape views: when every view is contiguous the shape
// is walked as one row (i = 0, j = flat index), else row by row.
template <typename F>
cudaError_t LaunchForEach(std::initializer_list<KView> views, int64_t rows,
                          int64_t cols, cudaStream_t stream, F f) {
  if (Flat(views)) return LaunchForEach2D(1, rows * cols, stream, f);
  return LaunchForEach2D(rows, cols, stream, f);
}

// Contiguous views walked as one flat array, kIlp elements per thread per
// iteration with all loads issued before any store: a load-store op (one
// with In Load(j) and Store(j, In)) keeps kIlp independent loads in flight
// per thread, which the one-element loop cannot (the char* views may alias,
// so the compiler may not hoist a later load above an earlier store). The
// per-element math is unchanged, so results are bitwise those of
// ForEachKernel.
constexpr int kIlp = 4;
template <typename F>
__global__ void ForEachFlatIlpKernel(int64_t n, F f) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t base = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; base < n;
       base += stride * kIlp) {
    typename F::In in[kIlp];
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t j = base + k * stride;
      if (j < n) in[k] = f.Load(j);
    }
#pragma unroll
    for (int k = 0; k < kIlp; ++k) {
      const int64_t j = base + k * stride;
      if (j < n) f.Store(j, in[k]);
    }
  }
}

// Runs a load-store op: the flat ILP kernel when every view is contiguous,
// else ForEach2D with op(i, j) (F also has operator()(i, j)).
template <typename F>
cudaError_t LaunchLoadStore(std::initializer_list<KView> views, int64_t rows,
                            int64_t cols, cudaStream_t stream, F f) {
  if (!Flat(views)) return LaunchForEach2D(rows, cols, stream, f);
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  int64_t blocks = (n + int64_t(kThreads) * kIlp - 1) / (kThreads * kIlp);
  if (blocks > kMaxFlatBlocks) blocks = kMaxFlatBlocks;
  ForEachFlatIlpKernel<<<unsigned(blocks), kThreads, 0, stream>>>(n, f);
  return cudaGetLastError();
}

// !(|x| < limit): NaN, +-Inf, or at/beyond the limit.
__device__ __forceinline__ bool OutOfRange(float x, float limit) {
  return !(fabsf(x) < limit);
}

// GradCheck on one loaded grad element. Threads that find one store the
// same 1 (no atomic needed); nothing is stored while every grad is in range.
__device__ __forceinline__ void MarkOutOfRange(const GradCheck& check,
                                               float g) {
  if (check.flag != nullptr && OutOfRange(g, check.limit)) *check.flag = 1;
}

}  // namespace

}  // namespace cuda_kernels
}  // namespace muond
