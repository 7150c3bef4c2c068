#pragma once
// One all_to_allv of the exchange: pack, exchange, unpack, for one or more
// groups' routes over one communicator (lane_exchanges.h batches them).
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/comm/communicator.h"
#include "core/common/matrix_view.h"
#include "core/plan/exchange_plan.h"
#include "core/step/buffers.h"

namespace muond {

// A group's share of one all_to_allv: the blocks its `route` names, packed
// out of `from` and unpacked into `to` (one view per param, indexed by
// Piece::param); `group` names it in errors.
struct ExchangePart {
  const std::string* group = nullptr;
  const AllToAllvPlan* route = nullptr;
  absl::Span<const MatrixView> from;
  absl::Span<const MatrixView> to;
};

// The send (or receive) bytes `parts` need in `dtype`: the sum of their
// routes' totals.
int64_t SendBytesOf(absl::Span<const ExchangePart> parts, DType dtype);
int64_t RecvBytesOf(absl::Span<const ExchangePart> parts, DType dtype);

// Packs the parts' blocks into the send buffer, peer by peer and within a
// peer part by part (so every rank of `comm` must pass the parts of the same
// groups in the same order), exchanges them over `comm` as one all_to_allv
// of `dtype`, and unpacks what arrived in the same layout, on `backend`.
// `exchange` must hold SendBytesOf and RecvBytesOf (ExchangeBuffers::
// Reserve). A failed pack or unpack does not skip the collective, which the
// peers wait for; it is returned after, naming its part's group. A missing
// communicator is an Internal error naming every part's group; communicator
// errors are returned as they come.
absl::Status ExchangeParts(Backend& backend, Communicator* comm,
                           absl::Span<const ExchangePart> parts, DType dtype,
                           ExchangeBuffers& exchange);

}  // namespace muond
