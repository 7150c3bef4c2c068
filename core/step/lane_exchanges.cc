#include "core/step/lane_exchanges.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/step/group_in_order.h"
#include "core/step/step_failures.h"

namespace muond {
namespace {

// A group's part in one exchange step, and the communicator it runs over;
// none where the group has no such stage or its stage is inactive.
struct GroupPart {
  Communicator* comm = nullptr;
  ExchangePart part;
};

const StageExchange* StageTwo(const GroupExchangePlan& plan, int tp_dim) {
  for (const StageExchange& s2 : plan.stage2) {
    if (s2.tp_dim == tp_dim) return &s2;
  }
  return nullptr;
}

std::optional<GroupPart> PartOf(const GroupState& group, LaneExchangeStep step,
                                int tp_dim) {
  if (!group.plan.has_value()) return std::nullopt;
  const PlanBuffers& pb = *group.plan;
  const GroupExchangePlan& plan = pb.plan;
  const DomainBinding& d = group.config.domain;
  const StageExchange* stage = nullptr;
  switch (step) {
    case LaneExchangeStep::kStage1Forward:
    case LaneExchangeStep::kStage1Reverse:
      if (plan.has_stage1) stage = &plan.stage1;
      break;
    case LaneExchangeStep::kStage2Forward:
    case LaneExchangeStep::kStage2Reverse:
      stage = StageTwo(plan, tp_dim);
      break;
    case LaneExchangeStep::kDpShare:
      stage = &pb.dp_share;
      break;
  }
  if (stage == nullptr || !stage->active) return std::nullopt;
  const std::string* name = &group.config.name;
  switch (step) {
    case LaneExchangeStep::kStage1Forward:
      return GroupPart{d.gtp, {name, &stage->forward, group.local, pb.stage1}};
    case LaneExchangeStep::kStage2Forward:
      return GroupPart{d.tp, {name, &stage->forward, pb.stage1, pb.stage2}};
    case LaneExchangeStep::kStage2Reverse:
      return GroupPart{d.tp, {name, &stage->reverse, pb.stage2, pb.stage1}};
    case LaneExchangeStep::kStage1Reverse:
      return GroupPart{d.gtp, {name, &stage->reverse, pb.stage1, group.local}};
    case LaneExchangeStep::kDpShare:
      return GroupPart{d.dp, {name, &stage->forward, group.local, group.local}};
  }
  return std::nullopt;
}

// The same on every rank of the group's domain: its params' whole elements
// in its NS dtype, times the other replicas for dp_share (a replica sends
// the updates of the params homed in it to each of them): at least what any
// rank sends or receives for the group in `step`.
int64_t SizeBound(const GroupState& group, LaneExchangeStep step) {
  int64_t elements = 0;
  for (const ParamState& p : group.params) {
    int64_t n = 1;
    for (int64_t dim : p.spec.full_shape) n *= dim;
    elements += n;
  }
  const int64_t copies = step == LaneExchangeStep::kDpShare
                             ? std::max(1, group.config.domain.size.dp - 1)
                             : 1;
  return elements * copies * int64_t(DTypeSize(group.ns_dtype));
}

// The tp_dims of stage 2 in the order `step` runs them.
std::vector<int> TpDimsOf(LaneExchangeStep step) {
  if (step == LaneExchangeStep::kStage2Forward) return {0, 1};
  if (step == LaneExchangeStep::kStage2Reverse) return {1, 0};
  return {-1};
}

// Appends the batches of one exchange (one tp_dim of stage 2) to `out`.
void AppendBatches(absl::Span<GroupState* const> groups, LaneExchangeStep step,
                   int tp_dim, int64_t batch_bytes,
                   std::vector<ExchangeBatch>& out) {
  std::vector<std::optional<GroupPart>> parts(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    parts[i] = PartOf(*groups[i], step, tp_dim);
  }
  // One all_to_allv carries one dtype over one communicator, packed on one
  // backend's queue.
  const std::vector<std::vector<size_t>> keyed = GroupInOrder(
      groups.size(), [&](size_t i) { return parts[i].has_value(); },
      [&](size_t a, size_t b) {
        return parts[a]->comm == parts[b]->comm &&
               groups[a]->backend == groups[b]->backend &&
               groups[a]->ns_dtype == groups[b]->ns_dtype;
      });
  for (const std::vector<size_t>& same : keyed) {
    int64_t bound = 0;
    for (size_t i : same) {
      const int64_t own = SizeBound(*groups[i], step);
      if (i == same.front() || bound + own > batch_bytes) {
        ExchangeBatch& batch = out.emplace_back();
        batch.comm = parts[i]->comm;
        batch.backend = groups[i]->backend;
        batch.dtype = groups[i]->ns_dtype;
        bound = 0;
      }
      out.back().groups.push_back(groups[i]);
      out.back().parts.push_back(parts[i]->part);
      bound += own;
    }
  }
}

}  // namespace

std::vector<ExchangeBatch> ExchangeBatchesOf(
    absl::Span<GroupState* const> groups, LaneExchangeStep step,
    int64_t batch_bytes) {
  std::vector<ExchangeBatch> batches;
  for (int tp_dim : TpDimsOf(step)) {
    AppendBatches(groups, step, tp_dim, batch_bytes, batches);
  }
  return batches;
}

ExchangeBytes LaneExchangeBytes(absl::Span<GroupState* const> groups,
                                int64_t batch_bytes) {
  ExchangeBytes bytes;
  for (LaneExchangeStep step :
       {LaneExchangeStep::kStage1Forward, LaneExchangeStep::kStage2Forward,
        LaneExchangeStep::kStage2Reverse, LaneExchangeStep::kStage1Reverse,
        LaneExchangeStep::kDpShare}) {
    for (const ExchangeBatch& batch :
         ExchangeBatchesOf(groups, step, batch_bytes)) {
      bytes.send = std::max(bytes.send, SendBytesOf(batch.parts, batch.dtype));
      bytes.recv = std::max(bytes.recv, RecvBytesOf(batch.parts, batch.dtype));
    }
  }
  return bytes;
}

namespace {

absl::Status ZeroPadRows(const GroupState& group) {
  for (const ZeroFill& z : group.plan->plan.stage1.reverse_zero_fill) {
    const MatrixView& m = group.local[z.param];
    RETURN_IF_ERROR(group.backend->Memset0(
        m.Block(z.block.row0, z.block.col0, z.block.rows, z.block.cols)));
  }
  return absl::OkStatus();
}

absl::Status RunBatch(const ExchangeBatch& batch, LaneExchangeStep step,
                      ExchangeBuffers& exchange) {
  RETURN_IF_ERROR(ExchangeParts(*batch.backend, batch.comm, batch.parts,
                                batch.dtype, exchange));
  if (step != LaneExchangeStep::kStage1Reverse) return absl::OkStatus();
  for (const GroupState* group : batch.groups) {
    RETURN_IF_ERROR(WithContext(
        ZeroPadRows(*group),
        absl::StrCat("group '", group->config.name, "': pad rows: ")));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunLaneExchanges(absl::Span<GroupState* const> groups,
                              LaneExchangeStep step, int64_t batch_bytes,
                              ExchangeBuffers& exchange, PhaseClock& clock,
                              PhaseClock::Field field) {
  static constexpr const char* kRange[] = {"lsmuon/a2a_fwd", "lsmuon/a2a_fwd",
                                           "lsmuon/a2a_bwd", "lsmuon/a2a_bwd",
                                           "lsmuon/dp_share"};
  CommunicatorFirst comm;
  absl::Status first;
  for (const ExchangeBatch& batch :
       ExchangeBatchesOf(groups, step, batch_bytes)) {
    if (comm.failed()) break;
    first.Update(comm.Take(
        clock.Time(*batch.backend, kRange[static_cast<int>(step)], field,
                   [&] { return RunBatch(batch, step, exchange); })));
  }
  return comm.Or(first);
}

}  // namespace muond
