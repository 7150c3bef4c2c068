#include "core/plan/replica_exchange.h"

#include <utility>

#include "core/common/status_macros.h"
#include "core/plan/all_to_allv_builder.h"

namespace muond {
absl::StatusOr<StageExchange> BuildReplicaExchangePlan(
    const std::vector<ParamShardSpec>& specs, const std::vector<NsHome>& homes,
    DomainSize domain, int my_d, int my_g, int my_t) {
  RETURN_IF_ERROR(
      CheckDomainCoordinates(domain, my_d, my_g, my_t, "this rank"));
  RETURN_IF_ERROR(CheckNsHomeReplicas(specs, homes, domain.dp));
  const int D = domain.dp;
  StageExchange ex;
  for (int d = 0; d < D; ++d) {
    ex.group_ranks.push_back(domain.FlatRank(d, my_g, my_t));
  }
  ex.my_peer = my_d;
  AllToAllvBuilder builder(D);  // 0-element shards are not sent
  for (size_t i = 0; i < specs.size(); ++i) {
    const Block whole{0, 0, specs[i].local_shape[0], specs[i].local_shape[1]};
    const int home = homes[i].d;
    for (int peer = 0; peer < D; ++peer) {
      if (peer == my_d) continue;
      if (home == my_d) builder.Send(peer, int(i), whole);
      if (home == peer) builder.Recv(peer, int(i), whole);
    }
  }
  ex.forward = std::move(builder).Finish();
  const AllToAllvPlan& plan = ex.forward;
  // A non-empty shard homed anywhere is sent by its home and received by
  // every other member: the same answer on every member.
  ex.active = plan.total_send + plan.total_recv > 0;
  return ex;
}

}  // namespace muond
