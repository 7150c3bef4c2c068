// The checks of a step's overrides and skipped params, and the options a
// group steps with once its overrides apply (core/step/step_overrides.h):
// pure functions, against hand-written expectations.
#include "core/step/step_overrides.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"

namespace muond {
namespace {

TEST(Overrides, BoundsAndAlgorithmErrorsNameGroupAndField) {
  const std::map<std::string, Algorithm> groups = {{"dense", Algorithm::kMuon},
                                                   {"adam", Algorithm::kAdamW}};
  struct Case {
    std::function<void(StepOverrides&)> set;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](StepOverrides& o) { o.momentum["dense"] = 1.0; },
       "group 'dense' momentum must be in [0, 1)"},
      {[](StepOverrides& o) { o.momentum["dense"] = -0.1; },
       "group 'dense' momentum must be in [0, 1)"},
      {[](StepOverrides& o) { o.beta1["adam"] = 1.5; },
       "group 'adam' beta1 must be in [0, 1)"},
      {[](StepOverrides& o) { o.beta2["adam"] = std::nan(""); },
       "group 'adam' beta2 must be in [0, 1)"},
      {[](StepOverrides& o) { o.eps["adam"] = 1e-300; },
       "group 'adam' eps must be > 0"},
      {[](StepOverrides& o) { o.eps["adam"] = 0; },
       "group 'adam' eps must be > 0"},
      {[](StepOverrides& o) { o.beta1["dense"] = 0.9; },
       "group 'dense' beta1 is an AdamW hyperparameter"},
      {[](StepOverrides& o) { o.momentum["adam"] = 0.9; },
       "group 'adam' momentum is a Muon hyperparameter"},
      {[](StepOverrides& o) { o.nesterov["adam"] = true; },
       "group 'adam' nesterov is a Muon hyperparameter"},
      {[](StepOverrides& o) { o.eps["ghost"] = 1e-8; },
       "unknown group 'ghost'"},
  };
  for (const Case& c : cases) {
    StepOverrides o;
    c.set(o);
    const absl::Status st = CheckStepOverrides(o, groups);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_TRUE(absl::StrContains(st.message(), c.expect)) << st;
  }
  StepOverrides fine;
  fine.momentum["dense"] = 0.0;
  fine.nesterov["dense"] = false;
  fine.beta1["adam"] = 0.0;
  fine.beta2["adam"] = 0.999999;
  fine.eps["adam"] = 1e-30;
  EXPECT_TRUE(CheckStepOverrides(fine, groups).ok());
}

TEST(Overrides, LrAndWeightDecayBoundsAreTheRegistrationBounds) {
  const std::map<std::string, Algorithm> groups = {{"dense", Algorithm::kMuon}};
  StepOverrides at_bound;
  at_bound.lr["dense"] = kMaxLr;
  at_bound.weight_decay["dense"] = kMaxWeightDecay;
  EXPECT_TRUE(CheckStepOverrides(at_bound, groups).ok());
  for (double lr : {-1.0, kMaxLr * 2, double(NAN), double(INFINITY)}) {
    StepOverrides o;
    o.lr["dense"] = lr;
    const absl::Status st = CheckStepOverrides(o, groups);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << lr;
    EXPECT_TRUE(absl::StrContains(st.message(), "group 'dense' lr ")) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "must be finite, >= 0 and <= "))
        << st;
  }
  StepOverrides decay;
  decay.weight_decay["dense"] = kMaxWeightDecay * 2;
  EXPECT_TRUE(absl::StrContains(CheckStepOverrides(decay, groups).message(),
                                "group 'dense' weight_decay "));
}

TEST(SkipParams, EveryNameMustBeHeld) {
  const std::set<std::string> held = {"w0", "w1"};
  auto holds = [&](const std::string& name) { return held.contains(name); };
  EXPECT_TRUE(CheckSkipParams({}, holds).ok());
  EXPECT_TRUE(CheckSkipParams({"w1"}, holds).ok());
  const absl::Status st = CheckSkipParams({"w0", "ghost"}, holds);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_TRUE(absl::StrContains(
      st.message(), "skip_params: 'ghost' names no param this daemon holds"))
      << st;
}

TEST(OptionsForStep, OverridesReplaceOnlyTheirGroupsFields) {
  StepOverrides o;
  o.lr["dense"] = 0.5;
  o.momentum["dense"] = 0.8;
  o.nesterov["dense"] = true;
  o.weight_decay["adam"] = 0.25;
  o.beta1["adam"] = 0.7;
  o.beta2["adam"] = 0.9;
  o.eps["adam"] = 1e-6;
  MuonOptions muon;
  muon.lr = 0.1;
  muon.momentum = 0.95;
  muon.nesterov = false;
  muon.weight_decay = 0.01;
  const MuonOptions dense = MuonOptionsForStep(muon, "dense", o);
  EXPECT_EQ(dense.lr, 0.5);
  EXPECT_EQ(dense.momentum, 0.8);
  EXPECT_TRUE(dense.nesterov);
  EXPECT_EQ(dense.weight_decay, 0.01);
  const MuonOptions other = MuonOptionsForStep(muon, "other", o);
  EXPECT_EQ(other.lr, 0.1);
  EXPECT_EQ(other.momentum, 0.95);
  EXPECT_FALSE(other.nesterov);

  AdamWOptions adamw;
  adamw.lr = 0.1;
  adamw.weight_decay = 0.01;
  adamw.beta1 = 0.9;
  adamw.beta2 = 0.999;
  adamw.eps = 1e-8;
  const AdamWOptions adam = AdamWOptionsForStep(adamw, "adam", o);
  EXPECT_EQ(adam.lr, 0.1);
  EXPECT_EQ(adam.weight_decay, 0.25);
  EXPECT_EQ(adam.beta1, 0.7);
  EXPECT_EQ(adam.beta2, 0.9);
  EXPECT_EQ(adam.eps, 1e-6);
  const AdamWOptions dense_adam = AdamWOptionsForStep(adamw, "dense", o);
  EXPECT_EQ(dense_adam.lr, 0.5);  // lr applies to either algorithm
  EXPECT_EQ(dense_adam.beta1, 0.9);
}

}  // namespace
}  // namespace muond
