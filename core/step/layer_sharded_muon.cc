// The orchestration of the layer-sharded Muon step: per step, the domain
// agreement of every group, then the lanes, each stepping its groups phase
// by phase (group_step.h). The parts live in files of their own:
//   buffers.h              owned backend memory, the lanes' exchange buffers
//   group_state.h          per-group state, validated and allocated at Create
//   ns_homes_by_version.h  the NS homes each group holds, by plan version
//   domain_agreement.h     the pure per-step agreement over gathered votes
//   gather_domain_votes.h  the all_gather that carries the votes
//   finite_grads.h         this rank's finite-gradient vote
//   plan_buffers.h         the plan of the agreed homes and its views
//   lanes.h                lanes: groups that must run one after the other
//   lane_threads.h         one thread per lane, created with the engine
//   group_step.h           one group's phases (momentum ... update)
//   exchange_stage.h       one all_to_allv stage: pack, exchange, unpack
//   ns_runner.h            Newton–Schulz batched by shape, shape timing
//   state_io.h             ExportState / ImportState
#include "core/step/layer_sharded_muon.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/echo.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/step/domain_agreement.h"
#include "core/step/finite_grads.h"
#include "core/step/gather_domain_votes.h"
#include "core/step/gather_job_ballots.h"
#include "core/step/group_state.h"
#include "core/step/group_step.h"
#include "core/step/job_vote.h"
#include "core/step/lanes.h"
#include "core/step/ns_homes_by_version.h"
#include "core/step/ns_runner.h"
#include "core/step/plan_buffers.h"
#include "core/step/state_io.h"
#include "glog/logging.h"

namespace muond {

namespace {

// The group `name` of an override, or InvalidArgument naming it.
absl::StatusOr<Algorithm> OverriddenGroup(
    const std::string& name, const std::map<std::string, Algorithm>& groups) {
  auto it = groups.find(name);
  if (it == groups.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides: unknown group '", Echo(name), "'"));
  }
  return it->second;
}

// One overridable field: its name, the algorithm it belongs to, its values
// and the bound check (core/muon/bounds.h; null: a bool, nothing to check).
struct OverrideField {
  const char* field;
  std::optional<Algorithm> only;  // nullopt: both algorithms
  const std::map<std::string, double>* values;
  absl::Status (*check)(double, std::string_view);
};

// "overrides: group 'g' lr -1 must be finite, >= 0 and <= 1000".
absl::Status CheckUpTo(double value, double bound, std::string_view what) {
  // !(v >= 0) is true for NaN too.
  if (!(value >= 0) || !(value <= bound)) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), " ", value, " must be finite, >= 0 and <= ", bound));
  }
  return absl::OkStatus();
}
absl::Status CheckLrOverride(double v, std::string_view what) {
  return CheckUpTo(v, kMaxOverrideLr, what);
}
absl::Status CheckWeightDecayOverride(double v, std::string_view what) {
  return CheckUpTo(v, kMaxOverrideWeightDecay, what);
}

absl::Status CheckOverrideField(
    const OverrideField& f, const std::map<std::string, Algorithm>& groups) {
  for (const auto& [name, value] : *f.values) {
    ASSIGN_OR_RETURN(const Algorithm algorithm, OverriddenGroup(name, groups));
    const std::string what =
        absl::StrCat("overrides: group '", Echo(name), "' ", f.field);
    if (f.only.has_value() && *f.only != algorithm) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is ", *f.only == Algorithm::kMuon ? "a Muon" : "an AdamW",
          " hyperparameter; the group is ",
          algorithm == Algorithm::kMuon ? "a Muon" : "an AdamW", " group"));
    }
    RETURN_IF_ERROR(f.check(value, what));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckStepOverrides(
    const StepOverrides& o, const std::map<std::string, Algorithm>& groups) {
  const OverrideField fields[] = {
      {"lr", std::nullopt, &o.lr, CheckLrOverride},
      {"weight_decay", std::nullopt, &o.weight_decay, CheckWeightDecayOverride},
      {"momentum", Algorithm::kMuon, &o.momentum, CheckUnitInterval},
      {"beta1", Algorithm::kAdamW, &o.beta1, CheckUnitInterval},
      {"beta2", Algorithm::kAdamW, &o.beta2, CheckUnitInterval},
      {"eps", Algorithm::kAdamW, &o.eps, CheckPositiveFloat32},
  };
  for (const OverrideField& f : fields) {
    RETURN_IF_ERROR(CheckOverrideField(f, groups));
  }
  // nesterov has no bound, only an algorithm.
  std::map<std::string, double> nesterov;
  for (const auto& [name, on] : o.nesterov) nesterov[name] = on ? 1.0 : 0.0;
  return CheckOverrideField(
      {"nesterov", Algorithm::kMuon, &nesterov,
       [](double, std::string_view) { return absl::OkStatus(); }},
      groups);
}

