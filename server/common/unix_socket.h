#pragma once
// Private Unix-domain listening sockets (docs/ARCHITECTURE.md "Security and
// state"): the socket file lives in a directory only the current user can write
// and is chmod 0600 once the server has bound it.
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muond {

// True for "unix:" addresses; `path` receives the file path.
bool ParseUnixAddress(const std::string& address, std::string* path);

// The longest Unix socket path a gRPC listener binds (105 bytes on Linux:
// sun_path's 107 less what gRPC 1.51 refuses).
size_t MaxUnixSocketPathBytes();

// Before binding: refuses a relative path or one longer than
// MaxUnixSocketPathBytes (InvalidArgument naming `flag`, the length and the
// limit); checks that the parent directory of `path` exists, is owned
// by this user (or is root-owned and sticky, like /tmp) and is not writable by
// others unless sticky; removes a stale socket file at `path` (only a socket
// of this user, never a regular file, and only when nobody listens on it:
// see CheckSocketIsStale). FailedPrecondition naming the path otherwise,
// "address in use by a live process" when a server answers on it.
absl::Status PrepareUnixSocketPath(const std::string& path,
                                   std::string_view flag = "--listen");

// connect()s to the socket file `path`: OK when refused (or gone), i.e. the
// file is stale; FailedPrecondition "address in use by a live process" when
// the connect succeeds; FailedPrecondition for other errors (EACCES, ...).
absl::Status CheckSocketIsStale(const std::string& path);

// The default directory for a daemon's socket: $XDG_RUNTIME_DIR/muond when
// XDG_RUNTIME_DIR is set (a per-user 0700 directory), else /tmp/muond-<uid>.
// Created mode 0700 when missing; FailedPrecondition when it exists but is
// not a directory owned by this user with no group/other access.
absl::StatusOr<std::string> PrivateSocketDir();

// After binding: chmod 0600 and verify ownership. FailedPrecondition naming
// the path when the file is missing or cannot be restricted.
absl::Status RestrictUnixSocket(const std::string& path);

}  // namespace muond
