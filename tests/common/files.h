#pragma once
// Files the tests that run real servers read and wait for: a whole file, a
// file to appear (a server's port or socket), and this process's open
// descriptors (a step channel let go of, or not).
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace muond::testing {

// The file's contents; "" when it cannot be read.
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Whether `path` exists within `timeout` (polled every 20 ms).
inline bool WaitForFile(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  struct stat st;
  while (stat(path.c_str(), &st) != 0) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// Whether this process has a descriptor of a file whose path starts with
// `prefix`.
inline bool HoldsDescriptorOf(const std::string& prefix) {
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::string target =
        std::filesystem::read_symlink(entry.path(), error).string();
    if (!error && target.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

}  // namespace muond::testing
