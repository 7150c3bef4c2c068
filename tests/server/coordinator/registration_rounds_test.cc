// CoordinatorCore in-process. Registration rounds: a plan once every rank
// published, a new version per round, and a refused round dropping every
// manifest of the round so a retry (in any order) plans from nothing of the
// refused attempt. Plans come from the real core planner (PlanGroup).
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

TEST(RegistrationRounds, PlanComputedOnceAllPublished) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r, kShapes)).ok());
    EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound);
  }
  std::thread last([&core] {
    absl::SleepFor(absl::Milliseconds(30));
    ASSERT_TRUE(core.PublishManifest(Manifest("j", 3, kShapes)).ok());
  });
  absl::StatusOr<std::optional<v1::Plan>> waited =
      core.WaitForPlan("j", 0, absl::Seconds(10));
  last.join();
  ASSERT_TRUE(waited.ok() && waited->has_value());
  const v1::Plan& plan = **waited;
  EXPECT_EQ(plan.version(), 1);
  EXPECT_EQ(plan.activate_at_step(), 0);
  ASSERT_EQ(plan.groups_size(), 1);
  ASSERT_EQ(plan.groups(0).homes_size(), int(kShapes.size()));
  // Independent check of the load model: every GTP+TP param loads exactly its
  // home rank with ns_cost = max * min^2, so the rank loads sum to the total.
  std::vector<double> load(4, 0);
  for (size_t i = 0; i < kShapes.size(); ++i) {
    const auto [p, q] = kShapes[i];
    const double cost =
        double(std::max(p, q)) * std::min(p, q) * std::min(p, q);
    const v1::NsHome& h = plan.groups(0).homes(i);
    ASSERT_TRUE(h.g() >= 0 && h.g() < 2 && h.t() >= 0 && h.t() < 2);
    load[h.g() * 2 + h.t()] += cost;
  }
  ASSERT_EQ(plan.groups(0).rank_load_size(), 4);
  for (int r = 0; r < 4; ++r)
    EXPECT_DOUBLE_EQ(plan.groups(0).rank_load(r), load[r]);
  // Re-publishing the same manifest (a daemon reconnecting) keeps the plan.
  ASSERT_TRUE(core.PublishManifest(Manifest("j", 2, kShapes)).ok());
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
}

// Registration rounds: identical manifests from new registrations (a second
// trainer on the same daemons) get a new plan version once every rank has
// re-published; a reconnect re-publish (same registration id) does not.
TEST(RegistrationRounds, EveryRegistrationRoundGetsANewPlanVersion) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<int64_t> round = core.PublishRegistration(
        Manifest("j", r, kShapes), "a" + std::to_string(r));
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_EQ(*round, 1);
  }
  ASSERT_EQ(core.GetPlan("j")->version(), 1);
  // Reconnect re-publish: same id, same manifest, no new plan.
  ASSERT_TRUE(core.PublishRegistration(Manifest("j", 2, kShapes), "a2").ok());
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
  // Round 2: ranks 0..2 re-register; no plan until rank 3 does.
  for (int r = 0; r < 3; ++r) {
    absl::StatusOr<int64_t> round = core.PublishRegistration(
        Manifest("j", r, kShapes), "b" + std::to_string(r));
    ASSERT_TRUE(round.ok()) << round.status();
    EXPECT_EQ(*round, 2) << "the round's plan is at least version 2";
    EXPECT_EQ(core.GetPlan("j")->version(), 1);
  }
  ASSERT_TRUE(core.PublishRegistration(Manifest("j", 3, kShapes), "b3").ok());
  absl::StatusOr<v1::Plan> plan = core.GetPlan("j");
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->version(), 2);
  EXPECT_EQ(plan->activate_at_step(), 0);
}

// A re-registration in which rank 3's manifest is unchanged and published
// first, then rank 0's changed (a group only rank 0 holds was added, as
// muond.torch.Muon.add_param_group does): rank 3's registration counts in
// the new round, which completes with ranks 1 and 2 (it used to wait for
// rank 3 forever: rank 0's new manifest dropped it).
TEST(RegistrationRounds, UnchangedManifestPublishedFirstCountsInTheNewRound) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishRegistration(Manifest("j", r, kShapes),
                                         "a" + std::to_string(r))
                    .ok());
  }
  ASSERT_EQ(core.GetPlan("j")->version(), 1);
  ASSERT_TRUE(core.PublishRegistration(Manifest("j", 3, kShapes), "b3").ok());
  v1::PublishManifestRequest m0 = Manifest("j", 0, kShapes);
  v1::GroupManifest* solo = m0.add_groups();
  solo->set_group("late.solo-r0");
  solo->set_algorithm(v1::ALGORITHM_MUON);
  solo->mutable_domain()->set_name("solo-r0");
  solo->mutable_domain()->set_gtp_size(1);
  solo->mutable_domain()->set_tp_size(1);
  v1::ParamSpec* p = solo->add_params();
  p->set_name("solo");
  p->add_full_shape(8);
  p->add_full_shape(4);
  p->add_local_shape(8);
  p->add_local_shape(4);
  ASSERT_TRUE(core.PublishRegistration(m0, "b0").ok());
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
  for (int r = 1; r < 3; ++r) {
    ASSERT_TRUE(core.PublishRegistration(Manifest("j", r, kShapes),
                                         "b" + std::to_string(r))
                    .ok());
  }
  absl::StatusOr<v1::Plan> plan = core.GetPlan("j");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->version(), 2);
  EXPECT_EQ(plan->groups_size(), 2);
}

