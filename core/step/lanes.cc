#include "core/step/lanes.h"

#include <functional>
#include <map>

#include "absl/strings/str_cat.h"

namespace muond {

std::vector<Lane> AssignLanes(std::vector<GroupState>& groups) {
  // Union-find over groups, joining each group to the first one that holds
  // the same communicator or device backend: linear in the groups (a daemon
  // may hold thousands).
  std::vector<int> parent(groups.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = int(i);
  std::function<int(int)> find = [&](int i) {
    return parent[i] == i ? i : parent[i] = find(parent[i]);
  };
  std::map<const void*, int> first_holder;
  auto join = [&](const void* shared, int i) {
    auto [it, fresh] = first_holder.emplace(shared, i);
    if (!fresh) parent[find(i)] = find(it->second);
  };
  for (size_t i = 0; i < groups.size(); ++i) {
    const DomainBinding& d = groups[i].config.domain;
    for (Communicator* c : {d.gtp, d.tp, d.dp}) {
      if (c != nullptr) join(c, int(i));
    }
    if (groups[i].backend->is_device()) join(groups[i].backend, int(i));
  }
  std::vector<Lane> lanes;
  std::map<int, int> lane_of_root;
  for (size_t i = 0; i < groups.size(); ++i) {
    auto [it, fresh] = lane_of_root.emplace(find(int(i)), int(lanes.size()));
    if (fresh) {
      lanes.emplace_back();
      lanes.back().backend = groups[i].backend;
    }
    groups[i].lane = it->second;
    lanes[it->second].groups.push_back(int(i));
  }
  return lanes;
}

absl::Status CheckOneBackendPerCommunicator(
    const std::vector<GroupState>& groups) {
  std::map<const Communicator*, const GroupState*> first_on;
  for (const GroupState& group : groups) {
    const DomainBinding& d = group.config.domain;
    for (const Communicator* c : {d.gtp, d.tp, d.dp}) {
      if (c == nullptr) continue;
      const GroupState* first = first_on.emplace(c, &group).first->second;
      if (first->backend == group.backend) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "groups '", first->config.name, "' and '", group.config.name,
          "' share the communicator '", c->name(),
          "' but not a backend: groups that exchange over one communicator "
          "must compute on one backend (their exchanges run as one collective "
          "per stage); give them the same GroupConfig::backend"));
    }
  }
  return absl::OkStatus();
}

}  // namespace muond
