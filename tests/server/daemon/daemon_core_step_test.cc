// DaemonCore's Step: the step id rules, plan activation and hand-over to the
// engine, overrides and skip_params, and which round's plans a registration
// uses.
#include "tests/server/daemon/daemon_core_fixture.h"

namespace muond::daemon_core_test {
namespace {

TEST_F(DaemonCoreTest, StepRulesAndPlanActivation) {
  EXPECT_THAT(core_->Step(StepReq(1)).status().message(),
              HasSubstr("no params are registered"));
  ASSERT_TRUE(core_->Register(Valid()).ok());
  absl::Status before = core_->Step(StepReq(1)).status();
  EXPECT_EQ(before.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(before.message(), HasSubstr("before the plan"));

  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  float* w = static_cast<float*>(region_->data());
  ASSERT_EQ(*w, 0.0f);
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 1);
  EXPECT_FALSE(s1->replayed());
  EXPECT_GT(s1->timings().handler_us(), 0);  // the handler's own wall time
  EXPECT_EQ(*w, 1.0f);
  ASSERT_EQ(link_.reports.size(), 1u);
  EXPECT_EQ(link_.reports[0].step_id(), 1);

  // Replay: recorded answer, nothing applied.
  absl::StatusOr<v1::StepResponse> again = core_->Step(StepReq(1));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->replayed());
  EXPECT_EQ(again->timings().total_us(), 7);
  EXPECT_EQ(*w, 1.0f);

  // Backwards and gaps name both ids.
  absl::Status back = core_->Step(StepReq(0)).status();
  EXPECT_EQ(back.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(back.message(), HasSubstr("step_id 0"));
  EXPECT_THAT(back.message(), HasSubstr("last applied step_id 1"));
  // A trainer out of step after a state load is told where the id comes from.
  EXPECT_THAT(back.message(), HasSubstr("first_step_id=N"));
  EXPECT_THAT(core_->Step(StepReq(5)).status().message(),
              HasSubstr("step_id 5"));
  EXPECT_EQ(*w, 1.0f);

  // Wrong job, foreign client, unknown group in overrides.
  v1::StepRequest bad = StepReq(2);
  bad.set_job_id("nope");
  EXPECT_EQ(core_->Step(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = StepReq(2);
  bad.set_client_id("intruder");
  EXPECT_EQ(core_->Step(bad).status().code(),
            absl::StatusCode::kPermissionDenied);
  bad = StepReq(2);
  bad.add_overrides()->set_group("ghost");
  EXPECT_THAT(core_->Step(bad).status().message(),
              HasSubstr("unknown group 'ghost'"));
  EXPECT_EQ(*w, 1.0f);

  // A plan activating at step 3: step 2 keeps version 1, step 3 switches.
  core_->OnPlan(PlanFor(2, 3, 1));
  EXPECT_EQ(core_->Status().latest_plan_version(), 2);
  EXPECT_EQ(core_->Step(StepReq(2))->plan_version(), 1);
  EXPECT_EQ(core_->Step(StepReq(3))->plan_version(), 2);
  ASSERT_EQ(fake_->homes_set.size(), 2u);
  EXPECT_EQ(fake_->homes_set[1].second[0].g, 1);
  EXPECT_EQ(*w, 3.0f);
  EXPECT_EQ(core_->Status().last_step_id(), 3);

  // Unregister drops the engine; a new registration starts fresh step ids.
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_FALSE(core_->Health().has_plan());
  EXPECT_EQ(core_->Status().num_params(), 0);
}

// StepRequest.trainer_refusal refuses the step, new or a replay, naming the
// trainer's reason (echoed bounded, control bytes escaped); nothing is
// applied, and the same id steps afterwards. A refused replay answered from
// the record would advance the other trainers' step id and not the refusing
// one's.
TEST_F(DaemonCoreTest, TrainerRefusalRefusesANewStepAndAReplay) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  float* w = static_cast<float*>(region_->data());
  v1::StepRequest refused = StepReq(1);
  refused.set_trainer_refusal("ValueError: group 0 'ns_steps' changed\n[E]");
  absl::Status st = core_->Step(refused).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(st.message(), HasSubstr("the trainer refused it"));
  EXPECT_THAT(st.message(), HasSubstr("changed\\n[E]"));
  EXPECT_TRUE(HasErrorReason(st, ErrorReason::kTrainerRefused)) << st;
  EXPECT_EQ(*w, 0.0f);
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  EXPECT_EQ(*w, 1.0f);

  st = core_->Step(refused).status();  // step 1 again: a replay
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(st.message(), HasSubstr("the trainer refused it"));
  EXPECT_EQ(*w, 1.0f);
  EXPECT_EQ(core_->Status().last_step_id(), 1);
  absl::StatusOr<v1::StepResponse> again = core_->Step(StepReq(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed());
}

// The largest step id is 2^62 - 1 for steps as for loads and imports: a step
// past it is refused naming the range and applies nothing; the bound itself
// steps.
TEST_F(DaemonCoreTest, StepIdBoundIsTheLoadBound) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  float* w = static_cast<float*>(region_->data());
  absl::Status past = core_->Step(StepReq(int64_t{1} << 62)).status();
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  EXPECT_THAT(past.message(), HasSubstr("step_id 4611686018427387904 must be "
                                        "in [0, 4611686018427387903]"));
  EXPECT_EQ(*w, 0.0f);
  absl::StatusOr<v1::StepResponse> last =
      core_->Step(StepReq((int64_t{1} << 62) - 1));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(*w, 1.0f);
  EXPECT_EQ(core_->Status().last_step_id(), (int64_t{1} << 62) - 1);
}

// Two plans that become active at the same step both reach the engine, in
// version order, so this rank can route by the older one while a peer that
// has not received the newer one yet catches up; the response names the
// version the domain agreed on.
// skip_params and the overrides reach the engine as they were sent; a skip
// name the daemon does not hold, a field of the other algorithm or a value
// out of bounds is refused through the engine's job vote (the refusal is
// the step's inputs.refusal), naming it, and nothing is applied.
TEST_F(DaemonCoreTest, SkipParamsAndOverridesReachTheEngineOrAreRefused) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  float* w = static_cast<float*>(region_->data());
  v1::StepRequest bad = StepReq(1);
  bad.add_skip_params("w");
  bad.add_skip_params("ghost");
  absl::Status st = core_->Step(bad).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("skip_params: 'ghost' names no param"));
  EXPECT_EQ(*w, 0.0f);
  bad = StepReq(1);
  v1::GroupOverride* o = bad.add_overrides();
  o->set_group("muon");
  o->set_beta1(0.9);
  st = core_->Step(bad).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(),
              HasSubstr("group 'muon' beta1 is an AdamW hyperparameter"));
  o->clear_beta1();
  o->set_momentum(1.0);
  EXPECT_THAT(core_->Step(bad).status().message(),
              HasSubstr("group 'muon' momentum must be in [0, 1)"));
  EXPECT_EQ(*w, 0.0f);
  // One GroupOverride per group: a second (even a valid one) is refused.
  o->set_momentum(0.5);
  bad.add_overrides()->set_group("muon");
  st = core_->Step(bad).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(),
              HasSubstr("group 'muon' has more than one GroupOverride"));
  EXPECT_EQ(*w, 0.0f);

  v1::StepRequest good = StepReq(1);
  good.add_skip_params("v");
  o = good.add_overrides();
  o->set_group("muon");
  o->set_momentum(0.5);
  o->set_nesterov(false);
  absl::StatusOr<v1::StepResponse> r = core_->Step(good);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(fake_->skip_params, std::set<std::string>{"v"});
  EXPECT_EQ(fake_->overrides.momentum.at("muon"), 0.5);
  EXPECT_EQ(fake_->overrides.nesterov.at("muon"), false);
  EXPECT_TRUE(fake_->overrides.lr.empty());
}

