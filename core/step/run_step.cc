// One step, decided by the whole job: this rank's ballot (momentum into
// scratch where the grads are checked in its pass, then NS where it needs no
// exchange), the job vote (with the trainer's verdict on a step sent before
// its checks), momentum, exchanges and NS into scratch on every lane, the
// commit vote, then the commit.
#include <algorithm>
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/status_macros.h"
#include "core/step/group_step.h"
#include "core/step/lane_exchanges.h"
#include "core/step/lane_ns.h"
#include "core/step/layer_sharded_muon_impl.h"
#include "core/step/step_failures.h"
#include "core/step/step_overrides.h"
#include "glog/logging.h"

namespace muond {
namespace {

// Phase work of concurrently run lanes adds up; total_us stays wall time.
void AddTimings(const PhaseTimings& from, PhaseTimings& to) {
  to.momentum_us += from.momentum_us;
  to.a2a_fwd_us += from.a2a_fwd_us;
  to.ns_us += from.ns_us;
  to.a2a_bwd_us += from.a2a_bwd_us;
  to.dp_share_us += from.dp_share_us;
  to.update_us += from.update_us;
}

}  // namespace

bool LayerShardedMuonImpl::MeasuresShapes() const {
  // Host backends are measured every step (no extra sync); device backends
  // every ns_shape_timing_every-th step.
  const int every = options_.ns_shape_timing_every;
  return every > 0 &&
         (std::none_of(lanes_.begin(), lanes_.end(),
                       [](const Lane& l) { return l.backend->is_device(); }) ||
          steps_run_ % every == 0);
}

absl::StatusOr<StepResult> LayerShardedMuonImpl::RunStep(
    const StepInputs& inputs) {
  const absl::Time start = absl::Now();
  StepResult result;
  ResolveStepOptions(inputs.overrides);
  if (options_.testonly_commit_delay_ms > 0) {
    // A test may kill a peer once every survivor is inside this step: it
    // cannot end without that peer's ballot (tests/system/kill_mid_step.py).
    LOG(INFO) << "testonly_commit_delay_ms: step " << inputs.step_id
              << ": started";
  }
  // 1. Every check of this rank gives a verdict; none returns before the
  // job's vote, so a refusal on one rank reaches every rank at once instead
  // of leaving the peers waiting in their exchanges.
  std::vector<std::string> bad;
  absl::Status refusal;
  abandoned_ = absl::OkStatus();
  for (Lane& lane : lanes_) lane.clock.Start();
  JobBallot mine = LocalBallot(inputs, result, bad, refusal);
  // A rank of a domain never arrived: one comm timeout is all the step
  // costs (the job vote would wait a second one for the same rank).
  if (!abandoned_.ok()) return abandoned_;
  // The phases issue their work without waiting for it (PhaseClock). The
  // commit waits for its own; a step that ends before it, once a phase
  // issued work, waits here, so that none of its work runs on after its
  // answer. Not after a failed phase or an abandoned step, which waited for
  // nothing before either: a collective a dead peer never joined may never
  // finish.
  bool wait_at_end = false;
  absl::Cleanup drain = [&] {
    if (wait_at_end && abandoned_.ok()) DrainLanes();
  };
  if (mine.verdict == JobVerdict::kAgree && !MeasuresShapes()) {
    // A failure refuses the step here, in the vote: NS may have run part of
    // the way over L, so it must not run again on it after the vote.
    refusal = StartNsBeforeVote();
    wait_at_end = refusal.ok();
    if (!refusal.ok()) {
      mine.verdict = JobVerdict::kRefuse;
      mine.code = RefusalCode::kOther;
    }
  }
  const absl::Status withdrawn = TakeTrainerVerdict(inputs, mine);
  // 2. The job decides together.
  absl::StatusOr<JobDecision> decision = VoteOnJob(mine);
  // Timed out: the communicators are gone, whatever this rank refused.
  if (!abandoned_.ok()) return abandoned_;
  if (decision.ok()) {
    // A trainer withdrew it: whatever else was refused may come from memory
    // that trainer was about to change; every rank sends it again ...
    RETURN_IF_ERROR(WithdrawnByPeers(*decision, inputs.step_id));
    // ... unless a peer's trainer refused it (it sends no step again) or a
    // communicator failed: then this rank answers as a peer.
    if (!withdrawn.ok()) return RefusedByPeers(*decision, inputs.step_id);
  } else if (!withdrawn.ok()) {
    return decision.status();
  }
  if (!refusal.ok()) return refusal;  // mine, with its full detail
  if (!decision.ok()) return decision.status();
  if (decision->verdict == JobVerdict::kRefuse) {
    return RefusedByPeers(*decision, inputs.step_id);
  }
  // Every rank replays (a replay ballot never folds to step or skip).
  if (decision->verdict == JobVerdict::kReplay) return result;
  if (decision->verdict == JobVerdict::kSkip) {
    if (bad.empty()) {
      for (int r : decision->skipping_ranks) {
        bad.push_back(
            absl::StrCat("(non-finite gradients on rank ", r, " of the job)"));
      }
    }
    result.skipped_nonfinite = std::move(bad);
    return result;
  }
  // 3. Momentum (the NS input only), exchanges, NS: nothing of the state yet.
  ShapeTimes* shape_times = MeasuresShapes() ? &shape_times_ : nullptr;
  ++steps_run_;
  shape_times_.Clear();
  const absl::Status prepared = RunLanes(
      [&](Lane& lane, PhaseTimings&) {
        return PrepareLane(lane, inputs, shape_times);
      },
      result.timings);
  wait_at_end = prepared.ok();
  // 4. Every rank's exchanges succeeded, or nobody writes anything. A peer
  // dying during this vote itself is the one window left: it may reach some
  // ranks and not others (no consensus protocol; docs/ARCHITECTURE.md).
  // A peer that stopped mid-exchange would be waited for again in the vote.
  if (absl::IsDeadlineExceeded(prepared)) return AbandonStep(prepared);
  JobBallot commit{.kind = BallotKind::kCommit, .step_id = inputs.step_id};
  // Local checks only (no collective): a rank whose updates are not finite
  // refuses in the commit vote, so every rank refuses together.
  const absl::Status ns_finite =
      prepared.ok() ? CheckNsOutputs(inputs) : absl::OkStatus();
  if (!prepared.ok()) {
    commit.verdict = JobVerdict::kRefuse;
    commit.code = IsCommunicationFailure(prepared) ? RefusalCode::kCommunication
                                                   : RefusalCode::kOther;
  } else if (!ns_finite.ok()) {
    commit.verdict = JobVerdict::kRefuse;
    commit.code = RefusalCode::kNonFiniteUpdate;
  }
  if (options_.testonly_commit_delay_ms > 0) {
    // Said before the sleep, so a test watching the log kills a peer inside
    // this window, not by guessing a delay (tests/system/kill_mid_step.py).
    LOG(INFO) << "testonly_commit_delay_ms: step " << inputs.step_id
              << ": exchanges done (" << (prepared.ok() ? "ok" : "failed")
              << "); waiting " << options_.testonly_commit_delay_ms
              << " ms before the commit vote";
    absl::SleepFor(absl::Milliseconds(options_.testonly_commit_delay_ms));
  }
  absl::StatusOr<JobDecision> committed = VoteOnJob(commit);
  // Timed out: the communicators are gone, whatever this rank refused.
  if (!abandoned_.ok()) return abandoned_;
  if (!prepared.ok()) return prepared;
  if (!ns_finite.ok()) return ns_finite;  // mine, with the params named
  if (!committed.ok()) return committed.status();
  if (committed->verdict != JobVerdict::kAgree) {
    return absl::UnavailableError(
        absl::StrCat("step ", inputs.step_id, " was not applied on any rank: ",
                     DescribeRefusals(*committed), " in its exchanges"));
  }
  // 5. The commit: local writes only; it waits for its lanes' work itself.
  RETURN_IF_ERROR(RunLanes(
      [&](Lane& lane, PhaseTimings& t) { return CommitLane(lane, inputs, t); },
      result.timings));
  wait_at_end = false;
  result.ns_shapes = shape_times_.ByShape();
  result.timings.total_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  return result;
}

absl::Status LayerShardedMuonImpl::TakeTrainerVerdict(const StepInputs& inputs,
                                                      JobBallot& mine) {
  // A step sent before its trainer's checks: they ran alongside this rank's
  // ballot (the momentum phase, the domain agreements, NS where it needs no
  // exchange), which wrote nothing but scratch.
  // A withdrawal outranks this rank's own refusal or skip, which may come
  // from memory the trainer was about to change; not a failed communicator.
  if (!inputs.await_trainer_verdict || inputs.replay ||
      mine.code == RefusalCode::kCommunication) {
    return absl::OkStatus();
  }
  const absl::Status said = inputs.await_trainer_verdict();
  if (said.ok()) return said;
  mine.verdict = JobVerdict::kRefuse;
  mine.code = RefusalCode::kTrainerWithdrew;
  return WithdrawnHere(inputs.step_id,
                       options_.job != nullptr ? options_.job->rank() : 0,
                       std::string(said.message()));
}

absl::Status LayerShardedMuonImpl::RunLanes(
    const std::function<absl::Status(Lane&, PhaseTimings&)>& fn,
    PhaseTimings& timings) {
  // Every lane runs even after one failed: a lane's collectives are
  // awaited by peers that do not know this rank failed elsewhere.
  std::vector<absl::Status> lane_status(lanes_.size());
  if (lane_threads_ == nullptr) {
    for (size_t l = 0; l < lanes_.size(); ++l) {
      lane_status[l] = fn(lanes_[l], timings);
    }
  } else {
    std::vector<PhaseTimings> lane_timings(lanes_.size());
    lane_threads_->Run(
        [&](int l) { lane_status[l] = fn(lanes_[l], lane_timings[l]); });
    for (const PhaseTimings& t : lane_timings) AddTimings(t, timings);
  }
  // A communicator's failure in any lane decides the step, ahead of a local
  // failure in an earlier lane.
  CommunicatorFirst comm;
  absl::Status first;
  for (absl::Status& s : lane_status) first.Update(comm.Take(std::move(s)));
  return comm.Or(first);
}

absl::Status LayerShardedMuonImpl::PrepareLane(Lane& lane,
                                               const StepInputs& inputs,
                                               ShapeTimes* shape_times) {
  const std::set<std::string>& skip = inputs.skip_params;
  // A measured step's batched NS (an unmeasured one's ran before the vote).
  const absl::Status lane_ns =
      RunLaneNs(GroupsOf(lane), lane.clock, shape_times, " after the vote");
  // The Muon groups phase by phase, the exchanges batched across them. A
  // group that failed on its own (NS out of memory on a GPU another process
  // shares) still takes part in every collective, whose peers wait for it
  // (the exchanges, NorMuon's row statistics), on scratch only, and runs no
  // NS; the commit vote refuses the step. After a communicator's failure the
  // next collective would only wait out one more timeout: nothing more runs,
  // and that failure decides the step (a timeout abandons it).
  std::vector<GroupState*> muon;
  std::vector<PrepareWork> work;
  std::vector<absl::Status> own;
  for (int gi : lane.groups) {
    GroupState& group = groups_[gi];
    if (group.config.algorithm != Algorithm::kMuon) continue;
    muon.push_back(&group);
    work.push_back(TakePrepareWork(group, shape_times));
    own.push_back(RunMomentumPhase(group, group.step_muon, skip, work.back(),
                                   lane.clock));
  }
  CommunicatorFirst comm;
  absl::Status exchanged;
  auto exchange = [&](LaneExchangeStep step, PhaseClock::Field field) {
    if (comm.failed()) return;
    exchanged.Update(
        comm.Take(RunLaneExchanges(muon, step, options_.exchange_batch_bytes,
                                   lane.exchange, lane.clock, field)));
  };
  exchange(LaneExchangeStep::kStage1Forward, &PhaseTimings::a2a_fwd_us);
  exchange(LaneExchangeStep::kStage2Forward, &PhaseTimings::a2a_fwd_us);
  for (size_t i = 0; i < muon.size() && !comm.failed(); ++i) {
    if (!own[i].ok()) continue;
    own[i] = RunNsPhase(*muon[i], muon[i]->step_muon, work[i], shape_times,
                        lane.clock);
  }
  exchange(LaneExchangeStep::kStage2Reverse, &PhaseTimings::a2a_bwd_us);
  exchange(LaneExchangeStep::kStage1Reverse, &PhaseTimings::a2a_bwd_us);
  exchange(LaneExchangeStep::kDpShare, &PhaseTimings::dp_share_us);
  for (size_t i = 0; i < muon.size() && !comm.failed(); ++i) {
    const absl::Status variant = comm.Take(
        RunVariantPhase(*muon[i], muon[i]->step_muon, skip, lane.clock));
    if (own[i].ok()) own[i] = variant;
  }
  absl::Status first = comm.Or(absl::OkStatus());
  first.Update(lane_ns);
  for (const absl::Status& failed : own) first.Update(failed);
  first.Update(exchanged);
  for (GroupState* group : muon) first.Update(DrainMomentumStores(*group));
  return first;
}

std::vector<GroupState*> LayerShardedMuonImpl::GroupsOf(const Lane& lane) {
  std::vector<GroupState*> groups;
  for (int gi : lane.groups) groups.push_back(&groups_[gi]);
  return groups;
}

absl::Status LayerShardedMuonImpl::StartNsBeforeVote() {
  for (Lane& lane : lanes_) {
    RETURN_IF_ERROR(RunLaneNs(GroupsOf(lane), lane.clock,
                              /*shape_times=*/nullptr, " before the job vote"));
  }
  return absl::OkStatus();
}

void LayerShardedMuonImpl::DrainLanes() {
  for (Lane& lane : lanes_) {
    const absl::Status drained = lane.clock.Drain();
    LOG_IF(WARNING, !drained.ok())
        << "waiting for a lane's work at the step's end: " << drained;
  }
}

absl::Status LayerShardedMuonImpl::CheckNsOutputs(const StepInputs& inputs) {
  absl::Status first;
  for (GroupState& group : groups_) {
    if (group.config.algorithm != Algorithm::kMuon) continue;
    first.Update(
        CheckNsOutputsFinite(group, group.step_muon, inputs.skip_params));
  }
  return first;
}

absl::Status LayerShardedMuonImpl::CommitLane(Lane& lane,
                                              const StepInputs& inputs,
                                              PhaseTimings& timings) {
  const std::vector<GroupState*> groups = GroupsOf(lane);
  for (size_t i = 0; i < groups.size();) {
    GroupState& group = *groups[i];
    if (group.config.algorithm != Algorithm::kMuon) {
      RETURN_IF_ERROR(StepAdamWGroup(group, group.step_adamw,
                                     inputs.skip_params, lane.clock));
      ++i;
      continue;
    }
    // Neighbours that commit alike commit as one.
    size_t end = i + 1;
    while (end < groups.size() && CommitsTogether(group, *groups[end])) ++end;
    RETURN_IF_ERROR(
        CommitMuonGroups(absl::MakeConstSpan(groups).subspan(i, end - i),
                         inputs.skip_params, lane.clock));
    i = end;
  }
  // The step's writes are done before it answers; the times of all its
  // phases on this lane (the prepare's too) are known from here.
  return lane.clock.Finish(timings);
}

void LayerShardedMuonImpl::ResolveStepOptions(const StepOverrides& overrides) {
  for (GroupState& group : groups_) {
    const std::string& name = group.config.name;
    if (group.config.algorithm == Algorithm::kMuon) {
      group.step_muon = MuonOptionsForStep(group.config.muon, name, overrides);
    } else {
      group.step_adamw =
          AdamWOptionsForStep(group.config.adamw, name, overrides);
    }
  }
}

}  // namespace muond
