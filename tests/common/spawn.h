#pragma once
// Test helpers that start the real binaries: their path in the runfiles and
// posix_spawn with the output in a log file. Shared by the startup tests, the
// system tests and the reliability harness.
#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace muond::testing {

// A data dependency's path under Bazel's runfiles (workspace "muond"), or,
// when MUOND_BIN_DIR is set, the binary of that name there (a relocatable
// bundle's bin/, deploy/bundle.sh, where there are no runfiles).
inline std::string Runfile(const std::string& path) {
  if (const char* bin = getenv("MUOND_BIN_DIR"); bin != nullptr && *bin) {
    return absl::StrCat(bin, "/", path.substr(path.rfind('/') + 1));
  }
  const char* dir = getenv("TEST_SRCDIR");
  return absl::StrCat(dir ? dir : ".", "/muond/", path);
}

// Starts `args` with stdout+stderr appended to `log` (or to `log` truncated
// first when `truncate`; inherited when `log` is empty); -1 on failure.
inline pid_t Spawn(const std::vector<std::string>& args,
                   const std::string& log = "", bool truncate = false) {
  std::vector<char*> argv;
  for (const std::string& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!log.empty()) {
    posix_spawn_file_actions_addopen(
        &actions, 1, log.c_str(),
        O_WRONLY | O_CREAT | (truncate ? O_TRUNC : O_APPEND), 0600);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  }
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) != 0)
    pid = -1;
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

}  // namespace muond::testing
