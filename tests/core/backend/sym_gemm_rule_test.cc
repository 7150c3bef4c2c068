// The rule of CudaBackend::FastSymmetricGemm (core/backend/sym_gemm_rule.h):
// tile counts against an enumeration of the 128 x 128 output tiles, and the
// decisions against the H200 measurements it was fitted to
// (bench/results/gpu_h200_sym_gemm.md, 132 SMs).
#include "core/backend/sym_gemm_rule.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace muond {
namespace sym_gemm_sm90 {
namespace {

constexpr int64_t kH200Sms = 132;

// Tiles of an n x n result with a cell on or below the diagonal.
int64_t EnumeratedLowerTiles(int64_t n) {
  int64_t count = 0;
  for (int64_t r0 = 0; r0 < n; r0 += 128) {
    for (int64_t c0 = 0; c0 < n; c0 += 128) {
      if (c0 <= r0 + 127 && c0 <= n - 1) ++count;  // cell (min(r0+127,n-1), c0)
    }
  }
  return count;
}

TEST(SymGemmRule, LowerTilesCountTheTriangle) {
  for (int64_t n : {1, 127, 128, 129, 1000, 1024, 1536, 2048, 2050, 3072, 4096})
    EXPECT_EQ(LowerTiles(n), EnumeratedLowerTiles(n)) << n;
  EXPECT_EQ(LowerTiles(2048), 136);  // the two-wave single product
}

TEST(SymGemmRule, MatchesTheH200Measurements) {
  // Single products: wins from 3072 (1.22-1.54x), loses at 2048 and 1024.
  EXPECT_TRUE(BeatsFullGemm(3072, 1, kH200Sms));
  EXPECT_TRUE(BeatsFullGemm(4096, 1, kH200Sms));
  EXPECT_FALSE(BeatsFullGemm(2048, 1, kH200Sms));
  EXPECT_FALSE(BeatsFullGemm(1024, 1, kH200Sms));
  // 1024 x 3584 batch 32: 1.39x. 512 x 1792 batch 32: 1.01x (too small).
  EXPECT_TRUE(BeatsFullGemm(1024, 32, kH200Sms));
  EXPECT_FALSE(BeatsFullGemm(512, 32, kH200Sms));
  EXPECT_FALSE(BeatsFullGemm(512, 1 << 20, kH200Sms));
  // Batch 8 at 1024 (288 tiles, 1.12x) stays below the 4-wave margin.
  EXPECT_FALSE(BeatsFullGemm(1024, 8, kH200Sms));
  // Qwen3-1.7B's 2048 x 2048 q/o matrices in batches of 28.
  EXPECT_TRUE(BeatsFullGemm(2048, 28, kH200Sms));
}

TEST(SymGemmRule, BatchThresholdIsFourWaves) {
  for (int64_t n : {1024, 1536, 2048, 2560}) {
    const int64_t tiles = EnumeratedLowerTiles(n);
    const int64_t need = (4 * kH200Sms + tiles - 1) / tiles;  // ceil
    EXPECT_FALSE(BeatsFullGemm(n, need - 1, kH200Sms)) << n;
    EXPECT_TRUE(BeatsFullGemm(n, need, kH200Sms)) << n;
  }
  // Batch of one (and a degenerate batch) decides as an unbatched product.
  for (int64_t n : {1024, 2048, 2560, 3072}) {
    EXPECT_EQ(BeatsFullGemm(n, 1, kH200Sms), n >= 3072) << n;
    EXPECT_EQ(BeatsFullGemm(n, 0, kH200Sms), BeatsFullGemm(n, 1, kH200Sms));
  }
  // A smaller GPU fills with fewer tiles.
  EXPECT_TRUE(BeatsFullGemm(2048, 2, 66));
  EXPECT_FALSE(BeatsFullGemm(2048, 2, kH200Sms));
}

TEST(SymGemmRule, WideTilesFromTheLargestMeasuredSize) {
  // n = 8192 wins 1.40-1.65x; n = 4096 (Llama-3-8B's step 1.002x), 3072
  // (0.82-0.96x), 2048 (Qwen3-1.7B's step 4.6% slower) and 1024 stay
  // cooperative.
  EXPECT_TRUE(PrefersWideTiles(8192));
  EXPECT_TRUE(PrefersWideTiles(16384));
  EXPECT_FALSE(PrefersWideTiles(8191));
  for (int64_t n : {1, 1024, 2048, 3072, 4096, 6144}) {
    EXPECT_FALSE(PrefersWideTiles(n)) << n;
  }
}

// PrefersPingpong's third argument: by_size_only, true for every product
// but X X^T and X^T X without c (the backend: beta != 0 or (N,N)).
TEST(SymGemmRule, PingpongByTwoWavesForXXtAndBySizeFrom2048Otherwise) {
  constexpr int64_t kH100Sms = 132;
  // X X^T / X^T X without c: the MoE layer's expert products (n = 768: 21
  // lower tiles) at batch 128 and 256; 1024 x 3072 at batch 8 (288 tiles).
  EXPECT_TRUE(PrefersPingpong(768, 128, false, kH100Sms));
  EXPECT_TRUE(PrefersPingpong(768, 256, false, kH100Sms));
  EXPECT_TRUE(PrefersPingpong(1024, 8, false, kH100Sms));
  // Fewer than two waves of tiles: 512 x 1792 at batch 8 (80), n = 1536
  // alone (78), n = 2048 alone (136).
  EXPECT_FALSE(PrefersPingpong(512, 8, false, kH100Sms));
  EXPECT_FALSE(PrefersPingpong(1536, 1, false, kH100Sms));
  EXPECT_FALSE(PrefersPingpong(2048, 1, false, kH100Sms));
  // The two-wave boundary: 2 x 132 = 264 tiles (n = 512: 10 a product); a
  // degenerate batch counts as one.
  EXPECT_TRUE(PrefersPingpong(512, 27, false, kH100Sms));   // 270 tiles
  EXPECT_FALSE(PrefersPingpong(512, 26, false, kH100Sms));  // 260 tiles
  EXPECT_EQ(PrefersPingpong(1024, 0, false, kH100Sms),
            PrefersPingpong(1024, 1, false, kH100Sms));
  // With enough tiles, at every size.
  for (int64_t n : {768, 1024, 1536, 2047, 2048, 3072, 4096, 6144}) {
    EXPECT_TRUE(PrefersPingpong(n, 256, false, kH100Sms)) << n;
  }
  // Every other product (the NS polynomial's, with c): by size alone, from
  // n = 2048, whatever the batch and the GPU's SM count (a failed SM query
  // counts as 2^40), so that a batch of one and a batched call take the
  // same schedule. Qwen3-1.7B's n = 2048 at batch 28, Llama-3-8B's n = 4096
  // at batch 4, the MoE layer's q and o at n = 2048 alone are among them.
  for (int64_t sms : {int64_t{66}, kH100Sms, int64_t{1} << 40}) {
    for (int64_t n : {768, 1024, 1536, 2047, 2048, 3072, 4096, 6144}) {
      for (int64_t b : {0, 1, 2, 4, 8, 28, 1024}) {
        EXPECT_EQ(PrefersPingpong(n, b, true, sms), n >= 2048)
            << n << " " << b << " " << sms;
      }
    }
  }
}

}  // namespace
}  // namespace sym_gemm_sm90
}  // namespace muond
