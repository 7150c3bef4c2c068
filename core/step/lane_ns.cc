#include "core/step/lane_ns.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/step/group_in_order.h"
#include "core/step/group_step.h"
#include "core/step/ns_runner.h"

namespace muond {
namespace {

// Whether `a` and `b` run NS alike: the same runner (backend and work dtype)
// and the same NS options and batch size, so one RunLists serves both.
bool SameNs(const GroupState& a, const GroupState& b) {
  return a.ns == b.ns && a.step_muon.ns == b.step_muon.ns &&
         a.step_muon.ns_batch_size == b.step_muon.ns_batch_size;
}

// The groups that RunsLaneNs, those that SameNs each other together, in
// order of each batch's first group.
std::vector<std::vector<GroupState*>> BatchesOf(
    absl::Span<GroupState* const> groups) {
  const std::vector<std::vector<size_t>> batches = GroupInOrder(
      groups.size(), [&](size_t i) { return RunsLaneNs(*groups[i]); },
      [&](size_t a, size_t b) { return SameNs(*groups[a], *groups[b]); });
  std::vector<std::vector<GroupState*>> out;
  for (const std::vector<size_t>& batch : batches) {
    std::vector<GroupState*>& members = out.emplace_back();
    for (size_t i : batch) members.push_back(groups[i]);
  }
  return out;
}

absl::Status RunBatch(const std::vector<GroupState*>& batch, PhaseClock& clock,
                      ShapeTimes* shape_times, absl::string_view when) {
  NsLists all;
  for (const GroupState* group : batch) {
    const NsLists one = NsListsOf(*group);
    for (int l = 0; l < 3; ++l) {
      all.lists[l].insert(all.lists[l].end(), one.lists[l].begin(),
                          one.lists[l].end());
    }
  }
  const absl::Span<const MatrixView> spans[] = {all.lists[0], all.lists[1],
                                                all.lists[2]};
  GroupState& first = *batch.front();
  const absl::Status ran = clock.Time(
      *first.backend, "lsmuon/ns", &PhaseTimings::ns_us,
      [&] { return first.ns->RunLists(first.step_muon, spans, shape_times); });
  if (!ran.ok()) {
    return WithContext(
        ran, absl::StrCat(NamesOfGroups(batch), ": Newton-Schulz", when,
                          " failed (the step was not applied: params and "
                          "momentum unchanged): "));
  }
  for (GroupState* group : batch) group->ns_done = true;
  return absl::OkStatus();
}

}  // namespace

absl::Status RunLaneNs(absl::Span<GroupState* const> groups, PhaseClock& clock,
                       ShapeTimes* shape_times, absl::string_view when) {
  for (const std::vector<GroupState*>& batch : BatchesOf(groups)) {
    RETURN_IF_ERROR(RunBatch(batch, clock, shape_times, when));
  }
  return absl::OkStatus();
}

}  // namespace muond
