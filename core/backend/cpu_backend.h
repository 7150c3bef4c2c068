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

// GEMMs from many threads at once. Debian ships OpenBLAS's pthreads build
// (0.3.21: MAX_THREADS=64, no per-thread thread count; the thread-local
// openblas_set_num_threads_local came in 0.3.27). Every concurrent caller
// takes buffers of a table sized for MAX_THREADS threads; beyond it OpenBLAS
// warns "precompiled NUM_THREADS exceeded" and has been seen to crash (a host
// daemon whose 1,000 lanes called it at once). So callers that run
// concurrently (the step engine's lane workers) are at most
// CpuGemmCallerLimit(), and each runs its GEMMs single-threaded: the
// parallelism is the callers', and no GEMM oversubscribes the cores or
// queues behind another caller's threaded one.

// The most threads that may call the CPU backend's GEMMs at once: the
// MAX_THREADS OpenBLAS was built with (openblas_get_config; 64 if it does not
// say).
int CpuGemmCallerLimit();

// Declares that up to `callers` threads call the CPU backend's GEMMs at
// once. More than one makes OpenBLAS single-threaded from then on, process
// wide (openblas_set_num_threads(1), once: the setting is global in the
// pthreads build and is lowered, never raised again, so no GEMM running on
// another thread sees it grow). Safe to call from any thread.
void ExpectConcurrentCpuGemmCallers(int callers);

}  // namespace muond
