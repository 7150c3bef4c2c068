#include "server/daemon/memory_mapper.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/common/echo.h"
#include "server/common/open_files.h"

namespace muond {
namespace {

// The longest shm name accepted after its '/' (NAME_MAX 255 minus room).
constexpr size_t kMaxShmNameBytes = 250;

// A mapped shm object. The descriptor stays open so CheckStillBacked can
// fstat the object the trainer may have shrunk since (by name it might have
// been unlinked and replaced).
class ShmMapping : public MappedRegion {
 public:
  ShmMapping(std::string name, int fd, void* base, uint64_t size,
             std::string identity)
      : name_(std::move(name)),
        fd_(fd),
        base_(base),
        size_(size),
        identity_(std::move(identity)) {}
  ~ShmMapping() override {
    munmap(base_, size_);
    close(fd_);
  }
  void* base() const override { return base_; }
  uint64_t size() const override { return size_; }
  std::string identity() const override { return identity_; }

  // One fstat. The object can still shrink between this check and the last
  // byte the step touches (see Registration::RecheckMemory for why that
  // window is accepted).
  absl::Status CheckStillBacked(const std::string& field) const override {
    struct stat st;
    if (fstat(fd_, &st) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": cannot stat shm object '", Echo(name_),
                       "': ", strerror(errno)));
    }
    if (st.st_size < 0 || static_cast<uint64_t>(st.st_size) < size_) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": shm object '", Echo(name_), "' shrank to ", st.st_size,
          " bytes, below the region's registered byte_size ", size_,
          " (the trainer truncated it); nothing was stepped: restore its "
          "size or register again"));
    }
    return absl::OkStatus();
  }

 private:
  std::string name_;
  int fd_;
  void* base_;
  uint64_t size_;
  std::string identity_;
};

absl::Status ShmError(const std::string& field, const std::string& name,
                      const char* what) {
  const int err = errno;
  const std::string text =
      absl::StrCat(field, ": cannot ", what, " shm object '", Echo(name),
                   "': ", strerror(err), OpenFilesAdvice(err));
  if (err == ENOENT) {
    return absl::NotFoundError(absl::StrCat(
        text,
        " (the daemon must see the trainer's /dev/shm: the same host and "
        "IPC namespace, e.g. one container or a shared /dev/shm mount)"));
  }
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(text);
  if (err == EMFILE || err == ENFILE) return absl::ResourceExhaustedError(text);
  // O_NOFOLLOW refuses a symbolic link, and a directory is no object: the
  // name, not the daemon, is wrong (UNAVAILABLE would invite a retry).
  if (err == ELOOP) {
    return absl::InvalidArgumentError(
        absl::StrCat(text, " (a symbolic link: name the shm object itself)"));
  }
  // A directory (shm_open answers EINVAL for one), a socket.
  const bool not_regular = err == EISDIR || err == ENXIO ||
                           (err == EINVAL && std::string(what) == "open");
  if (not_regular) {
    return absl::FailedPreconditionError(
        absl::StrCat(text, " (not a regular shm object)"));
  }
  if (err == ENOMEM) return absl::ResourceExhaustedError(text);
  return absl::UnavailableError(text);
}

bool IsControl(char c) {
  return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
}

// '/' then a single path component: no further '/', no NUL (shm_open would
// see "/x\0junk" as "/x", escaping the one-name-per-object rule of
// region_table), no control bytes, not "." or ".." (which name /dev/shm
// itself or its parent, not an object).
absl::Status CheckShmName(const std::string& name, const std::string& field) {
  const std::string rest = name.empty() ? "" : name.substr(1);
  const bool ok = name.size() >= 2 && name[0] == '/' &&
                  rest.size() <= kMaxShmNameBytes &&
                  rest.find('/') == std::string::npos &&
                  std::none_of(rest.begin(), rest.end(), IsControl) &&
                  rest != "." && rest != "..";
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": shm_name '", Echo(name), "' must be '/' followed by 1..",
      kMaxShmNameBytes,
      " bytes without '/', NUL or control bytes, other than '.' and '..'"));
}

// `owner`: the uid whose objects are mapped; nullopt maps any user's.
absl::Status CheckObject(const struct stat& st, const std::string& name,
                         uint64_t byte_size, std::optional<uid_t> owner,
                         const std::string& field) {
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": shm object '", Echo(name), "' is not a regular file"));
  }
  if (owner && st.st_uid != *owner) {
    return absl::PermissionDeniedError(absl::StrCat(
        field, ": shm object '", Echo(name), "' belongs to uid ", st.st_uid,
        ", not to this daemon's uid ", *owner,
        "; the daemon maps only its own user's objects (start muond with "
        "--allow_foreign_shm to lift this)"));
  }
  if (st.st_size <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": shm object '", Echo(name), "' is empty"));
  }
  if (static_cast<uint64_t>(st.st_size) < byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shm object '", Echo(name), "' has ", st.st_size,
                     " bytes, fewer than the region's byte_size ", byte_size));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int> HandleOpener::OpenShmFile(const std::string& name,
                                              uint64_t byte_size,
                                              const std::string& field,
                                              struct stat* st) const {
  if (absl::Status s = CheckShmName(name, field); !s.ok()) return s;
  // O_NOFOLLOW: a symlink planted in /dev/shm must not redirect the mapping.
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) return ShmError(field, name, "open");
  if (fstat(fd, st) != 0) {
    absl::Status s = ShmError(field, name, "stat");
    close(fd);
    return s;
  }
  if (absl::Status s =
          CheckObject(*st, name, byte_size,
                      allow_foreign_shm_ ? std::nullopt
                                         : std::optional<uid_t>(shm_owner_uid_),
                      field);
      !s.ok()) {
    close(fd);
    return s;
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<MappedRegion>> HandleOpener::OpenShm(
    const std::string& name, uint64_t byte_size, const std::string& field) {
  struct stat st;
  absl::StatusOr<int> opened = OpenShmFile(name, byte_size, field, &st);
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  // Only the declared bytes are mapped: the region, not the object, bounds
  // every view.
  void* base =
      mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    absl::Status s = ShmError(field, name, "map");
    close(fd);
    return s;
  }
  return std::unique_ptr<MappedRegion>(
      new ShmMapping(name, fd, base, byte_size,
                     absl::StrCat("shm-inode:", st.st_dev, ":", st.st_ino)));
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