// A refused registration refuses its round: the ranks that published before
// it (their trainer gives up and unregisters) must not complete the retry's
// round with their old registrations (the refused rank, retrying first, built
// a plan its peers never used: a Gloo rendezvous on keys nobody set), and
// their values are not compared with the retry.
TEST(RegistrationRounds, RefusedRoundLeavesNothingForTheRetry) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r : {0, 1, 3}) {
    ASSERT_TRUE(
        core.PublishRegistration(WithNsSteps(Manifest("j", r, kShapes), 5),
                                 "a" + std::to_string(r))
            .ok());
  }
  absl::StatusOr<int64_t> refused =
      core.PublishRegistration(WithNsSteps(Manifest("j", 2, kShapes), 3), "a2");
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("num_ns_steps"));
  // Retry, the refused rank first: no plan until every rank published again,
  // and every rank's round is the plan that comes.
  for (int r : {2, 0, 1, 3}) {
    EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound)
        << "planned before rank " << r << " registered again";
    absl::StatusOr<int64_t> round = core.PublishRegistration(
        WithNsSteps(Manifest("j", r, kShapes), 5), "b" + std::to_string(r));
    ASSERT_TRUE(round.ok()) << r << ": " << round.status();
    EXPECT_EQ(*round, 1) << r;
  }
  ASSERT_TRUE(core.GetPlan("j").ok());
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
}

// The disagreeing rank published first: the ranks refused after it retry
// first with the agreed value, and are not compared with the refused
// attempt's value (it used to refuse them with "rank 2 has 3").
TEST(RegistrationRounds, RetryIsNotComparedWithTheRefusedAttempt) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  ASSERT_TRUE(
      core.PublishRegistration(WithNsSteps(Manifest("j", 2, kShapes), 3), "a2")
          .ok());
  absl::StatusOr<int64_t> refused =
      core.PublishRegistration(WithNsSteps(Manifest("j", 0, kShapes), 5), "a0");
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("rank 2 has 3"));
  for (int r : {0, 1, 3, 2}) {
    absl::StatusOr<int64_t> round = core.PublishRegistration(
        WithNsSteps(Manifest("j", r, kShapes), 5), "b" + std::to_string(r));
    ASSERT_TRUE(round.ok()) << r << ": " << round.status();
  }
  ASSERT_TRUE(core.GetPlan("j").ok());
  EXPECT_EQ(core.GetPlan("j")->version(), 1);
}

// A daemon's own refusal of its trainer's registration (registration_refused)
// refuses the round: the rank that published hears it on its plan stream at
// once, a re-publish of its dropped registration is refused with it, and the
// retry (every rank again, in any order) gets a plan.
TEST(RegistrationRounds, OwnRefusalRefusesTheRoundOnEveryRank) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  ASSERT_TRUE(core.PublishRegistration(Manifest("j", 0, kShapes), "a0").ok());
  v1::PublishManifestRequest refusal;
  refusal.set_job_id("j");
  refusal.set_rank(1);
  refusal.set_registration_refused("param 'w' grad: view runs past region");
  ASSERT_TRUE(core.PublishRegistration(refusal, "").ok());

  int64_t seen = -1;
  absl::StatusOr<std::optional<v1::Plan>> pushed =
      core.WaitForWatcher("j", 0, 0, &seen, absl::Milliseconds(100));
  ASSERT_TRUE(pushed.ok() && pushed->has_value());
  EXPECT_EQ((*pushed)->round_refused(),
            "rank 1 refused its trainer's registration: param 'w' grad: view "
            "runs past region");
  EXPECT_EQ((*pushed)->refused_registration(), "a0");

  absl::StatusOr<int64_t> stale =
      core.PublishRegistration(Manifest("j", 0, kShapes), "a0");
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stale.status().message(),
              HasSubstr("rank 1 refused its trainer's registration: param "
                        "'w' grad"));
  EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound);

  for (int r : {2, 1, 0, 3}) {
    ASSERT_TRUE(core.PublishRegistration(Manifest("j", r, kShapes),
                                         "b" + std::to_string(r))
                    .ok())
        << r;
  }
  EXPECT_TRUE(core.GetPlan("j").ok());

  refusal.add_groups()->set_group("g");
  EXPECT_THAT(core.PublishRegistration(refusal, "").status().message(),
              HasSubstr("registration_refused is set but groups has 1"));
}

