#pragma once
// A step's per-group hyperparameter overrides (StepInputs::overrides), in a
// header of its own so the wire conversion (server/common/proto_convert)
// needs no engine.
#include <map>
#include <string>

namespace muond {

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

}  // namespace muond
