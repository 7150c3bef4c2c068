// CUDA IPC handles: cudaIpcOpenMemHandle of the trainer's allocation base, on
// the daemon's device. Kept apart so the host build path needs no CUDA.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "server/daemon/memory_mapper.h"

namespace muond {
namespace {

class IpcMapping : public MappedRegion {
 public:
  IpcMapping(void* base, uint64_t size, int device)
      : base_(base), size_(size), device_(device) {}
  ~IpcMapping() override {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(base_);
  }
  void* base() const override { return base_; }
  uint64_t size() const override { return size_; }

 private:
  void* base_;
  uint64_t size_;
  int device_;
};

class CudaHandleOpener : public HandleOpener {
 public:
  explicit CudaHandleOpener(int device) : device_(device) {}

  absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaIpc(
      const std::string& handle, uint64_t byte_size, int device,
      const std::string& field) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": cuda_ipc_handle has ", handle.size(),
                       " bytes, needs ", sizeof(cudaIpcMemHandle_t)));
    }
    if (device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": memory on cuda:", device,
                       " but this daemon serves cuda:", device_));
    }
    cudaIpcMemHandle_t h;
    memcpy(&h, handle.data(), sizeof(h));
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return absl::UnavailableError(absl::StrCat(
          field, ": cudaSetDevice(", device_, "): ", cudaGetErrorString(e)));
    }
    void* base = nullptr;
    cudaError_t e =
        cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": cudaIpcOpenMemHandle failed: ", cudaGetErrorString(e),
          " (stale or foreign handle?)"));
    }
    return std::unique_ptr<MappedRegion>(
        new IpcMapping(base, byte_size, device_));
  }

 private:
  int device_;
};

}  // namespace

std::unique_ptr<HandleOpener> MakeCudaHandleOpener(int device) {
  return std::make_unique<CudaHandleOpener>(device);
}

}  // namespace muond
