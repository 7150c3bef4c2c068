#include "core/backend/bf16.h"
#include "core/backend/cuda_gram_kernels.h"
#include "core/backend/fp16.h"

namespace muond {
namespace cuda_gram_kernels {
namespace {

// One thread per diagonal element of the whole batch; the same conversions
// as the CPU backend (bf16.h, fp16.h), so both round identically.
__global__ void AddToDiagonalKernel(void* data, int dtype, int64_t n,
                                    int64_t ld, int64_t stride, int64_t total,
                                    float value) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total) return;
  const int64_t idx = (t / n) * stride + (t % n) * (ld + 1);
  if (dtype == 0) {
    float* p = static_cast<float*>(data) + idx;
    *p = __fadd_rn(*p, value);
  } else {
    uint16_t* p = static_cast<uint16_t*>(data) + idx;
    if (dtype == 1) {
      *p = FloatToBf16Bits(__fadd_rn(Bf16BitsToFloat(*p), value));
    } else {
      *p = FloatToFp16Bits(__fadd_rn(Fp16BitsToFloat(*p), value));
    }
  }
}

}  // namespace

cudaError_t AddToDiagonal(void* data, int dtype, int64_t n, int64_t ld,
                          int64_t stride, int64_t batch, float value,
                          cudaStream_t stream) {
  const int64_t total = n * batch;
  if (total == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  AddToDiagonalKernel<<<unsigned(blocks), kThreads, 0, stream>>>(
      data, dtype, n, ld, stride, total, value);
  return cudaGetLastError();
}

}  // namespace cuda_gram_kernels
}  // namespace muond
