#include "server/common/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/common/echo.h"

namespace muond {

bool ParseUnixAddress(const std::string& address, std::string* path) {
  constexpr absl::string_view kTriple = "unix://";
  constexpr absl::string_view kSingle = "unix:";
  if (absl::StartsWith(address, kTriple)) {
    *path = address.substr(kTriple.size());
    return true;
  }
  if (absl::StartsWith(address, kSingle)) {
    *path = address.substr(kSingle.size());
    return true;
  }
  return false;
}

size_t MaxUnixSocketPathBytes() {
  // sun_path holds 107 bytes and a NUL on Linux, but gRPC's listener (1.51)
  // refuses paths of 106 and 107 bytes ("Path name should not have more than
  // 107 characters", then "address in use?"): measured, 105 is the longest
  // it binds, so that is the bound said up front.
  return sizeof(sockaddr_un::sun_path) - 3;
}

absl::Status PrepareUnixSocketPath(const std::string& path,
                                   std::string_view flag) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(flag), ": unix socket path '", Echo(path),
                     "' must be absolute"));
  }
  // bind() would fail with a misleading errno (gRPC reports "address in
  // use?"); say what is wrong before trying.
  if (path.size() > MaxUnixSocketPathBytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(flag), ": unix socket path '", Echo(path), "' is ",
        path.size(), " bytes, longer than the ", MaxUnixSocketPathBytes(),
        " bytes a Unix socket address holds (choose a shorter path)"));
  }
  const std::string dir = path.substr(0, path.rfind('/'));
  struct stat st;
  if (stat(dir.empty() ? "/" : dir.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory '", dir, "' is not usable: ", strerror(errno)));
  }
  const bool sticky = (st.st_mode & S_ISVTX) != 0;
  const bool mine = st.st_uid == geteuid();
  const bool others_write = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
  if (!mine && !(st.st_uid == 0 && sticky)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory '", dir,
        "' belongs to another user and is not a sticky root directory"));
  }
  if (others_write && !sticky) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket directory '", dir,
                     "' is writable by other users and not sticky"));
  }
  struct stat old;
  if (lstat(path.c_str(), &old) == 0) {
    if (!S_ISSOCK(old.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "'", path, "' exists and is not a socket; refusing to replace it"));
    }
    if (old.st_uid != geteuid()) {
      return absl::FailedPreconditionError(
          absl::StrCat("socket '", path, "' belongs to another user"));
    }
    if (absl::Status live = CheckSocketIsStale(path); !live.ok()) return live;
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot remove stale socket '", path, "': ", strerror(errno)));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSocketIsStale(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() > MaxUnixSocketPathBytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unix socket path '", Echo(path), "' is longer than ",
                     MaxUnixSocketPathBytes(), " bytes"));
  }
  memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("socket(AF_UNIX): ", strerror(errno)));
  }
  const int rc =
      connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int connect_errno = errno;
  close(fd);
  if (rc == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "unix socket '", path,
        "': address in use by a live process (another muond is serving "
        "it; stop it or choose another --listen)"));
  }
  if (connect_errno == ECONNREFUSED || connect_errno == ENOENT) {
    return absl::OkStatus();  // nobody listens: a stale file
  }
  return absl::FailedPreconditionError(
      absl::StrCat("unix socket '", path, "' exists and cannot be probed (",
                   strerror(connect_errno), "); refusing to replace it"));
}

absl::StatusOr<std::string> PrivateSocketDir() {
  const char* xdg = getenv("XDG_RUNTIME_DIR");
  const std::string dir = (xdg != nullptr && xdg[0] == '/')
                              ? absl::StrCat(xdg, "/muond")
                              : absl::StrCat("/tmp/muond-", geteuid());
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot create socket directory '", dir, "': ", strerror(errno)));
  }
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
      st.st_uid != geteuid() || (st.st_mode & 0077) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory '", dir,
        "' must be a directory owned by this user with mode 0700"));
  }
  return dir;
}

absl::Status RestrictUnixSocket(const std::string& path) {
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot chmod 0600 socket '", path, "': ", strerror(errno)));
  }
  struct stat st;
  if (lstat(path.c_str(), &st) != 0 || st.st_uid != geteuid() ||
      (st.st_mode & 0077) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket '", path, "' is not private (0600, owned by us)"));
  }
  return absl::OkStatus();
}

}  // namespace muond
