#pragma once
// Conversions between the wire types (muond.v1) and core types.
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/common/dtype.h"
#include "core/muon/coefficients.h"
#include "core/muon/muon_update.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"
#include "core/step/layer_sharded_muon.h"
#include "muond/v1/muond.pb.h"

namespace muond {

inline ShardTags FromProto(const v1::ShardTags& tags) {
  ShardTags out;
  out.tensor_model_parallel = tags.tensor_model_parallel();
  out.partition_dim = tags.partition_dim();
  out.is_gtp_weight_remat = tags.is_gtp_weight_remat();
  out.pad_length = tags.pad_length();
  return out;
}

inline DomainSize DomainSizeOf(const v1::Domain& domain) {
  return DomainSize{domain.gtp_size(), domain.tp_size()};
}

// InvalidArgument naming `field` for DTYPE_UNSPECIFIED or an unknown value.
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, const std::string& field);

// The option enums. A wire value is named by its enum's prefix followed by
// the core name (ScaleModeName, ...) in upper case, so each pair below is the
// core Parse*/ *Name functions applied to the wire name; the clients follow
// the same rule (muond.torch, muonctl). FromProto: InvalidArgument naming
// `field` for *_UNSPECIFIED (callers test it first: it means the core
// default) and for numbers the enum does not define. ToProto never fails
// (tests/server/proto_convert_test checks every core value has a wire value).
absl::StatusOr<WeightDecayMethod> FromProto(v1::WeightDecayMethod method,
                                            std::string_view field);
absl::StatusOr<CoefficientType> FromProto(v1::CoefficientType type,
                                          std::string_view field);
absl::StatusOr<ScaleMode> FromProto(v1::ScaleMode mode, std::string_view field);
absl::StatusOr<MatmulPrecision> FromProto(v1::MatmulPrecision precision,
                                          std::string_view field);
absl::StatusOr<CostModel> FromProto(v1::CostModel model,
                                    std::string_view field);
v1::WeightDecayMethod ToProto(WeightDecayMethod method);
v1::CoefficientType ToProto(CoefficientType type);
v1::ScaleMode ToProto(ScaleMode mode);
v1::MatmulPrecision ToProto(MatmulPrecision precision);
v1::CostModel ToProto(CostModel model);

inline v1::NsHome ToProto(const NsHome& home) {
  v1::NsHome out;
  out.set_g(home.g);
  out.set_t(home.t);
  return out;
}

inline NsHome FromProto(const v1::NsHome& home) { return {home.g(), home.t()}; }

// A step's phase times (microseconds), field for field.
v1::StepTimings ToProto(const PhaseTimings& timings);

// One measured NS shape as {rows, cols}; the count saturates at INT32_MAX
// (the wire's int32).
v1::ShapeTiming ToProto(const ShapeTiming& timing);

// Plans the NS homes of one Muon group manifest with core/plan under
// `cost_model` (COST_MODEL_MEASURED: `measured`, per full-matrix shape {rows,
// cols}; UNSPECIFIED is refused: the coordinator resolves it). Errors name
// the param (from MakeShardSpec/PlanNsHomes) or the cost_model.
absl::StatusOr<v1::GroupPlan> PlanGroup(
    const v1::GroupManifest& manifest, v1::CostModel cost_model,
    const std::map<std::vector<int64_t>, double>& measured);

}  // namespace muond
