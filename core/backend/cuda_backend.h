#pragma once
// The CUDA backend: cuBLAS GEMMs (cublasGemmEx / cublasGemmStridedBatchedEx;
// highest = fp32 compute, high = TF32 tensor cores, medium = bf16 operands
// with fp32 accumulation) and muond's kernels (core/backend/cuda_kernels.h).
//
// One backend instance = one device, one non-blocking CUDA stream, one cuBLAS
// handle bound to that stream with a 64 MiB workspace set once at creation
// (cuBLAS never allocates inside a step), and small scratch buffers for the
// norm partial sums and the finiteness flag. Compute calls only enqueue work:
// no host synchronisation except in AllFinite, CopyToHost and Synchronize.
// A step's communicator (NCCL) runs on stream() to stay ordered with it.
// Not thread-safe: one caller thread per instance (one instance per group).
//
// fp16 (the Gram NS iteration dtype) is supported where Gram NS needs it:
// Copy2D to and from fp32/bf16 (__float2half_rn: round to nearest even),
// kMedium GEMMs on fp16 operands (cuBLASLt CUDA_R_16F, fp32 compute),
// FrobeniusNormalize into fp16, SymmetrizeFromLower and AllFiniteBelow.
//
// RunGraph captures the stream (cudaStreamBeginCapture, thread-local mode)
// into a cudaGraphExec cached per key (the 64 most recently used; older ones
// destroyed). Every call above is capturable (cuBLAS(Lt) runs on the
// preallocated workspace) except Allocate/Free, the host copies
// (CopyFromHost, CopyToHost), AllFinite, Synchronize and the lt_autotune
// tuning. A capture that fails runs the work directly and marks its key not
// capturable. CudaBackendOptions::cuda_graphs false turns graphs off
// (RunGraph = work()).
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/backend/cuda_backend_options.h"

namespace muond {

// True when the CUDA runtime sees at least one device.
bool CudaDeviceAvailable();

// What RunGraph did so far on a CUDA backend (all zero for other backends):
// for tests and diagnostics.
struct CudaGraphCounts {
  int64_t captures = 0;   // keys captured and instantiated
  int64_t launches = 0;   // graph launches (first runs included)
  int64_t fallbacks = 0;  // keys found not capturable (work run directly)
  // Keys that came back after their exec was evicted: the keys in use
  // outnumber kCudaGraphsKept, so such a key runs directly from then on
  // rather than evicting another on every step.
  int64_t uncached = 0;
};
CudaGraphCounts GetCudaGraphCounts(const Backend& backend);

// The graph execs a CUDA backend keeps (least recently used evicted beyond).
// Every Muon group's NS phase is a graph of its own on the engine's backend,
// replayed each step in group order: an LRU cache smaller than the keys in
// use would miss on every step (a capture each time), so a key that comes
// back after its eviction is run directly instead (CudaGraphCounts::uncached)
// and the others stay cached.
inline constexpr int64_t kCudaGraphsKept = 1024;

// A backend on CUDA device `device` with the switches of `options`.
// Errors: FailedPrecondition when no device / `device` out of range, Internal
// for CUDA or cuBLAS setup failures.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    int device, const CudaBackendOptions& options = {});

}  // namespace muond
