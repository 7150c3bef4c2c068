#include "server/common/proto_convert_options.h"

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

}  // namespace muond
