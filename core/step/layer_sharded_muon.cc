#include "core/step/layer_sharded_muon.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/backend/bf16.h"
#include "core/common/status_macros.h"
#include "core/muon/newton_schulz.h"
#include "core/plan/exchange_plan.h"
#include "glog/logging.h"

namespace muond {
namespace {

// Floats each rank contributes to the per-step domain agreement: all finite,
// newest and oldest NS homes version held (two floats each).
constexpr int kAgreementFloats = 5;
// NS homes versions a group keeps, so a rank can follow its domain back to a
// version an earlier plan set (a newer plan reached only some ranks yet).
constexpr size_t kHomesHistory = 8;

// Backend memory owned by the optimizer, freed with the backend.
class OwnedBuffer {
 public:
  OwnedBuffer() = default;
  OwnedBuffer(Backend* backend, void* data) : backend_(backend), data_(data) {}
  OwnedBuffer(OwnedBuffer&& o) noexcept { *this = std::move(o); }
  OwnedBuffer& operator=(OwnedBuffer&& o) noexcept {
    Reset();
    backend_ = o.backend_;
    data_ = o.data_;
    o.data_ = nullptr;
    return *this;
  }
  ~OwnedBuffer() { Reset(); }
  void* data() const { return data_; }

 private:
  void Reset() {
    if (data_ != nullptr) backend_->Free(data_);
    data_ = nullptr;
  }
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
};

absl::StatusOr<OwnedBuffer> AllocateZeroed(Backend* backend, DType dtype,
                                           int64_t rows, int64_t cols) {
  const int64_t bytes = std::max<int64_t>(rows * cols, 1) * DTypeSize(dtype);
  ASSIGN_OR_RETURN(void* data, backend->Allocate(bytes));
  OwnedBuffer buffer(backend, data);
  if (rows * cols > 0) {
    RETURN_IF_ERROR(backend->Memset0(ContiguousView(data, dtype, rows, cols)));
  }
  return buffer;
}

// Zeroed `dtype` matrices of the given shapes, each shape's matrices laid out
// back to back in one slab in list order, so a run of same-shape matrices
// (the chunks RunNs batches) is one contiguous stacked view that batched NS
// can work on in place. Returns one view per entry of `shapes`.
absl::StatusOr<std::vector<MatrixView>> AllocateSlabs(
    Backend* backend, DType dtype,
    const std::vector<std::pair<int64_t, int64_t>>& shapes,
    std::vector<OwnedBuffer>& owned) {
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<size_t>>>
      by_shape;
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto it = std::find_if(by_shape.begin(), by_shape.end(),
                           [&](const auto& e) { return e.first == shapes[i]; });
    if (it == by_shape.end()) {
      by_shape.push_back({shapes[i], {i}});
    } else {
      it->second.push_back(i);
    }
  }
  std::vector<MatrixView> views(shapes.size());
  for (const auto& [shape, members] : by_shape) {
    const auto [rows, cols] = shape;
    ASSIGN_OR_RETURN(
        OwnedBuffer buf,
        AllocateZeroed(backend, dtype, int64_t(members.size()) * rows, cols));
    char* base = static_cast<char*>(buf.data());
    const int64_t bytes = rows * cols * int64_t(DTypeSize(dtype));
    for (size_t k = 0; k < members.size(); ++k) {
      views[members[k]] =
          ContiguousView(base + int64_t(k) * bytes, dtype, rows, cols);
    }
    owned.push_back(std::move(buf));
  }
  return views;
}

double MicrosSince(absl::Time start) {
  return absl::ToDoubleMicroseconds(absl::Now() - start);
}

std::vector<int64_t> ViewShape(const MatrixView& v) { return {v.rows, v.cols}; }

// One phase of a step: a trace range (NVTX on CUDA) and its wall time. The
// phases synchronise the backend at their end so the times are real; the
// step has five such points, none inside a phase.
class Phase {
 public:
  Phase(Backend& backend, const char* name)
      : backend_(backend), start_(absl::Now()) {
    backend_.PushRange(name);
  }
  ~Phase() { backend_.PopRange(); }
  // Waits for the phase's work and adds its wall time to `total_us`.
  absl::Status Finish(double& total_us) {
    const absl::Status status = backend_.Synchronize();
    total_us += MicrosSince(start_);
    return status;
  }

