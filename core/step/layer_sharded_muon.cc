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
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/step/domain_agreement.h"
#include "core/step/finite_grads.h"
#include "core/step/gather_domain_votes.h"
#include "core/step/group_state.h"
#include "core/step/group_step.h"
#include "core/step/lanes.h"
#include "core/step/ns_homes_by_version.h"
#include "core/step/ns_runner.h"
#include "core/step/plan_buffers.h"
#include "core/step/state_io.h"
#include "glog/logging.h"

namespace muond {
namespace {

static_assert(LayerShardedMuon::kMaxHomesVersion <= kMaxDomainVoteVersion,
              "every homes version must travel exactly in a DomainVote");

// Phase work of concurrently run lanes adds up; total_us stays wall time.
void AddTimings(const PhaseTimings& from, PhaseTimings& to) {
  to.momentum_us += from.momentum_us;
  to.a2a_fwd_us += from.a2a_fwd_us;
  to.ns_us += from.ns_us;
  to.a2a_bwd_us += from.a2a_bwd_us;
  to.update_us += from.update_us;
}

absl::Status CheckOverrides(const StepOverrides& overrides,
                            const std::vector<GroupState>& groups) {
  for (const auto* m : {&overrides.lr, &overrides.weight_decay}) {
    for (const auto& [name, value] : *m) {
      if (std::none_of(groups.begin(), groups.end(), [&](const GroupState& g) {
            return g.config.name == name;
          })) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step override names unknown param group '", name, "'"));
      }
      if (!(value >= 0) || value > 1e30) {
        return absl::InvalidArgumentError(
            absl::StrCat("step override for group '", name,
                         "' must be finite and >= 0, got ", value));
      }
    }
  }
  return absl::OkStatus();
}

// The group's options with this step's overrides applied.
template <typename Options>
Options WithOverrides(Options options, const std::string& group,
                      const StepOverrides& overrides) {
  if (auto it = overrides.lr.find(group); it != overrides.lr.end()) {
    options.lr = it->second;
  }
  if (auto it = overrides.weight_decay.find(group);
      it != overrides.weight_decay.end()) {
    options.weight_decay = it->second;
  }
  return options;
}

class LayerShardedMuonImpl final : public LayerShardedMuon {
 public:
  LayerShardedMuonImpl(Backend* backend, StepOptions options)
      : backend_(backend), options_(options) {}

  absl::Status Init(std::vector<GroupConfig> groups);
  using LayerShardedMuon::SetHomes;
  absl::Status SetHomes(const std::string& group, std::vector<NsHome> homes,
                        int64_t version) override;
  absl::StatusOr<StepResult> Step(const StepOverrides& overrides) override;
  absl::StatusOr<std::map<std::string, std::vector<float>>> ExportState()
      const override;
  absl::Status ImportState(
      const std::map<std::string, std::vector<float>>& state) override;
  int64_t state_bytes() const override { return state_bytes_; }
  int64_t peak_transient_bytes() const override { return transient_bytes_; }

 private:
  // Lanes, their vote scratch and (when lanes run concurrently) threads.
  absl::Status SetUpLanes();
  // Before anything changes: agrees across each group's domain on whether
  // every gradient is finite and on the NS homes version, and makes that
  // version's plan the group's. Returns the names of non-finite gradients
  // (empty: step).
  absl::StatusOr<std::vector<std::string>> AgreeAcrossDomains(
      StepResult& result);
  // Routes `group` by the homes of `version` (0: round-robin fallback),
  // building its plan unless it is the one in use.
  absl::Status UseHomesVersion(GroupState& group, int64_t version);
  // The homes of `version` as this rank holds them.
  absl::StatusOr<std::vector<NsHome>> HomesOf(const GroupState& group,
                                              int64_t version) const;
  // Whether this step measures per-shape NS times.
  bool MeasuresShapes() const;
  // Steps the groups of one lane, in registration order.
  absl::Status StepLane(Lane& lane, const StepOverrides& overrides,
                        ShapeTimes* shape_times, PhaseTimings& timings);
  absl::Status StepLanes(const StepOverrides& overrides,
                         ShapeTimes* shape_times, PhaseTimings& timings);
  // Every piece of state, in the order ExportState/ImportState name them.
  std::vector<StateEntry> StateEntries() const;

