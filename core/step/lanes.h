#pragma once
// Lanes: the sets of groups that must run one after the other (their
// threads: lane_threads.h).
//
// Groups that share a communicator, or a device backend (one stream orders
// its work, and NCCL orders the collectives of one communicator), must run
// one after the other: each such set is a lane. Lanes run concurrently on
// the engine's worker pool (lane_threads.h, created once with the engine),
// each on one worker at a time and with its own exchange buffers.
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "core/backend/backend.h"
#include "core/step/buffers.h"
#include "core/step/group_state.h"
#include "core/step/lane_threads.h"
#include "core/step/phase_clock.h"

namespace muond {

struct Lane {
  Backend* backend = nullptr;
  // Indices into the engine's groups, in registration order.
  std::vector<int> groups;
  ExchangeBuffers exchange;
  // `exchange` holds the batches of the groups' current plans
  // (ReserveLaneExchanges); a group's new plan clears it.
  bool exchanges_reserved = false;
  // The L_i of its Muon groups (GroupState::local): one slab per NS runner
  // and shape, in group then param order, so that same-shape L_i of
  // neighbouring groups lie back to back and NS batched across them
  // (lane_ns.h) runs on them in place, with no staging copy (a batch of
  // groups that are not neighbours is staged).
  std::vector<OwnedBuffer> local_slabs;
  // Scratch of the per-step domain agreement (GatherDomainVotesOfGroups).
  OwnedBuffer vote_scratch;
  // Its groups' host momentum streams and slots (MakeHostStateStreams);
  // null when none keeps momentum on the host.
  std::unique_ptr<HostStateStreams> host_streams;
  // The step's phase times on this lane; the commit ends by waiting for its
  // work (PhaseClock::Finish).
  PhaseClock clock;
};

// Partitions `groups` into lanes (the union of groups that share a
// communicator or a device backend), in order of each lane's first group,
// and sets each group's `lane`. Allocates no buffers.
std::vector<Lane> AssignLanes(std::vector<GroupState>& groups);

// InvalidArgument naming two groups that exchange over one communicator
// (gtp, tp or dp) but compute on different backends: a lane's exchanges over
// a communicator run as one collective packed on one backend's queue
// (lane_exchanges.h), and every rank must batch them alike.
absl::Status CheckOneBackendPerCommunicator(
    const std::vector<GroupState>& groups);

}  // namespace muond
