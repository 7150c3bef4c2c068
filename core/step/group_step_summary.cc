#include "core/step/group_step_summary.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/echo.h"

namespace muond {

GroupStepSummary SummarizeGroupStep(const GroupState& group,
                                    const StepInputs& inputs) {
  GroupStepSummary out;
  for (const ParamBinding& p : group.config.params) {
    if (inputs.skip_params.contains(p.name)) out.skips.push_back(p.name);
  }
  std::sort(out.skips.begin(), out.skips.end());
  auto add = [&](const char* field, double v) {
    // -0.0 and 0.0 are the same hyperparameter: "+ 0.0" turns -0.0 into 0.0
    // so ranks that differ only there agree.
    out.hyper.push_back(absl::StrFormat("%s=%.17g", field, v + 0.0));
  };
  out.hyper.push_back(absl::StrCat("registered=", group.registered));
  if (group.config.algorithm == Algorithm::kMuon) {
    const MuonOptions& o = group.step_muon;
    add("lr", o.lr);
    add("weight_decay", o.weight_decay);
    add("momentum", o.momentum);
    out.hyper.push_back(o.nesterov ? "nesterov=true" : "nesterov=false");
    // Fixed at registration, but a rank registered with another variant
    // would renormalise differently: refused alike, naming the field.
    out.hyper.push_back(
        absl::StrCat("variant=", std::string(MuonVariantName(o.variant))));
    add("beta2", o.beta2);
    add("moment2_eps", o.moment2_eps);
  } else {
    const AdamWOptions& o = group.step_adamw;
    add("lr", o.lr);
    add("weight_decay", o.weight_decay);
    add("beta1", o.beta1);
    add("beta2", o.beta2);
    add("eps", o.eps);
  }
  return out;
}

std::vector<std::string> EchoAll(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& n : names)
    out.push_back(absl::StrCat("'", Echo(n), "'"));
  return out;
}

}  // namespace muond