// Rank 0 publishes, rank 1 is refused: in every order of the retry's new
// registrations the plan comes with the last, and re-publishes of the refused
// round's registrations (rank 0's dropped one, rank 1's refused one) are
// refused with its reason at every point, changing nothing.
TEST(RegistrationRounds, StaleRepublishIsRefusedAndEveryRetryOrderPlans) {
  std::vector<int> order = {0, 1, 2, 3};
  do {
    SCOPED_TRACE(
        absl::StrCat("order ", order[0], order[1], order[2], order[3]));
    CoordinatorCore core(Options());
    JoinAll(core, "j", 4);
    ASSERT_TRUE(core.PublishRegistration(
                        WithNsSteps(Manifest("j", 0, kShapes), 5), "a0")
                    .ok());
    ASSERT_FALSE(core.PublishRegistration(
                         WithNsSteps(Manifest("j", 1, kShapes), 3), "a1")
                     .ok());
    for (int r : order) {
      for (int s : {0, 1}) {
        absl::StatusOr<int64_t> stale = core.PublishRegistration(
            WithNsSteps(Manifest("j", s, kShapes), s == 0 ? 5 : 3),
            "a" + std::to_string(s));
        ASSERT_EQ(stale.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(stale.status().message(),
                    HasSubstr("registration round refused at rank 1: "));
        EXPECT_THAT(stale.status().message(), HasSubstr("num_ns_steps"));
      }
      EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound);
      absl::StatusOr<int64_t> round = core.PublishRegistration(
          WithNsSteps(Manifest("j", r, kShapes), 5), "b" + std::to_string(r));
      ASSERT_TRUE(round.ok()) << r << ": " << round.status();
      EXPECT_EQ(*round, 1) << r;
    }
    ASSERT_TRUE(core.GetPlan("j").ok());
    EXPECT_EQ(core.GetPlan("j")->version(), 1);
  } while (std::next_permutation(order.begin(), order.end()));
}

v1::PublishManifestRequest OwnRefusal(int rank, const std::string& reason) {
  v1::PublishManifestRequest refusal;
  refusal.set_job_id("j");
  refusal.set_rank(rank);
  refusal.set_registration_refused(reason);
  return refusal;
}

// The race of bad_input_test: rank 0's daemon refuses its trainer's
// registrations (the last of a series), then every rank registers anew. The
// other ranks' new publishes may reach the coordinator before rank 0's (they
// were refused as "late" for the refused round, and rank 0 waited for a plan
// forever) or after it: in both orders they start or join the next round and
// the plan comes with the last publish. A re-publish of the registration the
// refusal dropped (rank 1's daemon reconnecting) is stale: refused with the
// refusal's reason before and after rank 0's new publish and after the plan,
// changing nothing.
TEST(RegistrationRounds, NewRegistrationsAfterARefusalPlanInEitherOrder) {
  // A function per order, so a failed ASSERT in one still runs the other.
  auto run = [](bool zero_first) {
    SCOPED_TRACE(zero_first ? "rank 0 publishes first"
                            : "rank 0 publishes last");
    CoordinatorCore core(Options());
    JoinAll(core, "j", 4);
    ASSERT_TRUE(core.PublishRegistration(Manifest("j", 1, kShapes), "a1").ok());
    ASSERT_TRUE(core.PublishRegistration(OwnRefusal(0, "bad view"), "").ok());
    ASSERT_TRUE(core.PublishRegistration(OwnRefusal(0, "bad shape"), "").ok());
    auto expect_stale = [&](const std::string& when) {
      absl::StatusOr<int64_t> stale =
          core.PublishRegistration(Manifest("j", 1, kShapes), "a1");
      EXPECT_EQ(stale.status().code(), absl::StatusCode::kInvalidArgument)
          << when;
      EXPECT_THAT(stale.status().message(),
                  HasSubstr("rank 0 refused its trainer's registration: bad "
                            "view (rank 1 published its registration 'a1' of "
                            "that refused round again"))
          << when;
    };
    const std::vector<int> order = zero_first ? std::vector<int>{0, 1, 2, 3}
                                              : std::vector<int>{1, 2, 3, 0};
    for (size_t i = 0; i < order.size(); ++i) {
      const int r = order[i];
      EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound)
          << "planned before rank " << r << " registered anew";
      absl::StatusOr<int64_t> round = core.PublishRegistration(
          Manifest("j", r, kShapes), "b" + std::to_string(r));
      ASSERT_TRUE(round.ok()) << "rank " << r << ": " << round.status();
      EXPECT_EQ(*round, 1) << r;
      if (i == 0) expect_stale(absl::StrCat("after rank ", r, "'s publish"));
    }
    absl::StatusOr<v1::Plan> plan = core.GetPlan("j");
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->version(), 1);
    // Stale after the plan too: it starts no round (rank 1 would wait alone).
    expect_stale("after the plan");
    v1::RebalanceRequest rebalance;
    rebalance.set_job_id("j");
    EXPECT_TRUE(core.Rebalance(rebalance).ok())
        << "a stale publish left a registration round open";
  };
  run(/*zero_first=*/false);
  run(/*zero_first=*/true);
}

}  // namespace
}  // namespace muond
