// CoordinatorCore in-process. Plan versions and their delivery: watchers get
// every version in order, the job keeps its newest plans, a restarted
// coordinator numbers above the daemons' plans, versions are bounded. Plans
// come from the real core planner (PlanGroup).
#include "server/coordinator/plan_delivery.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/common/job_id.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"
#include "server/coordinator/coordinator_metrics.h"
#include "tests/server/coordinator/coordinator_fixtures.h"

namespace muond {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A coordinator restarted under running daemons: they re-publish with the
// newest plan version they hold (7) and their last step (40, 42). Its plans
// are numbered above 7 (a version the daemons already hold would be dropped
// as an old plan), its first plan activates rebalance_activate_margin steps
// after the latest step (every rank switches at the same step; the daemons
// keep their plan meanwhile), and a reconnect re-publish with newer resume
// fields is still the same manifest (no new round).
TEST(PlanDelivery, RestartedCoordinatorNumbersAboveTheDaemonsPlans) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    v1::PublishManifestRequest m = Manifest("j", r, kShapes);
    m.set_known_plan_version(r == 1 ? 7 : 5);
    m.set_last_step_id(r == 3 ? 42 : 40);
    absl::StatusOr<int64_t> round =
        core.PublishRegistration(m, "old" + std::to_string(r));
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_EQ(*round, r == 0 ? 6 : 8) << "rank " << r;
  }
  absl::StatusOr<v1::Plan> plan = core.GetPlan("j");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->version(), 8);
  EXPECT_EQ(plan->activate_at_step(), 42 + Options().rebalance_activate_margin);
  v1::PublishManifestRequest again = Manifest("j", 2, kShapes);
  again.set_known_plan_version(8);
  again.set_last_step_id(45);
  ASSERT_TRUE(core.PublishRegistration(again, "old2").ok());
  EXPECT_EQ(core.GetPlan("j")->version(), 8) << "a reconnect is no new round";
  v1::RebalanceRequest req;
  req.set_job_id("j");
  absl::StatusOr<v1::Plan> next = core.Rebalance(req);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version(), 9);
  v1::PublishManifestRequest bad = Manifest("j", 0, kShapes);
  bad.set_known_plan_version(-1);
  absl::Status st = core.PublishRegistration(bad, "old0").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("known_plan_version"));
}

// Rebalances in quick succession (versions 2, 3, 4 before a watcher asks
// again): a watcher that holds version 1 gets 2, then 3, then 4, not just the
// newest. A daemon that skipped a version could be asked for it by its
// domain (the ranks agree on the oldest of their newest versions) and fail
// the step alone while its peers waited in the exchange. A new watcher
// (after_version 0) starts at the newest.
TEST(PlanDelivery, WatchersGetEveryPlanVersionInOrder) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r, kShapes)).ok());
  }
  v1::RebalanceRequest req;
  req.set_job_id("j");
  for (int64_t want = 2; want <= 4; ++want) {
    absl::StatusOr<v1::Plan> plan = core.Rebalance(req);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->version(), want);
  }
  for (int64_t held = 1; held <= 3; ++held) {
    absl::StatusOr<std::optional<v1::Plan>> next =
        core.WaitForPlan("j", held, absl::Seconds(1));
    ASSERT_TRUE(next.ok() && next->has_value()) << "after version " << held;
    EXPECT_EQ((*next)->version(), held + 1);
  }
  absl::StatusOr<std::optional<v1::Plan>> none =
      core.WaitForPlan("j", 4, absl::Milliseconds(10));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  absl::StatusOr<std::optional<v1::Plan>> fresh =
      core.WaitForPlan("j", 0, absl::Seconds(1));
  ASSERT_TRUE(fresh.ok() && fresh->has_value());
  EXPECT_EQ((*fresh)->version(), 4);
}

// A job keeps its newest plans_kept plans: a long job that rebalances often
// does not grow without bound; a watcher further behind gets the oldest kept.
TEST(PlanDelivery, KeepsTheNewestPlans) {
  CoordinatorOptions options = Options();
  options.plans_kept = 3;
  CoordinatorCore core(options);
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r, kShapes)).ok());
  }
  v1::RebalanceRequest req;
  req.set_job_id("j");
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(core.Rebalance(req).ok());
  EXPECT_EQ(core.GetPlan("j")->version(), 7);
  absl::StatusOr<std::optional<v1::Plan>> behind =
      core.WaitForPlan("j", 1, absl::Seconds(1));
  ASSERT_TRUE(behind.ok() && behind->has_value());
  EXPECT_EQ((*behind)->version(), 5) << "versions 1-4 are dropped";
  absl::StatusOr<std::optional<v1::Plan>> next =
      core.WaitForPlan("j", 5, absl::Seconds(1));
  ASSERT_TRUE(next.ok() && next->has_value());
  EXPECT_EQ((*next)->version(), 6);
  // Numbering continues above the dropped versions.
  EXPECT_EQ(core.Rebalance(req)->version(), 8);
}

TEST(PlanDelivery, PlanVersionsAreBounded) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  v1::PublishManifestRequest m = Manifest("j", 0, kShapes);
  m.set_known_plan_version(int64_t(1) << 62);
  absl::Status st = core.PublishManifest(m);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("known_plan_version"));
  EXPECT_THAT(st.message(), HasSubstr("kMaxPlanVersion"));
  m.set_known_plan_version(0);
  m.set_last_step_id(std::numeric_limits<int64_t>::max() - 1);
  st = core.PublishManifest(m);
  EXPECT_THAT(st.message(), HasSubstr("last_step_id"));
  // At the limit, the next version cannot be numbered: refused, not wrapped.
  m.set_last_step_id(0);
  m.set_known_plan_version(kMaxPlanVersion);
  ASSERT_TRUE(core.PublishManifest(m).ok());
  for (int r = 1; r < 3; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r, kShapes)).ok());
  }
  st = core.PublishManifest(Manifest("j", 3, kShapes));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(st.message(), HasSubstr("kMaxPlanVersion"));
}

// The communicator epoch moves once per failed epoch, never past a report of
// an epoch the job was not pushed (a caller cannot jump it to its top and so
// stop the job healing), and stays bounded.
TEST(CommEpochTest, MovesOncePerFailureAndRefusesEpochsNotPushed) {
  Job job;
  job.id = "j";
  // A fresh job (or a restarted coordinator under running daemons) follows
  // the report.
  ASSERT_EQ(AdvanceCommEpoch(job, 4).value(), 5);
  // The other ranks' reports of the same failure do not move it again.
  EXPECT_EQ(AdvanceCommEpoch(job, 4).value(), 5);
  EXPECT_EQ(AdvanceCommEpoch(job, 5).value(), 6);
  absl::StatusOr<int64_t> ahead = AdvanceCommEpoch(job, 7);
  EXPECT_EQ(ahead.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ahead.status().message(), HasSubstr("newer than the epoch"));
  absl::StatusOr<int64_t> top = AdvanceCommEpoch(job, kMaxCommEpoch);
  EXPECT_EQ(top.status().code(), absl::StatusCode::kInvalidArgument);
  Job fresh;
  EXPECT_FALSE(
      AdvanceCommEpoch(fresh, std::numeric_limits<int64_t>::max()).ok());
  EXPECT_FALSE(AdvanceCommEpoch(fresh, -1).ok());
  EXPECT_EQ(job.comm_epoch, 6);
  EXPECT_EQ(fresh.comm_epoch, 0);
}

}  // namespace
}  // namespace muond
