// CudaRef: the IPC handle of the allocation holding a device pointer, plus
// the pointer's byte offset in it. The CUDA driver is loaded with dlopen so
// the client library links and runs on hosts without CUDA (CudaRef then
// returns Unavailable). Driver-API IPC handles are the runtime's
// cudaIpcMemHandle_t bytes, so the daemon opens them with
// cudaIpcOpenMemHandle. The calling thread must have the device's context
// current (any CUDA runtime call on that device makes it so).
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

absl::StatusOr<v1::TensorRef> CudaRef(const void* ptr, v1::DType dtype,
                                      std::vector<int64_t> shape,
                                      std::vector<int64_t> strides) {
  absl::StatusOr<int64_t> span = ViewSpanBytes(dtype, shape, &strides);
  if (!span.ok()) return span.status();
  const Driver& cu = LoadDriver();
  if (!cu.ok) {
    return absl::UnavailableError(
        "CudaRef: the CUDA driver (libcuda.so.1) is not available");
  }
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr);
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (CUresult r = cu.get_address_range(&base, &bytes, p); r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CudaRef: pointer is not in a CUDA allocation (cuMemGetAddressRange "
        "error ",
        int(r), "; is its device's context current?)"));
  }
  const uint64_t offset = p - base;
  if (offset + uint64_t(*span) > bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaRef: view of ", *span, " bytes at offset ", offset,
                     " runs past its allocation of ", bytes, " bytes"));
  }
  CUipcMemHandle handle;
  if (CUresult r = cu.ipc_get_mem_handle(&handle, base); r != CUDA_SUCCESS) {
    return absl::UnavailableError(absl::StrCat(
        "CudaRef: cuIpcGetMemHandle failed with error ", int(r),
        " (memory from a pool or cuMemCreate cannot be shared by IPC)"));
  }
  int device = -1;
  cu.pointer_get_attribute(&device, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
  v1::TensorRef ref;
  ref.set_kind(v1::CUDA_IPC);
  ref.set_cuda_ipc_handle(
      std::string(handle.reserved, sizeof(handle.reserved)));
  ref.set_allocation_bytes(bytes);
  ref.set_byte_offset(offset);
  ref.set_dtype(dtype);
  ref.set_device(device);
  for (int64_t d : shape) ref.add_shape(d);
  for (int64_t s : strides) ref.add_strides(s);
  return ref;
}

}  // namespace muond
