// CoordinatorCore in-process. The CoordinatorCore facade as a whole: the job id
// rule on every RPC and the validation of CoordinatorOptions. Plans come from
// the real core planner (PlanGroup).
#include "server/coordinator/coordinator_core.h"

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
#include "server/coordinator/coordinator_metrics.h"
#include "tests/server/coordinator/coordinator_fixtures.h"

namespace muond {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// CheckJobId's rule on every RPC that names a job: refused naming job_id
// and the rule, before any state exists (no job, no metrics series); the
// longest valid id is accepted.
// An optimizer instance's job "<job>/<name>" (server/common/job_id.h
// InstanceJobId) is a job of its own beside its user's job.
TEST(CoordinatorCore, InstanceJobIsAJobOfItsOwn) {
  CoordinatorOptions options;
  CoordinatorCore core(options);
  ASSERT_TRUE(core.Join(JoinReq("team", 0, 1)).ok());
  ASSERT_TRUE(core.Join(JoinReq("team/opt-2", 0, 1)).ok());
  EXPECT_THAT(core.JobIds(),
              ::testing::UnorderedElementsAre("team", "team/opt-2"));
  EXPECT_TRUE(core.CheckJobToken("team/opt-2", "").ok());
}

TEST(CoordinatorCore, JobIdRuleOnEveryRpc) {
  CoordinatorMetrics metrics;
  CoordinatorOptions options;
  options.metrics = &metrics;
  CoordinatorCore core(options);
  const std::vector<std::string> bad = {"",
                                        std::string(65, 'a'),
                                        std::string("a\0b", 3),
                                        "a\nb",
                                        "a b",
                                        "team/a/b",
                                        "team/",
                                        "/a",
                                        std::string(4 << 20, 'x')};
  for (const std::string& id : bad) {
    SCOPED_TRACE(absl::CHexEscape(id.substr(0, 70)));
    const auto refused = [&](const absl::Status& st, const char* rpc) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << rpc;
      EXPECT_THAT(st.message(), HasSubstr("job_id=\"")) << rpc;
      EXPECT_THAT(st.message(),
                  HasSubstr("must be 1-64 characters of [A-Za-z0-9._-]"))
          << rpc;
      EXPECT_LT(st.message().size(), 400u) << rpc;  // the id is not echoed
    };
    refused(core.Join(JoinReq(id, 0, 1)).status(), "Join");
    refused(core.CheckJobToken(id, ""), "CheckJobToken");
    v1::KvSetRequest set;
    set.set_job_id(id);
    set.set_key("k");
    refused(core.KvSet(set), "KvSet");
    v1::KvGetRequest get;
    get.set_job_id(id);
    get.set_key("k");
    refused(core.KvGet(get).status(), "KvGet");
    refused(core.PublishManifest(Manifest(id, 0, kShapes)), "PublishManifest");
    refused(core.GetPlan(id).status(), "GetPlan");
    v1::ReportTimingsRequest timings;
    timings.set_job_id(id);
    refused(core.ReportTimings(timings), "ReportTimings");
    v1::RebalanceRequest rebalance;
    rebalance.set_job_id(id);
    refused(core.Rebalance(rebalance).status(), "Rebalance");
    v1::ListDaemonsRequest list;
    list.set_job_id(id);
    refused(core.ListDaemons(list).status(), "ListDaemons");
  }
  EXPECT_TRUE(core.JobIds().empty());
  EXPECT_THAT(metrics.registry().Render(), Not(HasSubstr("{job=")));

  const std::string longest = "A-z_0.9" + std::string(kMaxJobIdChars - 7, 'j');
  ASSERT_TRUE(core.Join(JoinReq(longest, 0, 1)).ok());
  EXPECT_EQ(core.JobIds(), std::vector<std::string>{longest});
  v1::ListDaemonsRequest list;
  list.set_job_id(longest);
  EXPECT_TRUE(core.ListDaemons(list).ok());
}

TEST(CoordinatorCore, OptionsAreValidatedNamingTheField) {
  auto refused = [](const std::function<void(CoordinatorOptions&)>& edit,
                    const std::string& field) {
    CoordinatorOptions o = Options();
    edit(o);
    absl::Status st = o.Validate();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(st.message(), HasSubstr(field));
  };
  refused([](auto& o) { o.rebalance_threshold = std::nan(""); },
          "rebalance_threshold");
  refused([](auto& o) { o.rebalance_threshold = -1; }, "rebalance_threshold");
  refused([](auto& o) { o.rebalance_activate_margin = -5; },
          "rebalance_activate_margin");
  refused([](auto& o) { o.rebalance_interval_steps = 0; },
          "rebalance_interval_steps");
  refused([](auto& o) { o.job_idle_expiry = absl::ZeroDuration(); },
          "job_idle_expiry");
  refused([](auto& o) { o.kv.max_value_bytes = 0; }, "kv_max_value_bytes");
  EXPECT_TRUE(Options().Validate().ok());
}

}  // namespace
}  // namespace muond
