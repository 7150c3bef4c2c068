#pragma once
// A POSIX shared-memory object mapped into this process: the host-mode way a
// trainer shares parameter and gradient memory with its daemon: one region
// (client.h HostRegion; docs/ARCHITECTURE.md "Memory registration").
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace muond {

class ShmRegion {
 public:
  // Creates `name` (shm_open style: "/muond-job-r0", mode 0600, must not
  // exist yet) of `bytes` bytes, zero-filled, and maps it read/write. The
  // object is unlinked when the region is destroyed (the daemon's mapping,
  // opened before that, stays valid until it unmaps).
  // Errors: InvalidArgument (name not "/x" without further '/', bytes == 0),
  // AlreadyExists, Unavailable (shm_open/ftruncate/mmap failures, errno text).
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Create(
      const std::string& name, size_t bytes);
  // Maps an existing object read/write; it is not unlinked on destruction.
  // Errors: NotFound, Unavailable.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Open(
      const std::string& name);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  const std::string& name() const { return name_; }
  void* data() const { return data_; }
  size_t size() const { return size_; }
  bool Contains(const void* p, size_t bytes) const;

  // Bump allocation inside the region, `align`-byte aligned (power of two).
  // ResourceExhausted when it does not fit.
  absl::StatusOr<void*> Allocate(size_t bytes, size_t align = 64);
  size_t used() const { return used_; }

 private:
  ShmRegion(std::string name, void* data, size_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner) {}

  std::string name_;
  void* data_;
  size_t size_;
  bool owner_;
  size_t used_ = 0;
};

}  // namespace muond