absl::Status CheckSkipParams(
    const std::set<std::string>& skip,
    const std::function<bool(const std::string&)>& held) {
  for (const std::string& name : skip) {
    if (held(name)) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "skip_params: '", Echo(name),
        "' names no param this daemon holds (a skipped param must be one "
        "registered on this rank); the step was not applied"));
  }
  return absl::OkStatus();
}

namespace {

template <typename T>
void Override(const std::map<std::string, T>& values, const std::string& group,
              T& field) {
  if (auto it = values.find(group); it != values.end()) field = it->second;
}

}  // namespace

MuonOptions MuonOptionsForStep(MuonOptions options, const std::string& group,
                               const StepOverrides& o) {
  Override(o.lr, group, options.lr);
  Override(o.weight_decay, group, options.weight_decay);
  Override(o.momentum, group, options.momentum);
  Override(o.nesterov, group, options.nesterov);
  return options;
}

AdamWOptions AdamWOptionsForStep(AdamWOptions options, const std::string& group,
                                 const StepOverrides& o) {
  Override(o.lr, group, options.lr);
  Override(o.weight_decay, group, options.weight_decay);
  Override(o.beta1, group, options.beta1);
  Override(o.beta2, group, options.beta2);
  Override(o.eps, group, options.eps);
  return options;
}

namespace {

static_assert(LayerShardedMuon::kMaxHomesVersion <= kMaxDomainVoteVersion,
              "every homes version must travel exactly in a DomainVote");

// Phase work of concurrently run lanes adds up; total_us stays wall time.
void AddTimings(const PhaseTimings& from, PhaseTimings& to) {
  to.momentum_us += from.momentum_us;
  to.a2a_fwd_us += from.a2a_fwd_us;
  to.ns_us += from.ns_us;
  to.a2a_bwd_us += from.a2a_bwd_us;
  to.dp_share_us += from.dp_share_us;
  to.update_us += from.update_us;
}

// Collective failures: a transport error or timeout, or a communicator that
// an earlier failure aborted (core/comm/communicator.h).
bool IsCommunicationFailure(const absl::Status& st) {
  return absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st) ||
         absl::IsAborted(st);
}

// A collective of `phase` that timed out: a rank never arrived. Says who
// (`who`), which step and phase and how long this rank waited, keeping the
// code (DeadlineExceeded: the daemon answers PEER_GONE) and the transport's
// text.
absl::Status DidNotJoin(const absl::Status& st, const std::string& who,
                        int64_t step_id, const std::string& phase,
                        absl::Duration waited) {
  if (!absl::IsDeadlineExceeded(st)) return st;
  return absl::DeadlineExceededError(absl::StrFormat(
      "%s did not join step %d within %.0f s (%s): its trainer has not called "
      "Step, or it is hung (%s)",
      who, step_id, absl::ToDoubleSeconds(waited), phase, st.message()));
}

// The peer a timed-out collective of `comm` waited for: known for two ranks.
std::string MissingPeer(const Communicator& comm, const char* of) {
  if (comm.size() == 2)
    return absl::StrCat("rank ", 1 - comm.rank(), " of ", of);
  return absl::StrCat("a rank of ", of, " (", comm.size(), " ranks)");
}

absl::Status NonFiniteError(const std::vector<std::string>& bad) {
  return absl::InvalidArgumentError(absl::StrCat(
      "non-finite gradients (NaN or Inf) in: ", absl::StrJoin(bad, ", "),
      "; the step was not applied"));
}

// What a step does to a group on this rank, as its domain's ranks must agree
// on it (domain_agreement.h): the group's params this rank skips, sorted,
// and the group's hyperparameters for the step, each "<field>=<value>"
// (%.17g: every double exactly).
struct GroupStepSummary {
  std::vector<std::string> skips;
  std::vector<std::string> hyper;
};

