// DaemonCore's engine builds and what Health and the readiness callback say
// of them: abandoned and stuck builds, failed builds, refused rounds,
// shutdown.
#include "tests/server/daemon/daemon_core_fixture.h"

namespace muond::daemon_core_test {
namespace {

// A trainer that unregisters while the daemon waits for its domain's peers
// (client_recovery_test's failed constructor: one rank got the plan only after
// the unregister and never joined) must not leave the next registration
// waiting out the communicator timeout.
TEST_F(DaemonCoreTest, UnregisterAbandonsAnEngineStillWaitingForPeers) {
  hold_builds_ = true;
  ReRegisterWhileTheFirstBuildIsHeld();
  ASSERT_FALSE(HasFatalFailure());
  WaitForBuildsToEnd(1);
  EXPECT_EQ(builds_abandoned_.load(), 1);
  EXPECT_EQ(core_->engine_error(), "") << "an abandoned build is no error";
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 2);
}

// The same when the build cannot be interrupted (stuck connecting to a peer
// that gave up): the daemon leaves it to end in the background and builds
// the next registration's engine meanwhile.
TEST_F(DaemonCoreTest, UnregisterLeavesAStuckBuildBehind) {
  stuck_builds_ = true;
  ReRegisterWhileTheFirstBuildIsHeld();  // while the first build is stuck
  ASSERT_FALSE(HasFatalFailure());
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 2);
  EXPECT_EQ(core_->engine_error(), "");
  EXPECT_EQ(builds_ended_.load(), 0) << "the first build is still stuck";
  release_stuck_ = true;
  WaitForBuildsToEnd(1);
}

// GetStatus and muond_state_bytes carry the engine's state bytes by
// location and dtype once it stands, and nothing after UnregisterParams.
TEST_F(DaemonCoreTest, StatusAndMetricsReportStateBytesByLocationAndDType) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Status().state_bytes_by_size(), 0) << "no engine yet";
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  const v1::GetStatusResponse s = core_->Status();
  ASSERT_EQ(s.state_bytes_by_size(), int(fake_->storage.size()));
  for (int i = 0; i < s.state_bytes_by_size(); ++i) {
    const StateStorageBytes& want = fake_->storage[i];
    EXPECT_EQ(s.state_bytes_by(i).location(), StateLocationName(want.location));
    EXPECT_EQ(s.state_bytes_by(i).dtype(), DTypeName(want.dtype));
    EXPECT_EQ(s.state_bytes_by(i).bytes(), want.bytes);
  }
  std::string text = metrics_.registry().Render();
  EXPECT_THAT(text, HasSubstr("\nmuond_state_bytes{location=\"device\","
                              "dtype=\"bf16\"} 96\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_state_bytes{location=\"host\","
                              "dtype=\"fp32\"} 320\n"));
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_EQ(core_->Status().state_bytes_by_size(), 0);
  text = metrics_.registry().Render();
  EXPECT_THAT(text, HasSubstr("\nmuond_state_bytes{location=\"device\","
                              "dtype=\"bf16\"} 0\n"));
}

// A failed engine build is reported by Health (the daemon waits for a new
// plan), so a trainer waiting for has_plan can stop with the reason; a new
// registration clears it.
TEST_F(DaemonCoreTest, HealthReportsAFailedEngineBuild) {
  fail_builds_ = true;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Health().engine_error(), "");
  core_->OnPlan(PlanFor(1, 0, 0));
  for (int i = 0; i < 2000 && core_->Health().engine_error().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const v1::HealthResponse h = core_->Health();
  EXPECT_FALSE(h.has_plan());
  EXPECT_THAT(h.engine_error(), HasSubstr("rendezvous: rank 1 never came"));
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_EQ(core_->Health().engine_error(), "") << "nothing is registered";
  fail_builds_ = false;
  link_.round_version = 2;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Health().engine_error(), "");
  core_->OnPlan(PlanFor(2, 0, 0));
  WaitForEngine();
  EXPECT_EQ(core_->Health().engine_error(), "");
}

// The readiness callback (the grpc.health.v1 status) follows has_plan:
// nothing while an engine build fails, true once an engine stands, false when
// the trainer unregisters and when the core goes away.
TEST_F(DaemonCoreTest, ReadinessFollowsTheEngine) {
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  fail_builds_ = true;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  for (int i = 0; i < 2000 && core_->Health().engine_error().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_FALSE(core_->Health().engine_error().empty());
  ASSERT_TRUE(core_->Unregister(un).ok());
  fail_builds_ = false;
  link_.round_version = 2;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(2, 0, 0));
  WaitForEngine();
  EXPECT_EQ(WaitForReadiness(1), std::vector<bool>({true}))
      << "the failed build reported nothing";
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_EQ(WaitForReadiness(2), std::vector<bool>({true, false}));
  link_.round_version = 3;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(3, 0, 0));
  EXPECT_EQ(WaitForReadiness(3), std::vector<bool>({true, false, true}));
  core_.reset();
  EXPECT_EQ(Readiness(), std::vector<bool>({true, false, true, false}));
}

v1::Plan RoundRefusal(const std::string& reason) {
  v1::Plan refusal;
  refusal.set_job_id("job");
  refusal.set_round_refused(reason);
  return refusal;
}

// The coordinator refused the round of this daemon's registration (another
// rank's manifest disagreed): Health says so at once, with the reason, until
// a new registration; the refusal is no plan.
TEST_F(DaemonCoreTest, HealthReportsARefusedRound) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(RoundRefusal("rank 1: full_shape [64, 32] vs [128, 32]"));
  v1::HealthResponse h = core_->Health();
  EXPECT_FALSE(h.has_plan());
  EXPECT_EQ(h.engine_error(),
            "the coordinator refused the registration round (register again "
            "on every rank): rank 1: full_shape [64, 32] vs [128, 32]");
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  link_.round_version = 1;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Health().engine_error(), "") << "a new registration";
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  h = core_->Health();
  EXPECT_TRUE(h.has_plan());
  EXPECT_EQ(h.engine_error(), "");
  // A refusal reaching a daemon that steps with its engine changes nothing.
  core_->OnPlan(RoundRefusal("a later round"));
  EXPECT_TRUE(core_->Health().has_plan());
  EXPECT_EQ(core_->Health().engine_error(), "");
}

// The refusal of a registration's round may overtake the answer to its
// publish: the registration is still reported refused.
TEST_F(DaemonCoreTest, ARefusalDuringThePublishIsKept) {
  link_.during_publish = [this] { core_->OnPlan(RoundRefusal("mismatch")); };
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_THAT(core_->Health().engine_error(), HasSubstr("mismatch"));
}

// Shutting down does not wait out a rendezvous either.
TEST_F(DaemonCoreTest, ShutdownAbandonsAnEngineStillWaitingForPeers) {
  hold_builds_ = true;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForHeldBuild();
  core_.reset();
  WaitForBuildsToEnd(1);
  EXPECT_EQ(builds_abandoned_.load(), 1);
}

}  // namespace
}  // namespace muond::daemon_core_test
