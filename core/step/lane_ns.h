#pragma once
// NS of a lane's groups, batched across them.
//
// Where a group's momentum ran in the domain agreement and its NS needs no
// exchange (RunsLaneNs), its NS runs with the other such groups of its lane:
// those that share an NS runner and NS options (MuonOptions::ns and
// ns_batch_size) run as one NsRunner::RunLists, so same-shape matrices of
// different groups batch together (with a group per layer, every layer's
// q_proj in one batch, not one batch of one per layer) and a device replays
// one graph for them all instead of one per group. The batches are those of
// one group holding the same params, so a model registered as a group per
// layer holds the NS workspace of one group of all its layers.
//
// On an unmeasured step it runs before the trainer's verdict and the job
// vote: it writes scratch only (L_i), so a refused step just discards it,
// and its device work fills those waits. A step that measures NS per shape
// runs it after the vote, timed per chunk.
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/step/group_state.h"
#include "core/step/ns_runner.h"
#include "core/step/phase_clock.h"

namespace muond {

// NS for every group of `groups` (one lane's, in its order) that
// RunsLaneNs, under each group's step options, timed on `clock` (per shape
// into `shape_times` where not null); sets ns_done on each group whose NS
// ran. A failure names the groups of the batch that failed, and `when` ("
// before the job vote"), and must refuse the step: NS may have run part of
// the way over their L_i, so it must not run again.
absl::Status RunLaneNs(absl::Span<GroupState* const> groups, PhaseClock& clock,
                       ShapeTimes* shape_times, absl::string_view when);

}  // namespace muond
