#include "core/step/group_state.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/domain.h"
#include "core/common/state_storage.h"
#include "core/common/status_macros.h"
#include "core/muon/newton_schulz.h"
#include "core/step/domain_agreement.h"
#include "core/step/variant_phase.h"

namespace muond {
namespace {

std::vector<int64_t> ViewShape(const MatrixView& v) { return {v.rows, v.cols}; }

absl::Status CheckDomain(const std::string& group, const DomainBinding& d) {
  RETURN_IF_ERROR(CheckDomainCoordinates(d.size, d.d, d.g, d.t,
                                         absl::StrCat("group '", group, "'")));
  auto check_comm = [&](Communicator* comm, int size, int rank,
                        const char* axis) -> absl::Status {
    if (size == 1) return absl::OkStatus();
    if (comm == nullptr || comm->size() != size || comm->rank() != rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", group, "': the ", axis, " communicator must have size ",
          size, " and rank ", rank));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(check_comm(d.gtp, d.size.gtp, d.g, "gtp_remat"));
  RETURN_IF_ERROR(check_comm(d.tp, d.size.tp, d.t, "tp"));
  return check_comm(d.dp, d.size.dp, d.d, "dp");
}

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

absl::StatusOr<ParamShardSpec> MakeSpec(const GroupConfig& config,
                                        const ParamBinding& p) {
  ParamShardSpec spec;
  if (config.algorithm == Algorithm::kMuon) {
    ASSIGN_OR_RETURN(spec, MakeShardSpec(p.name, ViewShape(p.param), p.tags,
                                         config.domain.size, config.domain.g));
    if (!p.full_shape.empty() && p.full_shape != spec.full_shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", config.name, "' param '", p.name, "': full_shape [",
          absl::StrJoin(p.full_shape, ", "),
          "] disagrees with the shape implied by the local shard and tags [",
          absl::StrJoin(spec.full_shape, ", "), "]"));
    }
  } else {
    spec.name = p.name;
    spec.local_shape = ViewShape(p.param);
    spec.full_shape = spec.local_shape;
  }
  RETURN_IF_ERROR(CheckBinding(config.name, p, spec));
  return spec;
}

// Zeroed block scales of fp8_e4m3 state of `elements` elements: one fp32
// per kStateBlock, where the state lives.
absl::StatusOr<float*> AllocateScales(Backend* backend, int64_t elements,
                                      StateLocation where, OwnedBuffer& buf) {
  const int64_t blocks = (elements + kStateBlock - 1) / kStateBlock;
  ASSIGN_OR_RETURN(buf,
                   AllocateZeroed(backend, DType::kFloat32, blocks, 1, where));
  return static_cast<float*>(buf.data());
}

// Host momentum on a device streams through slots (HostStateStreams); on a
// host backend it is simply the state.
bool StreamsHostMomentum(StateLocation where, const Backend& backend) {
  return where == StateLocation::kHost && backend.is_device();
}

