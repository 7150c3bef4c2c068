#pragma once
// What the engine keeps per param group: the config, the optimizer state of
// the local shards, L_i, the NS homes by version and the plan in use.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/common/matrix_view.h"
#include "core/plan/sharding.h"
#include "core/step/buffers.h"
#include "core/step/layer_sharded_muon.h"
#include "core/step/ns_homes_by_version.h"
#include "core/step/ns_runner.h"
#include "core/step/plan_buffers.h"

namespace muond {

// The persistent state of one param's local shard.
struct ParamState {
  ParamShardSpec spec;
  OwnedBuffer momentum_buf, exp_avg_buf, exp_avg_sq_buf;
  // Muon: momentum (MuonOptions::state_dtype). AdamW: exp_avg, exp_avg_sq
  // (AdamWOptions::state_dtype).
  MatrixView momentum, exp_avg, exp_avg_sq;
  // Muon with streamed host state (state_location) or double_buffer_momentum:
  // the step's new momentum, stored by the stream or the momentum phase
  // while `momentum` stays as it was; the commit swaps the two
  // (group_step.h), so a step that fails before its commit leaves the state
  // untouched. Other state has none (the commit recomputes the momentum in
  // place).
  OwnedBuffer staged_momentum_buf;
  MatrixView staged_momentum;
  // Muon with fp8_e4m3 state: the fp32 scale of each kStateBlock elements of
  // momentum and (where staged) of staged_momentum (swapped with them); null
  // otherwise.
  OwnedBuffer momentum_scales_buf, staged_momentum_scales_buf;
  float* momentum_scales = nullptr;
  float* staged_momentum_scales = nullptr;
  // AdamW with fp8_e4m3 moments: exp_avg's and exp_avg_sq's block scales.
  OwnedBuffer exp_avg_scales_buf, exp_avg_sq_scales_buf;
  AdamWMomentScales moment_scales;
  // Muon variants (core/muon/muon_variant.h): the second moment, fp32.
  // AdaMuon: the shard's shape in buffers of its own, staged like momentum.
  // NorMuon: local rows x 1, a view of GroupState::normuon.state_buf (the
  // step's new values are staged in normuon.staged_buf).
  OwnedBuffer moment2_buf, staged_moment2_buf;
  MatrixView moment2, staged_moment2;
  // AdamW: the steps this param took (torch.optim's state[p]["step"]: a
  // param skipped at a step does not count it).
  int64_t adamw_step = 0;
};

// NorMuon's per-row buffers of a group (variant_phase.h): the state, the
// step's new state (staged until the commit, which swaps the two) and row
// factors of every param's local rows back to back (param i from
// offset[i]), and the row statistics with the scratch of their gathers.
struct NorMuonRows {
  OwnedBuffer state_buf, staged_buf, factors_buf, stats_buf;
  std::vector<int64_t> offset;
  int64_t total_rows = 0;
  // The statistics: per param 2 x full rows (row sums, then state); the
  // gathers receive behind them.
  int64_t slots = 0;
};

// The streams and device slots through which the Muon groups of a lane
// stream their host momentum (one group at a time, as the lane runs them):
// `load` copies a piece of a group's params' momentum into a slot while NS
// runs, the momentum kernel updates it in place on the lane's backend,
// `store` copies the new momentum to the host staged momentum. Two slots, so
// at most two pieces' state is on the device.
struct HostStateStreams {
  std::unique_ptr<Backend> load, store;
  OwnedBuffer slot[2];
  // Bytes of each slot: the lane's largest GroupState::host_slot_bytes.
  int64_t slot_bytes = 0;
};

// Where a param's momentum sits in a slot: its values, then (fp8) its block
// scales, each from a 256-byte boundary (the alignment of every allocation,
// which the kernels' vector loads rely on).
struct MomentumSlot {
  int64_t value_bytes = 0;
  int64_t scale_bytes = 0;  // 0 unless fp8
  int64_t scales_offset = 0;
  int64_t bytes = 0;  // the whole, a multiple of 256
};
MomentumSlot SlotOf(const ParamState& p);

// Whether a Muon group with `options` on `backend` keeps a staged momentum
// beside the momentum, which its commit swaps in: streamed host state (the
// stream stores to it) or double_buffer_momentum (the momentum phase does).
bool StagesMomentum(const MuonOptions& options, const Backend& backend);

struct GroupState {
  GroupConfig config;
  // The backend this group computes on (its own, e.g. a CUDA stream of its
  // own, or the optimizer's) and the lane it runs in.
  Backend* backend = nullptr;
  int lane = 0;
  std::vector<ParamState> params;
  // Muon: L_i per param, the local shard in ns_dtype: NS input after the
  // momentum phase, the (unscaled) update after the reverse route, read as
  // UpdateOf gives it. In the lane's slabs (Lane::local_slabs), set with
  // the lanes.
  std::vector<MatrixView> local;
  // This step's momentum phase ran in the domain agreement, with the grad
  // check in its pass (MomentumWithGradCheck): L_i holds the NS input, and
  // the prepare runs no momentum phase of its own (TakePrepareWork clears it).
  bool momentum_ready = false;
  // This step's NS ran with the lane's other groups (RunLaneNs: its inputs
  // were all local): the prepare runs no NS of its own (TakePrepareWork clears
  // it).
  bool ns_done = false;
  // The dtype of L_i, the assembled matrices and the exchanges: NS's work
  // dtype (bf16 for medium precision), so nothing is converted between the
  // momentum kernel and the update kernel but inside Newton–Schulz. NS
  // writes its result over its input in NsResultDType (fp16 from Gram NS
  // under medium: same size, so the exchanges move its bytes unchanged).
  DType ns_dtype = DType::kFloat32;
  // The group as registered, as the ranks of its domain compare it every
  // step (group_step_summary.h): "#<fingerprint> (<n> params)" of its
  // name, algorithm, NS dtype and its params' names and full shapes. Ranks that
  // registered a communicator's groups in different orders, or a group with
  // other params, refuse the step instead of exchanging each other's data.
  std::string registered;
  int64_t state_bytes = 0;
  // The part of state_bytes that is the variants' fp32 second moments
  // (variant_phase.h), in device memory whatever the group's state_dtype and
  // state_location.
  int64_t variant_state_bytes = 0;
  // Bytes of the variants' staged state (the step's new state until its
  // commit; variant_phase.h) and of double-buffered momentum's second buffer.
  int64_t staging_bytes = 0;
  NorMuonRows normuon;
  NsHomesByVersion homes;
  // The plan in use and the homes version it was built from (0: the
  // round-robin fallback, -1: none yet).
  std::optional<PlanBuffers> plan;
  int64_t plan_version = -1;
  // Shared with the other groups of its lane on the same backend and NS
  // work dtype (SetUpLanes).
  std::shared_ptr<NsRunner> ns;
  // Host momentum (MuonOptions::state_location) on a device: a piece of a
  // step's stream (StreamMomentum, group_step.cc) gathers params until it
  // holds host_piece_bytes (about 1/32 of the group's momentum); a slot holds
  // host_slot_bytes (a piece and the largest param). 0 otherwise.
  int64_t host_piece_bytes = 0;
  int64_t host_slot_bytes = 0;
  // Its lane's streams and slots (not owned; null but for host momentum).
  HostStateStreams* host_streams = nullptr;
  // This step's options: the registered ones with the step's overrides
  // (MuonOptionsForStep / AdamWOptionsForStep, by the group's algorithm),
  // resolved once when RunStep starts, before anything of the step reads
  // them. Once: every phase reads them, and at a thousand groups the
  // overrides' name lookups cost ~1 ms a resolution.
  MuonOptions step_muon;
  AdamWOptions step_adamw;
};

// Validates `config` (domain coordinates and communicators, hyperparameters,
// shard specs, views against shapes: InvalidArgument naming the group/param
// and the rule) and allocates its zeroed state on its backend (config's, or
// `default_backend`). `ns_budget` (not owned, may be null) bounds its NS
// workspaces (NsRunner).
absl::StatusOr<GroupState> CreateGroupState(
    GroupConfig config, Backend* default_backend,
    NsWorkspaceBudget* ns_budget = nullptr);

std::vector<ParamShardSpec> ParamSpecs(const GroupState& group);

// Param i's L_i as the update NS left in it: NsResultDType of its full
// matrix under `options` (the step's), which every rank holding a shard
// derives alike, whichever rank ran the NS.
MatrixView UpdateOf(const GroupState& group, const MuonOptions& options,
                    size_t i);

// The lane's streams and slots for the host-momentum groups of `groups`
// (null when none has any): slots of the largest group's host_slot_bytes,
// allocated on `backend`; points each such group's host_streams at them.
absl::StatusOr<std::unique_ptr<HostStateStreams>> MakeHostStateStreams(
    Backend* backend, std::vector<GroupState*> groups);

// How an error names several groups: "group 'a'", or "groups 'a', 'b',
// 'c' and 5 more".
std::string NamesOfGroups(absl::Span<GroupState* const> groups);

}  // namespace muond
