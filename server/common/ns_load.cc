#include "server/common/ns_load.h"

#include <map>

#include "server/common/proto_convert.h"

namespace muond {

double NsLoadShare(const v1::Plan& plan, const HeldGroups& held) {
  double total = 0;
  std::map<std::string, const v1::GroupPlan*> by_name;
  for (const v1::GroupPlan& g : plan.groups()) {
    by_name[g.group()] = &g;
    for (double load : g.rank_load()) total += load;
  }
  if (!(total > 0)) return 0;
  double mine = 0;
  for (const auto& [group, domain] : held) {
    auto it = by_name.find(group);
    if (it == by_name.end()) continue;
    const int flat =
        DomainSizeOf(domain).FlatRank(domain.d(), domain.g(), domain.t());
    if (flat >= 0 && flat < it->second->rank_load_size()) {
      mine += it->second->rank_load(flat);
    }
  }
  return mine / total;
}

}  // namespace muond
