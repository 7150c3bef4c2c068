// When a step channel polls for its next request: from `poll` before the
// request is due (the last one plus the interval before it) to `poll` after,
// once an interval, never before two requests or for steps shorter than
// twice the poll.
#include "server/daemon/request_poll.h"

#include <chrono>

#include "gtest/gtest.h"

namespace muond {
namespace {

using std::chrono::milliseconds;
const RequestPoll::Clock::time_point kStart{};

TEST(RequestPollTest, PollsAroundTheNextRequestOnceTwoHaveCome) {
  RequestPoll poll(milliseconds(1));
  EXPECT_FALSE(poll.Next().has_value());
  poll.Arrived(kStart);
  EXPECT_FALSE(poll.Next().has_value());  // no interval yet
  poll.Arrived(kStart + milliseconds(30));
  const std::optional<RequestPoll::Window> w = poll.Next();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->from, kStart + milliseconds(59));
  EXPECT_EQ(w->until, kStart + milliseconds(61));
  // The next interval is the one measured last.
  poll.Arrived(kStart + milliseconds(50));
  EXPECT_EQ(poll.Next()->from, kStart + milliseconds(69));
}

TEST(RequestPollTest, ASpentWindowWaitsForTheNextRequest) {
  RequestPoll poll(milliseconds(1));
  poll.Arrived(kStart);
  poll.Arrived(kStart + milliseconds(10));
  poll.Spent();
  EXPECT_FALSE(poll.Next().has_value());
  poll.Arrived(kStart + milliseconds(100));  // after a pause
  ASSERT_TRUE(poll.Next().has_value());
  EXPECT_EQ(poll.Next()->from, kStart + milliseconds(189));
}

TEST(RequestPollTest, ShortIntervalsAndNoPollNeverPoll) {
  RequestPoll poll(milliseconds(2));
  poll.Arrived(kStart);
  poll.Arrived(kStart + milliseconds(3));  // under 2 x 2 ms
  EXPECT_FALSE(poll.Next().has_value());
  poll.Arrived(kStart + milliseconds(7));  // 4 ms: just enough
  EXPECT_TRUE(poll.Next().has_value());

  RequestPoll off(RequestPoll::Clock::duration::zero());
  off.Arrived(kStart);
  off.Arrived(kStart + milliseconds(100));
  EXPECT_FALSE(off.Next().has_value());
}

// StepChannelOptions::request_poll set far past any use (absl's infinite
// duration is nanoseconds' largest): capped, the window stays about the
// request it was for, not overflowed into the past.
TEST(RequestPollTest, AnEndlessPollIsCapped) {
  RequestPoll poll(RequestPoll::Clock::duration::max());
  const RequestPoll::Clock::time_point start = kStart + std::chrono::hours(24);
  poll.Arrived(start);
  poll.Arrived(start + std::chrono::seconds(3));
  const std::optional<RequestPoll::Window> w = poll.Next();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->from, start + std::chrono::milliseconds(5900));
  EXPECT_EQ(w->until, start + std::chrono::milliseconds(6100));
}

}  // namespace
}  // namespace muond