 private:
  Backend& backend_;
  const absl::Time start_;
};

// Phase work of concurrently run lanes adds up; total_us stays wall time.
void AddTimings(const PhaseTimings& from, PhaseTimings& to) {
  to.momentum_us += from.momentum_us;
  to.a2a_fwd_us += from.a2a_fwd_us;
  to.ns_us += from.ns_us;
  to.a2a_bwd_us += from.a2a_bwd_us;
  to.update_us += from.update_us;
}

// Per-param buffers of one rank.
struct ParamState {
  ParamShardSpec spec;
  OwnedBuffer momentum_buf, exp_avg_buf, exp_avg_sq_buf;
  MatrixView momentum, exp_avg, exp_avg_sq;
  // L_i: local shard in the group's NS dtype; NS input after momentum, the
  // (unscaled) update after the reverse route.
  MatrixView local;
  // A1_i / A2_i: assembled matrices (stage 1 / stage 2) when this rank
  // assembles the param under the current plan; owned by the plan buffers.
  MatrixView a1, a2;
};

// Buffers that depend on the plan (assembled matrices), replaced when the
// homes change.
struct PlanBuffers {
  GroupExchangePlan plan;
  std::vector<OwnedBuffer> owned;
};

struct GroupState {
  GroupConfig config;
  // The backend this group computes on (its own, e.g. a CUDA stream of its
  // own, or the optimizer's) and its lane.
  Backend* backend = nullptr;
  int lane = 0;
  std::vector<ParamState> params;
  // The params' local buffers (L_i), one slab per shape (AllocateSlabs).
  std::vector<OwnedBuffer> local_slabs;
  // The dtype of L_i, the assembled matrices and the exchanges: NS's work
  // dtype (bf16 for medium precision), so nothing is converted between the
  // momentum kernel and the update kernel but inside Newton–Schulz.
  DType ns_dtype = DType::kFloat32;
  std::optional<PlanBuffers> plan;
  // The version `plan` was built from: 0 = the round-robin fallback, -1 =
  // none yet.
  int64_t plan_version = -1;
  // NS homes by plan version (SetHomes), the newest kHomesHistory kept. Each
  // step the domain agrees on one of them (AgreeAcrossDomain).
  std::map<int64_t, std::vector<NsHome>> homes_by_version;
  int64_t adamw_step = 0;
  // Newton–Schulz engines by (rows, cols, batch capacity).
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<NewtonSchulz>>
      ns;
  // Staging for batched NS (ns_batch_size > 1).
  OwnedBuffer batch_buf;
  int64_t batch_buf_elems = 0;
};

// Groups that share a communicator, or a device backend (one stream orders
// its work, and NCCL orders the collectives of one communicator), must run
// one after the other: each such set is a lane. Lanes run concurrently, each
// on a thread of its own with its own exchange buffers.
struct Lane {
  Backend* backend = nullptr;
  std::vector<int> groups;
  OwnedBuffer send_buf, recv_buf, flag_buf;
  int64_t send_bytes = 0, recv_bytes = 0;
};

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
  absl::Status InitGroup(GroupConfig config, GroupState& group);
  absl::Status BuildPlan(GroupState& group, std::vector<NsHome> homes);
  absl::Status AssignLanes();
  absl::Status EnsureExchangeBuffers(Lane& lane, int64_t send_bytes,
                                     int64_t recv_bytes);
  // Steps the groups of one lane, in registration order.
  absl::Status StepLane(const Lane& lane, const StepOverrides& overrides,
                        PhaseTimings& timings);
  // Before anything changes: agrees across each group's domain on whether
  // every gradient is finite and on the NS homes version (the oldest of the
  // ranks' newest), and builds that version's exchange plan. Returns the
  // names of non-finite gradients (empty: step).
  absl::StatusOr<std::vector<std::string>> AgreeAcrossDomains(
      StepResult& result);
  struct DomainAgreement {
    bool all_finite = true;
    // This rank's newest NS homes version; agreed: the oldest of the ranks'.
    int64_t homes_version = 0;
    // This rank's oldest held version; agreed: the newest of the ranks'. The
    // agreed homes_version below it was dropped by some rank.
    int64_t oldest_held = 0;
  };
  absl::StatusOr<DomainAgreement> AgreeAcrossDomain(GroupState& group,
                                                    DomainAgreement mine);
  absl::Status UseHomesVersion(GroupState& group, int64_t version);

  absl::Status StepMuonGroup(GroupState& group, const MuonOptions& options,
                             PhaseTimings& t);
  absl::Status StepAdamWGroup(GroupState& group, const AdamWOptions& options,
                              PhaseTimings& t);
  // Runs NS (+ scale) on the matrices `select(i)` of params `indices`,
  // batched by shape up to ns_batch_size.
  absl::Status RunNs(GroupState& group, const MuonOptions& options,
                     const std::vector<int>& indices,
                     MatrixView ParamState::*matrix);
  // Adds one NS chunk (`count` matrices of rows x cols started at `start`)
  // to the step's per-shape times when the step is measured.
  absl::Status RecordShapeTime(GroupState& group, int64_t rows, int64_t cols,
                               int64_t count, absl::Time start);
  absl::StatusOr<NewtonSchulz*> GetNs(GroupState& group,
                                      const MuonOptions& options, int64_t rows,
                                      int64_t cols, int64_t batch);
  absl::Status Exchange(GroupState& group, const StageExchange& stage,
                        const AllToAllvPlan& route, Communicator* comm,
                        MatrixView ParamState::*src,
                        MatrixView ParamState::*dst);

  Backend* backend_;
  StepOptions options_;
  std::vector<GroupState> groups_;
  // Steps run (for sampling per-shape NS timings on device backends).
  int64_t steps_run_ = 0;
  // Whether the current step measures per-shape NS times, and the times.
  bool measure_shapes_ = false;
  std::map<std::pair<int64_t, int64_t>, ShapeTiming> shape_times_;
  std::vector<Lane> lanes_;
  // Guards what lanes running concurrently share: shape_times_ and
  // transient_bytes_.
  absl::Mutex mu_;
  int64_t state_bytes_ = 0;
  int64_t transient_bytes_ = 0;
};

