// Proves the CUDA wrappers: our kernel (cuda_library) and a cuBLAS sgemm
// compile, link and, where a device is present, compute the right values.
// Without a device the test reports skipped.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "tests/common/cuda_device.h"
#include "tests/third_party/cuda_kernel.h"

namespace {

TEST(CudaWrapper, KernelAndCublasSgemm) {
  if (!muond::testing::HaveCudaDevice())
    GTEST_SKIP() << "no CUDA device on this machine";
  const int n = 4;
  std::vector<float> x = {1, 2, 3, 4}, y = {10, 20, 30, 40};
  float *dx, *dy;
  ASSERT_EQ(cudaMalloc(&dx, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dy, n * sizeof(float)), cudaSuccess);
  cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  ASSERT_EQ(LaunchAxpy(2.0f, dx, dy, n), 0);
  cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost);
  EXPECT_EQ(y, (std::vector<float>{12, 24, 36, 48}));

  // 2x2 column-major: C = A * B with A = [[1, 2], [3, 4]], B = I * 2.
  std::vector<float> a = {1, 3, 2, 4}, b = {2, 0, 0, 2}, c(4, 0);
  float *da, *db, *dc;
  cudaMalloc(&da, 16);
  cudaMalloc(&db, 16);
  cudaMalloc(&dc, 16);
  cudaMemcpy(da, a.data(), 16, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), 16, cudaMemcpyHostToDevice);
  cublasHandle_t handle;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const float one = 1, zero = 0;
  ASSERT_EQ(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, da, 2,
                        db, 2, &zero, dc, 2),
            CUBLAS_STATUS_SUCCESS);
  cudaMemcpy(c.data(), dc, 16, cudaMemcpyDeviceToHost);
  EXPECT_EQ(c, (std::vector<float>{2, 6, 4, 8}));
  cublasDestroy(handle);
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  cudaFree(dx);
  cudaFree(dy);
}

}  // namespace
