#pragma once
// Clean shutdown on SIGTERM/SIGINT: the signal handler only writes to a
// pipe (async-signal-safe) and one watcher thread reads it and runs the
// callback, so the callback may do anything (grpc::Server::Shutdown, unlink)
// instead of only _exit.
#include <atomic>
#include <functional>
#include <thread>

namespace muond {

// Installs the SIGTERM/SIGINT handler (from then on the signals no longer
// kill the process; a ShutdownSignalWatcher acts on them). Call first thing
// in main. One watcher per process at a time.
void InstallShutdownSignalHandler();

class ShutdownSignalWatcher {
 public:
  // Starts the watcher thread; `on_signal(signum)` runs on it once, at the
  // first SIGTERM/SIGINT (also one that came before the watcher started).
  // InstallShutdownSignalHandler() must have run before.
  explicit ShutdownSignalWatcher(std::function<void(int)> on_signal);
  // Stops the thread without calling `on_signal` when no signal came, and
  // waits for it (and for a running `on_signal`).
  ~ShutdownSignalWatcher();

  ShutdownSignalWatcher(const ShutdownSignalWatcher&) = delete;
  ShutdownSignalWatcher& operator=(const ShutdownSignalWatcher&) = delete;

 private:
  std::atomic<bool> cancelled_{false};
  std::thread thread_;
};

}  // namespace muond
