#pragma once
// The engine behind LayerShardedMuon, private to core/step. Its member
// functions live by job:
//   layer_sharded_muon.cc   Create: groups, lanes; SetHomes
//   agree_across_domains.cc each group's per-step agreement and its plan
//   step_ballots.cc         this rank's ballot and the job-wide vote
//   run_step.cc             RunStep: vote, prepare, commit vote, commit
//   engine_state.cc         ExportState / ImportState
// The parts it drives live in files of their own:
//   buffers.h              owned backend memory, the lanes' exchange buffers
//   group_state.h          per-group state, validated and allocated at Create
//   ns_homes_by_version.h  the NS homes each group holds, by plan version
//   domain_agreement.h     the pure per-step agreement over gathered votes
//   gather_domain_votes.h  the all_gather that carries the votes
//   finite_grads.h         this rank's finite-gradient vote
//   plan_buffers.h         the plan of the agreed homes and its views
//   lanes.h                lanes: groups that must run one after the other
//   lane_threads.h         the lanes' worker pool, created with the engine
//   group_step.h           one group's phases (momentum ... update)
//   exchange_parts.h       one all_to_allv: pack, exchange, unpack
//   lane_exchanges.h       a lane's exchanges batched across its groups
//   lane_ns.h              a lane's NS batched across its groups
//   ns_runner.h            Newton–Schulz batched by shape, shape timing
//   state_io.h             the state codec of ExportState / ImportState
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/step/group_state.h"
#include "core/step/job_vote.h"
#include "core/step/lane_threads.h"
#include "core/step/lanes.h"
#include "core/step/layer_sharded_muon.h"
#include "core/step/ns_runner.h"
#include "core/step/state_io.h"

namespace muond {

class LayerShardedMuonImpl final : public LayerShardedMuon {
 public:
  LayerShardedMuonImpl(Backend* backend, StepOptions options)
      : backend_(backend),
        options_(options),
        ns_budget_(options.max_ns_workspace_bytes) {}

  absl::Status Init(std::vector<GroupConfig> groups);
  using LayerShardedMuon::SetHomes;
  absl::Status SetHomes(const std::string& group, std::vector<NsHome> homes,
                        int64_t version) override;
  absl::StatusOr<StepResult> RunStep(const StepInputs& inputs) override;
  absl::StatusOr<std::map<std::string, std::vector<float>>> ExportState()
      const override;
  absl::Status CheckImportState(
      const std::map<std::string, std::vector<float>>& state) const override;
  absl::Status ImportState(
      const std::map<std::string, std::vector<float>>& state) override;
  int64_t state_bytes() const override { return state_bytes_; }
  std::vector<StateStorageBytes> state_bytes_by_storage() const override;
  int64_t ns_workspace_bytes() const override { return ns_budget_.taken(); }
  int64_t peak_ns_workspace_bytes() const override { return ns_budget_.peak(); }
  int64_t peak_transient_bytes() const override {
    return transient_bytes_ + staging_bytes_;
  }

