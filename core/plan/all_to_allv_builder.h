#pragma once
// Collects the pieces of one all_to_allv per peer, then lays them out: counts,
// displacements and absolute offsets (the exchange plans of
// exchange_plan.cc and replica_exchange.cc).
#include <cstdint>
#include <utility>
#include <vector>

#include "core/plan/exchange_plan.h"

namespace muond {

class AllToAllvBuilder {
 public:
  explicit AllToAllvBuilder(int peers) : send_(peers), recv_(peers) {}
  void Send(int peer, int param, Block block) {
    if (block.numel() > 0) send_[peer].push_back(Piece{param, block, 0});
  }
  void Recv(int peer, int param, Block block) {
    if (block.numel() > 0) recv_[peer].push_back(Piece{param, block, 0});
  }
  AllToAllvPlan Finish() && {
    AllToAllvPlan plan;
    plan.total_send = Layout(send_, plan.send_counts, plan.send_displs);
    plan.total_recv = Layout(recv_, plan.recv_counts, plan.recv_displs);
    plan.send = std::move(send_);
    plan.recv = std::move(recv_);
    return plan;
  }

 private:
  static int64_t Layout(std::vector<std::vector<Piece>>& per_peer,
                        std::vector<int64_t>& counts,
                        std::vector<int64_t>& displs) {
    counts.assign(per_peer.size(), 0);
    displs.assign(per_peer.size(), 0);
    int64_t offset = 0;
    for (size_t p = 0; p < per_peer.size(); ++p) {
      displs[p] = offset;
      for (Piece& piece : per_peer[p]) {
        piece.offset = offset;
        offset += piece.block.numel();
      }
      counts[p] = offset - displs[p];
    }
    return offset;
  }

  std::vector<std::vector<Piece>> send_, recv_;
};

}  // namespace muond
