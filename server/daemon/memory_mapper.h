#pragma once
// Mapping trainer memory regions (docs/ARCHITECTURE.md "Memory
// registration"). A MappedRegion is one opened region (a POSIX shm object
// mapped read/write, or a CUDA IPC allocation opened in this process); it
// unmaps/closes on destruction. The daemon maps each region a registration
// declares once (server/daemon/region_table.h) and keeps it until the params
// are unregistered.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace muond {

class MappedRegion {
 public:
  virtual ~MappedRegion() = default;
  // Base of the mapping in the daemon's address space (host, or device for
  // CUDA IPC) and its size in bytes.
  virtual void* base() const = 0;
  virtual uint64_t size() const = 0;
};

class HandleOpener {
 public:
  virtual ~HandleOpener() = default;
  // shm_open + fstat + mmap of the object's first `byte_size` (> 0) bytes.
  // InvalidArgument for a malformed name or an object smaller than
  // `byte_size`, NotFound when it does not exist, FailedPrecondition when
  // empty, PermissionDenied / Unavailable for other errno values; messages
  // name `field` and the object.
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> OpenShm(
      const std::string& name, uint64_t byte_size, const std::string& field);
  // cudaIpcOpenMemHandle of a 64-byte handle of an allocation on `device`,
  // of which the region covers the first `byte_size` (> 0) bytes. This base
  // implementation (host mode) answers FailedPrecondition.
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaIpc(
      const std::string& handle, uint64_t byte_size, int device,
      const std::string& field);
};

// The CUDA IPC opener for a daemon on `device` (cuda_ipc_opener.cc; links
// cudart). Shm handles are opened as in HandleOpener.
std::unique_ptr<HandleOpener> MakeCudaHandleOpener(int device);

}  // namespace muond
