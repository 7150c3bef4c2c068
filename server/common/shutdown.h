#pragma once
// Clean shutdown on SIGTERM/SIGINT: the signals are blocked in every thread
// and one watcher thread takes them with sigwait, so the handler may do
// anything (grpc::Server::Shutdown, unlink) instead of only _exit.
#include <atomic>
#include <functional>
#include <thread>

namespace muond {

// Blocks SIGTERM and SIGINT in the calling thread and in every thread it
// starts afterwards. Call first thing in main, before any thread exists.
void BlockShutdownSignals();

class ShutdownSignalWatcher {
 public:
  // Starts the watcher thread; `on_signal(signum)` runs on it once, at the
  // first SIGTERM/SIGINT. BlockShutdownSignals() must have run before.
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