GroupStepSummary SummarizeGroupStep(const GroupState& group,
                                    const StepInputs& inputs) {
  GroupStepSummary out;
  for (const ParamBinding& p : group.config.params) {
    if (inputs.skip_params.contains(p.name)) out.skips.push_back(p.name);
  }
  std::sort(out.skips.begin(), out.skips.end());
  auto add = [&](const char* field, double v) {
    // -0.0 and 0.0 are the same hyperparameter: "+ 0.0" turns -0.0 into 0.0
    // so ranks that differ only there agree.
    out.hyper.push_back(absl::StrFormat("%s=%.17g", field, v + 0.0));
  };
  const std::string& name = group.config.name;
  if (group.config.algorithm == Algorithm::kMuon) {
    const MuonOptions o =
        MuonOptionsForStep(group.config.muon, name, inputs.overrides);
    add("lr", o.lr);
    add("weight_decay", o.weight_decay);
    add("momentum", o.momentum);
    out.hyper.push_back(o.nesterov ? "nesterov=true" : "nesterov=false");
  } else {
    const AdamWOptions o =
        AdamWOptionsForStep(group.config.adamw, name, inputs.overrides);
    add("lr", o.lr);
    add("weight_decay", o.weight_decay);
    add("beta1", o.beta1);
    add("beta2", o.beta2);
    add("eps", o.eps);
  }
  return out;
}

std::vector<std::string> EchoAll(const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const std::string& n : names)
    out.push_back(absl::StrCat("'", Echo(n), "'"));
  return out;
}

class LayerShardedMuonImpl final : public LayerShardedMuon {
 public:
  LayerShardedMuonImpl(Backend* backend, StepOptions options)
      : backend_(backend), options_(options) {}

  absl::Status Init(std::vector<GroupConfig> groups);
  using LayerShardedMuon::SetHomes;
  absl::Status SetHomes(const std::string& group, std::vector<NsHome> homes,
                        int64_t version) override;
  absl::StatusOr<StepResult> RunStep(const StepInputs& inputs) override;
  absl::StatusOr<std::map<std::string, std::vector<float>>> ExportState()
      const override;
  absl::Status ImportState(
      const std::map<std::string, std::vector<float>>& state) override;
  int64_t state_bytes() const override { return state_bytes_; }
  int64_t peak_transient_bytes() const override {
    return transient_bytes_ + staging_bytes_;
  }

 private:
  // Lanes, their vote scratch and (when lanes run concurrently) threads.
  absl::Status SetUpLanes();
  // Before anything changes: agrees across each group's domain on whether
  // every gradient is finite and on the NS homes version, and makes that
  // version's plan the group's. Returns the names of non-finite gradients
  // (empty: step).
  // The domains also agree on what the step does to each group (its skipped
  // params and hyperparameters, from `inputs`).
  absl::StatusOr<std::vector<std::string>> AgreeAcrossDomains(
      const StepInputs& inputs, StepResult& result, bool read_grads);
  // Routes `group` by the homes of `version` (0: round-robin fallback),
  // building its plan unless it is the one in use.
  absl::Status UseHomesVersion(GroupState& group, int64_t version);
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
  // The ballot of a replay (StepInputs::replay): kReplay, or a refusal when
  // the domain agreements it runs for its peers fail to communicate.
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
  // Up to the commit: the Muon groups of one lane, in registration order.
  absl::Status PrepareLane(Lane& lane, const StepInputs& inputs,
                           ShapeTimes* shape_times, PhaseTimings& timings);
  // After the exchanges, before the commit vote: the Muon groups' local
  // updates are finite (CheckNsOutputsFinite; custom coefficients only).
  absl::Status CheckNsOutputs(const StepInputs& inputs);
  // After the commit vote: every group of one lane writes its update.
  absl::Status CommitLane(Lane& lane, const StepInputs& inputs,
                          PhaseTimings& timings);
  // Every piece of state, in the order ExportState/ImportState name them.
  std::vector<StateEntry> StateEntries() const;

