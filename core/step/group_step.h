#pragma once
// One group's share of a step, phase by phase (docs/ARCHITECTURE.md "One
// step"). Each phase names the views it reads and writes:
//
//   momentum   grad_i, momentum_i -> L_i (momentum_i only read; double-
//              buffered: also -> staged_momentum_i)
//   a2a_fwd    stage 1 over gtp:  L_i  -> A1_i
//              stage 2 over tp:   A1_i -> A2_i
//   ns         replicated params on L_i, ns_tp_complete on A1_i,
//              ns_after_stage2 on A2_i (NsRunner, in place)
//   a2a_bwd    reverse stage 2:  A2_i -> A1_i
//              reverse stage 1:  A1_i -> L_i, then the pad rows of L_i zeroed
//   dp_share   over the DP group: L_i of the params homed in this replica
//              -> L_i of the same params on the other replicas
//              (PlanBuffers::dp_share; nothing without a DP axis)
//   variant    NorMuon / AdaMuon: the update renormalised where it is whole
//              (variant_phase.h); nothing for plain Muon
//   (a lane's exchanges, a2a_fwd, a2a_bwd and dp_share, run batched across
//   its groups: lane_exchanges.h)
//   ---------- the job's commit vote (layer_sharded_muon.cc) ----------
//   update     L_i -> param_i (weight decay + adjusted lr), then
//              grad_i, momentum_i -> momentum_i (the momentum kernel again,
//              in place; host state and double-buffered momentum: the
//              staged_momentum_i, stored by the stream or the momentum
//              phase, swapped in); not for a skipped param
//
// The phases before the commit write only engine-owned scratch (staging, L_i,
// A1_i, A2_i), never a param or optimizer state: a step that fails in an
// exchange (a peer died) or that the commit vote turns down leaves params and
// momentum exactly as before. The momentum phase reads momentum_i and writes
// only L_i; the commit runs the same kernel on the same values (the grads are
// the trainer's, untouched until the step returns) to store the new
// momentum: bitwise what the phase computed, with no second copy of the
// state (a staged copy doubled the device state's bytes; the recompute
// reads grad and momentum once more). With MuonOptions::
// double_buffer_momentum the phase also writes the new momentum to a second
// buffer, never read before the commit swaps it in (that copy's memory for
// one pass less).
//
// A param named in `skip` (StepInputs::skip_params) is left alone, as
// torch.optim leaves a param whose grad is None: the kernel does not run on
// it and the commit does not store its momentum, its L_i is zeroed (NS
// of zeros is zeros, and the exchanges keep their shapes on every rank), and
// the update phase leaves its param alone (no weight decay, no update); an
// AdamW param keeps its moments and its step count. The other params run the
// same kernels on the same values: bitwise as without `skip`.
//
// With a DP axis, a2a_fwd, ns and a2a_bwd cover only the params homed in
// this rank's replica (NsHome::d; the plan leaves the others out); the L_i of
// the others, momentum output until then, is overwritten by dp_share with the
// update their home replica computed: bitwise the update of D = 1.
//
// A1_i is PlanBuffers::stage1 (L_i itself where this rank assembles no A1_i),
// A2_i is PlanBuffers::stage2. A device's phases issue their work without a
// host wait; each is timed by two events on the lane's PhaseClock, and the
// commit waits once per lane (phase_clock.h).
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/muon/adamw.h"
#include "core/muon/muon_update.h"
#include "core/step/group_state.h"
#include "core/step/layer_sharded_muon.h"
#include "core/step/ns_runner.h"
#include "core/step/phase_clock.h"

