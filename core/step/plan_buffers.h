#pragma once
// One group's exchange plan under a set of NS homes, with the assembled
// matrices it needs and the view each stage of the step reads and writes.
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/common/matrix_view.h"
#include "core/plan/exchange_plan.h"
#include "core/plan/planner.h"
#include "core/plan/replica_exchange.h"
#include "core/plan/sharding.h"
#include "core/step/buffers.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {

// Per param (registration order) the matrix each stage works on. L_i, the
// local shard in the NS dtype, is the group's (GroupState::local); the plan
// adds:
struct PlanBuffers {
  // This replica's exchanges and NS: the params homed in it (NsHome::d).
  // max_send_elems / max_recv_elems cover dp_share too.
  GroupExchangePlan plan;
  // The dp_share exchange over the DP group, from L_i (the updates of the
  // params homed in this replica) into L_i (those homed elsewhere):
  // replica_exchange.h. Inactive without a DP axis.
  StageExchange dp_share;
  // The stage-1 result of each param: A1_i where this rank assembles param i
  // in stage 1, and L_i itself for every other param (StageOneResultOrLocal:
  // a param without stage 1, e.g. kTp-sharded, is already whole along dim 0
  // locally). Stage 2 reads it, the NS of ns_tp_complete works on it, the
  // reverse of stage 2 writes it and the reverse of stage 1 reads it.
  std::vector<MatrixView> stage1;
  // A2_i where this rank assembles param i in stage 2; empty elsewhere
  // (never read there).
  std::vector<MatrixView> stage2;
  // The slabs behind the assembled views, and their size.
  std::vector<OwnedBuffer> owned;
  int64_t assembled_bytes = 0;
};

// Builds the plans of `homes` for this rank (d, g, t) of `domain` and
// allocates its
// assembled matrices (zeroed, same shapes back to back in param order so
// NsRunner batches them in place) on `backend` in `ns_dtype`. `local`: L_i
// per param. Errors: BuildGroupExchangePlan's, allocation failures.
absl::StatusOr<PlanBuffers> BuildPlanBuffers(
    Backend* backend, DType ns_dtype, std::vector<ParamShardSpec> specs,
    std::vector<NsHome> homes, const DomainBinding& domain,
    absl::Span<const MatrixView> local);

}  // namespace muond
