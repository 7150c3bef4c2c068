#include "server/coordinator/manifest_checks.h"

#include <algorithm>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status_macros.h"
#include "core/plan/sharding.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"
#include "server/common/checked_math.h"
#include "server/common/proto_convert.h"

namespace muond {
namespace {

std::string TagsString(const v1::ShardTags& t) {
  return absl::StrCat("{tensor_model_parallel=", t.tensor_model_parallel(),
                      ", partition_dim=", t.partition_dim(),
                      ", is_gtp_weight_remat=", t.is_gtp_weight_remat(),
                      ", pad_length=", t.pad_length(), ", gtp_rows=[",
                      absl::StrJoin(t.gtp_rows(), ", "), "]}");
}

bool SameShape(const google::protobuf::RepeatedField<int64_t>& a,
               const google::protobuf::RepeatedField<int64_t>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

bool SameTags(const v1::ShardTags& a, const v1::ShardTags& b) {
  return a.tensor_model_parallel() == b.tensor_model_parallel() &&
         a.partition_dim() == b.partition_dim() &&
         a.is_gtp_weight_remat() == b.is_gtp_weight_remat() &&
         a.pad_length() == b.pad_length() &&
         SameShape(a.gtp_rows(), b.gtp_rows());
}

// Empty when `a` (rank ra) and `b` (rank rb) describe the same params;
// otherwise the first difference, naming the param, both ranks and, for
// replicas of one (g, t), their replicas d.
std::string FirstParamDifference(const v1::GroupManifest& a, int ra,
                                 const v1::GroupManifest& b, int rb) {
  const bool replicas =
      a.domain().g() == b.domain().g() && a.domain().t() == b.domain().t();
  const std::string where = absl::StrCat(
      "group '", a.group(), "': rank ", ra, " and rank ", rb,
      replicas && a.domain().d() != b.domain().d()
          ? absl::StrCat(" (replicas d=", a.domain().d(),
                         " and d=", b.domain().d(), " of (g=", a.domain().g(),
                         ", t=", a.domain().t(), "))")
          : "");
  const int n = std::min(a.params_size(), b.params_size());
  for (int i = 0; i < n; ++i) {
    const v1::ParamSpec& pa = a.params(i);
    const v1::ParamSpec& pb = b.params(i);
    const std::string at =
        absl::StrCat(where, " differ at param #", i, " '", pa.name(), "'");
    if (pa.name() != pb.name()) {
      return absl::StrCat(at, ": name '", pa.name(), "' vs '", pb.name(), "'");
    }
    if (!SameShape(pa.full_shape(), pb.full_shape())) {
      return absl::StrCat(at, ": full_shape ", ShapeString(pa.full_shape()),
                          " vs ", ShapeString(pb.full_shape()));
    }
    // Uneven gtp_rows blocks differ by g: full_shape, tags and g imply the
    // local shape (each daemon checks it), so only replicas compare it.
    if (a.domain().g() == b.domain().g() &&
        !SameShape(pa.local_shape(), pb.local_shape())) {
      return absl::StrCat(at, ": local_shape ", ShapeString(pa.local_shape()),
                          " vs ", ShapeString(pb.local_shape()));
    }
    if (!SameTags(pa.tags(), pb.tags())) {
      return absl::StrCat(at, ": tags ", TagsString(pa.tags()), " vs ",
                          TagsString(pb.tags()));
    }
  }
  if (a.params_size() != b.params_size()) {
    const bool a_longer = a.params_size() > b.params_size();
    const v1::ParamSpec& extra = a_longer ? a.params(n) : b.params(n);
    return absl::StrCat(where, " differ at param #", n, " '", extra.name(),
                        "': only rank ", a_longer ? ra : rb, " has it (",
                        a.params_size(), " vs ", b.params_size(), " params)");
  }
  if (a.algorithm() != b.algorithm()) {
    return absl::StrCat(
        where, " differ in algorithm: ", v1::Algorithm_Name(a.algorithm()),
        " vs ", v1::Algorithm_Name(b.algorithm()));
  }
  return "";
}

std::string FieldText(const google::protobuf::Message& m,
                      const google::protobuf::FieldDescriptor* field);

// A message on one line: "{name: value, ...}" over its set fields, "{}" for
// none (TextFormat's own printing ends fields with newlines, which broke the
// disagreement message across lines).
std::string MessageText(const google::protobuf::Message& m) {
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  m.GetReflection()->ListFields(m, &fields);
  std::vector<std::string> parts;
  for (const google::protobuf::FieldDescriptor* f : fields) {
    parts.push_back(absl::StrCat(f->name(), ": ", FieldText(m, f)));
  }
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

// One field's value as text: "unset" for an unset field with presence, the
// elements in brackets for a repeated field, a message as MessageText.
std::string FieldText(const google::protobuf::Message& m,
                      const google::protobuf::FieldDescriptor* field) {
  const google::protobuf::Reflection* r = m.GetReflection();
  const bool is_message =
      field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE;
  std::string out, value;
  if (field->is_repeated()) {
    std::vector<std::string> items;
    for (int i = 0; i < r->FieldSize(m, field); ++i) {
      if (is_message) {
        items.push_back(MessageText(r->GetRepeatedMessage(m, field, i)));
        continue;
      }
      google::protobuf::TextFormat::PrintFieldValueToString(m, field, i,
                                                            &value);
      items.push_back(value);
    }
    return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
  }
  if (field->has_presence() && !r->HasField(m, field)) return "unset";
  if (is_message) return MessageText(r->GetMessage(m, field));
  google::protobuf::TextFormat::PrintFieldValueToString(m, field, -1, &out);
  return out;
}

// Empty when the hyperparameters `a` (rank ra) and `b` (rank rb) of `group`
// agree field by field, as on the wire; otherwise the first field that
// differs with both ranks' values. Generic over the message so a field added
// to MuonHyperparams/AdamWHyperparams is compared without a change here.
std::string FirstHyperparamDifference(const std::string& group,
                                      const google::protobuf::Message& a,
                                      int ra,
                                      const google::protobuf::Message& b,
                                      int rb) {
  const google::protobuf::Descriptor* d = a.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = d->field(i);
    const std::string va = FieldText(a, field), vb = FieldText(b, field);
    if (va == vb) continue;
    return absl::StrCat("group '", group, "': hyperparameter ", d->name(), ".",
                        field->name(), " differs between ranks: rank ", ra,
                        " has ", va, ", rank ", rb, " has ", vb,
                        "; every rank must register the group with the same "
                        "hyperparameters");
  }
  return "";
}

std::string GroupHyperparamDifference(const v1::GroupManifest& a, int ra,
                                      const v1::GroupManifest& b, int rb) {
  std::string diff =
      FirstHyperparamDifference(a.group(), a.muon(), ra, b.muon(), rb);
  if (diff.empty()) {
    diff = FirstHyperparamDifference(a.group(), a.adamw(), ra, b.adamw(), rb);
  }
  return diff;
}

// A shape from the wire: 1 or 2 dims (what the servers register), each
// >= 1, whose element count fits int64.
absl::Status CheckWireShape(const std::string& where, const char* field,
                            const google::protobuf::RepeatedField<int64_t>& s,
                            bool zero_rows_ok = false) {
  if (s.size() < 1 || s.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", field, " ", ShapeString(s), " must have 1 or 2 dims"));
  }
  std::optional<int64_t> elements = 1;
  for (int i = 0; i < s.size(); ++i) {
    const int64_t dim = s[i];
    if (dim == 0 && i == 0 && zero_rows_ok && s.size() == 2) continue;
    if (dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", field, " ", ShapeString(s), " has a dim < 1"));
    }
    if (elements) elements = CheckedMul(*elements, dim);
  }
  if (!elements) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", field, " ", ShapeString(s),
                     " has more elements than int64 holds"));
  }
  return absl::OkStatus();
}

