#pragma once
// CUDA runtime and cuBLAS return codes as absl::Status: Internal naming the
// failed call (`what`) and the library's own error string.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muond::cuda_backend_internal {

inline absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(std::string(what), ": CUDA error ",
                                          cudaGetErrorString(err)));
}

inline absl::Status CublasStatus(cublasStatus_t st, std::string_view what) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(std::string(what), ": cuBLAS error ",
                                          cublasGetStatusString(st)));
}

}  // namespace muond::cuda_backend_internal
