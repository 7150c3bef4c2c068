#pragma once
// The CUDA backend: cuBLAS GEMMs (cublasGemmEx / cublasGemmStridedBatchedEx;
// highest = fp32 compute, high = TF32 tensor cores, medium = bf16 operands
// with fp32 accumulation) and muond's kernels (core/backend/cuda_kernels.cu).
//
// One backend instance = one device, one non-blocking CUDA stream, one cuBLAS
// handle bound to that stream with a 64 MiB workspace set once at creation
// (cuBLAS never allocates inside a step), and small scratch buffers for the
// norm partial sums and the finiteness flag. Compute calls only enqueue work:
// no host synchronisation except in AllFinite, CopyToHost and Synchronize.
// A step's communicator (NCCL) runs on stream() to stay ordered with it.
// Not thread-safe: one caller thread per instance (one instance per group).
#include <memory>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"

namespace muond {

// True when the CUDA runtime sees at least one device.
bool CudaDeviceAvailable();

// Errors: FailedPrecondition when no device / `device` out of range, Internal
// for CUDA or cuBLAS setup failures.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace muond
