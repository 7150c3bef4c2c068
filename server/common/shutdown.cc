#include "server/common/shutdown.h"

#include <pthread.h>
#include <signal.h>

#include <utility>

namespace muond {
namespace {

sigset_t ShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

}  // namespace

void BlockShutdownSignals() {
  const sigset_t set = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

ShutdownSignalWatcher::ShutdownSignalWatcher(std::function<void(int)> on_signal)
    : thread_([this, on_signal = std::move(on_signal)] {
        const sigset_t set = ShutdownSignals();
        int signum = 0;
        while (sigwait(&set, &signum) != 0) {
        }
        if (!cancelled_.load()) on_signal(signum);
      }) {}

ShutdownSignalWatcher::~ShutdownSignalWatcher() {
  cancelled_.store(true);
  // Wakes sigwait if no signal came (the signal is blocked, so it goes to
  // the watcher's sigwait and nowhere else); harmless after one came.
  pthread_kill(thread_.native_handle(), SIGTERM);
  thread_.join();
}

}  // namespace muond
