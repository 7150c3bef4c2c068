#pragma once
// The CPU backend: GEMMs on OpenBLAS (cblas_sgemm), elementwise loops over
// host memory. MatmulPrecision::kHighest (fp32) and kMedium (bf16 operands
// and output widened to fp32 for cblas_sgemm: exact products, fp32
// accumulation, one rounding to bf16, as cuBLASLt's CUBLAS_COMPUTE_32F) exist
// here; kHigh (TF32) does not. It is the runtime where there is no GPU and the
// reference the CUDA backend is tested against. Calls run synchronously on
// the calling thread.
#include <memory>

#include "core/backend/backend.h"

namespace muond {

std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace muond