 private:
  // Lanes, their vote scratch and (when lanes run concurrently) the lane
  // workers.
  absl::Status SetUpLanes();
  // One NsRunner per backend and NS work dtype among `lane`'s Muon groups.
  void ShareNsRunners(const Lane& lane);
  // Floats of `lane`'s vote scratch: its largest domain-vote gather.
  int64_t VoteScratchFloats(const Lane& lane) const;
  // The L_i of `lane`'s Muon groups, in the lane's slabs (Lane::local_slabs),
  // after ShareNsRunners.
  absl::Status AllocateLocalSlabs(Lane& lane);
  // Whether some lane computes on the host (calls the BLAS).
  bool RunsOnHost() const;
  // How many workers run the lanes (StepOptions::lane_workers).
  int LaneWorkers() const;
  // Before anything changes: agrees across each group's domain on whether
  // every gradient is finite and on the NS homes version, and makes that
  // version's plan the group's. Returns the names of non-finite gradients
  // (empty: step).
  // The domains also agree on what the step does to each group (its skipped
  // params and hyperparameters, from `inputs`). With `momentum_now` (the
  // step's local checks passed) a group that ChecksGradsInMomentum runs its
  // momentum phase here, the grad check in the same pass; its time counts
  // as the momentum phase's.
  absl::StatusOr<std::vector<std::string>> AgreeAcrossDomains(
      const StepInputs& inputs, StepResult& result, bool read_grads,
      bool momentum_now = false);
  // Routes `group` by the homes of `version` (0: round-robin fallback),
  // building its plan unless it is the one in use.
  absl::Status UseHomesVersion(GroupState& group, int64_t version);
  // Grows `lane`'s exchange buffers to its batched exchanges under the
  // groups' current plans (lane_exchanges.h).
  absl::Status ReserveLaneExchanges(Lane& lane);
  // The homes of `version` as this rank holds them.
  absl::StatusOr<std::vector<NsHome>> HomesOf(const GroupState& group,
                                              int64_t version) const;
  // Whether this step measures per-shape NS times.
  bool MeasuresShapes() const;
  // This rank's vote on the step after every local check (overrides, the
  // daemon's refusal, the domain agreements): `refusal` and `code` get the
  // first refusal, `bad` the non-finite gradients.
  JobBallot LocalBallot(const StepInputs& inputs, StepResult& result,
                        std::vector<std::string>& bad, absl::Status& refusal);
  // For a step sent before its trainer's checks (StepInputs::
  // await_trainer_verdict): waits for the verdict once `mine` is cast; a
  // withdrawal turns `mine` into kTrainerWithdrew and is returned as this
  // rank's answer (ABORTED, STEP_WITHDRAWN). OK otherwise.
  absl::Status TakeTrainerVerdict(const StepInputs& inputs, JobBallot& mine);
  // The ballot of a replay (StepInputs::replay): kReplay, or a refusal when
  // the domain agreements it runs for its peers fail to communicate or the
  // daemon refused it (StepInputs::refusal: its trainer refused it).
  JobBallot ReplayBallot(const StepInputs& inputs, StepResult& result,
                         absl::Status& refusal);
  // The job-wide vote on `mine`; OK with the decision, or this step's error
  // (a communicator's, or the peers' refusal).
  absl::StatusOr<JobDecision> VoteOnJob(const JobBallot& mine);
  // After a collective of this step timed out (a rank never arrived): every
  // communicator is aborted, so the step goes no further and any peer still
  // blocked on this rank fails at once instead of after a timeout of its own.
  // Returns `timeout`, the step's answer, named by DidNotJoin.
  absl::Status AbandonStep(absl::Status timeout);
  // Runs `fn` on every lane (on the lane threads when they exist); phase
  // times of concurrent lanes add up.
  absl::Status RunLanes(
      const std::function<absl::Status(Lane&, PhaseTimings&)>& fn,
      PhaseTimings& timings);
  // Up to the commit: the Muon groups of one lane phase by phase, in
  // registration order within each phase, the exchanges batched across them
  // (lane_exchanges.h). Phases are timed on lane.clock; their work may run
  // on after it returns.
  absl::Status PrepareLane(Lane& lane, const StepInputs& inputs,
                           ShapeTimes* shape_times);
  // The lane's groups, in its order.
  std::vector<GroupState*> GroupsOf(const Lane& lane);
  // Waits for every lane's work (a step that ends before its commit).
  void DrainLanes();
  // After this rank's ballot agreed, before the trainer's verdict and the
  // job vote: RunLaneNs (lane_ns.h) on every lane's groups; its first
  // failure, which refuses the step.
  absl::Status StartNsBeforeVote();
  // After the exchanges, before the commit vote: the Muon groups' local
  // updates are finite (CheckNsOutputsFinite; custom coefficients only).
  absl::Status CheckNsOutputs(const StepInputs& inputs);
  // After the commit vote: every group of one lane writes its update, then
  // waits for the lane's work and adds the step's phase times to `timings`.
  absl::Status CommitLane(Lane& lane, const StepInputs& inputs,
                          PhaseTimings& timings);
  // Each group's step_muon / step_adamw: its registered options with
  // `overrides` applied. They are checked after (LocalBallot,
  // CheckStepOverrides): a step whose overrides fail is refused, and its
  // resolved values feed only the refusal's agreement, never an update.
  void ResolveStepOptions(const StepOverrides& overrides);
  // Every piece of state, in the order ExportState/ImportState name them.
  std::vector<StateEntry> StateEntries() const;

  Backend* backend_;
  StepOptions options_;
  // Before groups_: their NS runners give their bytes back to it as they go.
  NsWorkspaceBudget ns_budget_;
  std::vector<GroupState> groups_;
  std::vector<Lane> lanes_;
  // Steps run (for sampling per-shape NS timings on device backends).
  int64_t steps_run_ = 0;
  // Not OK: this step timed out in a collective and was abandoned, with this
  // answer (AbandonStep).
  absl::Status abandoned_;
  ShapeTimes shape_times_;
  int64_t state_bytes_ = 0;
  int64_t transient_bytes_ = 0;
  int64_t staging_bytes_ = 0;
  std::map<std::string, Algorithm> group_algorithms_;
  // Every param's name, for CheckSkipParams.
  std::set<std::string> param_names_;
  // Declared last: its threads, which use the members above, are joined
  // first.
  std::unique_ptr<LaneThreads> lane_threads_;
};

}  // namespace muond