absl::Status CheckBinding(const std::string& group, const ParamBinding& p,
                          const ParamShardSpec& spec) {
  const std::vector<int64_t> local = spec.local_shape;
  auto shape_str = [](const std::vector<int64_t>& s) {
    return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
  };
  if (local.size() != 2 || ViewShape(p.param) != local ||
      ViewShape(p.grad) != local) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", group, "' param '", p.name, "': param view ",
        shape_str(ViewShape(p.param)), " and grad view ",
        shape_str(ViewShape(p.grad)), " must both have the local shard shape ",
        shape_str(local)));
  }
  if (p.param.data == nullptr || p.grad.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", group, "' param '", p.name, "': null param or grad view"));
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::Init(std::vector<GroupConfig> groups) {
  std::map<std::string, int> names;
  groups_.resize(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) {
    if (!names.emplace(groups[i].name, int(i)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate param group name '", groups[i].name, "'"));
    }
    RETURN_IF_ERROR(InitGroup(std::move(groups[i]), groups_[i]));
  }
  return AssignLanes();
}

absl::Status LayerShardedMuonImpl::AssignLanes() {
  // Union-find over groups: shared communicator or shared device backend.
  std::vector<int> parent(groups_.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = int(i);
  std::function<int(int)> find = [&](int i) {
    return parent[i] == i ? i : parent[i] = find(parent[i]);
  };
  auto shares = [](const GroupState& a, const GroupState& b) {
    const DomainBinding &x = a.config.domain, &y = b.config.domain;
    for (Communicator* c : {x.gtp, x.tp}) {
      if (c != nullptr && (c == y.gtp || c == y.tp)) return true;
    }
    return a.backend == b.backend && a.backend->is_device();
  };
  for (size_t i = 0; i < groups_.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (shares(groups_[i], groups_[j])) parent[find(int(i))] = find(int(j));
    }
  }
  std::map<int, int> lane_of_root;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const int root = find(int(i));
    auto [it, fresh] = lane_of_root.emplace(root, int(lanes_.size()));
    if (fresh) {
      lanes_.emplace_back();
      lanes_.back().backend = groups_[i].backend;
    }
    groups_[i].lane = it->second;
    lanes_[it->second].groups.push_back(int(i));
  }
  // The agreement gathers kAgreementFloats per rank of the largest
  // communicator of the lane, after the rank's own.
  for (Lane& lane : lanes_) {
    int64_t most = 1;
    for (int g : lane.groups) {
      for (Communicator* c :
           {groups_[g].config.domain.gtp, groups_[g].config.domain.tp}) {
        if (c != nullptr) most = std::max<int64_t>(most, c->size());
      }
    }
    ASSIGN_OR_RETURN(lane.flag_buf,
                     AllocateZeroed(lane.backend, DType::kFloat32, 1,
                                    kAgreementFloats * (1 + most)));
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::InitGroup(GroupConfig config,
                                             GroupState& group) {
  const std::string& gname = config.name;
  const DomainBinding& d = config.domain;
  group.backend = config.backend != nullptr ? config.backend : backend_;
  if (d.size.gtp < 1 || d.size.tp < 1 || d.g < 0 || d.g >= d.size.gtp ||
      d.t < 0 || d.t >= d.size.tp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", gname, "': domain coordinates (g=", d.g, ", t=", d.t,
        ") must lie in the ", d.size.gtp, " x ", d.size.tp, " domain"));
  }
  auto check_comm = [&](Communicator* comm, int size, int rank,
                        const char* axis) -> absl::Status {
    if (size == 1) return absl::OkStatus();
    if (comm == nullptr || comm->size() != size || comm->rank() != rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", gname, "': the ", axis, " communicator must have size ",
          size, " and rank ", rank));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(check_comm(d.gtp, d.size.gtp, d.g, "gtp_remat"));
  RETURN_IF_ERROR(check_comm(d.tp, d.size.tp, d.t, "tp"));
  if (config.algorithm == Algorithm::kMuon) {
    RETURN_IF_ERROR(config.muon.Validate());
    RETURN_IF_ERROR(ValidateNsOptions(config.muon.ns, *group.backend));
  } else {
    RETURN_IF_ERROR(config.adamw.Validate());
  }
  std::map<std::string, int> names;
  for (const ParamBinding& p : config.params) {
    if (!names.emplace(p.name, 0).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", gname, "': duplicate param name '", p.name, "'"));
    }
    ParamState st;
    if (config.algorithm == Algorithm::kMuon) {
      ASSIGN_OR_RETURN(
          st.spec, MakeShardSpec(p.name, ViewShape(p.param), p.tags, d.size));
      if (!p.full_shape.empty() && p.full_shape != st.spec.full_shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            "group '", gname, "' param '", p.name, "': full_shape [",
            absl::StrJoin(p.full_shape, ", "),
            "] disagrees with the shape implied by the local shard and tags [",
            absl::StrJoin(st.spec.full_shape, ", "), "]"));
      }
    } else {
      st.spec.name = p.name;
      st.spec.local_shape = ViewShape(p.param);
      st.spec.full_shape = st.spec.local_shape;
    }
    RETURN_IF_ERROR(CheckBinding(gname, p, st.spec));
    const int64_t rows = p.param.rows, cols = p.param.cols;
    if (config.algorithm == Algorithm::kMuon) {
      const DType sd = config.muon.state_dtype;
      ASSIGN_OR_RETURN(st.momentum_buf,
                       AllocateZeroed(group.backend, sd, rows, cols));
      st.momentum = ContiguousView(st.momentum_buf.data(), sd, rows, cols);
      state_bytes_ += rows * cols * DTypeSize(sd);
    } else {
      ASSIGN_OR_RETURN(
          st.exp_avg_buf,
          AllocateZeroed(group.backend, DType::kFloat32, rows, cols));
      ASSIGN_OR_RETURN(
          st.exp_avg_sq_buf,
          AllocateZeroed(group.backend, DType::kFloat32, rows, cols));
      st.exp_avg =
          ContiguousView(st.exp_avg_buf.data(), DType::kFloat32, rows, cols);
      st.exp_avg_sq =
          ContiguousView(st.exp_avg_sq_buf.data(), DType::kFloat32, rows, cols);
      state_bytes_ += 2 * rows * cols * 4;
    }
    group.params.push_back(std::move(st));
  }
  if (config.algorithm == Algorithm::kMuon) {
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (const ParamBinding& p : config.params) {
      shapes.emplace_back(p.param.rows, p.param.cols);
    }
    group.ns_dtype = NsWorkDType(config.muon.ns.precision);
    ASSIGN_OR_RETURN(std::vector<MatrixView> locals,
                     AllocateSlabs(group.backend, group.ns_dtype, shapes,
                                   group.local_slabs));
    for (size_t i = 0; i < locals.size(); ++i) {
      group.params[i].local = locals[i];
    }
  }
  group.config = std::move(config);
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::SetHomes(const std::string& name,
                                            std::vector<NsHome> homes,
                                            int64_t version) {
  for (GroupState& group : groups_) {
    if (group.config.name != name) continue;
    if (group.config.algorithm != Algorithm::kMuon) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", name, "' is an AdamW group: it has no NS homes"));
    }
    std::map<int64_t, std::vector<NsHome>>& held = group.homes_by_version;
    if (version == kNextHomesVersion) {
      version = held.empty() ? 1 : held.rbegin()->first + 1;
    }
    if (version < 1 || version > kMaxHomesVersion) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", name, "': homes version ", version,
                       " must be in [1, ", kMaxHomesVersion, "]"));
    }
    // Validate now, so bad homes are refused here and not at a later step.
    std::vector<ParamShardSpec> specs;
    for (const ParamState& p : group.params) specs.push_back(p.spec);
    const DomainBinding& d = group.config.domain;
    RETURN_IF_ERROR(
        BuildGroupExchangePlan(specs, homes, d.size, d.g, d.t).status());
    auto it = held.find(version);
    if (it != held.end()) {
      if (it->second == homes) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", name, "': homes version ", version,
          " was already set to different homes (versions name one plan)"));
    }
    held.emplace(version, std::move(homes));
    while (held.size() > kHomesHistory) held.erase(held.begin());
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("no param group named '", name, "'"));
}

