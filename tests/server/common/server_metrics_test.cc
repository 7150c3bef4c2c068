// What the servers' hooks put into their metrics: DaemonMetrics' mapping of
// step outcomes (applied, refused by reason, skipped, replayed), NsLoadShare
// against hand-computed shares, and CoordinatorCore's counters and per-job
// gauges after real publishes, a rebalance and a failing planner.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"
#include "server/common/metrics.h"
#include "server/common/ns_load.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"
#include "server/daemon/daemon_metrics.h"

namespace muond {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

size_t CountOf(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos;
       at = text.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

v1::StepResponse Applied(double total_us, double ns_us) {
  v1::StepResponse r;
  r.mutable_timings()->set_total_us(total_us);
  r.mutable_timings()->set_ns_us(ns_us);
  return r;
}

TEST(DaemonMetrics, StepOutcomes) {
  DaemonMetrics m;
  m.StepDone(Applied(250000, 125000));  // 0.25 s total, 0.125 s NS
  m.StepDone(Applied(2000000, 0));      // 2 s
  v1::StepResponse replay = Applied(1, 1);
  replay.set_replayed(true);
  m.StepDone(replay);  // counted when it was applied
  v1::StepResponse skipped;
  skipped.add_skipped_nonfinite("w");
  m.StepDone(skipped);
  m.StepDone(absl::InvalidArgumentError("non-finite gradients"));
  m.StepDone(absl::InvalidArgumentError("a bad override"));
  m.StepDone(
      WithErrorReason(absl::UnavailableError("peer"), ErrorReason::kPeerGone));
  m.StepDone(WithErrorReason(absl::FailedPreconditionError("a trainer"),
                             ErrorReason::kTrainerRefused));
  const std::string text = m.registry().Render();
  EXPECT_THAT(text, HasSubstr("\nmuond_steps_applied_total 2\n"));
  // Every reason StepDone can produce is a series from the start: the ones
  // counted above with their counts, every other one at 0.
  std::vector<std::string> reasons = {"NONFINITE_SKIPPED", "PEER_GONE",
                                      "NO_PLAN_YET",       "ALREADY_REGISTERED",
                                      "TRAINER_REFUSED",   "REFUSED_BY_PEER",
                                      "STEP_WITHDRAWN"};
  for (int code = 1; code <= 16; ++code) {
    reasons.push_back(absl::StatusCodeToString(absl::StatusCode(code)));
  }
  for (const std::string& reason : reasons) {
    const int count = reason == "INVALID_ARGUMENT"    ? 2
                      : reason == "NONFINITE_SKIPPED" ? 1
                      : reason == "PEER_GONE"         ? 1
                      : reason == "TRAINER_REFUSED"   ? 1
                                                      : 0;
    EXPECT_THAT(text,
                HasSubstr(absl::StrCat("\nmuond_steps_refused_total{reason=\"",
                                       reason, "\"} ", count, "\n")));
  }
  EXPECT_EQ(CountOf(text, "\nmuond_steps_refused_total{"), reasons.size());
  EXPECT_THAT(text,
              HasSubstr("\nmuond_step_phase_seconds_bucket{phase=\"total\","
                        "le=\"0.25\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("\nmuond_step_phase_seconds_bucket{phase=\"total\","
                        "le=\"1\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("\nmuond_step_phase_seconds_bucket{phase=\"total\","
                        "le=\"2.5\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_step_phase_seconds_sum{phase=\"total\"}"
                              " 2.25\nmuond_step_phase_seconds_count{phase="
                              "\"total\"} 2\n"));
  EXPECT_THAT(text,
              HasSubstr("\nmuond_step_phase_seconds_count{phase=\"ns\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_ns_seconds_total 0.125\n"));
}

TEST(DaemonMetrics, RegistrationAndPlan) {
  DaemonMetrics m;
  v1::RegisterParamsResponse accepted;
  accepted.set_num_params(5);
  m.RegistrationDone(absl::InvalidArgumentError("bad view"));
  m.RegistrationDone(accepted);
  m.PlanActive(3, 0.375);
  m.EngineBuildFailed();
  std::string text = m.registry().Render();
  EXPECT_THAT(text, HasSubstr("\nmuond_registrations_total{result="
                              "\"accepted\"} 1\nmuond_registrations_total{"
                              "result=\"refused\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_registered_params 5\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_plan_version 3\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_ns_load 0.375\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_engine_build_failures_total 1\n"));
  m.Unregistered();
  text = m.registry().Render();
  EXPECT_THAT(text, HasSubstr("\nmuond_registered_params 0\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_plan_version 0\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_ns_load 0\n"));
}

// muond_state_bytes: every (location, dtype) series from the start, the
// engine's breakdown as given, all back to 0 when the params go.
TEST(DaemonMetrics, StateBytesByLocationAndDType) {
  DaemonMetrics m;
  const std::string labels[][2] = {
      {"device", "fp32"}, {"device", "bf16"}, {"device", "fp8_e4m3"},
      {"host", "fp32"},   {"host", "bf16"},   {"host", "fp8_e4m3"}};
  auto series = [](const std::string& location, const std::string& dtype,
                   int64_t bytes) {
    return absl::StrCat("\nmuond_state_bytes{location=\"", location,
                        "\",dtype=\"", dtype, "\"} ", bytes, "\n");
  };
  std::string text = m.registry().Render();
  for (const auto& [location, dtype] : labels) {
    EXPECT_THAT(text, HasSubstr(series(location, dtype, 0)));
  }
  google::protobuf::RepeatedPtrField<v1::StateBytes> by;
  *by.Add() = StateBytesToProto({StateLocation::kDevice, DType::kBFloat16, 96});
  *by.Add() = StateBytesToProto({StateLocation::kHost, DType::kFloat32, 320});
  m.StateBytes(by);
  text = m.registry().Render();
  EXPECT_THAT(text, HasSubstr(series("device", "bf16", 96)));
  EXPECT_THAT(text, HasSubstr(series("host", "fp32", 320)));
  EXPECT_THAT(text, HasSubstr(series("device", "fp32", 0)));
  m.Unregistered();
  text = m.registry().Render();
  EXPECT_THAT(text, HasSubstr(series("device", "bf16", 0)));
  EXPECT_THAT(text, HasSubstr(series("host", "fp32", 0)));
}

v1::Domain DomainOf(int dp, int gtp, int tp, int d, int g, int t) {
  v1::Domain domain;
  domain.set_name("dense");
  domain.set_dp_size(dp);
  domain.set_gtp_size(gtp);
  domain.set_tp_size(tp);
  domain.set_d(d);
  domain.set_g(g);
  domain.set_t(t);
  return domain;
}

TEST(NsLoadShare, SumsTheRanksLoadOverEveryGroup) {
  v1::Plan plan;
  // "a": a 2 x 2 domain with a DP axis (flat rank (d*G+g)*T+t, T = 1 here);
  // "b": a 1 x 2 domain; "adamw": no NS.
  v1::GroupPlan* a = plan.add_groups();
  a->set_group("a");
  for (double l : {1.0, 2.0, 3.0, 4.0}) a->add_rank_load(l);
  v1::GroupPlan* b = plan.add_groups();
  b->set_group("b");
  for (double l : {6.0, 4.0}) b->add_rank_load(l);
  plan.add_groups()->set_group("adamw");
  // total 20: a rank at (d=1, g=0) of "a" (flat 2: 3) and t=1 of "b" (4).
  EXPECT_DOUBLE_EQ(NsLoadShare(plan, {{"a", DomainOf(2, 2, 1, 1, 0, 0)},
                                      {"b", DomainOf(1, 1, 2, 0, 0, 1)},
                                      {"adamw", DomainOf(1, 1, 1, 0, 0, 0)}}),
                   7.0 / 20);
  EXPECT_DOUBLE_EQ(NsLoadShare(plan, {{"a", DomainOf(2, 2, 1, 0, 1, 0)}}),
                   2.0 / 20);
  EXPECT_EQ(NsLoadShare(plan, {{"other", DomainOf(1, 1, 1, 0, 0, 0)}}), 0);
  EXPECT_EQ(NsLoadShare(v1::Plan(), {{"a", DomainOf(1, 1, 1, 0, 0, 0)}}), 0);
}

// A 1 x 2 TP domain; rank r = t, column-parallel weights.
v1::PublishManifestRequest Manifest(const std::string& job, int rank) {
  v1::PublishManifestRequest r;
  r.set_job_id(job);
  r.set_rank(rank);
  v1::GroupManifest* g = r.add_groups();
  g->set_group("muon");
  g->set_algorithm(v1::ALGORITHM_MUON);
  *g->mutable_domain() = DomainOf(0, 1, 2, 0, 0, rank);
  g->mutable_domain()->clear_dp_size();
  for (const auto& [p, q] :
       {std::pair<int64_t, int64_t>{64, 32}, {32, 32}, {16, 32}}) {
    v1::ParamSpec* s = g->add_params();
    s->set_name(absl::StrCat("w", p));
    s->add_full_shape(p);
    s->add_full_shape(q);
    s->add_local_shape(p / 2);
    s->add_local_shape(q);
    s->mutable_tags()->set_tensor_model_parallel(true);
    s->mutable_tags()->set_partition_dim(0);
  }
  return r;
}

v1::JoinRequest Join(const std::string& job, int rank) {
  v1::JoinRequest r;
  r.set_job_id(job);
  r.set_rank(rank);
  r.set_world_size(2);
  r.set_address(absl::StrCat("unix:///tmp/x", rank));
  return r;
}

TEST(CoordinatorMetrics, CountersAndJobGauges) {
  CoordinatorMetrics metrics;
  CoordinatorOptions options;
  options.metrics = &metrics;
  options.planner = [](const v1::GroupManifest& m, v1::CostModel model,
                       const CostTable& costs) {
    return PlanGroup(m, model, costs);
  };
  CoordinatorCore core(options);
  metrics.CollectJobsFrom([&core] { return core.MetricsSnapshot(); });
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(core.Join(Join("j", r)).ok());
  // The job's counters exist at 0 from its first Join on.
  for (const char* counter : {"plans_built", "manifests", "rebalances"}) {
    EXPECT_THAT(metrics.registry().Render(),
                HasSubstr(absl::StrCat("\nmuond_coordinator_", counter,
                                       "_total{job=\"j\"} 0\n")));
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r)).ok());
  }
  absl::StatusOr<v1::Plan> plan = core.GetPlan("j");
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The shares from the homes, independently: ns_cost = max * min^2 at the
  // home rank t.
  double load[2] = {0, 0};
  const int64_t shapes[3][2] = {{64, 32}, {32, 32}, {16, 32}};
  for (int i = 0; i < 3; ++i) {
    const double p = double(shapes[i][0]), q = double(shapes[i][1]);
    load[plan->groups(0).homes(i).t()] +=
        std::max(p, q) * std::min(p, q) * std::min(p, q);
  }
  std::string text = metrics.registry().Render();
  EXPECT_THAT(text, HasSubstr("\nmuond_coordinator_jobs 1\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_coordinator_daemons{job=\"j\"} 2\n"));
  EXPECT_THAT(text,
              HasSubstr("\nmuond_coordinator_plan_version{job=\"j\"} 1\n"));
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(text,
                HasSubstr(absl::StrCat(
                    "\nmuond_coordinator_ns_load{job=\"j\",rank=\"", r, "\"} ",
                    FormatMetricValue(load[r] / (load[0] + load[1])), "\n")));
  }
  EXPECT_THAT(text, HasSubstr("\nmuond_coordinator_manifests_total{job=\"j\"}"
                              " 2\n"));
  EXPECT_THAT(
      text, HasSubstr("\nmuond_coordinator_plans_built_total{job=\"j\"} 1\n"));
  // Created at 0 with the job, so rate() sees the first rebalance.
  EXPECT_THAT(text,
              HasSubstr("\nmuond_coordinator_rebalances_total{job=\"j\"} 0\n"));