TEST_F(DaemonCoreTest, EveryPlanVersionReachesTheEngineInOrder) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  core_->OnPlan(PlanFor(2, 3, 1));
  core_->OnPlan(PlanFor(3, 3, 0));
  core_->OnPlan(PlanFor(4, 9, 1));  // later: not handed over at step 3
  ASSERT_TRUE(core_->Step(StepReq(2)).ok());
  fake_->agreed_version = 2;  // a peer holds version 2 only
  absl::StatusOr<v1::StepResponse> s3 = core_->Step(StepReq(3));
  ASSERT_TRUE(s3.ok()) << s3.status();
  EXPECT_EQ(s3->plan_version(), 2);
  EXPECT_EQ(fake_->versions_set, (std::vector<int64_t>{1, 2, 3}));
  ASSERT_EQ(fake_->homes_set.size(), 3u);
  EXPECT_EQ(fake_->homes_set[1].second[0].g, 1);
  EXPECT_EQ(fake_->homes_set[2].second[0].g, 0);
}

// A daemon keeps its newest 64 plans; the engine gets the kept versions.
TEST_F(DaemonCoreTest, KeepsTheNewestPlans) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  for (int64_t v = 1; v <= 70; ++v) core_->OnPlan(PlanFor(v, 0, v % 2));
  WaitForEngine();
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 70);
  ASSERT_EQ(fake_->versions_set.size(), 64u);
  EXPECT_EQ(fake_->versions_set.front(), 7);
  EXPECT_EQ(fake_->versions_set.back(), 70);
}

// A re-registration uses only plans of its own round (never the plan of the
// previous trainer, whose rendezvous keys are stale); when every plan of the
// round activates later than the step, the round's oldest one serves it.
TEST_F(DaemonCoreTest, ReRegistrationUsesOnlyItsRoundsPlans) {
  link_.round_version = 1;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_EQ(core_->Step(StepReq(1))->plan_version(), 1);
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());

  link_.round_version = 2;
  absl::StatusOr<v1::RegisterParamsResponse> again = core_->Register(Valid());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->plan_version(), 0) << "plan 1 belongs to the last round";
  absl::Status early = core_->Step(StepReq(1)).status();
  EXPECT_THAT(early.message(), HasSubstr("before the plan"));
  core_->OnPlan(PlanFor(2, 10, 1));  // the round's plan activates later
  WaitForEngine();
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 2);
  ASSERT_FALSE(fake_->homes_set.empty());
  EXPECT_EQ(fake_->homes_set.back().second[0].g, 1);
}

}  // namespace
}  // namespace muond::daemon_core_test
