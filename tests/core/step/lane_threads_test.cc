// LaneThreads runs each lane's work once per Run, on the same thread every
// time (threads are created once, not per step), and concurrently.
#include "core/step/lane_threads.h"

#include <atomic>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

TEST(LaneThreads, EachLaneRunsOncePerRunOnItsOwnFixedThread) {
  constexpr int kLanes = 3;
  auto created = LaneThreads::Create(kLanes);
  ASSERT_TRUE(created.ok()) << created.status();
  LaneThreads& threads = **created;
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
  auto created = LaneThreads::Create(kLanes);
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
  auto created = LaneThreads::Create(5, starter);
  ASSERT_FALSE(created.ok());
  EXPECT_EQ(created.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(created.status().message().find("lane 3 of 5"), std::string::npos)
      << created.status();
  EXPECT_EQ(started.load(), 2);
  EXPECT_EQ(finished.load(), 2);
}

}  // namespace
}  // namespace muond
