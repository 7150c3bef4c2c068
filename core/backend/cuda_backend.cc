#include "core/backend/cuda_backend.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/backend/cuda_backend_impl.h"
#include "core/common/status_macros.h"

namespace muond {
namespace cuda_backend_internal {

CudaBackend::CudaBackend(int device, const CudaBackendOptions& options)
    : graphs_(options.cuda_graphs),
      device_(device),
      options_(options),
      name_(absl::StrCat("cuda:", device)) {}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  graphs_.Clear();
  for (auto& [key, plan] : lt_plans_) {
    for (cublasLtMatrixLayout_t l : {plan.a, plan.b, plan.c, plan.d})
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    if (plan.desc != nullptr) cublasLtMatmulDescDestroy(plan.desc);
  }
  if (lt_ != nullptr) cublasLtDestroy(lt_);
  if (handle_ != nullptr) cublasDestroy(handle_);
  cudaFree(cublas_workspace_);
  cudaFree(partials_);
  cudaFree(flag_);
  cudaFreeHost(host_flag_);
  if (order_event_ != nullptr) cudaEventDestroy(order_event_);
  for (cudaEvent_t e : time_marks_) cudaEventDestroy(e);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::Init() {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                 "cudaStreamCreate"));
  RETURN_IF_ERROR(CudaStatus(
      cudaMalloc(&partials_, sizeof(double) * cuda_kernels::kNormPartials),
      "cudaMalloc"));
  constexpr size_t kFlagBytes = (1 + kDefaultGradCheckSlots) * sizeof(int);
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&flag_, kFlagBytes), "cudaMalloc"));
  RETURN_IF_ERROR(
      CudaStatus(cudaMallocHost(&host_flag_, kFlagBytes), "cudaMallocHost"));
  RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(flag_, 0, kFlagBytes, stream_),
                             "cudaMemsetAsync"));
  RETURN_IF_ERROR(CudaStatus(
      cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming),
      "cudaEventCreate"));
  if (!options_.blas) return absl::OkStatus();
  RETURN_IF_ERROR(CublasStatus(cublasCreate(&handle_), "cublasCreate"));
  RETURN_IF_ERROR(
      CublasStatus(cublasSetStream(handle_, stream_), "cublasSetStream"));
  RETURN_IF_ERROR(CublasStatus(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH),
                               "cublasSetMathMode"));
  RETURN_IF_ERROR(CudaStatus(
      cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes), "cudaMalloc"));
  RETURN_IF_ERROR(CublasStatus(
      cublasSetWorkspace(handle_, cublas_workspace_, kCublasWorkspaceBytes),
      "cublasSetWorkspace"));
  RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&lt_), "cublasLtCreate"));
  // cublas_gemmex: the legacy cublasGemmEx path (plus a copy for a
  // separate output), for A/B measurements.
  use_lt_ = !options_.cublas_gemmex;
  autotune_ = std::max(0, std::min(kMaxLtAutotune, options_.lt_autotune));
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaBackend::Allocate(int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("allocate: bytes must be >= 0, got ", bytes));
  }
  void* p = nullptr;
  cudaSetDevice(device_);
  const cudaError_t err = cudaMalloc(&p, bytes == 0 ? 256 : size_t(bytes));
  if (err != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocate: cudaMalloc of ", bytes, " bytes on ", name_,
                     " failed: ", cudaGetErrorString(err)));
  }
  return p;
}
absl::StatusOr<void*> CudaBackend::AllocateHost(int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("allocate host: bytes must be >= 0, got ", bytes));
  }
  void* p = nullptr;
  cudaSetDevice(device_);
  const cudaError_t err =
      cudaHostAlloc(&p, bytes == 0 ? 256 : size_t(bytes),
                    cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocate host: cudaHostAlloc of ", bytes,
                     " bytes of pinned host memory for ", name_,
                     " failed: ", cudaGetErrorString(err),
                     " (host state needs that much page-locked memory: "
                     "check ulimit -l and the container's memory limit)"));
  }
  // The kernels take the host address as is: that needs unified addressing
  // (every 64-bit Linux CUDA device has it), where the mapped device
  // pointer is the host pointer.
  void* device_view = nullptr;
  if (cudaHostGetDevicePointer(&device_view, p, 0) != cudaSuccess ||
      device_view != p) {
    cudaFreeHost(p);
    return absl::FailedPreconditionError(absl::StrCat(
        "allocate host: ", name_,
        " does not address mapped host memory at its host address (no "
        "unified addressing): state_location host is not available"));
  }
  return p;
}

void CudaBackend::FreeHost(void* ptr) {
  if (ptr == nullptr) return;
  cudaStreamSynchronize(stream_);
  cudaFreeHost(ptr);
}

