// Backend::SymmetricGemmStridedBatchedOut's default (the CPU backend's): the
// full product followed by the mirror of its lower triangle. Checked against
// an fp64 product written here (both orientations, alpha/beta with a
// symmetric c, a batch, padded rows) and against the same backend's plain
// GemmStridedBatchedOut: the lower triangle equal bitwise, d == d^T bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/backend/backend.h"
#include "core/backend/cpu_backend.h"

namespace muond {
namespace {

TEST(SymmetricGemmDefault, SymmetricAndEqualToThePlainProduct) {
  auto cpu = MakeCpuBackend();
  EXPECT_FALSE(cpu->FastSymmetricGemm(4096, 4096, DType::kFloat32, 1));
  EXPECT_FALSE(cpu->FastSymmetricGemm(2048, 2048, DType::kBFloat16, 64));
  const int64_t n = 37, k = 53, batch = 3, pad = 5;
  std::mt19937 rng(11);
  std::normal_distribution<float> g;
  for (bool xtx : {false, true}) {
    SCOPED_TRACE(xtx ? "X^T X" : "X X^T");
    const int64_t xr = xtx ? k : n, xc = xtx ? n : k, ldx = xc + pad;
    const int64_t ldd = n + pad, sx = xr * ldx, sd = n * ldd;
    std::vector<float> x(sx * batch), c(sd * batch, 0.0f);
    for (float& v : x) v = g(rng);
    for (int64_t l = 0; l < batch; ++l)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j)
          c[l * sd + i * ldd + j] = c[l * sd + j * ldd + i] = g(rng);
    std::vector<float> d(sd * batch, -7.0f), plain(sd * batch, -7.0f);
    const MatrixView xv{x.data(), DType::kFloat32, xr, xc, ldx};
    const MatrixView cv{c.data(), DType::kFloat32, n, n, ldd};
    const MatrixView dv{d.data(), DType::kFloat32, n, n, ldd};
    const MatrixView pv{plain.data(), DType::kFloat32, n, n, ldd};
    const Op oa = xtx ? Op::kT : Op::kN, ob = xtx ? Op::kN : Op::kT;
    const float alpha = 0.7f, beta = -0.3f;
    const MatmulPrecision hi = MatmulPrecision::kHighest;
    ASSERT_TRUE(cpu->SymmetricGemmStridedBatchedOut(oa, ob, alpha, xv, sx, xv,
                                                    sx, beta, cv, sd, dv, sd,
                                                    batch, hi)
                    .ok());
    ASSERT_TRUE(cpu->GemmStridedBatchedOut(oa, ob, alpha, xv, sx, xv, sx, beta,
                                           cv, sd, pv, sd, batch, hi)
                    .ok());
    for (int64_t l = 0; l < batch; ++l) {
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t o = l * sd + i * ldd + j;
          double want = beta * double(c[o]);
          for (int64_t p = 0; p < k; ++p) {
            const double xi =
                xtx ? x[l * sx + p * ldx + i] : x[l * sx + i * ldx + p];
            const double xj =
                xtx ? x[l * sx + p * ldx + j] : x[l * sx + j * ldx + p];
            want += alpha * xi * xj;
          }
          EXPECT_NEAR(d[o], want, 1e-4 * (1.0 + std::fabs(want)));
          EXPECT_EQ(d[o], d[l * sd + j * ldd + i]) << l << " " << i << " " << j;
          if (j <= i) {
            EXPECT_EQ(d[o], plain[o]) << l << " " << i << " " << j;
          }
        }
        for (int64_t j = n; j < ldd; ++j)
          EXPECT_EQ(d[l * sd + i * ldd + j], -7.0f) << "padding written";
      }
    }
  }
}

}  // namespace
}  // namespace muond
