#include "core/step/plan_buffers.h"

#include <algorithm>
#include <utility>

#include "core/common/status_macros.h"

namespace muond {
namespace {

// Allocates the matrices of `assembled` in one set of slabs, sorted by param
// (the order NsRunner chunks them in, so same-shape ones lie back to back),
// and stores each view at its param's index of `views`.
absl::Status AllocateAssembled(Backend* backend, DType dtype,
                               std::vector<const AssembledParam*> assembled,
                               PlanBuffers& buffers,
                               std::vector<MatrixView>& views) {
  std::stable_sort(assembled.begin(), assembled.end(),
                   [](const AssembledParam* x, const AssembledParam* y) {
                     return x->param < y->param;
                   });
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const AssembledParam* ap : assembled) {
    shapes.emplace_back(ap->rows, ap->cols);
    buffers.assembled_bytes += ap->rows * ap->cols * int64_t(DTypeSize(dtype));
  }
  ASSIGN_OR_RETURN(std::vector<MatrixView> slab_views,
                   AllocateSlabs(backend, dtype, shapes, buffers.owned));
  for (size_t k = 0; k < assembled.size(); ++k) {
    views[assembled[k]->param] = slab_views[k];
  }
  return absl::OkStatus();
}

// The explicit stage-1 fallback: where this rank assembles no A1_i, the
// stage-1 result of param i is its local shard L_i.
void StageOneResultOrLocal(absl::Span<const MatrixView> local,
                           std::vector<MatrixView>& stage1) {
  for (size_t i = 0; i < stage1.size(); ++i) {
    if (stage1[i].data == nullptr) stage1[i] = local[i];
  }
}

}  // namespace

absl::StatusOr<PlanBuffers> BuildPlanBuffers(
    Backend* backend, DType ns_dtype, std::vector<ParamShardSpec> specs,
    std::vector<NsHome> homes, const DomainBinding& domain,
    absl::Span<const MatrixView> local) {
  PlanBuffers buffers;
  ASSIGN_OR_RETURN(buffers.dp_share,
                   BuildReplicaExchangePlan(specs, homes, domain.size, domain.d,
                                            domain.g, domain.t));
  ASSIGN_OR_RETURN(
      buffers.plan,
      BuildGroupExchangePlan(std::move(specs), std::move(homes), domain.size,
                             domain.g, domain.t, domain.d));
  GroupExchangePlan& plan = buffers.plan;
  // The lane's exchange buffers carry dp_share too.
  plan.max_send_elems =
      std::max(plan.max_send_elems, buffers.dp_share.forward.total_send);
  plan.max_recv_elems =
      std::max(plan.max_recv_elems, buffers.dp_share.forward.total_recv);
  buffers.stage1.resize(local.size());
  buffers.stage2.resize(local.size());
  if (plan.has_stage1) {
    std::vector<const AssembledParam*> assembled;
    for (const AssembledParam& ap : plan.stage1.assembled) {
      assembled.push_back(&ap);
    }
    RETURN_IF_ERROR(AllocateAssembled(backend, ns_dtype, std::move(assembled),
                                      buffers, buffers.stage1));
  }
  std::vector<const AssembledParam*> assembled;
  for (const StageExchange& s2 : plan.stage2) {
    for (const AssembledParam& ap : s2.assembled) assembled.push_back(&ap);
  }
  RETURN_IF_ERROR(AllocateAssembled(backend, ns_dtype, std::move(assembled),
                                    buffers, buffers.stage2));
  StageOneResultOrLocal(local, buffers.stage1);
  return buffers;
}

}  // namespace muond
