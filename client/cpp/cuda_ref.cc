// CudaRegion: the allocation holding a device pointer as a MEMORY_KIND_CUDA_IPC
// region (its IPC handle, size and device); CudaRef: a view's byte offset in
// it. The CUDA driver is loaded with dlopen so the client library links and
// runs on hosts without CUDA (CudaRegion then returns Unavailable). Driver-API
// IPC handles are the runtime's cudaIpcMemHandle_t bytes, so the daemon opens
// them with cudaIpcOpenMemHandle. The calling thread must have the device's
// context current (any CUDA runtime call on that device makes it so).
#include <cuda.h>
#include <dlfcn.h>

#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "client/cpp/view_util.h"

namespace muond {
namespace {

struct Driver {
  CUresult (*get_address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*ipc_get_mem_handle)(CUipcMemHandle*, CUdeviceptr) = nullptr;
  CUresult (*pointer_get_attribute)(void*, CUpointer_attribute,
                                    CUdeviceptr) = nullptr;
  bool ok = false;
};

const Driver& LoadDriver() {
  static const Driver driver = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return d;
    d.get_address_range = reinterpret_cast<decltype(d.get_address_range)>(
        dlsym(lib, "cuMemGetAddressRange_v2"));
    d.ipc_get_mem_handle = reinterpret_cast<decltype(d.ipc_get_mem_handle)>(
        dlsym(lib, "cuIpcGetMemHandle"));
    d.pointer_get_attribute =
        reinterpret_cast<decltype(d.pointer_get_attribute)>(
            dlsym(lib, "cuPointerGetAttribute"));
    d.ok =
        d.get_address_range && d.ipc_get_mem_handle && d.pointer_get_attribute;
    return d;
  }();
  return driver;
}

}  // namespace

absl::StatusOr<CudaAllocation> CudaRegion(const void* ptr, std::string name) {
  const Driver& cu = LoadDriver();
  if (!cu.ok) {
    return absl::UnavailableError(
        "CudaRegion: the CUDA driver (libcuda.so.1) is not available");
  }
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr);
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (CUresult r = cu.get_address_range(&base, &bytes, p); r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaRegion '", name,
        "': pointer is not in a CUDA allocation (cuMemGetAddressRange error ",
        int(r), "; is its device's context current?)"));
  }
  CUipcMemHandle handle;
  if (CUresult r = cu.ipc_get_mem_handle(&handle, base); r != CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat(
        "CudaRegion '", name, "': cuIpcGetMemHandle failed with error ", int(r),
        " (memory from a pool or cuMemCreate cannot be shared by IPC)"));
  }
  int device = -1;
  cu.pointer_get_attribute(&device, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
  CudaAllocation allocation;
  allocation.base = reinterpret_cast<const void*>(base);
  v1::MemoryRegion& region = allocation.region;
  region.set_name(std::move(name));
  region.set_kind(v1::MEMORY_KIND_CUDA_IPC);
  region.set_cuda_ipc_handle(
      std::string(handle.reserved, sizeof(handle.reserved)));
  region.set_byte_size(bytes);
  region.set_device(device);
  return allocation;
}

absl::StatusOr<v1::TensorRef> CudaRef(const CudaAllocation& allocation,
                                      const void* ptr, v1::DType dtype,
                                      std::vector<int64_t> shape,
                                      std::vector<int64_t> strides) {
  absl::StatusOr<int64_t> span = ViewSpanBytes(dtype, shape, &strides);
  if (!span.ok()) return span.status();
  const auto* base = static_cast<const char*>(allocation.base);
  const auto* at = static_cast<const char*>(ptr);
  const uint64_t bytes = allocation.region.byte_size();
  if (at < base || uint64_t(at - base) > bytes ||
      uint64_t(*span) > bytes - uint64_t(at - base)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaRef: view of ", *span, " bytes does not lie inside region '",
        allocation.region.name(), "' (", bytes, " bytes)"));
  }
  return MakeTensorRef(allocation.region.name(), uint64_t(at - base), dtype,
                       shape, strides);
}

}  // namespace muond
