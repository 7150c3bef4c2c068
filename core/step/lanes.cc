#include "core/step/lanes.h"

#include <functional>
#include <map>

namespace muond {
namespace {

bool MustShareLane(const GroupState& a, const GroupState& b) {
  const DomainBinding &x = a.config.domain, &y = b.config.domain;
  for (Communicator* c : {x.gtp, x.tp, x.dp}) {
    if (c != nullptr && (c == y.gtp || c == y.tp || c == y.dp)) return true;
  }
  return a.backend == b.backend && a.backend->is_device();
}

}  // namespace

std::vector<Lane> AssignLanes(std::vector<GroupState>& groups) {
  // Union-find over groups.
  std::vector<int> parent(groups.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = int(i);
  std::function<int(int)> find = [&](int i) {
    return parent[i] == i ? i : parent[i] = find(parent[i]);
  };
  for (size_t i = 0; i < groups.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (MustShareLane(groups[i], groups[j])) {
        parent[find(int(i))] = find(int(j));
      }
    }
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

}  // namespace muond
