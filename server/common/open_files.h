#pragma once
// The servers' open-file limit (RLIMIT_NOFILE). A daemon holds one
// descriptor per mapped shm region besides its sockets; the common soft
// limit of 1024 is far below the hard limit on most systems, so both servers
// raise the soft limit to the hard one at start (BeginServerMain), and an
// open that still fails for lack of descriptors says what to change.
#include <sys/resource.h>

#include <string>

#include "absl/status/statusor.h"

namespace muond {

struct OpenFileLimit {
  rlim_t soft_before = 0;  // the soft limit the process started with
  rlim_t soft = 0;         // the soft limit now
  rlim_t hard = 0;
};

// Sets the soft RLIMIT_NOFILE to the hard limit (capped at the kernel's
// fs.nr_open when the hard limit is unlimited). Unavailable naming the
// errno when getrlimit/setrlimit fail; the limit is then unchanged.
absl::StatusOr<OpenFileLimit> RaiseOpenFileLimit();

// The limit in words for the start-up log line.
std::string DescribeOpenFileLimit(const OpenFileLimit& limit);

// For an open that failed with `err` EMFILE or ENFILE: this process's open
// files and its limit (or the system's table being full) and what to change
// (`ulimit -n`, systemd LimitNOFILE=); "" for any other errno.
std::string OpenFilesAdvice(int err);

}  // namespace muond
