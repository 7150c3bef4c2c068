// CoordinatorCore in-process. Jobs and their ranks: Join admission (world size,
// tokens, live ranks, bounded text fields), liveness and the join grace,
// idle-job expiry, ListDaemons. Plans come from the real core planner
// (PlanGroup).
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

TEST(JobTable, DuplicateJoinOfLiveRankIsAlreadyExists) {
  CoordinatorCore core(Options());
  ASSERT_TRUE(core.Join(JoinReq("j", 1, 4)).ok());
  absl::StatusOr<v1::JoinResponse> again = core.Join(JoinReq("j", 1, 4));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr("rank 1"));
  // After the rank left (its plan stream ended) it may join again.
  core.Leave("j", 1);
  EXPECT_TRUE(core.Join(JoinReq("j", 1, 4)).ok());
}

TEST(JobTable, WrongJobIdAndBadJoinFields) {
  CoordinatorCore core(Options("secret"));
  EXPECT_EQ(core.Join(JoinReq("j", 0, 2, "nope")).status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(core.Join(JoinReq("j", 0, 2, "secret")).ok());
  // World size disagreeing with the job, rank out of range, empty job id.
  // The job is held by its live daemon: FailedPrecondition (the daemon
  // waits it out) naming the holder's world size and the fix.
  absl::Status world = core.Join(JoinReq("j", 1, 3, "secret")).status();
  EXPECT_EQ(world.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(world.message(),
              HasSubstr("world_size: 3 differs: job 'j' is held by 1 live "
                        "daemon of world size 2"));
  EXPECT_THAT(world.message(), HasSubstr("another --job_id"));
  EXPECT_EQ(core.Join(JoinReq("j", 2, 2, "secret")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core.Join(JoinReq("", 0, 2, "secret")).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Every other RPC with an unknown job id: NotFound naming it.
  v1::PublishManifestRequest m = Manifest("other", 0, kShapes);
  absl::Status publish = core.PublishManifest(m);
  EXPECT_EQ(publish.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(publish.message(), HasSubstr("'other'"));
  EXPECT_EQ(core.GetPlan("other").status().code(), absl::StatusCode::kNotFound);
  v1::KvSetRequest set;
  set.set_job_id("other");
  set.set_key("k");
  EXPECT_EQ(core.KvSet(set).code(), absl::StatusCode::kNotFound);
  v1::RebalanceRequest rb;
  rb.set_job_id("other");
  EXPECT_EQ(core.Rebalance(rb).status().code(), absl::StatusCode::kNotFound);
  // Publishing for a rank that never joined.
  v1::PublishManifestRequest unjoined = Manifest("j", 1, kShapes);
  EXPECT_EQ(core.PublishManifest(unjoined).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A Join's host, device and address are kept per rank and logged: bounded
// An optimizer instance's job is named by its trainer, not by a daemon flag:
// held by daemons of another world size or token, the fix it names is
// another instance name, never another --job_id.
TEST(JobTable, HeldInstanceJobNamesAnotherInstanceNameAsTheFix) {
  CoordinatorCore core(Options());
  ASSERT_TRUE(core.Join(JoinReq("j/opt-2", 0, 3)).ok());
  const absl::Status world = core.Join(JoinReq("j/opt-2", 1, 2)).status();
  EXPECT_EQ(world.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(world.message(),
              HasSubstr("job 'j/opt-2' is held by 1 live daemon of world "
                        "size 3"));
  EXPECT_THAT(world.message(),
              HasSubstr("give this optimizer instance another name"));
  EXPECT_THAT(world.message(), Not(HasSubstr("--job_id")));
  const absl::Status token =
      core.Join(JoinReq("j/opt-2", 1, 3, "another")).status();
  EXPECT_EQ(token.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(token.message(),
              HasSubstr("give this optimizer instance another name"));
  EXPECT_THAT(token.message(), Not(HasSubstr("--job_id")));
}

// and printable.
TEST(JobTable, JoinTextFieldsAreBounded) {
  CoordinatorCore core(Options(""));
  v1::JoinRequest join = JoinReq("j", 0, 1);
  join.set_host(std::string(256, 'h'));
  absl::Status st = core.Join(join).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("host: 256 bytes"));
  join = JoinReq("j", 0, 1);
  join.set_device("cpu\n");
  st = core.Join(join).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("device: 4 bytes \"cpu\\n\""));
  join = JoinReq("j", 0, 1);
  join.set_host(std::string(255, 'h'));
  EXPECT_TRUE(core.Join(join).ok());
}

TEST(JobTable, ListDaemonsReportsJoinedRanks) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 2);
  v1::ReportTimingsRequest t;
  t.set_job_id("j");
  t.set_rank(1);
  t.set_step_id(5);
  t.mutable_timings()->set_total_us(42);
  ASSERT_TRUE(core.ReportTimings(t).ok());
  v1::ListDaemonsRequest req;
  req.set_job_id("j");
  absl::StatusOr<v1::ListDaemonsResponse> list = core.ListDaemons(req);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->daemons_size(), 2);
  EXPECT_EQ(list->daemons(0).last_step_id(), -1);
  EXPECT_EQ(list->daemons(1).last_step_id(), 5);
  EXPECT_EQ(list->daemons(1).last_timings().total_us(), 42);
  EXPECT_EQ(list->daemons(1).address(), "unix:///tmp/x1");
}

TEST(JobTable, IdleJobsExpireAndMayChangeWorldSizeAndToken) {
  FakeClock clock;
  CoordinatorOptions o = Options();
  o.clock = clock.Fn();
  o.job_idle_expiry = absl::Minutes(10);
  o.max_jobs = 2;
  CoordinatorCore core(o);
  ASSERT_TRUE(core.Join(JoinReq("j", 0, 2, "old")).ok());
  ASSERT_TRUE(core.StartWatching("j", 0));
  // Live: a different world size or token is refused.
  EXPECT_EQ(core.Join(JoinReq("j", 1, 3, "old")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::Status token = core.Join(JoinReq("j", 1, 2, "new")).status();
  EXPECT_EQ(token.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(token.message(), HasSubstr("token differs"));
  // Every daemon gone: a new incarnation may bring another world size and
  // token.
  core.Leave("j", 0);
  ASSERT_TRUE(core.Join(JoinReq("j", 0, 3, "new")).ok());
  core.Leave("j", 0);
  // Jobs per coordinator are bounded; idle ones expire.
  ASSERT_TRUE(core.Join(JoinReq("k", 0, 1)).ok());
  core.Leave("k", 0);
  absl::Status full = core.Join(JoinReq("l", 0, 1)).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("max_jobs=2"));
  clock.now += absl::Minutes(11);
  EXPECT_TRUE(core.Join(JoinReq("l", 0, 1)).ok());
  EXPECT_THAT(core.JobIds(), ::testing::ElementsAre("l"));
  EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound);
}

TEST(JobTable, InstanceJobIsForgottenWhenNoDaemonIsLive) {
  FakeClock clock;
  CoordinatorOptions o = Options();
  o.clock = clock.Fn();
  o.job_idle_expiry = absl::Minutes(10);
  o.max_jobs = 1;
  CoordinatorCore core(o);
  for (const char* name : {"j/opt-2", "j/opt-3", "j/opt-4"}) {
    SCOPED_TRACE(name);
    // Each instance takes the one job slot, then its daemon removes it.
    ASSERT_TRUE(core.Join(JoinReq(name, 0, 1)).ok());
    ASSERT_TRUE(core.StartWatching(name, 0));
    core.Leave(name, 0);
  }
  // A plain job still waits out the idle expiry.
  ASSERT_TRUE(core.Join(JoinReq("k", 0, 1)).ok());
  core.Leave("k", 0);
  EXPECT_EQ(core.Join(JoinReq("j/opt-5", 0, 1)).status().code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(JobTable, LiveJobDoesNotExpire) {
  FakeClock clock;
  CoordinatorOptions o = Options();
  o.clock = clock.Fn();
  CoordinatorCore core(o);
  ASSERT_TRUE(core.Join(JoinReq("j", 0, 1)).ok());
  ASSERT_TRUE(core.StartWatching("j", 0));
  clock.now += absl::Hours(5);
  EXPECT_THAT(core.JobIds(), ::testing::ElementsAre("j"));
}

TEST(JobTable, StaleJoinIsReplacedLiveOneIsNot) {
  FakeClock clock;
  CoordinatorOptions o = Options();
  o.clock = clock.Fn();
  o.join_grace = absl::Seconds(30);
  CoordinatorCore core(o);
  // A rogue joins rank 0 and never opens a plan stream.
  ASSERT_TRUE(core.Join(JoinReq("j", 0, 2)).ok());
  absl::Status early = core.Join(JoinReq("j", 0, 2)).status();
  EXPECT_EQ(early.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(early.message(), HasSubstr("replaced after"));
  // After the grace the real daemon takes the rank.
  clock.now += absl::Seconds(31);
  ASSERT_TRUE(core.Join(JoinReq("j", 0, 2)).ok());
  ASSERT_TRUE(core.StartWatching("j", 0));
  // Now it is live for as long as its stream is open: a second Join is
  // refused, and the real daemon keeps the rank.
  clock.now += absl::Hours(1);
  absl::Status second = core.Join(JoinReq("j", 0, 2)).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(second.message(), HasSubstr("plan stream is open"));
  v1::ListDaemonsRequest list;
  list.set_job_id("j");
  EXPECT_TRUE(core.ListDaemons(list)->daemons(0).live());
}

}  // namespace
}  // namespace muond
