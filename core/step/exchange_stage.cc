#include "core/step/exchange_stage.h"

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

MatrixView PieceOf(const MatrixView& m, const Piece& pc) {
  return m.Block(pc.block.row0, pc.block.col0, pc.block.rows, pc.block.cols);
}

MatrixView PieceIn(char* buffer, DType dtype, const Piece& pc) {
  return ContiguousView(buffer + pc.offset * int64_t(DTypeSize(dtype)), dtype,
                        pc.block.rows, pc.block.cols);
}

}  // namespace

absl::Status ExchangeStage(Backend& backend, Communicator* comm,
                           const StageExchange& stage,
                           const AllToAllvPlan& route, DType dtype,
                           ExchangeBuffers& exchange,
                           absl::Span<const MatrixView> from,
                           absl::Span<const MatrixView> to,
                           const std::string& group) {
  if (!stage.active) return absl::OkStatus();
  for (const auto& pieces : route.send) {
    for (const Piece& pc : pieces) {
      RETURN_IF_ERROR(backend.Copy2D(PieceIn(exchange.send(), dtype, pc),
                                     PieceOf(from[pc.param], pc)));
    }
  }
  if (comm == nullptr) {
    return absl::InternalError(
        absl::StrCat("group '", group, "': exchange needs a communicator"));
  }
  RETURN_IF_ERROR(comm->AllToAllV(exchange.send(), route.send_counts,
                                  exchange.recv(), route.recv_counts, dtype));
  for (const auto& pieces : route.recv) {
    for (const Piece& pc : pieces) {
      RETURN_IF_ERROR(backend.Copy2D(PieceOf(to[pc.param], pc),
                                     PieceIn(exchange.recv(), dtype, pc)));
    }
  }
  return comm->Wait();
}

}  // namespace muond
