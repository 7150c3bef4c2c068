#include "server/daemon/memory_mapper.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace muond {
namespace {

class ShmMapping : public MappedRegion {
 public:
  ShmMapping(void* base, uint64_t size) : base_(base), size_(size) {}
  ~ShmMapping() override { munmap(base_, size_); }
  void* base() const override { return base_; }
  uint64_t size() const override { return size_; }

 private:
  void* base_;
  uint64_t size_;
};

absl::Status ShmError(const std::string& field, const std::string& name,
                      const char* what) {
  const std::string text = absl::StrCat(
      field, ": cannot ", what, " shm object '", name, "': ", strerror(errno));
  if (errno == ENOENT) return absl::NotFoundError(text);
  if (errno == EACCES || errno == EPERM) {
    return absl::PermissionDeniedError(text);
  }
  return absl::UnavailableError(text);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedRegion>> HandleOpener::OpenShm(
    const std::string& name, uint64_t byte_size, const std::string& field) {
  // A NUL would end the name shm_open sees early: "/x\0junk" opens "/x",
  // escaping the one-name-per-object rule of region_table.
  if (name.size() < 2 || name[0] != '/' ||
      name.find('/', 1) != std::string::npos || name.size() > 250 ||
      name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shm_name '", absl::CEscape(name),
                     "' must be '/' followed by a name without '/' or NUL"));
  }
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ShmError(field, name, "open");
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status s = ShmError(field, name, "stat");
    close(fd);
    return s;
  }
  if (st.st_size <= 0) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": shm object '", name, "' is empty"));
  }
  if (static_cast<uint64_t>(st.st_size) < byte_size) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shm object '", name, "' has ", st.st_size,
                     " bytes, fewer than the region's byte_size ", byte_size));
  }
  // Only the declared bytes are mapped: the region, not the object, bounds
  // every view.
  void* base =
      mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return ShmError(field, name, "map");
  return std::unique_ptr<MappedRegion>(new ShmMapping(base, byte_size));
}

absl::StatusOr<std::unique_ptr<MappedRegion>> HandleOpener::OpenCudaIpc(
    const std::string&, uint64_t, int, const std::string& field) {
  return absl::FailedPreconditionError(
      absl::StrCat(field,
                   ": kind MEMORY_KIND_CUDA_IPC needs a daemon started with "
                   "--device; this one runs in --host mode (use "
                   "MEMORY_KIND_HOST_SHM)"));
}

}  // namespace muond
