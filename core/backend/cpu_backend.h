#pragma once
// The CPU backend: fp32 GEMMs on OpenBLAS (cblas_sgemm), elementwise loops
// over host memory. Only MatmulPrecision::kHighest exists here. It is the
// runtime where there is no GPU and the reference the CUDA backend is tested
// against. Calls run synchronously on the calling thread.
#include <memory>

#include "core/backend/backend.h"

namespace muond {

std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace muond
