#pragma once
// The exchanges of a lane's groups, batched across the groups.
//
// Each exchange step (stage 1 or a stage 2 of the a2a_fwd, the same in
// reverse, dp_share) of every group of a lane that exchanges over the same
// communicator, on the same backend and in the same NS dtype runs as one
// all_to_allv (ExchangeParts), instead of one per group: with a group per
// layer that is one collective per stage for the lane, not one per layer,
// and on NCCL one wait instead of one per layer.
//
// Every rank of a communicator must issue the same collectives in the same
// order, so the batches depend on nothing that differs between ranks: the
// groups in the lane's (registration) order, each batch cut where the
// groups' size bound (the elements of all their params, whole, in the NS
// dtype: at least what any rank sends or receives for them) would pass
// `batch_bytes`. A group above it exchanges alone, as before batching; with
// `batch_bytes` 0 every group does.
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/step/buffers.h"
#include "core/step/exchange_parts.h"
#include "core/step/group_state.h"
#include "core/step/phase_clock.h"

namespace muond {

// The exchange steps of a step, in the order they run.
enum class LaneExchangeStep {
  kStage1Forward,  // L_i -> A1_i over gtp
  kStage2Forward,  // A1_i -> A2_i over tp, one exchange per tp_dim (0, 1)
  kStage2Reverse,  // A2_i -> A1_i over tp (tp_dim 1, then 0)
  kStage1Reverse,  // A1_i -> L_i over gtp, then the pad rows of L_i zeroed
  kDpShare,        // L_i of the params homed here -> the other replicas
};

// One all_to_allv of a step: the parts of `groups`, in that order.
struct ExchangeBatch {
  Communicator* comm = nullptr;
  Backend* backend = nullptr;
  DType dtype = DType::kFloat32;
  std::vector<GroupState*> groups;
  std::vector<ExchangePart> parts;
};

// The batches of `step` over `groups` (one lane's, in its order; each with
// its plan set), tp_dim by tp_dim for stage 2, in the order they run. Groups
// whose stage is inactive (no member moves data) take no part.
std::vector<ExchangeBatch> ExchangeBatchesOf(
    absl::Span<GroupState* const> groups, LaneExchangeStep step,
    int64_t batch_bytes);

// The largest send and receive bytes of any batch of any step over
// `groups`: what the lane's ExchangeBuffers must hold.
struct ExchangeBytes {
  int64_t send = 0;
  int64_t recv = 0;
};
ExchangeBytes LaneExchangeBytes(absl::Span<GroupState* const> groups,
                                int64_t batch_bytes);

// Runs every batch of `step` over `groups`, each timed on `clock` into
// `field`; kStage1Reverse also zeroes the pad rows of L_i. After a batch's
// communicator fails, runs no more (the next would only wait out one more
// timeout); after a local failure (a pack or unpack), runs on: the peers
// wait for the batches after it. Returns the communicator's failure if any
// (it decides the step: a timeout abandons it), else the first local one,
// naming the group whose pack or unpack failed.
absl::Status RunLaneExchanges(absl::Span<GroupState* const> groups,
                              LaneExchangeStep step, int64_t batch_bytes,
                              ExchangeBuffers& exchange, PhaseClock& clock,
                              PhaseClock::Field field);

}  // namespace muond
