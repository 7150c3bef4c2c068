#include "server/daemon/registration.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/echo.h"
#include "core/common/status_macros.h"
#include "core/step/group_count.h"
#include "server/common/proto_convert.h"
#include "server/daemon/view_overlap.h"

namespace muond {
namespace {

std::string Shape(const std::vector<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

template <typename T>
std::vector<int64_t> Vec(const T& repeated) {
  return std::vector<int64_t>(repeated.begin(), repeated.end());
}

absl::Status ValidateDomain(const v1::ParamGroup& group, int world_size) {
  const v1::Domain& d = group.domain();
  const std::string where =
      absl::StrCat("group '", Echo(group.name()), "' domain");
  RETURN_IF_ERROR(CheckDomainCoordinates(DomainSizeOf(d), d.g(), d.t(), where));
  if (int64_t(d.gtp_size()) * d.tp_size() > world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", d.gtp_size(), "x", d.tp_size(),
                     " ranks exceed the job's world size ", world_size));
  }
  return absl::OkStatus();
}

// The shape this rank must hold for a param; for Muon params from
// core/plan's sharding model.
absl::StatusOr<std::vector<int64_t>> ExpectedLocalShape(
    const v1::ParamGroup& group, const v1::Param& p,
    const std::vector<int64_t>& local) {
  const std::vector<int64_t> full = Vec(p.full_shape());
  const std::string where = absl::StrCat("param '", Echo(p.name()), "'");
  if (full.empty() || full.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": full_shape ", Shape(full), " must be 1-D or 2-D"));
  }
  for (int64_t d : full) {
    if (d < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": full_shape ", Shape(full), " has a dim < 1"));
    }
  }
  const bool muon = group.algorithm() != v1::ALGORITHM_ADAMW;
  if (muon && full.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": Muon params must be 2-D (full_shape ",
                     Shape(full), "); put it in an ALGORITHM_ADAMW group"));
  }
  if (local.size() != full.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": param.shape ", Shape(local), " and full_shape ",
                     Shape(full), " differ in rank"));
  }
  const DomainSize domain = DomainSizeOf(group.domain());
  if (full.size() == 2) {
    absl::StatusOr<ParamShardSpec> spec = MakeShardSpec(
        p.name(), local, FromProto(p.tags()), domain, group.domain().g());
    if (!spec.ok()) return spec.status();
    if (spec->full_shape != full) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": param.shape ", Shape(local), " with its tags in the ",
          domain.gtp, "x", domain.tp, " domain implies full_shape ",
          Shape(spec->full_shape), ", not ", Shape(full)));
    }
    return local;
  }
  // 1-D (AdamW): whole, or split along dim 0 by TP or GTP.
  ASSIGN_OR_RETURN(const int64_t n,
                   LocalLengthOf1d(Echo(p.name()), full[0], FromProto(p.tags()),
                                   domain, group.domain().g()));
  return std::vector<int64_t>{n};
}

std::vector<TensorSpan> Spans(const Registration& reg) {
  std::vector<TensorSpan> spans;
  spans.reserve(2 * reg.num_params);
  for (const BoundGroup& g : reg.groups) {
    for (const BoundParam& p : g.params) {
      spans.push_back({&p.param, &p.name, false});
      spans.push_back({&p.grad, &p.name, true});
    }
  }
  return spans;
}

}  // namespace

absl::Status Registration::RecheckMemory() const { return regions.Recheck(); }

v1::PublishManifestRequest Registration::Manifest(const std::string& job_id,
                                                  int rank) const {
  v1::PublishManifestRequest m;
  m.set_job_id(job_id);
  m.set_rank(rank);
  for (const BoundGroup& g : groups) {
    v1::GroupManifest* gm = m.add_groups();
    gm->set_group(g.proto.name());
    gm->set_algorithm(g.proto.algorithm() == v1::ALGORITHM_ADAMW
                          ? v1::ALGORITHM_ADAMW
                          : v1::ALGORITHM_MUON);
    *gm->mutable_domain() = g.proto.domain();
    // Compared across ranks by the coordinator (hyperparameters agree).
    if (gm->algorithm() == v1::ALGORITHM_ADAMW) {
      *gm->mutable_adamw() = g.proto.adamw();
    } else {
      *gm->mutable_muon() = g.proto.muon();
    }
    for (const BoundParam& p : g.params) {
      v1::ParamSpec* spec = gm->add_params();
      spec->set_name(p.name);
      for (int64_t d : p.full_shape) spec->add_full_shape(d);
      for (int64_t d : p.local_shape) spec->add_local_shape(d);
      *spec->mutable_tags() = ToProto(p.tags);
    }
  }
  return m;
}

