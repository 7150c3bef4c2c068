#pragma once
// Conversions between the wire types (muond.v1) and core types.
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/dtype.h"
#include "core/common/state_options.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"
#include "core/step/step_overrides.h"
#include "core/step/step_result.h"
#include "muond/v1/muond.pb.h"

namespace muond {

inline ShardTags FromProto(const v1::ShardTags& tags) {
  ShardTags out;
  out.tensor_model_parallel = tags.tensor_model_parallel();
  out.partition_dim = tags.partition_dim();
  out.is_gtp_weight_remat = tags.is_gtp_weight_remat();
  out.pad_length = tags.pad_length();
  out.gtp_rows.assign(tags.gtp_rows().begin(), tags.gtp_rows().end());
  return out;
}

inline v1::ShardTags ToProto(const ShardTags& tags) {
  v1::ShardTags out;
  out.set_tensor_model_parallel(tags.tensor_model_parallel);
  out.set_partition_dim(tags.partition_dim);
  out.set_is_gtp_weight_remat(tags.is_gtp_weight_remat);
  out.set_pad_length(tags.pad_length);
  for (int64_t rows : tags.gtp_rows) out.add_gtp_rows(rows);
  return out;
}

// dp_size 0 (unset: a domain without a DP axis) reads as 1.
inline int DpSizeOf(const v1::Domain& domain) {
  return domain.dp_size() == 0 ? 1 : domain.dp_size();
}

inline DomainSize DomainSizeOf(const v1::Domain& domain) {
  return DomainSize{domain.gtp_size(), domain.tp_size(), DpSizeOf(domain)};
}

// InvalidArgument naming `field` for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, const std::string& field);

// GetStatusResponse.state_bytes_by: location and dtype by their core names.
v1::StateBytes StateBytesToProto(const StateStorageBytes& bytes);

// The cost model (the Muon option enums: proto_convert_options.h). A wire
// value is named by the rule of wire_enum.h; FromProto: InvalidArgument
// naming `field` for COST_MODEL_UNSPECIFIED (callers resolve it first) and
// for numbers the enum does not define.
absl::StatusOr<CostModel> FromProto(v1::CostModel model,
                                    std::string_view field);
v1::CostModel ToProto(CostModel model);

inline v1::NsHome ToProto(const NsHome& home) {
  v1::NsHome out;
  out.set_g(home.g);
  out.set_t(home.t);
  out.set_d(home.d);
  return out;
}

inline NsHome FromProto(const v1::NsHome& home) {
  return {home.g(), home.t(), home.d()};
}

// A GroupPlan's homes, in order.
inline std::vector<NsHome> FromProto(
    const google::protobuf::RepeatedPtrField<v1::NsHome>& homes) {
  std::vector<NsHome> out;
  for (const v1::NsHome& h : homes) out.push_back(FromProto(h));
  return out;
}

// A step's phase times (microseconds), field for field.
v1::StepTimings ToProto(const PhaseTimings& timings);

// A StepRequest's overrides as the engine takes them: each set field of each
// GroupOverride. No check here: ParseOverrides (server/daemon/step_request.h)
// refuses an unknown group and a group named twice (before this map would
// keep the later one); the engine's CheckStepOverrides
// (core/step/step_overrides.h) is the one home of the value rules (known
// group, the field's algorithm, bounds).
StepOverrides FromProto(
    const google::protobuf::RepeatedPtrField<v1::GroupOverride>& overrides);

// One measured NS shape as {rows, cols}; the count saturates at INT32_MAX
// (the wire's int32).
v1::ShapeTiming ToProto(const ShapeTiming& timing);

// Plans the NS homes of one Muon group manifest (over its whole D x G x T
// domain: homes carry the replica d, rank_load one entry per flat domain rank
// (d * G + g) * T + t) with core/plan under
// `cost_model` (COST_MODEL_MEASURED: `measured`, per full-matrix shape {rows,
// cols}; UNSPECIFIED is refused: the coordinator resolves it). Errors name
// the param (from MakeShardSpec/PlanNsHomes) or the cost_model.
absl::StatusOr<v1::GroupPlan> PlanGroup(
    const v1::GroupManifest& manifest, v1::CostModel cost_model,
    const std::map<std::vector<int64_t>, double>& measured);

}  // namespace muond