namespace muond {

// Host momentum (GroupState::host_streams) is always streamed: copied in
// and out piece by piece through two device slots by copy engines. Whether
// this step of `group` also runs NS piece by piece, under the copies of the
// pieces after: where NS runs on every param's L_i in place (no exchange, no
// DP axis) and the step is not measured per shape (`shape_times` null).
// Elsewhere the exchanges and NS follow the momentum and run under its stores.
bool StreamsNsWithMomentum(const GroupState& group,
                           const ShapeTimes* shape_times);

// Whether `group`'s momentum phase runs in its domain agreement, the grads
// checked against `grad_limit` as the momentum kernels read them
// (MomentumWithGradCheck): a Muon group on a device backend whose momentum
// is on the device. Host momentum is streamed through device slots with its
// copies, and a host backend's check is a read of its own anyway: they keep
// a check of its own (on a device into the group's check slot,
// Backend::CheckGradsInto; on the host GradsWithinLimit).
bool ChecksGradsInMomentum(const GroupState& group);

// The prepare's momentum phase run ahead of it, in the domain agreement
// (nothing of the state is written: L_i only), with the "every grad not in
// `skip` under check.limit" check in the same pass
// (Backend::CheckedMuonMomentumBatch into check.slot). Issues the work and
// returns: the caller takes the finding (Backend::TakeGradChecks, one wait
// for every group of the backend) and then sets group.momentum_ready.
absl::Status MomentumWithGradCheck(GroupState& group,
                                   const MuonOptions& options,
                                   const std::set<std::string>& skip,
                                   MomentumGradCheck check);

// Where this step's momentum ran in the domain agreement
// (MomentumWithGradCheck), NS needs no exchange before it (every param
// whole on this rank) and has not run yet: NS runs with the lane's other
// such groups (lane_ns.h), before the job vote where the step is not
// measured, and the prepare runs none of its own.
bool RunsLaneNs(const GroupState& group);

// The matrices a group's NS runs on in place (group.plan must be set), as
// NsRunner::RunLists takes them: the replicated params' L_i, the
// ns_tp_complete params' A1_i, the ns_after_stage2 params' A2_i.
struct NsLists {
  std::vector<MatrixView> lists[3];
};
NsLists NsListsOf(const GroupState& group);

// A Muon group's share of a lane's prepare (PrepareLane runs it phase by
// phase across its groups, the exchanges batched: lane_exchanges.h), under
// the group's current plan (group.plan must be set). What is left to do
// this step: the momentum unless the domain agreement ran it, NS unless it
// ran with the lane's (lane_ns.h); `streamed` where StreamsNsWithMomentum,
// whose momentum phase runs NS too, leaving only the variant phase. Reads
// and clears GroupState::momentum_ready and ns_done.
struct PrepareWork {
  bool momentum = true;
  bool ns = true;
  bool streamed = false;
};
PrepareWork TakePrepareWork(GroupState& group, const ShapeTimes* shape_times);

// grad_i, momentum_i -> L_i (host momentum streamed through its device
// slots; `work.streamed`: NS overlapped), timed on `clock`; nothing where
// the agreement ran it.
absl::Status RunMomentumPhase(GroupState& group, const MuonOptions& options,
                              const std::set<std::string>& skip,
                              const PrepareWork& work, PhaseClock& clock);

// NS in place on NsListsOf (after the forward exchanges), timed on `clock`
// and per shape into `shape_times` where not null; nothing where it ran
// already.
absl::Status RunNsPhase(GroupState& group, const MuonOptions& options,
                        const PrepareWork& work, ShapeTimes* shape_times,
                        PhaseClock& clock);

// NorMuon/AdaMuon: the update renormalised where it is whole again (after
// the reverse exchanges and dp_share); nothing for plain Muon.
absl::Status RunVariantPhase(GroupState& group, const MuonOptions& options,
                             const std::set<std::string>& skip,
                             PhaseClock& clock);

// Waits until the streams of host momentum are idle: the staged momentum is
// complete (before the commit), and after an error nothing is still copying.
absl::Status DrainMomentumStores(GroupState& group);

// After the prepare: InvalidArgument naming the group's params whose
// update on this rank (L_i) has a NaN or Inf, for custom coefficient
// schedules only. A custom schedule can grow past the iteration dtype's range
// (fp16 65504, or fp32) with finite gradients; the built-in sets are bounded
// (gram_spectra_test: sigma_max <= max p + 0.05), so they skip the check and
// its sync. Skipped params (zero L_i) are not named.
absl::Status CheckNsOutputsFinite(GroupState& group, const MuonOptions& options,
                                  const std::set<std::string>& skip);

// Whether Muon groups `a` and `b` commit as one (CommitMuonGroups): the
// same backend, step options and way of storing the momentum.
bool CommitsTogether(const GroupState& a, const GroupState& b);

// After the job's commit vote: the update of the params (L_i after the
// prepare) and the new momentum stored (host state and double-buffered
// momentum: the staged momentum made the state), for Muon `groups` that
// CommitsTogether, in one batched update and one momentum store for them
// all (a group per layer launches them once, not once per layer). Local
// only. Its only failures are the backend's own (a launch error): after the
// update, a failed store leaves every group of the run with new params and
// old momentum, as one group's batch could before.
absl::Status CommitMuonGroups(absl::Span<GroupState* const> groups,
                              const std::set<std::string>& skip,
                              PhaseClock& clock);

// An AdamW group's step on its local shards (no exchange), run at the
// commit: each param not in `skip` at its own step count + 1 (torch.optim
// keeps state[p]["step"] per param).
absl::Status StepAdamWGroup(GroupState& group, const AdamWOptions& options,
                            const std::set<std::string>& skip,
                            PhaseClock& clock);

}  // namespace muond
