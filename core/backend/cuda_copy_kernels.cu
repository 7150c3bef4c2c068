// Copies with fp32/bf16/fp16 conversion (Copy2DConvert: 16-byte vectors where
// both views are contiguous and aligned, else element by element) and the
// symmetric mirror of a lower triangle (SymmetrizeFromLower).
#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"

namespace muond {
namespace cuda_kernels {
namespace {

struct CopyOp {
  DView dst, src;
  using In = float;
  __device__ In Load(int64_t j) const { return Ld(src, 0, j); }
  __device__ void Store(int64_t j, In v) const { St(dst, 0, j, v); }
  __device__ void operator()(int64_t i, int64_t j) const {
    St(dst, i, j, Ld(src, i, j));
  }
};

// Contiguous converting copies, 8 elements per thread per round, loaded
// and stored as 16-byte vectors: the per-element CopyOp moves 2-byte values
// at under half of an H100's bandwidth (the Gram NS result's fp16 -> bf16
// copy, bench/gpu_step_bench.py --kernel-profile). Each element goes
// through LdElem / StElem, as Ld / St, so the bits are CopyOp's. A tail of
// n % 8 elements goes element by element.
constexpr int kVec = 8;
template <int kSrc, bool kSrcF16, int kDst, bool kDstF16>
__global__ void CopyVecKernel(const char* src, char* dst, int64_t n) {
  constexpr int kSrcVecs = kVec * kSrc / 16, kDstVecs = kVec * kDst / 16;
  const int64_t groups = n / kVec;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t g = first; g < groups; g += stride) {
    // Through char pointers (which may alias anything), as PyTorch's aligned
    // vectors: nvcc keeps both arrays in registers (LDG.128 / STG.128, no
    // local memory).
    uint4 in[kSrcVecs];
#pragma unroll
    for (int v = 0; v < kSrcVecs; ++v)
      in[v] = reinterpret_cast<const uint4*>(src + g * kVec * kSrc)[v];
    uint4 out[kDstVecs];
    const char* ip = reinterpret_cast<const char*>(in);
    char* op = reinterpret_cast<char*>(out);
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      StElem<kDst, kDstF16>(op + e * kDst,
                            LdElem<kSrc, kSrcF16>(ip + e * kSrc));
#pragma unroll
    for (int v = 0; v < kDstVecs; ++v)
      reinterpret_cast<uint4*>(dst + g * kVec * kDst)[v] = out[v];
  }
  const int64_t tail = groups * kVec + first;
  if (tail < n) {
    StElem<kDst, kDstF16>(dst + tail * kDst,
                          LdElem<kSrc, kSrcF16>(src + tail * kSrc));
  }
}

// The element type of a view as CopyVecKernel's template arguments: 0 fp32,
// 1 bf16, 2 fp16.
int ElemKind(const KView& v) { return v.elem == 4 ? 0 : v.f16 ? 2 : 1; }

template <int kSrcKind, int kDstKind>
cudaError_t LaunchCopyVec(const KView& dst, const KView& src, int64_t n,
                          cudaStream_t stream) {
  constexpr int kSrc = kSrcKind == 0 ? 4 : 2, kDst = kDstKind == 0 ? 4 : 2;
  int64_t blocks = (n / kVec + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxFlatBlocks) blocks = kMaxFlatBlocks;
  CopyVecKernel<kSrc, kSrcKind == 2, kDst, kDstKind == 2>
      <<<unsigned(blocks), kThreads, 0, stream>>>(
          static_cast<const char*>(src.data), static_cast<char*>(dst.data), n);
  return cudaGetLastError();
}

template <int kSrcKind>
cudaError_t LaunchCopyVecTo(const KView& dst, const KView& src, int64_t n,
                            cudaStream_t stream) {
  switch (ElemKind(dst)) {
    case 0:
      return LaunchCopyVec<kSrcKind, 0>(dst, src, n, stream);
    case 1:
      return LaunchCopyVec<kSrcKind, 1>(dst, src, n, stream);
    default:
      return LaunchCopyVec<kSrcKind, 2>(dst, src, n, stream);
  }
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

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

// SymmetrizeKernel for 2-byte elements with an even ld, 4-byte aligned: 64 x
// 64 tiles moved as element pairs (one 32-bit load or store per two
// elements), and only the upper tiles launched (blockIdx.x counts them; the
// 32 x 32 kernel launches all and idles half, and at 2 bytes an element its
// loads are too small to keep HBM busy: 30% of an H100's bandwidth on a MoE
// layer's 768 x 768 Gram matrices). grid (T (T + 1) / 2, 1, batch) for T
// tiles a side, block 32 x 8.
constexpr int kPairTile = 64;
__global__ void SymmetrizePairsKernel(DView a, int64_t stride_bytes) {
  // Upper tile k -> (bi, bj), bi <= bj: bj (bj + 1) / 2 <= k < (bj + 1) (bj
  // + 2) / 2.
  const int k = blockIdx.x;
  int bj = int((sqrt(8.0 * k + 1.0) - 1.0) / 2.0);
  while ((bj + 1) * (bj + 2) / 2 <= k) ++bj;
  while (bj * (bj + 1) / 2 > k) --bj;
  const int bi = k - bj * (bj + 1) / 2;
  __shared__ uint16_t tile[kPairTile][kPairTile + 2];
  char* base = a.data + int64_t(blockIdx.z) * stride_bytes;
  const int64_t n = a.cols;
  const int c = 2 * threadIdx.x;  // this thread's column pair in the tile
  // Source tile: rows bj*64.., cols bi*64.. (lower part).
  for (int r = threadIdx.y; r < kPairTile; r += blockDim.y) {
    const int64_t i = int64_t(bj) * kPairTile + r,
                  j = int64_t(bi) * kPairTile + c;
    if (i >= n) continue;
    const uint16_t* p = reinterpret_cast<const uint16_t*>(base) + i * a.ld + j;
    if (j + 1 < n) {
      const uint32_t two = *reinterpret_cast<const uint32_t*>(p);
      tile[r][c] = uint16_t(two & 0xffffu);
      tile[r][c + 1] = uint16_t(two >> 16);
    } else if (j < n) {
      tile[r][c] = *p;
    }
  }
  __syncthreads();
  for (int r = threadIdx.y; r < kPairTile; r += blockDim.y) {
    const int64_t i = int64_t(bi) * kPairTile + r,
                  j = int64_t(bj) * kPairTile + c;
    if (i >= n) continue;
    uint16_t* p = reinterpret_cast<uint16_t*>(base) + i * a.ld + j;
    const uint16_t lo = tile[c][r], hi = tile[c + 1][r];
    if (j > i && j + 1 < n) {
      *reinterpret_cast<uint32_t*>(p) = uint32_t(lo) | (uint32_t(hi) << 16);
    } else {
      if (j > i && j < n) p[0] = lo;
      if (j + 1 > i && j + 1 < n) p[1] = hi;
    }
  }
}

}  // namespace

cudaError_t Copy2DConvert(const KView& dst, const KView& src,
                          cudaStream_t stream) {
  const int64_t n = src.rows * src.cols;
  if (n > 0 && Flat({dst, src}) && Aligned16(dst.data) && Aligned16(src.data)) {
    switch (ElemKind(src)) {
      case 0:
        return LaunchCopyVecTo<0>(dst, src, n, stream);
      case 1:
        return LaunchCopyVecTo<1>(dst, src, n, stream);
      default:
        return LaunchCopyVecTo<2>(dst, src, n, stream);
    }
  }
  return LaunchLoadStore({dst, src}, src.rows, src.cols, stream,
                         CopyOp{D(dst), D(src)});
}

cudaError_t SymmetrizeFromLower(const KView& a, int64_t stride, int64_t batch,
                                cudaStream_t stream) {
  if (a.rows == 0 || batch == 0) return cudaSuccess;
  const bool pairs = a.elem == 2 && a.ld % 2 == 0 && stride % 2 == 0 &&
                     reinterpret_cast<uintptr_t>(a.data) % 4 == 0;
  const int pair_tiles = int((a.cols + kPairTile - 1) / kPairTile);
  const unsigned tiles = unsigned((a.cols + kTile - 1) / kTile);
  // gridDim.z is at most 65535: the batch in chunks of that many slices.
  for (int64_t s0 = 0; s0 < batch; s0 += 65535) {
    const unsigned nb = unsigned(batch - s0 < 65535 ? batch - s0 : 65535);
    DView ds = D(a);
    ds.data += s0 * stride * ds.elem;
    if (pairs) {
      const unsigned upper =
          unsigned(pair_tiles) * unsigned(pair_tiles + 1) / 2;
      SymmetrizePairsKernel<<<dim3(upper, 1, nb), dim3(32, 8), 0, stream>>>(
          ds, stride * ds.elem);
    } else {
      SymmetrizeKernel<<<dim3(tiles, tiles, nb), dim3(kTile, 8), 0, stream>>>(
          ds, stride * ds.elem);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda_kernels
}  // namespace muond