  Backend* backend_;
  StepOptions options_;
  std::vector<GroupState> groups_;
  std::vector<Lane> lanes_;
  // Steps run (for sampling per-shape NS timings on device backends).
  int64_t steps_run_ = 0;
  ShapeTimes shape_times_;
  int64_t state_bytes_ = 0;
  int64_t transient_bytes_ = 0;
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
      for (Communicator* c : {d.gtp, d.tp}) {
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
      BuildGroupExchangePlan(ParamSpecs(group), homes, d.size, d.g, d.t)
          .status());
  return WithContext(group.homes.Put(version, std::move(homes)),
                     absl::StrCat("group '", name, "': "));
}

absl::StatusOr<std::vector<std::string>>
LayerShardedMuonImpl::AgreeAcrossDomains(StepResult& result) {
  std::vector<std::string> bad;
  // A group that cannot step fails the step only after every group's
  // agreement, so all ranks run the same collectives whatever they decide.
  absl::Status refused;
  for (GroupState& group : groups_) {
    DomainVote mine;
    ASSIGN_OR_RETURN(mine.all_finite, GradsWithinLimit(group));
    mine.homes_version = group.homes.newest();
    mine.oldest_held = group.homes.oldest();
    std::vector<std::string> local_bad;
    if (!mine.all_finite) {
      ASSIGN_OR_RETURN(local_bad, BadGradNames(group));
    }
    float* scratch =
        static_cast<float*>(lanes_[group.lane].vote_scratch.data());
    ASSIGN_OR_RETURN(
        const DomainVote agreed,
        GatherDomainVotes(*group.backend, group.config.domain, scratch, mine));
    if (!agreed.all_finite && local_bad.empty()) {
      local_bad.push_back(group.config.name +
                          "/(non-finite gradients on another rank of the "
                          "domain)");
    }
    bad.insert(bad.end(), local_bad.begin(), local_bad.end());
    if (group.config.algorithm != Algorithm::kMuon || !refused.ok()) continue;
    // Every rank sees the same gathered votes, so every rank of the domain
    // refuses alike (a rank failing alone would leave its peers waiting in
    // the exchange for the communicator timeout).
    refused = CheckHomesVersionHeld(agreed, group.config.name,
                                    NsHomesByVersion::kCapacity);
    if (!refused.ok()) continue;
    refused = UseHomesVersion(group, agreed.homes_version);
    result.homes_versions[group.config.name] = agreed.homes_version;
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

absl::StatusOr<StepResult> LayerShardedMuonImpl::Step(
    const StepOverrides& overrides) {
  RETURN_IF_ERROR(CheckOverrides(overrides, groups_));
  const absl::Time start = absl::Now();
  StepResult result;
  ASSIGN_OR_RETURN(std::vector<std::string> bad, AgreeAcrossDomains(result));
  if (!bad.empty()) {
    if (options_.skip_nonfinite) {
      result.skipped_nonfinite = std::move(bad);
      return result;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "non-finite gradients (NaN or Inf) in: ", absl::StrJoin(bad, ", "),
        "; the step was not applied"));
  }
  ShapeTimes* shape_times = MeasuresShapes() ? &shape_times_ : nullptr;
  ++steps_run_;
  shape_times_.Clear();
  RETURN_IF_ERROR(StepLanes(overrides, shape_times, result.timings));
  result.ns_shapes = shape_times_.ByShape();
  result.timings.total_us = absl::ToDoubleMicroseconds(absl::Now() - start);
  return result;
}

absl::Status LayerShardedMuonImpl::StepLanes(const StepOverrides& overrides,
                                             ShapeTimes* shape_times,
                                             PhaseTimings& timings) {
  if (lane_threads_ == nullptr) {
    for (Lane& lane : lanes_) {
      RETURN_IF_ERROR(StepLane(lane, overrides, shape_times, timings));
    }
    return absl::OkStatus();
  }
  std::vector<PhaseTimings> lane_timings(lanes_.size());
  std::vector<absl::Status> lane_status(lanes_.size());
  lane_threads_->Run([&](int l) {
    lane_status[l] =
        StepLane(lanes_[l], overrides, shape_times, lane_timings[l]);
  });
  for (size_t l = 0; l < lanes_.size(); ++l) {
    RETURN_IF_ERROR(lane_status[l]);
    AddTimings(lane_timings[l], timings);
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::StepLane(Lane& lane,
                                            const StepOverrides& overrides,
                                            ShapeTimes* shape_times,
                                            PhaseTimings& timings) {
  for (int gi : lane.groups) {
    GroupState& group = groups_[gi];
    const std::string& name = group.config.name;
    if (group.config.algorithm == Algorithm::kMuon) {
      RETURN_IF_ERROR(StepMuonGroup(
          group, WithOverrides(group.config.muon, name, overrides),
          lane.exchange, shape_times, timings));
    } else {
      RETURN_IF_ERROR(StepAdamWGroup(
          group, WithOverrides(group.config.adamw, name, overrides), timings));
    }
  }
  return absl::OkStatus();
}

std::vector<StateEntry> LayerShardedMuonImpl::StateEntries() const {
  std::vector<StateEntry> entries;
  for (const GroupState& group : groups_) {
    const std::string& gname = group.config.name;
    const bool muon = group.config.algorithm == Algorithm::kMuon;
    for (const ParamState& p : group.params) {
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
      } else {
        tensor(".exp_avg", p.exp_avg);
        tensor(".exp_avg_sq", p.exp_avg_sq);
      }
    }
    if (!muon) {
      StateEntry e;
      e.key = gname + "/.step";
      e.count = group.adamw_step;
      e.group = gname;
      entries.push_back(std::move(e));
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
  // Count entries are the AdamW groups' step counts, named "<group>/.step".
  std::map<std::string, GroupState*> by_name;
  for (GroupState& group : groups_) by_name[group.config.name] = &group;
  return ImportStateEntries(state, entries, lane_backends,
                            [&](size_t i, int64_t count) {
                              by_name.at(entries[i].group)->adamw_step = count;
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
