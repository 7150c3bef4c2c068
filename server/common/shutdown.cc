#include "server/common/shutdown.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <utility>

namespace muond {
namespace {

// Self-pipe: the handler only write()s the signal number (async-signal-safe),
// whichever thread the kernel picks; the watcher thread reads it.
int g_pipe[2] = {-1, -1};

void OnShutdownSignal(int signum) {
  const char byte = static_cast<char>(signum);
  [[maybe_unused]] ssize_t n = write(g_pipe[1], &byte, 1);
}

}  // namespace

void InstallShutdownSignalHandler() {
  if (g_pipe[0] < 0 && pipe2(g_pipe, O_CLOEXEC) != 0) return;
  struct sigaction action = {};
  action.sa_handler = OnShutdownSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

ShutdownSignalWatcher::ShutdownSignalWatcher(std::function<void(int)> on_signal)
    : thread_([this, on_signal = std::move(on_signal)] {
        char byte = 0;
        while (true) {
          const ssize_t n = read(g_pipe[0], &byte, 1);
          if (n == 1) break;
          if (n < 0 && errno == EINTR) continue;
          return;
        }
        if (!cancelled_.load() && byte != 0) on_signal(byte);
      }) {}

ShutdownSignalWatcher::~ShutdownSignalWatcher() {
  cancelled_.store(true);
  const char wake = 0;  // unblocks read() if no signal came
  [[maybe_unused]] ssize_t n = write(g_pipe[1], &wake, 1);
  thread_.join();
}

}  // namespace muond