absl::Status ValidateManifestShape(const v1::PublishManifestRequest& request) {
  std::set<std::string> groups;
  for (const v1::GroupManifest& g : request.groups()) {
    if (g.group().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", request.rank(), ": a group has an empty name"));
    }
    if (!groups.insert(g.group()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", request.rank(), ": group '", g.group(), "' appears twice"));
    }
    if (!v1::Algorithm_IsValid(g.algorithm())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", g.group(), "': algorithm: value ", g.algorithm(),
          " is not one of ALGORITHM_MUON, ALGORITHM_ADAMW (or unset)"));
    }
    const v1::Domain& d = g.domain();
    if (d.dp_size() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", g.group(), "': domain '", d.name(),
                       "': dp_size ", d.dp_size(), " must be >= 0 (0 = 1)"));
    }
    RETURN_IF_ERROR(CheckDomainCoordinates(
        DomainSizeOf(d), d.d(), d.g(), d.t(),
        absl::StrCat("group '", g.group(), "': domain '", d.name(), "'")));
    std::set<std::string> names;
    for (const v1::ParamSpec& p : g.params()) {
      if (p.name().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("group '", g.group(), "': a param has an empty name"));
      }
      if (!names.insert(p.name()).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "group '", g.group(), "': duplicate param name '", p.name(), "'"));
      }
      const std::string where = absl::StrCat("param '", p.name(), "'");
      RETURN_IF_ERROR(CheckWireShape(where, "full_shape", p.full_shape()));
      // 0 rows: an empty shard of uneven gtp_rows blocks.
      RETURN_IF_ERROR(
          CheckWireShape(where, "local_shape", p.local_shape(), true));
      if (p.local_shape_size() != p.full_shape_size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": local_shape ", ShapeString(p.local_shape()),
                         " and full_shape ", ShapeString(p.full_shape()),
                         " must have the same number of dims"));
      }
    }
  }
  return absl::OkStatus();
}