// fp8_e4m3 state's scales (Muon: momentum, and staged where `staged`;
// AdamW: both moments); nothing for other dtypes.
absl::Status AllocateStateScales(Backend* backend, DType dtype,
                                 int64_t elements, StateLocation where,
                                 bool muon, bool staged, ParamState& st) {
  if (dtype != DType::kFloat8E4M3) return absl::OkStatus();
  auto scales = [&](OwnedBuffer& buf) {
    return AllocateScales(backend, elements, where, buf);
  };
  if (muon) {
    ASSIGN_OR_RETURN(st.momentum_scales, scales(st.momentum_scales_buf));
    if (staged) {
      ASSIGN_OR_RETURN(st.staged_momentum_scales,
                       scales(st.staged_momentum_scales_buf));
    }
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(st.moment_scales.exp_avg, scales(st.exp_avg_scales_buf));
  ASSIGN_OR_RETURN(st.moment_scales.exp_avg_sq,
                   scales(st.exp_avg_sq_scales_buf));
  return absl::OkStatus();
}

// A zeroed rows x cols buffer of the param's state (`what`: its name in the
// error) in `sd` at `where`; a failed allocation names the group, the param,
// the buffer and its bytes, its status code kept.
absl::StatusOr<OwnedBuffer> AllocateStateBuffer(Backend* backend,
                                                const GroupConfig& config,
                                                const ParamBinding& p,
                                                const char* what, DType sd,
                                                StateLocation where) {
  const int64_t rows = p.param.rows, cols = p.param.cols;
  absl::StatusOr<OwnedBuffer> buf =
      AllocateZeroed(backend, sd, rows, cols, where);
  if (buf.ok()) return buf;
  return absl::Status(
      buf.status().code(),
      absl::StrCat(
          "group '", config.name, "' param '", p.name, "': its ", what, " (",
          rows * cols * int64_t(DTypeSize(sd)), " bytes of ",
          std::string(DTypeName(sd)), " in ",
          std::string(StateLocationName(where)),
          " memory) could not be allocated: ", buf.status().message()));
}

// Zeroed optimizer state of one param's shard; adds its bytes to the group's.
absl::Status AllocateParamState(GroupState& group, const GroupConfig& config,
                                const ParamBinding& p, ParamState& st) {
  const int64_t rows = p.param.rows, cols = p.param.cols;
  if (config.algorithm == Algorithm::kMuon) {
    const DType sd = config.muon.state_dtype;
    const StateLocation where = config.muon.state_location;
    ASSIGN_OR_RETURN(
        st.momentum_buf,
        AllocateStateBuffer(group.backend, config, p, "momentum", sd, where));
    st.momentum = ContiguousView(st.momentum_buf.data(), sd, rows, cols);
    // Streamed host state stores its new momentum to a staged host copy (the
    // slots are reused), double-buffered state to its second buffer; other
    // state needs none: the commit recomputes it in place (CommitMuonGroups).
    const bool staged = StagesMomentum(config.muon, *group.backend);
    const bool streamed = StreamsHostMomentum(where, *group.backend);
    if (staged) {
      ASSIGN_OR_RETURN(
          st.staged_momentum_buf,
          AllocateStateBuffer(
              group.backend, config, p,
              streamed ? "staged momentum"
                       : "second momentum buffer (double_buffer_momentum; "
                         "without it the commit recomputes the momentum and "
                         "needs none)",
              sd, where));
      st.staged_momentum =
          ContiguousView(st.staged_momentum_buf.data(), sd, rows, cols);
      // The second buffer of double-buffered state; a streamed host copy is
      // host memory.
      if (!streamed) group.staging_bytes += StateBytes(sd, rows * cols);
    }
    RETURN_IF_ERROR(AllocateStateScales(group.backend, sd, rows * cols, where,
                                        /*muon=*/true, staged, st));
    group.state_bytes += StateBytes(sd, rows * cols);
    return absl::OkStatus();
  }
  const DType sd = config.adamw.state_dtype;
  const StateLocation where = config.adamw.state_location;
  ASSIGN_OR_RETURN(st.exp_avg_buf, AllocateStateBuffer(group.backend, config, p,
                                                       "exp_avg", sd, where));
  ASSIGN_OR_RETURN(
      st.exp_avg_sq_buf,
      AllocateStateBuffer(group.backend, config, p, "exp_avg_sq", sd, where));
  st.exp_avg = ContiguousView(st.exp_avg_buf.data(), sd, rows, cols);
  st.exp_avg_sq = ContiguousView(st.exp_avg_sq_buf.data(), sd, rows, cols);
  RETURN_IF_ERROR(AllocateStateScales(group.backend, sd, rows * cols, where,
                                      /*muon=*/false, /*staged=*/false, st));
  group.state_bytes += 2 * StateBytes(sd, rows * cols);
  return absl::OkStatus();
}

// Pieces of about 1/kStreamPieces of the momentum, at most kMaxPieceBytes:
// small enough that the first NS starts early and two slots hold little, few
// enough that the per-piece launches and events stay negligible.
constexpr int64_t kStreamPieces = 32;
constexpr int64_t kMaxPieceBytes = int64_t(64) << 20;

// Sets the group's host_piece_bytes and host_slot_bytes.
void SizeHostStream(GroupState& group) {
  int64_t total = 0, largest = 0;
  for (const ParamState& p : group.params) {
    total += SlotOf(p).bytes;
    largest = std::max(largest, SlotOf(p).bytes);
  }
  group.host_piece_bytes =
      std::clamp<int64_t>(total / kStreamPieces, 256, kMaxPieceBytes);
  // A piece stops at the first param that takes it to the size or beyond.
  group.host_slot_bytes = group.host_piece_bytes + largest;
}

// GroupState::registered.
std::string RegisteredAs(const GroupState& group) {
  const GroupConfig& c = group.config;
  std::vector<std::string> parts = {
      c.name, c.algorithm == Algorithm::kMuon ? "muon" : "adamw",
      std::string(DTypeName(group.ns_dtype))};
  for (const ParamBinding& p : c.params) {
    parts.push_back(p.name);
    parts.push_back(absl::StrJoin(p.full_shape, "x"));
  }
  return absl::StrCat("#", absl::Hex(StepFingerprint(parts), absl::kZeroPad16),
                      " (", c.params.size(),
                      c.params.size() == 1 ? " param)" : " params)");
}

}  // namespace

