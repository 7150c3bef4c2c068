#include "core/plan/replica_exchange.h"

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

// Offsets of the pieces, then each peer's count and displacement.
int64_t Layout(std::vector<std::vector<Piece>>& per_peer,
               std::vector<int64_t>& counts, std::vector<int64_t>& displs) {
  counts.assign(per_peer.size(), 0);
  displs.assign(per_peer.size(), 0);
  int64_t offset = 0;
  for (size_t peer = 0; peer < per_peer.size(); ++peer) {
    displs[peer] = offset;
    for (Piece& piece : per_peer[peer]) {
      piece.offset = offset;
      offset += piece.block.numel();
    }
    counts[peer] = offset - displs[peer];
  }
  return offset;
}

absl::Status CheckHomes(const std::vector<ParamShardSpec>& specs,
                        const std::vector<NsHome>& homes, int dp) {
  if (homes.size() != specs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(homes.size(), " NS homes for ", specs.size(), " params"));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (homes[i].d < 0 || homes[i].d >= dp) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param '", specs[i].name, "': NS home replica d=", homes[i].d,
          " is outside dp_size ", dp));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StageExchange> BuildReplicaExchangePlan(
    const std::vector<ParamShardSpec>& specs, const std::vector<NsHome>& homes,
    DomainSize domain, int my_d, int my_g, int my_t) {
  RETURN_IF_ERROR(
      CheckDomainCoordinates(domain, my_d, my_g, my_t, "this rank"));
  RETURN_IF_ERROR(CheckHomes(specs, homes, domain.dp));
  const int D = domain.dp;
  StageExchange ex;
  for (int d = 0; d < D; ++d) {
    ex.group_ranks.push_back(domain.FlatRank(d, my_g, my_t));
  }
  ex.my_peer = my_d;
  std::vector<std::vector<Piece>> send(D), recv(D);
  for (size_t i = 0; i < specs.size(); ++i) {
    const Block whole{0, 0, specs[i].local_shape[0], specs[i].local_shape[1]};
    if (whole.numel() == 0) continue;
    const int home = homes[i].d;
    for (int peer = 0; peer < D; ++peer) {
      if (peer == my_d) continue;
      if (home == my_d) send[peer].push_back(Piece{int(i), whole, 0});
      if (home == peer) recv[peer].push_back(Piece{int(i), whole, 0});
    }
  }
  AllToAllvPlan& plan = ex.forward;
  plan.total_send = Layout(send, plan.send_counts, plan.send_displs);
  plan.total_recv = Layout(recv, plan.recv_counts, plan.recv_displs);
  plan.send = std::move(send);
  plan.recv = std::move(recv);
  // A non-empty shard homed anywhere is sent by its home and received by
  // every other member: the same answer on every member.
  ex.active = plan.total_send + plan.total_recv > 0;
  return ex;
}

}  // namespace muond
