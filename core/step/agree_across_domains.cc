// The per-step agreement of every group's domain (finite gradients, the NS
// homes version, what the step does to the group, that replicas hold the
// same gradients) and the plan of the agreed homes.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/status_macros.h"
#include "core/step/domain_agreement.h"
#include "core/step/finite_grads.h"
#include "core/step/gather_domain_votes.h"
#include "core/step/grad_fingerprint.h"
#include "core/step/group_step.h"
#include "core/step/group_step_summary.h"
#include "core/step/lane_exchanges.h"
#include "core/step/layer_sharded_muon_impl.h"
#include "core/step/plan_buffers.h"
#include "core/step/step_failures.h"
#include "glog/logging.h"

namespace muond {
namespace {

// This rank's "every grad of the group within GradLimit" finding for every
// group (index as the engine's groups). On a device each group writes a
// check slot of its backend, and one TakeGradChecks per backend (per
// grad_check_slots() groups) takes them all, so a thousand groups wait
// once, not once each: where the group ChecksGradsInMomentum and the step's
// local checks passed (`momentum_now`), the momentum kernels check the
// grads in their pass; elsewhere (AdamW, host momentum) a check of its own
// (Backend::CheckGradsInto). On the host, or where the call failed, by a
// read of its own.
class LocalGradFindings {
 public:
  LocalGradFindings(std::vector<GroupState>& groups, const StepInputs& inputs,
                    StepResult& result)
      : groups_(groups),
        inputs_(inputs),
        result_(result),
        findings_(groups.size(), true) {}

  std::vector<absl::StatusOr<bool>> Take(bool momentum_now) && {
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      GroupState& group = groups_[gi];
      const bool in_momentum = momentum_now && ChecksGradsInMomentum(group);
      if (!in_momentum && !group.backend->is_device()) {
        findings_[gi] = GradsWithinLimit(group, inputs_.skip_params);
        continue;
      }
      Pending& pending = pending_[group.backend];
      if (int(pending.entries.size()) == group.backend->grad_check_slots()) {
        TakeSlots(*group.backend, pending);
      }
      const int slot = int(pending.entries.size());
      const absl::Time start = absl::Now();
      const absl::Status issued =
          in_momentum ? MomentumWithGradCheck(group, group.step_muon,
                                              inputs_.skip_params,
                                              {GradLimit(group), slot})
                      : group.backend->CheckGradsInto(
                            GradsToCheck(group, inputs_.skip_params),
                            GradLimit(group), slot);
      if (in_momentum) {
        result_.timings.momentum_us +=
            absl::ToDoubleMicroseconds(absl::Now() - start);
      }
      // A failed call keeps its slot, which it may have written to part of
      // the way; its finding is not taken from it.
      pending.entries.push_back({gi, in_momentum});
      if (!issued.ok()) {
        pending.failed.insert(gi);
        ReadOwnInstead(
            gi, in_momentum ? "the momentum phase" : "the grad check", issued);
      }
    }
    for (auto& [backend, pending] : pending_) TakeSlots(*backend, pending);
    return std::move(findings_);
  }

 private:
  struct Entry {
    size_t group;
    bool in_momentum;  // MomentumWithGradCheck's, not CheckGradsInto's
  };
  struct Pending {
    std::vector<Entry> entries;  // by slot
    std::set<size_t> failed;
  };

  // The momentum phase's own failure is the step's, as it was where the
  // phase runs after the vote: the check reads the grads itself, and
  // the prepare runs the phase again and refuses in the commit vote.
  void ReadOwnInstead(size_t gi, const char* what, const absl::Status& why) {
    GroupState& group = groups_[gi];
    LOG(WARNING) << "group '" << group.config.name << "': " << what
                 << " in the domain agreement failed (" << why
                 << "); checking the grads by a read of their own";
    findings_[gi] = GradsWithinLimit(group, inputs_.skip_params);
  }

  // Takes the findings of `pending`'s slots (one wait) and frees them.
  void TakeSlots(Backend& backend, Pending& pending) {
    if (pending.entries.empty()) return;
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<bool>> within =
        backend.TakeGradChecks(int(pending.entries.size()));
    // The wait is the momentum kernels' where some ran (checks of their own
    // alone are no phase's).
    if (std::any_of(pending.entries.begin(), pending.entries.end(),
                    [](const Entry& e) { return e.in_momentum; })) {
      result_.timings.momentum_us +=
          absl::ToDoubleMicroseconds(absl::Now() - start);
    }
    for (size_t slot = 0; slot < pending.entries.size(); ++slot) {
      const Entry& entry = pending.entries[slot];
      if (pending.failed.contains(entry.group)) continue;
      if (!within.ok()) {
        ReadOwnInstead(entry.group, "reading the grad checks", within.status());
        continue;
      }
      findings_[entry.group] = bool((*within)[slot]);
      if (entry.in_momentum) groups_[entry.group].momentum_ready = true;
    }
    pending = {};
  }

