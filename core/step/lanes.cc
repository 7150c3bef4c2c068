#include "core/step/lanes.h"

#include <map>

namespace muond {
namespace {

bool MustShareLane(const GroupState& a, const GroupState& b) {
  const DomainBinding &x = a.config.domain, &y = b.config.domain;
  for (Communicator* c : {x.gtp, x.tp}) {
    if (c != nullptr && (c == y.gtp || c == y.tp)) return true;
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

LaneThreads::LaneThreads(int lanes) {
  for (int l = 0; l < lanes; ++l) threads_.emplace_back([this, l] { Loop(l); });
}

LaneThreads::~LaneThreads() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.SignalAll();
  }
  for (std::thread& t : threads_) t.join();
}

void LaneThreads::Run(const std::function<void(int)>& work) {
  absl::MutexLock lock(&mu_);
  work_ = &work;
  running_ = int(threads_.size());
  ++generation_;
  changed_.SignalAll();
  while (running_ > 0) changed_.Wait(&mu_);
  work_ = nullptr;
}

void LaneThreads::Loop(int lane) {
  int64_t done = 0;  // the generation this thread ran last
  while (true) {
    const std::function<void(int)>* work;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && generation_ == done) changed_.Wait(&mu_);
      if (stop_) return;
      done = generation_;
      work = work_;
    }
    (*work)(lane);
    absl::MutexLock lock(&mu_);
    if (--running_ == 0) changed_.SignalAll();
  }
}

}  // namespace muond
