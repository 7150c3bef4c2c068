#pragma once
// A step's per-group hyperparameter overrides (StepInputs::overrides) and
// their checks, in a header of its own so the wire conversion
// (server/common/proto_convert) and the daemon's request checks need no
// engine.
#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "core/muon/adamw.h"
#include "core/muon/bounds.h"
#include "core/muon/muon_update.h"

namespace muond {

// The optimizer of a param group (GroupConfig::algorithm).
enum class Algorithm { kMuon, kAdamW };

// Per-step overrides by group name (a trainer's live param_groups: LR
// schedules, momentum warm-up, OneCycleLR's cycled betas); a group absent
// from a map keeps its registered value. Muon groups take lr, weight_decay,
// momentum and nesterov; AdamW groups lr, weight_decay, beta1, beta2 and eps.
// Bounds (CheckStepOverrides, the one home of the rule, with the constants
// of core/muon/bounds.h): lr and weight_decay finite, >= 0, <= kMaxLr /
// kMaxWeightDecay (beyond them a step turns params into inf while answering
// OK); momentum, beta1, beta2 in [0, 1); eps > 0 and finite as fp32. Every
// rank of a group's domain must step with the same values (the domain
// agreement refuses the step otherwise).
struct StepOverrides {
  std::map<std::string, double> lr;
  std::map<std::string, double> weight_decay;
  std::map<std::string, double> momentum;  // Muon
  std::map<std::string, bool> nesterov;    // Muon
  std::map<std::string, double> beta1;     // AdamW
  std::map<std::string, double> beta2;     // AdamW
  std::map<std::string, double> eps;       // AdamW
};

// The same bounds as registration's hyperparameters (core/muon/bounds.h).
inline constexpr double kMaxOverrideLr = kMaxLr;
inline constexpr double kMaxOverrideWeightDecay = kMaxWeightDecay;

// InvalidArgument naming the group, the field and the bound when an override
// names no group of `groups` (name -> algorithm), sets a field of the other
// algorithm, or is out of range.
absl::Status CheckStepOverrides(const StepOverrides& overrides,
                                const std::map<std::string, Algorithm>& groups);

// InvalidArgument naming the first name of `skip` (StepInputs::skip_params)
// for which `held` is false: a skipped param must be one this rank holds.
absl::Status CheckSkipParams(
    const std::set<std::string>& skip,
    const std::function<bool(const std::string&)>& held);

// The group's registered options with this step's overrides applied.
MuonOptions MuonOptionsForStep(MuonOptions registered, const std::string& group,
                               const StepOverrides& overrides);
AdamWOptions AdamWOptionsForStep(AdamWOptions registered,
                                 const std::string& group,
                                 const StepOverrides& overrides);

}  // namespace muond
