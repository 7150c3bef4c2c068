// The symmetric GEMM's tile order (core/backend/sym_gemm_tiles.h): every index
// of a T x T triangle maps to a distinct lower tile, so the persistent kernel
// computes each lower tile exactly once; bands keep their row-major index
// ranges and run column by column. Checked against a brute-force enumeration.
// The wide schedule's 128 x 256 items cover every lower tile exactly once with
// the halves the epilogue writes (square column <= tile row, inside).
#include "core/backend/sym_gemm_tiles.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <utility>

namespace muond {
namespace sym_gemm_sm90 {
namespace {

TEST(SymGemmTiles, TriangleRowMatchesBruteForce) {
  int32_t m = 0;
  for (uint32_t t = 0; t < 3000000; ++t) {
    if (uint32_t(m + 1) * uint32_t(m + 2) / 2 <= t) ++m;
    ASSERT_EQ(TriangleRow(t), m) << t;
  }
  for (uint32_t row : {8191u, 8192u, 12345u, 16383u}) {
    const uint32_t first = row * (row + 1) / 2;
    EXPECT_EQ(TriangleRow(first), int32_t(row));
    EXPECT_EQ(TriangleRow(first + row), int32_t(row));
    EXPECT_EQ(TriangleRow(first - 1), int32_t(row - 1));
  }
}

TEST(SymGemmTiles, EveryLowerTileExactlyOnceInBands) {
  for (int32_t tiles : {1, 2, 7, 8, 9, 15, 16, 17, 33, 64, 65, 130}) {
    std::set<std::pair<int32_t, int32_t>> seen;
    const uint32_t total = uint32_t(tiles) * uint32_t(tiles + 1) / 2;
    int32_t prev_m = -1, prev_n = -1;
    for (uint32_t t = 0; t < total; ++t) {
      int32_t m = -1, n = -1;
      TileOfIndex(t, tiles, &m, &n);
      ASSERT_TRUE(n >= 0 && n <= m && m < tiles)
          << tiles << ": " << t << " -> " << m << "," << n;
      ASSERT_TRUE(seen.insert({m, n}).second) << tiles << ": " << t;
      // Same band as in row-major order.
      EXPECT_EQ(m / kBandRows, TriangleRow(t) / kBandRows) << tiles << " " << t;
      // Within a band, column by column: n never decreases.
      if (t > 0 && m / kBandRows == prev_m / kBandRows) {
        EXPECT_GE(n, prev_n) << tiles << " " << t;
      }
      prev_m = m;
      prev_n = n;
    }
    EXPECT_EQ(seen.size(), total);
  }
}

TEST(SymGemmTiles, WideItemsWriteEveryLowerTileExactlyOnce) {
  for (int32_t tiles : {1, 2, 3, 7, 8, 9, 16, 17, 32, 33, 130}) {
    std::set<std::pair<int32_t, int32_t>> written;
    const int64_t total = WideTileWork(tiles, 1);
    int64_t wasted_halves = 0;
    for (uint32_t t = 0; t < uint32_t(total); ++t) {
      int32_t m = -1, pair = -1;
      WideTileOfIndex(t, tiles, &m, &pair);
      ASSERT_TRUE(pair >= 0 && 2 * pair <= m) << tiles << ": " << t;
      // Only the pair row past the matrix, when T is odd.
      ASSERT_LT(m, tiles + (tiles % 2)) << tiles << ": " << t;
      for (int32_t n : {2 * pair, 2 * pair + 1}) {
        if (n > m || m >= tiles || n >= tiles) {
          ++wasted_halves;  // what the epilogue skips
          continue;
        }
        ASSERT_TRUE(written.insert({m, n}).second)
            << tiles << ": " << t << " -> " << m << "," << n;
      }
    }
    EXPECT_EQ(int64_t(written.size()), int64_t(tiles) * (tiles + 1) / 2);
    // The waste: the upper half of each pair row's diagonal item, and with T
    // odd the whole last tile row past the matrix.
    const int64_t p = WidePairRows(tiles);
    EXPECT_EQ(wasted_halves, tiles % 2 == 0 ? p : 3 * p) << tiles;
  }
}

}  // namespace
}  // namespace sym_gemm_sm90
}  // namespace muond
