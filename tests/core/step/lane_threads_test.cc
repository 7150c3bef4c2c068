// LaneThreads runs each lane's work once per Run, on the same thread every
// time (threads are created once, not per step), and concurrently.
#include "core/step/lane_threads.h"

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

TEST(LaneThreads, EachLaneRunsOncePerRunOnItsOwnFixedThread) {
  constexpr int kLanes = 3;
  LaneThreads threads(kLanes);
  std::vector<std::thread::id> first(kLanes);
  std::vector<int> runs(kLanes, 0);
  for (int step = 0; step < 5; ++step) {
    std::vector<std::thread::id> ids(kLanes);
    threads.Run([&](int lane) {
      ids[lane] = std::this_thread::get_id();
      ++runs[lane];
    });
    if (step == 0) first = ids;
    EXPECT_EQ(ids, first) << "step " << step;
  }
  EXPECT_EQ(runs, std::vector<int>(kLanes, 5));
  const std::set<std::thread::id> distinct(first.begin(), first.end());
  EXPECT_EQ(distinct.size(), size_t(kLanes));
  EXPECT_FALSE(distinct.contains(std::this_thread::get_id()));
}

TEST(LaneThreads, LanesRunConcurrently) {
  // Every lane waits for all the others: this only returns if all lanes run
  // at the same time (as lanes blocked in collectives must).
  constexpr int kLanes = 4;
  LaneThreads threads(kLanes);
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

}  // namespace
}  // namespace muond
