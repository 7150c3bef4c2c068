#pragma once
// The worker threads that run the engine's lanes (lanes.h): a fixed pool,
// started when the engine is created and joined when it is destroyed, so a
// step starts no thread. Lanes queue on it in order; each lane runs on one
// worker at a time, so its groups keep their order.
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"

namespace muond {

// The most lane workers an engine starts unless told otherwise
// (StepOptions::lane_workers): a daemon with thousands of independent groups
// would otherwise run as many threads, each calling the BLAS at once
// (OpenBLAS sizes its buffers for a fixed number of concurrent callers).
inline constexpr int kMaxLaneWorkers = 32;

// The number of workers for `lanes` lanes: `requested` (> 0) or else the
// machine's cores, capped by kMaxLaneWorkers; never more than `lanes`, never
// below 1.
int LaneWorkerCount(int lanes, int requested);

// A fixed pool of worker threads, started at construction and joined at
// destruction, so a step starts no thread.
//
// Why a pool smaller than the lane count cannot deadlock ranks whose lanes
// wait on each other in collectives: every rank queues its lanes in the
// order of their first group, and ranks register the groups they share in
// one order (the per-group domain agreement runs in that order and needs it
// already). So the earliest unfinished lane of the job waits on no rank:
// every lane queued before it on any rank has finished, so each of its ranks
// has started it, and its collectives complete.
class LaneThreads {
 public:
  // Starts a thread (tests inject one that fails).
  using ThreadStarter = std::function<std::thread(std::function<void()>)>;

  // Starts `workers` threads (>= 1) for `lanes` lanes. ResourceExhausted
  // naming the worker count when the system refuses a thread (a pids or
  // memory limit); the threads already started are joined, so a refused
  // engine leaves none behind.
  static absl::StatusOr<std::unique_ptr<LaneThreads>> Create(
      int lanes, int workers, const ThreadStarter& start_thread = nullptr);
  ~LaneThreads();
  LaneThreads(const LaneThreads&) = delete;
  LaneThreads& operator=(const LaneThreads&) = delete;

  int workers() const { return int(threads_.size()); }

  // Runs work(l) once for every lane l, lanes taken by the workers in order
  // of l, and returns once all have returned. One Run at a time.
  void Run(const std::function<void(int lane)>& work);

 private:
  explicit LaneThreads(int lanes) : lanes_(lanes), next_lane_(lanes) {}
  void Stop();
  void Loop();

  const int lanes_;
  // std::mutex rather than absl::Mutex: ThreadSanitizer sees the hand-off
  // of a step's state to the workers through it even where absl is a system
  // library built without TSan (CONTRIBUTING.md).
  std::mutex mu_;
  std::condition_variable changed_;
  // Guarded by mu_:
  const std::function<void(int)>* work_ = nullptr;
  // The next lane a free worker takes; lanes_ when none is queued.
  int next_lane_;
  // Lanes of this Run not yet returned.
  int unfinished_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace muond
