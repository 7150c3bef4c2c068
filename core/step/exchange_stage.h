#pragma once
// One all_to_allv of a stage of the exchange: pack, exchange, unpack.
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/comm/communicator.h"
#include "core/common/matrix_view.h"
#include "core/plan/exchange_plan.h"
#include "core/step/buffers.h"

namespace muond {

// Packs the blocks `route.send` names out of `from` (one view per param,
// indexed by Piece::param) into the send buffer, exchanges over `comm`, and
// unpacks the received blocks into `to`, all in `dtype` on `backend`. Does
// nothing when `stage` is inactive on this rank. `exchange` must hold the
// route's bytes (ExchangeBuffers::Reserve). A missing communicator is an
// Internal error naming `group`; communicator errors are returned as they
// come.
absl::Status ExchangeStage(Backend& backend, Communicator* comm,
                           const StageExchange& stage,
                           const AllToAllvPlan& route, DType dtype,
                           ExchangeBuffers& exchange,
                           absl::Span<const MatrixView> from,
                           absl::Span<const MatrixView> to,
                           const std::string& group);

}  // namespace muond
