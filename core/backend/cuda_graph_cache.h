#pragma once
// The CUDA backend's graph cache behind Backend::RunGraph: the stream's work
// for a key is captured once (cudaStreamBeginCapture, thread-local mode) into
// a cudaGraphExec and relaunched; the kCudaGraphsKept most recently used
// execs are kept, older ones destroyed, and a key that comes back after its
// eviction runs directly from then on (more keys in use than execs kept: a
// cycle through them would otherwise capture on every call). Work that cannot
// be captured runs directly, and its key is never tried again. Not thread-safe
// (one per backend instance).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "core/backend/cuda_backend.h"

namespace muond::cuda_backend_internal {

class CudaGraphCache {
 public:
  // `enabled` false (CudaBackendOptions::cuda_graphs off): Run = work().
  explicit CudaGraphCache(bool enabled) : enabled_(enabled) {}
  ~CudaGraphCache() { Clear(); }
  CudaGraphCache(const CudaGraphCache&) = delete;
  CudaGraphCache& operator=(const CudaGraphCache&) = delete;

  // Runs `work` on `stream` as the cached graph of `key` (captured on first
  // use); inside another capture, `work` joins that graph instead.
  absl::Status Run(cudaStream_t stream, uint64_t key,
                   const std::function<absl::Status()>& work);

  // Destroys every cached exec (the backend does so before its stream goes).
  void Clear();

  CudaGraphCounts counts() const { return counts_; }

 private:
  // Evicts the least recently used exec beyond kCudaGraphsKept.
  void Insert(uint64_t key, cudaGraphExec_t exec);

  const bool enabled_;
  // Most recently used first, at most kCudaGraphsKept.
  std::list<std::pair<uint64_t, cudaGraphExec_t>> lru_;
  absl::flat_hash_map<uint64_t, decltype(lru_)::iterator> by_key_;
  // Keys run directly: not capturable, or back after an eviction.
  absl::flat_hash_set<uint64_t> uncapturable_;
  // Keys whose exec was evicted (cleared when it grows past a bound: keys of
  // old plans never come back).
  absl::flat_hash_set<uint64_t> evicted_;
  CudaGraphCounts counts_;
};

}  // namespace muond::cuda_backend_internal
