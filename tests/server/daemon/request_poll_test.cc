// When a step channel polls for its next request: from `poll` before the
// request is due (the last answer plus the trainer's last turn, from an
// answer to its next request) to `poll` after, once a turn, never before a
// turn was measured or for requests less than twice the poll apart.
#include "server/daemon/request_poll.h"

#include <chrono>

#include "gtest/gtest.h"

namespace muond {
namespace {

using std::chrono::milliseconds;
const RequestPoll::Clock::time_point kStart{};

TEST(RequestPollTest, PollsAroundTheNextRequestOnceATurnWasMeasured) {
  RequestPoll poll(milliseconds(1));
  EXPECT_FALSE(poll.Next().has_value());
  poll.Arrived(kStart);
  poll.Answered(kStart + milliseconds(20));
  EXPECT_FALSE(poll.Next().has_value());    // no turn yet
  poll.Arrived(kStart + milliseconds(30));  // a 10 ms turn
  EXPECT_FALSE(poll.Next().has_value());    // not answered yet
  poll.Answered(kStart + milliseconds(50));
  const std::optional<RequestPoll::Window> w = poll.Next();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->from, kStart + milliseconds(59));
  EXPECT_EQ(w->until, kStart + milliseconds(61));
}

// The daemon's step varies from step to step; the trainer's turn (its
// forward and backward) does not. Counted from the answer, the window moves
// with the step and stays on the request: a step 5 ms longer than the last
// still finds its next request polled for.
TEST(RequestPollTest, ALongerStepMovesTheWindowWithIt) {
  RequestPoll poll(milliseconds(1));
  poll.Arrived(kStart);
  poll.Answered(kStart + milliseconds(20));  // a 20 ms step
  poll.Arrived(kStart + milliseconds(30));   // a 10 ms turn
  poll.Answered(kStart + milliseconds(55));  // then a 25 ms step
  const std::optional<RequestPoll::Window> w = poll.Next();
  ASSERT_TRUE(w.has_value());
  // The next request comes 10 ms after this answer, at 65 ms; the interval
  // between the last two requests (30 ms) would have put it at 60.
  EXPECT_LE(w->from, kStart + milliseconds(65));
  EXPECT_GT(w->until, kStart + milliseconds(65));
  EXPECT_EQ(w->from, kStart + milliseconds(64));
}

TEST(RequestPollTest, ASpentWindowWaitsForTheNextRequest) {
  RequestPoll poll(milliseconds(1));
  poll.Arrived(kStart);
  poll.Answered(kStart + milliseconds(5));
  poll.Arrived(kStart + milliseconds(10));
  poll.Answered(kStart + milliseconds(15));
  ASSERT_TRUE(poll.Next().has_value());
  poll.Spent();
  EXPECT_FALSE(poll.Next().has_value());
  poll.Arrived(kStart + milliseconds(100));  // after a pause (an 85 ms turn)
  poll.Answered(kStart + milliseconds(105));
  ASSERT_TRUE(poll.Next().has_value());
  EXPECT_EQ(poll.Next()->from, kStart + milliseconds(189));
}

TEST(RequestPollTest, ShortIntervalsAndNoPollNeverPoll) {
  RequestPoll poll(milliseconds(2));
  poll.Arrived(kStart);
  poll.Answered(kStart + milliseconds(1));
  poll.Arrived(kStart + milliseconds(3));  // under 2 x 2 ms apart
  poll.Answered(kStart + milliseconds(4));
  EXPECT_FALSE(poll.Next().has_value());
  poll.Arrived(kStart + milliseconds(7));  // 4 ms: just enough
  poll.Answered(kStart + milliseconds(8));
  EXPECT_TRUE(poll.Next().has_value());

  RequestPoll off(RequestPoll::Clock::duration::zero());
  off.Arrived(kStart);
  off.Answered(kStart + milliseconds(10));
  off.Arrived(kStart + milliseconds(100));
  off.Answered(kStart + milliseconds(110));
  EXPECT_FALSE(off.Next().has_value());
}

// A request that was never answered leaves no turn to measure (Serve
// answers every request unless the channel ends; RequestPoll does not rely
// on it): the turn measured before it stays.
TEST(RequestPollTest, ATurnIsMeasuredFromTheLastRequestsAnswerOnly) {
  RequestPoll poll(milliseconds(1));
  poll.Arrived(kStart);
  poll.Answered(kStart + milliseconds(10));
  poll.Arrived(kStart + milliseconds(20));  // never answered
  poll.Arrived(kStart + milliseconds(40));
  poll.Answered(kStart + milliseconds(50));
  // The turn is still the one measured (10 ms), not 40 -> 10.
  ASSERT_TRUE(poll.Next().has_value());
  EXPECT_EQ(poll.Next()->from, kStart + milliseconds(59));
}

// StepChannelOptions::request_poll set far past any use (absl's infinite
// duration is nanoseconds' largest): capped, the window stays about the
// request it was for, not overflowed into the past.
TEST(RequestPollTest, AnEndlessPollIsCapped) {
  RequestPoll poll(RequestPoll::Clock::duration::max());
  const RequestPoll::Clock::time_point start = kStart + std::chrono::hours(24);
  poll.Arrived(start);
  poll.Answered(start + std::chrono::seconds(1));
  poll.Arrived(start + std::chrono::seconds(3));
  poll.Answered(start + std::chrono::seconds(4));
  const std::optional<RequestPoll::Window> w = poll.Next();
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->from, start + std::chrono::milliseconds(5900));
  EXPECT_EQ(w->until, start + std::chrono::milliseconds(6100));
}

}  // namespace
}  // namespace muond
