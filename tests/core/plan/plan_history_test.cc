// PlanHistory: numbering, the restart floor, retention, rounds, activation.
// Reference: the rules written out as plain loops over every held version
// (ReferenceActiveAt) and hand-computed expectations.
#include "core/plan/plan_history.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace muond {
namespace {

struct TestPlan {
  int64_t v = 0;
  int64_t activate = 0;
  std::string homes;  // stands for the payload
  int64_t version() const { return v; }
  int64_t activate_at_step() const { return activate; }
};

const PlanHistory<TestPlan>::Usable kAny = [](const TestPlan&) { return true; };

std::vector<int64_t> Versions(const std::vector<const TestPlan*>& plans) {
  std::vector<int64_t> out;
  for (const TestPlan* p : plans) out.push_back(p->v);
  return out;
}

TEST(PlanHistoryTest, NumbersFromOneStrictlyIncreasing) {
  PlanHistory<TestPlan> h;
  EXPECT_EQ(h.NextVersion(), 1);
  ASSERT_TRUE(h.Append({1, 0, "a"}).ok());
  ASSERT_TRUE(h.Append({2, 10, "b"}).ok());
  EXPECT_EQ(h.NextVersion(), 3);
  // A version that is not the next one is refused and changes nothing.
  const absl::Status st = h.Append({2, 20, "c"});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("not the next version 3"), std::string::npos)
      << st;
  EXPECT_EQ(h.Append({5, 0, "d"}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(h.size(), 2u);
  EXPECT_EQ(h.newest()->homes, "b");
}

TEST(PlanHistoryTest, RestartFloorNumbersAboveDaemonsAndActivatesLater) {
  // A fresh coordinator under daemons holding version 7, stepped to 300.
  PlanHistory<TestPlan> h;
  EXPECT_EQ(h.RoundActivationStep(20), 0);  // a fresh job: at once
  h.RaiseFloor(7, 300);
  h.RaiseFloor(5, 250);  // another daemon, behind: the floor never drops
  EXPECT_EQ(h.NextVersion(), 8);
  EXPECT_EQ(h.resume_step(), 300);
  EXPECT_EQ(h.RoundActivationStep(20), 320);
  ASSERT_TRUE(h.Append({8, 320, "x"}).ok());
  // Once it planned, later rounds activate at once again.
  EXPECT_EQ(h.RoundActivationStep(20), 0);
  EXPECT_EQ(h.NextVersion(), 9);
  // A floor above the newest held version wins.
  h.RaiseFloor(12, 0);
  EXPECT_EQ(h.NextVersion(), 13);
}

TEST(PlanHistoryTest, KeepsTheNewestKPlansKept) {
  PlanHistory<TestPlan> h;
  const int64_t total = kPlansKept + 5;
  for (int64_t v = 1; v <= total; ++v) ASSERT_TRUE(h.Append({v, 0, ""}).ok());
  EXPECT_EQ(h.size(), size_t(kPlansKept));
  EXPECT_EQ(h.oldest()->v, total - kPlansKept + 1);
  EXPECT_EQ(h.newest()->v, total);
  EXPECT_EQ(h.Find(total - kPlansKept), nullptr);  // evicted
  EXPECT_NE(h.Find(total - kPlansKept + 1), nullptr);
  // Numbering goes on above the evicted ones.
  EXPECT_EQ(h.NextVersion(), total + 1);
}

TEST(PlanHistoryTest, SmallerLimitClampedAndValidated) {
  PlanHistory<TestPlan> three(3);
  for (int64_t v = 1; v <= 5; ++v) three.Insert({v, 0, ""});
  EXPECT_EQ(three.size(), 3u);
  EXPECT_EQ(three.oldest()->v, 3);
  EXPECT_EQ(PlanHistory<TestPlan>(0).kept(), 1);
  EXPECT_EQ(PlanHistory<TestPlan>(kPlansKept + 1).kept(), kPlansKept);
  EXPECT_TRUE(ValidatePlansKept("plans_kept", kPlansKept).ok());
  EXPECT_TRUE(ValidatePlansKept("plans_kept", 1).ok());
  for (int bad : {0, -1, kPlansKept + 1}) {
    const absl::Status st = ValidatePlansKept("plans_kept", bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("plans_kept"), std::string::npos) << st;
  }
}

TEST(PlanHistoryTest, InsertKeepsTheFirstCopyOfAVersionAndAcceptsAnyOrder) {
  PlanHistory<TestPlan> h;
  EXPECT_TRUE(h.Insert({4, 0, "first"}));
  EXPECT_FALSE(h.Insert({4, 9, "second"}));
  EXPECT_TRUE(h.Insert({2, 0, "older"}));
  EXPECT_EQ(h.Find(4)->homes, "first");
  EXPECT_EQ(h.oldest()->v, 2);
  EXPECT_EQ(h.newest()->v, 4);
}

TEST(PlanHistoryTest, WatcherGetsEveryVersionInOrder) {
  PlanHistory<TestPlan> h(4);
  EXPECT_EQ(h.NextForWatcher(0), nullptr);
  for (int64_t v = 1; v <= 6; ++v) ASSERT_TRUE(h.Append({v, 0, ""}).ok());
  // Held: 3..6.
  EXPECT_EQ(h.NextForWatcher(0)->v, 6);  // a new watcher: the newest
  EXPECT_EQ(h.NextForWatcher(1)->v, 3);  // fell behind the limit: oldest
  EXPECT_EQ(h.NextForWatcher(3)->v, 4);  // the next, not the newest
  EXPECT_EQ(h.NextForWatcher(5)->v, 6);
  EXPECT_EQ(h.NextForWatcher(6), nullptr);  // up to date
}

// The activation rule written out over all held versions.
const TestPlan* ReferenceActiveAt(const std::vector<TestPlan>& held,
                                  int64_t round, int64_t step,
                                  bool (*usable)(const TestPlan&)) {
  const TestPlan* best = nullptr;
  for (const TestPlan& p : held) {
    if (p.v >= round && p.activate <= step && usable(p) &&
        (best == nullptr || p.v > best->v)) {
      best = &p;
    }
  }
  if (best != nullptr) return best;
  for (const TestPlan& p : held) {
    if (p.v >= round && usable(p) && (best == nullptr || p.v < best->v)) {
      best = &p;
    }
  }
  return best;
}

TEST(PlanHistoryTest, ActiveAtMatchesTheRuleWrittenOut) {
  // Versions 1..9; odd ones are "usable" (match the registration).
  std::vector<TestPlan> held;
  PlanHistory<TestPlan> h;
  for (int64_t v = 1; v <= 9; ++v) {
    held.push_back({v, (v * 37) % 23, ""});
    h.Insert(held.back());
  }
  bool (*odd)(const TestPlan&) = [](const TestPlan& p) { return p.v % 2 == 1; };
  for (int64_t round : {0, 1, 4, 9, 10}) {
    h.StartRound(round);
    EXPECT_EQ(h.round_start(), round);
    for (int64_t step = 0; step <= 25; ++step) {
      const TestPlan* want = ReferenceActiveAt(held, round, step, odd);
      const TestPlan* got = h.ActiveAt(step, odd);
      ASSERT_EQ(got == nullptr, want == nullptr)
          << "round " << round << " step " << step;
      if (want != nullptr) {
        EXPECT_EQ(got->v, want->v) << "round " << round << " step " << step;
      }
    }
  }
}

TEST(PlanHistoryTest, ActiveAtFallsBackToTheRoundsOldest) {
  // A restarted job stepping from 1 under plans made for later steps.
  PlanHistory<TestPlan> h;
  h.Insert({3, 0, ""});  // an earlier round's plan, active at once
  h.Insert({5, 100, ""});
  h.Insert({6, 120, ""});
  h.StartRound(5);
  EXPECT_EQ(h.ActiveAt(1, kAny)->v, 5);
  EXPECT_EQ(h.ActiveAt(110, kAny)->v, 5);
  EXPECT_EQ(h.ActiveAt(120, kAny)->v, 6);
  EXPECT_EQ(h.NewestOfRound(kAny)->v, 6);
  h.StartRound(7);
  EXPECT_EQ(h.ActiveAt(500, kAny), nullptr);
  EXPECT_EQ(h.NewestOfRound(kAny), nullptr);
}

TEST(PlanHistoryTest, HandOverGivesEveryUsableVersionOfTheRoundInOrder) {
  PlanHistory<TestPlan> h;
  for (int64_t v = 1; v <= 8; ++v) h.Insert({v, 0, ""});
  auto not_six = [](const TestPlan& p) { return p.v != 6; };
  h.StartRound(3);
  EXPECT_EQ(Versions(h.HandOver(0, 7, not_six)),
            (std::vector<int64_t>{3, 4, 5, 7}));
  EXPECT_EQ(Versions(h.HandOver(4, 8, not_six)),
            (std::vector<int64_t>{5, 7, 8}));
  EXPECT_TRUE(h.HandOver(8, 8, kAny).empty());
  h.StartRound(0);
  EXPECT_EQ(Versions(h.HandOver(0, 2, kAny)), (std::vector<int64_t>{1, 2}));
}

TEST(PlanHistoryTest, AgreedVersionIsTheOldestOfTheDomainsAndTheActive) {
  EXPECT_EQ(AgreedPlanVersion(5, {}), 5);
  EXPECT_EQ(AgreedPlanVersion(5, {{"a", 5}, {"b", 4}}), 4);
  EXPECT_EQ(AgreedPlanVersion(5, {{"a", 7}}), 5);
  EXPECT_EQ(AgreedPlanVersion(5, {{"a", 0}}), 0);  // round-robin fallback
}

}  // namespace
}  // namespace muond