  std::vector<GroupState>& groups_;
  const StepInputs& inputs_;
  StepResult& result_;
  std::vector<absl::StatusOr<bool>> findings_;
  std::map<Backend*, Pending> pending_;
};

// This rank's side of every group's agreement.
struct RankVotes {
  std::vector<GroupVote> votes;
  std::vector<GroupStepSummary> summaries;
  // The group's params whose grads broke GradLimit here.
  std::vector<std::vector<std::string>> local_bad;
};

// This rank's vote in every group's agreement from its grad `findings`;
// `refused` gets the first failure to form one. A Muon group's vote also
// carries the engine's `exchange_batch_bytes`: ranks that cut a lane's
// exchanges at different sizes would run different collectives (Gloo
// aborts the process on the mismatched sizes).
RankVotes CastVotes(std::vector<GroupState>& groups,
                    const std::vector<Lane>& lanes, const StepInputs& inputs,
                    const std::vector<absl::StatusOr<bool>>& findings,
                    bool read_grads, int64_t exchange_batch_bytes,
                    absl::Status& refused) {
  RankVotes out;
  const std::string batch_entry =
      absl::StrCat("exchange_batch_bytes=", exchange_batch_bytes);
  out.votes.resize(groups.size());
  out.local_bad.resize(groups.size());
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    GroupState& group = groups[gi];
    DomainVote& mine = out.votes[gi].vote;
    const absl::StatusOr<bool>& finite = findings[gi];
    if (!finite.ok() && refused.ok()) refused = finite.status();
    mine.all_finite = finite.value_or(false);
    mine.homes_version = group.homes.newest();
    mine.oldest_held = group.homes.oldest();
    GroupStepSummary& summary =
        out.summaries.emplace_back(SummarizeGroupStep(group, inputs));
    if (group.config.algorithm == Algorithm::kMuon) {
      summary.hyper.push_back(batch_entry);
    }
    mine.skip_min = mine.skip_max = StepFingerprint(summary.skips);
    mine.hyper_min = mine.hyper_max = StepFingerprint(summary.hyper);
    if (read_grads) mine.grads = GradFingerprint(group, inputs.skip_params);
    if (finite.ok() && !mine.all_finite) {
      absl::StatusOr<std::vector<std::string>> names =
          BadGradNames(group, inputs.skip_params);
      if (!names.ok() && refused.ok()) refused = names.status();
      out.local_bad[gi] =
          names.value_or(std::vector<std::string>{group.config.name});
    }
    GroupVote& vote = out.votes[gi];
    vote.backend = group.backend;
    vote.dp = group.config.domain.dp;
    vote.gtp = group.config.domain.gtp;
    vote.tp = group.config.domain.tp;
    vote.scratch = static_cast<float*>(lanes[group.lane].vote_scratch.data());
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::string>>
LayerShardedMuonImpl::AgreeAcrossDomains(const StepInputs& inputs,
                                         StepResult& result, bool read_grads,
                                         bool momentum_now) {
  std::vector<std::string> bad;
  // A group that cannot step fails the step only after every group's
  // agreement, so all ranks run the same collectives whatever they decide:
  // an error in one group (even a communicator's) must not skip the
  // agreements of the groups after it, whose peers would wait for them.
  absl::Status refused;
  // A step that stopped after them left them set.
  for (GroupState& group : groups_) {
    group.momentum_ready = false;
    group.ns_done = false;
  }
  // A rank whose registered memory failed its check (RefusalCode::kMemory:
  // a shrunk shm object would raise SIGBUS) reads no grad; it still takes
  // part in the collectives and refuses through the job vote.
  std::vector<absl::StatusOr<bool>> findings =
      read_grads ? LocalGradFindings(groups_, inputs, result).Take(momentum_now)
                 : std::vector<absl::StatusOr<bool>>(groups_.size(), true);
  RankVotes mine = CastVotes(groups_, lanes_, inputs, findings, read_grads,
                             options_.exchange_batch_bytes, refused);
  std::vector<GroupVote>& votes = mine.votes;
  const absl::Time asked = absl::Now();
  size_t timed_out = 0;
  const absl::Status gathered =
      GatherDomainVotesOfGroups(absl::MakeSpan(votes), &timed_out);
  if (absl::IsDeadlineExceeded(gathered)) {
    // A rank of the domain never arrived. Waiting on in the next
    // agreements and in the job vote would cost one more comm timeout each;
    // the step is lost anyway (that rank cannot vote).
    return AbandonStep(
        DidNotJoin(gathered, "a peer rank of the domain", inputs.step_id,
                   absl::StrCat("the domain agreement of group '",
                                groups_[timed_out].config.name, "'"),
                   absl::Now() - asked));
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    GroupState& group = groups_[gi];
    const GroupVote& vote = votes[gi];
    if (!vote.status.ok()) {
      if (refused.ok()) refused = vote.status;
      continue;
    }
    const DomainVote* agreed = &vote.vote;
    const GroupStepSummary& summary = mine.summaries[gi];
    // A non-finite gradient on another rank of the domain is that rank's to
    // report: it refuses (or skips) in the job vote, and this rank's answer
    // then names it, instead of a refusal of its own that names nobody.
    bad.insert(bad.end(), mine.local_bad[gi].begin(), mine.local_bad[gi].end());
    if (refused.ok()) {
      refused = CheckStepAgreed(*agreed, group.config.name,
                                EchoAll(summary.skips), summary.hyper);
    }
    if (refused.ok()) {
      const DomainBinding& d = group.config.domain;
      refused = CheckReplicaGradsAgreed(*agreed, group.config.name, d.g, d.t,
                                        vote.replica_grads);
    }
    if (group.config.algorithm != Algorithm::kMuon || !refused.ok()) continue;
    // Every rank sees the same gathered votes, so every rank of the domain
    // refuses alike (a rank failing alone would leave its peers waiting in
    // the exchange for the communicator timeout).
    refused = CheckHomesVersionHeld(*agreed, group.config.name,
                                    NsHomesByVersion::kCapacity);
    if (!refused.ok()) continue;
    refused = UseHomesVersion(group, agreed->homes_version);
    result.homes_versions[group.config.name] = agreed->homes_version;
  }
  // Before the job vote, so a rank that cannot hold its batched exchanges
  // refuses with every rank instead of leaving its peers in them.
  for (Lane& lane : lanes_) {
    if (refused.ok()) refused = ReserveLaneExchanges(lane);
  }
  RETURN_IF_ERROR(refused);
  return bad;
}

absl::StatusOr<std::vector<NsHome>> LayerShardedMuonImpl::HomesOf(
    const GroupState& group, int64_t version) const {
  if (version == 0) {
    // Homes were never set: round-robin fallback, loudly (planner logs it).
    LOG(WARNING) << "group '" << group.config.name
                 << "': no NS homes were set; using the round-robin fallback "
                    "(LPT balancing NOT in effect)";
    return RoundRobinHomes(ParamSpecs(group), group.config.domain.size).homes;
  }
  const std::vector<NsHome>* homes = group.homes.Find(version);
  if (homes == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", group.config.name,
                     "': the domain agreed on the NS homes of plan version ",
                     version, ", which this rank does not hold (it holds ",
                     group.homes.size(), " versions, newest ",
                     group.homes.newest(), "); the step was not applied"));
  }
  return *homes;
}

