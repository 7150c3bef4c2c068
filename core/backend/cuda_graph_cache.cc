#include "core/backend/cuda_graph_cache.h"

#include "core/backend/cuda_status.h"

namespace muond::cuda_backend_internal {
namespace {

// Captures `work` on the stream and instantiates it; nullptr when the
// work failed or was not capturable (a host sync, an allocation, ...),
// with the capture ended and the error state cleared, so the caller can
// run `work` directly. ThreadLocal mode: only this thread's calls are
// checked (other groups' threads may allocate meanwhile).
cudaGraphExec_t Capture(cudaStream_t stream,
                        const std::function<absl::Status()>& work) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) !=
      cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  const absl::Status status = work();
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  cudaGraphExec_t exec = nullptr;
  if (status.ok() && end == cudaSuccess && graph != nullptr &&
      cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    exec = nullptr;
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();  // clear the (non-sticky) error of a failed capture
  return exec;
}

}  // namespace

absl::Status CudaGraphCache::Run(cudaStream_t stream, uint64_t key,
                                 const std::function<absl::Status()>& work) {
  if (!enabled_ || uncapturable_.contains(key)) return work();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  absl::Status status = CudaStatus(cudaStreamIsCapturing(stream, &capturing),
                                   "run graph: capture status");
  if (!status.ok()) return status;
  // Inside another RunGraph's capture: part of that graph.
  if (capturing != cudaStreamCaptureStatusNone) return work();
  cudaGraphExec_t exec = nullptr;
  if (auto it = by_key_.find(key); it != by_key_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    exec = it->second->second;
  } else if (evicted_.contains(key)) {
    uncapturable_.insert(key);
    ++counts_.uncached;
    return work();
  } else {
    exec = Capture(stream, work);
    if (exec == nullptr) {
      uncapturable_.insert(key);
      ++counts_.fallbacks;
      return work();
    }
    ++counts_.captures;
    Insert(key, exec);
  }
  ++counts_.launches;
  return CudaStatus(cudaGraphLaunch(exec, stream), "run graph: launch");
}

void CudaGraphCache::Insert(uint64_t key, cudaGraphExec_t exec) {
  lru_.emplace_front(key, exec);
  by_key_.emplace(key, lru_.begin());
  if (int64_t(lru_.size()) > kCudaGraphsKept) {
    // A launched exec may be destroyed: CUDA frees it after it ran.
    if (int64_t(evicted_.size()) >= 16 * kCudaGraphsKept) evicted_.clear();
    evicted_.insert(lru_.back().first);
    by_key_.erase(lru_.back().first);
    cudaGraphExecDestroy(lru_.back().second);
    lru_.pop_back();
  }
}

void CudaGraphCache::Clear() {
  for (auto& [key, exec] : lru_) cudaGraphExecDestroy(exec);
  lru_.clear();
  by_key_.clear();
}

}  // namespace muond::cuda_backend_internal
