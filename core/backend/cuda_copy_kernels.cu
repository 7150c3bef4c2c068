// Strided copies with fp32/bf16/fp16 conversion (Copy2DConvert) and the
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

}  // namespace cuda_kernels
}  // namespace muond
