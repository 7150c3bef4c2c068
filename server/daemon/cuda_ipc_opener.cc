// CUDA IPC handles: cudaIpcOpenMemHandle of the trainer's allocation base, on
// the daemon's device. Kept apart so the host build path needs no CUDA.
#include <cuda.h>  // CUresult, CUdeviceptr only: no libcuda link
#include <cuda_runtime_api.h>

#include <cstring>
#include <optional>

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

// Bytes of the allocation `base` starts from, by cuMemGetAddressRange (got
// through the runtime's driver entry point, so the daemon needs no libcuda
// link); nullopt when the driver does not answer (then the declared size is
// trusted, as before).
std::optional<uint64_t> AllocationBytesFrom(void* base) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const GetAddressRange fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000,
                                         cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return GetAddressRange{nullptr};
    }
    return reinterpret_cast<GetAddressRange>(f);
  }();
  if (fn == nullptr) return std::nullopt;
  CUdeviceptr range_base = 0;
  size_t range_bytes = 0;
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(base);
  if (fn(&range_base, &range_bytes, p) != CUDA_SUCCESS || p < range_base) {
    return std::nullopt;
  }
  return uint64_t(range_base + range_bytes - p);
}

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
    auto mapping = std::make_unique<IpcMapping>(base, byte_size, device_);
    // A byte_size past the allocation would let views reach other memory
    // of the daemon's device (or fault the kernels).
    if (std::optional<uint64_t> bytes = AllocationBytesFrom(base);
        bytes && byte_size > *bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": byte_size ", byte_size, " is larger than the ", *bytes,
          " bytes of the CUDA allocation its handle opens"));
    }
    return std::unique_ptr<MappedRegion>(std::move(mapping));
  }

 private:
  int device_;
};

}  // namespace

std::unique_ptr<HandleOpener> MakeCudaHandleOpener(int device) {
  return std::make_unique<CudaHandleOpener>(device);
}

}  // namespace muond