  Backend* backend_;
  StepOptions options_;
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

absl::Status LayerShardedMuonImpl::Init(std::vector<GroupConfig> groups) {
  std::map<std::string, int> names;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!names.emplace(groups[i].name, int(i)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate param group name '", groups[i].name, "'"));
    }
    ASSIGN_OR_RETURN(GroupState group,
                     CreateGroupState(std::move(groups[i]), backend_));
    state_bytes_ += group.state_bytes;
    staging_bytes_ += group.staging_bytes;
    group_algorithms_[group.config.name] = group.config.algorithm;
    for (const ParamBinding& p : group.config.params) {
      param_names_.insert(p.name);
    }
    groups_.push_back(std::move(group));
  }
  return SetUpLanes();
}

absl::Status LayerShardedMuonImpl::SetUpLanes() {
  lanes_ = AssignLanes(groups_);
  // The agreement gathers one vote per rank of the largest communicator of
  // the lane, after the rank's own.
  for (Lane& lane : lanes_) {
    int64_t most = 1;
    for (int g : lane.groups) {
      const DomainBinding& d = groups_[g].config.domain;
      for (Communicator* c : {d.gtp, d.tp, d.dp}) {
        if (c != nullptr) most = std::max<int64_t>(most, c->size());
      }
    }
    ASSIGN_OR_RETURN(lane.vote_scratch,
                     AllocateZeroed(lane.backend, DType::kFloat32, 1,
                                    DomainVoteScratchFloats(most)));
  }
  if (lanes_.size() > 1 && options_.concurrent_groups) {
    ASSIGN_OR_RETURN(lane_threads_, LaneThreads::Create(int(lanes_.size())));
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::SetHomes(const std::string& name,
                                            std::vector<NsHome> homes,
                                            int64_t version) {
  auto it =
      std::find_if(groups_.begin(), groups_.end(),
                   [&](const GroupState& g) { return g.config.name == name; });
  if (it == groups_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no param group named '", name, "'"));
  }
  GroupState& group = *it;
  if (group.config.algorithm != Algorithm::kMuon) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", name, "' is an AdamW group: it has no NS homes"));
  }
  if (version == kNextHomesVersion) version = group.homes.newest() + 1;
  if (version < 1 || version > kMaxHomesVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", name, "': homes version ", version,
                     " must be in [1, ", kMaxHomesVersion, "]"));
  }
  // Validate now, so bad homes are refused here and not at a later step.
  const DomainBinding& d = group.config.domain;
  RETURN_IF_ERROR(
      BuildGroupExchangePlan(ParamSpecs(group), homes, d.size, d.g, d.t, d.d)
          .status());
  return WithContext(group.homes.Put(version, std::move(homes)),
                     absl::StrCat("group '", name, "': "));
}

