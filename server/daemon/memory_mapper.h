#pragma once
// Mapping trainer memory regions (docs/ARCHITECTURE.md "Memory
// registration"). A MappedRegion is one opened region (a POSIX shm object
// mapped read/write, or a CUDA IPC allocation opened in this process); it
// unmaps/closes on destruction. The daemon maps each region a registration
// declares once (server/daemon/region_table.h) and keeps it until the params
// are unregistered.
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

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
  // OK while the memory behind the mapping still covers size() bytes.
  // An shm object can be shrunk (ftruncate) by its owner after mapping;
  // touching a mapped page past its new end raises SIGBUS in the daemon, so
  // the daemon re-checks before every step (Registration::RecheckMemory).
  // FailedPrecondition naming `field`, the object and both sizes otherwise.
  // A CUDA IPC allocation cannot shrink, and stays valid while opened even
  // if the trainer frees it: always OK.
  virtual absl::Status CheckStillBacked(const std::string& /*field*/) const {
    return absl::OkStatus();
  }
  // Identifies the memory object (st_dev, st_ino of an shm object) so two
  // region names of one object (a hard link, a bind mount) are refused as
  // aliases; empty when the kind has no such identity.
  virtual std::string identity() const { return ""; }
};

class HandleOpener {
 public:
  virtual ~HandleOpener() = default;
  // shm_open + fstat + mmap of the object's first `byte_size` (> 0) bytes;
  // the descriptor stays open for CheckStillBacked (one per region: a
  // trainer packs its tensors into a few regions, so a daemon holds a few).
  // InvalidArgument for a malformed name ('/' then 1..250 bytes without '/',
  // NUL or control bytes, not "." or "..") or an object smaller than
  // `byte_size`, NotFound when it does not exist (the message says the
  // daemon must see the trainer's /dev/shm), InvalidArgument for a symbolic
  // link, FailedPrecondition when empty or not a regular file (a directory,
  // a socket), PermissionDenied when another user owns it (see
  // allow_foreign_shm) and for EACCES/EPERM, ResourceExhausted when the
  // daemon is out of descriptors (EMFILE/ENFILE: the message gives the count,
  // the limit and what to change) or memory, Unavailable for other errno
  // values; messages name `field` and the object.
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> OpenShm(
      const std::string& name, uint64_t byte_size, const std::string& field);
  // OpenShm's checks without the mapping: the object's descriptor (the
  // caller closes it) after the name, ownership and size rules, with its
  // fstat in `st`. The step channel reads its object with pread instead of
  // a mapping (step_channel.h).
  absl::StatusOr<int> OpenShmFile(const std::string& name, uint64_t byte_size,
                                  const std::string& field,
                                  struct stat* st) const;
  // cudaIpcOpenMemHandle of a 64-byte handle of an allocation on `device`,
  // of which the region covers the first `byte_size` (> 0) bytes. This base
  // implementation (host mode) answers FailedPrecondition.
  virtual absl::StatusOr<std::unique_ptr<MappedRegion>> OpenCudaIpc(
      const std::string& handle, uint64_t byte_size, int device,
      const std::string& field);

  // The ownership rule: an shm object is mapped only when it belongs to the
  // daemon's effective uid. A daemon run as root would otherwise map and
  // write any user's objects on a client's say-so. (gRPC exposes no Unix
  // peer credentials, so "the connected client's uid" cannot be checked
  // cheaply; muond-daemon --allow_foreign_shm lifts the rule for deployments
  // where trainers run as another user on purpose.)
  void set_allow_foreign_shm(bool allow) { allow_foreign_shm_ = allow; }
  // The uid whose objects are mapped: the effective uid (tests change it to
  // see the rule refuse their own objects without root).
  void set_shm_owner_uid(uid_t uid) { shm_owner_uid_ = uid; }

 private:
  bool allow_foreign_shm_ = false;
  uid_t shm_owner_uid_ = geteuid();
};

// The CUDA IPC opener for a daemon on `device` (cuda_ipc_opener.cc; links
// cudart). Shm handles are opened as in HandleOpener.
std::unique_ptr<HandleOpener> MakeCudaHandleOpener(int device);

}  // namespace muond
