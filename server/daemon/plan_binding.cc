#include "server/daemon/plan_binding.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"
#include "server/common/proto_convert.h"

namespace muond {

bool PlanCoversRegistration(const v1::Plan& plan,
                            const Registration& registration) {
  std::map<std::string, int> plan_homes;
  for (const v1::GroupPlan& g : plan.groups())
    plan_homes[g.group()] = g.homes_size();
  for (const BoundGroup& g : registration.groups) {
    auto it = plan_homes.find(g.proto.name());
    if (it == plan_homes.end()) return false;
    const bool muon = g.proto.algorithm() != v1::ALGORITHM_ADAMW;
    if (muon && it->second != int(g.params.size())) return false;
  }
  return true;
}

absl::Status SetEngineHomes(const v1::Plan& plan,
                            const Registration& registration,
                            LayerShardedMuon& muon) {
  for (const v1::GroupPlan& gp : plan.groups()) {
    const BoundGroup* group = nullptr;
    for (const BoundGroup& g : registration.groups) {
      if (g.proto.name() == gp.group()) group = &g;
    }
    if (group == nullptr || group->proto.algorithm() == v1::ALGORITHM_ADAMW) {
      continue;
    }
    const absl::Status st =
        muon.SetHomes(gp.group(), FromProto(gp.homes()), plan.version());
    if (!st.ok()) {
      return WithContext(st,
                         absl::StrCat("plan version ", plan.version(), ": "));
    }
  }
  return absl::OkStatus();
}

HeldGroups HeldGroupsOf(const Registration& registration) {
  HeldGroups held;
  for (const BoundGroup& g : registration.groups) {
    held.emplace_back(g.proto.name(), g.proto.domain());
  }
  return held;
}

}  // namespace muond
