// CoordinatorCore in-process. Rebalancing: the operator's Rebalance (next
// version, activation step, refused during a registration round) and the
// automatic one from measured timings (threshold, hysteresis, the measured cost
// table). Plans come from the real core planner (PlanGroup).
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

// muonctl rebalance right after a coordinator restart, before any daemon
// has reported timings: the activation step counts from the steps the
// daemons published with their manifests (40, 42), not from 0 (a plan for a
// step already past takes effect whenever each rank receives it).
TEST(Rebalancer, RebalanceAfterRestartActivatesAfterThePublishedSteps) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    v1::PublishManifestRequest m = Manifest("j", r, kShapes);
    m.set_known_plan_version(5);
    m.set_last_step_id(r == 3 ? 42 : 40);
    ASSERT_TRUE(core.PublishRegistration(m, "old" + std::to_string(r)).ok());
  }
  v1::RebalanceRequest req;
  req.set_job_id("j");
  req.set_activate_after_steps(3);
  absl::StatusOr<v1::Plan> next = core.Rebalance(req);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->activate_at_step(), 42 + 3);
}

TEST(Rebalancer, RebalanceBumpsVersionWithActivationStep) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  v1::RebalanceRequest early;
  early.set_job_id("j");
  EXPECT_EQ(core.Rebalance(early).status().code(),
            absl::StatusCode::kFailedPrecondition);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r, kShapes)).ok());
  }
  const v1::Plan first = *core.GetPlan("j");
  for (int r = 0; r < 4; ++r) {
    v1::ReportTimingsRequest t;
    t.set_job_id("j");
    t.set_rank(r);
    t.set_step_id(r == 2 ? 7 : 6);
    ASSERT_TRUE(core.ReportTimings(t).ok());
  }
  // Make the largest matrix (128x32) the cheapest: its home must change.
  v1::RebalanceRequest req;
  req.set_job_id("j");
  req.set_activate_after_steps(3);
  for (const auto& [p, q] : kShapes) {
    v1::ShapeTiming* c = req.add_cost_table();
    c->add_shape(p);
    c->add_shape(q);
    c->set_ns_us(p == 128 ? 1.0 : 1000.0 / (p * q / 512.0));
  }
  absl::StatusOr<v1::Plan> plan = core.Rebalance(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->version(), 2);
  EXPECT_EQ(plan->activate_at_step(), 7 + 3);
  EXPECT_EQ(plan->cost_model(), v1::COST_MODEL_MEASURED);
  bool changed = false;
  for (int i = 0; i < plan->groups(0).homes_size(); ++i) {
    changed |= plan->groups(0).homes(i).g() != first.groups(0).homes(i).g() ||
               plan->groups(0).homes(i).t() != first.groups(0).homes(i).t();
  }
  EXPECT_TRUE(changed);
  EXPECT_EQ(core.GetPlan("j")->version(), 2);
  absl::StatusOr<std::optional<v1::Plan>> seen =
      core.WaitForPlan("j", 1, absl::Seconds(1));
  ASSERT_TRUE(seen.ok() && seen->has_value());
  EXPECT_EQ((*seen)->version(), 2);

  // Bad requests.
  v1::RebalanceRequest bad = req;
  bad.mutable_cost_table(0)->set_ns_us(-1);
  EXPECT_THAT(core.Rebalance(bad).status().message(), HasSubstr("cost_table"));
  bad = req;
  bad.set_cost_model(static_cast<v1::CostModel>(99));
  EXPECT_THAT(core.Rebalance(bad).status().message(),
              HasSubstr("cost_model: value 99"));
  bad = req;
  bad.set_activate_after_steps(-1);
  EXPECT_EQ(core.Rebalance(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  // An explicit 0 is not "the default" any more: it is refused by name.
  bad = req;
  bad.set_activate_after_steps(0);
  EXPECT_THAT(core.Rebalance(bad).status().message(),
              HasSubstr("activate_after_steps: 0 must be >= 1"));
}

// Records what reached the planner, then plans with the real core planner.
struct PlannerSpy {
  std::vector<v1::CostModel> models;
  std::vector<CostTable> tables;
};

CoordinatorOptions AutoOptions(PlannerSpy* spy, double threshold) {
  CoordinatorOptions o = Options();
  o.planner = [spy](const v1::GroupManifest& m, v1::CostModel model,
                    const CostTable& costs) {
    spy->models.push_back(model);
    spy->tables.push_back(costs);
    return PlanGroup(m, model, costs);
  };
  o.rebalance_threshold = threshold;
  o.rebalance_interval_steps = 5;
  o.rebalance_activate_margin = 3;
  return o;
}

// A report of `rank` at `step` with NS phase time `ns_us` that measured
// every shape of kShapes once at the "inverted" per-matrix cost (the largest
// matrix cheapest), so a measured plan differs from the ns_cost plan.
v1::ReportTimingsRequest Report(int rank, int64_t step, double ns_us) {
  v1::ReportTimingsRequest t;
  t.set_job_id("j");
  t.set_rank(rank);
  t.set_step_id(step);
  t.mutable_timings()->set_ns_us(ns_us);
  for (const auto& [p, q] : kShapes) {
    v1::ShapeTiming* s = t.add_shapes();
    s->add_shape(p);
    s->add_shape(q);
    s->set_ns_us(p == 128 ? 1.0 : 1e6 / double(p * q));
    s->set_count(1);
  }
  return t;
}

void PublishAll(CoordinatorCore& core) {
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r, kShapes)).ok());
  }
}

