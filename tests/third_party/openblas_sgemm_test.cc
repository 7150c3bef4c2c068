// Proves the OpenBLAS wrapper: sgemm on small matrices against a product
// computed by hand.
#include <cblas.h>
#include <gtest/gtest.h>

TEST(OpenBlasWrapper, SgemmMatchesHandComputedProduct) {
  // A = [[1, 2, 3], [4, 5, 6]] (2x3), B = [[7, 8], [9, 10], [11, 12]] (3x2).
  const float a[] = {1, 2, 3, 4, 5, 6};
  const float b[] = {7, 8, 9, 10, 11, 12};
  float c[] = {1, 1, 1, 1};
  // C = 2 * A B - 1 * C; A B = [[58, 64], [139, 154]].
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 2, 2, 3, 2.0f, a, 3, b,
              2, -1.0f, c, 2);
  EXPECT_EQ(c[0], 115.0f);
  EXPECT_EQ(c[1], 127.0f);
  EXPECT_EQ(c[2], 277.0f);
  EXPECT_EQ(c[3], 307.0f);
}
