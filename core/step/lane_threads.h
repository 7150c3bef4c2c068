#pragma once
// The threads that run the engine's lanes (lanes.h) concurrently: one per
// lane, started when the engine is created and joined when it is destroyed,
// so a step starts no thread.
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace muond {

// A fixed set of threads, one per lane, started at construction and joined
// at destruction, so a step starts no thread.
class LaneThreads {
 public:
  // Starts a thread (tests inject one that fails).
  using ThreadStarter = std::function<std::thread(std::function<void()>)>;

  // Starts `lanes` threads. ResourceExhausted naming the lane count when the
  // system refuses a thread (a pids or memory limit: a daemon with hundreds
  // of independent groups runs one thread per group); the threads already
  // started are joined, so a refused engine leaves none behind.
  static absl::StatusOr<std::unique_ptr<LaneThreads>> Create(
      int lanes, const ThreadStarter& start_thread = nullptr);
  ~LaneThreads();
  LaneThreads(const LaneThreads&) = delete;
  LaneThreads& operator=(const LaneThreads&) = delete;

  // Runs work(l) on thread l for every lane l and returns once all have
  // returned. One Run at a time.
  void Run(const std::function<void(int lane)>& work);

 private:
  LaneThreads() = default;
  void Stop();
  void Loop(int lane);

  absl::Mutex mu_;
  absl::CondVar changed_;
  const std::function<void(int)>* work_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Bumped by each Run; a thread runs once per generation.
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace muond
