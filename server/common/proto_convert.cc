#include "server/common/proto_convert.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status_macros.h"
#include "server/common/wire_enum.h"

namespace muond {
namespace {

using wire_enum::CoreFromWire;
using wire_enum::WireFromCore;

absl::StatusOr<CostModel> ParseCostModelName(std::string_view name) {
  return ParseCostModel(name);
}

}  // namespace

absl::StatusOr<CostModel> FromProto(v1::CostModel model,
                                    std::string_view field) {
  return CoreFromWire<CostModel>(*v1::CostModel_descriptor(), model, field,
                                 ParseCostModelName);
}

v1::CostModel ToProto(CostModel model) {
  return WireFromCore<v1::CostModel>(*v1::CostModel_descriptor(),
                                     CostModelName(model));
}

v1::StateBytes StateBytesToProto(const StateStorageBytes& bytes) {
  v1::StateBytes out;
  out.set_location(std::string(StateLocationName(bytes.location)));
  out.set_dtype(std::string(DTypeName(bytes.dtype)));
  out.set_bytes(bytes.bytes);
  return out;
}

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype,
                                     const std::string& field) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return DType::kFloat32;
    case v1::DTYPE_BF16:
      return DType::kBFloat16;
    case v1::DTYPE_FP16:
      return DType::kFloat16;
    default:
      // A number the enum does not define has no name: show the number.
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": dtype '",
          v1::DType_IsValid(dtype) ? v1::DType_Name(dtype)
                                   : absl::StrCat(static_cast<int>(dtype)),
          "' is not supported (DTYPE_FP32, DTYPE_BF16 or DTYPE_FP16)"));
  }
}

StepOverrides FromProto(
    const google::protobuf::RepeatedPtrField<v1::GroupOverride>& overrides) {
  StepOverrides out;
  for (const v1::GroupOverride& o : overrides) {
    const std::string& g = o.group();
    if (o.has_lr()) out.lr[g] = o.lr();
    if (o.has_weight_decay()) out.weight_decay[g] = o.weight_decay();
    if (o.has_momentum()) out.momentum[g] = o.momentum();
    if (o.has_nesterov()) out.nesterov[g] = o.nesterov();
    if (o.has_beta1()) out.beta1[g] = o.beta1();
    if (o.has_beta2()) out.beta2[g] = o.beta2();
    if (o.has_eps()) out.eps[g] = o.eps();
  }
  return out;
}

v1::StepTimings ToProto(const PhaseTimings& timings) {
  v1::StepTimings out;
  out.set_momentum_us(timings.momentum_us);
  out.set_a2a_fwd_us(timings.a2a_fwd_us);
  out.set_ns_us(timings.ns_us);
  out.set_a2a_bwd_us(timings.a2a_bwd_us);
  out.set_dp_share_us(timings.dp_share_us);
  out.set_update_us(timings.update_us);
  out.set_total_us(timings.total_us);
  return out;
}

v1::ShapeTiming ToProto(const ShapeTiming& timing) {
  v1::ShapeTiming out;
  out.add_shape(timing.rows);
  out.add_shape(timing.cols);
  out.set_ns_us(timing.ns_us);
  out.set_count(int32_t(std::min<int64_t>(timing.count, INT32_MAX)));
  return out;
}

absl::StatusOr<v1::GroupPlan> PlanGroup(
    const v1::GroupManifest& manifest, v1::CostModel cost_model,
    const std::map<std::vector<int64_t>, double>& measured) {
  PlannerOptions options;
  ASSIGN_OR_RETURN(options.cost, FromProto(cost_model, "cost_model"));
  const DomainSize domain = DomainSizeOf(manifest.domain());
  std::vector<ParamShardSpec> specs;
  specs.reserve(manifest.params_size());
  for (const v1::ParamSpec& p : manifest.params()) {
    ASSIGN_OR_RETURN(
        ParamShardSpec spec,
        MakeShardSpec(p.name(),
                      std::vector<int64_t>(p.local_shape().begin(),
                                           p.local_shape().end()),
                      FromProto(p.tags()), domain, manifest.domain().g()));
    if (!std::equal(spec.full_shape.begin(), spec.full_shape.end(),
                    p.full_shape().begin(), p.full_shape().end())) {
      return absl::InvalidArgumentError(
          absl::StrCat("param '", p.name(),
                       "': full_shape does not follow from "
                       "local_shape, tags and the ",
                       domain.gtp, "x", domain.tp, " domain"));
    }
    specs.push_back(std::move(spec));
  }
  if (options.cost == kMeasured) {
    for (const auto& [shape, cost] : measured) {
      if (shape.size() == 2) options.measured_cost[{shape[0], shape[1]}] = cost;
    }
  }
  ASSIGN_OR_RETURN(HomePlan plan, PlanNsHomes(specs, domain, options));
  v1::GroupPlan out;
  out.set_group(manifest.group());
  for (const NsHome& h : plan.homes) *out.add_homes() = ToProto(h);
  for (double load : plan.rank_load) out.add_rank_load(load);
  out.set_max_over_mean(plan.max_over_mean);
  out.set_lower_bound_ratio(plan.lower_bound_ratio);
  return out;
}

}  // namespace muond
