#include "server/common/open_files.h"

#include <dirent.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"

namespace muond {
namespace {

// The server raised its soft limit to the hard one at start: what is left to
// raise is the hard limit, where the server is started.
constexpr char kRaiseHint[] =
    "raise the hard limit where the server starts: `ulimit -Hn N; ulimit -n N` "
    "in its shell, or LimitNOFILE=N in its systemd unit (server/README.md "
    "\"Open files\")";

// The most descriptors the kernel allows one process (fs.nr_open): the
// ceiling for a soft limit when the hard one is unlimited.
rlim_t KernelOpenFileCeiling() {
  std::ifstream nr_open("/proc/sys/fs/nr_open");
  rlim_t ceiling = 0;
  if (nr_open >> ceiling && ceiling > 0) return ceiling;
  return 1 << 20;  // Linux's default nr_open
}

// The descriptors this process holds, or nullopt when /proc cannot be read
// (at EMFILE opendir itself needs a descriptor).
std::optional<int> CountOpenFiles() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return std::nullopt;
  int count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the directory's own descriptor
}

std::string LimitText(rlim_t value) {
  return value == RLIM_INFINITY ? std::string("unlimited")
                                : absl::StrCat(value);
}

}  // namespace

absl::StatusOr<OpenFileLimit> RaiseOpenFileLimit() {
  struct rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return absl::UnavailableError(
        absl::StrCat("getrlimit(RLIMIT_NOFILE): ", strerror(errno)));
  }
  OpenFileLimit out{limit.rlim_cur, limit.rlim_cur, limit.rlim_max};
  const rlim_t target = limit.rlim_max == RLIM_INFINITY
                            ? KernelOpenFileCeiling()
                            : limit.rlim_max;
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < target) {
    limit.rlim_cur = target;
    if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
      return absl::UnavailableError(absl::StrCat(
          "setrlimit(RLIMIT_NOFILE) to ", target, ": ", strerror(errno)));
    }
    out.soft = target;
  }
  return out;
}

std::string DescribeOpenFileLimit(const OpenFileLimit& limit) {
  return absl::StrCat("open files (RLIMIT_NOFILE): soft limit ",
                      LimitText(limit.soft), " (was ",
                      LimitText(limit.soft_before), "), hard limit ",
                      LimitText(limit.hard));
}

std::string OpenFilesAdvice(int err) {
  if (err == ENFILE) {
    return "; the system's open-file table is full (sysctl fs.file-max): "
           "close files elsewhere or raise fs.file-max";
  }
  if (err != EMFILE) return "";
  struct rlimit limit {};
  getrlimit(RLIMIT_NOFILE, &limit);
  const std::optional<int> open = CountOpenFiles();
  return absl::StrCat("; this process has ",
                      open ? absl::StrCat(*open)
                           : absl::StrCat("all ", LimitText(limit.rlim_cur)),
                      " open files of its soft limit ",
                      LimitText(limit.rlim_cur), " (RLIMIT_NOFILE, hard limit ",
                      LimitText(limit.rlim_max), "): ", kRaiseHint);
}

}  // namespace muond
