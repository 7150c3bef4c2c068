#pragma once
// Runs one function per rank in forked child processes, for multi-process
// communicator tests. Fork before anything creates threads or touches CUDA.
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace muond::testing {

// Forks `size` children; child r runs fn(r) and exits with its result
// (0 = pass). Returns each child's exit code, or 128 + signal when killed.
inline std::vector<int> RunRanks(int size, const std::function<int(int)>& fn) {
  std::fflush(nullptr);  // children must not re-flush the parent's buffers
  std::vector<pid_t> pids;
  for (int rank = 0; rank < size; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = fn(rank);
      std::fflush(nullptr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) {
      codes.push_back(-1);
    } else if (WIFEXITED(status)) {
      codes.push_back(WEXITSTATUS(status));
    } else {
      codes.push_back(128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0));
    }
  }
  return codes;
}

// A fresh directory under the test's temporary directory.
inline std::string MakeTempDir() {
  const char* base = getenv("TEST_TMPDIR");
  std::string tmpl = std::string(base ? base : "/tmp") + "/muond-comm-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return "";
  return std::string(buf.data());
}

}  // namespace muond::testing
