// A trivial kernel that proves the cuda_library macro (nvcc -> objects ->
// cc_library).
#include "tests/third_party/cuda_kernel.h"

__global__ void AxpyKernel(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}

int LaunchAxpy(float a, const float* x, float* y, int n) {
  AxpyKernel<<<(n + 255) / 256, 256>>>(a, x, y, n);
  return static_cast<int>(cudaGetLastError());
}
