#include "client/cpp/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace muond {
namespace {

absl::Status ErrnoStatus(const std::string& what, const std::string& name) {
  const std::string text =
      absl::StrCat(what, " shm object '", name, "': ", strerror(errno));
  if (errno == ENOENT) return absl::NotFoundError(text);
  if (errno == EEXIST) return absl::AlreadyExistsError(text);
  return absl::UnavailableError(text);
}

absl::Status ValidateName(const std::string& name) {
  if (name.size() < 2 || name[0] != '/' ||
      name.find('/', 1) != std::string::npos || name.size() > 250) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm name '", name,
                     "' must be '/' followed by 1..249 characters "
                     "without '/'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Create(
    const std::string& name, size_t bytes) {
  if (absl::Status st = ValidateName(name); !st.ok()) return st;
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm object '", name, "': size must be > 0"));
  }
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus("cannot create", name);
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    absl::Status st = ErrnoStatus("cannot size", name);
    close(fd);
    shm_unlink(name.c_str());
    return st;
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) {
    absl::Status st = ErrnoStatus("cannot map", name);
    shm_unlink(name.c_str());
    return st;
  }
  return std::unique_ptr<ShmRegion>(new ShmRegion(name, data, bytes, true));
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Open(
    const std::string& name) {
  if (absl::Status st = ValidateName(name); !st.ok()) return st;
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("cannot open", name);
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shm object '", name, "' is empty"));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data == MAP_FAILED) return ErrnoStatus("cannot map", name);
  return std::unique_ptr<ShmRegion>(new ShmRegion(name, data, bytes, false));
}

ShmRegion::~ShmRegion() {
  munmap(data_, size_);
  if (owner_) shm_unlink(name_.c_str());
}

bool ShmRegion::Contains(const void* p, size_t bytes) const {
  const auto* begin = static_cast<const char*>(data_);
  const auto* q = static_cast<const char*>(p);
  return q >= begin && bytes <= size_ && size_t(q - begin) <= size_ - bytes;
}

absl::StatusOr<void*> ShmRegion::Allocate(size_t bytes, size_t align) {
  if (align == 0 || (align & (align - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("align ", align, " is not a power of two"));
  }
  const size_t start = (used_ + align - 1) & ~(align - 1);
  if (start > size_ || bytes > size_ - start) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shm object '", name_, "': ", bytes, " bytes at offset ",
                     start, " exceed its ", size_, " bytes"));
  }
  used_ = start + bytes;
  return static_cast<char*>(data_) + start;
}

}  // namespace muond
