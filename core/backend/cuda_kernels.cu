// muond's CUDA kernels: strided copies with fp32/bf16/fp16 conversion, the
// symmetric mirror, the deterministic two-pass Frobenius normalisation and
// the elementwise Muon/AdamW steps. Elementwise math comes from
// elementwise_math.h (no FMA contraction: bit-identical to the CPU backend).
#include <cuda_fp16.h>

#include <initializer_list>
#include <type_traits>

#include "core/backend/bf16.h"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"
#include "core/backend/fp16.h"

namespace muond {
namespace cuda_kernels {
namespace {

constexpr int kThreads = 256;

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

__device__ __forceinline__ float Ld(const DView& v, int64_t i, int64_t j) {
  const char* p = v.data + (i * v.ld + j) * v.elem;
  if (v.elem == 4) return *reinterpret_cast<const float*>(p);
  const uint16_t h = *reinterpret_cast<const uint16_t*>(p);
  return v.f16 ? F16BitsToFloat(h) : Bf16BitsToFloat(h);
}

__device__ __forceinline__ void St(const DView& v, int64_t i, int64_t j,
                                   float x) {
  char* p = v.data + (i * v.ld + j) * v.elem;
  if (v.elem == 4) {
    *reinterpret_cast<float*>(p) = x;
  } else {
    *reinterpret_cast<uint16_t*>(p) =
        v.f16 ? FloatToF16Bits(x) : FloatToBf16Bits(x);
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
  if (blocks > 132 * 16) blocks = 132 * 16;
  ForEachFlatIlpKernel<<<unsigned(blocks), kThreads, 0, stream>>>(n, f);
  return cudaGetLastError();
}

struct CopyOp {
  DView dst, src;
  using In = float;
  __device__ In Load(int64_t j) const { return Ld(src, 0, j); }
  __device__ void Store(int64_t j, In v) const { St(dst, 0, j, v); }
  __device__ void operator()(int64_t i, int64_t j) const {
    St(dst, i, j, Ld(src, i, j));
  }
};

// upper[i][j] = lower[j][i] for i < j, tile by tile through shared memory
// (coalesced reads and writes). grid (tiles, tiles, batch), block 32 x 8.
constexpr int kTile = 32;
__global__ void SymmetrizeKernel(DView a, int64_t stride_bytes) {
  const int bi = blockIdx.y, bj = blockIdx.x;  // destination tile (upper)
  if (bi > bj) return;
  __shared__ uint32_t tile[kTile][kTile + 1];
  char* base = a.data + int64_t(blockIdx.z) * stride_bytes;
  const int64_t n = a.cols;
  // Source tile: rows bj*32.., cols bi*32.. (lower part).
  for (int r = threadIdx.y; r < kTile; r += blockDim.y) {
    const int64_t i = int64_t(bj) * kTile + r,
                  j = int64_t(bi) * kTile + threadIdx.x;
    if (i < n && j < n) {
      const char* p = base + (i * a.ld + j) * a.elem;
      tile[r][threadIdx.x] =
          a.elem == 4 ? *reinterpret_cast<const uint32_t*>(p)
                      : uint32_t(*reinterpret_cast<const uint16_t*>(p));
    }
  }
  __syncthreads();
  for (int r = threadIdx.y; r < kTile; r += blockDim.y) {
    const int64_t i = int64_t(bi) * kTile + r,
                  j = int64_t(bj) * kTile + threadIdx.x;
    if (i < n && j < n && j > i) {
      char* p = base + (i * a.ld + j) * a.elem;
      const uint32_t v = tile[threadIdx.x][r];
      if (a.elem == 4) {
        *reinterpret_cast<uint32_t*>(p) = v;
      } else {
        *reinterpret_cast<uint16_t*>(p) = uint16_t(v);
      }
    }
  }
}

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
__device__ __forceinline__ float Half16ToFloat(uint16_t h) {
  if constexpr (kFmt == 2) return F16BitsToFloat(h);
  return Bf16BitsToFloat(h);
}
template <int kFmt>
__device__ __forceinline__ uint32_t FloatToHalf16(float x) {
  if constexpr (kFmt == 2) return FloatToF16Bits(x);
  return FloatToBf16Bits(x);
}
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
      x[2 * k] = Half16ToFloat<kFmt>(uint16_t(w[k] & 0xffffu));
      x[2 * k + 1] = Half16ToFloat<kFmt>(uint16_t(w[k] >> 16));
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
      w[k] = FloatToHalf16<kFmt>(x[2 * k]) |
             (FloatToHalf16<kFmt>(x[2 * k + 1]) << 16);
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

// mom_out may be mom_in (in place): every element is loaded before it is
// stored, by the same thread.
struct MomentumOp {
  DView grad, mom_in, mom_out, out;
  float w_ema, w_nesterov;
  bool nesterov;
  struct In {
    float g, m;
  };
  __device__ In Load(int64_t j) const {
    return In{Ld(grad, 0, j), Ld(mom_in, 0, j)};
  }
  __device__ void Store(int64_t j, In in) const {
    const float m_new = ew::MomentumEma(in.m, in.g, w_ema);
    St(mom_out, 0, j, m_new);
    const float m =
        mom_out.elem == 4 ? m_new : Bf16BitsToFloat(FloatToBf16Bits(m_new));
    St(out, 0, j, nesterov ? ew::NesterovInput(in.g, m, w_nesterov) : m);
  }
  __device__ void operator()(int64_t i, int64_t j) const {
    const float g = Ld(grad, i, j);
    const float m_new = ew::MomentumEma(Ld(mom_in, i, j), g, w_ema);
    St(mom_out, i, j, m_new);
    // The stored value, without reading it back (bf16 state: rounded once).
    const float m =
        mom_out.elem == 4 ? m_new : Bf16BitsToFloat(FloatToBf16Bits(m_new));
    St(out, i, j, nesterov ? ew::NesterovInput(g, m, w_nesterov) : m);
  }
};

struct UpdateOp {
  DView p, u;
  float lr, decay;
  int method;
  struct In {
    float p, u;
  };
  __device__ In Load(int64_t j) const { return In{Ld(p, 0, j), Ld(u, 0, j)}; }
  __device__ void Store(int64_t j, In in) const {
    St(p, 0, j, ew::UpdateParam(in.p, in.u, lr, decay, method));
  }
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

// ---- multi-tensor launches ------------------------------------------------
// Up to kMultiMaxTensors contiguous tensors per launch, passed by value in the
// kernel arguments (< 4 KB). Block b works on tensor k with
// block_start[k] <= b < block_start[k + 1], elements
// [(b - block_start[k]) * kMultiTile, + kMultiTile).
constexpr int kMultiViews = 4;
constexpr int64_t kMultiTile = int64_t(kThreads) * kIlp * 4;
struct MultiTable {
  char* ptr[kMultiViews][kMultiMaxTensors];
  int64_t n[kMultiMaxTensors];
  int block_start[kMultiMaxTensors + 1];
  unsigned char elem[kMultiViews][kMultiMaxTensors];
  // Every view of tensor k is fp32 and 16-byte aligned or bf16 and 8-byte
  // aligned: the kernels move 4 elements per access (float4 / 4 x bf16; the
  // scalar loop reached only 56-74% of HBM bandwidth on an H200,
  // bench/results/gpu_h200.md).
  bool vec4[kMultiMaxTensors];
  float scalar[kMultiMaxTensors];  // a per-tensor operand (the update's lr)
  int count;
  // The dtypes of the table's vec4 tensors, one bit per view (1 = bf16), the
  // same for all of them (RunMulti starts a new table when it changes): the
  // kernel is compiled for it, so the vec4 loads have no dtype branch between
  // them and stay in flight together (a branch per load cost the bf16 update
  // a quarter of its bandwidth). -1: no vec4 tensor yet.
  int vec4_sig;
};

// Bytes per element of view v under a vec4 signature.
__host__ __device__ constexpr int ElemOf(int sig, int v) {
  return (sig >> v) & 1 ? 2 : 4;
}

__device__ __forceinline__ float& At(float4& v, int e) {
  return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}
// Elements j..j+3 of a vec4 view of kElem-byte elements (fp32, or bf16
// widened exactly).
template <int kElem>
__device__ __forceinline__ float4 Ld4(const char* p, int64_t j) {
  if constexpr (kElem == 4) {
    return *reinterpret_cast<const float4*>(p + j * 4);
  } else {
    const uint2 h = *reinterpret_cast<const uint2*>(p + j * 2);
    return make_float4(Bf16BitsToFloat(uint16_t(h.x & 0xffffu)),
                       Bf16BitsToFloat(uint16_t(h.x >> 16)),
                       Bf16BitsToFloat(uint16_t(h.y & 0xffffu)),
                       Bf16BitsToFloat(uint16_t(h.y >> 16)));
  }
}
__device__ __forceinline__ float4 Ld4(const char* p, int elem, int64_t j) {
  return elem == 4 ? Ld4<4>(p, j) : Ld4<2>(p, j);
}
// Stores 4 elements from j, each rounded once to bf16 for a bf16 view.
template <int kElem>
__device__ __forceinline__ void St4(char* p, int64_t j, float4 x) {
  if constexpr (kElem == 4) {
    *reinterpret_cast<float4*>(p + j * 4) = x;
  } else {
    uint2 h;
    h.x =
        uint32_t(FloatToBf16Bits(x.x)) | (uint32_t(FloatToBf16Bits(x.y)) << 16);
    h.y =
        uint32_t(FloatToBf16Bits(x.z)) | (uint32_t(FloatToBf16Bits(x.w)) << 16);
    *reinterpret_cast<uint2*>(p + j * 2) = h;
  }
}

__device__ __forceinline__ float LdFlat(const char* p, int elem, int64_t j) {
  if (elem == 4) return reinterpret_cast<const float*>(p)[j];
  return Bf16BitsToFloat(reinterpret_cast<const uint16_t*>(p)[j]);
}
__device__ __forceinline__ void StFlat(char* p, int elem, int64_t j, float x) {
  if (elem == 4) {
    reinterpret_cast<float*>(p)[j] = x;
  } else {
    reinterpret_cast<uint16_t*>(p)[j] = FloatToBf16Bits(x);
  }
}

__device__ __forceinline__ int MultiTensorOf(const MultiTable& t, int b) {
  int lo = 0, hi = t.count - 1;  // last k with block_start[k] <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.block_start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// A vec4 tensor's tile: each thread moves kIlp runs of 4 consecutive
// elements, the op's first F::kLoads (<= 2) views loaded as float4 before any
// store, dtypes fixed by kSig; a ragged end (n % 4) goes element by element
// through Load/Store.
template <typename F, int kSig>
__device__ void MultiVec4Tile(const MultiTable& t, const F& f, int k,
                              int64_t t0, int64_t end) {
  static_assert(F::kLoads == 2, "two loaded views");
  float4 in[kIlp][F::kLoads];
#pragma unroll
  for (int u = 0; u < kIlp; ++u) {
    const int64_t j = t0 + (int64_t(u) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end) {
      in[u][0] = Ld4<ElemOf(kSig, 0)>(t.ptr[0][k], j);
      in[u][1] = Ld4<ElemOf(kSig, 1)>(t.ptr[1][k], j);
    }
  }
#pragma unroll
  for (int u = 0; u < kIlp; ++u) {
    const int64_t j = t0 + (int64_t(u) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end) {
      f.template Store4<kSig>(t, k, j, in[u]);
    } else {
      for (int64_t e = j; e < end; ++e) f.Store(t, k, e, f.Load(t, k, e));
    }
  }
}

// Load-store op over the table: In Load(t, k, j), Store(t, k, j, In), and
// for vec4 tensors Store4<kSig>(t, k, j, float4[kLoads]) on 4 elements from
// j; kSig is the table's vec4_sig.
template <typename F, int kSig>
__global__ void MultiLoadStoreKernel(MultiTable t, F f) {
  const int k = MultiTensorOf(t, blockIdx.x);
  const int64_t n = t.n[k];
  const int64_t t0 = int64_t(blockIdx.x - t.block_start[k]) * kMultiTile;
  const int64_t end = t0 + kMultiTile < n ? t0 + kMultiTile : n;
  if (t.vec4[k]) {  // kMultiTile = kThreads * kIlp * 4: one pass per tile
    MultiVec4Tile<F, kSig>(t, f, k, t0, end);
    return;
  }
  for (int64_t base = t0 + threadIdx.x; base < end; base += kThreads * kIlp) {
    typename F::In in[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = base + u * kThreads;
      if (j < end) in[u] = f.Load(t, k, j);
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = base + u * kThreads;
      if (j < end) f.Store(t, k, j, in[u]);
    }
  }
}

// !(|x| < limit): NaN, +-Inf, or at/beyond the limit.
__device__ __forceinline__ bool OutOfRange(float x, float limit) {
  return !(fabsf(x) < limit);
}

__global__ void MultiFiniteKernel(MultiTable t, float limit, int* flag) {
  const int k = MultiTensorOf(t, blockIdx.x);
  const int64_t n = t.n[k];
  const int64_t t0 = int64_t(blockIdx.x - t.block_start[k]) * kMultiTile;
  const int64_t end = t0 + kMultiTile < n ? t0 + kMultiTile : n;
  bool bad = false;
  if (t.vec4[k]) {
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = t0 + (int64_t(u) * kThreads + threadIdx.x) * 4;
      if (j + 4 <= end) {
        const float4 x = Ld4(t.ptr[0][k], t.elem[0][k], j);
        bad = bad || OutOfRange(x.x, limit) || OutOfRange(x.y, limit) ||
              OutOfRange(x.z, limit) || OutOfRange(x.w, limit);
      } else {
        for (int64_t e = j; e < end; ++e)
          bad = bad || OutOfRange(LdFlat(t.ptr[0][k], t.elem[0][k], e), limit);
      }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
    return;
  }
  for (int64_t base = t0 + threadIdx.x; base < end; base += kThreads * kIlp) {
    float x[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = base + u * kThreads;
      x[u] = j < end ? LdFlat(t.ptr[0][k], t.elem[0][k], j) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) bad = bad || OutOfRange(x[u], limit);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

// Views: 0 grad, 1 momentum in, 2 NS input, 3 momentum out (may be view 1).
struct MultiMomentumOp {
  static constexpr int kViews = 4;
  float w_ema, w_nesterov;
  bool nesterov;
  struct In {
    float g, m;
  };
  __device__ In Load(const MultiTable& t, int k, int64_t j) const {
    return In{LdFlat(t.ptr[0][k], t.elem[0][k], j),
              LdFlat(t.ptr[1][k], t.elem[1][k], j)};
  }
  __device__ void Store(const MultiTable& t, int k, int64_t j, In in) const {
    const float m_new = ew::MomentumEma(in.m, in.g, w_ema);
    StFlat(t.ptr[3][k], t.elem[3][k], j, m_new);
    const float m =
        t.elem[3][k] == 4 ? m_new : Bf16BitsToFloat(FloatToBf16Bits(m_new));
    StFlat(t.ptr[2][k], t.elem[2][k], j,
           nesterov ? ew::NesterovInput(in.g, m, w_nesterov) : m);
  }
  static constexpr int kLoads = 2;  // grad, momentum in
  template <int kSig>
  __device__ void Store4(const MultiTable& t, int k, int64_t j,
                         float4 (&in)[kLoads]) const {
    constexpr bool bf16_state = ElemOf(kSig, 3) == 2;
    float4 m_new, out;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      At(m_new, e) = ew::MomentumEma(At(in[1], e), At(in[0], e), w_ema);
      // The stored value (bf16 state: rounded once), as in Store.
      const float m = bf16_state
                          ? Bf16BitsToFloat(FloatToBf16Bits(At(m_new, e)))
                          : At(m_new, e);
      At(out, e) =
          nesterov ? ew::NesterovInput(At(in[0], e), m, w_nesterov) : m;
    }
    St4<ElemOf(kSig, 3)>(t.ptr[3][k], j, m_new);
    St4<ElemOf(kSig, 2)>(t.ptr[2][k], j, out);
  }
};

struct MultiUpdateOp {  // lr: t.scalar[k]
  static constexpr int kViews = 2;  // param, update
  float decay;
  int method;
  struct In {
    float p, u;
  };
  __device__ In Load(const MultiTable& t, int k, int64_t j) const {
    return In{LdFlat(t.ptr[0][k], t.elem[0][k], j),
              LdFlat(t.ptr[1][k], t.elem[1][k], j)};
  }
  __device__ void Store(const MultiTable& t, int k, int64_t j, In in) const {
    StFlat(t.ptr[0][k], t.elem[0][k], j,
           ew::UpdateParam(in.p, in.u, t.scalar[k], decay, method));
  }
  static constexpr int kLoads = 2;  // param, update
  template <int kSig>
  __device__ void Store4(const MultiTable& t, int k, int64_t j,
                         float4 (&in)[kLoads]) const {
    const float lr = t.scalar[k];
    float4 p;
#pragma unroll
    for (int e = 0; e < 4; ++e)
      At(p, e) = ew::UpdateParam(At(in[0], e), At(in[1], e), lr, decay, method);
    St4<ElemOf(kSig, 0)>(t.ptr[0][k], j, p);
  }
};

bool Vec4Ok(const KView& v) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(v.data);
  return (v.elem == 4 && a % 16 == 0) || (v.elem == 2 && a % 8 == 0);
}

// Collects tensors into tables and launches `launch(table)` per full table;
// `single(i)` launches tensor i alone (non-contiguous or large). `scalars`
// (may be null) gives each tensor's MultiTable::scalar.
template <typename Launch, typename Single>
cudaError_t RunMulti(const KView* const* views, int nviews, int64_t count,
                     const float* scalars, Launch launch, Single single) {
  MultiTable t;
  t.count = 0;
  t.block_start[0] = 0;
  t.vec4_sig = -1;
  auto flush = [&]() -> cudaError_t {
    if (t.count == 0) return cudaSuccess;
    const cudaError_t err = launch(t);
    t.count = 0;
    t.vec4_sig = -1;
    return err;
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = views[0][i].rows * views[0][i].cols;
    if (n == 0) continue;
    bool flat = n < kMultiMaxElems;
    // The tables' loads know fp32 and bf16 only; fp16 goes alone.
    for (int v = 0; v < nviews && flat; ++v)
      flat = Flat({views[v][i]}) && !views[v][i].f16;
    if (!flat) {
      const cudaError_t err = single(i);
      if (err != cudaSuccess) return err;
      continue;
    }
    bool vec4 = true;
    int sig = 0;
    for (int v = 0; v < nviews; ++v) {
      vec4 = vec4 && Vec4Ok(views[v][i]);
      if (views[v][i].elem == 2) sig |= 1 << v;
    }
    if (vec4 && t.vec4_sig >= 0 && sig != t.vec4_sig) {
      const cudaError_t err = flush();  // one vec4 signature per table
      if (err != cudaSuccess) return err;
    }
    const int k = t.count;
    t.vec4[k] = vec4;
    if (vec4) t.vec4_sig = sig;
    for (int v = 0; v < nviews; ++v) {
      t.ptr[v][k] = static_cast<char*>(views[v][i].data);
      t.elem[v][k] = static_cast<unsigned char>(views[v][i].elem);
    }
    t.scalar[k] = scalars == nullptr ? 0.0f : scalars[i];
    t.n[k] = n;
    t.block_start[k + 1] =
        t.block_start[k] + int((n + kMultiTile - 1) / kMultiTile);
    ++t.count;
    if (t.count == kMultiMaxTensors) {
      const cudaError_t err = flush();
      if (err != cudaSuccess) return err;
    }
  }
  return flush();
}

struct FiniteOp {
  DView v;
  float limit;
  int* flag;
  __device__ void operator()(int64_t i, int64_t j) const {
    if (OutOfRange(Ld(v, i, j), limit)) *flag = 1;
  }
};

}  // namespace

cudaError_t Copy2DConvert(const KView& dst, const KView& src,
                          cudaStream_t stream) {
  return LaunchLoadStore({dst, src}, src.rows, src.cols, stream,
                         CopyOp{D(dst), D(src)});
}

cudaError_t SymmetrizeFromLower(const KView& a, int64_t stride, int64_t batch,
                                cudaStream_t stream) {
  if (a.rows == 0 || batch == 0) return cudaSuccess;
  const unsigned tiles = unsigned((a.cols + kTile - 1) / kTile);
  const DView d = D(a);
  for (int64_t s0 = 0; s0 < batch; s0 += 65535) {
    const int64_t nb = batch - s0 < 65535 ? batch - s0 : 65535;
    DView ds = d;
    ds.data += s0 * stride * d.elem;
    SymmetrizeKernel<<<dim3(tiles, tiles, unsigned(nb)), dim3(kTile, 8), 0,
                       stream>>>(ds, stride * d.elem);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

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

cudaError_t MuonMomentum(const KView& grad, const KView& momentum_in,
                         const KView& momentum_out, float one_minus_beta,
                         float beta, bool nesterov, const KView& out,
                         cudaStream_t stream) {
  return LaunchLoadStore({grad, momentum_in, momentum_out, out}, grad.rows,
                         grad.cols, stream,
                         MomentumOp{D(grad), D(momentum_in), D(momentum_out),
                                    D(out), one_minus_beta, beta, nesterov});
}

cudaError_t ApplyUpdate(const KView& param, const KView& update, float lr,
                        float decay, int method, cudaStream_t stream) {
  return LaunchLoadStore({param, update}, param.rows, param.cols, stream,
                         UpdateOp{D(param), D(update), lr, decay, method});
}

cudaError_t AdamW(const KView& param, const KView& grad, const KView& exp_avg,
                  const KView& exp_avg_sq, float param_decay,
                  float one_minus_beta1, float beta2, float one_minus_beta2,
                  float step_size, float bc2_sqrt, float eps,
                  cudaStream_t stream) {
  return LaunchForEach({param, grad, exp_avg, exp_avg_sq}, param.rows,
                       param.cols, stream,
                       AdamWOp{D(param), D(grad), D(exp_avg), D(exp_avg_sq),
                               param_decay, one_minus_beta1, beta2,
                               one_minus_beta2, step_size, bc2_sqrt, eps});
}

// Launches MultiLoadStoreKernel for a table, compiled for its vec4 dtypes:
// one instantiation per signature of F::kViews views (kSig from 0 up).
template <typename F, int kSig = 0>
cudaError_t LaunchTable(const MultiTable& t, const F& op, cudaStream_t stream) {
  if constexpr (kSig < (1 << F::kViews)) {
    if ((t.vec4_sig < 0 ? 0 : t.vec4_sig) != kSig) {
      return LaunchTable<F, kSig + 1>(t, op, stream);
    }
    const unsigned blocks = unsigned(t.block_start[t.count]);
    MultiLoadStoreKernel<F, kSig><<<blocks, kThreads, 0, stream>>>(t, op);
    return cudaGetLastError();
  } else {
    return cudaErrorInvalidValue;
  }
}

cudaError_t MarkNonFinite(const KView& v, float limit, int* flag,
                          cudaStream_t stream) {
  return LaunchForEach({v}, v.rows, v.cols, stream,
                       FiniteOp{D(v), limit, flag});
}

cudaError_t MuonMomentumMulti(const KView* grads, const KView* moms_in,
                              const KView* moms_out, const KView* outs,
                              int64_t count, float one_minus_beta, float beta,
                              bool nesterov, cudaStream_t stream) {
  const KView* views[MultiMomentumOp::kViews] = {grads, moms_in, outs,
                                                 moms_out};
  const MultiMomentumOp op{one_minus_beta, beta, nesterov};
  return RunMulti(
      views, MultiMomentumOp::kViews, count, nullptr,
      [&](const MultiTable& t) { return LaunchTable(t, op, stream); },
      [&](int64_t i) {
        return MuonMomentum(grads[i], moms_in[i], moms_out[i], one_minus_beta,
                            beta, nesterov, outs[i], stream);
      });
}

cudaError_t ApplyUpdateMulti(const KView* params, const KView* updates,
                             const float* lrs, int64_t count, float decay,
                             int method, cudaStream_t stream) {
  const KView* views[2] = {params, updates};
  const MultiUpdateOp op{decay, method};
  return RunMulti(
      views, 2, count, lrs,
      [&](const MultiTable& t) { return LaunchTable(t, op, stream); },
      [&](int64_t i) {
        return ApplyUpdate(params[i], updates[i], lrs[i], decay, method,
                           stream);
      });
}

cudaError_t MarkNonFiniteMulti(const KView* views, int64_t count, float limit,
                               int* flag, cudaStream_t stream) {
  const KView* table[1] = {views};
  return RunMulti(
      table, 1, count, nullptr,
      [&](const MultiTable& t) {
        MultiFiniteKernel<<<unsigned(t.block_start[t.count]), kThreads, 0,
                            stream>>>(t, limit, flag);
        return cudaGetLastError();
      },
      [&](int64_t i) { return MarkNonFinite(views[i], limit, flag, stream); });
}

}  // namespace cuda_kernels
}  // namespace muond