bool StagesMomentum(const MuonOptions& options, const Backend& backend) {
  return StreamsHostMomentum(options.state_location, backend) ||
         options.double_buffer_momentum;
}

MomentumSlot SlotOf(const ParamState& p) {
  auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
  const int64_t n = p.momentum.numel();
  MomentumSlot slot;
  slot.value_bytes = n * int64_t(DTypeSize(p.momentum.dtype));
  if (p.momentum_scales != nullptr) {
    slot.scale_bytes = (n + kStateBlock - 1) / kStateBlock * 4;
  }
  slot.scales_offset = aligned(slot.value_bytes);
  slot.bytes = slot.scales_offset + aligned(slot.scale_bytes);
  return slot;
}

absl::StatusOr<GroupState> CreateGroupState(GroupConfig config,
                                            Backend* default_backend,
                                            NsWorkspaceBudget* ns_budget) {
  GroupState group;
  group.backend = config.backend != nullptr ? config.backend : default_backend;
  RETURN_IF_ERROR(CheckDomain(config.name, config.domain));
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
          "group '", config.name, "': duplicate param name '", p.name, "'"));
    }
    ParamState st;
    ASSIGN_OR_RETURN(st.spec, MakeSpec(config, p));
    RETURN_IF_ERROR(AllocateParamState(group, config, p, st));
    group.params.push_back(std::move(st));
  }
  if (config.algorithm == Algorithm::kMuon) {
    // L_i come with the lane's (AllocateLocalSlabs), once lanes are known.
    group.ns_dtype = NsWorkDType(config.muon.ns.precision);
    group.ns =
        std::make_shared<NsRunner>(group.backend, group.ns_dtype, ns_budget);
    if (StreamsHostMomentum(config.muon.state_location, *group.backend)) {
      SizeHostStream(group);
    }
  }
  group.config = std::move(config);
  group.registered = RegisteredAs(group);
  if (group.config.algorithm == Algorithm::kMuon) {
    RETURN_IF_ERROR(AllocateVariantState(group));
  }
  return group;
}

absl::StatusOr<std::unique_ptr<HostStateStreams>> MakeHostStateStreams(
    Backend* backend, std::vector<GroupState*> groups) {
  int64_t slot_bytes = 0;
  for (const GroupState* g : groups) {
    slot_bytes = std::max(slot_bytes, g->host_slot_bytes);
  }
  if (slot_bytes == 0) return nullptr;
  auto streams = std::make_unique<HostStateStreams>();
  ASSIGN_OR_RETURN(streams->load, backend->NewStream());
  ASSIGN_OR_RETURN(streams->store, backend->NewStream());
  streams->slot_bytes = slot_bytes;
  for (OwnedBuffer& slot : streams->slot) {
    ASSIGN_OR_RETURN(
        slot, AllocateZeroed(backend, DType::kFloat8E4M3, 1, slot_bytes));
  }
  for (GroupState* g : groups) {
    if (g->host_slot_bytes > 0) g->host_streams = streams.get();
  }
  return streams;
}

std::vector<ParamShardSpec> ParamSpecs(const GroupState& group) {
  std::vector<ParamShardSpec> specs;
  for (const ParamState& p : group.params) specs.push_back(p.spec);
  return specs;
}

MatrixView UpdateOf(const GroupState& group, const MuonOptions& options,
                    size_t i) {
  const std::vector<int64_t>& full = group.params[i].spec.full_shape;
  return NsResultOver(group.local[i],
                      NsResultDType(options.ns, full[0], full[1]));
}

std::string NamesOfGroups(absl::Span<GroupState* const> groups) {
  constexpr size_t kNamed = 3;
  std::string names;
  for (size_t i = 0; i < groups.size() && i < kNamed; ++i) {
    absl::StrAppend(&names, i > 0 ? ", '" : "'", groups[i]->config.name, "'");
  }
  if (groups.size() > kNamed) {
    absl::StrAppend(&names, " and ", groups.size() - kNamed, " more");
  }
  return absl::StrCat(groups.size() == 1 ? "group " : "groups ", names);
}

}  // namespace muond