absl::StatusOr<std::vector<std::string>>
LayerShardedMuonImpl::AgreeAcrossDomains(const StepInputs& inputs,
                                         StepResult& result, bool read_grads) {
  std::vector<std::string> bad;
  // A group that cannot step fails the step only after every group's
  // agreement, so all ranks run the same collectives whatever they decide:
  // an error in one group (even a communicator's) must not skip the
  // agreements of the groups after it, whose peers would wait for them.
  absl::Status refused;
  for (GroupState& group : groups_) {
    DomainVote mine;
    // A rank whose registered memory failed its check (RefusalCode::kMemory:
    // a shrunk shm object would raise SIGBUS) reads no grad; it still takes
    // part in the collectives and refuses through the job vote.
    absl::StatusOr<bool> finite =
        read_grads ? GradsWithinLimit(group) : absl::StatusOr<bool>(true);
    if (!finite.ok() && refused.ok()) refused = finite.status();
    mine.all_finite = finite.value_or(false);
    mine.homes_version = group.homes.newest();
    mine.oldest_held = group.homes.oldest();
    const GroupStepSummary summary = SummarizeGroupStep(group, inputs);
    mine.skip_min = mine.skip_max = StepFingerprint(summary.skips);
    mine.hyper_min = mine.hyper_max = StepFingerprint(summary.hyper);
    std::vector<std::string> local_bad;
    if (finite.ok() && !mine.all_finite) {
      absl::StatusOr<std::vector<std::string>> names = BadGradNames(group);
      if (!names.ok() && refused.ok()) refused = names.status();
      local_bad = names.value_or(std::vector<std::string>{group.config.name});
    }
    float* scratch =
        static_cast<float*>(lanes_[group.lane].vote_scratch.data());
    const absl::Time asked = absl::Now();
    absl::StatusOr<DomainVote> agreed =
        GatherDomainVotes(*group.backend, group.config.domain, scratch, mine);
    if (absl::IsDeadlineExceeded(agreed.status())) {
      // A rank of the domain never arrived. Waiting on in the next groups'
      // agreements and in the job vote would cost one more comm timeout
      // each; the step is lost anyway (that rank cannot vote).
      return AbandonStep(DidNotJoin(
          agreed.status(), "a peer rank of the domain", inputs.step_id,
          absl::StrCat("the domain agreement of group '", group.config.name,
                       "'"),
          absl::Now() - asked));
    }
    if (!agreed.ok()) {
      if (refused.ok()) refused = agreed.status();
      continue;
    }
    // A non-finite gradient on another rank of the domain is that rank's to
    // report: it refuses (or skips) in the job vote, and this rank's answer
    // then names it, instead of a refusal of its own that names nobody.
    bad.insert(bad.end(), local_bad.begin(), local_bad.end());
    if (refused.ok()) {
      refused = CheckStepAgreed(*agreed, group.config.name,
                                EchoAll(summary.skips), summary.hyper);
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
  Lane& lane = lanes_[group.lane];
  const int64_t elem = int64_t(DTypeSize(group.ns_dtype));
  RETURN_IF_ERROR(lane.exchange.Reserve(lane.backend,
                                        plan.plan.max_send_elems * elem,
                                        plan.plan.max_recv_elems * elem));
  transient_bytes_ = std::max(transient_bytes_, plan.assembled_bytes +
                                                    lane.exchange.send_bytes() +
                                                    lane.exchange.recv_bytes());
  group.plan = std::move(plan);
  group.plan_version = version;
  return absl::OkStatus();
}

bool LayerShardedMuonImpl::MeasuresShapes() const {
  // Host backends are measured every step (no extra sync); device backends
  // every ns_shape_timing_every-th step.
  const int every = options_.ns_shape_timing_every;
  return every > 0 &&
         (std::none_of(lanes_.begin(), lanes_.end(),
                       [](const Lane& l) { return l.backend->is_device(); }) ||
          steps_run_ % every == 0);
}

JobBallot LayerShardedMuonImpl::LocalBallot(const StepInputs& inputs,
                                            StepResult& result,
                                            std::vector<std::string>& bad,
                                            absl::Status& refusal) {
  JobBallot mine{.kind = BallotKind::kStep, .step_id = inputs.step_id};
  if (inputs.replay) return ReplayBallot(inputs, result, refusal);
  auto refuse = [&](absl::Status st, RefusalCode code) {
    if (st.ok() || !refusal.ok()) return;
    refusal = std::move(st);
    mine.verdict = JobVerdict::kRefuse;
    mine.code = code;
  };
  refuse(inputs.refusal, inputs.refusal_code == RefusalCode::kNone
                             ? RefusalCode::kOther
                             : inputs.refusal_code);
  refuse(CheckStepOverrides(inputs.overrides, group_algorithms_),
         RefusalCode::kOverrides);
  refuse(CheckSkipParams(inputs.skip_params,
                         [&](const std::string& name) {
                           return param_names_.contains(name);
                         }),
         RefusalCode::kSkipParams);
  // Always run: the domain agreements are collectives of their own.
  absl::StatusOr<std::vector<std::string>> agreed = AgreeAcrossDomains(
      inputs, result, inputs.refusal_code != RefusalCode::kMemory);
  if (!agreed.ok()) {
    refuse(agreed.status(), IsCommunicationFailure(agreed.status())
                                ? RefusalCode::kCommunication
                            : absl::IsFailedPrecondition(agreed.status())
                                ? RefusalCode::kPlanVersion
                            // The agreements' one InvalidArgument:
                            // CheckStepAgreed.
                            : absl::IsInvalidArgument(agreed.status())
                                ? RefusalCode::kDomainDisagreement
                                : RefusalCode::kOther);
    return mine;
  }
  bad = *std::move(agreed);
  if (bad.empty() || !refusal.ok()) return mine;
  if (options_.skip_nonfinite) {
    mine.verdict = JobVerdict::kSkip;
  } else {
    refuse(NonFiniteError(bad), RefusalCode::kNonFinite);
  }
  return mine;
}

JobBallot LayerShardedMuonImpl::ReplayBallot(const StepInputs& inputs,
                                             StepResult& result,
                                             absl::Status& refusal) {
  JobBallot mine{.kind = BallotKind::kStep,
                 .step_id = inputs.step_id,
                 .verdict = JobVerdict::kReplay};
  // Only for the collectives: peers that do step this id wait in the domain
  // agreements for this rank. No grad is read (nothing is stepped here).
  absl::StatusOr<std::vector<std::string>> agreed =
      AgreeAcrossDomains(inputs, result, /*read_grads=*/false);
  if (!agreed.ok() && IsCommunicationFailure(agreed.status())) {
    refusal = agreed.status();
    mine.verdict = JobVerdict::kRefuse;
    mine.code = RefusalCode::kCommunication;
  }
  return mine;
}

absl::StatusOr<JobDecision> LayerShardedMuonImpl::VoteOnJob(
    const JobBallot& mine) {
  const absl::Time asked = absl::Now();
  absl::StatusOr<std::vector<JobBallot>> ballots =
      GatherJobBallots(options_.job, mine);
  if (absl::IsDeadlineExceeded(ballots.status())) {
    return AbandonStep(DidNotJoin(
        ballots.status(), MissingPeer(*options_.job, "the job"), mine.step_id,
        mine.kind == BallotKind::kCommit
            ? "the commit vote, after the exchanges"
            : "the job vote",
        absl::Now() - asked));
  }
  if (!ballots.ok()) return ballots.status();
  return FoldJobBallots(*ballots);
}

absl::Status LayerShardedMuonImpl::AbandonStep(absl::Status timeout) {
  abandoned_ = timeout;
  if (options_.job != nullptr) options_.job->Abort();
  for (GroupState& group : groups_) {
    const DomainBinding& d = group.config.domain;
    for (Communicator* comm : {d.gtp, d.tp, d.dp}) {
      if (comm != nullptr) comm->Abort();
    }
  }
  return timeout;
}

absl::StatusOr<StepResult> LayerShardedMuonImpl::RunStep(
    const StepInputs& inputs) {
  const absl::Time start = absl::Now();
  StepResult result;
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
  const JobBallot mine = LocalBallot(inputs, result, bad, refusal);
  // A rank of a domain never arrived: one comm timeout is all the step
  // costs (the job vote would wait a second one for the same rank).
  if (!abandoned_.ok()) return abandoned_;
  // 2. The job decides together.
  absl::StatusOr<JobDecision> decision = VoteOnJob(mine);
  // Timed out: the communicators are gone, whatever this rank refused.
  if (!abandoned_.ok()) return abandoned_;
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
  // 3. Momentum into staging, exchanges, NS: nothing of the state yet.
  ShapeTimes* shape_times = MeasuresShapes() ? &shape_times_ : nullptr;
  ++steps_run_;
  shape_times_.Clear();
  const absl::Status prepared = RunLanes(
      [&](Lane& lane, PhaseTimings& t) {
        return PrepareLane(lane, inputs, shape_times, t);
      },
      result.timings);
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
  if (!prepared.ok()) return prepared;
  if (!ns_finite.ok()) return ns_finite;  // mine, with the params named
  if (!committed.ok()) return committed.status();
  if (committed->verdict != JobVerdict::kAgree) {
    return absl::UnavailableError(
        absl::StrCat("step ", inputs.step_id, " was not applied on any rank: ",
                     DescribeRefusals(*committed), " in its exchanges"));
  }
  // 5. The commit: local writes only.
  RETURN_IF_ERROR(RunLanes(
      [&](Lane& lane, PhaseTimings& t) { return CommitLane(lane, inputs, t); },
      result.timings));
  result.ns_shapes = shape_times_.ByShape();
  result.timings.total_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  return result;
}

absl::Status LayerShardedMuonImpl::RunLanes(
    const std::function<absl::Status(Lane&, PhaseTimings&)>& fn,
    PhaseTimings& timings) {
  if (lane_threads_ == nullptr) {
    absl::Status first;
    // Every lane runs even after one failed: a lane's collectives are
    // awaited by peers that do not know this rank failed elsewhere.
    for (Lane& lane : lanes_) first.Update(fn(lane, timings));
    return first;
  }
  std::vector<PhaseTimings> lane_timings(lanes_.size());
  std::vector<absl::Status> lane_status(lanes_.size());
  lane_threads_->Run(
      [&](int l) { lane_status[l] = fn(lanes_[l], lane_timings[l]); });
  absl::Status first;
  for (size_t l = 0; l < lanes_.size(); ++l) {
    first.Update(lane_status[l]);
    AddTimings(lane_timings[l], timings);
  }
  return first;
}

absl::Status LayerShardedMuonImpl::PrepareLane(Lane& lane,
                                               const StepInputs& inputs,
                                               ShapeTimes* shape_times,
                                               PhaseTimings& timings) {
  for (int gi : lane.groups) {
    GroupState& group = groups_[gi];
    if (group.config.algorithm != Algorithm::kMuon) continue;
    RETURN_IF_ERROR(PrepareMuonGroup(
        group,
        MuonOptionsForStep(group.config.muon, group.config.name,
                           inputs.overrides),
        inputs.skip_params, lane.exchange, shape_times, timings));
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::CheckNsOutputs(const StepInputs& inputs) {
  absl::Status first;
  for (GroupState& group : groups_) {
    if (group.config.algorithm != Algorithm::kMuon) continue;
    first.Update(CheckNsOutputsFinite(
        group,
        MuonOptionsForStep(group.config.muon, group.config.name,
                           inputs.overrides),
        inputs.skip_params));
  }
  return first;
}

absl::Status LayerShardedMuonImpl::CommitLane(Lane& lane,
                                              const StepInputs& inputs,
                                              PhaseTimings& timings) {
  for (int gi : lane.groups) {
    GroupState& group = groups_[gi];
    const std::string& name = group.config.name;
    if (group.config.algorithm == Algorithm::kMuon) {
      RETURN_IF_ERROR(CommitMuonGroup(
          group, MuonOptionsForStep(group.config.muon, name, inputs.overrides),
          inputs.skip_params, timings));
    } else {
      RETURN_IF_ERROR(StepAdamWGroup(
          group,
          AdamWOptionsForStep(group.config.adamw, name, inputs.overrides),
          inputs.skip_params, timings));
    }
  }
  return absl::OkStatus();
}

std::vector<StateEntry> LayerShardedMuonImpl::StateEntries() const {
  std::vector<StateEntry> entries;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const GroupState& group = groups_[gi];
    const std::string& gname = group.config.name;
    const bool muon = group.config.algorithm == Algorithm::kMuon;
    for (size_t pi = 0; pi < group.params.size(); ++pi) {
      const ParamState& p = group.params[pi];
      const std::string base = gname + "/" + p.spec.name;
      auto tensor = [&](const std::string& suffix, const MatrixView& view) {
        StateEntry e;
        e.key = base + suffix;
        e.backend = group.backend;
        e.tensor = view;
        entries.push_back(std::move(e));
      };
      if (muon) {
        tensor(".momentum", p.momentum);
        continue;
      }
      tensor(".exp_avg", p.exp_avg);
      tensor(".exp_avg_sq", p.exp_avg_sq);
      StateEntry count;
      count.key = base + ".step";
      count.count = p.adamw_step;
      count.group = gname;
      count.param = p.spec.name;
      count.group_index = int(gi);
      count.param_index = int(pi);
      entries.push_back(std::move(count));
    }
  }
  return entries;
}

absl::StatusOr<std::map<std::string, std::vector<float>>>
LayerShardedMuonImpl::ExportState() const {
  return ExportStateEntries(StateEntries());
}

absl::Status LayerShardedMuonImpl::ImportState(
    const std::map<std::string, std::vector<float>>& state) {
  const std::vector<StateEntry> entries = StateEntries();
  std::vector<Backend*> lane_backends;
  for (const Lane& lane : lanes_) lane_backends.push_back(lane.backend);
  // Count entries are the AdamW params' step counts, "<group>/<param>.step".
  return ImportStateEntries(WithPerParamStepCounts(state, entries), entries,
                            lane_backends, [&](size_t i, int64_t count) {
                              groups_[entries[i].group_index]
                                  .params[entries[i].param_index]
                                  .adamw_step = count;
                            });
}

}  // namespace

absl::StatusOr<std::unique_ptr<LayerShardedMuon>> LayerShardedMuon::Create(
    Backend* backend, std::vector<GroupConfig> groups, StepOptions options) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError("LayerShardedMuon needs a backend");
  }
  auto impl = std::make_unique<LayerShardedMuonImpl>(backend, options);
  RETURN_IF_ERROR(impl->Init(std::move(groups)));
  return std::unique_ptr<LayerShardedMuon>(std::move(impl));
}

}  // namespace muond