// Rank 0 is 4x slower than the others: max/mean = 40 / 17.5 = 2.29.
void ReportImbalancedStep(CoordinatorCore& core, int64_t step) {
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.ReportTimings(Report(r, step, r == 0 ? 40 : 10)).ok());
  }
}

TEST(Rebalancer, ImbalanceTriggersMeasuredPlanWithHysteresis) {
  PlannerSpy spy;
  CoordinatorCore core(AutoOptions(&spy, 1.25));
  PublishAll(core);
  const v1::Plan first = *core.GetPlan("j");
  ASSERT_EQ(spy.models, std::vector<v1::CostModel>{v1::COST_MODEL_NS_COST});
  // Steps 1..4: fewer than rebalance_interval_steps (5) since plan v1
  // activated at step 0 -> no check yet.
  for (int64_t step = 1; step <= 4; ++step) ReportImbalancedStep(core, step);
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
  // Step 5 from ranks 0..2 only: the oldest rank (3) is still at step 4.
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(core.ReportTimings(Report(r, 5, r == 0 ? 40 : 10)).ok());
  }
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
  ASSERT_TRUE(core.ReportTimings(Report(3, 5, 10)).ok());
  const v1::Plan second = *core.GetPlan("j");
  ASSERT_EQ(second.version(), 2);
  EXPECT_EQ(second.cost_model(), v1::COST_MODEL_MEASURED);
  EXPECT_EQ(second.activate_at_step(), 5 + 3);  // latest step + margin
  // The measured table reached the planner: per shape, one matrix's time.
  ASSERT_EQ(spy.models.back(), v1::COST_MODEL_MEASURED);
  CostTable want;
  for (const auto& [p, q] : kShapes) {
    want[{p, q}] = p == 128 ? 1.0 : 1e6 / double(p * q);
  }
  EXPECT_EQ(spy.tables.back(), want);
  bool changed = false;
  for (int i = 0; i < second.groups(0).homes_size(); ++i) {
    changed |= second.groups(0).homes(i).g() != first.groups(0).homes(i).g() ||
               second.groups(0).homes(i).t() != first.groups(0).homes(i).t();
  }
  EXPECT_TRUE(changed);
  // Watchers see it.
  absl::StatusOr<std::optional<v1::Plan>> seen =
      core.WaitForPlan("j", 1, absl::Seconds(1));
  ASSERT_TRUE(seen.ok() && seen->has_value());
  EXPECT_EQ((*seen)->version(), 2);

  // Hysteresis: still imbalanced, but no check before every rank reported
  // step >= activation (8) + interval (5) = 13.
  const size_t plans_before = spy.models.size();
  for (int64_t step = 6; step <= 12; ++step) ReportImbalancedStep(core, step);
  EXPECT_EQ(spy.models.size(), plans_before);
  EXPECT_EQ(core.GetPlan("j")->version(), 2);
  // At 13 the check runs; the same measured table gives the same homes, so
  // nothing is pushed (and the next check is 5 steps later).
  ReportImbalancedStep(core, 13);
  EXPECT_EQ(spy.models.size(), plans_before + 1);
  EXPECT_EQ(core.GetPlan("j")->version(), 2);
  for (int64_t step = 14; step <= 17; ++step) ReportImbalancedStep(core, step);
  EXPECT_EQ(spy.models.size(), plans_before + 1);
}

TEST(Rebalancer, BalancedOrOffDoesNotRebalance) {
  for (double threshold : {1.25, 0.0}) {
    PlannerSpy spy;
    CoordinatorCore core(AutoOptions(&spy, threshold));
    PublishAll(core);
    for (int64_t step = 1; step <= 20; ++step) {
      for (int r = 0; r < 4; ++r) {
        // threshold 1.25: max/mean = 12 / 10.5 = 1.14, within it.
        // threshold 0 (off): even a 4x imbalance changes nothing.
        const double ns =
            threshold > 0 ? (r == 0 ? 12 : 10) : (r == 0 ? 40 : 10);
        ASSERT_TRUE(core.ReportTimings(Report(r, step, ns)).ok());
      }
    }
    EXPECT_EQ(core.GetPlan("j")->version(), 1) << "threshold " << threshold;
    EXPECT_EQ(spy.models.size(), 1u) << "threshold " << threshold;
  }
}