  v1::RebalanceRequest rebalance;
  rebalance.set_job_id("j");
  ASSERT_TRUE(core.Rebalance(rebalance).ok());
  text = metrics.registry().Render();
  EXPECT_THAT(
      text, HasSubstr("\nmuond_coordinator_plans_built_total{job=\"j\"} 2\n"));
  EXPECT_THAT(text,
              HasSubstr("\nmuond_coordinator_rebalances_total{job=\"j\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("\nmuond_coordinator_plan_version{job=\"j\"} 2\n"));
  EXPECT_THAT(text, Not(HasSubstr("plan_build_failures_total{")));
}

TEST(CoordinatorMetrics, PlanningFailuresByCode) {
  CoordinatorMetrics metrics;
  CoordinatorOptions options;
  options.metrics = &metrics;
  options.planner = [](const v1::GroupManifest&, v1::CostModel,
                       const CostTable&) -> absl::StatusOr<v1::GroupPlan> {
    return absl::ResourceExhaustedError("planner out of memory");
  };
  CoordinatorCore core(options);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(core.Join(Join("j", r)).ok());
  ASSERT_TRUE(core.PublishManifest(Manifest("j", 0)).ok());
  EXPECT_FALSE(core.PublishManifest(Manifest("j", 1)).ok());
  const std::string text = metrics.registry().Render();
  EXPECT_THAT(text, HasSubstr("\nmuond_coordinator_plan_build_failures_total{"
                              "reason=\"RESOURCE_EXHAUSTED\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("\nmuond_coordinator_plans_built_total{"
                              "job=\"j\"} 0\n"));
  // No collector: the job gauges stay empty, the count of jobs 0.
  EXPECT_THAT(text, HasSubstr("\nmuond_coordinator_jobs 0\n"));
}

}  // namespace
}  // namespace muond