absl::StatusOr<MemoryInfo> CudaBackend::Memory() {
  cudaSetDevice(device_);
  size_t free_bytes = 0, total_bytes = 0;
  RETURN_IF_ERROR(
      CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  return MemoryInfo{int64_t(free_bytes), int64_t(total_bytes)};
}

void CudaBackend::Free(void* ptr) {
  if (ptr == nullptr) return;
  cudaStreamSynchronize(stream_);
  cudaFree(ptr);
}

absl::Status CudaBackend::Memset0(const MatrixView& v) {
  RETURN_IF_ERROR(CheckView(v, "memset0"));
  if (v.numel() == 0) return absl::OkStatus();
  const size_t es = DTypeSize(v.dtype);
  return CudaStatus(
      cudaMemset2DAsync(v.data, size_t(Ld(v)) * es, 0, size_t(v.cols) * es,
                        size_t(v.rows), stream_),
      "memset0");
}
absl::Status CudaBackend::CopyFromHost(void* dst, const void* src,
                                       int64_t bytes) {
  if (bytes <= 0) return absl::OkStatus();
  return CudaStatus(
      cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDefault, stream_),
      "copy from host");
}
absl::Status CudaBackend::CopyToHost(void* dst, const void* src,
                                     int64_t bytes) {
  if (bytes <= 0) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDefault, stream_),
      "copy to host"));
  return CudaStatus(cudaStreamSynchronize(stream_), "copy to host sync");
}
absl::Status CudaBackend::Copy2D(const MatrixView& dst, const MatrixView& src) {
  RETURN_IF_ERROR(CheckCopy(dst, src));
  if (src.numel() == 0) return absl::OkStatus();
  if (dst.dtype == src.dtype) {
    if (dst.data == src.data && Ld(dst) == Ld(src)) return absl::OkStatus();
    const size_t es = DTypeSize(src.dtype);
    if (dst.contiguous() && src.contiguous()) {
      // One run of bytes: a plain copy (a 2-D copy's row pitch is bounded,
      // and a whole state buffer may be gigabytes).
      return CudaStatus(cudaMemcpyAsync(dst.data, src.data, src.numel() * es,
                                        cudaMemcpyDefault, stream_),
                        "copy2d");
    }
    return CudaStatus(
        cudaMemcpy2DAsync(dst.data, size_t(Ld(dst)) * es, src.data,
                          size_t(Ld(src)) * es, size_t(src.cols) * es,
                          size_t(src.rows), cudaMemcpyDefault, stream_),
        "copy2d");
  }
  return CudaStatus(cuda_kernels::Copy2DConvert(K(dst), K(src), stream_),
                    "copy2d convert");
}

void CudaBackend::PushRange(const char* name) { nvtxRangePushA(name); }
void CudaBackend::PopRange() { nvtxRangePop(); }

absl::Status CudaBackend::Synchronize() {
  return CudaStatus(cudaStreamSynchronize(stream_), "synchronize");
}

absl::StatusOr<int> CudaBackend::TimeMark() {
  // An event recorded under a graph capture would be a node of the graph,
  // not a time of this run.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamIsCapturing(stream_, &capture), "time mark"));
  if (capture != cudaStreamCaptureStatusNone) {
    return absl::FailedPreconditionError(
        "time mark: the stream is being captured into a CUDA graph");
  }
  if (time_marks_used_ == int(time_marks_.size())) {
    // An event belongs to the device current at its creation.
    cudaSetDevice(device_);
    cudaEvent_t event = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&event), "time mark"));
    time_marks_.push_back(event);
  }
  RETURN_IF_ERROR(CudaStatus(
      cudaEventRecord(time_marks_[time_marks_used_], stream_), "time mark"));
  return time_marks_used_++;
}

absl::StatusOr<double> CudaBackend::MarkedUs(int from, int to) {
  if (from < 0 || to < 0 || from >= time_marks_used_ ||
      to >= time_marks_used_) {
    return absl::OutOfRangeError(
        absl::StrCat("time marks ", from, " and ", to, ": ", time_marks_used_,
                     " were made since ClearTimeMarks"));
  }
  float ms = 0;
  RETURN_IF_ERROR(
      CudaStatus(cudaEventElapsedTime(&ms, time_marks_[from], time_marks_[to]),
                 "time between marks"));
  return 1e3 * double(ms);
}

}  // namespace cuda_backend_internal

using cuda_backend_internal::CudaBackend;

bool CudaDeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

CudaGraphCounts GetCudaGraphCounts(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda == nullptr ? CudaGraphCounts{} : cuda->graph_counts();
}

absl::StatusOr<std::unique_ptr<Backend>> CudaBackend::NewStream() {
  // Copies and elementwise work only: no cuBLAS memory.
  CudaBackendOptions options = options_;
  options.blas = false;
  return MakeCudaBackend(device_, options);
}

absl::Status CudaBackend::OrderBefore(Backend& later) {
  if (&later == this) return absl::OkStatus();
  cudaSetDevice(device_);
  cudaError_t err = cudaEventRecord(order_event_, stream_);
  if (err == cudaSuccess) {
    err = cudaStreamWaitEvent(static_cast<cudaStream_t>(later.stream()),
                              order_event_, 0);
  }
  return CudaStatus(err, "order before");
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    int device, const CudaBackendOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        "MakeCudaBackend: no CUDA device is visible on this machine");
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MakeCudaBackend: device must be in [0, ", count, "), got ", device));
  }
  auto backend = std::make_unique<CudaBackend>(device, options);
  RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace muond