// "(g=0, t=1)", or "(d=1, g=0, t=1)" with a DP axis.
std::string CoordText(const v1::Domain& d) {
  return absl::StrCat("(",
                      DpSizeOf(d) > 1 ? absl::StrCat("d=", d.d(), ", ") : "",
                      "g=", d.g(), ", t=", d.t(), ")");
}

}  // namespace

std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// "GxT", or "DxGxT" with a DP axis: how messages name a domain's sizes.
std::string DomainText(const v1::Domain& d) {
  return absl::StrCat(DpSizeOf(d) > 1 ? absl::StrCat(DpSizeOf(d), "x") : "",
                      d.gtp_size(), "x", d.tp_size());
}

absl::Status CheckAgainstPeers(const Job& job,
                               const v1::PublishManifestRequest& request) {
  for (const v1::GroupManifest& mine : request.groups()) {
    for (const auto& [rank, daemon] : job.daemons) {
      if (rank == request.rank() || !daemon.has_manifest) continue;
      for (const v1::GroupManifest& theirs : daemon.manifest.groups()) {
        if (theirs.group() != mine.group()) continue;
        const v1::Domain& a = mine.domain();
        const v1::Domain& b = theirs.domain();
        if (a.name() != b.name() || a.gtp_size() != b.gtp_size() ||
            a.tp_size() != b.tp_size() || DpSizeOf(a) != DpSizeOf(b)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "group '", mine.group(), "': rank ", request.rank(),
              " has domain '", a.name(), "' ", DomainText(a), " but rank ",
              rank, " has '", b.name(), "' ", DomainText(b)));
        }
        if (a.g() == b.g() && a.t() == b.t() && a.d() == b.d()) {
          return absl::InvalidArgumentError(
              absl::StrCat("group '", mine.group(), "': ranks ", rank, " and ",
                           request.rank(), " both claim ", CoordText(a),
                           " of domain '", a.name(), "'"));
        }
        // The earlier rank is the reference, so messages read "rank 0 and
        // rank 1 differ".
        const std::string diff =
            rank < request.rank()
                ? FirstParamDifference(theirs, rank, mine, request.rank())
                : FirstParamDifference(mine, request.rank(), theirs, rank);
        if (!diff.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "manifest mismatch in domain '", a.name(), "': ", diff));
        }
        // The published rank is the reference, the later one is refused.
        const std::string hyper =
            GroupHyperparamDifference(theirs, rank, mine, request.rank());
        if (!hyper.empty()) return absl::InvalidArgumentError(hyper);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePublishFields(const v1::PublishManifestRequest& published,
                                   int64_t rebalance_activate_margin) {
  RETURN_IF_ERROR(ValidateManifestShape(published));
  for (const auto& [field, value] :
       {std::pair<const char*, int64_t>{"known_plan_version",
                                        published.known_plan_version()},
        {"last_step_id", published.last_step_id()}}) {
    if (value < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("manifest of rank ", published.rank(), ": ", field,
                       " must be >= 0, got ", value));
    }
  }
  if (published.known_plan_version() > kMaxPlanVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest of rank ", published.rank(),
                     ": known_plan_version ", published.known_plan_version(),
                     " exceeds kMaxPlanVersion ", kMaxPlanVersion));
  }
  // A restarted coordinator activates its first plan this far after it.
  if (!CheckedAdd(published.last_step_id(), rebalance_activate_margin)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest of rank ", published.rank(), ": last_step_id ",
        published.last_step_id(), " plus rebalance_activate_margin ",
        rebalance_activate_margin, " overflows int64"));
  }
  return absl::OkStatus();
}

}  // namespace muond
