// LaneThreads runs each lane's work once per Run on a fixed pool of workers
// (created once, not per step), lanes taken in order, concurrently up to the
// pool's size.
#include "core/step/lane_threads.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

TEST(LaneThreads, EveryLaneRunsOncePerRunOnTheWorkersStartedWithThePool) {
  // 7 lanes on 3 workers: each Run runs every lane once, on the pool's own
  // threads (never the caller's, never a thread started by the Run).
  constexpr int kLanes = 7, kWorkers = 3;
  auto created = LaneThreads::Create(kLanes, kWorkers);
  ASSERT_TRUE(created.ok()) << created.status();
  LaneThreads& threads = **created;
  EXPECT_EQ(threads.workers(), kWorkers);
  std::mutex mu;  // not absl::Mutex: TSan sees std::mutex (CONTRIBUTING.md)
  std::set<std::thread::id> seen;
  std::vector<int> runs(kLanes, 0);
  for (int step = 0; step < 5; ++step) {
    threads.Run([&](int lane) {
      std::lock_guard<std::mutex> lock(mu);
      seen.insert(std::this_thread::get_id());
      ++runs[lane];
    });
  }
  EXPECT_EQ(runs, std::vector<int>(kLanes, 5));
  EXPECT_LE(seen.size(), size_t(kWorkers));
  EXPECT_FALSE(seen.contains(std::this_thread::get_id()));
}

TEST(LaneThreads, OneWorkerRunsTheLanesInOrder) {
  // Lanes are taken in order (what keeps ranks whose lanes meet in
  // collectives from waiting on each other); one worker shows the order.
  auto created = LaneThreads::Create(6, 1);
  ASSERT_TRUE(created.ok()) << created.status();
  std::vector<int> ran;
  (*created)->Run([&](int lane) { ran.push_back(lane); });
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

TEST(LaneThreads, AtMostTheWorkersRunAtOnce) {
  constexpr int kLanes = 9, kWorkers = 2;
  auto created = LaneThreads::Create(kLanes, kWorkers);
  ASSERT_TRUE(created.ok()) << created.status();
  std::mutex mu;  // not absl::Mutex: TSan sees std::mutex (CONTRIBUTING.md)
  int running = 0, most = 0, ran = 0;
  (*created)->Run([&](int) {
    {
      std::lock_guard<std::mutex> lock(mu);
      most = std::max(most, ++running);
    }
    std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    --running;
    ++ran;
  });
  EXPECT_EQ(ran, kLanes);
  EXPECT_LE(most, kWorkers);
}

TEST(LaneThreads, LanesRunConcurrentlyWhenEveryLaneHasAWorker) {
  // Every lane waits for all the others: this only returns if all lanes run
  // at the same time (as lanes blocked in collectives must).
  constexpr int kLanes = 4;
  auto created = LaneThreads::Create(kLanes, kLanes);
  ASSERT_TRUE(created.ok()) << created.status();
  LaneThreads& threads = **created;
  for (int step = 0; step < 3; ++step) {
    absl::Barrier* barrier = new absl::Barrier(kLanes);
    std::atomic<int> passed = 0;
    threads.Run([&](int) {
      if (barrier->Block()) delete barrier;
      ++passed;
    });
    EXPECT_EQ(passed.load(), kLanes);
  }
}

TEST(LaneWorkerCount, RequestedOrTheCoresCappedNeverMoreThanTheLanes) {
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  EXPECT_EQ(LaneWorkerCount(1000, 0), std::min(cores, kMaxLaneWorkers));
  EXPECT_EQ(LaneWorkerCount(1, 0), 1);
  EXPECT_EQ(LaneWorkerCount(1000, 5), 5);
  EXPECT_EQ(LaneWorkerCount(3, 5), 3);
  EXPECT_EQ(LaneWorkerCount(1000, 200), 200);  // an explicit choice stands
  EXPECT_EQ(LaneWorkerCount(0, 0), 1);
}

TEST(LaneThreads, RefusedThreadIsAnErrorAndLeavesNoThreadRunning) {
  // The system refuses the third thread (as under a pids limit): Create
  // answers ResourceExhausted naming the lane count instead of letting
  // std::system_error escape (which aborted the daemon), and the two threads
  // it had started are joined.
  std::atomic<int> started = 0;
  std::atomic<int> finished = 0;
  auto starter = [&](std::function<void()> loop) {
    if (started == 2) {
      throw std::system_error(
          std::make_error_code(std::errc::resource_unavailable_try_again));
    }
    ++started;
    return std::thread([&finished, loop = std::move(loop)] {
      loop();
      ++finished;
    });
  };
  auto created = LaneThreads::Create(8, 5, starter);
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(created.status().message().find("worker thread 3 of 5 for 8 lanes"),
            std::string::npos)
      << created.status();
  EXPECT_EQ(started.load(), 2);
  EXPECT_EQ(finished.load(), 2);
}

}  // namespace
}  // namespace muond