absl::Status LayerShardedMuonImpl::UseHomesVersion(GroupState& group,
                                                   int64_t version) {
  if (group.plan_version == version && group.plan.has_value()) {
    return absl::OkStatus();
  }
  std::vector<NsHome> homes;
  if (version == 0) {
    // Homes were never set: round-robin fallback, loudly (planner logs it).
    std::vector<ParamShardSpec> specs;
    for (const ParamState& p : group.params) specs.push_back(p.spec);
    homes = RoundRobinHomes(specs, group.config.domain.size).homes;
    LOG(WARNING) << "group '" << group.config.name
                 << "': no NS homes were set; using the round-robin fallback "
                    "(LPT balancing NOT in effect)";
  } else {
    auto it = group.homes_by_version.find(version);
    if (it == group.homes_by_version.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("group '", group.config.name,
                       "': the domain agreed on the NS homes of plan version ",
                       version, ", which this rank does not hold (it holds ",
                       group.homes_by_version.size(), " versions, newest ",
                       group.homes_by_version.empty()
                           ? 0
                           : group.homes_by_version.rbegin()->first,
                       "); the step was not applied"));
    }
    homes = it->second;
  }
  RETURN_IF_ERROR(BuildPlan(group, std::move(homes)));
  group.plan_version = version;
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::BuildPlan(GroupState& group,
                                             std::vector<NsHome> homes) {
  std::vector<ParamShardSpec> specs;
  for (const ParamState& p : group.params) specs.push_back(p.spec);
  const DomainBinding& d = group.config.domain;
  ASSIGN_OR_RETURN(
      GroupExchangePlan plan,
      BuildGroupExchangePlan(specs, std::move(homes), d.size, d.g, d.t));
  PlanBuffers buffers;
  // Allocate every buffer first: a failure leaves the old plan in place.
  std::vector<std::pair<int, MatrixView>> a1, a2;
  // Same-shape assembled matrices share a slab in param order (the order
  // RunNs chunks them in), so batched NS runs on them in place.
  auto allocate =
      [&](const std::vector<const AssembledParam*>& aps,
          std::vector<std::pair<int, MatrixView>>& out) -> absl::Status {
    std::vector<const AssembledParam*> sorted = aps;
    std::stable_sort(sorted.begin(), sorted.end(),
                     [](const AssembledParam* x, const AssembledParam* y) {
                       return x->param < y->param;
                     });
    std::vector<std::pair<int64_t, int64_t>> shapes;
    for (const AssembledParam* ap : sorted)
      shapes.emplace_back(ap->rows, ap->cols);
    ASSIGN_OR_RETURN(
        std::vector<MatrixView> views,
        AllocateSlabs(group.backend, group.ns_dtype, shapes, buffers.owned));
    for (size_t k = 0; k < sorted.size(); ++k) {
      out.emplace_back(sorted[k]->param, views[k]);
    }
    return absl::OkStatus();
  };
  const int64_t elem = int64_t(DTypeSize(group.ns_dtype));
  int64_t assembled_bytes = 0;
  if (plan.has_stage1) {
    std::vector<const AssembledParam*> aps;
    for (const AssembledParam& ap : plan.stage1.assembled) {
      aps.push_back(&ap);
      assembled_bytes += ap.rows * ap.cols * elem;
    }
    RETURN_IF_ERROR(allocate(aps, a1));
  }
  {
    std::vector<const AssembledParam*> aps;
    for (const StageExchange& s2 : plan.stage2) {
      for (const AssembledParam& ap : s2.assembled) {
        aps.push_back(&ap);
        assembled_bytes += ap.rows * ap.cols * elem;
      }
    }
    RETURN_IF_ERROR(allocate(aps, a2));
  }
  Lane& lane = lanes_[group.lane];
  RETURN_IF_ERROR(EnsureExchangeBuffers(lane, plan.max_send_elems * elem,
                                        plan.max_recv_elems * elem));
  for (ParamState& p : group.params) p.a1 = p.a2 = MatrixView{};
  for (auto& [i, v] : a1) group.params[i].a1 = v;
  for (auto& [i, v] : a2) group.params[i].a2 = v;
  buffers.plan = std::move(plan);
  group.plan = std::move(buffers);
  absl::MutexLock lock(&mu_);
  transient_bytes_ = std::max(
      transient_bytes_, assembled_bytes + lane.send_bytes + lane.recv_bytes);
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::EnsureExchangeBuffers(Lane& lane,
                                                         int64_t send_bytes,
                                                         int64_t recv_bytes) {
  // Raw bytes: the groups of a lane may exchange different dtypes.
  if (send_bytes > lane.send_bytes) {
    ASSIGN_OR_RETURN(lane.send_buf,
                     AllocateZeroed(lane.backend, DType::kBFloat16, 1,
                                    (send_bytes + 1) / 2));
    lane.send_bytes = send_bytes;
  }
  if (recv_bytes > lane.recv_bytes) {
    ASSIGN_OR_RETURN(lane.recv_buf,
                     AllocateZeroed(lane.backend, DType::kBFloat16, 1,
                                    (recv_bytes + 1) / 2));
    lane.recv_bytes = recv_bytes;
  }
  return absl::OkStatus();
}

// The matrix a stage reads or writes for param i: the stage-specific buffer,
// falling back to the previous stage's matrix where a stage is absent for the
// param (kTp params have no stage 1: A1 is L).
MatrixView StageMatrix(const ParamState& p, MatrixView ParamState::*which) {
  if (which == &ParamState::a1 && p.a1.data == nullptr) return p.local;
  return p.*which;
}

absl::Status LayerShardedMuonImpl::Exchange(GroupState& group,
                                            const StageExchange& stage,
                                            const AllToAllvPlan& route,
                                            Communicator* comm,
                                            MatrixView ParamState::*src,
                                            MatrixView ParamState::*dst) {
  if (!stage.active) return absl::OkStatus();
  Lane& lane = lanes_[group.lane];
  const DType dt = group.ns_dtype;
  const int64_t elem = int64_t(DTypeSize(dt));
  char* send = static_cast<char*>(lane.send_buf.data());
  char* recv = static_cast<char*>(lane.recv_buf.data());
  for (const auto& pieces : route.send) {
    for (const Piece& pc : pieces) {
      const MatrixView m = StageMatrix(group.params[pc.param], src);
      RETURN_IF_ERROR(group.backend->Copy2D(
          ContiguousView(send + pc.offset * elem, dt, pc.block.rows,
                         pc.block.cols),
          m.Block(pc.block.row0, pc.block.col0, pc.block.rows, pc.block.cols)));
    }
  }
  if (comm == nullptr) {
    return absl::InternalError(absl::StrCat(
        "group '", group.config.name, "': exchange needs a communicator"));
  }
  RETURN_IF_ERROR(
      comm->AllToAllV(send, route.send_counts, recv, route.recv_counts, dt));
  for (const auto& pieces : route.recv) {
    for (const Piece& pc : pieces) {
      const MatrixView m = StageMatrix(group.params[pc.param], dst);
      RETURN_IF_ERROR(group.backend->Copy2D(
          m.Block(pc.block.row0, pc.block.col0, pc.block.rows, pc.block.cols),
          ContiguousView(recv + pc.offset * elem, dt, pc.block.rows,
                         pc.block.cols)));
    }
  }
  return comm->Wait();
}

absl::StatusOr<NewtonSchulz*> LayerShardedMuonImpl::GetNs(
    GroupState& group, const MuonOptions& options, int64_t rows, int64_t cols,
    int64_t batch) {
  auto key = std::make_tuple(rows, cols, batch);
  auto it = group.ns.find(key);
  if (it != group.ns.end()) return it->second.get();
  ASSIGN_OR_RETURN(auto ns, NewtonSchulz::Create(group.backend, options.ns,
                                                 rows, cols, batch));
  NewtonSchulz* raw = ns.get();
  group.ns.emplace(key, std::move(ns));
  return raw;
}

absl::Status LayerShardedMuonImpl::RunNs(GroupState& group,
                                         const MuonOptions& options,
                                         const std::vector<int>& indices,
                                         MatrixView ParamState::*matrix) {
  // Same-shape matrices in first-appearance order, so chunking depends only
  // on the (rank-independent) param order.
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<int>>>
      by_shape;
  for (int i : indices) {
    const MatrixView m = StageMatrix(group.params[i], matrix);
    auto shape = std::make_pair(m.rows, m.cols);
    auto it = std::find_if(by_shape.begin(), by_shape.end(),
                           [&](const auto& e) { return e.first == shape; });
    if (it == by_shape.end()) {
      by_shape.push_back({shape, {i}});
    } else {
      it->second.push_back(i);
    }
  }
  const int64_t max_batch = std::max<int64_t>(1, options.ns_batch_size);
  for (const auto& [shape, members] : by_shape) {
    const auto [rows, cols] = shape;
    for (size_t begin = 0; begin < members.size(); begin += max_batch) {
      const int64_t batch =
          std::min<int64_t>(max_batch, int64_t(members.size()) - begin);
      ASSIGN_OR_RETURN(NewtonSchulz * ns,
                       GetNs(group, options, rows, cols, batch));
      const absl::Time chunk_start = absl::Now();
      if (batch == 1) {
        // The unbatched path, in place: bit-exact numerics contract.
        const MatrixView m = StageMatrix(group.params[members[begin]], matrix);
        RETURN_IF_ERROR(ns->Run(m, m, 1));
        RETURN_IF_ERROR(RecordShapeTime(group, rows, cols, batch, chunk_start));
        continue;
      }
      // In place when the chunk's matrices lie back to back (the slabs of
      // AllocateSlabs); staged through the batch buffer otherwise.
      const MatrixView first =
          StageMatrix(group.params[members[begin]], matrix);
      const DType dt = group.ns_dtype;
      const int64_t bytes = rows * cols * int64_t(DTypeSize(dt));
      bool contiguous = first.dtype == dt;
      for (int64_t b = 0; b < batch && contiguous; ++b) {
        const MatrixView m =
            StageMatrix(group.params[members[begin + b]], matrix);
        contiguous = (m.rows <= 1 || m.row_stride == cols) &&
                     m.data == static_cast<char*>(first.data) + b * bytes;
      }
      if (contiguous) {
        const MatrixView stacked =
            ContiguousView(first.data, dt, batch * rows, cols);
        RETURN_IF_ERROR(ns->Run(stacked, stacked, batch));
        RETURN_IF_ERROR(RecordShapeTime(group, rows, cols, batch, chunk_start));
        continue;
      }
      const int64_t elems = batch * rows * cols;
      if (elems > group.batch_buf_elems) {
        ASSIGN_OR_RETURN(group.batch_buf,
                         AllocateZeroed(group.backend, dt, 1, elems));
        group.batch_buf_elems = elems;
      }
      const MatrixView stacked =
          ContiguousView(group.batch_buf.data(), dt, batch * rows, cols);
      for (int64_t b = 0; b < batch; ++b) {
        RETURN_IF_ERROR(group.backend->Copy2D(
            stacked.Block(b * rows, 0, rows, cols),
            StageMatrix(group.params[members[begin + b]], matrix)));
      }
      RETURN_IF_ERROR(ns->Run(stacked, stacked, batch));
      for (int64_t b = 0; b < batch; ++b) {
        RETURN_IF_ERROR(group.backend->Copy2D(
            StageMatrix(group.params[members[begin + b]], matrix),
            stacked.Block(b * rows, 0, rows, cols)));
      }
      RETURN_IF_ERROR(RecordShapeTime(group, rows, cols, batch, chunk_start));
    }
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::RecordShapeTime(GroupState& group,
                                                   int64_t rows, int64_t cols,
                                                   int64_t count,
                                                   absl::Time start) {
  if (!measure_shapes_) return absl::OkStatus();
  // The chunk's work must have finished (device backends run async).
  RETURN_IF_ERROR(group.backend->Synchronize());
  absl::MutexLock lock(&mu_);
  ShapeTiming& t = shape_times_[{rows, cols}];
  t.rows = rows;
  t.cols = cols;
  t.ns_us += MicrosSince(start);
  t.count += count;
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::StepMuonGroup(GroupState& group,
                                                 const MuonOptions& options,
                                                 PhaseTimings& t) {
  const GroupExchangePlan& plan = group.plan->plan;
  const DomainBinding& d = group.config.domain;
  // Each param's lr times its Muon scale (of the full matrix), formed before
  // anything is written.
  std::vector<float> adjusted_lrs;
  for (const ParamState& p : group.params) {
    ASSIGN_OR_RETURN(float lr, MuonAdjustedLr(options, p.spec.full_shape[0],
                                              p.spec.full_shape[1]));
    adjusted_lrs.push_back(lr);
  }

  {
    Phase phase(*group.backend, "lsmuon/momentum");
    // One batched call (CUDA: a launch per ~40 small params, not per param).
    std::vector<MatrixView> grads, momenta, locals;
    for (size_t i = 0; i < group.params.size(); ++i) {
      grads.push_back(group.config.params[i].grad);
      momenta.push_back(group.params[i].momentum);
      locals.push_back(group.params[i].local);
    }
    RETURN_IF_ERROR(MuonMomentumPhaseBatch(*group.backend, options, grads,
                                           momenta, locals));
    RETURN_IF_ERROR(phase.Finish(t.momentum_us));
  }

  {
    Phase phase(*group.backend, "lsmuon/a2a_fwd");
    if (plan.has_stage1) {
      RETURN_IF_ERROR(Exchange(group, plan.stage1, plan.stage1.forward, d.gtp,
                               &ParamState::local, &ParamState::a1));
    }
    for (const StageExchange& s2 : plan.stage2) {
      RETURN_IF_ERROR(Exchange(group, s2, s2.forward, d.tp, &ParamState::a1,
                               &ParamState::a2));
    }
    RETURN_IF_ERROR(phase.Finish(t.a2a_fwd_us));
  }

  {
    Phase phase(*group.backend, "lsmuon/ns");
    RETURN_IF_ERROR(RunNs(group, options, plan.replicated, &ParamState::local));
    RETURN_IF_ERROR(
        RunNs(group, options, plan.ns_tp_complete, &ParamState::a1));
    RETURN_IF_ERROR(
        RunNs(group, options, plan.ns_after_stage2, &ParamState::a2));
    RETURN_IF_ERROR(phase.Finish(t.ns_us));
  }

  {
    Phase phase(*group.backend, "lsmuon/a2a_bwd");
    for (auto it = plan.stage2.rbegin(); it != plan.stage2.rend(); ++it) {
      RETURN_IF_ERROR(Exchange(group, *it, it->reverse, d.tp, &ParamState::a2,
                               &ParamState::a1));
    }
    if (plan.has_stage1) {
      RETURN_IF_ERROR(Exchange(group, plan.stage1, plan.stage1.reverse, d.gtp,
                               &ParamState::a1, &ParamState::local));
      for (const ZeroFill& z : plan.stage1.reverse_zero_fill) {
        const MatrixView& m = group.params[z.param].local;
        RETURN_IF_ERROR(group.backend->Memset0(
            m.Block(z.block.row0, z.block.col0, z.block.rows, z.block.cols)));
      }
    }
    RETURN_IF_ERROR(phase.Finish(t.a2a_bwd_us));
  }

  {
    Phase phase(*group.backend, "lsmuon/update");
    std::vector<MatrixView> params, updates;
    for (size_t i = 0; i < group.params.size(); ++i) {
      params.push_back(group.config.params[i].param);
      updates.push_back(group.params[i].local);
    }
    RETURN_IF_ERROR(MuonUpdatePhaseBatch(*group.backend, options, params,
                                         updates, adjusted_lrs));
    RETURN_IF_ERROR(phase.Finish(t.update_us));
  }
  return absl::OkStatus();
}

absl::Status LayerShardedMuonImpl::StepAdamWGroup(GroupState& group,
                                                  const AdamWOptions& options,
                                                  PhaseTimings& t) {
  Phase phase(*group.backend, "lsmuon/adamw");
  const int64_t step = group.adamw_step + 1;
  for (size_t i = 0; i < group.params.size(); ++i) {
    const ParamBinding& b = group.config.params[i];
    ParamState& p = group.params[i];
    RETURN_IF_ERROR(AdamWStep(*group.backend, options, step, b.param, b.grad,
                              p.exp_avg, p.exp_avg_sq));
  }
  RETURN_IF_ERROR(phase.Finish(t.update_us));
  group.adamw_step = step;
  return absl::OkStatus();
}

// The bound every gradient element must stay under, |g| < limit, for a
// group's step to go ahead. Where a Muon group carries gradients through
// bf16 (the NS input of medium precision, or bf16 momentum state) a finite
// fp32 gradient at or beyond the bf16 overflow threshold (~3.396e38) would
// round to inf there and turn the whole update into NaN, so it fails (or
// skips) the step like a non-finite one. Momentum and NS input are convex
// combinations of gradients (lerp), so gradients under the bound keep them
// under it. The bound costs nothing: the same one read of the gradients.
float GradLimit(const GroupState& group) {
  const bool bf16 = group.config.algorithm == Algorithm::kMuon &&
                    (group.ns_dtype == DType::kBFloat16 ||
                     group.config.muon.state_dtype == DType::kBFloat16);
  return bf16 ? BitsToFloat(kBf16OverflowThresholdBits)
              : std::numeric_limits<float>::infinity();
}

// The params of a group whose gradients break GradLimit, by name, with the
// reason when the gradient is finite but beyond the bf16 range.
absl::StatusOr<std::vector<std::string>> BadGradNames(const GroupState& group,
                                                      float limit) {
  std::vector<std::string> names;
  for (const ParamBinding& b : group.config.params) {
    ASSIGN_OR_RETURN(bool ok, group.backend->AllFiniteBelow({b.grad}, limit));
    if (ok) continue;
    std::string name = group.config.name + "/" + b.name;
    ASSIGN_OR_RETURN(bool finite, group.backend->AllFinite({b.grad}));
    if (finite) {
      absl::StrAppend(
          &name,
          " (finite in fp32 but beyond the bf16 range, |g| >= 3.396e38, "
          "which ",
          group.ns_dtype == DType::kBFloat16
              ? "fp32_matmul_prec \"medium\" (bf16 Newton-Schulz input)"
              : "the bf16 momentum state",
          " cannot hold)");
    }
    names.push_back(std::move(name));
  }
  return names;
}

absl::StatusOr<std::vector<std::string>>
LayerShardedMuonImpl::AgreeAcrossDomains(StepResult& result) {
  std::vector<std::string> bad;
  // A group that cannot step fails the step only after every group's
  // agreement, so all ranks run the same collectives whatever they decide.
  absl::Status refused;
  for (GroupState& group : groups_) {
    std::vector<MatrixView> grads;
    for (const ParamBinding& b : group.config.params) grads.push_back(b.grad);
    const float limit = GradLimit(group);
    DomainAgreement mine;
    if (!grads.empty()) {
      ASSIGN_OR_RETURN(mine.all_finite,
                       group.backend->AllFiniteBelow(grads, limit));
    }
    if (!group.homes_by_version.empty()) {
      mine.homes_version = group.homes_by_version.rbegin()->first;
      mine.oldest_held = group.homes_by_version.begin()->first;
    }
    std::vector<std::string> local_bad;
    if (!mine.all_finite) {
      ASSIGN_OR_RETURN(local_bad, BadGradNames(group, limit));
    }
    // Every rank of the domain must take the same decision and route by the
    // same homes, or the ranks would wait forever in (or garble) the
    // exchange. A plan that reached one rank late is used by all once it has.
    ASSIGN_OR_RETURN(DomainAgreement domain, AgreeAcrossDomain(group, mine));
    if (!domain.all_finite && local_bad.empty()) {
      local_bad.push_back(group.config.name +
                          "/(non-finite gradients on another rank of the "
                          "domain)");
    }
    bad.insert(bad.end(), local_bad.begin(), local_bad.end());
    if (group.config.algorithm != Algorithm::kMuon || !refused.ok()) continue;
    if (domain.homes_version > 0 && domain.homes_version < domain.oldest_held) {
      // Every rank sees the same gathered versions, so every rank of the
      // domain refuses here alike (a rank failing alone would leave its
      // peers waiting in the exchange for the communicator timeout).
      refused = absl::FailedPreconditionError(absl::StrCat(
          "group '", group.config.name,
          "': the domain's ranks hold no NS homes version in common (a "
          "rank's newest is version ",
          domain.homes_version, ", another rank holds only versions from ",
          domain.oldest_held, " on; each keeps its newest ", kHomesHistory,
          ": more plan versions reached it between two steps); the step "
          "was not applied on any rank, retry it"));
      continue;
    }
    refused = UseHomesVersion(group, domain.homes_version);
    result.homes_versions[group.config.name] = domain.homes_version;
  }
  RETURN_IF_ERROR(refused);
  return bad;
}

absl::StatusOr<LayerShardedMuonImpl::DomainAgreement>
LayerShardedMuonImpl::AgreeAcrossDomain(GroupState& group,
                                        DomainAgreement mine) {
  // Per rank: [all finite, newest version / 2^24, newest % 2^24, oldest
  // version / 2^24, oldest % 2^24]; fp32 holds integers below 2^24 exactly,
  // so versions up to 2^48 travel exactly.
  // Gathered over GTP, then (carrying the GTP result) over TP: the whole
  // domain.
  constexpr int64_t kLow = int64_t(1) << 24;
  float* flags = static_cast<float*>(lanes_[group.lane].flag_buf.data());
  for (Communicator* comm : {group.config.domain.gtp, group.config.domain.tp}) {
    if (comm == nullptr || comm->size() <= 1) continue;
    const float local[kAgreementFloats] = {
        mine.all_finite ? 1.0f : 0.0f, float(mine.homes_version / kLow),
        float(mine.homes_version % kLow), float(mine.oldest_held / kLow),
        float(mine.oldest_held % kLow)};
    RETURN_IF_ERROR(group.backend->CopyFromHost(flags, local, sizeof(local)));
    RETURN_IF_ERROR(comm->AllGather(flags, kAgreementFloats,
                                    flags + kAgreementFloats, DType::kFloat32));
    RETURN_IF_ERROR(comm->Wait());
    std::vector<float> all(kAgreementFloats * comm->size());
    RETURN_IF_ERROR(group.backend->CopyToHost(
        all.data(), flags + kAgreementFloats, all.size() * sizeof(float)));
    for (int r = 0; r < comm->size(); ++r) {
      const float* f = &all[kAgreementFloats * r];
      mine.all_finite = mine.all_finite && f[0] == 1.0f;
      mine.homes_version =
          std::min(mine.homes_version, int64_t(f[1]) * kLow + int64_t(f[2]));
      mine.oldest_held =
          std::max(mine.oldest_held, int64_t(f[3]) * kLow + int64_t(f[4]));
    }
  }
  return mine;
}

absl::StatusOr<StepResult> LayerShardedMuonImpl::Step(
    const StepOverrides& overrides) {
  for (const auto* m : {&overrides.lr, &overrides.weight_decay}) {
    for (const auto& [name, value] : *m) {
      if (std::none_of(
              groups_.begin(), groups_.end(),
              [&](const GroupState& g) { return g.config.name == name; })) {
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
  // Host backends are measured every step (no extra sync); device backends
  // every ns_shape_timing_every-th step.
  const int every = options_.ns_shape_timing_every;
  measure_shapes_ =
      every > 0 &&
      (std::none_of(lanes_.begin(), lanes_.end(),
                    [](const Lane& l) { return l.backend->is_device(); }) ||
       steps_run_ % every == 0);
  ++steps_run_;
  shape_times_.clear();
  if (lanes_.size() > 1 && options_.concurrent_groups) {
    std::vector<PhaseTimings> lane_timings(lanes_.size());
    std::vector<absl::Status> lane_status(lanes_.size());
    std::vector<std::thread> threads;
    for (size_t l = 0; l < lanes_.size(); ++l) {
      threads.emplace_back([&, l] {
        lane_status[l] = StepLane(lanes_[l], overrides, lane_timings[l]);
      });
    }
    for (std::thread& t : threads) t.join();
    for (size_t l = 0; l < lanes_.size(); ++l) {
      RETURN_IF_ERROR(lane_status[l]);
      AddTimings(lane_timings[l], result.timings);
    }
  } else {
    for (const Lane& lane : lanes_) {
      RETURN_IF_ERROR(StepLane(lane, overrides, result.timings));
    }
  }
  for (const auto& [shape, timing] : shape_times_) {
    result.ns_shapes.push_back(timing);
  }
  result.timings.total_us = MicrosSince(start);
  return result;
}

absl::Status LayerShardedMuonImpl::StepLane(const Lane& lane,
                                            const StepOverrides& overrides,
                                            PhaseTimings& timings) {
  for (int gi : lane.groups) {
    GroupState& group = groups_[gi];
    const std::string& name = group.config.name;
    auto lr = overrides.lr.find(name);
    auto wd = overrides.weight_decay.find(name);
    if (group.config.algorithm == Algorithm::kMuon) {
      MuonOptions options = group.config.muon;
      if (lr != overrides.lr.end()) options.lr = lr->second;
      if (wd != overrides.weight_decay.end()) options.weight_decay = wd->second;
      RETURN_IF_ERROR(StepMuonGroup(group, options, timings));
    } else {
      AdamWOptions options = group.config.adamw;
      if (lr != overrides.lr.end()) options.lr = lr->second;
      if (wd != overrides.weight_decay.end()) options.weight_decay = wd->second;
      RETURN_IF_ERROR(StepAdamWGroup(group, options, timings));
    }
  }
  return absl::OkStatus();
}

// A contiguous state buffer as fp32 on the host; bf16 state widens exactly.
absl::StatusOr<std::vector<float>> StateToHost(Backend* backend,
                                               const MatrixView& v) {
  std::vector<float> host(v.numel());
  if (v.dtype == DType::kFloat32) {
    RETURN_IF_ERROR(backend->CopyToHost(host.data(), v.data, v.numel() * 4));
    return host;
  }
  std::vector<uint16_t> bits(v.numel());
  RETURN_IF_ERROR(backend->CopyToHost(bits.data(), v.data, v.numel() * 2));
  for (size_t i = 0; i < bits.size(); ++i) host[i] = Bf16BitsToFloat(bits[i]);
  return host;
}

absl::StatusOr<std::map<std::string, std::vector<float>>>
LayerShardedMuonImpl::ExportState() const {
  std::map<std::string, std::vector<float>> out;
  auto dump = [&](Backend* backend, const std::string& key,
                  const MatrixView& v) -> absl::Status {
    ASSIGN_OR_RETURN(out[key], StateToHost(backend, v));
    return absl::OkStatus();
  };
  for (const GroupState& group : groups_) {
    for (size_t i = 0; i < group.params.size(); ++i) {
      const ParamState& p = group.params[i];
      const std::string base = group.config.name + "/" + p.spec.name;
      if (group.config.algorithm == Algorithm::kMuon) {
        RETURN_IF_ERROR(dump(group.backend, base + ".momentum", p.momentum));
      } else {
        RETURN_IF_ERROR(dump(group.backend, base + ".exp_avg", p.exp_avg));
        RETURN_IF_ERROR(
            dump(group.backend, base + ".exp_avg_sq", p.exp_avg_sq));
      }
    }
    if (group.config.algorithm == Algorithm::kAdamW) {
      out[group.config.name + "/.step"] = {float(group.adamw_step)};
    }
  }
  return out;
}

absl::Status LayerShardedMuonImpl::ImportState(
    const std::map<std::string, std::vector<float>>& state) {
  // Validate everything before writing anything.
  struct Write {
    Backend* backend;
    MatrixView view;
    const std::vector<float>* data;
  };
  std::vector<Write> writes;
  std::vector<std::pair<GroupState*, int64_t>> steps;
  size_t expected = 0;
  std::set<std::string> known;
  for (GroupState& group : groups_) {
    for (ParamState& p : group.params) {
      const std::string base = group.config.name + "/" + p.spec.name;
      std::vector<std::pair<std::string, MatrixView>> keys;
      if (group.config.algorithm == Algorithm::kMuon) {
        keys = {{base + ".momentum", p.momentum}};
      } else {
        keys = {{base + ".exp_avg", p.exp_avg},
                {base + ".exp_avg_sq", p.exp_avg_sq}};
      }
      for (auto& [key, view] : keys) {
        auto it = state.find(key);
        if (it == state.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat("state has no entry for '", key, "'"));
        }
        if (int64_t(it->second.size()) != view.numel()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "state entry '", key, "' has ", it->second.size(),
              " fp32 elements; the param's shard needs ", view.numel()));
        }
        writes.push_back({group.backend, view, &it->second});
        known.insert(key);
        ++expected;
      }
    }
    if (group.config.algorithm == Algorithm::kAdamW) {
      auto it = state.find(group.config.name + "/.step");
      if (it == state.end() || it->second.size() != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("state has no step count for AdamW group '",
                         group.config.name, "'"));
      }
      steps.emplace_back(&group, int64_t(it->second[0]));
      known.insert(it->first);
      ++expected;
    }
  }
  if (state.size() != expected) {
    for (const auto& [key, _] : state) {
      if (!known.contains(key)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "state entry '", key, "' matches no registered param"));
      }
    }
  }
  // CopyFromHost may read the source until the next Synchronize, so the
  // bf16 images live until the lanes have synchronized below.
  std::vector<std::vector<uint16_t>> bf16_images;
  for (const Write& w : writes) {
    if (w.view.dtype == DType::kFloat32) {
      RETURN_IF_ERROR(w.backend->CopyFromHost(w.view.data, w.data->data(),
                                              w.data->size() * 4));
      continue;
    }
    std::vector<uint16_t>& image = bf16_images.emplace_back(w.data->size());
    for (size_t i = 0; i < image.size(); ++i) {
      image[i] = FloatToBf16Bits((*w.data)[i]);
    }
    RETURN_IF_ERROR(
        w.backend->CopyFromHost(w.view.data, image.data(), image.size() * 2));
  }
  for (auto& [group, step] : steps) group->adamw_step = step;
  for (const Lane& lane : lanes_) RETURN_IF_ERROR(lane.backend->Synchronize());
  return absl::OkStatus();
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
