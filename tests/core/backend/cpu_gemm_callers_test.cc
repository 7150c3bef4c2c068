// The CPU backend's GEMMs called from many threads at once (the step
// engine's lane workers): once more than one caller is declared OpenBLAS runs
// single-threaded, and as many callers as CpuGemmCallerLimit() allows get the
// same bits as one caller alone.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/backend/cpu_backend.h"

namespace muond {
namespace {

constexpr int64_t kN = 96;  // large enough for OpenBLAS's buffered path

std::vector<float> Matrix(int seed) {
  std::vector<float> m(kN * kN);
  for (int64_t i = 0; i < kN * kN; ++i) {
    m[i] = float((i * 7 + seed * 13) % 19) / 19.0f - 0.5f;
  }
  return m;
}

std::vector<float> Product(Backend& backend, int seed) {
  std::vector<float> a = Matrix(seed), b = Matrix(seed + 1), c(kN * kN);
  auto view = [](std::vector<float>& v) {
    return ContiguousView(v.data(), DType::kFloat32, kN, kN);
  };
  EXPECT_TRUE(backend
                  .Gemm(Op::kN, Op::kT, 1.0f, view(a), view(b), 0.0f, view(c),
                        MatmulPrecision::kHighest)
                  .ok());
  return c;
}

TEST(CpuGemmCallers, ConcurrentCallersMakeOpenBlasSingleThreaded) {
  const int before = openblas_get_num_threads();
  ExpectConcurrentCpuGemmCallers(1);  // one caller: OpenBLAS as it was
  EXPECT_EQ(openblas_get_num_threads(), before);
  ExpectConcurrentCpuGemmCallers(8);
  EXPECT_EQ(openblas_get_num_threads(), 1);
}

TEST(CpuGemmCallers, AsManyCallersAsTheLimitGetTheBitsOfOneCaller) {
  ExpectConcurrentCpuGemmCallers(2);
  const int callers = CpuGemmCallerLimit();
  ASSERT_GE(callers, 2);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<std::vector<float>> alone(callers), together(callers);
  for (int i = 0; i < callers; ++i) alone[i] = Product(*backend, i);
  std::vector<std::thread> threads;
  for (int i = 0; i < callers; ++i) {
    threads.emplace_back([&, i] {
      for (int round = 0; round < 3; ++round) {
        together[i] = Product(*backend, i);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < callers; ++i) {
    ASSERT_EQ(0, std::memcmp(alone[i].data(), together[i].data(),
                             alone[i].size() * sizeof(float)))
        << "caller " << i;
  }
}

}  // namespace
}  // namespace muond
