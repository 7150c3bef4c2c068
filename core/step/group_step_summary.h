#pragma once
// What a step does to a group on this rank, in the words its domain's ranks
// compare (domain_agreement.h): the skipped params and the hyperparameters.
#include <string>
#include <vector>

#include "core/step/group_state.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {

// What a step does to a group on this rank, as its domain's ranks must agree
// on it (domain_agreement.h): the group's params this rank skips, sorted,
// and the group as registered ("registered=", GroupState::registered) and
// its hyperparameters for the step (its step_muon or step_adamw, which
// RunStep resolves first), each "<field>=<value>" (%.17g: every double
// exactly).
struct GroupStepSummary {
  std::vector<std::string> skips;
  std::vector<std::string> hyper;
};

GroupStepSummary SummarizeGroupStep(const GroupState& group,
                                    const StepInputs& inputs);

// Each name quoted and echo-safe, for an error message.
std::vector<std::string> EchoAll(const std::vector<std::string>& names);

}  // namespace muond
