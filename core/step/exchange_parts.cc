#include "core/step/exchange_parts.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

MatrixView PieceOf(const MatrixView& m, const Piece& pc) {
  return m.Block(pc.block.row0, pc.block.col0, pc.block.rows, pc.block.cols);
}

MatrixView ElementsAt(char* buffer, DType dtype, int64_t offset,
                      const Block& block) {
  return ContiguousView(buffer + offset * int64_t(DTypeSize(dtype)), dtype,
                        block.rows, block.cols);
}

// One direction of the batched all_to_allv: per peer, each part's elements
// for that peer back to back in part order.
struct BatchLayout {
  std::vector<int64_t> counts;  // [peer]: the sum over the parts
  // [part][peer]: where the part's elements for the peer start, in elements.
  std::vector<std::vector<int64_t>> starts;
};

template <typename CountsOf>
BatchLayout LayOut(absl::Span<const ExchangePart> parts, int peers,
                   CountsOf counts_of) {
  BatchLayout layout;
  layout.counts.assign(peers, 0);
  layout.starts.assign(parts.size(), std::vector<int64_t>(peers, 0));
  int64_t offset = 0;
  for (int p = 0; p < peers; ++p) {
    const int64_t peer_start = offset;
    for (size_t k = 0; k < parts.size(); ++k) {
      layout.starts[k][p] = offset;
      offset += counts_of(*parts[k].route)[p];
    }
    layout.counts[p] = offset - peer_start;
  }
  return layout;
}

// Where a piece of part `k` for peer `p` lies in the batched buffer: its
// offset within the part's own layout (displs[p] first) moved to the part's
// start for that peer.
int64_t BatchedOffset(const BatchLayout& layout, size_t k, int p,
                      const std::vector<int64_t>& displs, const Piece& pc) {
  return layout.starts[k][p] + (pc.offset - displs[p]);
}

}  // namespace

int64_t SendBytesOf(absl::Span<const ExchangePart> parts, DType dtype) {
  int64_t elements = 0;
  for (const ExchangePart& part : parts) elements += part.route->total_send;
  return elements * int64_t(DTypeSize(dtype));
}

int64_t RecvBytesOf(absl::Span<const ExchangePart> parts, DType dtype) {
  int64_t elements = 0;
  for (const ExchangePart& part : parts) elements += part.route->total_recv;
  return elements * int64_t(DTypeSize(dtype));
}

absl::Status ExchangeParts(Backend& backend, Communicator* comm,
                           absl::Span<const ExchangePart> parts, DType dtype,
                           ExchangeBuffers& exchange) {
  if (parts.empty()) return absl::OkStatus();
  if (comm == nullptr) {
    return absl::InternalError(absl::StrCat(
        "groups '",
        absl::StrJoin(parts, "', '",
                      [](std::string* out, const ExchangePart& part) {
                        out->append(*part.group);
                      }),
        "': the exchange needs a communicator"));
  }
  const int peers = static_cast<int>(parts.front().route->send_counts.size());
  const BatchLayout send = LayOut(
      parts, peers, [](const AllToAllvPlan& r) -> const std::vector<int64_t>& {
        return r.send_counts;
      });
  const BatchLayout recv = LayOut(
      parts, peers, [](const AllToAllvPlan& r) -> const std::vector<int64_t>& {
        return r.recv_counts;
      });
  absl::Status local;
  // The group of the part whose pack or unpack failed.
  auto named = [&](size_t k, absl::Status status) {
    return WithContext(
        status, absl::StrCat("group '", *parts[k].group, "': exchange: "));
  };
  for (size_t k = 0; k < parts.size() && local.ok(); ++k) {
    const AllToAllvPlan& route = *parts[k].route;
    for (int p = 0; p < peers && local.ok(); ++p) {
      for (const Piece& pc : route.send[p]) {
        local = backend.Copy2D(
            ElementsAt(exchange.send(), dtype,
                       BatchedOffset(send, k, p, route.send_displs, pc),
                       pc.block),
            PieceOf(parts[k].from[pc.param], pc));
        if (!local.ok()) {
          local = named(k, local);
          break;
        }
      }
    }
  }
  RETURN_IF_ERROR(comm->AllToAllV(exchange.send(), send.counts, exchange.recv(),
                                  recv.counts, dtype));
  for (size_t k = 0; k < parts.size() && local.ok(); ++k) {
    const AllToAllvPlan& route = *parts[k].route;
    for (int p = 0; p < peers && local.ok(); ++p) {
      for (const Piece& pc : route.recv[p]) {
        local = backend.Copy2D(
            PieceOf(parts[k].to[pc.param], pc),
            ElementsAt(exchange.recv(), dtype,
                       BatchedOffset(recv, k, p, route.recv_displs, pc),
                       pc.block));
        if (!local.ok()) {
          local = named(k, local);
          break;
        }
      }
    }
  }
  RETURN_IF_ERROR(comm->Wait());
  return local;
}

}  // namespace muond
