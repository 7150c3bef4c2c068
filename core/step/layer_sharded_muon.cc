// LayerShardedMuon's construction (groups validated and allocated, lanes
// set up) and SetHomes; the rest of the engine by job: see
// layer_sharded_muon_impl.h.
#include "core/step/layer_sharded_muon.h"

#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/step/domain_agreement.h"
#include "core/step/gather_domain_votes.h"
#include "core/step/group_count.h"
#include "core/step/group_in_order.h"
#include "core/step/layer_sharded_muon_impl.h"

namespace muond {

static_assert(LayerShardedMuon::kMaxHomesVersion <= kMaxDomainVoteVersion,
              "every homes version must travel exactly in a DomainVote");

absl::Status LayerShardedMuonImpl::Init(std::vector<GroupConfig> groups) {
  RETURN_IF_ERROR(CheckParamGroupCount(int64_t(groups.size())));
  std::map<std::string, int> names;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!names.emplace(groups[i].name, int(i)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate param group name '", groups[i].name, "'"));
    }
    ASSIGN_OR_RETURN(GroupState group, CreateGroupState(std::move(groups[i]),
                                                        backend_, &ns_budget_));
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

void LayerShardedMuonImpl::ShareNsRunners(const Lane& lane) {
  std::map<std::pair<Backend*, DType>, std::shared_ptr<NsRunner>> runners;
  for (int g : lane.groups) {
    GroupState& group = groups_[g];
    if (group.ns == nullptr) continue;  // AdamW
    auto [it, first] = runners.emplace(
        std::make_pair(group.backend, group.ns_dtype), group.ns);
    if (!first) group.ns = it->second;
  }
}

int64_t LayerShardedMuonImpl::VoteScratchFloats(const Lane& lane) const {
  // Each gather carries the votes of the groups on one communicator, per
  // rank of it, after this rank's own: the largest such gather of the lane.
  std::map<Communicator*, int64_t> groups_on;
  for (int g : lane.groups) {
    const DomainBinding& d = groups_[g].config.domain;
    for (Communicator* c : {d.gtp, d.tp, d.dp}) {
      if (c != nullptr && c->size() > 1) ++groups_on[c];
    }
  }
  int64_t most = DomainVoteScratchFloats(1, 1);
  for (const auto& [comm, groups] : groups_on) {
    most = std::max(most, DomainVoteScratchFloats(comm->size(), groups));
  }
  return most;
}

absl::Status LayerShardedMuonImpl::AllocateLocalSlabs(Lane& lane) {
  // The lane's Muon groups by NS runner (AdamW groups have none), in order
  // of their first group.
  auto of = [&](size_t k) -> GroupState& { return groups_[lane.groups[k]]; };
  const std::vector<std::vector<size_t>> runners = GroupInOrder(
      lane.groups.size(), [&](size_t k) { return of(k).ns != nullptr; },
      [&](size_t a, size_t b) { return of(a).ns == of(b).ns; });
  for (const std::vector<size_t>& members : runners) {
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (size_t k : members) {
      for (const ParamBinding& p : of(k).config.params) {
        shapes.emplace_back(p.param.rows, p.param.cols);
      }
    }
    // Groups sharing a runner share its backend and work dtype.
    const GroupState& first = of(members.front());
    ASSIGN_OR_RETURN(
        std::vector<MatrixView> views,
        AllocateSlabs(first.backend, first.ns_dtype, shapes, lane.local_slabs));
    auto next = views.begin();
    for (size_t k : members) {
      GroupState& group = of(k);
      group.local.assign(next, next + group.config.params.size());
      next += group.config.params.size();
    }
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::SetUpLanes() {
  RETURN_IF_ERROR(CheckOneBackendPerCommunicator(groups_));
  lanes_ = AssignLanes(groups_);
  for (Lane& lane : lanes_) {
    const int64_t scratch = VoteScratchFloats(lane);
    ASSIGN_OR_RETURN(lane.vote_scratch,
                     AllocateZeroed(lane.backend, DType::kFloat32, 1, scratch));
    staging_bytes_ += scratch * int64_t(sizeof(float));
    ShareNsRunners(lane);
    RETURN_IF_ERROR(AllocateLocalSlabs(lane));
    std::vector<GroupState*> members;
    for (int g : lane.groups) members.push_back(&groups_[g]);
    ASSIGN_OR_RETURN(lane.host_streams,
                     MakeHostStateStreams(lane.backend, members));
    if (lane.host_streams != nullptr) {
      staging_bytes_ += 2 * lane.host_streams->slot_bytes;
    }
  }
  if (lanes_.size() <= 1 || !options_.concurrent_groups) {
    return absl::OkStatus();
  }
  const int workers = LaneWorkers();
  if (workers <= 1) return absl::OkStatus();  // every lane on the caller
  if (RunsOnHost()) ExpectConcurrentCpuGemmCallers(workers);
  ASSIGN_OR_RETURN(lane_threads_,
                   LaneThreads::Create(int(lanes_.size()), workers));
  return absl::OkStatus();
}

bool LayerShardedMuonImpl::RunsOnHost() const {
  return std::any_of(lanes_.begin(), lanes_.end(),
                     [](const Lane& l) { return !l.backend->is_device(); });
}

int LayerShardedMuonImpl::LaneWorkers() const {
  const int workers =
      LaneWorkerCount(int(lanes_.size()), options_.lane_workers);
  // More host lanes calling the BLAS at once than it holds buffers for
  // crashed host daemons with thousands of groups (cpu_backend.h).
  return RunsOnHost() ? std::min(workers, CpuGemmCallerLimit()) : workers;
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
