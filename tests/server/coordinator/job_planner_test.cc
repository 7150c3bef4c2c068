// CoordinatorCore in-process. Planning a job with DP replicas: every matrix
// gets a home replica and the NS load spreads over them; replicas share grid
// coordinates. Plans come from the real core planner (PlanGroup).
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

// A DDP job of 4: the plan waits for all 4 replicas, gives every matrix a home
// replica and each rank about a quarter of the job's ns_cost.
TEST(JobPlanner, DdpPlanSpreadsNsOverReplicas) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  std::vector<std::pair<int64_t, int64_t>> shapes;
  double total = 0;
  for (int i = 0; i < 24; ++i) {
    const int64_t p = 32 * (1 + i % 3), q = 32 * (1 + i % 2);
    shapes.push_back({p, q});
    total += double(std::max(p, q)) * std::min(p, q) * std::min(p, q);
  }
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound);
    ASSERT_TRUE(core.PublishManifest(DpManifest("j", r, 4, 1, shapes)).ok())
        << r;
  }
  absl::StatusOr<v1::Plan> plan = core.GetPlan("j");
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::GroupPlan& group = plan->groups(0);
  ASSERT_EQ(group.homes_size(), int(shapes.size()));
  std::vector<double> load(4, 0);
  for (int i = 0; i < group.homes_size(); ++i) {
    const v1::NsHome& h = group.homes(i);
    ASSERT_TRUE(h.d() >= 0 && h.d() < 4 && h.g() == 0 && h.t() == 0);
    const auto [p, q] = shapes[i];
    load[h.d()] += double(std::max(p, q)) * std::min(p, q) * std::min(p, q);
  }
  ASSERT_EQ(group.rank_load_size(), 4);
  for (int r = 0; r < 4; ++r) {
    EXPECT_DOUBLE_EQ(group.rank_load(r), load[r]);
    EXPECT_NEAR(load[r] / total, 0.25, 0.03) << "rank " << r;
  }
}

// DP x TP replicas need no renaming: (d, g, t) is what must be unique.
TEST(JobPlanner, ReplicasShareGridCoordinatesNotReplicaCoordinates) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishManifest(DpManifest("j", r, 2, 2, kShapes)).ok())
        << r;
  }
  absl::StatusOr<v1::Plan> plan = core.GetPlan("j");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->groups(0).rank_load_size(), 4);
  // A second claim of (d=1, g=0, t=0) in a new round.
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(
        core.PublishRegistration(DpManifest("j", r, 2, 2, kShapes), "b").ok());
  }
  v1::PublishManifestRequest clash = DpManifest("j", 3, 2, 2, kShapes);
  clash.mutable_groups(0)->mutable_domain()->set_t(0);
  const absl::Status st = core.PublishRegistration(clash, "b").status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "group 'muon': ranks 2 and 3 both claim (d=1, g=0, t=0) of domain "
            "'dense'");
}

}  // namespace
}  // namespace muond
