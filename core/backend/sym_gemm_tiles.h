// The lower-triangle tile order of the sm_90a symmetric GEMM
// (sym_gemm_sm90_kernel.cuh), host and device, so that CPU tests can check it.
//
// Linear index t over one T x T tile triangle (tile_m >= tile_n, T (T+1) / 2
// tiles) -> (tile_m, tile_n). Tile rows are taken in bands of kBandRows; a
// band's tiles keep the index range its rows have in row-major order but run
// column by column (the rectangle left of the band's diagonal block, then that
// block's lower triangle). Consecutive indices, which the persistent CTAs of
// one wave take together, then share a few row panels (A) and column panels
// (B), so a wave's operands stay in L2 (row-major order would touch every
// column panel of a long row).
#ifndef MUOND_CORE_BACKEND_SYM_GEMM_TILES_H_
#define MUOND_CORE_BACKEND_SYM_GEMM_TILES_H_

#include <cstdint>

#if defined(__CUDACC__)
#define MUOND_SG_HD __host__ __device__ __forceinline__
#else
#define MUOND_SG_HD inline
#endif

namespace muond {
namespace sym_gemm_sm90 {

constexpr int32_t kBandRows = 8;
// The kernel's square output tile: the mirror of a tile is one tile.
constexpr int kSymTile = 128;

// Work items of `batch` T x T lower tile triangles (diagonal included).
MUOND_SG_HD int64_t LowerTileWork(int64_t tiles, int64_t batch) {
  return batch * tiles * (tiles + 1) / 2;
}

// Row m of index t in row-major triangle order (t = m (m+1) / 2 + n, n <= m):
// an approximate square root fixed up exactly in 32-bit integers (valid for
// t < 2^29, m < 2^15).
MUOND_SG_HD int32_t TriangleRow(uint32_t t) {
  const float x = 8.0f * float(t) + 1.0f;
#if defined(__CUDA_ARCH__)
  int32_t m = int32_t((x * rsqrtf(x) - 1.0f) * 0.5f);
#else
  int32_t m = int32_t((x / __builtin_sqrtf(x) - 1.0f) * 0.5f);
#endif
  m = m < 0 ? 0 : m;
  while (uint32_t(m) * uint32_t(m + 1) / 2 > t) --m;
  while (uint32_t(m + 1) * uint32_t(m + 2) / 2 <= t) ++m;
  return m;
}

// (tile_m, tile_n) of index t < T (T+1) / 2 in the banded order above.
MUOND_SG_HD void TileOfIndex(uint32_t t, int32_t tiles, int32_t* tile_m,
                             int32_t* tile_n) {
  const int32_t r0 = TriangleRow(t) / kBandRows * kBandRows;
  const int32_t r1 = r0 + kBandRows < tiles ? r0 + kBandRows : tiles;
  const int32_t h = r1 - r0;
  uint32_t u = t - uint32_t(r0) * uint32_t(r0 + 1) / 2;
  if (u < uint32_t(h) * uint32_t(r0)) {  // the rectangle, column by column
    *tile_n = int32_t(u / uint32_t(h));
    *tile_m = r0 + int32_t(u % uint32_t(h));
    return;
  }
  u -= uint32_t(h) * uint32_t(r0);  // the diagonal block's lower triangle
  int32_t c = 0;
  while (u >= uint32_t(h - c)) u -= uint32_t(h - c++);
  *tile_n = r0 + c;
  *tile_m = r0 + c + int32_t(u);
}

// The wide schedule's output tiles are 128 x 256: tile row m (kSymTile rows)
// by column pair k (square tile columns 2k and 2k + 1). Tile rows 2p and
// 2p + 1 both have pairs 0..p, so the work is a triangle of "pair rows" p >= k,
// each cell two items (tile rows 2p, 2p + 1), taken in TileOfIndex's banded
// order. The pair (2p, p) holds one tile of the triangle and one above it
// (computed, not written); with T odd, the last pair row's second tile row
// lies outside the matrix (computed on zeros, not written).
MUOND_SG_HD int64_t WidePairRows(int64_t tiles) { return (tiles + 1) / 2; }

// Work items of `batch` T x T triangles in 128 x 256 tiles.
MUOND_SG_HD int64_t WideTileWork(int64_t tiles, int64_t batch) {
  const int64_t p = WidePairRows(tiles);
  return batch * p * (p + 1);
}

// (tile_m, column pair) of index t < WideTileWork(tiles, 1).
MUOND_SG_HD void WideTileOfIndex(uint32_t t, int32_t tiles, int32_t* tile_m,
                                 int32_t* pair) {
  int32_t p = 0;
  TileOfIndex(t >> 1, int32_t(WidePairRows(tiles)), &p, pair);
  *tile_m = 2 * p + int32_t(t & 1);
}

}  // namespace sym_gemm_sm90
}  // namespace muond

#undef MUOND_SG_HD

#endif  // MUOND_CORE_BACKEND_SYM_GEMM_TILES_H_
