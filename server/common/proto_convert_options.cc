#include "server/common/proto_convert_options.h"

#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/muon/bounds.h"
#include "server/common/proto_convert.h"
#include "server/common/wire_enum.h"

namespace muond {

using wire_enum::CoreFromWire;
using wire_enum::WireFromCore;

absl::StatusOr<WeightDecayMethod> FromProto(v1::WeightDecayMethod method,
                                            std::string_view field) {
  return CoreFromWire<WeightDecayMethod>(*v1::WeightDecayMethod_descriptor(),
                                         method, field, ParseWeightDecayMethod);
}

absl::StatusOr<CoefficientType> FromProto(v1::CoefficientType type,
                                          std::string_view field) {
  return CoreFromWire<CoefficientType>(*v1::CoefficientType_descriptor(), type,
                                       field, ParseCoefficientType);
}

absl::StatusOr<ScaleMode> FromProto(v1::ScaleMode mode,
                                    std::string_view field) {
  return CoreFromWire<ScaleMode>(*v1::ScaleMode_descriptor(), mode, field,
                                 ParseScaleMode);
}

absl::StatusOr<MatmulPrecision> FromProto(v1::MatmulPrecision precision,
                                          std::string_view field) {
  return CoreFromWire<MatmulPrecision>(*v1::MatmulPrecision_descriptor(),
                                       precision, field, ParseMatmulPrecision);
}

absl::StatusOr<NsAlgorithm> FromProto(v1::NsAlgorithm algorithm,
                                      std::string_view field) {
  return CoreFromWire<NsAlgorithm>(*v1::NsAlgorithm_descriptor(), algorithm,
                                   field, ParseNsAlgorithm);
}

absl::StatusOr<DType> FromProto(v1::NsIterDType dtype, std::string_view field) {
  return CoreFromWire<DType>(*v1::NsIterDType_descriptor(), dtype, field,
                             ParseGramDType);
}

absl::StatusOr<DType> StateDTypeFromProto(v1::StateDType dtype,
                                          std::span<const DType> param_dtypes,
                                          std::string_view field) {
  if (dtype == v1::STATE_DTYPE_UNSPECIFIED) {
    return AutoStateDType(param_dtypes);
  }
  return CoreFromWire<DType>(*v1::StateDType_descriptor(), dtype, field,
                             ParseStateDType);
}

absl::StatusOr<StateLocation> FromProto(v1::StateLocation location,
                                        std::string_view field) {
  if (location == v1::STATE_LOCATION_UNSPECIFIED) return StateLocation::kDevice;
  return CoreFromWire<StateLocation>(*v1::StateLocation_descriptor(), location,
                                     field, ParseStateLocation);
}

v1::WeightDecayMethod ToProto(WeightDecayMethod method) {
  return WireFromCore<v1::WeightDecayMethod>(
      *v1::WeightDecayMethod_descriptor(), WeightDecayMethodName(method));
}

v1::CoefficientType ToProto(CoefficientType type) {
  return WireFromCore<v1::CoefficientType>(*v1::CoefficientType_descriptor(),
                                           CoefficientTypeName(type));
}

v1::ScaleMode ToProto(ScaleMode mode) {
  return WireFromCore<v1::ScaleMode>(*v1::ScaleMode_descriptor(),
                                     ScaleModeName(mode));
}

v1::MatmulPrecision ToProto(MatmulPrecision precision) {
  return WireFromCore<v1::MatmulPrecision>(*v1::MatmulPrecision_descriptor(),
                                           MatmulPrecisionName(precision));
}

v1::NsAlgorithm ToProto(NsAlgorithm algorithm) {
  return WireFromCore<v1::NsAlgorithm>(*v1::NsAlgorithm_descriptor(),
                                       NsAlgorithmName(algorithm));
}

v1::NsIterDType GramDTypeToProto(DType dtype) {
  return WireFromCore<v1::NsIterDType>(*v1::NsIterDType_descriptor(),
                                       DTypeName(dtype));
}

v1::StateDType StateDTypeToProto(DType dtype) {
  return WireFromCore<v1::StateDType>(*v1::StateDType_descriptor(),
                                      DTypeName(dtype));
}

v1::StateLocation ToProto(StateLocation location) {
  return WireFromCore<v1::StateLocation>(*v1::StateLocation_descriptor(),
                                         StateLocationName(location));
}

namespace {

absl::Status InGroup(const v1::ParamGroup& group, absl::Status st) {
  if (st.ok()) return st;
  return WithContext(st, absl::StrCat("group '", group.name(), "': "));
}

template <typename T>
absl::StatusOr<T> InGroup(const v1::ParamGroup& group,
                          absl::StatusOr<T> value) {
  if (value.ok()) return value;
  return InGroup(group, value.status());
}

// Coefficient `index` of custom_coefficients finite as a float32, checked
// before the fp32 cast (as eps) so that 1e300 is named as out of the fp32
// range, with the value as sent, not as the cast's "non-finite" inf.
absl::Status CheckCoefficientFloat32(double value, int index) {
  if (std::isfinite(value) && std::isfinite(static_cast<float>(value))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("custom_coefficients: tuple ", index / 3, " value ",
                   index % 3, " must be finite as a float32 (|value| <= ",
                   std::numeric_limits<float>::max(), "), got ", value));
}

// The dtypes of the group's params as the wire gives them (one the wire
// does not define counts as fp32: registration refuses it anyway).
std::vector<DType> ParamDTypesOf(const v1::ParamGroup& group) {
  std::vector<DType> dtypes;
  for (const v1::Param& p : group.params()) {
    dtypes.push_back(
        DTypeFromProto(p.param().dtype(), "dtype").value_or(DType::kFloat32));
  }
  return dtypes;
}

// state_dtype and state_location of either algorithm's hyperparameters.
template <typename Hyperparams, typename Options>
absl::Status SetStateStorage(const v1::ParamGroup& group, const Hyperparams& h,
                             std::span<const DType> param_dtypes, Options& o) {
  ASSIGN_OR_RETURN(
      o.state_dtype,
      InGroup(group, StateDTypeFromProto(h.state_dtype(), param_dtypes,
                                         "state_dtype")));
  ASSIGN_OR_RETURN(
      o.state_location,
      InGroup(group, FromProto(h.state_location(), "state_location")));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MuonOptions> MuonOptionsFromProto(const v1::ParamGroup& group) {
  return MuonOptionsFromProto(group, ParamDTypesOf(group));
}

absl::StatusOr<AdamWOptions> AdamWOptionsFromProto(
    const v1::ParamGroup& group) {
  return AdamWOptionsFromProto(group, ParamDTypesOf(group));
}

absl::StatusOr<MuonOptions> MuonOptionsFromProto(
    const v1::ParamGroup& group, std::span<const DType> param_dtypes) {
  const v1::MuonHyperparams& h = group.muon();
  MuonOptions o;
  o.lr = h.lr();
  o.momentum = h.momentum();
  o.nesterov = h.nesterov();
  o.weight_decay = h.weight_decay();
  // UNSPECIFIED enums and unset optional fields keep MuonOptions' defaults.
  if (h.weight_decay_method() != v1::WEIGHT_DECAY_METHOD_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.weight_decay_method,
                     InGroup(group, FromProto(h.weight_decay_method(),
                                              "weight_decay_method")));
  }
  if (h.coefficient_type() != v1::COEFFICIENT_TYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(
        o.ns.coefficient_type,
        InGroup(group, FromProto(h.coefficient_type(), "coefficient_type")));
  }
  if (h.custom_coefficients_size() % 3 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", group.name(), "': custom_coefficients has ",
        h.custom_coefficients_size(), " values, not a multiple of 3"));
  }
  for (int i = 0; i < h.custom_coefficients_size(); ++i) {
    RETURN_IF_ERROR(
        InGroup(group, CheckCoefficientFloat32(h.custom_coefficients(i), i)));
  }
  for (int i = 0; i + 2 < h.custom_coefficients_size(); i += 3) {
    o.ns.custom.push_back({float(h.custom_coefficients(i)),
                           float(h.custom_coefficients(i + 1)),
                           float(h.custom_coefficients(i + 2))});
  }
  if (h.has_num_ns_steps()) o.ns.num_steps = h.num_ns_steps();
  if (h.has_eps()) {
    // Checked before the fp32 cast so the message shows the value sent.
    RETURN_IF_ERROR(InGroup(group, CheckPositiveFloat32(h.eps(), "muon eps")));
    o.ns.eps = float(h.eps());
  }
  if (h.scale_mode() != v1::SCALE_MODE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.scale_mode,
                     InGroup(group, FromProto(h.scale_mode(), "scale_mode")));
  }
  if (h.has_extra_scale_factor()) {
    o.extra_scale_factor = h.extra_scale_factor();
  }
  // Unset: auto (batches by shape), the fastest path for any client.
  o.ns_batch_size = h.has_ns_batch_size() ? h.ns_batch_size() : 0;
  if (h.fp32_matmul_prec() != v1::MATMUL_PRECISION_UNSPECIFIED) {
    ASSIGN_OR_RETURN(
        o.ns.precision,
        InGroup(group, FromProto(h.fp32_matmul_prec(), "fp32_matmul_prec")));
  }
  o.ns.use_syrk = h.use_syrk();
  if (h.ns_algorithm() != v1::NS_ALGORITHM_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.ns.algorithm, InGroup(group, FromProto(h.ns_algorithm(),
                                                              "ns_algorithm")));
  }
  if (h.has_gram_restarts()) {
    o.ns.gram_restarts.emplace(h.gram_restarts().iterations().begin(),
                               h.gram_restarts().iterations().end());
  }
  if (h.gram_dtype() != v1::NS_ITER_DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(o.ns.gram_dtype,
                     InGroup(group, FromProto(h.gram_dtype(), "gram_dtype")));
  }
  if (h.has_gram_min_aspect_ratio()) {
    o.ns.gram_min_aspect_ratio = h.gram_min_aspect_ratio();
  }
  if (h.variant() != v1::MUON_VARIANT_UNSPECIFIED) {
    ASSIGN_OR_RETURN(
        o.variant,
        InGroup(group, wire_enum::CoreFromWire<MuonVariant>(
                           *v1::MuonVariant_descriptor(), h.variant(),
                           "variant", ParseMuonVariant)));
  }
  if (h.has_beta2()) o.beta2 = h.beta2();
  if (h.has_moment2_eps()) o.moment2_eps = h.moment2_eps();
  RETURN_IF_ERROR(SetStateStorage(group, h, param_dtypes, o));
  o.double_buffer_momentum = h.double_buffer_momentum();
  // Validate (ValidateGramOptions) names gram_restarts / gram_dtype /
  // gram_min_aspect_ratio and the rule.
  RETURN_IF_ERROR(InGroup(group, o.Validate()));
  return o;
}

absl::StatusOr<AdamWOptions> AdamWOptionsFromProto(
    const v1::ParamGroup& group, std::span<const DType> param_dtypes) {
  const v1::AdamWHyperparams& h = group.adamw();
  AdamWOptions o;
  o.lr = h.lr();
  if (h.has_beta1()) o.beta1 = h.beta1();
  if (h.has_beta2()) o.beta2 = h.beta2();
  if (h.has_eps()) o.eps = h.eps();
  o.weight_decay = h.weight_decay();
  RETURN_IF_ERROR(SetStateStorage(group, h, param_dtypes, o));
  RETURN_IF_ERROR(InGroup(group, o.Validate()));
  return o;
}

}  // namespace muond
