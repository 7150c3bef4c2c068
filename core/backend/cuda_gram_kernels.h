#pragma once
// CUDA kernels of Gram Newton–Schulz that are not GEMMs (plain header: the
// .cu side sees no absl). Launchers enqueue on `stream`, never synchronise,
// and return the launch's cudaError_t; arguments are validated by
// CudaBackend (backend.h documents the semantics).
#include <cuda_runtime.h>

#include <cstdint>

namespace muond {
namespace cuda_gram_kernels {

// dtype: 0 fp32, 1 bf16, 2 fp16 (DType's values). For each of `batch`
// n x n slices (slice s at data + s * stride elements, rows `ld` apart):
// x_ii <- round(x_ii + value), computed in fp32.
cudaError_t AddToDiagonal(void* data, int dtype, int64_t n, int64_t ld,
                          int64_t stride, int64_t batch, float value,
                          cudaStream_t stream);

}  // namespace cuda_gram_kernels
}  // namespace muond
