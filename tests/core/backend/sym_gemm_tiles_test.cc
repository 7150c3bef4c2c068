// The symmetric GEMM's tile order (core/backend/sym_gemm_tiles.h): every index
// of a T x T triangle maps to a distinct lower tile, so the persistent kernel
// computes each lower tile exactly once; bands keep their row-major index
// ranges and run column by column. Checked against a brute-force enumeration.
// The wide schedule's 128 x 256 items cover every lower tile exactly once with
// the halves the epilogue writes (square column <= tile row, inside). With
// clusters of two, the CTAs of an item share its tile column(s) (the B panel
// they multicast) and still write every lower tile exactly once.
#include "core/backend/sym_gemm_tiles.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

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

// The tiles item t's CTA of rank r writes: tile_n is a column pair for wide
// items; the epilogue skips what lies above the diagonal or past the matrix.
std::vector<std::pair<int32_t, int32_t>> WrittenTiles(uint32_t t, int32_t rank,
                                                      int32_t tiles, bool wide,
                                                      int32_t cluster_m,
                                                      int32_t* col_out) {
  int32_t m = -1, col = -1;
  ClusterTileOfItem(t, rank, tiles, wide, cluster_m, &m, &col);
  *col_out = col;
  std::vector<std::pair<int32_t, int32_t>> out;
  std::vector<int32_t> cols = {col};
  if (wide) cols = {2 * col, 2 * col + 1};
  for (int32_t n : cols) {
    if (n <= m && m < tiles && n < tiles) out.push_back({m, n});
  }
  return out;
}

TEST(SymGemmTiles, ClusterPairsShareColumnsAndWriteEveryLowerTileOnce) {
  for (bool wide : {false, true}) {
    for (int32_t tiles : {1, 2, 3, 7, 8, 9, 16, 17, 32, 33, 130}) {
      std::set<std::pair<int32_t, int32_t>> written;
      const int64_t total = ClusterWork(tiles, 1, wide, 2);
      int64_t ctas = 0;
      for (uint32_t t = 0; t < uint32_t(total); ++t) {
        int32_t col0 = -1, col1 = -1;
        const auto w0 = WrittenTiles(t, 0, tiles, wide, 2, &col0);
        const auto w1 = WrittenTiles(t, 1, tiles, wide, 2, &col1);
        ASSERT_EQ(col0, col1)
            << "one B panel per cluster: " << tiles << " " << t;
        for (const auto& tile : w0) {
          ASSERT_EQ(tile.first % 2, 0) << tiles << " " << t;
          ASSERT_TRUE(written.insert(tile).second) << tiles << " " << t;
        }
        for (const auto& tile : w1) {
          ASSERT_EQ(tile.first % 2, 1) << tiles << " " << t;
          ASSERT_TRUE(written.insert(tile).second) << tiles << " " << t;
        }
        ctas += 2;
      }
      EXPECT_EQ(int64_t(written.size()), int64_t(tiles) * (tiles + 1) / 2)
          << (wide ? "wide " : "square ") << tiles;
      // The waste stays small: one square tile (wide: one half) per pair
      // row on the diagonal, plus the row past the matrix when T is odd.
      const int64_t square_tiles = wide ? 2 * ctas : ctas;
      const int64_t p = WidePairRows(tiles);
      EXPECT_LE(square_tiles - int64_t(written.size()),
                tiles % 2 == 0 ? p : 4 * p + 1)
          << (wide ? "wide " : "square ") << tiles;
      // Batches repeat the count.
      EXPECT_EQ(ClusterWork(tiles, 5, wide, 2), 5 * total);
    }
  }
}

TEST(SymGemmTiles, ClusterOfOneIsTheUnclusteredOrder) {
  for (int32_t tiles : {1, 8, 9, 33}) {
    EXPECT_EQ(ClusterWork(tiles, 3, false, 1), LowerTileWork(tiles, 3));
    EXPECT_EQ(ClusterWork(tiles, 3, true, 1), WideTileWork(tiles, 3));
    for (uint32_t t = 0; t < uint32_t(LowerTileWork(tiles, 1)); ++t) {
      int32_t m0, n0, m1, n1;
      TileOfIndex(t, tiles, &m0, &n0);
      ClusterTileOfItem(t, 0, tiles, false, 1, &m1, &n1);
      ASSERT_EQ(std::make_pair(m0, n0), std::make_pair(m1, n1));
    }
    for (uint32_t t = 0; t < uint32_t(WideTileWork(tiles, 1)); ++t) {
      int32_t m0, n0, m1, n1;
      WideTileOfIndex(t, tiles, &m0, &n0);
      ClusterTileOfItem(t, 0, tiles, true, 1, &m1, &n1);
      ASSERT_EQ(std::make_pair(m0, n0), std::make_pair(m1, n1));
    }
  }
}

}  // namespace
}  // namespace sym_gemm_sm90
}  // namespace muond
