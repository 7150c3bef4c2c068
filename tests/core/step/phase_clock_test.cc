// PhaseClock times a step's phases without a host wait after each on a
// backend with time marks (a device queue, played here by a backend whose
// "device" clock the test advances), waits once per backend at Finish, and
// on a backend without marks (the CPU backend) times the wall clock after a
// wait per phase.
#include "core/step/phase_clock.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

// A queue whose work takes no host time: a phase "runs" by advancing
// device_us. A mark records the device clock; MarkedUs answers only after a
// Synchronize that followed the mark (as cudaEventElapsedTime needs the
// events complete), so a reading the clock did not wait for fails the test.
class MarkingBackend final : public testing::DelegatingBackend {
 public:
  bool is_device() const override { return true; }
  absl::StatusOr<int> TimeMark() override {
    if (fail_marks_after >= 0 && int(marks_.size()) >= fail_marks_after) {
      return absl::InternalError("no more marks");
    }
    marks_.push_back({device_us, false});
    return int(marks_.size()) - 1;
  }
  absl::StatusOr<double> MarkedUs(int from, int to) override {
    if (from < 0 || to >= int(marks_.size()) || from > to) {
      return absl::OutOfRangeError(absl::StrCat("marks ", from, ", ", to));
    }
    if (!marks_[from].waited || !marks_[to].waited) {
      return absl::FailedPreconditionError("read before the work finished");
    }
    return marks_[to].us - marks_[from].us;
  }
  void ClearTimeMarks() override {
    marks_.clear();
    ++clears;
  }
  absl::Status Synchronize() override {
    ++syncs;
    for (Mark& m : marks_) m.waited = true;
    return absl::OkStatus();
  }

  double device_us = 0;
  int syncs = 0;
  int clears = 0;
  int fail_marks_after = -1;  // TimeMark fails once this many were made

 private:
  struct Mark {
    double us;
    bool waited;
  };
  std::vector<Mark> marks_;
};

absl::Status RunOn(MarkingBackend& b, double us) {
  b.device_us += us;
  return absl::OkStatus();
}

TEST(PhaseClock, MarkedPhasesWaitOnceAtFinishAndAddTheirDeviceTime) {
  MarkingBackend b;
  PhaseClock clock;
  clock.Start();
  ASSERT_TRUE(
      clock.Time(b, "ns", &PhaseTimings::ns_us, [&] { return RunOn(b, 700); })
          .ok());
  b.device_us += 50;  // work outside any phase (a vote's copy) is not counted
  ASSERT_TRUE(clock
                  .Time(b, "update", &PhaseTimings::update_us,
                        [&] { return RunOn(b, 120); })
                  .ok());
  ASSERT_TRUE(clock
                  .Time(b, "adamw", &PhaseTimings::update_us,
                        [&] { return RunOn(b, 30); })
                  .ok());
  EXPECT_EQ(b.syncs, 0) << "a phase waited for its work";
  PhaseTimings t;
  t.update_us = 1;  // Finish adds; it does not overwrite
  ASSERT_TRUE(clock.Finish(t).ok());
  EXPECT_EQ(b.syncs, 1);
  EXPECT_DOUBLE_EQ(t.ns_us, 700);
  EXPECT_DOUBLE_EQ(t.update_us, 1 + 120 + 30);
  EXPECT_DOUBLE_EQ(t.momentum_us, 0);
}

TEST(PhaseClock, FinishWaitsForEveryBackendOnce) {
  MarkingBackend a, b;
  PhaseClock clock;
  clock.Start();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        clock.Time(a, "ns", &PhaseTimings::ns_us, [&] { return RunOn(a, 10); })
            .ok());
    ASSERT_TRUE(
        clock.Time(b, "ns", &PhaseTimings::ns_us, [&] { return RunOn(b, 100); })
            .ok());
  }
  PhaseTimings t;
  ASSERT_TRUE(clock.Finish(t).ok());
  EXPECT_EQ(a.syncs, 1);
  EXPECT_EQ(b.syncs, 1);
  EXPECT_DOUBLE_EQ(t.ns_us, 3 * 10 + 3 * 100);
}

TEST(PhaseClock, StartForgetsTheLastStepAndClearsItsMarks) {
  MarkingBackend b;
  PhaseClock clock;
  clock.Start();
  ASSERT_TRUE(
      clock.Time(b, "ns", &PhaseTimings::ns_us, [&] { return RunOn(b, 500); })
          .ok());
  // That step ended before its Finish (a refused commit).
  clock.Start();
  EXPECT_EQ(b.clears, 1);
  ASSERT_TRUE(
      clock.Time(b, "ns", &PhaseTimings::ns_us, [&] { return RunOn(b, 40); })
          .ok());
  PhaseTimings t;
  ASSERT_TRUE(clock.Finish(t).ok());
  EXPECT_DOUBLE_EQ(t.ns_us, 40);
}

TEST(PhaseClock, AFailedPhaseIsNotTimedAndDrainStillWaitsForItsWork) {
  MarkingBackend b;
  PhaseClock clock;
  clock.Start();
  const absl::Status failed = clock.Time(b, "ns", &PhaseTimings::ns_us, [&] {
    b.device_us += 300;  // issued before it failed
    return absl::InvalidArgumentError("bad view");
  });
  EXPECT_TRUE(absl::IsInvalidArgument(failed)) << failed;
  EXPECT_EQ(b.syncs, 0);
  ASSERT_TRUE(clock.Drain().ok());
  EXPECT_EQ(b.syncs, 1) << "the failed phase's work was not waited for";
  PhaseTimings t;
  ASSERT_TRUE(clock.Finish(t).ok());
  EXPECT_DOUBLE_EQ(t.ns_us, 0);
}

TEST(PhaseClock, APhaseWhoseEndCannotBeMarkedIsWaitedForAndUntimed) {
  MarkingBackend b;
  b.fail_marks_after = 1;  // the start mark, then no more
  PhaseClock clock;
  clock.Start();
  ASSERT_TRUE(
      clock.Time(b, "ns", &PhaseTimings::ns_us, [&] { return RunOn(b, 200); })
          .ok());
  EXPECT_EQ(b.syncs, 1);
  PhaseTimings t;
  ASSERT_TRUE(clock.Finish(t).ok());
  EXPECT_DOUBLE_EQ(t.ns_us, 0);
}

TEST(PhaseClock, WithoutMarksEachPhaseWaitsAndTakesItsWallTime) {
  // A backend without marks (the CPU backend's default), counting waits.
  class Counting final : public testing::DelegatingBackend {
   public:
    absl::Status Synchronize() override {
      ++syncs;
      return absl::OkStatus();
    }
    int syncs = 0;
  } b;
  ASSERT_FALSE(b.TimeMark().ok());
  PhaseClock clock;
  clock.Start();
  const absl::Time before = absl::Now();
  ASSERT_TRUE(clock
                  .Time(b, "ns", &PhaseTimings::ns_us,
                        [&] {
                          absl::SleepFor(absl::Milliseconds(20));
                          return absl::OkStatus();
                        })
                  .ok());
  const double elapsed_us = absl::ToDoubleMicroseconds(absl::Now() - before);
  EXPECT_EQ(b.syncs, 1);
  PhaseTimings t;
  ASSERT_TRUE(clock.Finish(t).ok());
  EXPECT_GE(t.ns_us, 20e3);
  EXPECT_LE(t.ns_us, elapsed_us);
  EXPECT_EQ(b.syncs, 1) << "Finish waited again for a backend without marks";
}

}  // namespace
}  // namespace muond
