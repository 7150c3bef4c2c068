#pragma once
// Lanes: the sets of groups that must run one after the other, and the
// threads that run lanes concurrently.
//
// Groups that share a communicator, or a device backend (one stream orders
// its work, and NCCL orders the collectives of one communicator), must run
// one after the other: each such set is a lane. Lanes run concurrently, each
// on a thread of its own (created once, with the engine) and with its own
// exchange buffers.
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/backend/backend.h"
#include "core/step/buffers.h"
#include "core/step/group_state.h"

namespace muond {

struct Lane {
  Backend* backend = nullptr;
  // Indices into the engine's groups, in registration order.
  std::vector<int> groups;
  ExchangeBuffers exchange;
  // Scratch of the per-step domain agreement (GatherDomainVotes).
  OwnedBuffer vote_scratch;
};

// Partitions `groups` into lanes (the union of groups that share a
// communicator or a device backend), in order of each lane's first group,
// and sets each group's `lane`. Allocates no buffers.
std::vector<Lane> AssignLanes(std::vector<GroupState>& groups);

// A fixed set of threads, one per lane, started at construction and joined
// at destruction, so a step starts no thread.
class LaneThreads {
 public:
  explicit LaneThreads(int lanes);
  ~LaneThreads();
  LaneThreads(const LaneThreads&) = delete;
  LaneThreads& operator=(const LaneThreads&) = delete;

  // Runs work(l) on thread l for every lane l and returns once all have
  // returned. One Run at a time.
  void Run(const std::function<void(int lane)>& work);

 private:
  void Loop(int lane);

  absl::Mutex mu_;
  absl::CondVar changed_;
  const std::function<void(int)>* work_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Bumped by each Run; a thread runs once per generation.
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace muond