absl::StatusOr<std::unique_ptr<Registration>> BuildRegistration(
    const v1::RegisterParamsRequest& request, const RegistrationLimits& limits,
    HandleOpener& opener, const std::function<bool()>& cancelled) {
  if (request.job_id() != limits.job_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id: '", Echo(request.job_id()),
                     "' but this daemon serves '", limits.job_id, "'"));
  }
  if (request.groups().empty()) {
    return absl::InvalidArgumentError("groups: at least one group is needed");
  }
  RETURN_IF_ERROR(CheckParamGroupCount(request.groups_size()));
  RETURN_IF_ERROR(CheckNameLength(request.client_id(), "client_id"));
  auto reg = std::make_unique<Registration>();
  reg->client_id = request.client_id();
  ASSIGN_OR_RETURN(reg->regions, RegionTable::Map(request.regions(), opener));
  std::set<std::string> group_names, param_names;
  std::map<std::string, v1::Domain> domains;
  for (const v1::ParamGroup& group : request.groups()) {
    if (group.name().empty()) {
      return absl::InvalidArgumentError("groups: a group has an empty name");
    }
    RETURN_IF_ERROR(CheckNameLength(group.name(), "group name"));
    const std::string gname = Echo(group.name());
    RETURN_IF_ERROR(
        CheckNameLength(group.domain().name(),
                        absl::StrCat("group '", gname, "': domain.name")));
    if (group.domain().name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", gname,
                       "': domain.name is empty (it names the communicators)"));
    }
    if (group.params().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", gname, "': has no params"));
    }
    if (!group_names.insert(group.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("groups: duplicate group name '", gname, "'"));
    }
    if (group.algorithm() != v1::ALGORITHM_UNSPECIFIED &&
        group.algorithm() != v1::ALGORITHM_MUON &&
        group.algorithm() != v1::ALGORITHM_ADAMW) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", gname, "': unknown algorithm ", group.algorithm()));
    }
    RETURN_IF_ERROR(ValidateDomain(group, limits.world_size));
    auto [it, fresh] = domains.emplace(group.domain().name(), group.domain());
    if (!fresh &&
        it->second.SerializeAsString() != group.domain().SerializeAsString()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", gname, "': domain '", Echo(group.domain().name()),
          "' has different sizes or coordinates in another group"));
    }
    BoundGroup bound;
    bound.proto = group;
    bound.proto.clear_params();
    for (const v1::Param& p : group.params()) {
      if (p.name().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("group '", gname, "': a param has an empty name"));
      }
      RETURN_IF_ERROR(CheckNameLength(
          p.name(), absl::StrCat("group '", gname, "': param name")));
      const std::string pname = Echo(p.name());
      if (!param_names.insert(p.name()).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("param '", pname, "': duplicate param name"));
      }
      const std::vector<int64_t> local = Vec(p.param().shape());
      ASSIGN_OR_RETURN(std::vector<int64_t> expected,
                       ExpectedLocalShape(group, p, local));
      BoundParam bp;
      bp.name = p.name();
      bp.full_shape = Vec(p.full_shape());
      bp.local_shape = expected;
      bp.tags = FromProto(p.tags());
      ASSIGN_OR_RETURN(
          bp.param,
          reg->regions.View(p.param(), expected,
                            absl::StrCat("param '", pname, "' param")));
      ASSIGN_OR_RETURN(
          bp.grad, reg->regions.View(p.grad(), expected,
                                     absl::StrCat("param '", pname, "' grad")));
      reg->param_names.insert(bp.name);
      bound.params.push_back(std::move(bp));
      ++reg->num_params;
    }
    reg->groups.push_back(std::move(bound));
  }
  RETURN_IF_ERROR(CheckNoAliasing(Spans(*reg)));
  if (cancelled && cancelled()) {
    return absl::CancelledError(
        "the trainer disconnected during RegisterParams; nothing registered");
  }
  return reg;
}

bool RefusalEndsTheRound(const absl::Status& refusal,
                         const v1::RegisterParamsRequest& request,
                         const std::string& job_id) {
  if (request.job_id() != job_id) return false;
  switch (refusal.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kResourceExhausted:
      return true;
    default:
      return false;
  }
}

}  // namespace muond