absl::Status LayerShardedMuonImpl::UseHomesVersion(GroupState& group,
                                                   int64_t version) {
  if (group.plan_version == version && group.plan.has_value()) {
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::vector<NsHome> homes, HomesOf(group, version));
  // Everything is allocated before the group's plan is replaced: a failure
  // leaves the old plan in place.
  ASSIGN_OR_RETURN(
      PlanBuffers plan,
      BuildPlanBuffers(group.backend, group.ns_dtype, ParamSpecs(group),
                       std::move(homes), group.config.domain, group.local));
  group.plan = std::move(plan);
  group.plan_version = version;
  lanes_[group.lane].exchanges_reserved = false;
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::ReserveLaneExchanges(Lane& lane) {
  // Plans change rarely; their batches are worked out again only then.
  if (lane.exchanges_reserved) return absl::OkStatus();
  const std::vector<GroupState*> groups = GroupsOf(lane);
  const ExchangeBytes need =
      LaneExchangeBytes(groups, options_.exchange_batch_bytes);
  RETURN_IF_ERROR(lane.exchange.Reserve(lane.backend, need.send, need.recv));
  // The lane's groups keep their assembled matrices all at once: the
  // exchanges run phase by phase across them.
  int64_t assembled = 0;
  for (const GroupState* group : groups) {
    if (group->plan.has_value()) assembled += group->plan->assembled_bytes;
  }
  transient_bytes_ =
      std::max(transient_bytes_, assembled + lane.exchange.send_bytes() +
                                     lane.exchange.recv_bytes());
  lane.exchanges_reserved = true;
  return absl::OkStatus();
}

}  // namespace muond
