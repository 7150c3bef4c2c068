// EngineBuilder: a build's result comes back; an abandoned build is cancelled
// and keeps what it touches alive (shared ownership) however long it runs
// after the builder moved on or went away. Reference: counters and a
// use-count of the shared store, checked by hand.
#include "server/daemon/engine_builder.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace muond {
namespace {

// Stands for the rendezvous store a real factory shares.
struct Store {
  std::atomic<int> uses{0};
};

struct Control {
  std::atomic<bool> hold{false};   // wait until cancelled
  std::atomic<bool> stuck{false};  // wait until released, ignoring it
  std::atomic<bool> release{false};
  std::atomic<int> cancelled_seen{0};
  absl::Notification entered;
  std::atomic<int> ended{0};
};

EngineFactory MakeFactory(std::shared_ptr<Store> store,
                          std::shared_ptr<Control> control) {
  return [store, control](const Registration&, const v1::Plan& plan,
                          const std::function<bool()>& abandoned)
             -> absl::StatusOr<std::unique_ptr<StepEngine>> {
    if (!control->entered.HasBeenNotified()) control->entered.Notify();
    store->uses.fetch_add(1);
    absl::StatusOr<std::unique_ptr<StepEngine>> result =
        std::make_unique<StepEngine>();
    if (control->hold.load()) {
      while (!abandoned()) absl::SleepFor(absl::Milliseconds(1));
      control->cancelled_seen.fetch_add(1);
      result = absl::CancelledError("abandoned");
    } else if (control->stuck.load()) {
      while (!control->release.load()) absl::SleepFor(absl::Milliseconds(1));
      store->uses.fetch_add(1);  // touches the store after the builder died
    } else if (plan.version() == 13) {
      result = absl::DeadlineExceededError("rank 1 never came");
    }
    control->ended.fetch_add(1);
    return result;
  };
}

void WaitFor(const std::atomic<int>& counter, int n) {
  for (int i = 0; i < 4000 && counter.load() < n; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(counter.load(), n);
}

TEST(EngineBuilderTest, ReturnsTheFactorysResult) {
  auto store = std::make_shared<Store>();
  auto control = std::make_shared<Control>();
  EngineBuilder builder(MakeFactory(store, control));
  auto reg = std::make_shared<const Registration>();
  v1::Plan plan;
  plan.set_version(1);
  auto built = builder.Build(reg, plan, [] { return false; });
  ASSERT_TRUE(built.has_value());
  EXPECT_TRUE(built->ok()) << built->status();
  plan.set_version(13);
  built = builder.Build(reg, plan, [] { return false; });
  ASSERT_TRUE(built.has_value());
  EXPECT_EQ(built->status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(builder.abandoned_builds(), 0);
  EXPECT_EQ(store->uses.load(), 2);
}

TEST(EngineBuilderTest, AbandonCancelsTheBuildAndTheNextBuildJoinsIt) {
  auto store = std::make_shared<Store>();
  auto control = std::make_shared<Control>();
  EngineBuilder builder(MakeFactory(store, control));
  auto reg = std::make_shared<const Registration>();
  v1::Plan plan;
  plan.set_version(1);
  control->hold = true;
  std::atomic<bool> abandon{false};
  std::thread later([&] {
    control->entered.WaitForNotification();
    abandon = true;
  });
  EXPECT_FALSE(
      builder.Build(reg, plan, [&] { return abandon.load(); }).has_value());
  later.join();
  WaitFor(control->cancelled_seen, 1);
  EXPECT_EQ(builder.abandoned_builds(), 1);
  control->hold = false;
  auto built = builder.Build(reg, plan, [] { return false; });
  ASSERT_TRUE(built.has_value());
  EXPECT_TRUE(built->ok());
  EXPECT_EQ(builder.abandoned_builds(), 0) << "the ended build was joined";
}

TEST(EngineBuilderTest, AStuckBuildOutlivesTheBuilderAndKeepsItsStore) {
  auto store = std::make_shared<Store>();
  auto control = std::make_shared<Control>();
  auto builder = std::make_unique<EngineBuilder>(MakeFactory(store, control));
  v1::Plan plan;
  plan.set_version(1);
  control->stuck = true;
  {
    auto reg = std::make_shared<const Registration>();
    EXPECT_FALSE(builder
                     ->Build(reg, plan,
                             [&] { return control->entered.HasBeenNotified(); })
                     .has_value());
  }
  builder.reset();  // a shutdown does not wait for the stuck build
  std::weak_ptr<Store> weak = store;
  store.reset();
  EXPECT_FALSE(weak.expired()) << "the build shares the store";
  EXPECT_EQ(control->ended.load(), 0);
  control->release = true;
  WaitFor(control->ended, 1);
  for (int i = 0; i < 4000 && !weak.expired(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(weak.expired()) << "released when the build ended";
}

}  // namespace
}  // namespace muond