TEST(Rebalancer, MeasuredCostsKeepTheLatestPerRankAndShape) {
  PlannerSpy spy;
  CoordinatorCore core(AutoOptions(&spy, 0));
  JoinAll(core, "j", 2);
  auto report = [&](int rank, int64_t step, std::vector<int64_t> shape,
                    double ns_us, int count) {
    v1::ReportTimingsRequest t;
    t.set_job_id("j");
    t.set_rank(rank);
    t.set_step_id(step);
    v1::ShapeTiming* s = t.add_shapes();
    for (int64_t d : shape) s->add_shape(d);
    s->set_ns_us(ns_us);
    s->set_count(count);
    return core.ReportTimings(t);
  };
  ASSERT_TRUE(report(0, 1, {64, 32}, 300, 3).ok());
  ASSERT_TRUE(report(0, 2, {64, 32}, 200, 2).ok());  // replaces step 1's
  ASSERT_TRUE(report(1, 2, {64, 32}, 100, 1).ok());
  ASSERT_TRUE(report(1, 2, {16, 16}, 0, 1).ok());  // below timer resolution
  ASSERT_TRUE(report(0, 3, {32, 32}, 50, 2).ok());
  // A report without shapes (an unmeasured step) keeps the measurements.
  v1::ReportTimingsRequest plain;
  plain.set_job_id("j");
  plain.set_rank(0);
  plain.set_step_id(4);
  ASSERT_TRUE(core.ReportTimings(plain).ok());
  absl::StatusOr<CostTable> costs = core.MeasuredCosts("j");
  ASSERT_TRUE(costs.ok());
  const CostTable want = {{{64, 32}, (200.0 + 100.0) / 3}, {{32, 32}, 25.0}};
  EXPECT_EQ(*costs, want);
  // Bad entries change nothing.
  EXPECT_THAT(report(0, 5, {64}, 1, 1).message(), HasSubstr("2-D"));
  EXPECT_THAT(report(0, 5, {64, 32}, 1, 0).message(), HasSubstr("count"));
  EXPECT_THAT(report(0, 5, {64, 32}, -1, 1).message(), HasSubstr("ns_us"));
  EXPECT_EQ(*core.MeasuredCosts("j"), want);
  EXPECT_EQ(core.MeasuredCosts("nope").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(Rebalancer, ManualRebalanceUsesTheMeasuredTable) {
  PlannerSpy spy;
  CoordinatorCore core(AutoOptions(&spy, 0));
  PublishAll(core);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.ReportTimings(Report(r, 3, 10)).ok());
  }
  v1::RebalanceRequest req;
  req.set_job_id("j");  // unset cost_model: measured when available
  absl::StatusOr<v1::Plan> plan = core.Rebalance(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->cost_model(), v1::COST_MODEL_MEASURED);
  EXPECT_EQ(spy.models.back(), v1::COST_MODEL_MEASURED);
  EXPECT_EQ(spy.tables.back(), *core.MeasuredCosts("j"));
  EXPECT_EQ(spy.tables.back().size(), kShapes.size());
}

TEST(Rebalancer, HugeRebalanceActivationIsRefused) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  PublishAll4(core, "j");
  v1::ReportTimingsRequest report;
  report.set_job_id("j");
  report.set_rank(0);
  report.set_step_id(10);
  ASSERT_TRUE(core.ReportTimings(report).ok());
  v1::RebalanceRequest req;
  req.set_job_id("j");
  req.set_activate_after_steps(std::numeric_limits<int64_t>::max());
  absl::StatusOr<v1::Plan> plan = core.Rebalance(req);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("overflows"));
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
}

TEST(Rebalancer, RebalanceRefusedDuringARegistrationRound) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishRegistration(Manifest("j", r, kShapes),
                                         "a" + std::to_string(r))
                    .ok());
  }
  v1::RebalanceRequest req;
  req.set_job_id("j");
  ASSERT_TRUE(core.Rebalance(req).ok());
  // A new registration round: two of four ranks published.
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(core.PublishRegistration(Manifest("j", r, kShapes),
                                         "b" + std::to_string(r))
                    .ok());
  }
  absl::StatusOr<v1::Plan> during = core.Rebalance(req);
  EXPECT_EQ(during.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(during.status().message(),
              HasSubstr("registration round in progress: 2 of 4 ranks"));
  for (int r = 2; r < 4; ++r) {
    ASSERT_TRUE(core.PublishRegistration(Manifest("j", r, kShapes),
                                         "b" + std::to_string(r))
                    .ok());
  }
  EXPECT_TRUE(core.Rebalance(req).ok());
}

}  // namespace
}  // namespace muond
